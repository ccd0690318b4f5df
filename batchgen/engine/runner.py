"""Model runner: turns a scheduled Batch into one forward pass and sampled tokens on the device."""

from __future__ import annotations

from itertools import pairwise

import torch
from transformers import PreTrainedModel

from batchgen.engine.attention import AttentionMetadata, KVCache, ReferenceBackend
from batchgen.engine.block_manager import blocks_for
from batchgen.engine.config import EngineConfig
from batchgen.engine.model_loader import ModelShape, model_shape
from batchgen.engine.sampler import Sampler
from batchgen.engine.scheduler import Batch
from batchgen.engine.step_inputs import DeviceStep, HostStep, Layout, prepare_step, unpack_step
from batchgen.engine.transfer import StepOutput, Transfer
from batchgen.errors import BatchgenError

_GIB = 1024**3


def plan_num_blocks(
    config: EngineConfig,
    shape: ModelShape,
    dtype: torch.dtype,
    device: torch.device,
    max_model_len: int,
) -> int:
    """How many KV blocks to allocate; an error if not even one full-length request fits."""
    per_block = KVCache.bytes_per_block(
        shape.num_layers, config.block_size, shape.num_kv_heads, shape.head_dim, dtype
    )
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        budget = int(free * config.kv_cache_memory_fraction)
    else:
        budget = int(config.cpu_kv_cache_gib * _GIB)
    num_blocks = budget // per_block
    needed = blocks_for(max_model_len, config.block_size)
    if num_blocks < needed:
        raise BatchgenError(
            f"KV cache fits {num_blocks} blocks of {config.block_size} tokens but one "
            f"{max_model_len}-token request needs {needed}: lower max_model_len or give the "
            "cache more memory (kv_cache_memory_fraction / cpu_kv_cache_gib)"
        )
    return num_blocks


class ModelRunner:
    """Owns the model, the KV cache, the token relay and the step buffers."""

    def __init__(
        self,
        model: PreTrainedModel,
        config: EngineConfig,
        device: torch.device,
        dtype: torch.dtype,
        num_blocks: int,
        max_model_len: int,
    ) -> None:
        self.model = model
        self.config = config
        self.device = device
        self.shape = model_shape(model)
        self.kv_cache = KVCache.allocate(
            self.shape.num_layers,
            num_blocks,
            config.block_size,
            self.shape.num_kv_heads,
            self.shape.head_dim,
            dtype,
            device,
        )
        self.backend = ReferenceBackend()
        self.sampler = Sampler(self.shape.vocab_size, device)
        # relay[slot]: the newest sampled token of the request in that slot, on the device
        self.relay = torch.zeros(config.max_num_seqs, dtype=torch.int64, device=device)
        max_blocks = blocks_for(max_model_len, config.block_size)
        size = Layout.max_size(config.max_num_batched_tokens, config.max_num_seqs, max_blocks)
        self.transfer = Transfer(size, config.max_num_seqs, device)

    @torch.inference_mode()
    def launch(self, batch: Batch) -> StepOutput:
        """Queue the step's work on the device; the returned tokens arrive on the host later."""
        host = prepare_step(batch, self.config.block_size, self.transfer.host_buffer())
        step = unpack_step(self.transfer.to_device(host.layout.size), host.layout)
        ids = torch.where(step.relay_src >= 0, self.relay[step.relay_src.clamp(min=0)], step.ids)
        logits = self.model(
            input_ids=ids[None],
            position_ids=step.positions[None],
            logits_to_keep=step.sample_idx,
            use_cache=False,
            batchgen_meta=self._metadata(host, step),
        ).logits[0]
        tokens = torch.empty(0, dtype=torch.int64, device=self.device)
        if host.layout.S:
            tokens = self.sampler(
                logits, step.temperatures, step.seeds, step.sample_pos, host.any_random
            )
            self.relay[step.sample_slots] = tokens
        return self.transfer.finish(tokens)

    def _metadata(self, host: HostStep, step: DeviceStep) -> AttentionMetadata:
        bs = self.config.block_size
        tables = step.block_tables
        slot_mapping = tables[step.seq_idx, step.positions // bs] * bs + step.positions % bs
        return AttentionMetadata(
            slot_mapping=slot_mapping,
            cu_seqlens_q=step.cu_seqlens.int(),
            context_lens=step.context_lens.int(),
            block_tables=tables.int(),
            cu_seqlens_q_host=host.cu_seqlens,
            context_lens_host=host.context_lens,
            max_query_len=max(b - a for a, b in pairwise(host.cu_seqlens)),
            max_context_len=max(host.context_lens, default=0),
            num_decodes=host.num_decodes,
            kv_cache=self.kv_cache,
            backend=self.backend,
        )
