"""batchgen's attention for Hugging Face models: a paged KV cache and the per-step metadata.

The function registered with transformers' AttentionInterface writes the layer's new K/V into
the paged cache and attends over it. Models run unchanged: they pass our metadata through
their forward **kwargs as `batchgen_meta`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import pairwise
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

ATTENTION_NAME = "batchgen"


@dataclass
class KVCache:
    """Per layer: key and value blocks, each [num_blocks, block_size, num_kv_heads, head_dim]."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]

    @classmethod
    def allocate(
        cls,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> KVCache:
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        return cls(keys, values)

    @staticmethod
    def bytes_per_block(
        num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        return 2 * num_layers * block_size * num_kv_heads * head_dim * dtype.itemsize


@dataclass
class AttentionMetadata:
    """One step's packed batch. B sequences, T tokens; the first num_decodes have one query each."""

    slot_mapping: torch.Tensor  # [T] int64: flat cache slot of each new token, -1 = padding
    cu_seqlens_q: torch.Tensor  # [B + 1] int32: query offsets into the packed tokens
    context_lens: torch.Tensor  # [B] int32: KV length of each sequence after this step
    block_tables: torch.Tensor  # [B, max_blocks] int32, -1 = unused
    cu_seqlens_q_host: list[int]
    context_lens_host: list[int]
    max_query_len: int
    max_context_len: int
    num_decodes: int
    kv_cache: KVCache
    backend: AttentionBackend


class AttentionBackend(Protocol):
    def forward(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        window: int | None,
    ) -> torch.Tensor:
        """q: [T, H, D], k/v: [T, Hkv, D] -> [T, H, D]; also writes k/v into the cache."""
        ...


class ReferenceBackend:
    """Plain PyTorch: gather each sequence's blocks and run SDPA. The CPU path and the oracle."""

    def forward(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        window: int | None,
    ) -> torch.Tensor:
        k_cache, v_cache = meta.kv_cache.keys[layer], meta.kv_cache.values[layer]
        write_kv_reference(k_cache, v_cache, k, v, meta.slot_mapping)
        out = torch.empty_like(q)
        cu, lens = meta.cu_seqlens_q_host, meta.context_lens_host
        nd = meta.num_decodes
        if nd:
            out[:nd] = decode_batched(
                q[:nd],
                k_cache,
                v_cache,
                meta.block_tables[:nd],
                meta.context_lens[:nd],
                max(lens[:nd]),
                scale,
                window,
            )
        starts, sizes, ctxs = cu[nd:-1], [b - a for a, b in pairwise(cu[nd:])], lens[nd:]
        if len(ctxs) > 1 and len(ctxs) * max(sizes) * max(ctxs) <= BATCHED_PREFILL_LIMIT:
            rows = slice(cu[nd], cu[-1])
            out[rows] = prefill_batched(
                q[rows], k_cache, v_cache, meta.block_tables[nd:], sizes, ctxs, scale, window
            )
            return out
        for i, (start, size, ctx) in enumerate(zip(starts, sizes, ctxs, strict=True), start=nd):
            keys, values = gather_sequence(k_cache, v_cache, meta.block_tables[i], ctx)
            mask = causal_mask(size, ctx, window, q.device)
            out[start : start + size] = sdpa_one(q[start : start + size], keys, values, mask, scale)
        return out


BATCHED_PREFILL_LIMIT = 1 << 22  # sequences x longest chunk x longest context, else a loop


def prefill_batched(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    sizes: list[int],
    ctxs: list[int],
    scale: float,
    window: int | None,
) -> torch.Tensor:
    """All prefill chunks in one padded SDPA. q: [sum(sizes), H, D] -> same shape.

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
    mask = (k_pos <= q_pos) & (k_pos < ctx)
    if window is not None:
        mask &= k_pos > q_pos - window
    padding = (
        torch.arange(q_max, device=device)[None, :, None]
        >= torch.tensor(sizes, device=device)[:, None, None]
    )
    mask |= padding & (k_pos == 0)  # padded query rows attend somewhere; their output is dropped
    out = F.scaled_dot_product_attention(
        padded.transpose(1, 2),
        keys.transpose(1, 2).to(q.dtype),
        values.transpose(1, 2).to(q.dtype),
        attn_mask=mask[:, None],
        scale=scale,
        enable_gqa=True,
    )
    return out.transpose(1, 2)[seq, row]


def write_kv_reference(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    valid = slot_mapping >= 0
    slots = slot_mapping[valid]
    k_cache.view(-1, *k_cache.shape[2:])[slots] = k[valid].to(k_cache.dtype)
    v_cache.view(-1, *v_cache.shape[2:])[slots] = v[valid].to(v_cache.dtype)


def decode_batched(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    max_ctx: int,
    scale: float,
    window: int | None,
) -> torch.Tensor:
    """One SDPA for all one-token sequences. q: [B, H, D] -> [B, H, D]."""
    block_size = k_cache.shape[1]
    tables = block_tables[:, : (max_ctx + block_size - 1) // block_size].long()
    keys = k_cache[tables].flatten(1, 2)  # [B, L, Hkv, D]; -1 entries read a masked block
    values = v_cache[tables].flatten(1, 2)
    k_pos = torch.arange(keys.shape[1], device=q.device)[None, :]
    q_pos = (context_lens.long() - 1)[:, None]
    mask = k_pos <= q_pos
    if window is not None:
        mask &= k_pos > q_pos - window
    out = F.scaled_dot_product_attention(
        q[:, :, None],
        keys.transpose(1, 2).to(q.dtype),
        values.transpose(1, 2).to(q.dtype),
        attn_mask=mask[:, None, None, :],
        scale=scale,
        enable_gqa=True,
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


def causal_mask(
    num_queries: int, ctx: int, window: int | None, device: torch.device
) -> torch.Tensor:
    """[num_queries, ctx] bool: the queries are the last num_queries positions of ctx."""
    q_pos = torch.arange(ctx - num_queries, ctx, device=device)[:, None]
    k_pos = torch.arange(ctx, device=device)[None, :]
    mask = k_pos <= q_pos
    if window is not None:
        mask &= k_pos > q_pos - window
    return mask


def sdpa_one(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """q: [n, H, D], keys/values: [ctx, Hkv, D], mask: [n, ctx] -> [n, H, D]."""
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1),
        keys.transpose(0, 1).to(q.dtype),
        values.transpose(0, 1).to(q.dtype),
        attn_mask=mask,
        scale=scale,
        enable_gqa=True,
    )
    return out.transpose(0, 1)


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
    """transformers attention interface. query: [1, H, T, D], key/value: [1, Hkv, T, D]."""
    meta: AttentionMetadata | None = kwargs.get("batchgen_meta")
    if meta is None:
        raise RuntimeError("batchgen attention called without batchgen_meta: run through Engine")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    window = kwargs.get("sliding_window") or getattr(module, "sliding_window", None)
    out = meta.backend.forward(
        module.layer_idx,
        query[0].transpose(0, 1),
        key[0].transpose(0, 1),
        value[0].transpose(0, 1),
        meta,
        scale,
        window,
    )
    return out[None], None  # [1, T, H, D]


def register() -> None:
    """Make attn_implementation="batchgen" available to every transformers model."""
    AttentionInterface.register(ATTENTION_NAME, batchgen_attention)


@contextlib.contextmanager
def attention_scope(model: torch.nn.Module) -> Iterator[None]:
    """Route a caller's model through batchgen's attention for one forward pass, then give it
    back its own implementation (on the model's config and every sub-config)."""
    configs = _configs(model.config)
    previous = [c._attn_implementation_internal for c in configs]
    for config in configs:
        config._attn_implementation_internal = ATTENTION_NAME
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
