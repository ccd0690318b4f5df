"""The per-step buffer: what prepare_step packs, the declared layout unpacks field by field."""

from __future__ import annotations

from itertools import pairwise

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
