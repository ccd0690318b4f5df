"""The reference attention backend: gather each sequence's KV blocks and attend in PyTorch.

The CPU path and the correctness oracle. Plain causal (and sliding-window) layers use SDPA;
layers with chunked masks, logit soft-capping or attention sinks use an explicit softmax.
"""

from __future__ import annotations

from dataclasses import replace
from itertools import pairwise

import torch
import torch.nn.functional as F

from batchgen.engine.attention.base import AttentionMetadata, LayerSpec
from batchgen.engine.quant.fp8 import FP8_DTYPE, fp8_cache_values

BATCHED_PREFILL_LIMIT = 1 << 22  # sequences x longest chunk x longest context, else a loop


class ReferenceBackend:
    """Plain PyTorch: gather each sequence's blocks and attend. The CPU path and the oracle."""

    def forward(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        meta: AttentionMetadata,
        spec: LayerSpec,
    ) -> torch.Tensor:
        k_cache, v_cache = meta.kv_cache.keys[layer], meta.kv_cache.values[layer]
        scales = meta.kv_cache.layer_scales(layer)
        write_kv_reference(k_cache, v_cache, k, v, meta.slot_mapping, scales)
        k_scale, v_scale = (1.0, 1.0) if scales is None else scales.tolist()
        if k_scale != 1.0:
            spec = replace(spec, scale=spec.scale * k_scale)
        out = self._attend(q, k_cache, v_cache, meta, spec)
        return out if v_scale == 1.0 else (out.float() * v_scale).to(out.dtype)

    def _attend(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        spec: LayerSpec,
    ) -> torch.Tensor:
        """Attention over the caches as they are stored (an FP8 cache's key scale is in
        spec.scale, its value scale is applied by the caller)."""
        out = torch.empty_like(q)
        cu, lens = meta.cu_seqlens_q_host, meta.context_lens_host
        nd = meta.num_decodes
        if nd:
            out[:nd] = decode_batched(
                q[:nd], k_cache, v_cache, meta.block_tables[:nd], meta.context_lens[:nd],
                max(lens[:nd]), spec,
            )  # fmt: skip
        starts, sizes, ctxs = cu[nd:-1], [b - a for a, b in pairwise(cu[nd:])], lens[nd:]
        if len(ctxs) > 1 and len(ctxs) * max(sizes) * max(ctxs) <= BATCHED_PREFILL_LIMIT:
            rows = slice(cu[nd], cu[-1])
            out[rows] = prefill_batched(
                q[rows], k_cache, v_cache, meta.block_tables[nd:], sizes, ctxs, spec
            )
            return out
        for i, (start, size, ctx) in enumerate(zip(starts, sizes, ctxs, strict=True), start=nd):
            keys, values = gather_sequence(k_cache, v_cache, meta.block_tables[i], ctx)
            q_pos = torch.arange(ctx - size, ctx, device=q.device)[:, None]
            mask = visible(q_pos, torch.arange(ctx, device=q.device)[None, :], spec)
            out[start : start + size] = attend(
                q[start : start + size].transpose(0, 1)[None],
                keys.transpose(0, 1)[None],
                values.transpose(0, 1)[None],
                mask[None, None],
                spec,
            )[0].transpose(0, 1)
        return out


def visible(q_pos: torch.Tensor, k_pos: torch.Tensor, spec: LayerSpec) -> torch.Tensor:
    """Broadcast positions -> bool: may a query at q_pos see the key at k_pos."""
    mask = k_pos <= q_pos
    if spec.window is not None:
        mask &= k_pos > q_pos - spec.window
    if spec.chunk is not None:
        mask &= k_pos >= torch.div(q_pos, spec.chunk, rounding_mode="floor") * spec.chunk
    return mask


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, spec: LayerSpec
) -> torch.Tensor:
    """q: [B, H, Lq, D], k/v: [B, Hkv, Lk, D], mask: bool broadcastable to [B, H, Lq, Lk]."""
    k, v = k.to(q.dtype), v.to(q.dtype)
    if spec.softcap is None and spec.sinks is None:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=spec.scale, enable_gqa=True
        )
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = (q.float() @ k.float().transpose(-1, -2)) * spec.scale  # [B, H, Lq, Lk]
    if spec.softcap is not None:
        scores = torch.tanh(scores / spec.softcap) * spec.softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    if spec.sinks is not None:
        sink = spec.sinks.float().reshape(1, -1, 1, 1).expand(*scores.shape[:3], 1)
        scores = torch.cat([scores, sink], dim=-1)
    probs = torch.softmax(scores, dim=-1)
    if spec.sinks is not None:
        probs = probs[..., :-1]
    return (probs @ v.float()).to(q.dtype)


def prefill_batched(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    sizes: list[int],
    ctxs: list[int],
    spec: LayerSpec,
) -> torch.Tensor:
    """All prefill chunks in one padded attention. q: [sum(sizes), H, D] -> same shape.

    Chunk i holds the last sizes[i] positions of its ctxs[i]-token context.
    """
    device, n, q_max, ctx_max = q.device, len(sizes), max(sizes), max(ctxs)
    seq = torch.repeat_interleave(
        torch.arange(n, device=device), torch.tensor(sizes, device=device)
    )
    first = torch.tensor([0, *sizes[:-1]], device=device).cumsum(0)
    row = torch.arange(q.shape[0], device=device) - first[seq]  # position within its chunk
    padded = q.new_zeros(n, q_max, *q.shape[1:])
    padded[seq, row] = q
    block_size = k_cache.shape[1]
    tables = block_tables[:, : (ctx_max + block_size - 1) // block_size].long()
    keys = k_cache[tables].flatten(1, 2)[:, :ctx_max]  # [n, L, Hkv, D]; -1 rows are masked
    values = v_cache[tables].flatten(1, 2)[:, :ctx_max]
    ctx = torch.tensor(ctxs, device=device)[:, None, None]
    q_pos = (
        ctx
        - torch.tensor(sizes, device=device)[:, None, None]
        + torch.arange(q_max, device=device)[None, :, None]
    )
    k_pos = torch.arange(ctx_max, device=device)[None, None, :]
    mask = visible(q_pos, k_pos, spec) & (k_pos < ctx)
    padding = (
        torch.arange(q_max, device=device)[None, :, None]
        >= torch.tensor(sizes, device=device)[:, None, None]
    )
    mask |= padding & (k_pos == 0)  # padded query rows attend somewhere; their output is dropped
    out = attend(
        padded.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2), mask[:, None], spec
    )
    return out.transpose(1, 2)[seq, row]


def write_kv_reference(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_scales: torch.Tensor | None = None,
) -> None:
    """write_kv's result: an FP8 cache holds x / scale, saturated (out-of-range values would
    be NaN)."""
    valid = slot_mapping >= 0
    slots = slot_mapping[valid]
    k, v = k[valid], v[valid]
    if k_cache.dtype == FP8_DTYPE:
        k_scale, v_scale = (1.0, 1.0) if kv_scales is None else kv_scales
        k, v = fp8_cache_values(k, k_scale), fp8_cache_values(v, v_scale)
    k_cache.view(-1, *k_cache.shape[2:])[slots] = k.to(k_cache.dtype)
    v_cache.view(-1, *v_cache.shape[2:])[slots] = v.to(v_cache.dtype)


def decode_batched(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    max_ctx: int,
    spec: LayerSpec,
) -> torch.Tensor:
    """One attention for all one-token sequences. q: [B, H, D] -> [B, H, D]."""
    block_size = k_cache.shape[1]
    tables = block_tables[:, : (max_ctx + block_size - 1) // block_size].long()
    keys = k_cache[tables].flatten(1, 2)  # [B, L, Hkv, D]; -1 entries read a masked block
    values = v_cache[tables].flatten(1, 2)
    k_pos = torch.arange(keys.shape[1], device=q.device)[None, :]
    q_pos = (context_lens.long() - 1)[:, None]
    mask = visible(q_pos, k_pos, spec)
    out = attend(
        q[:, :, None], keys.transpose(1, 2), values.transpose(1, 2), mask[:, None, None, :], spec
    )
    return out[:, :, 0]


def gather_sequence(
    k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor, ctx: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> keys, values: [ctx, Hkv, D] in position order."""
    block_size = k_cache.shape[1]
    blocks = block_table[: (ctx + block_size - 1) // block_size].long()
    keys = k_cache[blocks].flatten(0, 1)[:ctx]
    values = v_cache[blocks].flatten(0, 1)[:ctx]
    return keys, values
