"""Triton attention backend: fused KV write, paged decode (flash-decoding), paged varlen prefill.

Triton is imported when a TritonBackend is built, never at module import, so CPU-only installs
can import this module.
"""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass
from itertools import pairwise
from typing import NamedTuple

import torch

from batchgen.engine.attention.base import AttentionMetadata, LayerSpec

PROGRAMS_PER_SM = 4  # decode programs wanted per SM before the KV range is split further
CPU_TARGET_PROGRAMS = 8  # the interpreter has no SMs: a small number keeps tests quick


@dataclass(frozen=True)
class TritonTuning:
    """Tile sizes and split policy; defaults are for bf16 Llama shapes on an H200."""

    decode_block_n: int = 64  # keys per inner-loop tile
    decode_min_partition: int = 256  # fewest keys a split is given
    decode_max_splits: int = 64
    decode_num_warps: int = 4
    decode_num_stages: int = 2
    # an 8-bit (FP8) cache, fp16 operands: on an H200 at batch 256 (8b heads), 64 / 32 keys
    # with 2 warps took 90.5 / 94.0 us per layer at contexts 300-500, 142.6 / 151 us at 600-800
    decode_8bit_block_n: int = 64
    decode_8bit_num_warps: int = 2
    prefill_block_m: int = 64  # queries per program
    prefill_small_block_m: int = 16  # for steps whose prefill chunks are all this short
    prefill_block_n: int = 64
    prefill_num_warps: int = 4
    prefill_num_stages: int = 2

    def __post_init__(self) -> None:
        for name in (
            "decode_block_n",
            "decode_8bit_block_n",
            "prefill_block_m",
            "prefill_small_block_m",
            "prefill_block_n",
        ):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"{name}={value}: must be a power of two >= 16")
        for name in ("decode_block_n", "decode_8bit_block_n"):
            if self.decode_min_partition % getattr(self, name):
                raise ValueError(
                    f"decode_min_partition={self.decode_min_partition}: must be a multiple of "
                    f"{name}={getattr(self, name)}"
                )

    def decode_tiles(self, cache_dtype: torch.dtype) -> tuple[int, int]:
        """(keys per tile, warps) of the decode kernel for a cache of this dtype."""
        if cache_dtype.itemsize == 1:
            return self.decode_8bit_block_n, self.decode_8bit_num_warps
        return self.decode_block_n, self.decode_num_warps


class TritonPlan(NamedTuple):
    """One step's launch parameters, from host-side metadata only (computed once per step).
    For a step padded to a graph's shape, from that shape only (counts on the device)."""

    num_decodes: int  # decode attention's rows: sequences [0, num_decodes), at those rows
    num_splits: int  # decode KV partitions per sequence (from shapes only: graph-safe)
    first_prefill: int  # prefill attention's sequences: [first_prefill, + num_prefills)
    num_prefills: int
    num_prefill_tokens: int  # their tokens (an upper bound: it sizes the grid)
    prefill_block_m: int
    decode_block_n: int  # keys per decode tile, for the cache's dtype
    decode_num_warps: int


class TritonBackend:
    """AttentionBackend on Triton kernels: write K/V, then decode rows, then prefill rows.

    Decode-only steps are CUDA-graph capturable: nothing on the decode path reads contexts on
    the host, so a warm-up run compiles exactly what its capture will launch.
    """

    graphable = True
    fuses_rotary = True  # forward() takes q and k unrotated with their cos/sin (one launch)

    def __init__(self, tuning: TritonTuning | None = None) -> None:
        from batchgen.engine import kernels  # imports triton

        self.kernels = kernels
        self.tuning = tuning or TritonTuning()
        # the step the plan is for, weakly: the metadata holds this backend, so a strong
        # reference would be a cycle keeping the KV cache alive after the engine closes
        self._planned: weakref.ref[AttentionMetadata] | None = None
        self._plan: TritonPlan | None = None

    def plan(self, meta: AttentionMetadata) -> TritonPlan:
        """The step's plan, computed on the first layer and reused while meta is the same."""
        planned = self._planned() if self._planned is not None else None
        if meta is not planned or self._plan is None:
            self._plan = self._make_plan(meta)
            self._planned = weakref.ref(meta)
        return self._plan

    def forward(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        meta: AttentionMetadata,
        spec: LayerSpec,
        rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """q: [T, H, D], k/v: [T, Hkv, D] -> [T, H, D]; also writes k/v into the cache.
        rotary: (cos, sin) where q and k are still to be rotated (rotate-half), fused with
        the KV write."""
        plan, kern, tune = self.plan(meta), self.kernels, self.tuning
        scale, window = spec.scale, spec.window
        extra = {"chunk": spec.chunk, "softcap": spec.softcap, "sinks": spec.sinks}
        k_cache, v_cache = meta.kv_cache.keys[layer], meta.kv_cache.values[layer]
        extra["kv_scales"] = scales = meta.kv_cache.layer_scales(layer)
        if rotary is None:
            kern.write_kv(k, v, k_cache, v_cache, meta.slot_mapping, scales)
        else:
            q = kern.rope_write_kv(q, k, v, *rotary, k_cache, v_cache, meta.slot_mapping, scales)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        shaped = meta.decode_context_lens is not None  # counts on the device (_make_plan)
        decode_lens = meta.decode_context_lens if shaped else meta.context_lens
        prefill_cu = meta.prefill_cu_seqlens if shaped else meta.cu_seqlens_q
        if plan.num_decodes:
            kern.paged_decode(
                q, k_cache, v_cache, meta.block_tables, decode_lens, scale,
                window=window, num_seqs=plan.num_decodes, num_splits=plan.num_splits, **extra,
                min_partition=tune.decode_min_partition, out=out, block_n=plan.decode_block_n,
                num_warps=plan.decode_num_warps, num_stages=tune.decode_num_stages,
            )  # fmt: skip
        if plan.num_prefills:
            kern.paged_prefill(
                q, k_cache, v_cache, meta.block_tables, prefill_cu, meta.context_lens,
                scale, num_tokens=plan.num_prefill_tokens, first_seq=plan.first_prefill,
                num_seqs=plan.num_prefills, window=window, out=out, **extra,
                block_m=plan.prefill_block_m, block_n=tune.prefill_block_n,
                num_warps=tune.prefill_num_warps, num_stages=tune.prefill_num_stages,
            )  # fmt: skip
        return out

    def _make_plan(self, meta: AttentionMetadata) -> TritonPlan:
        tune, cu = self.tuning, meta.cu_seqlens_q_host
        num_seqs = len(cu) - 1
        if meta.decode_context_lens is not None:  # from the padded shape only (a graph's
            # capture sees no real rows): decode attention over every row that can be a
            # decode row, prefill over every sequence and token (AttentionMetadata's
            # device-side views make each skip what is not its own)
            num_tokens = meta.slot_mapping.shape[0]
            shape = self._plan_shape(meta, min(num_seqs, num_tokens))
            return shape._replace(
                first_prefill=0, num_prefills=num_seqs, num_prefill_tokens=num_tokens
            )
        plan = self._plan_shape(meta, meta.num_decodes)
        longest = max((b - a for a, b in pairwise(cu[plan.num_decodes :])), default=0)
        small = longest <= tune.prefill_small_block_m
        return plan._replace(
            first_prefill=plan.num_decodes,
            num_prefills=num_seqs - plan.num_decodes,
            num_prefill_tokens=cu[-1] - cu[plan.num_decodes],
            prefill_block_m=tune.prefill_small_block_m if small else tune.prefill_block_m,
        )

    def _plan_shape(self, meta: AttentionMetadata, num_decodes: int) -> TritonPlan:
        """The plan's decode part for num_decodes rows, without prefill rows."""
        tune = self.tuning
        k_cache = meta.kv_cache.keys[0]
        num_splits = self.kernels.plan_decode_splits(
            num_decodes,
            k_cache.shape[2],
            meta.block_tables.shape[1] * k_cache.shape[1],
            target_programs=_target_programs(k_cache.device),
            min_partition=tune.decode_min_partition,
            max_splits=tune.decode_max_splits,
        )
        block_n, warps = tune.decode_tiles(k_cache.dtype)
        return TritonPlan(
            num_decodes=num_decodes,
            num_splits=num_splits,
            first_prefill=num_decodes,
            num_prefills=0,
            num_prefill_tokens=0,
            prefill_block_m=tune.prefill_block_m,
            decode_block_n=block_n,
            decode_num_warps=warps,
        )


def _target_programs(device: torch.device) -> int:
    if device.type != "cuda":
        return CPU_TARGET_PROGRAMS
    return PROGRAMS_PER_SM * _sm_count(device.index or 0)


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count
