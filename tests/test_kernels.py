"""Triton kernels and TritonBackend against ReferenceBackend (the oracle, run in float32).

Without CUDA the kernels run in Triton's CPU interpreter (TRITON_INTERPRET=1, set before triton
is imported); with CUDA they run compiled. Error: ‖out − ref‖ / ‖ref‖ below FP32_TOL for
float32 inputs and BF16_TOL for bfloat16 ones (ref computed in float32 from the same values).
"""

from __future__ import annotations

import os
import sys
from itertools import accumulate
from types import SimpleNamespace
from typing import Any

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
triton = pytest.importorskip("triton")

from batchgen.engine.attention import (  # noqa: E402
    AttentionMetadata,
    KVCache,
    LayerSpec,
    ReferenceBackend,
)
from batchgen.engine.attention.reference import write_kv_reference  # noqa: E402
from batchgen.engine.attention.triton import TritonBackend, TritonTuning  # noqa: E402
from batchgen.engine.kernels import (  # noqa: E402
    paged_decode,
    paged_prefill,
    plan_decode_splits,
    write_kv,
)

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
FP32_TOL = 1e-5
BF16_TOL = 1e-2
BLOCK = 16
DEVICES = [
    pytest.param("cpu", marks=pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET")),
    pytest.param("cuda", marks=pytest.mark.gpu),
]
DTYPES = [torch.float32, torch.bfloat16]


def _patch_interpreter() -> None:
    """Make Triton's CPU interpreter usable here; compiled kernels are unaffected.

    - torch imports triton before this module can set TRITON_INTERPRET, so triton.language's
      own @jit helpers (tl.max, tl.zeros, ...) were built for compiling: rewrap them;
    - range(start, end) over loaded scalars calls int() on a 1-element array (numpy >= 2.4
      refuses it);
    - tl.dot on bfloat16 multiplies the raw uint16 bits: convert them to float32 first (exact).
    """
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter as interp
    from triton.runtime.jit import JITFunction

    rewrapped: dict[int, Any] = {}
    for name, module in list(sys.modules.items()):
        if not name.startswith("triton.language") or module is None:
            continue
        for attr, value in list(vars(module).items()):
            if isinstance(value, JITFunction):
                fn = rewrapped.setdefault(id(value), interp.InterpretedFunction(value.fn))
                setattr(module, attr, fn)

    patch_tensor, create_dot = interp._patch_lang_tensor, interp.InterpreterBuilder.create_dot

    def patched_tensor(tensor: Any, scope: Any) -> None:
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    def as_f32(h: Any) -> Any:
        if h.dtype.scalar != tl.bfloat16:
            return h
        return interp.TensorHandle((h.data.astype(np.uint32) << 16).view(np.float32), tl.float32)

    def patched_dot(self: Any, a: Any, b: Any, *args: Any) -> Any:
        return create_dot(self, as_f32(a), as_f32(b), *args)

    interp._patch_lang_tensor = patched_tensor
    interp.InterpreterBuilder.create_dot = patched_dot


if INTERPRET:
    try:
        _patch_interpreter()
    except (AttributeError, ImportError) as e:  # the interpreter's internals moved
        pytest.skip(f"cannot adapt Triton's interpreter: {e}", allow_module_level=True)


def _device(name: str) -> torch.device:
    if name == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    return torch.device(name)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def tol(dtype: torch.dtype) -> float:
    return FP32_TOL if dtype == torch.float32 else BF16_TOL


def paged_setup(
    ctx_lens: list[int], kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device
) -> tuple[KVCache, torch.Tensor]:
    """Random caches (one layer) and [B, W] int32 tables scattering each sequence's blocks."""
    need = [triton.cdiv(c, BLOCK) for c in ctx_lens]
    num_blocks = sum(need) + 3  # spare blocks that no table points at
    shape = (num_blocks, BLOCK, kv_heads, head_dim)
    keys, values = (torch.randn(shape).to(dtype).to(device) for _ in range(2))
    tables = torch.full((len(ctx_lens), max(need, default=1) + 1), -1, dtype=torch.int32)
    free = torch.randperm(num_blocks).int()
    for i, n in enumerate(need):
        tables[i, :n], free = free[:n], free[n:]
    return KVCache([keys], [values]), tables.to(device)


def make_meta(
    cache: KVCache,
    tables: torch.Tensor,
    q_lens: list[int],
    ctx_lens: list[int],
    backend: Any,
    slot_mapping: torch.Tensor | None = None,
) -> AttentionMetadata:
    device = tables.device
    cu = [0, *accumulate(q_lens)]
    if slot_mapping is None:
        slot_mapping = torch.full((cu[-1],), -1, dtype=torch.int64, device=device)
    return AttentionMetadata(
        slot_mapping=slot_mapping,
        cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=device),
        context_lens=torch.tensor(ctx_lens, dtype=torch.int32, device=device),
        block_tables=tables,
        cu_seqlens_q_host=cu,
        context_lens_host=ctx_lens,
        max_query_len=max(q_lens),
        max_context_len=max(ctx_lens),
        num_decodes=next((i for i, n in enumerate(q_lens) if n != 1), len(q_lens)),  # leading
        kv_cache=cache,
        backend=backend,
    )


def reference(
    q: torch.Tensor,
    cache: KVCache,
    tables: torch.Tensor,
    q_lens: list[int],
    ctx_lens: list[int],
    **features: Any,
) -> torch.Tensor:
    """ReferenceBackend in float32 over the cache as it is (no KV write).
    features: window, chunk, softcap, sinks (as LayerSpec takes them)."""
    f32 = KVCache([cache.keys[0].float()], [cache.values[0].float()])
    backend = ReferenceBackend()
    meta = make_meta(f32, tables, q_lens, ctx_lens, backend)
    kv = torch.zeros(q.shape[0], cache.keys[0].shape[2], q.shape[2], device=q.device)
    spec = LayerSpec(scale=q.shape[-1] ** -0.5, **features)
    return backend.forward(0, q.float(), kv, kv, meta, spec)


def features_for(name: str, num_heads: int, dev: torch.device) -> dict[str, Any]:
    """Attention features by name: chunked mask, soft-capping, attention sinks."""
    if name == "chunk":
        return {"chunk": 8}
    if name == "softcap":
        return {"softcap": 0.3}  # small: the cap changes scores a lot
    if name == "sinks":
        return {"sinks": torch.linspace(-1.0, 2.0, num_heads, device=dev)}
    return {}


def strided_q(
    num_tokens: int, heads: int, head_dim: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """[T, H, D] view with a token stride of 2H * D (as sliced from a fused projection)."""
    return torch.randn(num_tokens, 2 * heads, head_dim).to(dtype).to(device)[:, :heads]


def poisoned(q: torch.Tensor, extra_rows: int = 2) -> torch.Tensor:
    """A NaN-filled output buffer with extra rows the kernels must not touch."""
    return torch.full((q.shape[0] + extra_rows, *q.shape[1:]), float("nan"), dtype=q.dtype,
                      device=q.device)  # fmt: skip


# ---------------------------------------------------------------------------------------- kv_write


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_write_kv_matches_reference_and_skips_padding(device: str, dtype: torch.dtype) -> None:
    dev = _device(device)
    cache, _ = paged_setup([40], kv_heads=2, head_dim=64, dtype=dtype, device=dev)
    kc, vc = cache.keys[0], cache.values[0]
    kc_ref, vc_ref = kc.clone(), vc.clone()
    fused = torch.randn(7, 6, 64).to(dtype).to(dev)  # k, v: strided views of one projection
    k, v = fused[:, 1:3], fused[:, 4:6]
    slots = torch.tensor([3, -1, 17, 47, -1, 16, 0], device=dev)
    write_kv(k, v, kc, vc, slots)
    write_kv_reference(kc_ref, vc_ref, k, v, slots)
    assert torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref)  # padding rows left untouched


# ------------------------------------------------------------------------------------------ decode


def _check_decode(
    dev: torch.device,
    dtype: torch.dtype,
    ctx_lens: list[int],
    heads: tuple[int, int, int],
    window: int | None = None,
    features: dict[str, Any] | None = None,
    **kwargs: Any,
) -> None:
    num_heads, kv_heads, head_dim = heads
    features = {"window": window, **(features or {})}
    cache, tables = paged_setup(ctx_lens, kv_heads, head_dim, dtype, dev)
    q = strided_q(len(ctx_lens), num_heads, head_dim, dtype, dev)
    out = poisoned(q)
    lens = torch.tensor(ctx_lens, dtype=torch.int32, device=dev)
    paged_decode(q, cache.keys[0], cache.values[0], tables, lens, head_dim**-0.5,
                 out=out, **features, **kwargs)  # fmt: skip
    ref = reference(q, cache, tables, [1] * len(ctx_lens), ctx_lens, **features)
    assert out[len(ctx_lens) :].isnan().all()
    assert not out[: len(ctx_lens)].isnan().any()
    assert rel_err(out[: len(ctx_lens)], ref) < tol(dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "heads", [(2, 2, 64), (4, 1, 128), (8, 1, 64), (4, 2, 80)], ids=["g1", "g4", "g8", "g2-d80"]
)
def test_decode_block_boundaries(device: str, dtype: torch.dtype, heads: tuple) -> None:
    _check_decode(_device(device), dtype, [1, 15, 16, 17, 32, 33], heads, block_n=16)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("num_splits", "min_partition"), [(3, 16), (13, 16), (5, 32)])
def test_decode_many_splits(device: str, num_splits: int, min_partition: int) -> None:
    """Short contexts leave splits empty (they exit, the combine skips them)."""
    _check_decode(_device(device), torch.float32, [1, 16, 50, 100, 200], (4, 1, 64),
                  num_splits=num_splits, min_partition=min_partition, block_n=16)  # fmt: skip


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("window", "num_splits"), [(5, 1), (16, 3), (17, 8)])
def test_decode_sliding_window(device: str, window: int, num_splits: int) -> None:
    _check_decode(_device(device), torch.bfloat16, [1, 5, 17, 40, 70], (4, 2, 64),
                  window=window, num_splits=num_splits, min_partition=16, block_n=16)  # fmt: skip


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("feature", ["chunk", "softcap", "sinks"])
@pytest.mark.parametrize("num_splits", [1, 4])
def test_decode_attention_features(device: str, feature: str, num_splits: int) -> None:
    """Chunked masks, soft-capped scores and sinks, with and without KV splits."""
    dev = _device(device)
    _check_decode(dev, torch.float32, [1, 7, 8, 9, 40, 70], (4, 2, 64),
                  features=features_for(feature, 4, dev), num_splits=num_splits,
                  min_partition=16, block_n=16)  # fmt: skip


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_empty_context_gives_zeros(device: str, num_splits: int) -> None:
    dev = _device(device)
    cache, tables = paged_setup([20, 0], 1, 64, torch.float32, dev)
    q = torch.randn(2, 2, 64, device=dev)
    lens = torch.tensor([20, 0], dtype=torch.int32, device=dev)
    out = paged_decode(q, cache.keys[0], cache.values[0], tables, lens, 0.125,
                       num_splits=num_splits, min_partition=16, block_n=16)  # fmt: skip
    assert torch.equal(out[1], torch.zeros_like(out[1])) and out[0].abs().sum() > 0


def test_plan_decode_splits_from_shapes() -> None:
    assert plan_decode_splits(256, 8, 4608, target_programs=528) == 1
    assert plan_decode_splits(8, 8, 4608, target_programs=528) == 9
    assert plan_decode_splits(1, 8, 4608, target_programs=528) == 18  # >= 256 keys each
    assert plan_decode_splits(1, 8, 131072, target_programs=528, max_splits=64) == 64


# ----------------------------------------------------------------------------------------- prefill


def _check_prefill(
    dev: torch.device,
    dtype: torch.dtype,
    heads: tuple[int, int, int],
    window: int | None,
    block_m: int,
    features: dict[str, Any] | None = None,
    cache_dtype: torch.dtype | None = None,
) -> None:
    """A decode row first (skipped via first_seq=1), then chunks with and without prior context.
    dtype: q's and, unless cache_dtype is given, the cache's."""
    num_heads, kv_heads, head_dim = heads
    features = {"window": window, **(features or {})}
    q_lens, ctx_lens = [1, 5, 16, 20, 33, 1], [9, 5, 16, 36, 50, 3]
    cache, tables = paged_setup(ctx_lens, kv_heads, head_dim, cache_dtype or dtype, dev)
    q = strided_q(sum(q_lens), num_heads, head_dim, dtype, dev)
    out = poisoned(q)
    cu = torch.tensor([0, *accumulate(q_lens)], dtype=torch.int32, device=dev)
    lens = torch.tensor(ctx_lens, dtype=torch.int32, device=dev)
    paged_prefill(q, cache.keys[0], cache.values[0], tables, cu, lens, head_dim**-0.5,
                  num_tokens=sum(q_lens) - 1, first_seq=1, out=out,
                  block_m=block_m, block_n=16, **features)  # fmt: skip
    ref = reference(q, cache, tables, q_lens, ctx_lens, **features)
    assert out[0].isnan().all() and out[len(q) :].isnan().all()
    assert not out[1 : len(q)].isnan().any()
    assert rel_err(out[1 : len(q)], ref[1:]) < tol(dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", [(4, 1, 128), (4, 4, 64)], ids=["g4-d128", "g1-d64"])
def test_prefill_chunks_with_prior_context(device: str, dtype: torch.dtype, heads: tuple) -> None:
    _check_prefill(_device(device), dtype, heads, window=None, block_m=16)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("window", "block_m"), [(7, 16), (16, 32)])
def test_prefill_sliding_window(device: str, window: int, block_m: int) -> None:
    _check_prefill(_device(device), torch.bfloat16, (4, 2, 64), window, block_m)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("feature", ["chunk", "softcap", "sinks"])
def test_prefill_attention_features(device: str, feature: str) -> None:
    dev = _device(device)
    _check_prefill(dev, torch.float32, (4, 2, 64), None, 16, features_for(feature, 4, dev))


# ----------------------------------------------------------------------------------------- backend


SMALL_TILES = TritonTuning(
    decode_block_n=16, decode_8bit_block_n=16, decode_min_partition=16, prefill_block_n=16
)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    ("dtype", "window", "tuning"),
    [(torch.float32, None, None), (torch.bfloat16, 12, None), (torch.bfloat16, None, SMALL_TILES)],
    ids=["fp32", "bf16-window", "bf16-split"],
)
def test_backend_mixed_batch_matches_reference(
    device: str, dtype: torch.dtype, window: int | None, tuning: TritonTuning | None
) -> None:
    """Decodes first, then prefill chunks; K/V arrive as strided views and are written first."""
    dev = _device(device)
    q_lens, ctx_lens = [1, 1, 1, 5, 20, 17], [1, 17, 40, 5, 36, 17]
    num_heads, kv_heads, head_dim = 8, 2, 64
    cache, tables = paged_setup(ctx_lens, kv_heads, head_dim, dtype, dev)
    ref_cache = KVCache([cache.keys[0].float()], [cache.values[0].float()])
    positions = [p for n, c in zip(q_lens, ctx_lens, strict=True) for p in range(c - n, c)]
    seq = [i for i, n in enumerate(q_lens) for _ in range(n)]
    pos = torch.tensor(positions, device=dev)
    slots = tables[torch.tensor(seq, device=dev), pos // BLOCK].long() * BLOCK + pos % BLOCK
    qkv = torch.randn(len(seq), num_heads + 2 * kv_heads, head_dim).to(dtype).to(dev)
    q, k, v = qkv.split([num_heads, kv_heads, kv_heads], dim=1)
    backend = TritonBackend(tuning)
    meta = make_meta(cache, tables, q_lens, ctx_lens, backend, slots)
    spec = LayerSpec(scale=head_dim**-0.5, window=window)
    out = backend.forward(0, q, k, v, meta, spec)
    ref_meta = make_meta(ref_cache, tables, q_lens, ctx_lens, ReferenceBackend(), slots)
    ref = ReferenceBackend().forward(0, q.float(), k.float(), v.float(), ref_meta, spec)
    assert torch.equal(cache.keys[0].float(), ref_cache.keys[0])
    assert torch.equal(cache.values[0].float(), ref_cache.values[0])
    assert rel_err(out, ref) < tol(dtype)
    assert backend.plan(meta) is backend.plan(meta)
    plan = backend.plan(meta)
    assert (plan.num_decodes, plan.num_prefills, plan.num_prefill_tokens) == (3, 3, 42)
    assert (plan.num_splits > 1) == (tuning is SMALL_TILES)  # the split + combine path ran


def test_mismatched_heads_raise() -> None:
    cache, tables = paged_setup([4], 3, 64, torch.float32, torch.device("cpu"))
    q = torch.randn(1, 4, 64)
    with pytest.raises(ValueError, match="num_heads"):
        paged_decode(q, cache.keys[0], cache.values[0], tables, torch.tensor([4]).int(), 1.0)


# -- fused elementwise ops against the Hugging Face modules they replace -------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_ops_match_hf_modules(device: str, dtype: torch.dtype) -> None:
    from transformers.models.llama.modeling_llama import (
        LlamaRMSNorm,
        apply_rotary_pos_emb,
    )

    from batchgen.engine.kernels.fused_ops import rms_norm, silu_mul
    from batchgen.engine.kernels.rotary import rope, rope_qk

    torch.manual_seed(0)
    tol = FP32_TOL if dtype == torch.float32 else BF16_TOL
    x = torch.randn(1, 5, 48, device=device, dtype=dtype)
    norm = LlamaRMSNorm(48, eps=1e-5).to(device, dtype)
    norm.weight.data.normal_()
    ref = norm(x)
    exact = dtype == torch.float32 and device == "cpu"  # same op order as PyTorch's CPU path
    assert _rel(rms_norm(x, norm.weight, 1e-5), ref) <= (0 if exact else tol)
    gate, up = torch.randn(2, 5, 96, device=device, dtype=dtype).unbind(0)
    ref = torch.nn.functional.silu(gate) * up
    assert _rel(silu_mul(gate, up), ref) <= tol
    angles = torch.randn(1, 5, 16, device=device)
    cos = torch.cat([angles.cos(), angles.cos()], -1).to(dtype)
    sin = torch.cat([angles.sin(), angles.sin()], -1).to(dtype)
    for q_heads, k_heads in ((4, 2), (19, 9)):  # programs take 8 heads: partial and full blocks
        q = torch.randn(1, 5, q_heads, 32, device=device, dtype=dtype).transpose(1, 2)
        k = torch.randn(1, 5, k_heads, 32, device=device, dtype=dtype).transpose(1, 2)
        q_ref, k_ref = apply_rotary_pos_emb(q, k, cos, sin)  # [1, H, T, D]
        assert _rel(rope(q, cos, sin), q_ref) <= tol and _rel(rope(k, cos, sin), k_ref) <= tol
        q_out, k_out = rope_qk(q, k, cos, sin)  # one launch for both
        assert torch.equal(q_out, rope(q, cos, sin)) and torch.equal(k_out, rope(k, cos, sin))
        assert _rel(q_out, q_ref) <= tol and _rel(k_out, k_ref) <= tol


def rope_kv_case(
    q_heads: int, kv_heads: int, dim: int, dtype: torch.dtype, cache_dtype: torch.dtype, dev: Any
) -> dict[str, Any]:
    """q, k, v as strided views of one projection's rows (as the fused attention splits
    them), cos/sin, one layer's caches and slots with padding (-1) among them."""
    torch.manual_seed(1)
    tokens = 7
    fused = torch.randn(tokens, (q_heads + 2 * kv_heads) * dim).to(dtype).to(dev)
    q, k, v = fused.split([q_heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    angles = torch.randn(1, tokens, dim // 2, device=dev)
    cache, _ = paged_setup([40], kv_heads=kv_heads, head_dim=dim, dtype=dtype, device=dev)
    return {
        "q": q.view(tokens, q_heads, dim),
        "k": k.view(tokens, kv_heads, dim),
        "v": v.view(tokens, kv_heads, dim),
        "cos": torch.cat([angles.cos(), angles.cos()], -1).to(dtype),
        "sin": torch.cat([angles.sin(), angles.sin()], -1).to(dtype),
        "k_cache": cache.keys[0].to(cache_dtype),
        "v_cache": cache.values[0].to(cache_dtype),
        "slot_mapping": torch.tensor([3, -1, 17, 47, -1, 16, 0], device=dev),
    }


def check_rope_write_kv(case: dict[str, Any]) -> None:
    """rope_write_kv is rope_qk then write_kv, bit for bit: the rotated q it returns and both
    caches, where padding tokens' slots stay untouched."""
    from batchgen.engine.kernels.rotary import rope_qk, rope_write_kv

    c = dict(case)
    kc_ref, vc_ref = c["k_cache"].clone(), c["v_cache"].clone()
    q_ref, k_rot = rope_qk(c["q"].transpose(0, 1)[None], c["k"].transpose(0, 1)[None],
                           c["cos"], c["sin"])  # fmt: skip
    write_kv(k_rot[0].transpose(0, 1), c["v"], kc_ref, vc_ref, c["slot_mapping"],
             c.get("kv_scales"))  # fmt: skip
    q_out = rope_write_kv(**c)
    assert q_out.shape == c["q"].shape and torch.equal(q_out, q_ref[0].transpose(0, 1))
    for got, want in ((c["k_cache"], kc_ref), (c["v_cache"], vc_ref)):
        assert got.view(torch.uint8).equal(want.view(torch.uint8))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", [(4, 2, 32), (19, 9, 64)], ids=["partial", "full+partial"])
def test_rope_write_kv_is_rope_then_write_kv(device: str, dtype: torch.dtype, heads: tuple) -> None:
    q_heads, kv_heads, dim = heads  # programs take 8 heads: partial and full blocks
    check_rope_write_kv(rope_kv_case(q_heads, kv_heads, dim, dtype, dtype, _device(device)))


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


@pytest.mark.parametrize("device", DEVICES)
def test_merged_gate_up_mlp_matches_the_module(device: str) -> None:
    """The fused MLP forward: one gate/up GEMM whose rows the Linear modules keep as views."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaMLP

    from batchgen.engine.fusion import Fusion

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=32, intermediate_size=80)
    mlp = LlamaMLP(config).to(device)
    x = torch.randn(1, 7, 32, device=device)
    expected = mlp(x)
    holder = torch.nn.Sequential(mlp)
    fusion = Fusion(holder)
    fusion.on()
    assert fusion.modules == [mlp]
    base = mlp.gate_proj.weight.untyped_storage().data_ptr()
    assert mlp.up_proj.weight.untyped_storage().data_ptr() == base, "up is a view of the merge"
    assert _rel(mlp(x), expected) <= FP32_TOL
    fusion.off()
    assert torch.equal(mlp(x), expected), "the module's own forward, on the same values"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_is_the_add_then_the_norm(device: str, dtype: torch.dtype) -> None:
    """One pass gives residual + x as torch's add stores it and the norm of that stored sum,
    bit for bit what the two ops give separately (and the same FP8 rows)."""
    from batchgen.engine.kernels.fused_ops import add_rms_norm, rms_norm
    from batchgen.engine.quant.fp8 import _FP8_ROWS

    torch.manual_seed(0)
    dev = _device(device)
    x = torch.randn(1, 6, 96, device=dev, dtype=dtype)
    residual = torch.randn(1, 6, 96, device=dev, dtype=dtype) * 30.0
    weight = torch.randn(96, device=dev, dtype=dtype)
    total, normed = add_rms_norm(x, residual, weight, 1e-5)
    assert total.dtype == dtype
    if dev.type == "cpu" and dtype != torch.float32:  # the interpreter rounds bf16 its own way
        assert (
            _rel(total, residual + x) <= BF16_TOL
            and _rel(normed, rms_norm(total, weight, 1e-5)) <= BF16_TOL
        )
        return
    assert torch.equal(total, residual + x)
    assert torch.equal(normed, rms_norm(residual + x, weight, 1e-5))
    if dtype == torch.bfloat16:
        _, quantized = add_rms_norm(x, residual, weight, 1e-5, quantize=True)
        rows = getattr(quantized, _FP8_ROWS)
        expected = getattr(rms_norm(residual + x, weight, 1e-5, quantize=True), _FP8_ROWS)
        assert torch.equal(rows[1], expected[1])
        assert torch.equal(rows[0].view(torch.uint8), expected[0].view(torch.uint8))


@pytest.mark.parametrize("device", DEVICES)
def test_fused_decoder_layer_matches_the_layers_own_forward(device: str) -> None:
    """In a batchgen step the fused layer adds each residual inside the RMSNorm after it; the
    add after the MLP goes with the next norm, whose result rides on the layer's output and is
    taken by that norm. Outside a step the layer runs its own forward. (Attention stands in as
    a projection here: the layer's plumbing is under test, not attention.)"""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    from batchgen.engine import fusion as fu
    from batchgen.engine.kernels import fused_ops

    class Attention(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = torch.nn.Linear(32, 32)

        def forward(self, hidden_states, **kwargs):
            assert kwargs["position_embeddings"] == "pe"  # the layer's keywords reach it
            return self.proj(hidden_states), None

    torch.manual_seed(0)
    dev = _device(device)
    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_attention_heads=2)
    layers = torch.nn.ModuleList([LlamaDecoderLayer(config, i) for i in range(2)])
    for layer in layers:
        layer.self_attn = Attention()
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            norm.weight.data.normal_()
    final = type(layers[0].input_layernorm)(32, eps=1e-5)
    final.weight.data.normal_()
    layers.to(dev)
    final.to(dev)
    x = torch.randn(1, 5, 32, device=dev)
    expected = [layers[0](x, position_embeddings="pe")]
    expected.append(layers[1](expected[0], position_embeddings="pe"))
    expected.append(final(expected[1]))
    for norm in (
        final,
        *(n for lay in layers for n in (lay.input_layernorm, lay.post_attention_layernorm)),
    ):
        norm.forward = fu._norm_forward(norm, fused_ops.rms_norm)
    for layer, after in zip(layers, (layers[1].input_layernorm, final), strict=True):
        layer.forward = fu._layer_forward(
            layer,
            after,
            (False, False),
            fused_ops.add_rms_norm,
        )
    got = [layers[0](x, position_embeddings="pe", batchgen_meta=object())]
    got.append(layers[1](got[0], position_embeddings="pe", batchgen_meta=object()))
    assert getattr(got[1], fu._NORMED)[0] is final
    got.append(final(got[1]))  # taken from the layer's output, not computed again
    assert got[2] is getattr(got[1], fu._NORMED)[1]
    for a, b in zip(got, expected, strict=True):
        assert _rel(a, b) <= FP32_TOL
    own = layers[0](x, position_embeddings="pe")  # outside a step: the layer's own forward
    assert not hasattr(own, fu._NORMED) and _rel(own, expected[0]) <= FP32_TOL


def test_fusion_pairs_each_decoder_layer_with_the_norm_after_it(model_dir) -> None:
    """Each fused layer's last add goes with the next layer's input norm, the last layer's
    with the model's final norm; off() gives every layer its own forward back."""
    from transformers import AutoModelForCausalLM

    from batchgen.engine.fusion import Fusion

    path = model_dir("llama", hidden_size=64, intermediate_size=128, num_hidden_layers=3)
    model = AutoModelForCausalLM.from_pretrained(path)
    fusion = Fusion(model)
    fusion.on()
    layers = list(model.model.layers)
    after = [layers[1].input_layernorm, layers[2].input_layernorm, model.model.norm]
    assert fusion._fused_layers() == list(zip(layers, after, strict=True))
    assert all("forward" in layer.__dict__ for layer in layers)
    fusion.off()
    assert not any("forward" in layer.__dict__ for layer in layers)


@pytest.mark.parametrize("device", DEVICES)
def test_rope_check_keeps_the_models_own_rotary_where_it_differs(device: str) -> None:
    """Interleaved rotary (GPT-J style) is not rotate-half: the check must notice."""
    import types

    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    from batchgen.engine.fusion import RopeCheck

    def interleaved(q, k, cos, sin):
        def rot(x):
            pairs = x.unflatten(-1, (-1, 2))
            return torch.stack((-pairs[..., 1], pairs[..., 0]), -1).flatten(-2)

        c, s = (
            cos[:, None, :, ::2].repeat_interleave(2, -1),
            sin[:, None, :, ::2].repeat_interleave(2, -1),
        )
        return q * c + rot(q) * s, k * c + rot(k) * s

    q = torch.randn(1, 5, 4, 32, device=device).transpose(1, 2)
    k = torch.randn(1, 5, 2, 32, device=device).transpose(1, 2)
    angles = torch.randn(1, 5, 16, device=device)
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    same = RopeCheck(types.SimpleNamespace(apply_rotary_pos_emb=apply_rotary_pos_emb))
    assert _rel(same(q, k, cos, sin)[0], apply_rotary_pos_emb(q, k, cos, sin)[0]) <= FP32_TOL
    assert same.verified is True
    other = RopeCheck(types.SimpleNamespace(apply_rotary_pos_emb=interleaved))
    for _ in range(2):
        got = other(q, k, cos, sin)
        assert torch.equal(got[0], interleaved(q, k, cos, sin)[0])
    assert other.verified is False


@pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET")
@pytest.mark.parametrize(
    ("family", "backend"),
    [(f, "reference") for f in ("llama", "mistral", "qwen2", "qwen3")]
    + [(f, "triton") for f in ("llama", "qwen3")],  # ~35 s each in the interpreter
)
def test_fused_layers_generate_what_the_model_does(family: str, backend: str, tmp_path) -> None:
    """Fused norms, merged q/k/v and gate/up GEMMs and the fused rotary, in Triton's CPU
    interpreter: the same greedy tokens as the engine on the model's own modules. The Triton
    backend rotates q and k with its KV write (after the first call's check); the reference
    one gets them rotated."""
    from batchgen import Engine, EngineConfig, SamplingParams
    from batchgen.engine.attention import attention_scope
    from batchgen.engine.fusion import Fusion
    from tests.families import build_family_model

    path = build_family_model(family, tmp_path / family)
    prompts = [[5 + i, 17, 33 + 2 * i, 9, 41] * (1 + i) for i in range(3)]  # window 16 reached
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    config = EngineConfig(device="cpu", dtype="float32", attention_backend=backend)
    engine = Engine(path, config)
    expected = {o.request_id: o.output_token_ids for o in engine.generate(prompts, params)}
    fusion = Fusion(engine.model)
    fusion.on()
    if backend == "triton":  # every call after the first goes to the fused KV write
        calls = []
        fused = engine.runner.backend.kernels.rope_write_kv
        engine.runner.backend.kernels = SimpleNamespace(
            **{**vars(engine.runner.backend.kernels),
               "rope_write_kv": lambda *a: calls.append(1) or fused(*a)}
        )  # fmt: skip
    names = {type(m).__name__ for m in fusion.modules}
    assert any(n.endswith("Attention") for n in names) and any(n.endswith("MLP") for n in names)
    got = {o.request_id: o.output_token_ids for o in engine.generate(prompts, params)}
    assert fusion.rope.verified is True
    assert got == expected
    if backend == "triton":
        assert calls
    ids = torch.tensor([prompts[2]])
    with attention_scope(engine.model, "eager"):  # outside a step: the modules' own attention
        outside = engine.model(input_ids=ids, use_cache=False).logits
        fusion.off()
        own = engine.model(input_ids=ids, use_cache=False).logits
    assert _rel(outside, own) <= FP32_TOL


def test_host_cdiv_and_next_power_of_2_equal_tritons() -> None:
    """The launch wrappers' plain-Python grid helpers give what Triton's (constexpr functions,
    ~2 us per call from host code) give, for every value the wrappers can pass."""
    from batchgen.engine.kernels.launch import cdiv, next_power_of_2

    for n in [*range(0, 4200), 2**20 - 1, 2**20, 2**20 + 1, 2**31 - 1, 2**31]:
        assert next_power_of_2(n) == triton.next_power_of_2(n), n
    for a in range(0, 600):
        for b in (1, 2, 3, 7, 8, 16, 63, 64, 128, 1024):
            assert cdiv(a, b) == triton.cdiv(a, b), (a, b)


@pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET")
def test_steps_padded_to_graph_shapes_generate_what_the_model_does(model_dir) -> None:
    """Every step padded as the step graphs pad it (decode sizes; token sizes for steps with
    prefill chunks, whose decode count the attention reads on the device), run through the
    Triton backend in the interpreter: the greedy tokens of Hugging Face's generate."""
    from batchgen import Engine, EngineConfig, SamplingParams
    from tests.helpers import EagerPadding, hf_greedy, random_prompts

    path = model_dir("llama")
    prompts = random_prompts(5, 3, 26, 1000, seed=17)
    config = EngineConfig(
        device="cpu", dtype="float32", attention_backend="triton", max_num_seqs=3,
        max_num_batched_tokens=12, block_size=8, enable_prefix_caching=False,
    )  # fmt: skip
    engine = Engine(path, config)
    graphs = engine.runner.graphs = EagerPadding(engine.runner, (2,), tokens=(6, 12))
    backend, mixed = engine.runner.backend, []
    make_plan = backend._make_plan

    def plan(meta):  # a padded step's plan: from its shape only (what a capture sees)
        got, nd = make_plan(meta), meta.num_decodes
        if meta.decode_context_lens is None:
            return got
        T, B = meta.slot_mapping.shape[0], meta.context_lens.shape[0]
        assert got[:5] == (min(T, B), got.num_splits, 0, B, T)
        assert got.prefill_block_m == backend.tuning.prefill_block_m
        if 0 < nd < B - 1:  # the device-side views of a step with decodes and prefills
            lens, cu = meta.context_lens_host, meta.cu_seqlens_q_host
            assert meta.decode_context_lens.tolist() == lens[:nd] + [0] * (B - nd)
            assert meta.prefill_cu_seqlens.tolist() == [nd] * (nd + 1) + cu[nd + 1 :]
            mixed.append(nd)
        return got

    backend._make_plan = plan
    params = SamplingParams(max_new_tokens=7, ignore_eos=True)
    got = {o.request_id: o.output_token_ids for o in engine.generate(prompts, params)}
    shaped = [pad for pad in graphs.replays if pad[1] == 4]  # Pad(T, max_num_seqs + 1, 3)
    assert {pad[0] for pad in shaped} == {6, 12} and (2, 2, 2) in graphs.replays
    assert mixed, "no padded step had both decode rows and prefill chunks"
    for i, prompt in enumerate(prompts):
        assert got[str(i)] == hf_greedy(path, prompt, 7), f"request {i}"
