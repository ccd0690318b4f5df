"""FP8 kernels: per-token activation quantization, the FP8 GEMM, the FP8 KV write and paged
decode and prefill reading an FP8 cache. In Triton's CPU interpreter without CUDA, compiled
with CUDA.

The interpreter's float32 -> float8 cast does not round to nearest (124.4 becomes 64), so on
the CPU the quantization kernel is checked up to the cast (its float32 output: amax, scale,
division, clamp) and torch casts; the kernels' own casts (quantization, KV write) are checked
on the GPU only. Reading an FP8 cache (the cast up) the interpreter does correctly."""

from __future__ import annotations

# first: it sets TRITON_INTERPRET (no CUDA) before anything loads triton's kernels; later
# modules' interpreted kernels fail ("0 active drivers") otherwise
from tests import test_kernels as tk  # isort: split

import os
import subprocess
import sys

import pytest
import torch

from batchgen.engine.attention.reference import write_kv_reference
from batchgen.engine.kernels import paged_decode, write_kv
from batchgen.engine.kernels.fp8_gemm import GemmConfig, fp8_gemm, gemm_config
from batchgen.engine.kernels.fp8_quant import (
    launch_quantize_rows,
    quantize_rows_triton,
)
from batchgen.engine.quant.fp8 import (
    FP8_DTYPE,
    FP8_MAX,
    _fp8_product,
    quantize_rows_reference,
    quantize_weight,
)

DEVICES = tk.DEVICES


def _rows() -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(5, 4096 + 96, generator=generator).bfloat16()  # two loops of one block
    x[1] *= 300.0  # rows of very different ranges
    x[2] = 0.0  # an all-zero row stays zero
    x[3, 7] = -5000.0  # an outlier sets its row's scale
    return x


@pytest.mark.parametrize("device", DEVICES)
def test_quantize_rows_kernel_before_the_cast(device: str) -> None:
    dev = tk._device(device)
    x = _rows()
    scaled = torch.empty(x.shape, dtype=torch.float32, device=dev)
    s = torch.empty(x.shape[0], dtype=torch.float32, device=dev)
    launch_quantize_rows(x.to(dev), scaled, s)
    q_ref, s_ref = quantize_rows_reference(x)
    torch.testing.assert_close(s.cpu(), s_ref, rtol=1e-6, atol=0)
    assert abs(scaled[3, 7] + FP8_MAX) < 1e-3 and (scaled[2] == 0).all()
    assert scaled.abs().max() <= FP8_MAX
    cast = scaled.cpu().to(FP8_DTYPE)
    # rare: a division one ulp off. On CUDA Triton's division is approximate: one FP8 step at
    # most, on 0.19% of these values in the H200 run (test_quantize_rows_kernel_casts_like_torch
    # holds the GPU to its own torch reference)
    codes = (cast.view(torch.uint8).int() - q_ref.view(torch.uint8).int()).abs()
    exact = 0.999 if dev.type == "cpu" else 0.99
    assert codes.max() <= 1 and (codes == 0).float().mean() > exact


@pytest.mark.gpu
def test_quantize_rows_kernel_casts_like_torch() -> None:
    """The kernel's cast is torch's CUDA cast of its own scaled values, bit for bit; its
    division (Triton's approximate float32 one) moves a value by at most one FP8 step from
    torch's on the same device. (The CPU's torch was the reference before: the H200 run
    failed here while [300, 4096] rows against a CUDA reference matched exactly.)"""
    x = _rows().cuda()
    q, s = quantize_rows_triton(x)
    scaled = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    launch_quantize_rows(x, scaled, torch.empty_like(s))
    q_ref, s_ref = quantize_rows_reference(x)  # torch, on the GPU
    assert q.dtype == FP8_DTYPE
    torch.testing.assert_close(s, s_ref, rtol=1e-6, atol=0)
    assert q.view(torch.uint8).equal(scaled.to(FP8_DTYPE).view(torch.uint8)), "the cast"
    codes = (q.view(torch.uint8).int() - q_ref.view(torch.uint8).int()).abs()  # same sign
    bad = (codes > 1).nonzero().tolist()
    assert not bad, f"{len(bad)} values more than one FP8 step off, e.g. (row, col) {bad[:5]}"
    assert (codes == 0).float().mean() > 0.999, f"{int((codes > 0).sum())} values one step off"


@pytest.mark.gpu  # the interpreter's cast to float8 is not torch's (see above)
def test_write_kv_fp8_saturates_like_reference() -> None:
    dev = torch.device("cuda")
    cache, _ = tk.paged_setup([40], kv_heads=2, head_dim=64, dtype=FP8_DTYPE, device=dev)
    kc, vc = cache.keys[0], cache.values[0]
    kc_ref, vc_ref = kc.clone(), vc.clone()
    k, v = torch.randn(2, 7, 2, 64, dtype=torch.bfloat16).to(dev)
    k[0, 0, 0] = 1000.0  # beyond E4M3's range: stored as 448, never NaN
    slots = torch.tensor([3, -1, 17, 47, -1, 16, 0], device=dev)
    write_kv(k, v, kc, vc, slots)
    write_kv_reference(kc_ref, vc_ref, k, v, slots)
    assert kc.view(torch.uint8).equal(kc_ref.view(torch.uint8))
    assert vc.view(torch.uint8).equal(vc_ref.view(torch.uint8))
    assert kc.float().view(-1, 2, 64)[3, 0, 0] == FP8_MAX


@pytest.mark.gpu  # the interpreter's cast to float8 is not torch's (see above)
def test_rope_write_kv_into_fp8_cache_is_rope_then_write_kv() -> None:
    case = tk.rope_kv_case(19, 9, 64, torch.bfloat16, FP8_DTYPE, torch.device("cuda"))
    case["k"][0, 0, 0] = case["v"][0, 1, 5] = 1000.0  # beyond E4M3's range: saturated
    tk.check_rope_write_kv(case)


def test_fp8_cache_values_never_nan() -> None:
    """What an FP8 cache stores: saturated at +-448, NaN as 0 (the cache never holds NaN)."""
    from batchgen.engine.quant.fp8 import fp8_cache_values

    x = torch.tensor([float("nan"), 1000.0, -1000.0, 1.0, float("inf")])
    assert fp8_cache_values(x).float().tolist() == [0.0, FP8_MAX, -FP8_MAX, 1.0, FP8_MAX]
    assert fp8_cache_values(x, 0.5).float().tolist()[:4] == [0.0, FP8_MAX, -FP8_MAX, 2.0]


@pytest.mark.gpu  # the interpreter's cast to float8 is not torch's (see above)
def test_fp8_kv_writes_store_nan_as_zero() -> None:
    """write_kv and rope_write_kv store a NaN key or value as 0, as the reference does, bit
    for bit: decode's TMA copies read whole blocks and rely on a cache without NaN."""
    dev = torch.device("cuda")
    cache, _ = tk.paged_setup([40], kv_heads=2, head_dim=64, dtype=FP8_DTYPE, device=dev)
    kc, vc = cache.keys[0], cache.values[0]
    kc_ref, vc_ref = kc.clone(), vc.clone()
    k, v = torch.randn(2, 7, 2, 64, dtype=torch.bfloat16).to(dev)
    k[0, 0, 0] = v[2, 1, 3] = float("nan")
    slots = torch.tensor([3, -1, 17, 47, -1, 16, 0], device=dev)
    write_kv(k, v, kc, vc, slots)
    write_kv_reference(kc_ref, vc_ref, k, v, slots)
    assert kc.view(torch.uint8).equal(kc_ref.view(torch.uint8))
    assert vc.view(torch.uint8).equal(vc_ref.view(torch.uint8))
    assert kc.float().view(-1, 2, 64)[3, 0, 0] == 0 and vc.float().view(-1, 2, 64)[17, 1, 3] == 0
    assert not (kc.float().isnan().any() or vc.float().isnan().any())
    case = tk.rope_kv_case(19, 9, 64, torch.bfloat16, FP8_DTYPE, dev)
    case["k"][0, 0, 0] = case["v"][0, 1, 5] = float("nan")
    tk.check_rope_write_kv(case)
    assert not (case["k_cache"].float().isnan().any() or case["v_cache"].float().isnan().any())


@pytest.mark.gpu  # the interpreter's cast to float8 is not torch's (see above)
def test_scaled_fp8_kv_writes_store_x_over_scale() -> None:
    """With scales, write_kv stores k / scale and v / scale (saturated beyond), as the
    reference does, bit for bit; rope_write_kv stores what rope_qk then write_kv do."""
    dev = torch.device("cuda")
    scales = torch.tensor([8.0, 0.5], device=dev)
    cache, _ = tk.paged_setup([40], kv_heads=2, head_dim=64, dtype=FP8_DTYPE, device=dev)
    kc, vc = cache.keys[0], cache.values[0]
    kc_ref, vc_ref = kc.clone(), vc.clone()
    k, v = torch.randn(2, 7, 2, 64, dtype=torch.bfloat16).to(dev) * 100
    k[0, 0, 0] = 3072.0  # within 448 x 8: stored as 384
    v[2, 1, 3] = 1000.0  # beyond 448 x 0.5: stored as 448
    slots = torch.tensor([3, -1, 17, 47, -1, 16, 0], device=dev)
    write_kv(k, v, kc, vc, slots, scales)
    write_kv_reference(kc_ref, vc_ref, k, v, slots, scales)
    assert kc.view(torch.uint8).equal(kc_ref.view(torch.uint8))
    assert vc.view(torch.uint8).equal(vc_ref.view(torch.uint8))
    assert kc.float().view(-1, 2, 64)[3, 0, 0] == 384.0
    assert vc.float().view(-1, 2, 64)[17, 1, 3] == FP8_MAX
    case = tk.rope_kv_case(19, 9, 64, torch.bfloat16, FP8_DTYPE, dev)
    case["k"][0, 0, 0] = case["v"][0, 1, 5] = 1000.0
    tk.check_rope_write_kv({**case, "kv_scales": scales})


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_and_prefill_read_a_scaled_fp8_cache(device: str, num_splits: int) -> None:
    """A cache holding x / scale: decode (with and without splits) and prefill give the
    attention over x, i.e. the stored values times their scales."""
    from batchgen.engine.attention.base import KVCache
    from batchgen.engine.kernels import paged_prefill

    dev = tk._device(device)
    q_lens, ctx_lens = [1, 1, 5, 20], [37, 64, 5, 36]
    cache, tables = tk.paged_setup(ctx_lens, kv_heads=2, head_dim=64, dtype=FP8_DTYPE, device=dev)
    scales = torch.tensor([6.0, 0.25], device=dev)
    scaled = KVCache([cache.keys[0].float() * 6.0], [cache.values[0].float() * 0.25])
    q = tk.strided_q(sum(q_lens), 4, 64, torch.bfloat16, dev)
    ref = tk.reference(q, scaled, tables, q_lens, ctx_lens)
    lens = torch.tensor(ctx_lens, dtype=torch.int32, device=dev)
    out = paged_decode(q, cache.keys[0], cache.values[0], tables, lens, 64**-0.5,
                       num_seqs=2, num_splits=num_splits, min_partition=16, block_n=16,
                       kv_scales=scales)  # fmt: skip
    assert tk.rel_err(out[:2], ref[:2]) < tk.BF16_TOL
    unscaled = paged_decode(q, cache.keys[0], cache.values[0], tables, lens, 64**-0.5,
                            num_seqs=2, block_n=16)  # fmt: skip
    assert tk.rel_err(unscaled[:2], ref[:2]) > 0.1, "the scales must matter here"
    cu = torch.tensor([0, 1, 2, 7, 27], dtype=torch.int32, device=dev)
    pre = paged_prefill(q, cache.keys[0], cache.values[0], tables, cu, lens, 64**-0.5,
                        num_tokens=25, first_seq=2, block_m=16, block_n=16,
                        kv_scales=scales)  # fmt: skip
    assert tk.rel_err(pre[2:], ref[2:]) < tk.BF16_TOL


# compiles the rotary kernel (alone, or writing a cache) for sm_90 in a process without the
# interpreter
HOPPER_COMPILE = """
import sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from batchgen.engine.kernels.rotary import _rope_kernel as kernel

cache, into, scaled = sys.argv[1], sys.argv[2], sys.argv[3] == "scaled"
types = dict.fromkeys(("q_ptr", "k_ptr", "v_ptr", "cos_ptr", "sin_ptr", "qo_ptr"), "*bf16")
types.update(ko_ptr="*" + cache, vo_ptr="*" + cache, slot_ptr="*i64", scale_ptr="*fp32")
consts = dict(HALF=64, BLOCK=64, BLOCK_H=8, BLOCK_D=128, FP8_MAX=448.0)
consts.update(CACHE=into == "cache", BLOCK_SIZE=16 if into == "cache" else 1)
consts["SATURATE"] = cache == "fp8e4nv"
consts["SCALED"] = scaled
names = kernel.arg_names
signature = {n: types.get(n, "constexpr" if n in consts else "i32") for n in names}
constexprs = {(names.index(n),): v for n, v in consts.items()}
triton.compile(ASTSource(kernel, signature, constexprs), target=GPUTarget("cuda", 90, 32))
"""


@pytest.mark.parametrize(
    ("cache", "into", "scaled"),
    [
        ("bf16", "rows", ""),
        ("bf16", "cache", ""),
        ("fp8e4nv", "cache", ""),
        ("fp8e4nv", "cache", "scaled"),
    ],
)
def test_rotary_kernel_compiles_for_hopper(cache: str, into: str, scaled: str) -> None:
    """The interpreter runs code the compiler refuses (a constexpr branch returning another
    dtype did, and only the GPU run found it): compiled here for sm_90, no GPU needed."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run(
        [sys.executable, "-c", HOPPER_COMPILE, cache, into, scaled or "unscaled"],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]


# compiles the paged attention and KV write kernels over a scaled FP8 cache for sm_90
ATTENTION_COMPILE = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from batchgen.engine.kernels.kv_write import _kv_write_kernel
from batchgen.engine.kernels.paged_decode import _decode_kernel
from batchgen.engine.kernels.paged_prefill import _prefill_kernel

def compile(kernel, types, consts):
    names = kernel.arg_names
    signature = {n: "constexpr" if n in consts else types.get(n, "i32") for n in names}
    constexprs = {(names.index(n),): v for n, v in consts.items()}
    triton.compile(ASTSource(kernel, signature, constexprs), target=GPUTarget("cuda", 90, 32))

ptrs = dict(q_ptr="*bf16", out_ptr="*bf16", k_cache_ptr="*fp8e4nv", v_cache_ptr="*fp8e4nv",
            block_tables_ptr="*i32", context_lens_ptr="*i32", cu_seqlens_ptr="*i32",
            lse_ptr="*fp32", sinks_ptr="*fp32", kv_scale_ptr="*fp32", scale_log2="fp32",
            softcap_log2="fp32")
attention = dict(GROUP=4, HEAD_DIM=128, BLOCK_D=128, BLOCK_N=64, BLOCK_SIZE=16,
                 HAS_SOFTCAP=False, HAS_SINKS=False, PRECISION="tf32", CACHE_FP8=True,
                 KV_SCALED=True)
for direct in (True, False):
    for tma in (False, True):  # TMA: the caches are descriptors of one 64-token block per copy
        block = dict(BLOCK_SIZE=64) if tma else {}
        desc = "tensordesc<fp8e4nv[1, 64, 1, 128]>"
        types = dict(ptrs, k_cache_ptr=desc, v_cache_ptr=desc) if tma else ptrs
        consts = dict(attention, BLOCK_G=16, DIRECT=direct, FROM_ZERO=direct, TMA=tma, **block)
        compile(_decode_kernel, types, consts)
compile(_prefill_kernel, ptrs, dict(attention, BLOCK_M=64))
compile(_kv_write_kernel,
        dict(k_ptr="*bf16", v_ptr="*bf16", k_cache_ptr="*fp8e4nv", v_cache_ptr="*fp8e4nv",
             slot_ptr="*i64", scale_ptr="*fp32"),
        dict(BLOCK_SIZE=16, BLOCK_H=8, BLOCK_D=128, SATURATE=True, FP8_MAX=448.0, SCALED=True))
"""


def test_attention_kernels_over_a_scaled_fp8_cache_compile_for_hopper() -> None:
    """Decode (one split and several, pointer or TMA loads), prefill and the KV write with an
    FP8 cache's scales, compiled for sm_90 here (the interpreter accepts code the compiler
    refuses)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run(
        [sys.executable, "-c", ATTENTION_COMPILE],
        env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_reads_fp8_cache(device: str, num_splits: int) -> None:
    dev = tk._device(device)
    ctx_lens = [37, 5, 64]
    cache, tables = tk.paged_setup(ctx_lens, kv_heads=2, head_dim=64, dtype=FP8_DTYPE, device=dev)
    q = tk.strided_q(len(ctx_lens), 4, 64, torch.bfloat16, dev)
    lens = torch.tensor(ctx_lens, dtype=torch.int32, device=dev)
    out = paged_decode(q, cache.keys[0], cache.values[0], tables, lens, 64**-0.5,
                       num_splits=num_splits, min_partition=16, block_n=16)  # fmt: skip
    ref = tk.reference(q, cache, tables, [1] * len(ctx_lens), ctx_lens)  # float32 from fp8
    assert tk.rel_err(out, ref) < tk.BF16_TOL


def _stale_extremes(cache, tables: torch.Tensor, ctx_lens: list[int]) -> None:
    """+-448 (E4M3's largest values) in every cache slot no sequence reads: past each end and
    in blocks no table names (what an earlier sequence can leave there; never NaN, which an
    FP8 cache does not hold: test_fp8_kv_writes_store_nan_as_zero)."""
    block = cache.keys[0].shape[1]
    used = torch.zeros(cache.keys[0].shape[:2], dtype=torch.bool, device=tables.device)
    for i, n in enumerate(ctx_lens):
        for j in range(n):
            used[tables[i, j // block], j % block] = True
    for t, stale in ((cache.keys[0], FP8_MAX), (cache.values[0], -FP8_MAX)):
        t.copy_(torch.where(used[..., None, None], t.float(), stale).to(t.dtype))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    ("feature", "num_splits"),
    [("", 1), ("", 3), ("window", 1), ("window", 4), ("chunk", 1), ("softcap", 3), ("sinks", 1),
     ("sinks", 3)],
)  # fmt: skip
def test_decode_by_tma_copies_of_fp8_blocks(device: str, feature: str, num_splits: int) -> None:
    """Each K and V tile one TMA copy of a whole block (tma=True): the attention over the
    scaled cache with every mask, split and feature, though the slots past each end and the
    blocks no table names hold E4M3's extremes; the pointer loads' result within float
    rounding."""
    from batchgen.engine.attention.base import KVCache

    dev = tk._device(device)
    ctx_lens = [1, 15, 16, 17, 40, 70]
    cache, tables = tk.paged_setup(ctx_lens, kv_heads=2, head_dim=64, dtype=FP8_DTYPE, device=dev)
    features = {"window": 7} if feature == "window" else tk.features_for(feature, 8, dev)
    scales = torch.tensor([4.0, 0.5], device=dev)
    scaled = KVCache([cache.keys[0].float() * 4.0], [cache.values[0].float() * 0.5])
    q = tk.strided_q(len(ctx_lens), 8, 64, torch.bfloat16, dev)
    ref = tk.reference(q, scaled, tables, [1] * len(ctx_lens), ctx_lens, **features)
    lens = torch.tensor(ctx_lens, dtype=torch.int32, device=dev)
    kwargs = dict(features, num_splits=num_splits, min_partition=16, block_n=16, kv_scales=scales)
    pointers = paged_decode(q, cache.keys[0], cache.values[0], tables, lens, 0.125, **kwargs)
    _stale_extremes(cache, tables, ctx_lens)
    out = tk.poisoned(q)
    paged_decode(q, cache.keys[0], cache.values[0], tables, lens, 0.125, out=out, tma=True,
                 **kwargs)  # fmt: skip
    assert out[len(ctx_lens) :].isnan().all() and out[: len(ctx_lens)].isfinite().all()
    assert tk.rel_err(out[: len(ctx_lens)], ref) < tk.BF16_TOL
    torch.testing.assert_close(out[: len(ctx_lens)], pointers, rtol=1e-2, atol=1e-2)


def test_decode_tma_needs_one_block_per_tile() -> None:
    """tma=True where a tile is not one block, or on a 16-bit cache, is refused, not run
    wrongly; on the CPU auto stays off."""
    from batchgen.engine.kernels.paged_decode import _decode_tma

    cache, tables = tk.paged_setup([20], kv_heads=1, head_dim=64, dtype=FP8_DTYPE,
                                   device=torch.device("cpu"))  # fmt: skip
    q = torch.randn(1, 4, 64, dtype=torch.bfloat16)
    lens = torch.tensor([20], dtype=torch.int32)
    with pytest.raises(ValueError, match="tma=True needs an 8-bit cache in blocks of block_n=32"):
        paged_decode(q, cache.keys[0], cache.values[0], tables, lens, 0.125, block_n=32, tma=True)
    bf16 = cache.keys[0].to(torch.bfloat16)  # a 16-bit cache may hold NaN: never by TMA
    with pytest.raises(ValueError, match="tma=True needs an 8-bit cache"):
        paged_decode(q, bf16, bf16, tables, lens, 0.125, block_n=16, tma=True)
    assert not _decode_tma(cache.keys[0], 16, None)  # a CPU cache: no TMA unless asked


@pytest.mark.parametrize("device", DEVICES)
def test_decode_fp8_cache_keeps_large_queries(device: str) -> None:
    """FP8 cache tiles meet q as fp16 operands: q, scaled before its cast, must not overflow
    where it is beyond fp16's 65504 (the keys there are 0: an overflow would give inf * 0)."""
    dev = tk._device(device)
    ctx_lens = [40, 17]
    cache, tables = tk.paged_setup(ctx_lens, kv_heads=1, head_dim=128, dtype=FP8_DTYPE, device=dev)
    cache.keys[0][..., :8] = 0
    q = tk.strided_q(len(ctx_lens), 4, 128, torch.bfloat16, dev)
    q[..., :8] = 2e5
    lens = torch.tensor(ctx_lens, dtype=torch.int32, device=dev)
    out = paged_decode(q, cache.keys[0], cache.values[0], tables, lens, 128**-0.5, block_n=16)
    ref = tk.reference(q, cache, tables, [1] * len(ctx_lens), ctx_lens)
    assert out.isfinite().all() and tk.rel_err(out, ref) < tk.BF16_TOL


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("window", [None, 7])
def test_prefill_reads_fp8_cache(device: str, window: int | None) -> None:
    tk._check_prefill(tk._device(device), torch.bfloat16, (4, 2, 64), window, block_m=16,
                      cache_dtype=FP8_DTYPE)  # fmt: skip


def _assert_rows_of(out: torch.Tensor, scaled: torch.Tensor, s: torch.Tensor) -> None:
    """scaled (values before the FP8 cast) and s are what quantize_rows makes of out (its
    row 2 all zeros)."""
    q_ref, s_ref = quantize_rows_reference(out.cpu())
    torch.testing.assert_close(s.cpu(), s_ref, rtol=1e-6, atol=0)
    assert scaled.abs().max() <= FP8_MAX and (scaled[2] == 0).all()
    cast = scaled.cpu().to(FP8_DTYPE).float()
    assert (cast == q_ref.float()).float().mean() > 0.999  # rare: a division one ulp off


@pytest.mark.skipif(not tk.INTERPRET, reason="needs TRITON_INTERPRET")
def test_rms_norm_writes_the_fp8_rows_of_its_output() -> None:
    """The norm that feeds an FP8 projection writes the rows quantize_rows would make of its
    output, in the same pass; its 16-bit output is unchanged by that. (Against torch's CPU
    division, in the interpreter; on the GPU, against the quantization kernel, bit for bit.)"""
    from batchgen.engine.kernels.fused_ops import launch_rms_norm

    dev = torch.device("cpu")
    x = _rows().to(dev)
    weight = torch.randn(x.shape[1], dtype=torch.bfloat16, device=dev)
    out, plain = torch.empty_like(x), torch.empty_like(x)
    scaled = torch.empty(x.shape, dtype=torch.float32, device=dev)
    s = torch.empty(x.shape[0], dtype=torch.float32, device=dev)
    launch_rms_norm(x, weight, 1e-5, out, scaled, s)
    launch_rms_norm(x, weight, 1e-5, plain)
    assert torch.equal(out, plain)
    _assert_rows_of(out, scaled, s)


@pytest.mark.gpu
def test_rms_norm_fp8_rows_equal_the_quantize_kernel() -> None:
    """On the GPU, bit for bit what the quantization kernel makes of the norm's output."""
    from batchgen.engine.kernels.fused_ops import rms_norm
    from batchgen.engine.quant.fp8 import _FP8_ROWS

    x = _rows().cuda()[None]
    weight = torch.randn(x.shape[-1], dtype=torch.bfloat16, device="cuda")
    out = rms_norm(x, weight, 1e-5, quantize=True)
    q, s = getattr(out, _FP8_ROWS)
    q_ref, s_ref = quantize_rows_triton(out[0])
    assert torch.equal(s, s_ref)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    assert torch.equal(out, rms_norm(x, weight, 1e-5))


def _gate_up() -> torch.Tensor:
    """Seeded: the interpreter converts subnormal values wrongly and not idempotently (a bf16
    subnormal read back through memory can turn to 0, a float32 subnormal into a nonzero FP8
    value), so one input in ~2,000 (a gate near -88 in the row scaled by 30) made the two
    SiLU-and-mul kernels differ on the CPU, never on a GPU."""
    generator = torch.Generator().manual_seed(0)
    gu = torch.randn(5, 2 * (2048 + 96), generator=generator).bfloat16()  # three blocks a row
    gu[1] *= 30.0
    gu[2] = 0.0
    gu[3, 2048 + 96 + 5] = 4000.0  # an outlier in "up" sets its row's scale
    return gu


@pytest.mark.skipif(not tk.INTERPRET, reason="needs TRITON_INTERPRET")
def test_silu_mul_writes_the_fp8_rows_of_its_output() -> None:
    """As the norm's, for SiLU-and-mul before an FP8 down projection."""
    from batchgen.engine.kernels.fused_ops import launch_silu_mul_quant, silu_mul_merged

    dev = torch.device("cpu")
    gu = _gate_up().to(dev)
    out = torch.empty(gu.shape[0], gu.shape[1] // 2, dtype=gu.dtype, device=dev)
    scaled = torch.empty(out.shape, dtype=torch.float32, device=dev)
    s = torch.empty(out.shape[0], dtype=torch.float32, device=dev)
    launch_silu_mul_quant(gu, out, scaled, s)
    assert torch.equal(out, silu_mul_merged(gu))
    _assert_rows_of(out, scaled, s)


@pytest.mark.gpu
def test_silu_mul_fp8_rows_equal_the_quantize_kernel() -> None:
    from batchgen.engine.kernels.fused_ops import silu_mul_merged
    from batchgen.engine.quant.fp8 import _FP8_ROWS

    gu = _gate_up().cuda()[None]
    out = silu_mul_merged(gu, quantize=True)
    q, s = getattr(out, _FP8_ROWS)
    q_ref, s_ref = quantize_rows_triton(out[0])
    assert torch.equal(s, s_ref)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    assert torch.equal(out, silu_mul_merged(gu))


@pytest.mark.parametrize("device", DEVICES)
def test_silu_mul_fp8_rows_without_the_16_bit_result(device: str, monkeypatch) -> None:
    """silu_mul_fp8 gives the FP8 rows silu_mul_merged(quantize=True) attaches, bit for bit,
    without keeping the 16-bit result: a row held whole in registers, or (rows longer than
    ROW_IN_REGISTERS) through a scratch 16-bit row."""
    from batchgen.engine.kernels import fused_ops
    from batchgen.engine.kernels.fused_ops import silu_mul_merged
    from batchgen.engine.quant.fp8 import _FP8_ROWS

    gu = _gate_up().to(tk._device(device))[None]
    q_ref, s_ref = getattr(silu_mul_merged(gu, quantize=True), _FP8_ROWS)
    for longest in (fused_ops.ROW_IN_REGISTERS, 1024):  # whole rows, and two passes
        monkeypatch.setattr(fused_ops, "ROW_IN_REGISTERS", longest)
        q, s = fused_ops.silu_mul_fp8(gu)
        assert torch.equal(s, s_ref)
        assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))


@pytest.mark.parametrize("device", DEVICES)
def test_fused_fp8_mlp_feeds_its_rows_to_the_down_projection(device: str, monkeypatch) -> None:
    """The fused MLP of an FP8 model multiplies SiLU-and-mul's FP8 rows by the down
    projection directly: the same output as the down projection taking the 16-bit result
    with those rows attached, and no 16-bit result is made. While the model check runs
    16-bit activations, the down projection takes the 16-bit result."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaMLP

    from batchgen.engine.fusion import Fusion
    from batchgen.engine.kernels import fused_ops
    from batchgen.engine.quant.fp8 import Fp8Linear, unquantized_activations

    dev = tk._device(device)
    torch.manual_seed(0)
    mlp = LlamaMLP(LlamaConfig(hidden_size=64, intermediate_size=160, mlp_bias=True))
    mlp = mlp.to(dev, torch.bfloat16)
    for name in ("gate_proj", "up_proj", "down_proj"):  # after .to(): it would cast FP8 too
        setattr(mlp, name, Fp8Linear.from_linear(getattr(mlp, name)))
    assert mlp.down_proj.weight.dtype == torch.float8_e4m3fn
    x = torch.randn(1, 7, 64, device=dev, dtype=torch.bfloat16)
    Fusion(torch.nn.Sequential(mlp)).on()
    seen, made = [], []
    own_fp8, own_16bit = fused_ops.silu_mul_fp8, fused_ops.silu_mul_merged
    monkeypatch.setattr(fused_ops, "silu_mul_fp8", lambda gu: seen.append(gu) or own_fp8(gu))
    monkeypatch.setattr(
        fused_ops, "silu_mul_merged", lambda gu, **k: made.append(gu) or own_16bit(gu, **k)
    )
    got = mlp(x)
    assert len(seen) == 1 and not made  # no 16-bit SiLU-and-mul result
    expected = mlp.down_proj(own_16bit(seen[0], quantize=True))  # the module's way, same rows
    assert got.shape == expected.shape and torch.equal(got, expected)
    with unquantized_activations():
        got = mlp(x)
        assert len(made) == 1 and torch.equal(got, mlp.down_proj(own_16bit(made[0])))


GEMM_CASES = [  # (M, N, K, config): ragged M and N, K split evenly and unevenly
    (37, 96, 160, GemmConfig(32, 32, 32, 4, 2)),
    (37, 96, 160, GemmConfig(16, 64, 64, 4, 2, split_k=2)),  # splits of 64 and 96 (masked)
    (5, 128, 256, GemmConfig(16, 64, 64, 4, 2, split_k=4)),
    (64, 64, 512, GemmConfig(64, 64, 256, 4, 3)),
]


def _fp8_operands(m: int, n: int, k: int, dev: torch.device):
    x = torch.randn(m, k, dtype=torch.bfloat16)
    x[:, :: max(1, k // 4)] *= 50.0
    xq, xs = quantize_rows_reference(x)
    wq, ws = quantize_weight(torch.randn(n, k) * 0.05)
    return xq.to(dev), xs.to(dev), wq.to(dev), ws.to(dev)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("m", "n", "k", "config"), GEMM_CASES)
def test_fp8_gemm_is_the_scaled_product(device: str, m: int, n: int, k: int, config) -> None:
    """Every tile shape and K split gives the float32 product of the FP8 operands and their
    row-wise scales (exactly in float32 up to summation order; rounded once to bf16)."""
    dev = tk._device(device)
    xq, xs, wq, ws = _fp8_operands(m, n, k, dev)
    want = _fp8_product(xq.cpu(), xs.cpu(), wq.cpu(), ws.cpu(), torch.float32)
    got = fp8_gemm(xq, xs, wq, ws, config, out_dtype=torch.float32).cpu()
    if dev.type == "cpu":
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    else:  # the tensor cores round partial sums (within a K tile); cuBLAS compared below
        assert tk.rel_err(got, want) < 1e-3
    half = fp8_gemm(xq, xs, wq, ws, config, out_dtype=torch.bfloat16).cpu()
    assert half.dtype == torch.bfloat16
    assert tk.rel_err(half, want) < 8e-3  # the interpreter truncates to bf16, CUDA rounds


@pytest.mark.parametrize("sms", [132, 78, 16])
def test_gemm_config_covers_decode_batches_and_leaves_full_gpus_to_cublas(sms: int) -> None:
    shapes = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (2048, 8192), (96, 160)]
    for n, k in shapes:
        for m in (1, 16, 17, 32, 33, 64, 100, 128, 256, 1024, 8192):
            config = gemm_config(m, n, k, sms)
            tiles = None if config is None else -(-m // config.block_m) * -(-n // config.block_n)
            if config is None:  # only where cuBLAS's large tiles fill the GPU
                assert m > 64, (m, n, k)
                continue
            assert config.block_m == (16 if m <= 16 else 32 if m <= 32 else 64)
            assert tiles <= 1.5 * sms or m <= 64
            assert config.split_k in (1, 2, 4)
            if config.split_k > 1:  # equal parts, each at least MIN_SPLIT_K, within 2 per SM
                assert k % (config.split_k * config.block_k) == 0
                assert k // config.split_k >= 2048 and tiles * config.split_k <= 2 * sms
        assert gemm_config(8192, n, k, sms) is None or n * 8192 <= 2 * sms * 64 * 64
    assert gemm_config(16, 4096, 4104, 132) is None  # K not a multiple of 16


@pytest.mark.gpu
@pytest.mark.parametrize("k", [4096, 14336])
def test_fp8_gemm_sums_long_rows_as_exactly_as_scaled_mm(k: int) -> None:
    """Over a long K, FP8 tensor-core sums kept in the tensor core lose precision; the kernel
    adds them into float32 every EXACT_ACCUMULATION_K elements, so its error against the exact
    product is no larger than torch._scaled_mm's (both rounded to bf16)."""
    dev = torch.device("cuda")
    for m in (16, 64, 256):
        xq, xs, wq, ws = _fp8_operands(m, 512, k, dev)
        want = _fp8_product(xq.cpu().double(), xs.cpu().double(), wq.cpu().double(),
                            ws.cpu().double(), torch.float64)  # fmt: skip
        cublas = torch._scaled_mm(xq, wq.t(), scale_a=xs[:, None], scale_b=ws[None, :],
                                  out_dtype=torch.bfloat16)  # fmt: skip
        limit = 1.2 * tk.rel_err(cublas.cpu().double(), want) + 1e-4
        configs = [gemm_config(m, 512, k, 132) or GemmConfig(64, 64, 256, 4, 3)]
        configs.append(configs[0]._replace(split_k=2))
        for config in configs:
            got = fp8_gemm(xq, xs, wq, ws, config).cpu().double()
            assert tk.rel_err(got, want) <= limit, (m, config, tk.rel_err(got, want), limit)


@pytest.mark.gpu
@pytest.mark.parametrize("k", [4096, 14336])
def test_scaled_mm_sums_stay_far_below_the_fp8_rounding(k: int) -> None:
    """Large products go to torch._scaled_mm with its tensor-core sums over all of K
    (SCALED_MM_FAST_ACCUMULATION): their error against the exact product of the FP8 values
    stays within 5e-3, under a quarter of what rounding the weights alone to FP8 costs."""
    from batchgen.engine.kernels.fp8_gemm import fp8_matmul, gpu_gemm_config

    dev = torch.device("cuda")
    xq, xs, wq, ws = _fp8_operands(2048, 1024, k, dev)
    assert gpu_gemm_config(xq, wq) is None  # the _scaled_mm path
    got = fp8_matmul(xq, xs, wq, ws, torch.bfloat16, None).cpu().double()
    want = _fp8_product(xq.cpu().double(), xs.cpu().double(), wq.cpu().double(),
                        ws.cpu().double(), torch.float64)  # fmt: skip
    assert tk.rel_err(got, want) < 5e-3
    x = xq.cpu().double() * xs.cpu().double()[:, None]  # the 16-bit-exact operands' product
    w = torch.randn(1024, k, dtype=torch.float64) * 0.05
    rounding = tk.rel_err(_fp8_product(xq.cpu().double(), xs.cpu().double(),
                                       *quantize_weight(w), torch.float64), x @ w.t())  # fmt: skip
    assert rounding > 4 * 5e-3


@pytest.mark.gpu
def test_fp8_linear_matches_its_emulation_at_every_batch_size() -> None:
    """fp8_linear picks the Triton kernel or _scaled_mm by batch size; each batch size's
    product is the emulation's up to bf16 rounding."""
    from batchgen.engine.kernels.fp8_gemm import gpu_gemm_config
    from batchgen.engine.quant.fp8 import emulated_fp8_linear, fp8_linear

    dev = torch.device("cuda")
    wq, ws = quantize_weight(torch.randn(4096, 4096, device=dev) * 0.02)
    paths = set()
    for m in (1, 7, 16, 31, 64, 100, 128, 200, 256, 512, 2048):
        x = torch.randn(m, 4096, device=dev, dtype=torch.bfloat16)
        x[:, ::1024] *= 50.0
        got = fp8_linear(x, wq, ws)
        assert tk.rel_err(got, emulated_fp8_linear(x, wq, ws)) < 1e-2, m
        paths.add(gpu_gemm_config(quantize_rows_triton(x)[0], wq) is None)
    assert paths == {True, False}  # both GEMMs were exercised
