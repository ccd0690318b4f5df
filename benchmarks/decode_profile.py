"""Kernel-level profile of W1's steps on a random-weight shape, 256 requests. Decode (the
default): 40 steps in (every prompt prefilled, contexts ~360-400 tokens), 10 graphed decode
steps under the torch profiler, GPU time per kernel name, per step. Prefill (`--phase
prefill`): the eager steps from the first one until every prompt is prefilled, GPU time per
kernel name over all of them. Needs a CUDA GPU.

    PYTHONPATH=$PWD python benchmarks/decode_profile.py --shape 8b --precisions bf16,fp8,fp8-kv
    PYTHONPATH=$PWD python benchmarks/decode_profile.py --shape 8b --phase prefill

FP8 precisions quantize the model in place after the 16-bit one (as `batchgen bench` does).
"""

from __future__ import annotations

import argparse
import gc
import time

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from batchgen import Engine, EngineConfig, SamplingParams
from batchgen.bench.systems import build_model
from batchgen.bench.workloads import SHAPES, WORKLOADS
from batchgen.engine.quant.convert import is_quantized, quantize_model
from batchgen.engine.request import Prompt

PRECISIONS = ("bf16", "fp8", "fp8-kv")


def profile_steps(
    engine: Engine, prompts: list[list[int]], rows: int, phase: str, sequence: int = 0
) -> None:
    params = SamplingParams(max_new_tokens=256, ignore_eos=True, temperature=0.0)
    list(engine.generate(prompts[:64], params.replace(max_new_tokens=8), decode=False))
    for i, p in enumerate(prompts):
        engine.add_request(Prompt(p, f"r{i}"), params, f"r{i}")
    if phase == "prefill":
        torch.cuda.synchronize()
        start = time.perf_counter()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            steps = 0
            while engine.scheduler.waiting or any(
                r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running
            ):
                engine.step()
                steps += 1
            torch.cuda.synchronize()
        wall = time.perf_counter() - start
        print(f"  {steps} steps until every prompt is prefilled: {wall:.3f} s (wall, profiled)")
    else:
        for _ in range(40):  # prefill and the first decode steps
            engine.step()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(20):
            engine.step()
        torch.cuda.synchronize()
        print(f"  20 decode steps: {(time.perf_counter() - start) * 50:.2f} ms per step (wall)")
        steps = 10
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                engine.step()
            torch.cuda.synchronize()
    kernels = sorted(
        (e for e in prof.key_averages() if e.device_time_total > 0),
        key=lambda e: -e.device_time_total,
    )
    if sequence:
        print_sequence(prof, steps, sequence)
    per = 1 if phase == "prefill" else steps
    unit = "ms in all" if phase == "prefill" else "ms per step"
    total = sum(e.device_time_total for e in kernels) / per / 1e3
    print(f"  kernels: {total:.2f} {unit}")
    print(f"  | {unit} | launches | kernel |\n  |---|---|---|")
    for e in kernels[:rows]:
        print(f"  | {e.device_time_total / per / 1e3:.3f} | {e.count // per} | {e.key[:80]} |")
    while engine.has_unfinished():
        engine.step()


def print_sequence(prof: profile, steps: int, count: int) -> None:
    """The first `count` kernels of the last profiled step, in the order they ran."""
    kernels = sorted(
        (e for e in prof.events() if e.device_type == DeviceType.CUDA),
        key=lambda e: e.time_range.start,
    )
    last = kernels[len(kernels) - len(kernels) // steps :]
    print(f"  first {count} of the last step's {len(last)} kernels, in order:")
    print("  | us | kernel |\n  |---|---|")
    for e in last[:count]:
        print(f"  | {e.time_range.elapsed_us():.1f} | {e.name[:90]} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="8b")
    parser.add_argument("--precisions", default="bf16", help="comma-separated: bf16,fp8,fp8-kv")
    parser.add_argument("--rows", type=int, default=12, help="kernels listed per precision")
    parser.add_argument("--phase", choices=("decode", "prefill"), default="decode")
    parser.add_argument(
        "--sequence", type=int, default=0, help="also list a step's first N kernels in order"
    )
    args = parser.parse_args()
    chosen = args.precisions.split(",")
    if not torch.cuda.is_available() or not set(chosen) <= set(PRECISIONS):
        raise SystemExit(f"needs a CUDA GPU and precisions among {', '.join(PRECISIONS)}")
    shape = SHAPES[args.shape]
    model = build_model(shape)
    prompts = WORKLOADS["W1"].prompts(shape.vocab)
    for name in (p for p in PRECISIONS if p in chosen):
        if name != "bf16" and not is_quantized(model):
            quantize_model(model)
        print(f"== {args.shape} {name}")
        config = EngineConfig(kv_cache_dtype="fp8" if name == "fp8-kv" else "auto")
        engine = Engine(model, config)
        profile_steps(engine, prompts, args.rows, args.phase, args.sequence)
        engine.close()
        del engine
        gc.collect()
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
