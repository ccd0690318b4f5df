"""Where a structured step's time goes, per kind of step, without a profiler: W1 on the 8b shape
(random weights, the 32k bench tokenizer, 1,024 rows) with the example schema on every row,
then the same rows unconstrained with the same token counts, twice each after a warm-up run:

    PYTHONPATH=$PWD python benchmarks/structured_steps.py

Steps with prefill chunks ("mixed": an eager forward, ~10-16 ms of Python on the engine thread)
and decode-only steps (a CUDA-graph replay) are reported apart: the period between two step
launches, the time the engine thread spends queuing the forward, when the fill thread started
and ended (after the forward's queuing began), and how long the engine thread then waited.
"""

from __future__ import annotations

import collections
import itertools
import time

import torch

from batchgen import Engine, EngineConfig, SamplingParams
from batchgen.bench.job_path import bench_tokenizer, build_model
from batchgen.bench.workloads import SHAPES, WORKLOADS, Workload
from batchgen.engine.grammar import EXAMPLE_SCHEMA
from batchgen.engine.request import Prompt
from batchgen.models.tiny import batchgen_home

clock = time.perf_counter


def _timed(owner: object, name: str, record: dict, start: str, end: str) -> None:
    inner = getattr(owner, name)

    def timed(*args, **kwargs):
        record[start] = clock()
        try:
            return inner(*args, **kwargs)
        finally:
            record[end] = clock()

    setattr(owner, name, timed)


def main() -> None:
    tokenizer = bench_tokenizer(batchgen_home())
    engine = Engine(build_model(SHAPES["8b"], tokenizer), EngineConfig(), tokenizer=tokenizer)
    w1 = WORKLOADS["W1"]
    ids = Workload("W1", 1024, w1.prompt_range, w1.output_tokens).prompts(len(tokenizer))
    params = SamplingParams(max_new_tokens=256, temperature=1.0, seed=0)
    schema = [Prompt(p, str(i), {"json_schema": EXAMPLE_SCHEMA}) for i, p in enumerate(ids)]
    outs = {o.request_id: o for o in engine.generate(schema, params)}  # warm-up, lengths
    lengths = {key: len(out.output_token_ids) for key, out in outs.items()}
    plain = [
        Prompt(p, str(i), {"max_new_tokens": lengths[str(i)], "ignore_eos": True})
        for i, p in enumerate(ids)
    ]
    steps: list[dict] = []
    now: dict = {}
    launch = engine._launch

    def recorded(batch):
        now.clear()
        now["t0"], now["mixed"] = clock(), any(c.num_tokens > 1 for c in batch.chunks)
        result = launch(batch)
        steps.append(dict(now))
        return result

    engine._launch = recorded
    grammars = engine.grammars
    _timed(engine.runner, "begin", now, "b0", "b1")
    _timed(grammars, "finish", now, "f0", "f1")
    _timed(grammars, "_fill", now, "fs", "fe")
    for name, prompts in (("schema", schema), ("plain", plain)) * 2:
        steps.clear()
        torch.cuda.synchronize()
        start = clock()
        list(engine.generate(prompts, params))
        torch.cuda.synchronize()
        print(f"== {name}: {clock() - start:.2f} s, {len(steps)} steps")
        kinds = collections.defaultdict(list)
        for step, following in itertools.pairwise(steps):
            kinds[step["mixed"]].append((following["t0"] - step["t0"], step))
        for mixed, rows in kinds.items():
            n = len(rows)

            def ms(f, rows=rows, n=n):
                return 1e3 * sum(f(s) for _, s in rows) / n

            line = (
                f"  {'mixed' if mixed else 'decode'} x{n}: period "
                f"{1e3 * sum(p for p, _ in rows) / n:.2f} ms, queue forward "
                f"{ms(lambda s: s['b1'] - s['b0']):.2f}"
            )
            if all("fs" in s and "f0" in s for _, s in rows):
                line += (
                    f", fill thread {ms(lambda s: s['fs'] - s['b0']):.2f} -> "
                    f"{ms(lambda s: s['fe'] - s['b0']):.2f}, then waited "
                    f"{ms(lambda s: s['f1'] - s['f0']):.2f}"
                )
            print(line, flush=True)
    engine.close()


if __name__ == "__main__":
    main()
