"""Per-request sampling settings, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any


@dataclass(frozen=True)
class SamplingParams:
    """What to sample and when to stop. temperature == 0 means greedy."""

    max_new_tokens: int = 256
    temperature: float = 0.0
    seed: int | None = None  # None = derived from the engine seed and the request id
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={self.max_new_tokens!r} must be an integer >= 1")
        if not isinstance(self.temperature, (int, float)) or self.temperature < 0:
            raise ValueError(f"temperature={self.temperature!r} must be a number >= 0")
        if self.seed is not None and (not isinstance(self.seed, int) or self.seed < 0):
            raise ValueError(f"seed={self.seed!r} must be an integer >= 0")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids={self.stop_token_ids!r} must be token ids >= 0")
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def replace(self, **overrides: Any) -> SamplingParams:
        """A copy with some fields changed; unknown fields are an error naming them."""
        known = {f.name for f in fields(self)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise ValueError(f"unknown sampling field(s) {unknown}: use {sorted(known)}")
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        values.update(overrides)
        return SamplingParams(**values)
