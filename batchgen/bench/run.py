"""One benchmark run: build the model, run each system on the same prompts, print one table."""

from __future__ import annotations

import datetime
import json
import platform
from dataclasses import replace
from pathlib import Path

import torch
from transformers import PreTrainedModel

from batchgen.bench.systems import (
    RunResult,
    build_model,
    match_rate,
    percentile,
    run_batchgen,
    run_hf_generate_batch,
    run_hf_static,
    teacher_forced_agreement,
)
from batchgen.bench.workloads import SHAPES, WORKLOADS, roofline_seconds
from batchgen.engine import EngineConfig
from batchgen.errors import BatchgenError

SYSTEMS = ("overlap", "sync", "hf-static", "hf-batch")
# --prefix-caching: which batchgen runs each loop gets (None = as the engine config says)
PREFIX_CACHING = {"on": (True,), "off": (False,), "both": (True, False)}


def run_bench(
    shape_name: str,
    workload_name: str,
    systems: tuple[str, ...],
    config: EngineConfig,
    requests: int | None = None,
    prefix_caching: str | None = None,
) -> dict:
    """prefix_caching: a key of PREFIX_CACHING; "both" times each batchgen loop with the
    cache and without it, on the same prompts."""
    if not torch.cuda.is_available():
        raise BatchgenError("batchgen bench needs a CUDA GPU (it times real model shapes)")
    shape, workload = SHAPES[shape_name], WORKLOADS[workload_name]
    if requests is not None:
        workload = replace(workload, requests=requests)
    prompts = workload.prompts(shape.vocab)
    model = build_model(shape)
    modes = PREFIX_CACHING[prefix_caching] if prefix_caching else (config.enable_prefix_caching,)
    results, infos = _run_systems(model, prompts, workload.output_tokens, systems, config, modes)
    lens = [len(p) for p in prompts]
    bound = roofline_seconds(shape, lens, workload.output_tokens, workload.shared_prefix)
    first = next((r for r in results if r.system.startswith("batchgen")), None)
    if first is not None:
        infos["hf_teacher_forced"] = teacher_forced_agreement(model, prompts, first.tokens)
    return {
        "shape": shape_name,
        "workload": workload.name,
        "requests": workload.requests,
        "results": results,
        "infos": infos,
        "roofline_s": bound,
    }


def _run_systems(
    model: PreTrainedModel,
    prompts: list[list[int]],
    output_tokens: int,
    systems: tuple[str, ...],
    config: EngineConfig,
    modes: tuple[bool, ...],
) -> tuple[list[RunResult], dict[str, dict]]:
    """Each system in turn (each batchgen loop once per prefix-caching mode)."""
    results: list[RunResult] = []
    infos: dict[str, dict] = {}
    for system in systems:
        if system in ("overlap", "sync"):
            for caching in modes:
                cfg = replace(config, overlap=system == "overlap", enable_prefix_caching=caching)
                result, info = run_batchgen(model, prompts, output_tokens, cfg)
                infos[system if caching else f"{system}, no prefix cache"] = info
                results.append(_printed(result))
        elif system == "hf-static":
            results.append(_printed(run_hf_static(model, prompts, output_tokens)))
        else:
            results.append(_printed(run_hf_generate_batch(model, prompts, output_tokens)))
    return results, infos


def _printed(result: RunResult) -> RunResult:
    hits = (
        "" if result.cache_hit_rate is None else f", prefix cache hits {result.cache_hit_rate:.1%}"
    )
    print(f"  {result.system}: {result.tokens_per_s:,.0f} output tok/s{hits}", flush=True)
    return result


def table(report: dict) -> str:
    results: list[RunResult] = report["results"]
    hf = [r.tokens_per_s for r in results if r.system.startswith("HF")]
    best_hf = max(hf) if hf else None
    lines = [
        f"{report['shape']} {report['workload']} ({report['requests']} requests), roofline "
        f"{report['roofline_s']:.2f} s",
        "| system | output tok/s | x best HF | of roofline | GPU idle (steady decode) "
        "| TTFT p50 / p90 / p99 s | prefix cache hits |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        ratio = f"{r.tokens_per_s / best_hf:.2f}x" if best_hf else "-"
        idle = "-" if r.gpu_idle_share is None else f"{100 * r.gpu_idle_share:.1f}%"
        ttft = (
            "-"
            if not r.ttft
            else " / ".join(f"{percentile(r.ttft, q):.2f}" for q in (0.5, 0.9, 0.99))
        )
        hits = "-" if r.cache_hit_rate is None else f"{r.cache_hit_rate:.1%}"
        lines.append(
            f"| {r.system} | {r.tokens_per_s:,.0f} | {ratio} | "
            f"{report['roofline_s'] / r.seconds:.1%} | {idle} | {ttft} | {hits} |"
        )
    lines += _agreement(results)
    for system, info in report["infos"].items():
        lines.append(f"- {system}: {json.dumps(info)}")
    return "\n".join(lines)


def _agreement(results: list[RunResult]) -> list[str]:
    by_name = {r.system: r for r in results}
    out = []
    # each loop's first run (the cached one when both ran)
    ov = next((r for r in results if r.system.startswith("batchgen overlapped")), None)
    sy = next((r for r in results if r.system.startswith("batchgen synchronous")), None)
    if ov and sy:
        out.append(
            f"- overlapped == synchronous tokens: {ov.tokens == sy.tokens}; "
            f"speed-up {ov.tokens_per_s / sy.tokens_per_s:.2f}x"
        )
    for r in results:
        off = by_name.get(f"{r.system}, no prefix cache")
        if off is not None:
            out.append(
                f"- {r.system}, prefix cache on == off tokens: {r.tokens == off.tokens}; "
                f"speed-up {r.tokens_per_s / off.tokens_per_s:.2f}x"
            )
    for r in results:
        if r.system.startswith("HF") and ov:
            rate, diverged = match_rate(ov.tokens, r.tokens)
            out.append(
                f"- bf16 greedy match vs {r.system}: {rate:.1%} of positions "
                f"({diverged} of {len(r.tokens)} requests diverge somewhere)"
            )
    return out


def run_job_bench(
    shape_name: str,
    workload_name: str,
    rows: int,
    new_tokens: int | None,
    config: EngineConfig,
) -> str:
    """The job path against the engine alone (see bench/job_path.py) -> the table."""
    from batchgen.bench import job_path

    if not torch.cuda.is_available():
        raise BatchgenError("batchgen bench needs a CUDA GPU (it times real model shapes)")
    if rows < 1 or (new_tokens is not None and new_tokens < 1):
        raise BatchgenError("--job ROWS and --new-tokens must be >= 1")
    workload = WORKLOADS[workload_name]
    tokens = new_tokens or workload.output_tokens
    shape = SHAPES[shape_name]
    results, vocab = job_path.run_paths(shape, rows, tokens, workload.prompt_range, config)
    return job_path.table(shape_name, rows, tokens, results, vocab)


def record(title: str, text: str, path: Path, command: str) -> None:
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    header = (
        f"\n## {stamp} — {title} on {gpu}\n\n"
        f"`{command}` (torch {torch.__version__}, python {platform.python_version()})\n\n"
    )
    with open(path, "a") as f:
        f.write(header + text + "\n")
