"""The per-step buffer: what prepare_step packs, the declared layout unpacks field by field."""

from __future__ import annotations

import collections
from itertools import pairwise

import pytest
import torch

from batchgen import SamplingParams
from batchgen.engine.block_manager import BlockManager
from batchgen.engine.request import Request
from batchgen.engine.scheduler import Scheduler
from batchgen.engine.step_inputs import prepare_step
from batchgen.engine.step_layout import (
    REQUEST_FLOATS,
    REQUEST_INTS,
    unpack_sampling,
    unpack_step,
)


def test_every_declared_field_round_trips_through_the_buffer() -> None:
    params = [
        SamplingParams(temperature=0.7, top_k=5, top_p=0.9, logprobs=3),
        SamplingParams(min_p=0.2, repetition_penalty=1.3, presence_penalty=0.5, min_new_tokens=2),
    ]
    requests = [
        Request(str(i), list(range(3 + 4 * i)), p, 0, 100, frozenset({1}), rng_key=11 + i)
        for i, p in enumerate(params)
    ]
    scheduler = Scheduler(BlockManager(32, 4), 8, 64, True)
    for r in requests:
        scheduler.add(r)
    batch = scheduler.schedule()
    host, flat = prepare_step(batch)
    step = unpack_step(flat, host.layout)
    sampling = unpack_sampling(flat, host.layout)
    assert host.layout.size == flat.numel()
    assert step.cu_seqlens.tolist() == host.cu_seqlens and step.ids.tolist()[:3] == [0, 1, 2]
    assert sampling.rng_keys.tolist() == [11, 12]
    for name, get in (*REQUEST_INTS.items(), *REQUEST_FLOATS.items()):
        assert getattr(sampling, name).tolist() == [get(p) for p in params], name
    assert sampling.bans.tolist() == [[1, 1]]  # min_new_tokens bans eos on the second row
    assert sampling.updates.shape[1] == 3 and sampling.updates.shape[0] == 1 + 2
    assert all(r.num_synced_blocks == 0 for r in requests), "prepare_step changes no request"
    assert [(r.request_id, n) for r, n in host.synced] == [("0", 1), ("1", 2)]
    assert host.flags.any_random and host.flags.any_top_k and host.flags.logprobs_k == 3
    assert torch.equal(step.seq_slots, torch.tensor([r.slot for r in requests]))


def test_plain_decodes_packed_in_bulk_equal_the_per_chunk_path(monkeypatch) -> None:
    """A decode step with plain decodes, decodes inside min_new_tokens (bans) between them,
    one that opens a new block and a prefill: the bulk path for each run of plain decodes
    (the first and the ones after a decode that is not plain) packs exactly what the
    per-chunk path packs."""
    from batchgen.engine import step_inputs

    params = [
        SamplingParams(),
        SamplingParams(temperature=0.5, top_k=3, seed=1),
        SamplingParams(min_new_tokens=50),
        SamplingParams(top_p=0.5),
    ]
    requests = [
        Request(str(i), list(range(5 + 3 * i)), params[i % 4], 0, 200, frozenset({1}), rng_key=i)
        for i in range(10)
    ]
    scheduler = Scheduler(BlockManager(64, 16), 16, 64, True)
    for r in requests:
        scheduler.add(r)
    previous = None
    for _ in range(4):  # prefill, then decodes as the overlapped loop runs them
        batch = scheduler.schedule()
        host, _ = prepare_step(batch)
        for request, synced in host.synced:
            request.num_synced_blocks = synced
        for chunk in previous.chunks if previous else []:  # step N-1's tokens reach the host
            if chunk.samples:
                chunk.request.num_pending -= 1
                chunk.request.output_token_ids.append(7)
        previous = batch
    scheduler.add(Request("late", list(range(20)), SamplingParams(), 0, 200, frozenset({1})))
    batch = scheduler.schedule()
    runs = [i for i in range(len(batch.chunks)) if step_inputs._plain_run(batch.chunks, i) > i]
    assert runs[0] == 0 and runs[-1] < len(batch.chunks) - 1
    assert any(b > a + 1 for a, b in pairwise(runs)), "a run after a break"
    bulk_host, bulk = prepare_step(batch, 16, 16)
    monkeypatch.setattr(step_inputs, "_plain_run", lambda chunks, first: first)
    each_host, each = prepare_step(batch, 16, 16)
    assert torch.equal(bulk, each)
    assert bulk_host == each_host


def test_step_packer_packs_every_step_as_prepare_step(monkeypatch) -> None:
    """The runner's packer (steady decode steps repeat the previous buffer with new positions
    and the block-table entries of rows that opened a block) against the full packing, step by
    step, through admissions, finished and preempted
    requests (a small KV cache), requests readmitted into other slots, graph padding, and the
    sampling settings that make a decode not plain (min_new_tokens bans, penalties)."""
    import random

    from batchgen.engine import step_inputs
    from batchgen.engine.request import Status
    from batchgen.engine.step_inputs import StepPacker

    full = []
    monkeypatch.setattr(step_inputs, "prepare_step", lambda *a: full.append(1) or prepare_step(*a))
    params = [
        SamplingParams(),
        SamplingParams(temperature=0.8, top_k=4, seed=3),
        SamplingParams(min_new_tokens=6),
        SamplingParams(repetition_penalty=1.2),
        SamplingParams(top_p=0.7, logprobs=2),
    ]
    steps = repeats = grown = preemptions = 0
    for seed in range(6):
        rng = random.Random(seed)
        scheduler = Scheduler(BlockManager(40, 4), 8, 24, True)
        packer = StepPacker()
        for made in range(10):
            scheduler.add(_random_request(rng, f"{seed}-{made}", params))
        previous = None
        for _ in range(150):
            if rng.random() < 0.15:
                made += 1
                scheduler.add(_random_request(rng, f"{seed}-{made}", params))
            batch = scheduler.schedule()
            decode_only = bool(batch.chunks) and all(c.num_tokens == 1 for c in batch.chunks)
            pad_to = max(len(batch.chunks), 8 if len(batch.chunks) > 4 else 4) if decode_only else 0
            before = len(full)
            if batch.chunks:
                host, flat = packer.prepare(batch, pad_to, 8)
                want_host, want = prepare_step(batch, pad_to, 8)
                assert torch.equal(flat, want), f"seed {seed} step {steps}"
                assert host == want_host, f"seed {seed} step {steps}"
                steps += 1
                repeated = len(full) == before + 1  # only the reference packed it
                repeats += repeated
                grown += repeated and host.layout.U > 0  # rows that opened a block
                for request, synced in host.synced:
                    request.num_synced_blocks = synced
            for chunk in previous.chunks if previous else []:  # the step before's tokens
                if not chunk.samples:
                    continue
                request = chunk.request
                request.num_pending -= 1
                if request.status is Status.FINISHED:
                    continue
                request.output_token_ids.append(rng.randint(2, 50))
                if request.num_tokens >= request.max_tokens or rng.random() < 0.03:
                    scheduler.finish(request, "stop")
            previous = batch if batch.chunks else None
        preemptions += scheduler.num_preemptions
    assert preemptions, "the small cache preempts"
    assert repeats > 20 and grown > 5, f"fast path: {repeats} of {steps} steps ({grown} grown)"


def test_step_packer_repeats_only_the_same_requests() -> None:
    """Two steps of plain decodes, as many rows, other requests: packed in full again."""
    from batchgen.engine.scheduler import Batch, ScheduledChunk
    from batchgen.engine.step_inputs import StepPacker

    def plain_step(first_slot: int, key: int) -> Batch:
        chunks = []
        for i in range(3):
            r = Request(f"{key}-{i}", list(range(6)), SamplingParams(), 0, 50, frozenset({1}))
            r.slot, r.rng_key, r.block_table, r.num_synced_blocks = first_slot + i, key + i, [i], 1
            r.num_pending = 1
            chunks.append(ScheduledChunk(r, 6, 1, True, True))
        return Batch(chunks, 3)

    packer = StepPacker()
    for batch in (plain_step(0, 10), plain_step(3, 20)):
        host, flat = packer.prepare(batch, 4, 7)
        want_host, want = prepare_step(batch, 4, 7)
        assert torch.equal(flat, want) and host == want_host


def _random_request(rng, name: str, choices: list[SamplingParams]) -> Request:
    prompt = list(range(3, 3 + rng.randint(1, 14)))
    new_tokens = rng.randint(1, 60)
    key = int(name.rsplit("-", 1)[1])
    params = rng.choice(choices)
    return Request(name, prompt, params, 0, len(prompt) + new_tokens, frozenset({1}), rng_key=key)


def test_prefill_chunks_pack_their_tokens_positions_and_rows() -> None:
    """Chunks of long prompts (positions past any table the packer keeps) and a relayed
    token: each token's id, position, row and relay source, as the per-token segments hold."""
    from batchgen.engine.scheduler import Batch, ScheduledChunk

    long = Request("long", [7 + i % 50 for i in range(9000)], SamplingParams(), 0, 10**5,
                   frozenset({1}))  # fmt: skip
    short = Request("short", list(range(3, 40)), SamplingParams(), 0, 100, frozenset({1}))
    short.output_token_ids, short.num_pending = [11, 12], 1  # the newest token is relayed
    long.slot, short.slot = 0, 1
    chunks = [
        ScheduledChunk(short, 30, 10, True, True),  # prompt 30..36, outputs 11 12, relayed
        ScheduledChunk(long, 4000, 4200, False, False),
        ScheduledChunk(long, 8700, 300, True, False),  # (not a real schedule: packing only)
    ]
    host, flat = prepare_step(Batch(chunks, 4510))
    step = unpack_step(flat, host.layout)
    assert step.ids.tolist() == [*range(33, 40), 11, 12, 0, *long.prompt_token_ids[4000:8200],
                                 *long.prompt_token_ids[8700:9000]]  # fmt: skip
    assert step.positions.tolist() == [*range(30, 40), *range(4000, 8200), *range(8700, 9000)]
    assert step.seq_idx.tolist() == [0] * 10 + [1] * 4200 + [2] * 300
    assert step.relay_src.tolist() == [-1] * 9 + [1] + [-1] * 4500
    assert host.cu_seqlens == [0, 10, 4210, 4510] and host.context_lens == [40, 8200, 9000]


def test_a_step_padded_to_a_token_shape_keeps_its_rows_and_pads_in_the_pad_slot() -> None:
    """A step with decodes and prefill chunks padded to Pad(T, B, S): its own rows unchanged
    and first, then zero-length sequences in the pad slot, tokens in no sequence (the last
    padding sequence's row in seq_idx, position 0, no relay), sampled rows of token 0 with
    the padding constants; the host's decode count is the step's own."""
    from batchgen.engine.step_inputs import Pad
    from batchgen.engine.step_layout import PAD_CONSTANTS, SAMPLE_FLOATS, SAMPLE_INTS

    requests = [
        Request(str(i), list(range(2, 6 + 7 * i)), SamplingParams(temperature=0.5), 0, 100,
                frozenset({1}), rng_key=i)
        for i in range(4)
    ]  # fmt: skip
    scheduler = Scheduler(BlockManager(64, 4), 8, 20, True)
    for r in requests[:2]:
        scheduler.add(r)
    first = scheduler.schedule()
    for r, synced in prepare_step(first)[0].synced:
        r.num_synced_blocks = synced
    for r in requests[2:]:
        scheduler.add(r)
    batch = scheduler.schedule()  # two decodes (relayed) and prefill chunks
    assert 0 < sum(c.num_tokens == 1 for c in batch.chunks) < len(batch.chunks)
    own_host, own = prepare_step(batch)
    T, B, S = own_host.layout[:3]
    pad = Pad(T + 5, 9, 8)
    host, flat = prepare_step(batch, pad, 8)
    assert host.layout[:3] == (T + 5, 9, 8) and host.shape_only and not own_host.shape_only
    assert host.num_decodes == own_host.num_decodes == 2
    step, mine = unpack_step(flat, host.layout), unpack_step(own, own_host.layout)
    for name in ("ids", "relay_src", "positions", "seq_idx"):
        assert getattr(step, name)[:T].tolist() == getattr(mine, name).tolist(), name
    assert step.ids[T:].tolist() == [0] * 5 and step.relay_src[T:].tolist() == [-1] * 5
    assert step.positions[T:].tolist() == [0] * 5 and step.seq_idx[T:].tolist() == [8] * 5
    assert step.cu_seqlens.tolist() == mine.cu_seqlens.tolist() + [T] * (9 - B)
    assert host.cu_seqlens == step.cu_seqlens.tolist()
    assert step.context_lens.tolist() == mine.context_lens.tolist() + [0] * (9 - B)
    assert step.seq_slots.tolist() == mine.seq_slots.tolist() + [8] * (9 - B)
    assert step.sample_idx.tolist() == mine.sample_idx.tolist() + [0] * (8 - S)
    sampling, own_sampling = (
        unpack_sampling(flat, host.layout),
        unpack_sampling(own, own_host.layout),
    )
    assert sampling.slots.tolist() == own_sampling.slots.tolist() + [8] * (8 - S)
    names = SAMPLE_INTS[3:] + SAMPLE_FLOATS  # after slots, rng_keys, positions
    pad_values = dict(zip(names, PAD_CONSTANTS[0] + PAD_CONSTANTS[1], strict=True))
    for name, value in pad_values.items():
        assert getattr(sampling, name)[S:].tolist() == [value] * (8 - S), name
    assert torch.equal(sampling.updates, own_sampling.updates)
    assert host.flags == own_host.flags
    for too_small in (Pad(T - 1, 9, 8), Pad(T, B, 8), Pad(T, 9, S - 1)):
        with pytest.raises(ValueError, match="exceeds"):
            prepare_step(batch, too_small, 8)


def test_graph_shapes_chosen_for_steps_bound_their_padding() -> None:
    """Decode steps pad to the next decode size; a step with prefill chunks pads to the next
    token size when that size is small or the padding is a small share of it, and otherwise
    (or with more sequences or samples than a graph has room for) runs as it is."""
    from batchgen.engine.graphs import PAD_SHARE, SMALL_STEP, StepGraphs
    from batchgen.engine.scheduler import Batch, ScheduledChunk
    from batchgen.engine.step_inputs import Pad

    graphs = StepGraphs.__new__(StepGraphs)  # the choice needs no device
    graphs.sizes, graphs.tokens, graphs.max_seqs = [1, 2, 4, 8], [256, 1024, 2048, 4096], 8
    graphs.first_use = False

    def step(*lengths: int, samples: int | None = None) -> Batch:
        samples = len(lengths) if samples is None else samples
        chunks = [ScheduledChunk(None, 0, n, i < samples, False) for i, n in enumerate(lengths)]
        return Batch(chunks, sum(lengths))

    assert graphs.padded_size(step(1, 1, 1)) == Pad(4, 4, 4)
    assert graphs.padded_size(step(1, 1, 1, samples=2)) == Pad(256, 9, 8)
    assert graphs.padded_size(step(*[1] * 9)) is None  # more sequences than a graph holds
    assert graphs.padded_size(step(1, 1, 200)) == Pad(256, 9, 8)
    assert SMALL_STEP >= 1024
    assert graphs.padded_size(step(1, 300)) == Pad(1024, 9, 8)  # small: any padding
    fits = 4096 - 4096 // PAD_SHARE
    assert graphs.padded_size(step(1, fits - 1)) == Pad(4096, 9, 8)
    assert graphs.padded_size(step(1, fits - 2)) is None  # too much padding for its length
    assert graphs.padded_size(step(2048)) == Pad(2048, 9, 8)
    assert graphs.padded_size(step(2049)) is None
    assert graphs.padded_size(step(4097)) is None  # above every token size
    assert graphs.padded_size(Batch([], 0)) is None


def test_first_use_decode_sizes_borrow_a_larger_graph_until_their_capture_step() -> None:
    """A decode size without its graph replays the smallest larger graph captured for its
    first CAPTURE_AT_STEP - 1 steps, then its own pad (replay captures it); a size whose graph
    exists, or whose capture failed, or with no larger graph, keeps its own pad."""
    from batchgen.engine.graphs import CAPTURE_AT_STEP, StepGraphs
    from batchgen.engine.scheduler import Batch, ScheduledChunk
    from batchgen.engine.step_inputs import Pad

    graphs = StepGraphs.__new__(StepGraphs)
    graphs.sizes, graphs.tokens, graphs.max_seqs = [1, 2, 4, 8, 16], [256], 16
    graphs.first_use, graphs.borrowed = True, collections.Counter()
    graphs.graphs, graphs.eager = {Pad(8, 8, 8): None, Pad(16, 16, 16): None}, {Pad(2, 2, 2)}

    def decode(rows: int) -> Batch:
        return Batch([ScheduledChunk(None, 0, 1, True, False)] * rows, rows)

    chosen = [graphs.padded_size(decode(3)) for _ in range(CAPTURE_AT_STEP + 1)]
    assert chosen == [Pad(8, 8, 8)] * (CAPTURE_AT_STEP - 1) + [Pad(4, 4, 4)] * 2
    assert graphs.padded_size(decode(5)) == Pad(8, 8, 8)  # its own graph
    assert graphs.padded_size(decode(2)) == Pad(2, 2, 2)  # capture failed: runs eagerly
    graphs.graphs = {}
    assert graphs.padded_size(decode(9)) == Pad(16, 16, 16)  # nothing larger to borrow
    graphs.first_use = False
    assert graphs.padded_size(decode(1)) == Pad(1, 1, 1)


def test_steps_stop_admitting_at_a_token_size_where_padding_would_cost() -> None:
    """step_target keeps a step that replays a graph as it is (small, or padded cheaply), and
    otherwise stops it at the largest token size above what it already has."""
    from batchgen.engine.graphs import PAD_SHARE, pads_cheaply, step_target

    sizes = (256, 1024, 2048, 4096, 8192)
    assert step_target(sizes, 10, 900) == 900  # pads to 1024: small
    assert step_target(sizes, 10, 2048) == 2048  # a size: no padding
    cheap = 4096 - 4096 // PAD_SHARE
    assert pads_cheaply(4096, cheap) and not pads_cheaply(4096, cheap - 1)
    assert step_target(sizes, 10, cheap) == cheap
    assert step_target(sizes, 10, cheap - 1) == 2048
    assert step_target(sizes, 2047, 3000) == 2048
    assert step_target(sizes, 2048, 3000) == 3000  # no size between what it has and natural
    assert step_target(sizes, 5000, 7000) == 7000
    assert step_target(sizes, 4000, 7000) == 4096
    assert step_target(sizes, 100, 9000) == 9000  # above every size
    assert step_target((4096,), 0, 2000) == 2000  # no size below
    assert step_target((), 0, 5000) == 5000


def test_scheduler_cuts_the_last_prompt_at_the_step_target() -> None:
    """With a step target the admission stops inside the last prompt (chunked prefill); the
    rest of that prompt starts the next step, and no request is left out."""
    import functools

    from batchgen.engine.graphs import step_target

    sizes = (1024, 2048, 3072, 4096)
    prompts = [700, 900, 800, 600, 500]  # 3,500 tokens in all
    requests = [
        Request(str(i), list(range(n)), SamplingParams(), 0, n + 4, frozenset({1}))
        for i, n in enumerate(prompts)
    ]
    scheduler = Scheduler(BlockManager(400, 16), 8, 4096, True)
    scheduler.step_target = functools.partial(step_target, sizes)
    for r in requests:
        scheduler.add(r)
    first = scheduler.schedule()
    assert first.num_tokens == 3072, "3,500 would pad to 4,096 (15%): stop at 3,072"
    assert [c.num_tokens for c in first.chunks] == [700, 900, 800, 600, 72]
    assert [c.samples for c in first.chunks] == [True] * 4 + [False]
    second = scheduler.schedule()  # four decodes and the last prompt's other 428 tokens
    assert second.num_tokens == 432 and second.chunks[-1].start == 72
    assert len(scheduler.running) == 5 and not scheduler.waiting

    plain = Scheduler(BlockManager(400, 16), 8, 4096, False)  # whole prompts only: no cut
    plain.step_target = functools.partial(step_target, sizes)
    for i, n in enumerate(prompts):
        plain.add(Request(str(i), list(range(n)), SamplingParams(), 0, n + 4, frozenset({1})))
    assert plain.schedule().num_tokens == 3500


@pytest.mark.parametrize("block_size", [8, 16])
def test_a_full_budget_step_at_a_token_graphs_shape_fits_the_first_transfer_buffers(
    model_dir, monkeypatch, block_size: int
) -> None:
    """The first step at the token budget, padded to a token graph's shape (one sequence more
    than a step has, a sampled row per sequence) with a new block-table entry for each of its
    blocks, fits the step buffers made at start-up: no device synchronize and reallocation
    before the job's first step."""
    from batchgen import Engine, EngineConfig
    from batchgen.engine.transfer import Transfer
    from tests.helpers import EagerPadding, random_prompts

    sizes = []
    allocate = Transfer._allocate_inputs
    monkeypatch.setattr(
        Transfer, "_allocate_inputs", lambda self, size: (sizes.append(size), allocate(self, size))
    )
    budget, seqs = 128, 8
    config = EngineConfig(
        dtype="float32",
        device="cpu",
        max_num_seqs=seqs,
        max_num_batched_tokens=budget,
        block_size=block_size,
        enable_prefix_caching=False,
    )
    engine = Engine(model_dir("llama"), config)
    graphs = engine.runner.graphs = EagerPadding(engine.runner, (8,), tokens=(budget,))
    prompts = random_prompts(seqs, budget // seqs, budget // seqs, 500, seed=3)  # one step's worth
    list(engine.generate(prompts, SamplingParams(max_new_tokens=2, ignore_eos=True), decode=False))
    assert graphs.replays[0] == (budget, seqs + 1, seqs)  # the padded first step ...
    assert len(sizes) == 1  # ... in the buffers made at start-up
