"""Per-request sampling settings, validated on construction (names and meanings as in vLLM)."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any


@dataclass(frozen=True)
class SamplingParams:
    """What to sample and when to stop. temperature == 0 means greedy.

    Filters apply in the order penalties -> temperature -> top_k -> top_p -> min_p; logprobs
    are those of the model's own distribution (log_softmax of the raw logits).
    """

    max_new_tokens: int = 256
    min_new_tokens: int = 0  # end-of-sequence and stop tokens are banned before this many
    temperature: float = 0.0
    top_k: int = 0  # keep the k most likely tokens; 0 = all
    top_p: float = 1.0  # keep the smallest set whose probability reaches top_p
    min_p: float = 0.0  # drop tokens less likely than min_p x the most likely one
    repetition_penalty: float = 1.0  # > 1 discourages tokens of the prompt and the output
    presence_penalty: float = 0.0  # subtracted once from tokens already generated
    frequency_penalty: float = 0.0  # subtracted per occurrence in the generated tokens
    seed: int | None = None  # None = derived from the engine seed and the request id
    n: int = 1  # samples of one prompt, each its own result with a sample index
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()  # stop strings, matched on the detokenized text
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None  # None = off; k = the chosen token's and the top k's logprobs

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        object.__setattr__(self, "stop", stop)
        for problem in _problems(self):
            raise ValueError(problem)

    @property
    def uses_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

    def replace(self, **overrides: Any) -> SamplingParams:
        """A copy with some fields changed; unknown fields are an error naming them."""
        known = {f.name for f in fields(self)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise ValueError(f"unknown sampling field(s) {unknown}: use {sorted(known)}")
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        values.update(overrides)
        return SamplingParams(**values)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _problems(p: SamplingParams) -> list[str]:
    """Every rule a field breaks, as 'field=value must ...' messages."""
    rules = [
        (
            "max_new_tokens",
            _is_int(p.max_new_tokens) and p.max_new_tokens >= 1,
            "be an integer >= 1",
        ),
        (
            "min_new_tokens",
            _is_int(p.min_new_tokens) and p.min_new_tokens >= 0,
            "be an integer >= 0",
        ),
        ("temperature", _is_num(p.temperature) and p.temperature >= 0, "be a number >= 0"),
        ("top_k", _is_int(p.top_k) and p.top_k >= 0, "be an integer >= 0 (0 = off)"),
        ("top_p", _is_num(p.top_p) and 0 < p.top_p <= 1, "be in (0, 1]"),
        ("min_p", _is_num(p.min_p) and 0 <= p.min_p <= 1, "be in [0, 1]"),
        (
            "repetition_penalty",
            _is_num(p.repetition_penalty) and p.repetition_penalty > 0,
            "be a number > 0",
        ),
        (
            "presence_penalty",
            _is_num(p.presence_penalty) and -2 <= p.presence_penalty <= 2,
            "be in [-2, 2]",
        ),
        (
            "frequency_penalty",
            _is_num(p.frequency_penalty) and -2 <= p.frequency_penalty <= 2,
            "be in [-2, 2]",
        ),
        ("seed", p.seed is None or (_is_int(p.seed) and p.seed >= 0), "be an integer >= 0"),
        ("n", _is_int(p.n) and p.n >= 1, "be an integer >= 1"),
        (
            "stop_token_ids",
            all(_is_int(t) and t >= 0 for t in p.stop_token_ids),
            "be token ids >= 0",
        ),
        ("stop", all(isinstance(s, str) and s for s in p.stop), "be non-empty strings"),
        (
            "logprobs",
            p.logprobs is None or (_is_int(p.logprobs) and 0 <= p.logprobs <= 20),
            "be an integer in [0, 20] or unset",
        ),
    ]
    out = [f"{name}={getattr(p, name)!r} must {rule}" for name, ok, rule in rules if not ok]
    if not out and p.min_new_tokens > p.max_new_tokens:
        out.append(
            f"min_new_tokens={p.min_new_tokens} must be <= max_new_tokens={p.max_new_tokens}"
        )
    return out
