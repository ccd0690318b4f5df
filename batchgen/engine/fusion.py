"""Faster forwards for the modules of known Hugging Face decoder layers, set per module
instance (the model object only; nothing inside transformers is replaced).

- RMSNorm: one fused kernel; where its output goes straight into a merged FP8 projection,
  the same pass writes the FP8 rows that projection would quantize the output to.
- Gated-SiLU MLP: gate and up projections as one GEMM, SiLU-and-mul fused (writing the FP8
  rows of its result too where the down projection is FP8).
- Attention (Llama, Mistral, Qwen2, Qwen3): q, k and v projections as one GEMM, then
  batchgen's attention, which rotates q and k (rotary embedding) in the kernel that writes k
  and v into the cache. Whether that rotation computes what the modeling file's own
  `apply_rotary_pos_emb` does is not assumed: the first call computes both and compares them
  (interleaved or partial rotary differ), and where they differ the model's own function is
  used for good.

- Decoder layer (those families, where its norms, attention and MLP are all fused): the
  residual add after attention and the post-attention RMSNorm as one kernel, and the add after
  the MLP with the next layer's input RMSNorm (or the model's final norm) as one kernel, whose
  normed result travels attached to the layer's output until that norm takes it.

Merged projections are one weight tensor whose rows the original Linear modules keep as views
(no extra memory; the values do not change); FP8 layers merge their weights and per-channel
scales likewise (per-token activation scales depend only on the shared input, so the merged
GEMM computes what the separate ones do). Outside a batchgen step (a caller running its own
model meanwhile) the attention runs the module's own forward. Models of other families run
unchanged.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from batchgen.engine.attention.hf_adapter import batchgen_attention, in_step
from batchgen.engine.quant.fp8 import (
    Fp8Linear,
    activations_unquantized,
    fp8_linear,
    fp8_rows_linear,
)

FUSED_NORMS = ("LlamaRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm", "MistralRMSNorm")
FUSED_MLPS = ("LlamaMLP", "Qwen2MLP", "Qwen3MLP", "MistralMLP")
# pre-norm layers: norm -> attention -> add -> norm -> MLP -> add, nothing else
FUSED_LAYERS = (
    "LlamaDecoderLayer",
    "Qwen2DecoderLayer",
    "Qwen3DecoderLayer",
    "MistralDecoderLayer",
)
LAYER_PARTS = ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")
SILU = ("SiLU", "SiLUActivation")  # torch's and transformers' (5.2x) SiLU modules
# (norm, the module its output goes to unchanged) in the decoder layers of the fused families
FEEDS = (("input_layernorm", "self_attn"), ("post_attention_layernorm", "mlp"))
# attention class -> the sliding window its forward passes to the attention function
FUSED_ATTENTION: dict[str, Callable[[nn.Module], int | None]] = {
    "LlamaAttention": lambda m: None,
    "MistralAttention": lambda m: getattr(m.config, "sliding_window", None),
    "Qwen2Attention": lambda m: getattr(m, "sliding_window", None),
    "Qwen3Attention": lambda m: getattr(m, "sliding_window", None),
}


Merged = Callable[[torch.Tensor], torch.Tensor]  # one linear standing for several Linears


class Fusion:
    """The fused forwards of one model: on() sets them, off() gives the modules back theirs."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.rope = RopeCheck(sys.modules.get(type(model).__module__))
        self.modules: list[nn.Module] = []
        # merged projections by the module that uses them (kept when off() and on() again)
        self._merged: dict[nn.Module, Merged | None] = {}
        self._fp8_merged: list[Merged] = []  # those with FP8 weights

    def on(self) -> None:
        from batchgen.engine.kernels import fused_ops

        for module in self.model.modules():
            forward = self._forward(module, type(module).__name__, fused_ops)
            if forward is not None:
                module.forward = forward
                self.modules.append(module)
        feeding = self._norms_feeding_fp8()
        for norm in feeding:  # they also write their FP8 rows
            norm.forward = _norm_forward(norm, fused_ops.rms_norm, quantize=True)
        for layer, next_norm in self._fused_layers():
            fp8 = (layer.post_attention_layernorm in feeding, next_norm in feeding)
            layer.forward = _layer_forward(layer, next_norm, fp8, fused_ops.add_rms_norm)
            self.modules.append(layer)

    def _fused_layers(self) -> list[tuple[nn.Module, nn.Module | None]]:
        """(layer, the norm its output goes to) for the decoder layers of FUSED_LAYERS whose
        parts all run fused here; the norm is the next layer's input norm (the model's final
        norm after the last layer) where that is fused too, else None."""
        found = []
        for stack_owner in self.model.modules():
            for stack in stack_owner.children():
                if not isinstance(stack, nn.ModuleList):
                    continue
                layers = list(stack)
                final = getattr(stack_owner, "norm", None)
                for i, layer in enumerate(layers):
                    if not self._fusable(layer):
                        continue
                    after = layers[i + 1] if i + 1 < len(layers) else None
                    if after is None:
                        next_norm = final if final in self.modules else None
                    else:
                        next_norm = after.input_layernorm if self._fusable(after) else None
                    found.append((layer, next_norm))
        return found

    def _fusable(self, layer: nn.Module) -> bool:
        return type(layer).__name__ in FUSED_LAYERS and all(
            getattr(layer, part, None) in self.modules for part in LAYER_PARTS
        )

    def _norms_feeding_fp8(self) -> list[nn.Module]:
        """Fused norms of decoder layers whose output goes straight into a merged FP8
        projection (the layer's attention or MLP as fused here)."""
        feeding = []
        for layer in self.model.modules():
            for norm_name, user_name in FEEDS:
                norm, user = getattr(layer, norm_name, None), getattr(layer, user_name, None)
                if (
                    norm in self.modules
                    and user in self.modules
                    and self._merged.get(user) in self._fp8_merged
                ):
                    feeding.append(norm)
        return feeding

    def off(self) -> None:
        for module in self.modules:
            module.__dict__.pop("forward", None)
        self.modules = []

    def _forward(self, module: nn.Module, name: str, ops: Any) -> Callable[..., Any] | None:
        if name in FUSED_NORMS and hasattr(module, "variance_epsilon"):
            return _norm_forward(module, ops.rms_norm)
        if name in FUSED_MLPS and type(getattr(module, "act_fn", None)).__name__ in SILU:
            merged = self._merge(module, ("gate_proj", "up_proj"))
            return _mlp_forward(module, ops, merged)
        if (
            name in FUSED_ATTENTION
            and self.rope.original is not None
            and all(hasattr(module, a) for a in ("q_proj", "k_proj", "v_proj", "o_proj"))
            and isinstance(getattr(module, "head_dim", None), int)
        ):
            merged = self._merge(module, ("q_proj", "k_proj", "v_proj"))
            return _attention_forward(module, self.rope, merged, FUSED_ATTENTION[name](module))
        return None

    def _merge(self, module: nn.Module, names: tuple[str, ...]) -> Merged | None:
        if module not in self._merged:
            self._merged[module] = merged = _merged(module, names)
            if merged is not None and all(type(getattr(module, n)) is Fp8Linear for n in names):
                self._fp8_merged.append(merged)
        return self._merged[module]


def _merged(module: nn.Module, names: tuple[str, ...]) -> Merged | None:
    """One linear over the children `names` (outputs concatenated); each child's tensors
    become row views of the merged ones. None where they cannot be merged."""
    linears = [getattr(module, n) for n in names]
    if all(type(x) is Fp8Linear for x in linears):
        return _merged_fp8(linears)
    if not all(type(x) is nn.Linear for x in linears):
        return None
    weight, bias = _concat(linears, "weight")
    if weight is None:
        return None
    return lambda x: F.linear(x, weight, bias)


def _merged_fp8(linears: list[Fp8Linear]) -> Merged | None:
    """FP8 weights [sum(out), in] with their per-channel scales concatenated likewise."""
    weight, bias = _concat(linears, "weight")
    if weight is None:
        return None
    scale, _ = _concat(linears, "weight_scale")
    return lambda x: fp8_linear(x, weight, scale, bias)


def _concat(linears: list[nn.Module], name: str) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Concatenate each child's `name` tensor (and its bias) along rows and make the children's
    tensors views of the result. (None, None) where shapes, dtypes or biases disagree."""
    parts = [getattr(x, name) for x in linears]
    if len({(p.dtype, p.device, p.shape[1:]) for p in parts}) != 1:
        return None, None
    has_bias = [x.bias is not None for x in linears]
    if any(has_bias) and not all(has_bias):
        return None, None
    with_bias = all(has_bias) and name == "weight"
    with torch.no_grad():
        # bytes, not values: cat has no float8 kernel on every device
        merged = torch.cat([p.detach().view(torch.uint8) for p in parts]).view(parts[0].dtype)
        bias = torch.cat([x.bias.detach() for x in linears]) if with_bias else None
        start = 0
        for x, part in zip(linears, parts, strict=True):
            rows = part.shape[0]
            _set_view(x, name, merged[start : start + rows])
            if bias is not None:
                x.bias.data = bias[start : start + rows]
            start += rows
    return merged, bias


def _set_view(module: nn.Module, name: str, view: torch.Tensor) -> None:
    if isinstance(getattr(module, name), nn.Parameter):
        getattr(module, name).data = view
    else:  # a buffer (Fp8Linear's weight and scale)
        setattr(module, name, view)


# attribute of a decoder layer's output: (the norm it goes to, that norm's result on it)
_NORMED = "_batchgen_normed"


def _norm_forward(
    module: nn.Module, kernel: Any, quantize: bool = False
) -> Callable[..., torch.Tensor]:
    def forward(hidden_states: torch.Tensor) -> torch.Tensor:
        done = getattr(hidden_states, _NORMED, None)
        if done is not None and done[0] is module:  # computed with the add that made the input
            return done[1]
        return kernel(hidden_states, module.weight, module.variance_epsilon, quantize)

    return forward


def _layer_forward(
    layer: nn.Module,
    next_norm: nn.Module | None,
    fp8: tuple[bool, bool],
    add_rms_norm: Any,
) -> Callable[..., Any]:
    """The pre-norm decoder layer with each residual add fused into the RMSNorm after it;
    fp8: whether the post-attention norm and next_norm write FP8 rows."""
    post = layer.post_attention_layernorm
    post_fp8, next_fp8 = fp8

    def forward(*args: Any, **kwargs: Any) -> Any:
        if len(args) > 1 or (kwargs.get("batchgen_meta") is None and not in_step()):
            return type(layer).forward(layer, *args, **kwargs)  # the caller's own forward
        hidden = args[0] if args else kwargs.pop("hidden_states")
        h, _ = layer.self_attn(hidden_states=layer.input_layernorm(hidden), **kwargs)
        hidden, h = add_rms_norm(h, hidden, post.weight, post.variance_epsilon, post_fp8)
        h = layer.mlp(h)
        if next_norm is None:
            return hidden + h
        eps = next_norm.variance_epsilon
        out, normed = add_rms_norm(h, hidden, next_norm.weight, eps, next_fp8)
        setattr(out, _NORMED, (next_norm, normed))
        return out

    return forward


def _mlp_forward(module: nn.Module, ops: Any, merged: Merged | None) -> Callable[..., torch.Tensor]:
    down = module.down_proj
    down_fp8 = type(down) is Fp8Linear  # it takes the FP8 rows SiLU-and-mul writes

    def forward(x: torch.Tensor) -> torch.Tensor:
        if merged is None:
            return down(ops.silu_mul(module.gate_proj(x), module.up_proj(x)))
        if down_fp8 and not activations_unquantized():  # no 16-bit SiLU-and-mul result
            rows, scale = ops.silu_mul_fp8(merged(x))
            out = fp8_rows_linear(rows, scale, down.weight, down.weight_scale, down.bias, x.dtype)
            return out.view(*x.shape[:-1], out.shape[-1])
        return down(ops.silu_mul_merged(merged(x), quantize=down_fp8))

    return forward


def _attention_forward(
    module: nn.Module,
    rope: RopeCheck,
    merged: Merged | None,
    window: int | None,
) -> Callable[..., tuple[torch.Tensor, Any]]:
    head_dim = module.head_dim
    sizes = [getattr(module, n).out_features for n in ("q_proj", "k_proj", "v_proj")]
    q_norm, k_norm = getattr(module, "q_norm", None), getattr(module, "k_norm", None)
    extra = {} if window is None else {"sliding_window": window}

    def forward(
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        attention_mask: torch.Tensor | None = None,
        *args: Any,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, Any]:
        if kwargs.get("batchgen_meta") is None and not in_step():  # the caller's own forward
            own = type(module).forward
            return own(module, hidden_states, position_embeddings, attention_mask, *args, **kwargs)
        tokens = hidden_states.shape[:-1]  # [1, T]
        if merged is not None:
            q, k, v = merged(hidden_states).split(sizes, dim=-1)
        else:
            q, k, v = (getattr(module, n)(hidden_states) for n in ("q_proj", "k_proj", "v_proj"))
        q, k, v = (t.view(*tokens, -1, head_dim) for t in (q, k, v))  # [1, T, heads, D]
        if q_norm is not None and k_norm is not None:
            q, k = q_norm(q), k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        rotary = {}
        if rope.deferrable(q, k, *position_embeddings):  # rotated with the KV write
            rotary = {"rotary": position_embeddings}
        else:
            q, k = rope(q, k, *position_embeddings)
        out, _ = batchgen_attention(
            module, q, k, v.transpose(1, 2), None, scaling=module.scaling, **extra, **rotary,
            **kwargs,
        )  # fmt: skip
        return module.o_proj(out.reshape(*tokens, -1)), None

    return forward


class RopeCheck:
    """The fused rotary kernel where it equals the modeling file's apply_rotary_pos_emb
    (compared on the first call), else that function itself."""

    def __init__(self, modeling: Any) -> None:
        self.original = getattr(modeling, "apply_rotary_pos_emb", None)
        self.verified: bool | None = None  # None: not compared yet

    def _fits(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor) -> bool:
        return cos.shape[-1] == q.shape[-1] and q.shape[0] == 1 and q.dtype == k.dtype

    def deferrable(
        self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> bool:
        """Whether the attention may rotate q and k itself (the kernels' rotation, compared
        with the model's own function already, applies to them)."""
        return self.verified is True and self._fits(q, k, cos)

    def __call__(
        self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        from batchgen.engine.kernels.rotary import rope_qk

        if self.verified is False or not self._fits(q, k, cos):
            return self.original(q, k, cos, sin)
        fused = rope_qk(q, k, cos, sin)
        if self.verified is None:
            expected = self.original(q, k, cos, sin)
            self.verified = _close(fused, expected)
            if not self.verified:
                return expected
        return fused


def _close(got: tuple[torch.Tensor, ...], expected: Any) -> bool:
    if not isinstance(expected, tuple) or len(expected) != len(got):
        return False
    for a, b in zip(got, expected, strict=True):
        if not isinstance(b, torch.Tensor) or a.shape != b.shape:
            return False
        tol = 1e-5 if a.dtype == torch.float32 else 2e-2
        if not torch.allclose(a.float(), b.float(), rtol=tol, atol=tol):
            return False
    return True
