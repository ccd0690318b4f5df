"""Model runner: turns a scheduled Batch into one forward pass and sampled tokens on the device."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from functools import partial
from itertools import pairwise
from typing import Any, NamedTuple, Protocol

import torch
from transformers import PreTrainedModel

from batchgen.engine.attention import (
    AttentionMetadata,
    KVCache,
    attention_scope,
    step_context,
)
from batchgen.engine.attention.select import make_backend, uses_triton
from batchgen.engine.block_manager import blocks_for
from batchgen.engine.config import EngineConfig
from batchgen.engine.fusion import Fusion
from batchgen.engine.graphs import StepGraphs, token_sizes
from batchgen.engine.model_loader import ModelShape, eval_mode, has_training_parts
from batchgen.engine.sampler import PenaltyState, Sampler
from batchgen.engine.scheduler import Batch
from batchgen.engine.step_inputs import HostStep, Pad, StepPacker
from batchgen.engine.step_layout import Layout, SamplingInputs, unpack_sampling, unpack_step
from batchgen.engine.temperature import position_tuned, tuned_attention
from batchgen.engine.transfer import StepOutput, Transfer
from batchgen.errors import BatchgenError

_GIB = 1024**3
_AS_IT_IS = contextlib.nullcontext()


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
        budget = int(_free_bytes(device) * config.kv_cache_memory_fraction)
    else:
        # past any machine's memory either way (the allocation says so), but an integer
        budget = int(min(config.cpu_kv_cache_gib, 2.0**40) * _GIB)
    num_blocks = max(0, budget // per_block)
    needed = blocks_for(max_model_len, config.block_size)
    if num_blocks < needed:
        raise BatchgenError(
            f"KV cache fits {num_blocks} blocks of {config.block_size} tokens but one "
            f"{max_model_len}-token request needs {needed}: lower max_model_len or give the "
            "cache more memory (kv_cache_memory_fraction / cpu_kv_cache_gib)"
        )
    return num_blocks


def spare_bytes(
    config: EngineConfig,
    shape: ModelShape,
    dtype: torch.dtype,
    device: torch.device,
    num_blocks: int,
) -> int:
    """Device memory left once a KV cache of num_blocks (plus the scratch block) is allocated
    beside what is allocated now: room for a step's activations and the decode graphs. 0 off
    a GPU."""
    if device.type != "cuda":
        return 0
    per_block = KVCache.bytes_per_block(
        shape.num_layers, config.block_size, shape.num_kv_heads, shape.head_dim, dtype
    )
    return max(0, _free_bytes(device) - (num_blocks + 1) * per_block)


def _free_bytes(device: torch.device) -> int:
    """Free device memory, counting what the caching allocator holds but no tensor uses."""
    free, _ = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


@contextlib.contextmanager
def allocating(what: str, setting: str) -> Iterator[None]:
    """An allocation the settings sized: its failure (no memory, or a size past what the
    allocator takes) is one BatchgenError naming the setting to lower."""
    try:
        yield
    except (MemoryError, RuntimeError, TypeError, OverflowError) as exc:
        text = str(exc)
        if not isinstance(exc, (MemoryError, OverflowError)) and not any(
            word in text.lower() for word in ("alloc", "out of memory", "overflow")
        ):
            raise
        reason = text.strip().splitlines()[0][:160] if text.strip() else type(exc).__name__
        raise BatchgenError(f"cannot allocate {what} ({reason}): lower {setting}") from exc


def _kv_setting(config: EngineConfig, device: torch.device) -> str:
    """The setting that sized the KV cache."""
    if config.num_kv_blocks is not None:
        return "runtime.num_kv_blocks"
    if device.type == "cuda":
        return "runtime.kv_cache_memory_fraction"
    return "runtime.cpu_kv_cache_gib"


def _capture_or_warn(runner: ModelRunner) -> StepGraphs | None:
    """Step graphs, or None with a warning when the model's forward cannot be captured (a
    layer that copies from the host or synchronizes, e.g. some mixture-of-experts kernels):
    its steps then run eagerly, with the same results."""
    try:
        config = runner.config
        budget = config.max_num_batched_tokens
        graphs = StepGraphs(
            runner.forward,
            runner.device,
            runner.pad_slot,
            config.cuda_graph_batch_sizes,
            min(config.max_num_seqs, budget),
            first_use=config.cuda_graph_capture == "first_use",
            tokens=token_sizes(budget, config.cuda_graph_token_sizes),
            max_seqs=config.max_num_seqs,
        )
        return graphs
    except Exception as exc:  # capture failed: leave the device usable and run eagerly
        with contextlib.suppress(Exception):
            torch.cuda.synchronize(runner.device)
        text = str(exc).strip().splitlines()
        reason = f"{type(exc).__name__}: {text[0][:160]}" if text else type(exc).__name__
        warnings.warn(
            f"batchgen: CUDA graphs are off for this model, its steps run eagerly ({reason})",
            stacklevel=2,
        )
        return None


class Begun(NamedTuple):
    """A step whose forward is queued and whose sampling is not (ModelRunner.begin)."""

    host: HostStep
    sampling: SamplingInputs
    logits: torch.Tensor  # [S, vocab] of the sampled rows, padding rows included
    mark: Any  # the step hook's begin() value
    pad: Pad | None  # the padded shape whose graph the step replays (graphs.py), or None
    num_samples: int  # real sampled rows (the first ones)


class StepHook(Protocol):
    """Observes launched steps: begin() before the step's device work is queued, end() after."""

    def begin(self) -> Any: ...

    def end(self, mark: Any, graphed: bool, token_graph: bool = False) -> None: ...


class ModelRunner:
    """Owns the model, the KV cache, the device block tables, the token relay and the buffers.

    Relay slots and block-table rows are indexed by the request's slot; row `pad_slot` serves
    padding rows of graph-padded steps and points at a scratch KV block.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        shape: ModelShape,
        config: EngineConfig,
        device: torch.device,
        dtype: torch.dtype,
        num_blocks: int,
        max_model_len: int,
        adopted: bool = False,
    ) -> None:
        self.model = model
        self.config = config
        self.device = device
        self.shape = shape  # measured once by the engine (model_shape runs a forward pass)
        s = shape
        # one extra block: the scratch block that padding rows read and write
        with allocating(f"a KV cache of {num_blocks:,} blocks", _kv_setting(config, device)):
            self.kv_cache = KVCache.allocate(
                s.num_layers,
                num_blocks + 1,
                config.block_size,
                s.num_kv_heads,
                s.head_dim,
                dtype,
                device,
            )
        self.pad_slot = config.max_num_seqs
        width = blocks_for(max_model_len, config.block_size)
        # block_tables[slot]: [width] int32 KV block ids of the request in that slot, -1 unused
        with allocating(
            f"block tables of {config.max_num_seqs:,} sequences", "runtime.max_num_seqs"
        ):
            self.block_tables = torch.full(
                (config.max_num_seqs + 1, width), -1, dtype=torch.int32, device=device
            )
        self.block_tables[self.pad_slot] = num_blocks
        # relay[slot]: the newest sampled token of the request in that slot, on the device
        self.relay = torch.zeros(config.max_num_seqs + 1, dtype=torch.int64, device=device)
        self.backend = make_backend(config, device)
        self.step_tokens = None  # on CUDA, token_inputs as one kernel launch
        if device.type == "cuda":
            from batchgen.engine.kernels.step_tokens import step_tokens

            self.step_tokens = step_tokens
        self.sampler = Sampler(s.vocab_size, device)
        self.penalties: PenaltyState | None = None  # allocated when a request first needs it
        seqs, budget = config.max_num_seqs, config.max_num_batched_tokens
        # the largest step without cached prefixes: a token graph's shape (a sequence more than
        # a step has, a sampled row per sequence), a new block-table entry per block of its
        # tokens and per sequence; a step with more (cached blocks entering) grows the buffers
        updates = blocks_for(budget, config.block_size) + seqs
        size = Layout(budget, seqs + 1, seqs, U=updates).size
        with allocating(f"step buffers for {budget:,} tokens", "runtime.max_num_batched_tokens"):
            self.transfer = Transfer(size, seqs, device)
        self.packer = StepPacker()  # packs each launched step's buffer, in launch order
        # called around each launched step (a benchmark's timeline); None = nothing
        self.step_hook: StepHook | None = None
        # attention scaled by position (Llama-4) counts each token's own inside a step
        self._untune = position_tuned(tuned_attention(model))
        self.fusion: Fusion | None = None
        # a caller's model keeps its own attention outside batchgen's forward passes
        self.scope = partial(attention_scope, model) if adopted else contextlib.nullcontext
        # forward passes run in eval mode whatever mode the model is in (no dropout): set
        # when a part of it was in train mode as the engine last looked (watch_modes)
        self.training_parts = has_training_parts(model)
        if config.fused_ops and device.type == "cuda" and uses_triton(self.backend):
            self.fusion = Fusion(model)
            self.fusion.on()
        self.graphs: StepGraphs | None = None
        if (
            device.type == "cuda"
            and config.cuda_graphs
            and getattr(self.backend, "graphable", False)
        ):
            self.graphs = _capture_or_warn(self)

    def launch(self, batch: Batch) -> StepOutput:
        """Queue the step's work on the device; the returned tokens arrive on the host later."""
        return self.sample(self.begin(batch))

    @torch.inference_mode()
    def begin(self, batch: Batch) -> Begun:
        """Queue the step's inputs and forward pass; sample() queues the rest. Between the two
        the host may fill a token bitmask while the device runs the forward."""
        pad = self.graphs.padded_size(batch) if self.graphs is not None else None
        host, staged = self.packer.prepare(batch, pad or 0, self.pad_slot)
        for request, synced in host.synced:  # the new block-table entries are on their way
            request.num_synced_blocks = synced
        flat = self.transfer.to_device(staged)
        mark = self.step_hook.begin() if self.step_hook is not None else None
        sampling = unpack_sampling(flat, host.layout)
        if host.layout.U:
            updates = sampling.updates
            self.block_tables[updates[:, 0], updates[:, 1]] = updates[:, 2].int()
        if host.flags.any_penalty or host.layout.R:
            self._penalty_state().update_known(sampling)
        logits = self.graphs.replay(flat, host) if pad else self.forward(flat, host)
        return Begun(host, sampling, logits, mark, pad, batch.num_samples)

    @torch.inference_mode()
    def sample(self, begun: Begun, mask: torch.Tensor | None = None) -> StepOutput:
        """Queue the sampler (mask: [S, words] int32 token bitmask or None) and the copy back."""
        host, sampling = begun.host, begun.sampling
        tokens = torch.empty(0, dtype=torch.int64, device=self.device)
        logprobs = None
        if host.layout.S:
            tokens, logprobs = self.sampler(
                begun.logits, sampling, host.flags, self.penalties, mask
            )
            self.relay[sampling.slots] = tokens
        if self.step_hook is not None:
            decode = begun.pad is not None and begun.pad.decode
            self.step_hook.end(begun.mark, decode, begun.pad is not None and not decode)
        real = begun.num_samples
        return self.transfer.finish(tokens[:real], None if logprobs is None else logprobs[:real])

    def _penalty_state(self) -> PenaltyState:
        if self.penalties is None:
            self.penalties = PenaltyState(self.relay.shape[0], self.shape.vocab_size, self.device)
        return self.penalties

    def watch_modes(self) -> None:
        """Look again whether a part of the model is in train mode (a caller's model may have
        been switched since): forward passes then switch it to eval mode and back."""
        self.training_parts = has_training_parts(self.model)

    def forward(self, flat: torch.Tensor, host: HostStep) -> torch.Tensor:
        """-> logits [S, vocab] of the sampled rows. Capturable for decode-only layouts. The
        model runs in eval mode (the root's flag is read each step: model.train() between
        calls or steps is seen)."""
        step = unpack_step(flat, host.layout)
        ids, meta = self._metadata(host, step)
        training = self.training_parts or self.model.training
        modes = eval_mode(self.model) if training else _AS_IT_IS
        with self.scope(), step_context(meta), modes:
            out = self.model(
                input_ids=ids[None],
                position_ids=step.positions[None],
                logits_to_keep=step.sample_idx,
                use_cache=False,
                batchgen_meta=meta,
            )
        return out.logits[0]

    def close(self) -> None:
        """Give the model its own modules back and release every device buffer now: the KV
        cache, graphs and their pool, block tables, relay, transfer buffers."""
        if self.fusion is not None:
            self.fusion.off()
        self.fusion = None
        self._untune()
        if self.graphs is not None:
            self.graphs.close()
        self.graphs = None
        self.kv_cache = None
        self.penalties = None
        self.block_tables = self.relay = None
        self.transfer = None
        self.sampler = None
        self.backend = None

    def token_inputs(self, step) -> tuple[torch.Tensor, ...]:
        """-> (input ids [T] (relayed tokens from the relay), slot_mapping [T] int64 (-1 where
        the block is unused), cu_seqlens [B + 1] int32, context_lens [B] int32), in torch: the
        CPU path, and the reference of the one-launch CUDA kernel (kernels.step_tokens)."""
        bs = self.config.block_size
        ids = torch.where(step.relay_src >= 0, self.relay[step.relay_src.clamp(min=0)], step.ids)
        blocks = self.block_tables[step.seq_slots[step.seq_idx], step.positions // bs].long()
        slot_mapping = torch.where(blocks >= 0, blocks * bs + step.positions % bs, -1)
        return ids, slot_mapping, step.cu_seqlens.int(), step.context_lens.int()

    def _metadata(self, host: HostStep, step) -> tuple[torch.Tensor, AttentionMetadata]:
        """-> (input ids [T], the step's attention metadata)."""
        if self.step_tokens is not None:
            inputs = self.step_tokens(step, self.relay, self.block_tables, self.config.block_size)
        else:
            inputs = self.token_inputs(step)
        ids, slot_mapping, cu_seqlens, context_lens = inputs
        shaped = {}
        if host.shape_only:  # the decode rows' count, on the device (as the host counts it)
            decodes = (cu_seqlens[1:] - cu_seqlens[:-1] == 1).sum().int()
            rows = torch.arange(len(context_lens), device=context_lens.device)
            shaped = {
                "decode_context_lens": torch.where(rows < decodes, context_lens, 0),
                "prefill_cu_seqlens": torch.maximum(cu_seqlens, decodes),
            }
        return ids, AttentionMetadata(
            slot_mapping=slot_mapping,
            cu_seqlens_q=cu_seqlens,
            context_lens=context_lens,
            block_tables=self.block_tables[step.seq_slots],  # [B, width]
            cu_seqlens_q_host=host.cu_seqlens,
            context_lens_host=host.context_lens,
            max_query_len=max(b - a for a, b in pairwise(host.cu_seqlens)),
            max_context_len=max(host.context_lens, default=0),
            num_decodes=host.num_decodes,
            kv_cache=self.kv_cache,
            backend=self.backend,
            positions=step.positions,
            **shaped,
        )
