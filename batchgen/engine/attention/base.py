"""What every attention backend shares: the paged KV cache, one step's metadata, and what one
layer's attention computes (LayerSpec)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass
class KVCache:
    """Per layer: key and value blocks, each [num_blocks, block_size, num_kv_heads, head_dim].

    Keys and values share head_dim: a model whose value heads are narrower than its key heads
    (multi-head latent attention) stores them zero-padded to the key width.

    scales: [num_layers, 2] float32 on the cache's device, (key scale, value scale) per layer:
    an FP8 cache stores x / scale and its readers multiply by it; a 16-bit cache keeps ones.
    A tensor, not numbers, so CUDA graphs captured before the scales are set read them.
    """

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    scales: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.scales is None:
            device = self.keys[0].device if self.keys else None
            self.scales = torch.ones(len(self.keys), 2, device=device)
        # per layer, made once: the backends ask for them on every layer of every step
        views = self.scales.unbind(0) if self.fp8 else [None] * len(self.keys)
        self._layer_scales: list[torch.Tensor | None] = list(views)

    @property
    def fp8(self) -> bool:
        return bool(self.keys) and self.keys[0].dtype.itemsize == 1

    def layer_scales(self, layer: int) -> torch.Tensor | None:
        """The layer's (key, value) scales as a [2] view of scales, or None for a 16-bit
        cache."""
        return self._layer_scales[layer]

    def set_scales(self, scales: list[tuple[float, float]]) -> None:
        """Per layer (key scale, value scale); only an FP8 cache takes others than 1."""
        if len(scales) != len(self.keys):
            raise ValueError(f"{len(scales)} scale pairs for {len(self.keys)} layers")
        if not self.fp8 and any(s != (1.0, 1.0) for s in scales):
            raise ValueError("only an FP8 KV cache stores scaled keys and values")
        self.scales.copy_(torch.tensor(scales, dtype=torch.float32))

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
    # a step padded to a graph's shape (HostStep.shape_only): its decode rows' count lives on
    # the device, as these two views: the context lengths with every sequence past the decode
    # rows at 0 (decode attention over all B rows computes nothing for them), and cu_seqlens_q
    # with the decode rows at zero length (prefill attention over all B skips them)
    decode_context_lens: torch.Tensor | None = None
    prefill_cu_seqlens: torch.Tensor | None = None
    positions: torch.Tensor | None = None  # [T]: each token's position in its sequence


@dataclass(frozen=True)
class LayerSpec:
    """What one layer's attention computes: causal softmax(q k^T * scale) v, and optionally

    window: keys with q_pos - k_pos >= window are masked (sliding window);
    chunk: keys outside the query's chunk [q_pos // chunk * chunk, ...] are masked;
    softcap: scores become softcap * tanh(scores / softcap) before the softmax;
    sinks: [H] float32 per-head logits that join each softmax's denominator, not its output.
    """

    scale: float
    window: int | None = None
    chunk: int | None = None
    softcap: float | None = None
    sinks: torch.Tensor | None = None

    @property
    def plain(self) -> bool:
        """Nothing beyond a (windowed) causal softmax: what SDPA computes."""
        return self.chunk is None and self.softcap is None and self.sinks is None


class AttentionBackend(Protocol):
    def forward(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        meta: AttentionMetadata,
        spec: LayerSpec,
    ) -> torch.Tensor:
        """q: [T, H, D], k/v: [T, Hkv, D] -> [T, H, D]; also writes k/v into the cache."""
        ...
