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
from tests.helpers import apply_token_bitmask, random_prompts

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
    """The definitions in vLLM's order, in float64: temperature -> min_p -> top_k -> top_p,
    each over what the one before kept, renormalized."""
    probs = torch.softmax(LOGITS.double() / temperature, dim=-1)
    keep = probs >= min_p * probs.max()
    order = probs.argsort(descending=True)
    if top_k:
        keep[order[top_k:]] = False
    p = torch.where(keep, probs, 0) / torch.where(keep, probs, 0).sum()
    before = torch.cumsum(p[order], 0) - p[order]  # mass of strictly more likely tokens
    keep[order[before >= top_p]] = False
    return torch.where(keep, p, 0) / torch.where(keep, p, 0).sum()


@pytest.mark.parametrize(
    "settings",
    [
        dict(temperature=0.7),
        dict(temperature=1.3, top_k=3),
        dict(temperature=1.0, top_p=0.6),
        dict(temperature=1.0, min_p=0.2),
        dict(temperature=0.9, top_k=5, top_p=0.8, min_p=0.1),
        # min_p first, then top_p over what it left (vLLM): 3 tokens; top_p first would keep 2
        dict(temperature=1.0, top_p=0.6, min_p=0.3),
    ],
)
def test_sampling_distributions_match_their_definitions(settings: dict) -> None:
    got, want = empirical(**settings), expected(**settings)
    assert 0.5 * (got - want).abs().sum() < TV_BOUND, (got, want)
    assert (got[want == 0] == 0).all(), "a filtered token was drawn"


@pytest.mark.parametrize(
    "logits, temperature",
    [
        ([15.0, 15.0, 9.0], 1e-6),  # a tie (common in bf16 logits): half each
        ([5.0, 5.0000005, -3.0], 1e-6),  # gaps of 0.5 / T exact whatever the logits' size
        ([0.0, 5e-7, -3.0], 1e-6),  # the same gap: the same distribution
        ([2.0, 1.0, 2.0], 1e-20),  # below float32's smallest step of T: the two largest only
    ],
)
def test_tiny_temperatures_draw_exactly(logits: list[float], temperature: float) -> None:
    """softmax(logits / T) for a T so small that logits / T would round away the gaps."""
    row = torch.tensor(logits)
    sampler = Sampler(vocab_size=len(row), device=torch.device("cpu"))
    s = inputs(DRAWS, temperature=temperature)
    tokens, _ = sampler(row.expand(DRAWS, -1), s, flags_for(s), None)
    got = torch.bincount(tokens, minlength=len(row)).double() / DRAWS
    gaps = row.double() - row.double().max()
    want = torch.softmax(gaps / max(temperature, 1e-30), dim=-1)
    assert 0.5 * (got - want).abs().sum() < TV_BOUND, (got, want)


def test_keys_that_differ_only_past_32_bits_draw_apart() -> None:
    """The whole 63-bit key counts: rows whose keys share their low or high half still draw
    independent noise."""
    vocab_hash = hash_u32(torch.arange(64, dtype=torch.int64))
    keys = torch.tensor([5, 5 + 2**32, 5 + 2**40, 7 * 2**32, 9 * 2**32], dtype=torch.int64)
    noise = gumbel_noise(row_keys(keys, torch.zeros(5, dtype=torch.int64)), vocab_hash)
    for i in range(5):
        for j in range(i):
            assert not torch.equal(noise[i].argsort(), noise[j].argsort())


def test_rows_sharing_a_positions_key_do_not_share_the_next() -> None:
    """Among 300k random 63-bit keys ~10 pairs share a 32-bit key at one position (chance);
    none may share it at the next too (a key folded to 32 bits before the position was mixed
    in made such pairs alike at every position: the same text)."""
    gen = torch.Generator().manual_seed(0)
    keys = torch.randint(0, 2**63 - 1, (300_000,), generator=gen, dtype=torch.int64)
    zero, one = (row_keys(keys, torch.full_like(keys, p)) for p in (0, 1))
    pairs = torch.unique(torch.stack((zero, one), dim=1), dim=0)
    assert len(torch.unique(zero)) < len(keys)  # the chance collisions the test relies on
    assert len(pairs) == len(keys)


def test_seeds_whose_keys_folded_to_32_bits_alike_draw_apart(model_dir) -> None:
    """Seeds 97422 and 193141 (a pair among the first 200k seeds whose sampling keys once
    folded to the same 32 bits) draw different text from the same prompt."""
    engine = Engine(model_dir("llama"), EngineConfig(device="cpu"))
    params = SamplingParams(max_new_tokens=24, temperature=1.0, ignore_eos=True)
    prompt = random_prompts(1, 5, 6, 1000, seed=2)[0]
    items = [
        Prompt(prompt, request_id=str(seed), sampling={"seed": seed}) for seed in (97422, 193141)
    ]
    a, b = (o.output_token_ids for o in engine.generate(items, params))
    assert a != b


def test_greedy_rows_take_the_argmax() -> None:
    sampler = Sampler(vocab_size=50, device=torch.device("cpu"))
    logits = torch.randn(4, 50)
    s = inputs(4)
    s = s._replace(temperature=torch.tensor([0.0, 0.0, 1.0, 0.0], dtype=torch.float64))
    out, _ = sampler(logits, s, flags_for(s), None)
    assert out[[0, 1, 3]].tolist() == logits.argmax(-1)[[0, 1, 3]].tolist()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logprobs_are_taken_under_the_bitmask_only(dtype: torch.dtype) -> None:
    """A structured row's logprobs: log_softmax of the raw logits over its allowed tokens,
    a forbidden token never among the alternatives (id -1); an unstructured row of the same
    batch (every bit set) gets what it gets with no mask; bans and temperature are left out."""
    vocab, k = 70, 4
    sampler = Sampler(vocab_size=vocab, device=torch.device("cpu"))
    logits = torch.randn(3, vocab).to(dtype)
    s = inputs(3, temperature=0.8, logprobs_k=k)._replace(bans=torch.tensor([[1, 5], [0, 7]]))
    flags = flags_for(s)._replace(logprobs_k=k)
    allowed = torch.zeros(3, vocab, dtype=torch.bool)
    allowed[0, [3, 7, 40]] = True  # fewer than k: no forbidden token fills the list
    allowed[1] = True
    allowed[2, 64] = True
    bits = torch.zeros(3, 96, dtype=torch.uint8)
    bits[:, :vocab] = allowed
    words = (bits.view(3, 3, 32).long() << torch.arange(32)).sum(-1)
    mask = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    assert torch.equal(apply_token_bitmask(logits, mask).isfinite(), allowed)
    tokens, pack = sampler(logits, s, flags, None, mask)
    _, plain = sampler(logits, s, flags, None)
    assert torch.equal(pack[1], plain[1])
    masked = logits.float().masked_fill(~allowed, float("-inf")).log_softmax(-1)
    assert allowed[0, tokens[0]] and tokens[2] == 64
    assert pack[:, 0].tolist() == masked.gather(1, tokens[:, None]).view(-1).tolist()
    assert pack[0, 1 : 1 + 3].tolist() == masked[0].topk(3).values.tolist()
    assert pack[0, 1 + k : 1 + 2 * k].tolist() == [*masked[0].topk(3).indices.tolist(), -1]
    assert pack[2, 1 + k :].tolist() == [64, -1, -1, -1]


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
