"""Paged decode attention, flash-decoding style: one query token per sequence.

Grid (num_seqs, num_kv_heads, num_splits). A program attends all H/Hkv query heads of one KV
head (padded to >= 16 rows so tl.dot applies) over one partition of the visible KV range,
walking the block table. With one split it writes the output directly; otherwise it writes a
normalized partial output and its log2-sum-exp, and _combine_kernel merges the splits.
Context lengths are read on the device, and each sequence cuts its own range into num_splits
partitions of at least min_partition keys; the launch parameters never depend on contexts, so
one launch (or CUDA graph) is correct and balanced for any. Empty splits exit at once.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from batchgen.engine.kernels.launch import launch, next_power_of_2

LOG2E = 1.4426950408889634
MIN_DOT_ROWS = 16  # tl.dot operands need >= 16 rows; a GQA group is padded up to this
NO_WINDOW = 1 << 30  # window passed to the kernels when there is none (> any context)


@triton.jit
def _split_range(ctx, window, chunk, split, num_splits, min_partition, BLOCK_N: tl.constexpr):
    """Keys [start, end) of split(s) for a query at position ctx - 1 (start >= end: none).

    The visible keys [max(ctx - window, chunk start), ctx) are cut from a BLOCK_N-aligned base
    into num_splits partitions of max(min_partition, ceil(visible / num_splits)) keys, rounded
    to BLOCK_N.
    """
    lo = tl.maximum(tl.maximum(ctx - window, 0), (tl.maximum(ctx, 1) - 1) // chunk * chunk)
    base = lo // BLOCK_N * BLOCK_N
    part = tl.cdiv(tl.cdiv(ctx - base, num_splits), BLOCK_N) * BLOCK_N
    part = tl.maximum(part, min_partition)
    start = tl.maximum(base + split * part, lo)
    return start, tl.minimum(base + (split + 1) * part, ctx)


@triton.jit
def kv_row_offsets(
    bt_row_ptr, stride_btw, pos, valid, stride_cb, stride_cs, BLOCK_SIZE: tl.constexpr
):
    """pos: [N] key positions -> [N] int64 cache offsets of their rows (invalid: block 0)."""
    block = tl.load(bt_row_ptr + (pos // BLOCK_SIZE) * stride_btw, mask=valid, other=0)
    return block.to(tl.int64) * stride_cb + (pos % BLOCK_SIZE).to(tl.int64) * stride_cs


@triton.jit
def block_tiles(k_desc, v_desc, block, kv_head, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """One cache block's K and V tiles of one KV head, each by one TMA copy ([BLOCK_N, D]).

    The copies take the whole block, slots past the sequence's end included: their scores are
    masked and their probabilities 0, so V's rows there are not masked (on an H200 that mask
    took the copies' whole gain: 85.8 against 74.8 us per 8b layer). 0 * V is 0 because an FP8
    cache never holds NaN (fp8_stored); a 16-bit one could, so only 8-bit caches take this.
    """
    k = k_desc.load([block, 0, kv_head, 0]).reshape(BLOCK_N, BLOCK_D)
    v = v_desc.load([block, 0, kv_head, 0]).reshape(BLOCK_N, BLOCK_D)
    return k, v


@triton.jit
def query_operand(q, scale_log2, CACHE_FP8: tl.constexpr):
    """-> (q as the score product's operand, the scale its scores still need).

    An FP8 cache's tiles become fp16 (kv_operands), so q does too, scaled first (in float32,
    by the runtime scale: a constant power of two would be moved after the cast, where a q
    beyond fp16's range overflows): scaled, it fits fp16 for |q| up to ~500,000 at head_dim
    128, and rounds to 11 significant bits (bf16 q has 8).
    """
    if CACHE_FP8:
        q_op = (q.to(tl.float32) * scale_log2).to(tl.float16)
        scale = 1.0
    else:
        q_op = q
        scale = scale_log2
    return q_op, scale


@triton.jit
def cache_scales(scale_ptr, qk_scale, KV_SCALED: tl.constexpr):
    """-> (the scores' scale times the cache's key scale, its value scale): an FP8 cache
    with scales holds x / scale; 1 and qk_scale unchanged otherwise."""
    if KV_SCALED:
        return qk_scale * tl.load(scale_ptr), tl.load(scale_ptr + 1)
    else:
        return qk_scale, 1.0


@triton.jit
def kv_operands(k, v, CACHE_FP8: tl.constexpr):
    """Loaded K and V tiles -> the products' operands. An FP8 E4M3 cache's become fp16: exact,
    one paired hardware conversion per two values (to bf16, a scalar conversion more per
    value); on an H200, decode over an FP8 cache took 90.5 against 117.6 us per layer with
    bf16 operands (batch 256, 8b heads, contexts 300-500)."""
    if CACHE_FP8:
        k = k.to(tl.float16)
        v = v.to(tl.float16)
    return k, v


@triton.jit
def scores_log2(q, k, scale_log2, softcap_log2, HAS_SOFTCAP: tl.constexpr, PRECISION: tl.constexpr):
    """q: [M, D], k: [N, D] -> [M, N] log2-scaled scores; soft-capped as
    softcap * tanh(score / softcap) when HAS_SOFTCAP (softcap_log2 = softcap * log2(e))."""
    s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=PRECISION) * scale_log2
    if HAS_SOFTCAP:
        s = softcap_log2 * (1.0 - 2.0 / (tl.exp(2.0 * s / softcap_log2) + 1.0))  # tanh
    return s


@triton.jit
def add_sink(m_i, l_i, acc, sink_log2):
    """Fold a per-row sink logit into the softmax denominator: -> (l, acc) rescaled to it."""
    m_new = tl.maximum(m_i, sink_log2)
    alpha = tl.where(m_i == float("-inf"), 0.0, tl.exp2(m_i - m_new))
    return l_i * alpha + tl.exp2(sink_log2 - m_new), acc * alpha[:, None]


@triton.jit
def online_softmax_step(s, v, m_i, l_i, acc, PRECISION: tl.constexpr):
    """s: [M, N] log2-scaled scores (-inf = masked), v: [N, D]; running max/sum/acc per row."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing seen yet
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, l_i, acc


@triton.jit(do_not_specialize=["window", "chunk", "softcap_log2", "min_partition"])
def _decode_kernel(
    q_ptr,  # [B, H, D]
    k_cache_ptr,  # [num_blocks, BLOCK_SIZE, Hkv, D]; v_cache has the same strides
    v_cache_ptr,
    block_tables_ptr,  # [B, W] int32
    context_lens_ptr,  # [B] int32
    out_ptr,  # [B, H, D] (DIRECT: one split) or [B, H, S, D] fp32 partials
    lse_ptr,  # [B, H, S] fp32 log2-sum-exp of each partial (unused when DIRECT)
    sinks_ptr,  # [H] fp32 per-head sink logits (read when HAS_SINKS and DIRECT)
    kv_scale_ptr,  # [2] fp32 the cache's (key, value) scales (read when KV_SCALED)
    scale_log2,
    window,
    chunk,
    softcap_log2,
    min_partition,
    stride_qb,
    stride_qh,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_btb,
    stride_btw,
    stride_ob,
    stride_oh,
    stride_os,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    DIRECT: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    PRECISION: tl.constexpr,
    CACHE_FP8: tl.constexpr,
    KV_SCALED: tl.constexpr,
    FROM_ZERO: tl.constexpr,  # one split and no window or chunk: keys [0, ctx) in one program
    TMA: tl.constexpr,  # the caches are tensor descriptors and each tile is one cache block
):
    b = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    ctx = tl.load(context_lens_ptr + b)
    if FROM_ZERO:  # start known to be 0: each key's mask is one comparison (on an H200, an
        start = 0  # FP8-cache 8b layer at batch 256 took 83.7 against 87.0 us, bf16 -0.8%)
        end = ctx
    else:
        start, end = _split_range(
            ctx, window, chunk, split, tl.num_programs(2), min_partition, BLOCK_N
        )
    if not DIRECT:  # noqa: SIM102 (compile-time branch around a runtime one)
        if start >= end:
            return  # no keys here: the combine skips this split
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + g  # [BLOCK_G] query heads sharing this KV head
    io_mask = (g < GROUP)[:, None] & (d < HEAD_DIM)[None, :]
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=io_mask)
    q, qk_scale = query_operand(q, scale_log2, CACHE_FP8)
    qk_scale, v_scale = cache_scales(kv_scale_ptr, qk_scale, KV_SCALED)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    bt_row = block_tables_ptr + b * stride_btb
    head_off = kv_head * stride_ch + d[None, :]
    for n0 in range(start // BLOCK_N * BLOCK_N, end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        if FROM_ZERO:  # noqa: SIM108 (a compile-time branch)
            valid = pos < end
        else:
            valid = (pos >= start) & (pos < end)
        if TMA:
            block = tl.load(bt_row + (n0 // BLOCK_SIZE) * stride_btw)
            k, v = block_tiles(k_cache_ptr, v_cache_ptr, block, kv_head, BLOCK_N, BLOCK_D)
        else:
            rows = kv_row_offsets(bt_row, stride_btw, pos, valid, stride_cb, stride_cs, BLOCK_SIZE)
            kv_mask = valid[:, None] & (d < HEAD_DIM)[None, :]
            k = tl.load(k_cache_ptr + rows[:, None] + head_off, mask=kv_mask, other=0.0)
            v = tl.load(v_cache_ptr + rows[:, None] + head_off, mask=kv_mask, other=0.0)
        k, v = kv_operands(k, v, CACHE_FP8)
        s = scores_log2(q, k, qk_scale, softcap_log2, HAS_SOFTCAP, PRECISION)
        s = tl.where(valid[None, :], s, float("-inf"))  # [BLOCK_G, BLOCK_N]
        m_i, l_i, acc = online_softmax_step(s, v.to(q.dtype), m_i, l_i, acc, PRECISION)
    if HAS_SINKS and DIRECT:  # with splits, the combine adds the sink once
        sink = tl.load(sinks_ptr + heads, mask=g < GROUP, other=0.0) * 1.4426950408889634
        l_i, acc = add_sink(m_i, l_i, acc, sink)
    acc = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # no keys (ctx 0): zeros
    if KV_SCALED:  # partial outputs too: the combine is linear in them
        acc = acc * v_scale
    o_ptrs = out_ptr + b * stride_ob + heads[:, None] * stride_oh + split * stride_os + d[None, :]
    tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=io_mask)
    if not DIRECT:
        lse_row = (b * tl.num_programs(1) * GROUP + heads) * tl.num_programs(2)
        tl.store(lse_ptr + lse_row + split, m_i + tl.log2(l_i), mask=g < GROUP)


@triton.jit(do_not_specialize=["window", "chunk", "min_partition", "num_splits"])
def _combine_kernel(
    part_ptr,  # [B, H, S, D] fp32, normalized partial outputs
    lse_ptr,  # [B, H, S] fp32
    context_lens_ptr,  # [B] int32
    sinks_ptr,  # [H] fp32 (read when HAS_SINKS)
    out_ptr,  # [B, H, D]
    window,
    chunk,
    min_partition,
    num_splits,
    stride_ob,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_S: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    ctx = tl.load(context_lens_ptr + b)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    start, end = _split_range(ctx, window, chunk, s, num_splits, min_partition, BLOCK_N)
    valid = (start < end) & (s < num_splits)  # [BLOCK_S] splits the decode kernel wrote
    row = (b * tl.num_programs(1) + h) * num_splits
    lse = tl.load(lse_ptr + row + s, mask=valid, other=float("-inf"))
    m = tl.max(lse, 0)
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + h) * 1.4426950408889634
        m = tl.maximum(m, sink)
    w = tl.where(valid, tl.exp2(lse - tl.where(m == float("-inf"), 0.0, m)), 0.0)
    part_ptrs = part_ptr + (row + s[:, None]) * HEAD_DIM + d[None, :]
    part = tl.load(part_ptrs, mask=valid[:, None] & (d < HEAD_DIM)[None, :], other=0.0)
    denom = tl.sum(w, 0)
    if HAS_SINKS:
        denom += tl.exp2(sink - m)
    o = tl.sum(part * w[:, None], 0) / tl.where(denom > 0, denom, 1.0)  # [BLOCK_D]
    o_ptrs = out_ptr + b * stride_ob + h * stride_oh + d
    tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


def plan_decode_splits(
    num_seqs: int,
    num_kv_heads: int,
    capacity: int,
    *,
    target_programs: int,
    min_partition: int = 256,
    max_splits: int = 64,
) -> int:
    """-> num_splits giving about target_programs programs, from launch shapes only.

    capacity: the most keys a sequence can have (block-table width * block_size); no split
    gets fewer than min_partition keys of it. Contexts are not needed, so a CUDA-graph warm-up
    and its capture plan alike.
    """
    wanted = math.ceil(target_programs / max(num_seqs * num_kv_heads, 1))
    return max(1, min(wanted, max_splits, math.ceil(capacity / min_partition)))


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    *,
    window: int | None = None,
    chunk: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    kv_scales: torch.Tensor | None = None,
    num_seqs: int | None = None,
    num_splits: int = 1,
    min_partition: int = 256,
    out: torch.Tensor | None = None,
    block_n: int = 64,
    num_warps: int = 4,
    num_stages: int = 2,
    tma: bool | None = None,
) -> torch.Tensor:
    """Attention of one query per sequence over its paged KV; returns out [B, H, D] (q's dtype).

    q: [>= B, H, D] (any strides); row b < B = num_seqs (default q.shape[0]) is sequence b's
    query, at position context_lens[b] - 1. Caches: [num_blocks, block_size, Hkv, D] (same
    strides). block_tables: [>= B, W] int32; context_lens: [>= B] int32, read on the device
    (0 gives zeros). window: keys with q_pos - k_pos >= window are masked; chunk: keys before
    q_pos // chunk * chunk are masked; softcap: scores -> softcap * tanh(scores / softcap);
    sinks: [H] fp32 logits in each head's softmax denominator; kv_scales: an FP8 cache's
    (key, value) scales, [2] fp32 on the device (it holds x / scale). Each sequence's
    visible keys are cut into num_splits partitions of >= min_partition keys (a multiple of
    block_n). out: optional [>= B, H, D] buffer (contiguous last dim); rows >= B untouched.
    tma: load each K and V tile by one TMA copy of a whole cache block (block_n keys, the
    cache's block size); None = where tma_fits says it pays, True = always (ValueError where
    the cache does not fit it; the CPU interpreter runs it too), False = never.
    """
    num_seqs = q.shape[0] if num_seqs is None else num_seqs
    out = _check_decode(q, k_cache, v_cache, out, num_splits, min_partition, block_n)
    if num_seqs == 0:
        return out
    q = q if q.stride(-1) == 1 else q.contiguous()
    consts = _decode_consts(q, k_cache, kv_scales, block_n, num_splits, num_warps, num_stages)
    consts |= {"HAS_SOFTCAP": softcap is not None, "HAS_SINKS": sinks is not None}
    consts["FROM_ZERO"] = num_splits == 1 and window is None and chunk is None
    consts["TMA"] = _decode_tma(k_cache, block_n, tma)
    grid = (num_seqs, k_cache.shape[2], num_splits)
    caches = cache_descriptors(k_cache, v_cache) if consts["TMA"] else (k_cache, v_cache)
    args = (q, *caches, block_tables, context_lens)
    masks = (window or NO_WINDOW, chunk or NO_WINDOW)
    sizes = (scale * LOG2E, *masks, (softcap or 0.0) * LOG2E, min_partition, *q.stride()[:2])
    strides = (*k_cache.stride()[:3], *block_tables.stride())
    sink_ptr = sinks if sinks is not None else context_lens  # never read without sinks
    scale_ptr = kv_scales if kv_scales is not None else context_lens  # nor without scales
    if num_splits == 1:
        ostrides = (*out.stride()[:2], 0)
        launch(
            _decode_kernel, grid, *args, out, out, sink_ptr, scale_ptr, *sizes, *strides,
            *ostrides, **consts,
        )  # fmt: skip
        return out
    num_heads, head_dim = q.shape[1:]
    part = torch.empty(num_seqs, num_heads, num_splits, head_dim, device=q.device)
    lse = torch.empty(num_seqs, num_heads, num_splits, device=q.device)
    launch(
        _decode_kernel,
        grid,
        *args,
        part,
        lse,
        sink_ptr,
        scale_ptr,
        *sizes,
        *strides,
        *part.stride()[:3],
        **consts,
    )
    launch(_combine_kernel, (num_seqs, num_heads),
        part, lse, context_lens, sink_ptr, out, *masks, min_partition, num_splits,
        *out.stride()[:2],
        HEAD_DIM=head_dim,
        BLOCK_D=next_power_of_2(head_dim),
        BLOCK_N=block_n,
        BLOCK_S=next_power_of_2(num_splits),
        HAS_SINKS=sinks is not None,
    )  # fmt: skip
    return out


def tma_fits(k_cache: torch.Tensor, block_n: int) -> bool:
    """Whether decode tiles can be single TMA copies of cache blocks: an 8-bit cache (one
    that never holds NaN: block_tiles), the block is one tile, a head's row is 16-128 bytes
    (a power of two) and the cache's address and strides are 16-byte aligned."""
    head_bytes = k_cache.shape[3] * k_cache.dtype.itemsize
    return (
        k_cache.dtype.itemsize == 1
        and k_cache.shape[1] == block_n
        and 16 <= head_bytes <= 128
        and head_bytes & (head_bytes - 1) == 0
        and k_cache.data_ptr() % 16 == 0
        and all(s * k_cache.dtype.itemsize % 16 == 0 for s in k_cache.stride()[:-1])
    )


def _decode_tma(k_cache: torch.Tensor, block_n: int, tma: bool | None) -> bool:
    """Where TMA pays (tma None): a cache that fits it on a GPU with TMA. On an H200 (batch
    256, 8b heads, 64-token blocks, a probe kernel) an FP8 cache's layer took 72.6 against 82.5
    us at contexts 300-500 and 187 against 221 at 1-2,000 (1b heads: 43.5 against 52.9, 122
    against 141); a bf16 cache's the same within 2%."""
    if tma is None:
        return k_cache.is_cuda and has_tma(k_cache.device) and tma_fits(k_cache, block_n)
    if tma and not tma_fits(k_cache, block_n):
        raise ValueError(
            f"tma=True needs an 8-bit cache in blocks of block_n={block_n} tokens (this one: "
            f"{k_cache.dtype}, {k_cache.shape[1]}), 16-128 bytes per head row (a power of two) "
            "and a 16-byte aligned cache"
        )
    return tma


def has_tma(device: torch.device) -> bool:
    """A CUDA device with the tensor memory accelerator (compute capability 9.0+)."""
    return device.type == "cuda" and _capability(device.index or 0) >= (9, 0)


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def cache_descriptors(
    k_cache: torch.Tensor, v_cache: torch.Tensor
) -> tuple[TensorDescriptor, TensorDescriptor]:
    """TMA descriptors of the caches whose box is one block of one KV head: [1, S, 1, D]."""
    box = [1, k_cache.shape[1], 1, k_cache.shape[3]]
    shape, strides = list(k_cache.shape), list(k_cache.stride())
    return (
        TensorDescriptor(k_cache, shape, strides, box),
        TensorDescriptor(v_cache, shape, strides, box),
    )


def _decode_consts(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    kv_scales: torch.Tensor | None,
    block_n: int,
    num_splits: int,
    num_warps: int,
    num_stages: int,
) -> dict[str, object]:
    group = q.shape[1] // k_cache.shape[2]
    return {
        "GROUP": group,
        "HEAD_DIM": q.shape[2],
        "BLOCK_G": max(MIN_DOT_ROWS, next_power_of_2(group)),
        "BLOCK_D": next_power_of_2(q.shape[2]),
        "BLOCK_N": block_n,
        "BLOCK_SIZE": k_cache.shape[1],
        "DIRECT": num_splits == 1,
        "PRECISION": dot_precision(q.dtype),
        **cache_consts(k_cache, kv_scales),
        "num_warps": num_warps,
        "num_stages": num_stages,
    }


def _check_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor | None,
    num_splits: int,
    min_partition: int,
    block_n: int,
) -> torch.Tensor:
    """Validate; -> the output buffer (allocated when out is None)."""
    check_paged_args(q, k_cache, v_cache)
    if num_splits < 1 or min_partition < block_n or min_partition % block_n:
        raise ValueError(
            f"num_splits={num_splits} must be >= 1 and min_partition={min_partition} a "
            f"positive multiple of block_n={block_n}"
        )
    return output_buffer(q, out)


def cache_consts(k_cache: torch.Tensor, kv_scales: torch.Tensor | None) -> dict[str, bool]:
    """The kernels' constants for the cache's dtype: an FP8 E4M3 cache's tiles, and q, become
    fp16 operands (query_operand, kv_operands); its scales, when given, are applied
    (kv_scales)."""
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    return {"CACHE_FP8": fp8, "KV_SCALED": fp8 and kv_scales is not None}


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs: exact products (tf32 would lose ~1e-3); others ignore the setting."""
    return "ieee" if dtype == torch.float32 else "tf32"


def output_buffer(q: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """out, checked, or a new [T, H, D] tensor of q's dtype."""
    if out is None:
        return torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if out.shape[1:] != q.shape[1:] or out.dtype != q.dtype or out.stride(-1) != 1:
        raise ValueError(
            f"out {tuple(out.shape)} {out.dtype} must be [.., {q.shape[1]}, {q.shape[2]}] "
            f"{q.dtype} with a contiguous last dimension"
        )
    return out


def check_paged_args(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """Shapes and strides the paged kernels rely on; ValueError naming the mismatch."""
    if k_cache.shape != v_cache.shape or k_cache.stride() != v_cache.stride():
        raise ValueError("k_cache and v_cache must have the same shape and strides")
    if k_cache.stride(-1) != 1:
        raise ValueError("KV caches must have a contiguous last (head_dim) dimension")
    num_heads, head_dim = q.shape[1:]
    num_kv_heads = k_cache.shape[2]
    if k_cache.shape[3] != head_dim or num_heads % num_kv_heads:
        raise ValueError(
            f"q [.., {num_heads}, {head_dim}] does not fit caches {tuple(k_cache.shape)}: "
            "head_dim must match and num_heads be a multiple of num_kv_heads"
        )
    if head_dim < 16:
        raise ValueError(f"head_dim={head_dim}: the kernels need head_dim >= 16 for tl.dot")
