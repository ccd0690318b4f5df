"""Sampler: exact greedy, reproducible seeded draws, the right distributions, penalties."""

from __future__ import annotations

import pytest
import torch

from batchgen import Engine, EngineConfig, Prompt, SamplingParams
from batchgen.engine.sampler import (
    PenaltyState,
    Sampler,
    gumbel_noise,
    hash_u32,
    row_keys,
)
from batchgen.engine.step_inputs import SamplingFlags
from batchgen.engine.step_layout import SamplingInputs
from tests.helpers import random_prompts

DRAWS = 200_000
TV_BOUND = 0.01  # total variation between 200k draws and the float64 distribution


def inputs(rows: int, **values: float) -> SamplingInputs:
    """Sampling inputs for `rows` rows; keyword values fill a field for every row."""
    ints = {"slots": 0, "rng_keys": 0, "positions": 0, "top_k": 0, "logprobs_k": -1, "track": 0}
    floats = {
        "temperature": 0.0,
        "top_p": 1.0,
        "min_p": 0.0,
        "repetition": 1.0,
        "presence": 0.0,
        "frequency": 0.0,
    }
    full = {k: torch.full((rows,), values.get(k, v), dtype=torch.int64) for k, v in ints.items()}
    full |= {
        k: torch.full((rows,), float(values.get(k, v)), dtype=torch.float64)
        for k, v in floats.items()
    }
    full["rng_keys"] = torch.arange(rows, dtype=torch.int64)  # a different key per row
    empty2 = torch.zeros(0, 2, dtype=torch.int64)
    return SamplingInputs(
        **full,
        updates=torch.zeros(0, 3, dtype=torch.int64),
        resets=torch.zeros(0, dtype=torch.int64),
        prompt_marks=empty2,
        output_counts=empty2,
        bans=empty2,
    )


def flags_for(s: SamplingInputs) -> SamplingFlags:
    return SamplingFlags(
        any_random=bool((s.temperature > 0).any()),
        any_top_k=bool((s.top_k > 0).any()),
        any_top_p_min_p=bool((s.top_p < 1).any() or (s.min_p > 0).any()),
    )


LOGITS = torch.tensor([1.0, 0.5, 0.0, -0.5, 2.0, 0.1, -1.0, 0.3, 1.4, -2.0])


def empirical(**values: float) -> torch.Tensor:
    sampler = Sampler(vocab_size=len(LOGITS), device=torch.device("cpu"))
    s = inputs(DRAWS, **values)
    tokens, _ = sampler(LOGITS.expand(DRAWS, -1), s, flags_for(s), None)
    return torch.bincount(tokens, minlength=len(LOGITS)).double() / DRAWS


def expected(
    temperature: float, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0
) -> torch.Tensor:
    """The definitions, in float64: temperature -> top_k -> top_p -> min_p, renormalized."""
    probs = torch.softmax(LOGITS.double() / temperature, dim=-1)
    keep = torch.ones_like(probs, dtype=torch.bool)
    order = probs.argsort(descending=True)
    if top_k:
        keep[order[top_k:]] = False
    p = torch.where(keep, probs, 0) / torch.where(keep, probs, 0).sum()
    before = torch.cumsum(p[order], 0) - p[order]  # mass of strictly more likely tokens
    keep[order[before >= top_p]] = False
    p = torch.where(keep, p, 0) / torch.where(keep, p, 0).sum()
    keep &= p >= min_p * p.max()
    return torch.where(keep, p, 0) / torch.where(keep, p, 0).sum()


@pytest.mark.parametrize(
    "settings",
    [
        dict(temperature=0.7),
        dict(temperature=1.3, top_k=3),
        dict(temperature=1.0, top_p=0.6),
        dict(temperature=1.0, min_p=0.2),
        dict(temperature=0.9, top_k=5, top_p=0.8, min_p=0.1),
    ],
)
def test_sampling_distributions_match_their_definitions(settings: dict) -> None:
    got, want = empirical(**settings), expected(**settings)
    assert 0.5 * (got - want).abs().sum() < TV_BOUND, (got, want)
    assert (got[want == 0] == 0).all(), "a filtered token was drawn"


def test_greedy_rows_take_the_argmax() -> None:
    sampler = Sampler(vocab_size=50, device=torch.device("cpu"))
    logits = torch.randn(4, 50)
    s = inputs(4)
    s = s._replace(temperature=torch.tensor([0.0, 0.0, 1.0, 0.0], dtype=torch.float64))
    out, _ = sampler(logits, s, flags_for(s), None)
    assert out[[0, 1, 3]].tolist() == logits.argmax(-1)[[0, 1, 3]].tolist()


def test_penalties_follow_their_definitions() -> None:
    state = PenaltyState(num_slots=2, vocab_size=6, device=torch.device("cpu"))
    state.prompt[1, [0, 3]] = True
    state.counts[1] = torch.tensor([0, 2, 0, 1, 0, 0], dtype=torch.int32)
    s = inputs(1, repetition=2.0, presence=0.5, frequency=0.25)._replace(slots=torch.tensor([1]))
    logits = torch.tensor([[1.0, -1.0, 3.0, 2.0, -2.0, 0.5]])
    got = state.apply(logits.clone(), s)
    # seen (prompt or output): 0, 1, 3 -> positive / 2, negative * 2; then -0.25 x count,
    # then -0.5 for tokens generated at least once (1 and 3)
    want = torch.tensor([[0.5, -2.0 - 0.5 - 0.5, 3.0, 1.0 - 0.25 - 0.5, -2.0, 0.5]])
    assert torch.allclose(got, want)


def test_hash_is_deterministic_and_spread() -> None:
    x = torch.arange(100_000, dtype=torch.int64)
    h = hash_u32(x)
    assert torch.equal(h, hash_u32(x))
    assert h.min() >= 0 and h.max() < 2**32
    assert len(torch.unique(h)) > 99_990


def test_draws_depend_only_on_seed_and_position() -> None:
    vocab_hash = hash_u32(torch.arange(64, dtype=torch.int64))
    a = gumbel_noise(row_keys(torch.tensor([7, 8]), torch.tensor([3, 3])), vocab_hash)
    b = gumbel_noise(row_keys(torch.tensor([9, 7]), torch.tensor([1, 3])), vocab_hash)
    assert torch.equal(a[0], b[1])
    assert not torch.equal(a[0], a[1])


def test_seeded_requests_ignore_batch_composition(model_dir) -> None:
    """The same seeded rows give the same tokens alone, in a big batch, and in another order."""
    path = model_dir("llama")
    prompts = random_prompts(6, 3, 20, 1000, seed=4)
    params = SamplingParams(
        max_new_tokens=16,
        temperature=1.0,
        top_p=0.9,
        top_k=50,
        repetition_penalty=1.2,
        frequency_penalty=0.3,
    )

    def run(items, **config) -> dict[str, list[int]]:
        engine = Engine(path, EngineConfig(device="cpu", **config))
        return {o.request_id: o.output_token_ids for o in engine.generate(items, params)}

    seeded = [
        Prompt(p, request_id=f"r{i}", sampling={"seed": 100 + i}) for i, p in enumerate(prompts)
    ]
    together = run(seeded)
    alone = {}
    for item in seeded:
        alone.update(run([item]))
    reversed_small = run(seeded[::-1], max_num_seqs=2, max_num_batched_tokens=8)
    tiny_cache = run(seeded, block_size=8, num_kv_blocks=10, max_num_seqs=4)  # preempts
    assert together == alone == reversed_small == tiny_cache
    assert len({tuple(v) for v in together.values()}) == len(prompts)
