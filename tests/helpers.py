"""Test helpers: Hugging Face greedy references and random prompts."""

from __future__ import annotations

import functools
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM

from batchgen.engine.graphs import StepGraphs


@functools.cache
def hf_model(path: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(
        path, attn_implementation="sdpa", dtype=torch.float32
    ).eval()


def hf_greedy(
    path: Path, prompt: list[int], max_new_tokens: int, eos_token_id: int | None = None
) -> list[int]:
    """Hugging Face generate, greedy; stops only at eos_token_id (None: runs to the limit)."""
    model = hf_model(path)
    kwargs: dict = {"eos_token_id": eos_token_id}
    if eos_token_id is None:
        kwargs["min_new_tokens"] = max_new_tokens
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=0,
            **kwargs,
        )
    return out[0, len(prompt) :].tolist()


def random_prompts(n: int, low: int, high: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, vocab) for _ in range(rng.randint(low, high))] for _ in range(n)]


def stop_after(engine: Any, outputs: int) -> Any:
    """The engine's next generate sets the job's stop event after `outputs` results."""
    original = engine.generate

    def generate(*args: Any, stop: Any = None, **kwargs: Any) -> Iterator[Any]:
        for count, out in enumerate(original(*args, stop=stop, **kwargs), start=1):
            yield out
            if count == outputs:
                stop.set()
        engine.generate = original

    engine.generate = generate
    return engine


class EagerPadding(StepGraphs):
    """Stands in for StepGraphs on the CPU: pads steps as the graphs would (decode sizes, and
    token sizes for steps with prefill chunks when tokens are given), runs them eagerly."""

    def __init__(self, runner, sizes: tuple[int, ...], tokens: tuple[int, ...] = ()) -> None:
        self.sizes, self.tokens = sorted(sizes), sorted(tokens)
        self.max_seqs = runner.config.max_num_seqs
        self.first_use = False  # every size pads to its own shape (a test may borrow)
        self.runner = runner
        self.replays: list[tuple[int, int, int]] = []  # the padded (T, B, S) of each step

    def replay(self, flat, host):
        self.replays.append(tuple(host.layout[:3]))
        return self.runner.forward(flat, host)
