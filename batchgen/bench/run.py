"""One benchmark run: build the model, run each system on the same prompts, print one table."""

from __future__ import annotations

import datetime
import json
import platform
from dataclasses import replace
from pathlib import Path

import torch
from transformers import PreTrainedModel

from batchgen.bench.roof import H200_REFERENCE, measure_roof
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
from batchgen.bench.workloads import SHAPES, WORKLOADS, Precision, roofline_seconds
from batchgen.engine import EngineConfig
from batchgen.engine.quant import is_quantized, quantize_model
from batchgen.errors import BatchgenError

SYSTEMS = ("overlap", "sync", "hf-static", "hf-batch")
# --precisions: what each batchgen loop runs with; HF systems run the 16-bit model only.
# FP8 runs quantize the benchmark's model in place after the 16-bit ones (never reloaded).
PRECISIONS = {"bf16": Precision(), "fp8": Precision(True), "fp8-kv": Precision(True, True)}
# engine settings of every bench run, before the command's own --set: the bench times steady
# generation, so every decode graph is captured before its clock starts (a job's start-up is
# benchmarks/startup.sh's)
BENCH_SETTINGS = ("runtime.cuda_graph_capture='startup'",)
# --prefix-caching: which batchgen runs each loop gets (None = as the engine config says)
PREFIX_CACHING = {"on": (True,), "off": (False,), "both": (True, False)}


def run_bench(
    shape_name: str,
    workload_name: str,
    systems: tuple[str, ...],
    config: EngineConfig,
    requests: int | None = None,
    prefix_caching: str | None = None,
    precisions: tuple[str, ...] = ("bf16",),
) -> dict:
    """prefix_caching: a key of PREFIX_CACHING; "both" times each batchgen loop with the
    cache and without it, on the same prompts. precisions: keys of PRECISIONS, run in that
    table's order (16-bit first: FP8 quantizes the model in place)."""
    if not torch.cuda.is_available():
        raise BatchgenError("batchgen bench needs a CUDA GPU (it times real model shapes)")
    shape, workload = SHAPES[shape_name], WORKLOADS[workload_name]
    if requests is not None:
        workload = replace(workload, requests=requests)
    prompts = workload.prompts(shape.vocab)
    roof = measure_roof()  # before the model takes the GPU's memory
    print(f"roofline figures: {roof.describe()}", flush=True)
    model = build_model(shape)
    modes = PREFIX_CACHING[prefix_caching] if prefix_caching else (config.enable_prefix_caching,)
    lens = [len(p) for p in prompts]
    results: list[RunResult] = []
    infos: dict[str, dict] = {}
    bounds: dict[str, float] = {}
    reference: dict[str, float] = {}
    for name in (p for p in PRECISIONS if p in precisions):
        precision = PRECISIONS[name]
        if precision.weights_fp8 and not is_quantized(model):
            quantize_model(model)
        cfg = replace(config, kv_cache_dtype="fp8" if precision.kv_fp8 else "auto")
        chosen = (
            systems if name == "bf16" else tuple(s for s in systems if s in ("overlap", "sync"))
        )
        label = "" if name == "bf16" else f" [{name}]"
        done, info = _run_systems(model, prompts, workload.output_tokens, chosen, cfg, modes, label)
        first = next((r for r in done if r.system.startswith("batchgen")), None)
        if first is not None and name == "bf16":
            info["hf_teacher_forced"] = teacher_forced_agreement(model, prompts, first.tokens)
        results += done
        infos.update(info)
        args = (shape, lens, workload.output_tokens, workload.shared_prefix, precision)
        bounds[name] = roofline_seconds(*args, roof)
        reference[name] = roofline_seconds(*args, H200_REFERENCE)
    return {
        "shape": shape_name,
        "workload": workload.name,
        "requests": workload.requests,
        "results": results,
        "infos": infos,
        "roofline_s": bounds.get("bf16", next(iter(bounds.values()))),
        "rooflines": bounds,
        "roof": roof.describe(),
        "reference_rooflines": reference,
    }


def _run_systems(
    model: PreTrainedModel,
    prompts: list[list[int]],
    output_tokens: int,
    systems: tuple[str, ...],
    config: EngineConfig,
    modes: tuple[bool, ...],
    label: str = "",
) -> tuple[list[RunResult], dict[str, dict]]:
    """Each system in turn (each batchgen loop once per prefix-caching mode); label is
    appended to batchgen's system names."""
    results: list[RunResult] = []
    infos: dict[str, dict] = {}
    for system in systems:
        if system in ("overlap", "sync"):
            for caching in modes:
                cfg = replace(config, overlap=system == "overlap", enable_prefix_caching=caching)
                result, info = run_batchgen(model, prompts, output_tokens, cfg)
                result = result._replace(system=result.system + label)
                infos[(system if caching else f"{system}, no prefix cache") + label] = info
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
        f"{report['roofline_s']:.2f} s" + (f" ({report['roof']})" if "roof" in report else ""),
        "| system | output tok/s | x best HF | of roofline | GPU idle (steady decode) "
        "| TTFT p50 / p90 / p99 s | prefix cache hits |",
        "|---|---|---|---|---|---|---|",
    ]
    rooflines = report.get("rooflines", {})
    for r in results:
        ratio = f"{r.tokens_per_s / best_hf:.2f}x" if best_hf else "-"
        bound = rooflines.get(_precision_of(r.system), report["roofline_s"])
        idle = "-" if r.gpu_idle_share is None else f"{100 * r.gpu_idle_share:.1f}%"
        ttft = (
            "-"
            if not r.ttft
            else " / ".join(f"{percentile(r.ttft, q):.2f}" for q in (0.5, 0.9, 0.99))
        )
        hits = "-" if r.cache_hit_rate is None else f"{r.cache_hit_rate:.1%}"
        lines.append(
            f"| {r.system} | {r.tokens_per_s:,.0f} | {ratio} | "
            f"{bound / r.seconds:.1%} | {idle} | {ttft} | {hits} |"
        )
    lines += _agreement(results)
    lines += _reference_lines(results, report.get("reference_rooflines"))
    lines += _fp8_lines(results, rooflines, report["infos"])
    for system, info in report["infos"].items():
        lines.append(f"- {system}: {json.dumps(info)}")
    return "\n".join(lines)


def _reference_lines(results: list[RunResult], reference: dict | None) -> list[str]:
    """Each batchgen run's share of the roofline at the H200 reference figures, which the
    tables recorded before the bench measured its own device used."""
    if not reference:
        return []
    shares = [
        f"{r.system} {reference[_precision_of(r.system)] / r.seconds:.1%}"
        for r in results
        if r.system.startswith("batchgen") and _precision_of(r.system) in reference
    ]
    return (
        [f"- of roofline at the {H200_REFERENCE.describe()}: " + "; ".join(shares)]
        if shares
        else []
    )


def _precision_of(system: str) -> str:
    """'batchgen overlapped [fp8]' -> 'fp8'; no bracket -> 'bf16'."""
    return system.rpartition("[")[2].rstrip("]") if system.endswith("]") else "bf16"


def _fp8_lines(results: list[RunResult], rooflines: dict, infos: dict) -> list[str]:
    """Per FP8 precision: tok/s over the 16-bit run of the same loop, the FP8 roofline's gain
    over the 16-bit one, KV blocks, and how many greedy tokens match the 16-bit run."""
    out = []
    base = {r.system: r for r in results if _precision_of(r.system) == "bf16"}
    for r in results:
        name = _precision_of(r.system)
        ref = base.get(r.system.removesuffix(f" [{name}]"))
        if name == "bf16" or ref is None:
            continue
        bound = rooflines["bf16"] / rooflines[name] if "bf16" in rooflines else float("nan")
        rate, _ = match_rate(ref.tokens, r.tokens)
        out.append(
            f"- {r.system}: {r.tokens_per_s / ref.tokens_per_s:.2f}x the bf16 tok/s (roofline "
            f"allows {bound:.2f}x); greedy tokens equal to bf16 at {rate:.1%} of positions; "
            f"{_kv_capacity(infos, name)}"
        )
    return out


def _kv_capacity(infos: dict, name: str) -> str:
    """'KV cache: 1,924,800 tokens (30,075 blocks of 64), 2.10x bf16's' for each loop run in
    this precision (blocks may differ in size between precisions: the tokens compare)."""
    parts = []
    for key, info in infos.items():
        if not key.endswith(f"[{name}]") or info.get("kv_tokens") is None:
            continue
        base = infos.get(key.removesuffix(f" [{name}]"), {}).get("kv_tokens")
        ratio = f", {info['kv_tokens'] / base:.2f}x bf16's" if base else ""
        parts.append(
            f"{key} KV cache {info['kv_tokens']:,} tokens ({info['kv_blocks']:,} blocks of "
            f"{info['kv_block_size']}){ratio}"
        )
    return "; ".join(parts) or "KV cache size not reported"


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
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(header + text + "\n")
