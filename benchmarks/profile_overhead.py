"""The step recorder's host cost per step, without a model: the calls the engine and the
runner make for one launched step, timed over many steps with a batch of 256 decodes.

    PYTHONPATH=. python benchmarks/profile_overhead.py [--device cuda]

On CUDA this includes recording two events per step and reading them back lazily (with a tiny
kernel standing in for the step's work). Compare with a step's time (tens of ms for W1 8b):
the recorder must stay under 1% of it.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from batchgen.engine.block_manager import BlockManager
from batchgen.engine.scheduler import Batch, ScheduledChunk, Scheduler
from batchgen.profile.recorder import Gauges, StepRecorder


def fake_engine(device: torch.device) -> SimpleNamespace:
    blocks = BlockManager(4096, 16, enable_caching=True)
    scheduler = Scheduler(blocks, 256, 8192, True)
    config = SimpleNamespace(overlap=True, max_num_seqs=256)
    runner = SimpleNamespace(step_hook=None)
    return SimpleNamespace(
        scheduler=scheduler, blocks=blocks, runner=runner, config=config, device=device,
        num_blocks=4096, profiler=None,
    )  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--steps", type=int, default=20000)
    args = parser.parse_args()
    device = torch.device(args.device)
    engine = fake_engine(device)
    batch = Batch([ScheduledChunk(None, 100, 1, True, True)] * 256, 256)
    work = torch.zeros(1024, device=device)
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "steps.parquet"
        recorder = StepRecorder(engine, path, "bench", Gauges(lambda: 3, lambda: 5)).attach()
        start = time.perf_counter()
        for _ in range(args.steps):
            recorder.schedule_begin()
            recorder.scheduled(batch)
            mark = recorder.begin()
            if device.type == "cuda":
                work.add_(1)
            recorder.end(mark, True)
            recorder.post_begin()
            recorder.post_ready()
            recorder.post_end()
        per_step = (time.perf_counter() - start) / args.steps
        recorder.close()
    print(f"{device}: {per_step * 1e6:.2f} us per step over {args.steps} steps")


if __name__ == "__main__":
    main()
