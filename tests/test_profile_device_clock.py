"""CUDA event times read lazily (fake events here; the gpu-marked test runs the real ones)."""

from __future__ import annotations

import math
from array import array
from collections import deque
from itertools import pairwise
from pathlib import Path

import pytest
import torch

from batchgen.profile.device_clock import CudaClock


class FakeDevice:
    """Events get the next time of `times` when recorded; advance(t) completes those before t."""

    def __init__(self, times: list[float]) -> None:
        self.times, self.events = iter(times), []

    def event(self) -> FakeEvent:
        self.events.append(FakeEvent(self))
        return self.events[-1]

    def advance(self, until: float) -> None:
        for event in self.events:
            event.done = event.done or event.at <= until


class FakeEvent:
    def __init__(self, device: FakeDevice) -> None:
        self.device, self.at, self.done = device, 0.0, True

    def record(self, stream: object) -> None:
        self.at, self.done = next(self.device.times), False

    def query(self) -> bool:
        return self.done

    def elapsed_time(self, other: FakeEvent) -> float:
        assert self.done and other.done, "elapsed_time on an event not completed raises"
        return other.at - self.at

    def synchronize(self) -> None:
        self.device.advance(self.at)


def fake_clock(device: FakeDevice, monkeypatch: pytest.MonkeyPatch) -> CudaClock:
    monkeypatch.setattr(torch.cuda, "Event", lambda enable_timing: device.event())
    clock = object.__new__(CudaClock)  # no CUDA: skip the start-up synchronization
    clock.stream, clock.anchor = None, device.event()  # done, at 0
    clock._pool, clock._pending = [], deque()
    return clock


def test_completed_steps_are_read_in_order_without_waiting(monkeypatch) -> None:
    device = FakeDevice([1.0, 2.0, 3.0, 4.5, 5.0, 6.0, 9.0])
    clock = fake_clock(device, monkeypatch)
    starts, ends = array("d", [math.nan] * 3), array("d", [math.nan] * 3)
    for step in range(3):
        clock.end(step, clock.begin())
    device.advance(3.0)  # step 1 started, not ended
    clock.read(starts, ends, limit=5)
    assert (starts[0], ends[0]) == (1.0, 2.0) and math.isnan(starts[1])
    device.advance(6.0)
    clock.read(starts, ends, limit=1)  # at most `limit` steps per call
    assert ends[1] == 4.5 and math.isnan(ends[2])
    assert clock.finish(starts, ends) == 9.0  # waits once, reads the rest
    assert list(starts) == [1.0, 3.0, 5.0] and list(ends) == [2.0, 4.5, 6.0]
    assert len(device.events) == 1 + 6  # the anchor, the steps'; the stop reused a read one


@pytest.mark.gpu
def test_a_profiled_gpu_job_has_event_times_and_synchronization(model_dir, tmp_path: Path):
    from batchgen.job import run_job
    from batchgen.profile.records import CAUSES, SYNCHRONIZATION
    from batchgen.profile.report import write_report
    from batchgen.profile.store import read_records
    from tests.test_job import spec_for, write_jsonl

    inp = write_jsonl(tmp_path / "in.jsonl", [{"prompt": f"Item {i} and more."} for i in range(16)])
    causes = {}
    # big enough that a step's device time exceeds the host's launch of it (graph replay): the
    # synchronous loop then blocks on every step's tokens (float32: this random model's
    # logits are large enough that bf16 differs from its own forward by more than the probe
    # accepts)
    model = model_dir(
        "llama", hidden_size=1024, intermediate_size=4096, num_hidden_layers=8,
        num_attention_heads=8, num_key_value_heads=8,
    )  # fmt: skip
    # the engine in its own process (the default on a GPU: it records its steps there), and
    # once in the job's process
    for overlap, place in (("true", "auto"), ("false", "auto"), ("true", "thread")):
        out = tmp_path / f"out-{overlap}-{place}"
        spec = spec_for(
            model, inp, out, "runtime.device='cuda'", "runtime.dtype='float32'",
            "runtime.profile=true",
            "runtime.num_kv_blocks=512", "sampling.max_new_tokens=24", "sampling.ignore_eos=true",
            f"runtime.overlap={overlap}", f"runtime.engine_process='{place}'",
        )  # fmt: skip
        result = run_job(spec)
        info, records = read_records(Path(result.profile_file))
        assert info.on_gpu and info.stop_gpu_ms > 0
        assert all(r.gpu_start_ms is not None and r.gpu_end_ms >= r.gpu_start_ms for r in records)
        assert all(b.gpu_start_ms >= a.gpu_end_ms - 1e-3 for a, b in pairwise(records))
        assert any(r.graphed for r in records)
        report = write_report(out)
        totals = report.result.by_cause()
        idle = report.result.wall_ms - report.result.busy_ms
        assert sum(ms for ms, _ in totals.values()) == pytest.approx(idle, abs=1e-3)
        assert set(totals) == set(CAUSES)
        assert ("engine_process" in result.summary.startup_s) == (place == "auto")
        causes[overlap, place] = totals
    assert causes["false", "auto"][SYNCHRONIZATION][1] > 0  # the synchronous loop waits
