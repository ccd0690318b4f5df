"""The structured-output host work of a step on this machine's CPU: Grammars.fill (each
matcher consumes its newest token, then the step's bitmask is filled) over a batch of samples
of the example schema, with the 32k bench tokenizer.

    PYTHONPATH=$PWD python benchmarks/grammar_fill.py [--rows 256] [--threads 1 4 16]
        [--switch-ms 5 0.1]

The samples replay seeded documents drawn uniformly among the allowed tokens (what a random-
weight model does): mid-string, between keys, in numbers and arrays, then finished rows drop
out. "one lexer" gives every sample a copy of one compiled matcher (copies share its lexer
under one lock: the fill is serial whatever the thread count); "lanes" is what the engine does
(one call into llguidance's executor per step, on the fill thread, while the calling thread
waits); "lanes, torch fill_" is the engine's design with the mask reset by torch's fill_
instead of numpy (torch's OpenMP threads then spin on the cores llguidance's threads need).
--switch-ms sets sys.setswitchinterval for the run. (A design with a Python thread per share of
lanes, each calling its own one-thread executor, was measured here before and dropped.)
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from types import SimpleNamespace

import torch

from batchgen.bench.job_path import bench_tokenizer
from batchgen.engine.grammar import EXAMPLE_SCHEMA, Grammars, GrammarSpec, GrammarState
from batchgen.engine.sampling_params import SamplingParams
from batchgen.models.tiny import batchgen_home

SPEC = GrammarSpec("json_schema", SamplingParams(json_schema=EXAMPLE_SCHEMA).json_schema)


def documents(tokenizer, rows: int, seed: int = 0) -> list[list[int]]:
    """rows seeded token sequences valid under the schema, each ending with its grammar."""
    eos = frozenset([tokenizer.eos_token_id])
    grammars = Grammars(tokenizer, len(tokenizer), eos, rows, torch.device("cpu"))
    compiled = grammars.submit(SPEC).result()
    samples = [_sample(grammars.matcher(compiled)) for _ in range(rows)]
    rng, shifts = random.Random(seed), torch.arange(32, dtype=torch.int32)
    live = samples
    while live:
        mask = grammars.fill(live, len(live))  # each consumes its last token, then its mask
        going = []
        for row, sample in enumerate(live):
            if sample.grammar.matcher.is_stopped():
                continue  # the document is complete
            allowed = ((mask[row][:, None] >> shifts) & 1).view(-1).nonzero().view(-1)
            sample.output_token_ids.append(int(allowed[rng.randrange(len(allowed))]))
            going.append(sample)
        live = going
    grammars.close()
    return [s.output_token_ids for s in samples]


class TorchFillGrammars(Grammars):
    """The engine's fill, but the mask reset each step by torch (it was, before)."""

    @staticmethod
    def _allow_all(mask: torch.Tensor) -> None:
        mask.fill_(-1)


def _sample(state: GrammarState) -> SimpleNamespace:
    return SimpleNamespace(grammar=state, finish_reason=None, output_token_ids=[])


DESIGNS = {
    "one lexer": Grammars,
    "lanes": Grammars,
    "lanes, torch fill_": TorchFillGrammars,
}


def replay(tokenizer, docs: list[list[int]], threads: int, design: str) -> dict[str, float]:
    """-> per step: wall ms, CPU ms (all threads), constrained rows."""
    eos = frozenset([tokenizer.eos_token_id])
    lanes = design != "one lexer"
    grammars = DESIGNS[design](
        tokenizer, len(tokenizer), eos, len(docs), torch.device("cpu"), threads
    )
    if lanes:
        grammars.prepare(SPEC)
    compiled = grammars.submit(SPEC).result()
    one = compiled.lanes[0]
    samples = [
        _sample(grammars.matcher(compiled) if lanes else GrammarState(one.deep_copy(), id(one)))
        for _ in docs
    ]
    wall = cpu = rows = 0.0
    steps = max(map(len, docs))
    for step in range(steps):
        live = [s for s, doc in zip(samples, docs, strict=True) if step < len(doc)]
        start, start_cpu = time.perf_counter(), time.process_time()
        grammars.fill(live, len(live))
        wall += time.perf_counter() - start
        cpu += time.process_time() - start_cpu
        rows += len(live)
        for s, doc in zip(samples, docs, strict=True):
            if step < len(doc):
                s.output_token_ids.append(doc[step])
    grammars.close()
    return {"wall_ms": 1e3 * wall / steps, "cpu_ms": 1e3 * cpu / steps, "rows": rows / steps}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--switch-ms", type=float, nargs="+", default=[5.0])
    args = parser.parse_args()
    tokenizer = bench_tokenizer(batchgen_home())
    docs = documents(tokenizer, args.rows)
    mean = sum(map(len, docs)) / len(docs)
    print(f"rows {args.rows}, vocab {len(tokenizer)}, tokens per document {mean:.1f}")
    print("| matchers | threads | switch ms | fill ms/step (wall) | CPU ms/step | rows/step |")
    print("|---|---|---|---|---|---|")
    for switch in args.switch_ms:
        sys.setswitchinterval(switch / 1e3)
        for threads in args.threads:
            for design in DESIGNS:
                r = replay(tokenizer, docs, threads, design)
                print(
                    f"| {design} | {threads} | {switch:g} | {r['wall_ms']:.2f} "
                    f"| {r['cpu_ms']:.2f} | {r['rows']:.0f} |"
                )


if __name__ == "__main__":
    main()
