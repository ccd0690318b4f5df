"""top_k / top_p / min_p against Hugging Face's own test cases, and rows that ask for no filter
are left alone bit for bit whatever their neighbours ask."""

from __future__ import annotations

import torch

from batchgen.engine.sampler import Sampler, filter_top_k_top_p_min_p
from tests.test_sampler import flags_for, inputs


def filtered(logits: torch.Tensor, **values: float) -> torch.Tensor:
    """Run the filter over a [S, V] batch; values fill every row (lists fill row by row)."""
    s = inputs(logits.shape[0])
    per_row = {}
    for key, value in values.items():
        column = getattr(s, key)
        per_row[key] = (
            torch.tensor(value, dtype=column.dtype)
            if isinstance(value, list)
            else (torch.full_like(column, value))
        )
    s = s._replace(**per_row)
    return filter_top_k_top_p_min_p(logits.float(), s, flags_for(s))


def kept(scores: torch.Tensor) -> torch.Tensor:
    return scores > torch.finfo(scores.dtype).min


def test_top_k_matches_hf_ramp_case() -> None:
    """transformers test_top_k_dist_warper: a ramp and a shifted ramp, k = 3."""
    ramp = torch.arange(10, dtype=torch.float).unsqueeze(0).repeat(2, 1)
    ramp[1:, :5] += 10
    out = kept(filtered(ramp, top_k=3))
    assert out[0].tolist() == 7 * [False] + 3 * [True]
    assert out[1].tolist() == 2 * [False] + 3 * [True] + 5 * [False]


def test_top_p_keeps_the_smallest_prefix_as_hf_does() -> None:
    """transformers test_top_p_dist_warper: [0.3, 0.1, 0.1, 0.5] with top_p 0.8 keeps 0.5 and
    0.3 only (a tied 0.1 is not kept because its twin made the cut); the second row keeps 3."""
    dist = torch.log(torch.tensor([[0.3, 0.1, 0.1, 0.5], [0.15, 0.3, 0.3, 0.25]]))
    probs = torch.where(kept(out := filtered(dist, top_p=0.8)), out.exp(), 0.0)
    expected = torch.tensor([[0.3, 0.0, 0.0, 0.5], [0.0, 0.3, 0.3, 0.25]])
    torch.testing.assert_close(probs, expected, rtol=1e-3, atol=1e-3)


def test_top_p_on_extreme_ramps_matches_hf() -> None:
    """HF's edge case without min_tokens_to_keep: top_p 0.9 keeps 3 of a ramp, 1 of a steep one."""
    ramp = torch.arange(10, dtype=torch.float).unsqueeze(0).repeat(2, 1) - 5
    ramp[1] *= 100.0
    assert kept(filtered(ramp, top_p=0.9)).sum(dim=-1).tolist() == [3, 1]


def test_min_p_matches_hf_cases() -> None:
    """transformers test_min_p_dist_warper (its ramp case without min_tokens_to_keep=2)."""
    dist = torch.log(
        torch.tensor(
            [[0.9, 0.0274, 0.047, 0.0274], [0.15, 0.3, 0.3, 0.25], [0.97, 0.01, 0.01, 0.01]]
        )
    )
    out = filtered(dist, min_p=0.05)
    probs = torch.where(kept(out), out.exp(), 0.0)
    expected = torch.tensor([[0.9, 0.0, 0.047, 0.0], [0.15, 0.3, 0.3, 0.25], [0.97, 0.0, 0.0, 0.0]])
    torch.testing.assert_close(probs, expected, rtol=1e-3, atol=1e-3)
    ramp = torch.arange(10, dtype=torch.float).unsqueeze(0).repeat(2, 1) - 5
    ramp[1] *= 100.0
    assert kept(filtered(ramp, min_p=0.9)).sum(dim=-1).tolist() == [
        1,
        1,
    ]  # HF keeps 2 by min_tokens


def test_ties_at_the_top_p_cut_are_not_all_kept() -> None:
    """Many tokens tied at the cut: only as many as the mass needs survive."""
    logits = torch.zeros(1, 100)
    logits[0, :10] = 5.0  # ten tied favourites, each ~ 0.09 of the mass
    out = kept(filtered(logits, top_p=0.3))
    probs = torch.softmax(logits[0], dim=0)
    sorted_p = probs.sort(descending=True).values
    needed = int((torch.cumsum(sorted_p, 0) < 0.3).sum()) + 1
    assert int(out.sum()) == needed < 10


def test_rows_without_filters_are_untouched_next_to_filtered_rows() -> None:
    """A peaked distribution whose float32 cumulative mass reaches 1.0 before the tail: the
    no-filter rows must keep every token, bit for bit, beside rows that filter."""
    torch.manual_seed(0)
    vocab = 50_000
    row = torch.randn(vocab) * 3
    row[0] = 60.0  # almost all the mass on one token
    logits = row.expand(4, -1).clone()
    out = filtered(
        logits, top_p=[1.0, 0.5, 1.0, 1.0], min_p=[0.0, 0.0, 0.2, 0.0], top_k=[0, 0, 0, 7]
    )
    assert torch.equal(out[0], logits[0])
    assert int(kept(out[1]).sum()) == 1 and int(kept(out[3]).sum()) == 7


def test_seeded_draw_of_a_no_filter_row_does_not_depend_on_its_neighbours() -> None:
    torch.manual_seed(1)
    vocab = 30_000
    logits = torch.randn(vocab) * 4
    logits[:3] += 25.0
    sampler = Sampler(vocab, torch.device("cpu"))
    draws = []
    for neighbour_top_p in (1.0, 0.3):
        batch = logits.expand(64, -1).clone()
        s = inputs(64, temperature=1.0)
        top_p = torch.full((64,), 1.0, dtype=torch.float64)
        top_p[1::2] = neighbour_top_p
        s = s._replace(top_p=top_p, rng_keys=torch.arange(64) // 2 * 2)  # pairs share a key
        tokens, _ = sampler(batch, s, flags_for(s), None)
        draws.append(tokens[0::2])
    assert torch.equal(draws[0], draws[1])
