"""batchgen's attention as a transformers attention function, and the per-step context it reads.

Models run unchanged: the registered function receives each layer's q/k/v, writes k/v into the
paged cache and attends over it with the step's metadata. The metadata comes through the
forward's kwargs (`batchgen_meta`) or, for layers that do not pass kwargs on, from the step
context the runner opens around its forward pass. An audit context records what each layer
asks for, so a model that needs something batchgen does not implement is refused up front.
"""

from __future__ import annotations

import contextlib
import contextvars
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from batchgen.engine.attention.base import AttentionMetadata, LayerSpec

ATTENTION_NAME = "batchgen"
# kwargs an attention function may receive that batchgen implements or that change nothing
HANDLED_KWARGS = frozenset(
    {"batchgen_meta", "sliding_window", "softcap", "s_aux", "scaling", "dropout", "rotary"}
)
HARMLESS_KWARGS = frozenset(
    {"position_ids", "cache_position", "use_cache", "output_attentions", "return_dict"}
)

_STEP: contextvars.ContextVar[AttentionMetadata | None] = contextvars.ContextVar(
    "batchgen_step", default=None
)
_AUDIT: contextvars.ContextVar[Audit | None] = contextvars.ContextVar(
    "batchgen_audit", default=None
)
# each attention module's LayerSpec, computed on its first call (dropped with the module)
_SPECS: weakref.WeakKeyDictionary[torch.nn.Module, LayerSpec] = weakref.WeakKeyDictionary()


@contextlib.contextmanager
def step_context(meta: AttentionMetadata) -> Iterator[None]:
    """The step whose metadata layers that do not pass kwargs on should use."""
    token = _STEP.set(meta)
    try:
        yield
    finally:
        _STEP.reset(token)


def in_step() -> bool:
    """True inside a batchgen step's forward pass."""
    return _STEP.get() is not None


def step_metadata() -> AttentionMetadata | None:
    """The metadata of the step whose forward pass is running, None outside one."""
    return _STEP.get()


@dataclass
class Audit:
    """What the layers asked of batchgen's attention while an audit was open."""

    layers: set[int] = field(default_factory=set)
    unsupported: dict[str, str] = field(default_factory=dict)  # kwarg -> the module's class

    def record(self, module: torch.nn.Module, kwargs: dict[str, Any]) -> None:
        self.layers.add(getattr(module, "layer_idx", -1))
        for key, value in kwargs.items():
            if key in HANDLED_KWARGS or key in HARMLESS_KWARGS or value is None:
                continue
            if key == "is_causal" and value is True:
                continue
            if value is False:
                continue
            self.unsupported.setdefault(key, type(module).__name__)


@contextlib.contextmanager
def attention_audit() -> Iterator[Audit]:
    audit = Audit()
    token = _AUDIT.set(audit)
    try:
        yield audit
    finally:
        _AUDIT.reset(token)


def layer_spec(
    module: torch.nn.Module, head_dim: int, scaling: float | None, kwargs: dict[str, Any]
) -> LayerSpec:
    """What this layer computes, as the model's own mask and kwargs define it.

    Where the config lists layer types, they decide the mask (as transformers' mask functions
    do); otherwise the sliding window the layer passes or holds.
    """
    config = getattr(module, "config", None)
    kinds = getattr(config, "layer_types", None)
    layer = getattr(module, "layer_idx", None)
    window = chunk = None
    if isinstance(kinds, (list, tuple)) and layer is not None and layer < len(kinds):
        kind = kinds[layer]
        if kind == "sliding_attention":
            window = getattr(config, "sliding_window", None)
        elif kind == "chunked_attention":
            chunk = getattr(config, "attention_chunk_size", None)
    else:
        window = kwargs.get("sliding_window") or getattr(module, "sliding_window", None)
    sinks = kwargs.get("s_aux")
    return LayerSpec(
        scale=scaling if scaling is not None else head_dim**-0.5,
        window=window,
        chunk=chunk,
        softcap=kwargs.get("softcap"),
        sinks=None if sinks is None else sinks.detach().float(),
    )


def batchgen_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers attention interface. query: [1, H, T, Dk], key: [1, Hkv, T, Dk],
    value: [1, Hkv, T, Dv] -> ([1, T, H, Dv], None). batchgen's fused layers may pass
    rotary=(cos, sin) with query and key not yet rotated (rotate-half): a backend that fuses
    the rotation with its KV write gets them so, any other gets them rotated here."""
    meta: AttentionMetadata | None = kwargs.get("batchgen_meta") or _STEP.get()
    if meta is None:
        raise RuntimeError("batchgen attention called outside a batchgen step: run through Engine")
    audit = _AUDIT.get()
    if audit is not None:
        audit.record(module, kwargs)
    spec = _SPECS.get(module)
    if spec is None:  # what a layer computes is fixed for its life: worked out once
        spec = _SPECS[module] = layer_spec(module, query.shape[-1], scaling, kwargs)
    width = meta.kv_cache.keys[0].shape[-1]
    rotary = kwargs.get("rotary")
    if rotary is not None and not (
        getattr(meta.backend, "fuses_rotary", False) and query.shape[-1] == width
    ):
        from batchgen.engine.kernels.rotary import rope_qk

        query, key = rope_qk(query, key, *rotary)
        rotary = None
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [T, heads, dim]
    dv = v.shape[-1]
    if q.shape[-1] < width:  # narrower heads than the cache (values of latent attention)
        q, k = F.pad(q, (0, width - q.shape[-1])), F.pad(k, (0, width - k.shape[-1]))
    if dv < width:
        v = F.pad(v, (0, width - dv))
    fused = {} if rotary is None else {"rotary": rotary}
    out = meta.backend.forward(module.layer_idx, q, k, v, meta, spec, **fused)
    return out[None, ..., :dv], None  # [1, T, H, Dv]


def register() -> None:
    """Make attn_implementation="batchgen" available to every transformers model."""
    AttentionInterface.register(ATTENTION_NAME, batchgen_attention)


@contextlib.contextmanager
def attention_scope(model: torch.nn.Module, name: str = ATTENTION_NAME) -> Iterator[None]:
    """Run `model` with attention implementation `name` for the block, then give it back its
    own (on the model's config and every sub-config)."""
    configs = _configs(model.config)
    previous = [c._attn_implementation_internal for c in configs]
    for config in configs:
        config._attn_implementation_internal = name
    try:
        yield
    finally:
        for config, value in zip(configs, previous, strict=True):
            config._attn_implementation_internal = value


def _configs(config: Any) -> list[Any]:
    out, todo = [], [config]
    while todo:
        current = todo.pop()
        if current is None or any(current is c for c in out):
            continue
        out.append(current)
        todo.extend(getattr(current, key, None) for key in getattr(current, "sub_configs", {}))
    return out
