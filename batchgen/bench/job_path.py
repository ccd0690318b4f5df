"""The job path against the bare engine, on the same text prompts.

A 32k-vocabulary byte-level BPE is trained on English text that ships with Python (the
language reference in `pydoc_data`) and cached in $BATCHGEN_HOME. Text prompts cut from that
text are written to a Parquet file, and a random-weight Llama of the shape with the tokenizer's
vocabulary to a model folder. An engine on that folder runs the prompts as token ids through
`Engine.generate` (the engine alone), then as a real job (Parquet reader, tokenizer threads,
engine, detokenizer, shard writer, final file) in this process; then a job runs them with its
engine in a process of its own (EngineProcess, what `batchgen run` does on a GPU). Each engine
warms up on every prompt first and starts each timed path with an empty prefix cache.
"""

from __future__ import annotations

import ast
import functools
import gc
import os
import random
import sysconfig
import tempfile
import time
from pathlib import Path
from typing import Any, NamedTuple

import pyarrow as pa
import pyarrow.parquet as pq
import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from batchgen.bench.systems import CudaTimeline
from batchgen.bench.workloads import Shape
from batchgen.engine import Engine, EngineConfig, SamplingParams
from batchgen.engine.remote.client import EngineProcess
from batchgen.engine.remote.placement import keep_process_off, kept_cores

VOCAB = 32768
# the job paths run in this process: the engine in the job's process, tokenizing and decoding
# on its threads, and with tokenizer processes
IN_PROCESS_PATHS = {
    "job path, engine in the job's process": {"runtime.engine_process": "thread"},
    "same, 2 tokenizer processes": {
        "runtime.engine_process": "thread",
        "runtime.tokenizer_processes": 2,
    },
}
OWN_PROCESS_PATH = "job path, engine in its own process (the default on a GPU)"
TIMELINE = "batchgen.bench.systems:CudaTimeline"  # the step hook an EngineProcess makes


class PathResult(NamedTuple):
    path: str
    seconds: float
    output_tokens: int
    gpu_idle_share: float | None
    head_s: float  # from the start to the first step's launch
    tail_s: float  # from the last step's launch to the end (its results written)
    busy_s: float  # GPU time inside the steps, all of them
    graphed_steps: int  # decode steps replayed from their graphs
    token_graph_steps: int  # steps with prefill chunks replayed from a token size's graph
    eager_steps: int  # the other steps, launched op by op
    idle_ms: dict[str, float]  # GPU idle by where it falls (systems.idle_breakdown)

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds


@functools.cache
def english_text() -> str:
    """English prose that ships with Python: the language reference (pydoc_data) and the
    docstrings and comments of the standard library's modules (about 4 MB)."""
    from pydoc_data.topics import topics

    parts = [topics[k] for k in sorted(topics)]
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"test", "tests", "idle_test", "site-packages", "lib2to3"}
    for path in sorted(root.rglob("*.py")):
        if skip.isdisjoint(path.relative_to(root).parts):
            parts += _docstrings(path)
    return "\n\n".join(parts)


def _docstrings(path: Path) -> list[str]:
    """The file's docstrings, then its comment lines as one paragraph."""
    try:
        source = path.read_text(encoding="utf-8")
        tree = ast.parse(source)
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return []
    kinds = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    docs = (ast.get_docstring(n) for n in ast.walk(tree) if isinstance(n, kinds))
    lines = (line.strip() for line in source.splitlines())
    comments = " ".join(line[2:] for line in lines if line.startswith("# "))
    return [d for d in docs if d] + [comments]


def bench_tokenizer(home: Path) -> PreTrainedTokenizerFast:
    """The 32k byte-level BPE, trained once and kept under home."""
    from batchgen.models.tiny import train_tokenizer

    folder = home / "bench" / f"tokenizer-{VOCAB}"
    if (folder / "tokenizer.json").is_file():
        return PreTrainedTokenizerFast.from_pretrained(folder)
    tokenizer = train_tokenizer(VOCAB, [english_text()])
    tokenizer.save_pretrained(folder)
    return tokenizer


def text_prompts(
    tokenizer: PreTrainedTokenizerFast, n: int, lengths: tuple[int, int], seed: int = 0
) -> list[str]:
    """n seeded passages of the text, each about a length in `lengths` tokens long."""
    ids = tokenizer(english_text(), add_special_tokens=False).input_ids
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        size = rng.randint(*lengths)
        start = rng.randrange(0, len(ids) - size)
        out.append(tokenizer.decode(ids[start : start + size]))
    return out


def build_model(shape: Shape, tokenizer: PreTrainedTokenizerFast) -> LlamaForCausalLM:
    torch.manual_seed(0)
    values = shape.llama_config() | {"vocab_size": len(tokenizer)}
    config = LlamaConfig(
        **values, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id
    )
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"):
            return LlamaForCausalLM(config).eval()
    finally:
        torch.set_default_dtype(default)


def run_paths(
    shape: Shape, rows: int, new_tokens: int, lengths: tuple[int, int], config: EngineConfig
) -> tuple[list[PathResult], int]:
    """-> ([engine alone, the in-process job paths, the own-process one], vocabulary) on the
    same prompts and the same saved model."""
    from batchgen.home import batchgen_home

    tokenizer = bench_tokenizer(batchgen_home())
    texts = text_prompts(tokenizer, rows, lengths)
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    ids = [tokenizer(t).input_ids for t in texts]
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        folder = save_model(shape, tokenizer, work / "model")
        pq.write_table(pa.table({"prompt": texts}), work / "prompts.parquet")
        engine = Engine(str(folder), config)
        _warm_up(engine, ids, params)
        results = [_engine_alone(engine, ids, params)]
        for name, settings in IN_PROCESS_PATHS.items():
            engine.blocks.clear_cache()  # no path starts with prompts another one cached
            results.append(_job(engine, work, params, name, settings))
        engine.close()
        del engine
        # as in a `batchgen run` process (process_start.py), what lives on is kept out of the
        # collector's sight; else the close() above hands torch's and transformers' objects
        # back to it, and a full collection (0.2-0.3 s, every thread of this process stopped)
        # falls somewhere in the timed job (at its start, it holds back the first prompts)
        gc.collect()
        gc.freeze()
        cpus = kept_cores(None, os.sched_getaffinity(0))  # as `batchgen run` keeps them
        served = EngineProcess(str(folder), config, quiet=True, step_hook=TIMELINE, cpus=cpus)
        keep_process_off(cpus)  # this process too, its pools started earlier included
        with served:
            _warm_up(served, ids, params)
            served.clear_prefix_cache()
            settings = {"runtime.engine_process": "process"}
            results.append(_job(served, work, params, OWN_PROCESS_PATH, settings))
    return results, len(tokenizer)


def _warm_up(engine: Any, ids: list[list[int]], params: SamplingParams) -> None:
    """Every prompt, two tokens each: Triton compiles each prefill variant the timed runs
    launch (a 64-row warm-up left the first timed path paying compiles the later ones did not)."""
    list(engine.generate(ids, params.replace(max_new_tokens=2), decode=False))
    if isinstance(engine, Engine):
        engine.blocks.clear_cache()


def _engine_alone(engine: Engine, ids: list[list[int]], params: SamplingParams) -> PathResult:
    timeline = CudaTimeline()
    engine.runner.step_hook = timeline
    torch.cuda.synchronize()
    start = time.perf_counter()
    timeline.open()
    tokens = sum(len(o.output_token_ids) for o in engine.generate(ids, params, decode=False))
    timeline.close()
    torch.cuda.synchronize()
    end = time.perf_counter()
    engine.runner.step_hook = None
    return _result("engine alone (token ids)", start, end, tokens, timeline.report(end - start))


def _job(
    engine: Engine | EngineProcess,
    work: Path,
    params: SamplingParams,
    name: str,
    settings: dict[str, object],
) -> PathResult:
    """One job over work/prompts.parquet on `engine` (its step timeline: in this process for
    an Engine, in the server for an EngineProcess, which made it at start)."""
    from batchgen.job import run_job
    from batchgen.spec import load_spec

    out = work / f"out-{len(list(work.glob('out-*')))}"
    values = {
        "input.path": str(work / "prompts.parquet"),
        "output.dir": str(out),
        "sampling.max_new_tokens": params.max_new_tokens,
        "sampling.ignore_eos": True,
        "runtime.quiet": True,
        **settings,
    }
    spec = load_spec(None, values=values)
    timeline = CudaTimeline() if isinstance(engine, Engine) else None
    if timeline is not None:
        engine.runner.step_hook = timeline
        timeline.open()
    start = time.perf_counter()
    result = run_job(spec, engine=engine)
    end = time.perf_counter()
    if timeline is not None:
        timeline.close()
        engine.runner.step_hook = None
        report = timeline.report(end - start)
    else:
        report = engine.step_report
    summary = result.summary
    if not result.complete or summary.rows_error:
        raise RuntimeError(f"the benchmark job did not complete cleanly: {summary}")
    return _result(name, start, end, summary.run_generated_tokens, report)


def _result(name: str, start: float, end: float, tokens: int, report: dict) -> PathResult:
    """report: CudaTimeline.report()'s, of the same run."""
    return PathResult(
        name,
        end - start,
        tokens,
        report["gpu_idle_share"],
        report["first_launch"] - start,
        end - report["last_launch"],
        report["busy_s"],
        report["graphed_steps"],
        report["token_graph_steps"],
        report["other_steps"] - report["token_graph_steps"],
        report["idle_ms"],
    )


def table(shape: str, rows: int, new_tokens: int, results: list[PathResult], vocab: int) -> str:
    alone = results[0]
    lines = [
        f"{shape}, {rows} rows x {new_tokens} new tokens, {vocab:,}-token vocabulary",
        "| path | output tok/s | x engine alone | GPU idle (steady decode) "
        "| start -> first step s | last step -> end s | GPU busy s "
        "| steps: decode graphs / token graphs / eager "
        "| GPU idle ms: before first step / next to other steps / between decode steps / "
        "after last step |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        idle = "-" if r.gpu_idle_share is None else f"{100 * r.gpu_idle_share:.1f}%"
        ratio = r.tokens_per_s / alone.tokens_per_s
        lines.append(
            f"| {r.path} | {r.tokens_per_s:,.0f} | {ratio:.3f}x | {idle} | {r.head_s:.3f} "
            f"| {r.tail_s:.3f} | {r.busy_s:.3f} | {r.graphed_steps} / {r.token_graph_steps} "
            f"/ {r.eager_steps} "
            f"| {' / '.join(f'{v:.1f}' for v in r.idle_ms.values()) or '-'} |"
        )
    return "\n".join(lines)


def save_model(shape: Shape, tokenizer: PreTrainedTokenizerFast, folder: Path) -> Path:
    """The random-weight model of the shape, saved with the tokenizer into folder."""
    model = build_model(shape, tokenizer)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    del model
    torch.cuda.empty_cache()
    return folder


def write_model_folder(shape: str, folder: Path) -> Path:
    """A saved random-weight model of the shape with the 32k tokenizer (kept if it exists)."""
    from batchgen.bench.workloads import SHAPES
    from batchgen.home import batchgen_home

    if not (folder / "config.json").is_file():
        save_model(SHAPES[shape], bench_tokenizer(batchgen_home()), folder)
    return folder


def write_prompts(path: Path, rows: int, seed: int = 0) -> None:
    """rows text prompts of W1's lengths as a Parquet file with a `prompt` column."""
    from batchgen.bench.workloads import WORKLOADS
    from batchgen.home import batchgen_home

    tokenizer = bench_tokenizer(batchgen_home())
    texts = text_prompts(tokenizer, rows, WORKLOADS["W1"].prompt_range, seed)
    pq.write_table(pa.table({"prompt": texts}), path)


def main(argv: list[str]) -> None:
    """python -m batchgen.bench.job_path SHAPE WORK [NAME=ROWS[:SEED] ...]: WORK/model-SHAPE
    and WORK/NAME.parquet for the benchmark scripts."""
    shape, work = argv[0], Path(argv[1])
    work.mkdir(parents=True, exist_ok=True)
    write_model_folder(shape, work / f"model-{shape}")
    for item in argv[2:]:
        name, _, count = item.partition("=")
        rows, _, seed = count.partition(":")
        write_prompts(work / f"{name}.parquet", int(rows), int(seed or 0))


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
