"""Paged prefill attention: query chunks of any length against the paged KV cache.

A sequence's chunk of q_len queries holds the last q_len positions of its context_len keys
(chunked prefill); its own K/V are already in the cache. Grid (query tiles, num_heads): tile t
belongs to the sequence i whose tile range [key(i), key(i + 1)) holds it, with
key(i) = (cu[i] - cu[0]) // BLOCK_M + i (an upper bound on the tiles before i), found by a
binary search over cu_seqlens on the device: no host table, no host sync.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from batchgen.engine.kernels.launch import launch, next_power_of_2
from batchgen.engine.kernels.paged_decode import (
    LOG2E,
    NO_WINDOW,
    add_sink,
    cache_consts,
    cache_scales,
    check_paged_args,
    dot_precision,
    kv_operands,
    kv_row_offsets,
    online_softmax_step,
    output_buffer,
    query_operand,
    scores_log2,
)


@triton.jit
def _find_seq(cu_ptr, num_seqs, tile, BLOCK_M: tl.constexpr):
    """Largest i in [0, num_seqs) with key(i) <= tile; cu_ptr points at the first sequence."""
    base = tl.load(cu_ptr)
    lo = 0
    hi = num_seqs
    while lo < hi:  # invariant: key(j) <= tile for j < lo, key(j) > tile for j >= hi
        mid = (lo + hi) // 2
        key = (tl.load(cu_ptr + mid) - base) // BLOCK_M + mid
        if key <= tile:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit(do_not_specialize=["window", "chunk", "softcap_log2", "first_seq", "num_seqs"])
def _prefill_kernel(
    q_ptr,  # [T, H, D]
    k_cache_ptr,  # [num_blocks, BLOCK_SIZE, Hkv, D]; v_cache has the same strides
    v_cache_ptr,
    block_tables_ptr,  # [B, W] int32 (row of sequence i: first_seq + i)
    cu_seqlens_ptr,  # [B + 1] int32, absolute token offsets
    context_lens_ptr,  # [B] int32
    out_ptr,  # [T, H, D]
    sinks_ptr,  # [H] fp32 per-head sink logits (read when HAS_SINKS)
    kv_scale_ptr,  # [2] fp32 the cache's (key, value) scales (read when KV_SCALED)
    scale_log2,
    window,
    chunk,
    softcap_log2,
    first_seq,
    num_seqs,
    stride_qt,
    stride_qh,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_btb,
    stride_btw,
    stride_ot,
    stride_oh,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    PRECISION: tl.constexpr,
    CACHE_FP8: tl.constexpr,
    KV_SCALED: tl.constexpr,
):
    tile = tl.program_id(0)
    head = tl.program_id(1)
    cu_ptr = cu_seqlens_ptr + first_seq
    i = _find_seq(cu_ptr, num_seqs, tile, BLOCK_M)
    q_begin = tl.load(cu_ptr + i)
    q_len = tl.load(cu_ptr + i + 1) - q_begin
    m0 = (tile - (q_begin - tl.load(cu_ptr)) // BLOCK_M - i) * BLOCK_M
    if m0 >= q_len:
        return  # spare tile of the over-allocated grid
    seq = (first_seq + i).to(tl.int64)
    ctx = tl.load(context_lens_ptr + seq)
    rows = m0 + tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    io_mask = (rows < q_len)[:, None] & (d < HEAD_DIM)[None, :]
    tok = (q_begin + rows).to(tl.int64)
    q = tl.load(q_ptr + tok[:, None] * stride_qt + head * stride_qh + d[None, :], mask=io_mask)
    q, qk_scale = query_operand(q, scale_log2, CACHE_FP8)
    qk_scale, v_scale = cache_scales(kv_scale_ptr, qk_scale, KV_SCALED)
    q_pos = ctx - q_len + rows  # [BLOCK_M] position of each query
    hi = tl.minimum(ctx, ctx - q_len + m0 + BLOCK_M)  # keys past the last row are never seen
    first = ctx - q_len + m0  # nor before the first row's window or chunk
    lo = tl.maximum(tl.maximum(first - window + 1, 0), first // chunk * chunk)
    q_chunk = q_pos // chunk * chunk  # [BLOCK_M] first key each row's chunk lets it see
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    bt_row = block_tables_ptr + seq * stride_btb
    head_off = (head // GROUP) * stride_ch + d[None, :]
    for n0 in range(lo // BLOCK_N * BLOCK_N, hi, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        kv_rows = kv_row_offsets(
            bt_row, stride_btw, pos, pos < hi, stride_cb, stride_cs, BLOCK_SIZE
        )
        row_off = kv_rows[:, None] + head_off
        kv_mask = (pos < hi)[:, None] & (d < HEAD_DIM)[None, :]
        k = tl.load(k_cache_ptr + row_off, mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
        v = tl.load(v_cache_ptr + row_off, mask=kv_mask, other=0.0)
        k, v = kv_operands(k, v, CACHE_FP8)
        s = scores_log2(q, k, qk_scale, softcap_log2, HAS_SOFTCAP, PRECISION)
        delta = q_pos[:, None] - pos[None, :]  # [BLOCK_M, BLOCK_N]; seen: 0 <= delta < window
        seen = (delta >= 0) & (delta < window) & (pos[None, :] >= q_chunk[:, None])
        s = tl.where(seen & (pos < hi)[None, :], s, float("-inf"))
        m_i, l_i, acc = online_softmax_step(s, v.to(q.dtype), m_i, l_i, acc, PRECISION)
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + head) * 1.4426950408889634
        l_i, acc = add_sink(m_i, l_i, acc, tl.zeros([BLOCK_M], tl.float32) + sink)
    acc = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    if KV_SCALED:
        acc = acc * v_scale
    o_ptrs = out_ptr + tok[:, None] * stride_ot + head * stride_oh + d[None, :]
    tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=io_mask)


def paged_prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    *,
    num_tokens: int,
    first_seq: int = 0,
    num_seqs: int | None = None,
    window: int | None = None,
    chunk: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    kv_scales: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    block_m: int = 64,
    block_n: int = 64,
    num_warps: int = 4,
    num_stages: int = 2,
) -> torch.Tensor:
    """Causal attention of sequences first_seq .. first_seq + num_seqs - 1 over their paged KV.

    q: [T, H, D] (any strides; token rows indexed by the absolute cu_seqlens_q [B + 1] int32).
    Sequence s's queries are the last (cu[s + 1] - cu[s]) of its context_lens[s] positions.
    num_tokens: cu[first_seq + num_seqs] - cu[first_seq], known on the host (it sizes the grid).
    num_seqs defaults to all sequences from first_seq. window, chunk, softcap, sinks,
    kv_scales: as in paged_decode. Returns out [T, H, D] (q's dtype); rows outside the
    sequences are untouched.
    """
    num_seqs = len(cu_seqlens_q) - 1 - first_seq if num_seqs is None else num_seqs
    _, num_heads, head_dim = q.shape
    check_paged_args(q, k_cache, v_cache)
    out = output_buffer(q, out)
    if num_seqs == 0 or num_tokens == 0:
        return out
    q = q if q.stride(-1) == 1 else q.contiguous()
    grid = (num_tokens // block_m + num_seqs, num_heads)
    launch(_prefill_kernel, grid,
        q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, out,
        sinks if sinks is not None else context_lens,  # never read without sinks
        kv_scales if kv_scales is not None else context_lens,  # nor without scales
        scale * LOG2E, window or NO_WINDOW, chunk or NO_WINDOW, (softcap or 0.0) * LOG2E,
        first_seq, num_seqs,
        *q.stride()[:2], *k_cache.stride()[:3], *block_tables.stride(), *out.stride()[:2],
        GROUP=num_heads // k_cache.shape[2],
        HEAD_DIM=head_dim,
        BLOCK_D=next_power_of_2(head_dim),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_SIZE=k_cache.shape[1],
        HAS_SOFTCAP=softcap is not None,
        HAS_SINKS=sinks is not None,
        PRECISION=dot_precision(q.dtype),
        **cache_consts(k_cache, kv_scales),
        num_warps=num_warps,
        num_stages=num_stages,
    )  # fmt: skip
    return out
