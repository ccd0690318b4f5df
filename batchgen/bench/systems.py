"""The systems a benchmark compares, each run on the same prompts: batchgen (overlapped and
synchronous) and Hugging Face (static-batch generate, generate_batch)."""

from __future__ import annotations

import gc
import statistics
import time
from itertools import pairwise
from typing import NamedTuple

import torch
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedModel

from batchgen.bench.workloads import Shape
from batchgen.engine import Engine, EngineConfig, SamplingParams


class RunResult(NamedTuple):
    system: str
    seconds: float
    output_tokens: int
    tokens: list[list[int]]  # per request, in prompt order
    ttft: list[float]  # seconds from the start to each request's first token (empty if unknown)
    gpu_idle_share: float | None  # of steady (graphed) decode time
    cache_hit_rate: float | None = None  # prompt tokens served by the prefix cache (batchgen)

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds


def build_model(shape: Shape, seed: int = 0) -> PreTrainedModel:
    """A random-weight Llama of the shape, in bf16 on the GPU (no download)."""
    torch.manual_seed(seed)
    config = LlamaConfig(**shape.llama_config(), bos_token_id=128000, eos_token_id=128001)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(default)
    model.generation_config = GenerationConfig(
        bos_token_id=128000, eos_token_id=None, pad_token_id=0
    )
    return model.eval()


def run_batchgen(
    model: PreTrainedModel, prompts: list[list[int]], output_tokens: int, config: EngineConfig
) -> tuple[RunResult, dict]:
    """One timed engine run (after a short warm-up that compiles kernels), starting with an
    empty prefix cache."""
    engine = Engine(model, config)
    # warm-up on a slice of the same prompts: Triton compiles every kernel variant here
    warmup = SamplingParams(max_new_tokens=8, ignore_eos=True)
    list(engine.generate(prompts[:64], warmup, decode=False))
    engine.blocks.clear_cache()  # what the warm-up cached would be a head start
    cached_before = engine.cache_stats
    timeline = CudaTimeline()
    engine.runner.step_hook = timeline
    params = SamplingParams(max_new_tokens=output_tokens, ignore_eos=True)
    torch.cuda.synchronize()
    start = time.perf_counter()
    timeline.open()
    outs = {int(o.request_id): o for o in engine.generate(prompts, params, decode=False)}
    timeline.close()
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    tokens = [outs[i].output_token_ids for i in range(len(prompts))]
    ttft = [outs[i].first_token_time - start for i in range(len(prompts))]
    graphs = engine.runner.graphs
    info = {
        "kv_blocks": engine.num_blocks,
        "kv_block_size": engine.config.block_size,
        "kv_tokens": engine.num_blocks * engine.config.block_size,
        "graph_capture_s": graphs.report.seconds if graphs else None,
        "graph_pool_gib": graphs.report.pool_bytes / 2**30 if graphs else None,
        "preemptions": engine.scheduler.num_preemptions,
        **step_breakdown(timeline, seconds),
        "idle_ms": idle_breakdown(timeline),
    }
    idle = gpu_idle_share(timeline.steps)
    hit_rate = (engine.cache_stats - cached_before).hit_rate
    engine.close()
    del engine, graphs
    gc.collect()
    torch.cuda.empty_cache()
    result = RunResult(
        batchgen_name(config), seconds, sum(map(len, tokens)), tokens, ttft, idle, hit_rate
    )
    return result, info


def batchgen_name(config: EngineConfig) -> str:
    name = "batchgen overlapped" if config.overlap else "batchgen synchronous"
    return name if config.enable_prefix_caching else f"{name}, no prefix cache"


class CudaTimeline:
    """The runner's step hook for a benchmark: (start, end, graphed) CUDA events per step
    (graphed: a decode step's graph replayed), and how many steps were at token sizes."""

    def __init__(self) -> None:
        self.steps: list[tuple[torch.cuda.Event, torch.cuda.Event, bool]] = []
        self.token_graph_steps = 0  # steps with prefill chunks that replayed a graph
        self.first_launch: float | None = None  # perf_counter of the first step's launch
        self.last_launch: float | None = None  # ... and of the last step's
        self.opened: torch.cuda.Event | None = None  # the run's start and end on the device
        self.closed: torch.cuda.Event | None = None

    def open(self) -> None:
        """A run begins: the steps recorded so far (a warm-up's) are dropped."""
        self.steps, self.first_launch, self.last_launch = [], None, None
        self.token_graph_steps = 0
        self.opened = _event()

    def close(self) -> None:
        self.closed = _event()

    def report(self, wall_s: float) -> dict:
        """The run between open() and close(): its steps by kind, the GPU's idle share in
        steady decode and where its idle time fell, its busy time, and the first and last
        step's launch (perf_counter: the same clock in every process of the machine)."""
        torch.cuda.synchronize()
        return {
            **step_breakdown(self, wall_s),
            "gpu_idle_share": gpu_idle_share(self.steps),
            "idle_ms": idle_breakdown(self),
            "busy_s": sum(s.elapsed_time(e) for s, e, _ in self.steps) / 1e3,
            "first_launch": self.first_launch,
            "last_launch": self.last_launch,
        }

    def begin(self) -> torch.cuda.Event:
        now = time.perf_counter()
        self.first_launch = self.first_launch or now
        self.last_launch = now
        return _event()

    def end(self, mark: torch.cuda.Event, graphed: bool, token_graph: bool = False) -> None:
        self.steps.append((mark, _event(), graphed))
        self.token_graph_steps += token_graph


def _event() -> torch.cuda.Event:
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def step_breakdown(timeline: CudaTimeline, wall_s: float) -> dict:
    """Where the GPU time went: graphed decode steps vs the other steps (those with prefill
    chunks, whether they replay a token size's graph or run eagerly; token_graph_steps of
    them replay one)."""
    graphed = [s.elapsed_time(e) for s, e, g in timeline.steps if g]
    other = [s.elapsed_time(e) for s, e, g in timeline.steps if not g]
    return {
        "graphed_steps": len(graphed),
        "graphed_step_ms": round(statistics.fmean(graphed), 3) if graphed else None,
        "other_steps": len(other),
        "other_s": round(sum(other) / 1e3, 3),
        "token_graph_steps": timeline.token_graph_steps,
        "gpu_busy_share": round((sum(graphed) + sum(other)) / 1e3 / wall_s, 3),
    }


def idle_breakdown(timeline: CudaTimeline) -> dict[str, float]:
    """The run's GPU idle time (ms) by where it falls: before the first step, in the gaps next
    to another (prefill or mixed) step, between graphed decode steps, after the last step.
    Their sum and the steps' own time make up the run's device time between open and close."""
    steps = timeline.steps
    if not steps or timeline.opened is None or timeline.closed is None:
        return {}
    near_other = between_decodes = 0.0
    for (_, end, graphed), (start, _, next_graphed) in pairwise(steps):
        gap = end.elapsed_time(start)
        if graphed and next_graphed:
            between_decodes += gap
        else:
            near_other += gap
    return {
        "before_first_step": round(timeline.opened.elapsed_time(steps[0][0]), 1),
        "next_to_other_steps": round(near_other, 1),
        "between_decode_steps": round(between_decodes, 1),
        "after_last_step": round(steps[-1][1].elapsed_time(timeline.closed), 1),
    }


def gpu_idle_share(timeline: list | None, skip: int = 5) -> float | None:
    """Share of steady decode time the GPU spent between graphed steps: the gap from one
    step's end event to the next step's start event, over the span of those steps."""
    if not timeline:
        return None
    steady = [i for i in range(skip, len(timeline) - 1) if timeline[i][2] and timeline[i + 1][2]]
    if not steady:
        return None
    idle = sum(timeline[i][1].elapsed_time(timeline[i + 1][0]) for i in steady)
    busy = sum(timeline[i][0].elapsed_time(timeline[i][1]) for i in steady)
    return idle / (idle + busy)


def run_hf_static(
    model: PreTrainedModel, prompts: list[list[int]], output_tokens: int, batch_size: int = 64
) -> RunResult:
    """model.generate on static, left-padded batches of batch_size (sdpa attention)."""
    model.set_attn_implementation("sdpa")
    tokens: list[list[int]] = []
    torch.cuda.synchronize()
    start = time.perf_counter()
    for i in range(0, len(prompts), batch_size):
        chunk = prompts[i : i + batch_size]
        width = max(map(len, chunk))
        ids = torch.tensor([[0] * (width - len(p)) + p for p in chunk], device="cuda")
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk], device="cuda")
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                do_sample=False,
                max_new_tokens=output_tokens,
                min_new_tokens=output_tokens,
            )
        tokens.extend(out[:, width:].tolist())
    seconds = time.perf_counter() - start
    return RunResult(
        f"HF generate (static batches of {batch_size})",
        seconds,
        sum(map(len, tokens)),
        tokens,
        [],
        None,
    )


def run_hf_generate_batch(
    model: PreTrainedModel, prompts: list[list[int]], output_tokens: int
) -> RunResult:
    """transformers' continuous batching (generate_batch, synchronous, paged sdpa)."""
    from transformers import ContinuousBatchingConfig

    model.set_attn_implementation("sdpa")
    cb = ContinuousBatchingConfig(use_async_batching=False)
    gen = GenerationConfig(
        max_new_tokens=output_tokens, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    torch.cuda.synchronize()
    start = time.perf_counter()
    with torch.no_grad():  # not inference_mode: generate_batch's worker updates its tensors
        outs = model.generate_batch(
            prompts, generation_config=gen, continuous_batching_config=cb, record_timestamps=True
        )
    seconds = time.perf_counter() - start
    failed = [o for o in outs.values() if o.error]
    if failed:
        print(f"  generate_batch: {len(failed)} requests failed; first error: {failed[0].error}")
    ordered = sorted(outs.values(), key=lambda o: int(o.request_id.split("_")[-1]))
    tokens = [o.generated_tokens for o in ordered]
    ttft = [o.timestamps[0] - start for o in ordered if o.timestamps]
    return RunResult(
        "HF generate_batch (sync, paged sdpa)",
        seconds,
        sum(map(len, tokens)),
        tokens,
        ttft,
        None,
    )


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def match_rate(a: list[list[int]], b: list[list[int]]) -> tuple[float, int]:
    """Share of positions inside the agreeing prefix of each pair; -> (rate, diverged count)."""
    same = total = diverged = 0
    for x, y in zip(a, b, strict=True):
        n = next(
            (i for i, (p, q) in enumerate(zip(x, y, strict=False)) if p != q), min(len(x), len(y))
        )
        same += n
        total += max(len(x), len(y))
        diverged += n < max(len(x), len(y))
    return same / max(total, 1), diverged


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def teacher_forced_agreement(
    model: PreTrainedModel, prompts: list[list[int]], tokens: list[list[int]], limit: int = 16
) -> dict:
    """Hugging Face (sdpa, bf16) re-reads each prompt + batchgen's tokens: at every generated
    position, is HF's argmax batchgen's token? Where not, how far apart are their logits
    (a near-tie when the gap is within bf16 rounding of the logits)?"""
    agree = total = self_agree = 0
    gaps: list[float] = []
    top2: list[float] = []
    for prompt, out in zip(prompts[:limit], tokens[:limit], strict=True):
        logits = _hf_logits(model, prompt, out, "sdpa")
        want = torch.tensor(out, device="cuda")
        best = logits.argmax(-1)
        self_agree += int((_hf_logits(model, prompt, out, "eager").argmax(-1) == best).sum())
        agree += int((best == want).sum())
        total += len(out)
        bad = best != want
        picked = logits.gather(1, want[:, None])[:, 0]
        gaps += (logits.max(-1).values - picked)[bad].tolist()
        top2 += (logits.topk(2).values[:, 0] - logits.topk(2).values[:, 1]).tolist()
    return {
        "teacher_forced_top1_agreement": round(agree / max(total, 1), 4),
        "disagreements": len(gaps),
        "max_logit_gap_at_disagreement": round(max(gaps), 4) if gaps else 0.0,
        "median_top1_top2_gap": round(median(top2), 4),
        "hf_sdpa_vs_hf_eager_top1_agreement": round(self_agree / max(total, 1), 4),
    }


def _hf_logits(
    model: PreTrainedModel, prompt: list[int], out: list[int], attn: str
) -> torch.Tensor:
    """[len(out), vocab] float32 logits that predicted each of out's tokens."""
    model.set_attn_implementation(attn)
    ids = torch.tensor([prompt + out], device="cuda")
    with torch.inference_mode():
        return model(ids).logits[0, len(prompt) - 1 : len(prompt) + len(out) - 1].float()
