"""The step recorder on a real engine (CPU): what each record holds, in which order the host
phases ran, and the evidence the gap rule reads (empty loops, limits, preemptions)."""

from __future__ import annotations

import time
from itertools import pairwise
from pathlib import Path

import pytest

from batchgen import Engine, EngineConfig, SamplingParams
from batchgen.engine import NOT_READY
from batchgen.profile.attribution import attribute
from batchgen.profile.recorder import StepRecorder
from batchgen.profile.records import ADMISSION_BLOCKED, NO_DEMAND
from batchgen.profile.store import COLUMNS, new_arrays, read_records, snapshot
from tests.helpers import random_prompts


def profile(engine: Engine, prompts, path: Path, params: SamplingParams):
    recorder = StepRecorder(engine, path, "run").attach()
    outs = list(engine.generate(prompts, params, decode=False))
    recorder.close()
    assert engine.profiler is None and engine.runner.step_hook is None  # detached
    info, records = read_records(path)
    return outs, info, records


@pytest.fixture(scope="module")
def engine(model_dir):
    config = EngineConfig(device="cpu", max_num_seqs=2, check_model=False)
    with Engine(model_dir("llama"), config) as engine:
        yield engine


def test_records_count_every_token_and_post_process_in_launch_order(
    model_dir, tmp_path: Path
) -> None:
    prompts = random_prompts(5, 6, 12, 200, seed=1)
    params = SamplingParams(max_new_tokens=4, ignore_eos=True)
    for overlap in (True, False):
        config = EngineConfig(
            device="cpu", max_num_seqs=2, overlap=overlap, check_model=False,
            enable_prefix_caching=False,
        )  # fmt: skip
        with Engine(model_dir("llama"), config) as engine:
            outs, info, records = profile(engine, prompts, tmp_path / f"{overlap}.parquet", params)
        assert info.overlap is overlap and info.device == "cpu" and info.stop_host_ms > 0
        assert [r.step for r in records] == list(range(len(records)))
        # every prompt token is a prefill token; every sampled token but the first a decode
        assert sum(r.prefill_tokens for r in records) == sum(map(len, prompts))
        assert sum(r.decode_tokens for r in records) == sum(
            len(o.output_token_ids) - 1 for o in outs
        )
        assert all(r.gpu_start_ms is None and r.tokenizer_depth is None for r in records)
        for r in records:  # each step's own phases, in order
            phases = [r.host_schedule_ms, r.host_prepare_ms, r.host_begin_ms, r.host_end_ms]
            phases += [r.host_post_ms, r.host_ready_ms, r.host_done_ms]
            assert phases == sorted(phases), r
        pairs = list(pairwise(records))
        if overlap:  # a step is post-processed after the next one was launched
            assert sum(a.host_post_ms > b.host_end_ms for a, b in pairs) >= len(pairs) - 3
        else:  # synchronous: post-processed before the next one is scheduled
            assert all(a.host_done_ms <= b.host_schedule_ms for a, b in pairs)


def test_a_full_batch_blocks_admission(engine: Engine, tmp_path: Path) -> None:
    """Two sequences at most: when both end together, the third prompt waits for a slot while
    their last tokens are in flight; that loop launches nothing."""
    prompts = random_prompts(6, 8, 8, 200, seed=2)
    params = SamplingParams(max_new_tokens=3, ignore_eos=True)
    _, info, records = profile(engine, prompts, tmp_path / "p.parquet", params)
    blocked = [r for r in records if r.idle_blocked]
    assert blocked and all(r.blocked_by == "seqs" for r in blocked)
    causes = {g.step: g.cause for g in attribute(records, info).gaps}
    assert all(causes[r.step] == ADMISSION_BLOCKED for r in blocked)


def test_waiting_for_input_is_no_demand(engine: Engine, tmp_path: Path) -> None:
    def slow_source():
        yield [5, 6, 7, 8]
        while engine.has_unfinished():
            yield NOT_READY
        until = time.perf_counter() + 0.05
        while time.perf_counter() < until:  # the engine has run dry: nothing to run for 50 ms
            time.sleep(0.005)
            yield NOT_READY
        yield [9, 10, 11]

    params = SamplingParams(max_new_tokens=2, ignore_eos=True)
    _, info, records = profile(engine, slow_source(), tmp_path / "p.parquet", params)
    second = next(r for r in records if r.prefill_tokens == 3)
    assert second.idle_no_demand >= 1
    gap = next(g for g in attribute(records, info).gaps if g.step == second.step)
    assert gap.cause == NO_DEMAND and gap.ms >= 45


def test_preemptions_are_counted_on_the_step_that_made_them(model_dir, tmp_path: Path) -> None:
    config = EngineConfig(
        device="cpu", max_num_seqs=4, block_size=8, num_kv_blocks=8, check_model=False,
        enable_prefix_caching=False,
    )  # fmt: skip
    prompts = random_prompts(4, 10, 14, 200, seed=3)
    params = SamplingParams(max_new_tokens=20, ignore_eos=True)
    with Engine(model_dir("llama"), config) as engine:
        _, _, records = profile(engine, prompts, tmp_path / "p.parquet", params)
        total = engine.scheduler.num_preemptions
    assert total > 0 and sum(r.preemptions for r in records) == total
    assert all(0 <= r.free_blocks <= 8 and r.running <= 4 for r in records)
    # a preempted request's KV is computed again: its tokens below what was dropped are
    # recompute tokens, counted once per step that carries them (never more than its prefill)
    redo = [r for r in records if r.recompute_tokens]
    assert redo and all(r.recompute_tokens <= r.prefill_tokens for r in redo)
    assert min(r.step for r in redo) > min(r.step for r in records if r.preemptions)
    assert any(r.admit_limit == "blocks" for r in records)  # requests waited for KV blocks


def test_a_snapshot_holds_only_complete_rows() -> None:
    """The flusher copies on its own thread: a step half appended is left for the next one."""
    arrays = new_arrays()
    for name, values in arrays.items():
        values.extend([1, 2] if name != COLUMNS[-1] else [1])  # row 1 is being appended
    copy = snapshot(arrays)
    assert {len(v) for v in copy.values()} == {1}
    arrays[COLUMNS[0]].append(3)  # the live columns grow on; the copy does not
    assert len(copy[COLUMNS[0]]) == 1
