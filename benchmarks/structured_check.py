"""W1 on the 8b shape (random weights, the 32k bench tokenizer) with the example extraction
schema on every row, against the same rows unconstrained, in one process:

    PYTHONPATH=$PWD python benchmarks/structured_check.py

The unconstrained run generates exactly the token counts the structured run produced (per row
max_new_tokens, ignore_eos), so both do the same device work and the ratio of their tok/s is
the grammar's cost: compile (cached after the first row), the host mask fill that overlaps the
forward, the mask copy and its application in the sampler.
"""

from __future__ import annotations

import json
import time

import torch

from batchgen.bench.job_path import bench_tokenizer, build_model
from batchgen.bench.workloads import SHAPES, WORKLOADS
from batchgen.engine import Engine, EngineConfig, SamplingParams
from batchgen.engine.grammar import EXAMPLE_SCHEMA
from batchgen.engine.request import Prompt
from batchgen.models.tiny import batchgen_home

TEMPERATURE, SEED = 1.0, 0


def _timed(engine: Engine, prompts: list[Prompt], params: SamplingParams) -> tuple[float, dict]:
    torch.cuda.synchronize()
    start = time.perf_counter()
    outs = {o.request_id: o for o in engine.generate(prompts, params)}
    torch.cuda.synchronize()
    return time.perf_counter() - start, outs


def _fill_timer(engine: Engine) -> list[float]:
    """Wrap the engine's mask fill; -> the list its per-step host seconds go to."""
    grammars, spent = engine.grammars, []
    fill = grammars.fill

    def timed(rows, num_rows):
        start = time.perf_counter()
        out = fill(rows, num_rows)
        spent.append(time.perf_counter() - start)
        return out

    grammars.fill = timed
    return spent


def _valid(text: str) -> bool:
    try:
        import jsonschema

        jsonschema.validate(json.loads(text), EXAMPLE_SCHEMA)
        return True
    except ImportError:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False
    except Exception:  # jsonschema.ValidationError
        return False


def main() -> None:
    tokenizer = bench_tokenizer(batchgen_home())
    engine = Engine(build_model(SHAPES["8b"], tokenizer), EngineConfig(), tokenizer=tokenizer)
    ids = WORKLOADS["W1"].prompts(len(tokenizer))
    params = SamplingParams(max_new_tokens=256, temperature=TEMPERATURE, seed=SEED)
    schema = {"json_schema": EXAMPLE_SCHEMA}
    warm = [Prompt(p, f"w{i}", schema) for i, p in enumerate(ids[:32])]
    _timed(engine, warm, params.replace(max_new_tokens=16))  # compile, graphs, allocator
    spent = _fill_timer(engine)
    structured = [Prompt(p, str(i), schema) for i, p in enumerate(ids)]
    s_time, s_out = _timed(engine, structured, params)
    lengths = {k: len(o.output_token_ids) for k, o in s_out.items()}
    plain = [
        Prompt(p, str(i), {"max_new_tokens": lengths[str(i)], "ignore_eos": True})
        for i, p in enumerate(ids)
    ]
    u_time, u_out = _timed(engine, plain, params)
    assert {k: len(o.output_token_ids) for k, o in u_out.items()} == lengths
    tokens = sum(lengths.values())
    stopped = [o for o in s_out.values() if o.finish_reason == "stop"]
    valid = sum(_valid(o.text) for o in stopped)
    s_rate, u_rate = tokens / s_time, tokens / u_time
    fill_ms = 1e3 * sum(spent) / max(1, len(spent))
    print(f"rows {len(ids)}, generated tokens {tokens} (same in both runs), vocab {len(tokenizer)}")
    print(f"structured rows ended stop: {len(stopped)}, valid under the schema: {valid}")
    print(f"host mask fill: {len(spent)} steps, {fill_ms:.2f} ms per step on average")
    print("| run | seconds | tok/s |\n|---|---|---|")
    print(f"| unconstrained | {u_time:.2f} | {u_rate:.0f} |")
    print(f"| json_schema every row | {s_time:.2f} | {s_rate:.0f} |")
    print(f"ratio structured / unconstrained tok/s: {s_rate / u_rate:.3f} (target >= 0.9)")
    engine.close()


if __name__ == "__main__":
    main()
