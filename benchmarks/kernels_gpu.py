"""Triton attention kernels on the GPU: correctness (bf16 vs a float32 ReferenceBackend) and speed.

    python benchmarks/kernels_gpu.py [--quick]

Times are triton.testing.do_bench medians (L2 flushed between runs). Decode reports achieved
bandwidth (KV read + q + out) against the H200's 4.25 TB/s device copy; prefill reports TFLOP/s
(causal pairs only) next to torch's varlen_attn on contiguous K/V. A small config sweep shows
which tiles to make default (TritonTuning); "forward (host)" is the CPU time of one
TritonBackend.forward, i.e. the eager launch cost per layer. The summary table prints last.
Target: < 3 minutes on one H200.
"""

from __future__ import annotations

import argparse
import inspect
import time
from typing import NamedTuple

import torch
import triton
from triton.testing import do_bench

from batchgen.bench.roof import H200_REFERENCE
from batchgen.engine.attention import AttentionMetadata, KVCache, LayerSpec, ReferenceBackend
from batchgen.engine.attention.triton import TritonBackend
from batchgen.engine.kernels import paged_decode, paged_prefill, plan_decode_splits, write_kv

PEAK_BW = H200_REFERENCE.copy_bandwidth  # bytes/s, device copy (read + write)
PEAK_FLOPS = H200_REFERENCE.matmul_peak  # bf16 matmul
BLOCK = 16
SHAPES = {"8b": (32, 8, 128), "1b": (32, 8, 64)}  # (heads, kv heads, head_dim)
REF_ROWS = 32  # decode rows checked against the reference (the oracle is slow and big)
DECODE_CONFIGS = [(64, 4, 2), (32, 4, 2), (128, 4, 2), (64, 4, 3), (128, 8, 3)]  # bn, warps, st
PREFILL_CONFIGS = [(64, 64, 4, 2), (64, 64, 4, 3), (128, 64, 8, 2), (128, 32, 4, 3)]  # +bm first


class Row(NamedTuple):
    kernel: str
    case: str
    config: str
    us: float
    rate: str  # GB/s or TFLOP/s
    roof: float  # fraction of the roofline
    err: float  # relative error vs the float32 reference (nan: not checked)


class Paged(NamedTuple):
    k_cache: torch.Tensor  # [num_blocks, BLOCK, Hkv, D]
    v_cache: torch.Tensor
    tables: torch.Tensor  # [B, W] int32, blocks scattered at random
    ctx: list[int]


def paged(ctx: list[int], kv_heads: int, head_dim: int, gen: torch.Generator) -> Paged:
    need = [triton.cdiv(c, BLOCK) for c in ctx]
    shape = (sum(need) + 1, BLOCK, kv_heads, head_dim)
    k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    tables = torch.full((len(ctx), max(need)), -1, dtype=torch.int32)
    perm, at = torch.randperm(sum(need), generator=gen).int(), 0
    for i, n in enumerate(need):
        tables[i, :n], at = perm[at : at + n], at + n
    return Paged(k, v, tables.cuda(), ctx)


def reference(q: torch.Tensor, p: Paged, q_lens: list[int], window: int | None) -> torch.Tensor:
    """ReferenceBackend in float32 over the sequences of q_lens (first rows of the tables)."""
    n = len(q_lens)
    used = p.tables[:n]
    k = p.k_cache[used.clamp(min=0).flatten()].float()  # compact copy of the used blocks
    v = p.v_cache[used.clamp(min=0).flatten()].float()
    tables = torch.arange(used.numel(), device="cuda").view(used.shape).int()
    tables = torch.where(used >= 0, tables, -1)
    cu = [0]
    for m in q_lens:
        cu.append(cu[-1] + m)
    backend = ReferenceBackend()
    meta = AttentionMetadata(
        slot_mapping=torch.full((cu[-1],), -1, device="cuda"),
        cu_seqlens_q=torch.tensor(cu, device="cuda").int(),
        context_lens=torch.tensor(p.ctx[:n], device="cuda").int(),
        block_tables=tables,
        cu_seqlens_q_host=cu,
        context_lens_host=p.ctx[:n],
        max_query_len=max(q_lens),
        max_context_len=max(p.ctx[:n]),
        num_decodes=0,  # per-sequence SDPA: the plainest oracle
        kv_cache=KVCache([k], [v]),
        backend=backend,
    )
    kv = torch.zeros(cu[-1], k.shape[2], k.shape[3], device="cuda")
    spec = LayerSpec(scale=q.shape[-1] ** -0.5, window=window)
    return backend.forward(0, q[: cu[-1]].float(), kv, kv, meta, spec)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref).norm() / ref.norm()).item()


def bench_decode(name: str, dist: tuple[int, int], batch: int, quick: bool) -> list[Row]:
    heads, kv_heads, head_dim = SHAPES[name]
    gen = torch.Generator().manual_seed(0)
    ctx = torch.randint(dist[0], dist[1] + 1, (batch,), generator=gen).tolist()
    p = paged(ctx, kv_heads, head_dim, gen)
    q = torch.randn(batch, heads, head_dim, device="cuda", dtype=torch.bfloat16)
    lens = torch.tensor(ctx, device="cuda").int()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    splits = plan_decode_splits(batch, kv_heads, p.tables.shape[1] * BLOCK, target_programs=4 * sms)
    moved = (sum(ctx) * kv_heads * 2 + 2 * batch * heads) * head_dim * 2  # bytes: K+V, q, out
    case = f"{name} B={batch} ctx {dist[0]}-{dist[1]}"
    ref = reference(q, p, [1] * min(REF_ROWS, batch), None)
    rows = []
    for bn, warps, stages in DECODE_CONFIGS[: 1 if quick else None]:

        def run(bn: int = bn, warps: int = warps, stages: int = stages) -> torch.Tensor:
            return paged_decode(q, p.k_cache, p.v_cache, p.tables, lens, head_dim**-0.5,
                                num_splits=splits, block_n=bn, num_warps=warps,
                                num_stages=stages)  # fmt: skip

        err = rel_err(run()[: len(ref)], ref)
        ms = do_bench(run, return_mode="median")
        bw = moved / ms / 1e-3
        cfg = f"S={splits} bn={bn} w={warps} st={stages}"
        rows.append(Row("decode", case, cfg, ms * 1e3, f"{bw / 1e9:.0f} GB/s", bw / PEAK_BW, err))
    return rows


def bench_prefill(name: str, num_seqs: int, q_len: int, prior: int, quick: bool) -> list[Row]:
    heads, kv_heads, head_dim = SHAPES[name]
    gen = torch.Generator().manual_seed(1)
    ctx = [prior + q_len] * num_seqs
    p = paged(ctx, kv_heads, head_dim, gen)
    total = num_seqs * q_len
    q = torch.randn(total, heads, head_dim, device="cuda", dtype=torch.bfloat16)
    cu = torch.arange(0, total + 1, q_len, device="cuda").int()
    lens = torch.tensor(ctx, device="cuda").int()
    pairs = num_seqs * (q_len * prior + q_len * (q_len + 1) // 2)  # causal (query, key) pairs
    flops = 4 * pairs * heads * head_dim
    case = f"{name} {num_seqs}x{q_len}" + (f" +{prior} ctx" if prior else "")
    ref = reference(q, p, [q_len], None)  # first sequence
    rows = []
    for bm, bn, warps, stages in PREFILL_CONFIGS[: 1 if quick else None]:

        def run(bm: int = bm, bn: int = bn, warps: int = warps, st: int = stages) -> torch.Tensor:
            return paged_prefill(q, p.k_cache, p.v_cache, p.tables, cu, lens, head_dim**-0.5,
                                 num_tokens=total, block_m=bm, block_n=bn, num_warps=warps,
                                 num_stages=st)  # fmt: skip

        err = rel_err(run()[:q_len], ref)
        ms = do_bench(run, return_mode="median")
        tf = flops / ms / 1e-3
        cfg = f"bm={bm} bn={bn} w={warps} st={stages}"
        rows.append(
            Row("prefill", case, cfg, ms * 1e3, f"{tf / 1e12:.0f} TFLOP/s", tf / PEAK_FLOPS, err)
        )
    if not prior:
        rows.append(bench_varlen(q, p, ref, q_len, num_seqs, flops, case))
    return rows


def varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor,
           cu_k: torch.Tensor, max_q: int, max_k: int) -> torch.Tensor:  # fmt: skip
    """torch's varlen_attn, causal (window (-1, 0)); enable_gqa where the version has it."""
    from torch.nn.attention.varlen import varlen_attn

    kwargs = (
        {"enable_gqa": True} if "enable_gqa" in inspect.signature(varlen_attn).parameters else {}
    )
    return varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, scale=q.shape[-1] ** -0.5,
                       window_size=(-1, 0), **kwargs)  # fmt: skip


def bench_varlen(q: torch.Tensor, p: Paged, ref: torch.Tensor, q_len: int, num_seqs: int,
                 flops: int, case: str) -> Row:  # fmt: skip
    """The same fresh prefill through varlen_attn on contiguous K/V (gathered once, untimed)."""
    keys = p.k_cache[p.tables.clamp(min=0).long()].flatten(0, 2)  # [B * W * BLOCK, Hkv, D]
    keys = keys.view(num_seqs, -1, *keys.shape[1:])[:, :q_len].flatten(0, 1)
    values = p.v_cache[p.tables.clamp(min=0).long()].flatten(0, 2)
    values = values.view(num_seqs, -1, *values.shape[1:])[:, :q_len].flatten(0, 1)
    cu = torch.arange(0, q.shape[0] + 1, q_len, device="cuda").int()
    try:
        err = rel_err(varlen(q, keys, values, cu, cu, q_len, q_len)[:q_len], ref)
        ms = do_bench(lambda: varlen(q, keys, values, cu, cu, q_len, q_len), return_mode="median")
    except Exception as e:
        print(f"varlen_attn failed: {type(e).__name__}: {str(e).splitlines()[0]}")
        return Row("varlen_attn", case, "failed", float("nan"), "-", float("nan"), float("nan"))
    tf = flops / ms / 1e-3
    return Row("varlen_attn", case, "contig K/V", ms * 1e3, f"{tf / 1e12:.0f} TFLOP/s",
               tf / PEAK_FLOPS, err)  # fmt: skip


def varlen_alignment() -> str:
    """Is varlen_attn's causal mask bottom-right aligned when q_len < k_len?"""
    gen = torch.Generator(device="cuda").manual_seed(2)
    q = torch.randn(4, 2, 64, device="cuda", dtype=torch.bfloat16, generator=gen)
    k, v = (
        torch.randn(12, 2, 64, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2)
    )
    cu_q, cu_k = (torch.tensor([0, n], device="cuda").int() for n in (4, 12))
    try:
        out = varlen(q, k, v, cu_q, cu_k, 4, 12).float()
    except Exception as e:
        return f"varlen_attn with q_len < k_len failed: {type(e).__name__}: {str(e)[:200]}"
    errs = {}
    for name, offset in (("bottom-right", 8), ("top-left", 0)):
        mask = (
            torch.arange(12, device="cuda")[None]
            <= torch.arange(4, device="cuda")[:, None] + offset
        )
        ref = torch.nn.functional.scaled_dot_product_attention(
            q.float().transpose(0, 1), k.float().transpose(0, 1), v.float().transpose(0, 1),
            attn_mask=mask, scale=64**-0.5).transpose(0, 1)  # fmt: skip
        errs[name] = rel_err(out, ref)
    best = min(errs, key=errs.get)
    return f"varlen_attn causal mask with q_len < k_len: {best} ({errs})"


def bench_write(num_tokens: int) -> Row:
    heads, kv_heads, head_dim = SHAPES["8b"]
    gen = torch.Generator().manual_seed(3)
    p = paged([num_tokens + 64], kv_heads, head_dim, gen)
    qkv = torch.randn(
        num_tokens, heads + 2 * kv_heads, head_dim, device="cuda", dtype=torch.bfloat16
    )
    k, v = qkv[:, heads : heads + kv_heads], qkv[:, heads + kv_heads :]  # strided, as in a model
    slots = torch.randperm(p.k_cache.shape[0] * BLOCK, generator=gen)[:num_tokens].cuda()
    slots[::17] = -1  # some padding
    ref_k, ref_v = p.k_cache.clone(), p.v_cache.clone()
    write_kv(k, v, p.k_cache, p.v_cache, slots)
    valid = slots >= 0
    ref_k.view(-1, kv_heads, head_dim)[slots[valid]] = k[valid]
    ref_v.view(-1, kv_heads, head_dim)[slots[valid]] = v[valid]
    ok = torch.equal(ref_k, p.k_cache) and torch.equal(ref_v, p.v_cache)
    ms = do_bench(lambda: write_kv(k, v, p.k_cache, p.v_cache, slots), return_mode="median")
    moved = 2 * 2 * num_tokens * kv_heads * head_dim * 2  # read + write, K and V, bf16
    bw = moved / ms / 1e-3
    return Row("kv_write", f"8b T={num_tokens}", "", ms * 1e3, f"{bw / 1e9:.0f} GB/s",
               bw / PEAK_BW, 0.0 if ok else float("inf"))  # fmt: skip


def bench_host_overhead() -> Row:
    """Host time of one TritonBackend.forward (one decode sequence): the per-layer launch cost."""
    heads, kv_heads, head_dim = SHAPES["8b"]
    p = paged([100], kv_heads, head_dim, torch.Generator().manual_seed(4))
    backend = TritonBackend()
    meta = AttentionMetadata(
        slot_mapping=torch.tensor([99], device="cuda"),
        cu_seqlens_q=torch.tensor([0, 1], device="cuda").int(),
        context_lens=torch.tensor([100], device="cuda").int(),
        block_tables=p.tables,
        cu_seqlens_q_host=[0, 1],
        context_lens_host=[100],
        max_query_len=1,
        max_context_len=100,
        num_decodes=1,
        kv_cache=KVCache([p.k_cache], [p.v_cache]),
        backend=backend,
    )
    q = torch.randn(1, heads, head_dim, device="cuda", dtype=torch.bfloat16)
    k, v = q[:, :kv_heads], q[:, kv_heads : 2 * kv_heads]
    for _ in range(3):  # compile
        backend.forward(0, q, k, v, meta, LayerSpec(scale=head_dim**-0.5))
    torch.cuda.synchronize()
    started, calls = time.perf_counter(), 200
    for _ in range(calls):
        backend.forward(0, q, k, v, meta, LayerSpec(scale=head_dim**-0.5))
    us = (time.perf_counter() - started) / calls * 1e6
    torch.cuda.synchronize()
    return Row("forward", "8b B=1 decode (host)", "kv_write+decode", us, "-", float("nan"),
               float("nan"))  # fmt: skip


def print_table(rows: list[Row]) -> None:
    print(
        f"\n{'kernel':<12}{'case':<26}{'config':<24}{'us':>9}{'rate':>15}{'roof':>7}{'rel err':>10}"
    )
    for r in rows:
        print(f"{r.kernel:<12}{r.case:<26}{r.config:<24}{r.us:>9.1f}{r.rate:>15}"
              f"{r.roof:>7.1%}{r.err:>10.1e}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="default configs only")
    quick = parser.parse_args().quick
    torch.manual_seed(0)
    rows: list[Row] = []
    for name in SHAPES:
        for dist in ((128, 768), (2048, 2560), (4096, 4096)):
            rows += bench_decode(name, dist, 256, quick)
            print(rows[-1])
        rows += bench_decode(name, (4096, 4096), 8, quick)  # few sequences: splits matter
        rows += bench_prefill(name, 4, 2048, 0, quick)
        rows += bench_prefill(name, 4, 512, 1536, quick)  # a chunk after prior context
        print(rows[-1])
    rows += [bench_write(256), bench_write(8192), bench_host_overhead()]
    print(varlen_alignment())
    print_table(rows)


if __name__ == "__main__":
    main()
