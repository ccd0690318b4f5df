"""W1 on the 8b shape (random weights, the 32k bench tokenizer, 1024 rows) with the example
extraction schema on every row, against the same rows unconstrained, in one process:

    PYTHONPATH=$PWD python benchmarks/structured_check.py [--rows 1024]

The unconstrained run generates exactly the token counts the structured run produced (per row
max_new_tokens, ignore_eos), so both do the same device work and the ratio of their tok/s is
the grammar's cost: compile (cached after the first row), the host mask fill that overlaps the
forward, the mask copy and its application in the sampler.

A constrained step starts its mask fill on the fill thread (which waits for the previous
step's tokens itself), queues its forward meanwhile, post-processes the previous step, then
waits for the fill and queues the sampler: the device waits unless the host's whole loop fits
in a step. The host split per step of both runs is printed to show which part does not. The
whole structured run is done once first, untimed: kernel compiles for the prefill shapes of
this schedule would otherwise land in whichever run comes first.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict

import torch

import batchgen.engine.engine as engine_module
from batchgen.bench.job_path import bench_tokenizer, build_model
from batchgen.bench.workloads import SHAPES, WORKLOADS, Workload
from batchgen.engine import Engine, EngineConfig, SamplingParams
from batchgen.engine.grammar import EXAMPLE_SCHEMA
from batchgen.engine.request import Prompt
from batchgen.models.tiny import batchgen_home

TEMPERATURE, SEED = 1.0, 0
PARTS = {  # label -> (object attribute path, method)
    "schedule": ("scheduler", "schedule"),
    "begin: inputs + queue forward": ("runner", "begin"),
    "sample: queue sampler": ("runner", "sample"),
    "launch (unconstrained: begin + sample)": ("runner", "launch"),
    "post-process (incl. token wait)": ("", "_postprocess"),
    "  of which waiting for tokens": ("module", "wait_tokens"),
    "fill start (work list, Python)": ("grammars", "start"),
    "fill wait (after the forward is queued) + mask copy": ("grammars", "finish"),
}


def _unbounded(schema: object) -> object:
    if isinstance(schema, dict):
        return {k: _unbounded(v) for k, v in schema.items() if k != "maxLength"}
    return schema


UNBOUNDED = _unbounded(EXAMPLE_SCHEMA)


def _timed(engine: Engine, prompts: list[Prompt], params: SamplingParams) -> tuple[float, dict]:
    torch.cuda.synchronize()
    start = time.perf_counter()
    outs = {o.request_id: o for o in engine.generate(prompts, params)}
    torch.cuda.synchronize()
    return time.perf_counter() - start, outs


def _instrument(engine: Engine) -> dict[str, list[float]]:
    """Wrap the loop's parts (PARTS); -> label -> the seconds of each call (appended from
    any thread: list.append is atomic)."""
    spent: dict[str, list[float]] = defaultdict(list)
    for label, (where, name) in PARTS.items():
        owner = engine_module if where == "module" else getattr(engine, where, engine)
        if where and where != "module" and owner is engine:
            continue  # grammars not made yet
        inner = getattr(owner, name)

        def timed(*args, _inner=inner, _label=label, **kwargs):
            start = time.perf_counter()
            try:
                return _inner(*args, **kwargs)
            finally:
                spent[_label].append(time.perf_counter() - start)

        setattr(owner, name, timed)
    return spent


def _split(spent: dict[str, list[float]], steps: int) -> dict[str, float]:
    return {label: 1e3 * sum(spent.get(label, [])) / max(1, steps) for label in PARTS}


def _valid(text: str, schema: dict) -> bool:
    try:
        import jsonschema

        jsonschema.validate(json.loads(text), schema)
        return True
    except ImportError:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False
    except Exception:  # jsonschema.ValidationError
        return False


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=1024)
    parser.add_argument(
        "--schema",
        choices=["example", "unbounded"],
        default="example",
        help="example: EXAMPLE_SCHEMA (its strings have maxLength, so a random model's rows "
        "end and validate); unbounded: the same schema without maxLength (llguidance's masks "
        "inside bounded strings cost ~10x more; a random model's strings then run to the "
        "token limit, so few rows end)",
    )
    parser.add_argument(
        "--fill-threads",
        type=int,
        nargs="+",
        default=[0],
        help="mask fill threads to measure in turn, one count for every step (0: the engine's "
        "default, fewer threads for steps with prefill chunks than for decode steps)",
    )
    args = parser.parse_args()
    rows, target = args.rows, EXAMPLE_SCHEMA if args.schema == "example" else UNBOUNDED
    tokenizer = bench_tokenizer(batchgen_home())
    engine = Engine(build_model(SHAPES["8b"], tokenizer), EngineConfig(), tokenizer=tokenizer)
    w1 = WORKLOADS["W1"]
    ids = Workload("W1", rows, w1.prompt_range, w1.output_tokens).prompts(len(tokenizer))
    params = SamplingParams(max_new_tokens=256, temperature=TEMPERATURE, seed=SEED)
    schema = {"json_schema": target}
    structured = [Prompt(p, str(i), schema) for i, p in enumerate(ids)]
    # warm-up: the whole structured run once (grammar compile, kernel compiles for every
    # prefill shape of this schedule, graphs, allocator); it also gives the output lengths
    _, s_out = _timed(engine, structured, params)
    lengths = {k: len(o.output_token_ids) for k, o in s_out.items()}
    plain = [
        Prompt(p, str(i), {"max_new_tokens": lengths[str(i)], "ignore_eos": True})
        for i, p in enumerate(ids)
    ]
    tokens = sum(lengths.values())
    stopped = [o for o in s_out.values() if o.finish_reason == "stop"]
    valid = sum(_valid(o.text, target) for o in stopped)
    print(f"rows {len(ids)}, generated tokens {tokens} (same in both runs), vocab {len(tokenizer)}")
    print(f"schema {args.schema}: rows ended stop: {len(stopped)}, valid under it: {valid}")
    grammars = engine.grammars
    spent = _instrument(engine)
    for threads in args.fill_threads:
        if threads:  # one executor of that many threads for every step
            grammars.threads = threads
            grammars._executor = grammars._llg.LLExecutor(num_threads=threads)
            grammars._busy_executor = grammars._executor
        spent.clear()
        u_time, u_out = _timed(engine, plain, params)
        u_split, u_steps = dict(spent), len(spent["schedule"])
        spent.clear()
        s_time, s_out2 = _timed(engine, structured, params)
        s_split, s_steps = dict(spent), len(spent["schedule"])
        assert {k: len(o.output_token_ids) for k, o in u_out.items()} == lengths
        # a GPU forward is not batch-invariant: once the schedule differs (here: no compile
        # wait), a seeded row may take another path, so each run's own token count is used
        s_tokens = sum(len(o.output_token_ids) for o in s_out2.values())
        same = sum(o.output_token_ids == s_out[k].output_token_ids for k, o in s_out2.items())
        print(f"structured rows equal to the warm-up's: {same} of {len(s_out2)}")
        s_rate, u_rate = s_tokens / s_time, tokens / u_time
        fills = len(s_split.get("fill start (work list, Python)", []))
        busy = threads or "default"
        print(f"fill threads {busy} (decode steps {grammars.threads}), steps with a fill {fills}")
        print("| host ms per loop step | unconstrained | json_schema every row |\n|---|---|---|")
        u_ms, s_ms = _split(u_split, u_steps), _split(s_split, s_steps)
        for label in PARTS:
            print(f"| {label} | {u_ms[label]:.2f} | {s_ms[label]:.2f} |")
        u_loop, s_loop = 1e3 * u_time / max(1, u_steps), 1e3 * s_time / max(1, s_steps)
        print(f"| whole loop step ({u_steps} / {s_steps} steps) | {u_loop:.2f} | {s_loop:.2f} |")
        print("| run | seconds | tok/s |\n|---|---|---|")
        print(f"| unconstrained | {u_time:.2f} | {u_rate:.0f} |")
        print(f"| json_schema every row | {s_time:.2f} | {s_rate:.0f} |")
        print(f"ratio structured / unconstrained tok/s: {s_rate / u_rate:.3f} (target >= 0.9)")
    engine.close()


if __name__ == "__main__":
    main()
