"""A request's state inside the engine, and the record it leaves when it finishes."""

from __future__ import annotations

import functools
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any, NamedTuple

from batchgen.engine.sampling_params import SamplingParams
from batchgen.engine.step_layout import request_constants

if TYPE_CHECKING:
    from batchgen.engine.output_check import OutputCheck


class _NotReady:
    def __repr__(self) -> str:
        return "NOT_READY"


NOT_READY = _NotReady()  # a prompt source's "nothing yet, but not exhausted"


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class TokenLogprobs(NamedTuple):
    """One generated token's log-probability and the top alternatives (the model's own
    distribution: log_softmax of the raw logits)."""

    token_id: int
    logprob: float
    top_ids: list[int]
    top_logprobs: list[float]


@dataclass(eq=False)
class Request:
    """Token-level state of one request. Only the engine thread touches it.

    Invariants: num_computed_tokens <= num_tokens; num_pending <= 1 when the scheduler runs
    (a sampled token's value reaches the host one step after it was launched).
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int  # resolved: params.seed or one derived from the engine seed and request_id
    max_tokens: int  # prompt + max_new_tokens, capped by the model's context
    eos_token_ids: frozenset[int]
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # KV written, or being written by a launched step
    num_pending: int = 0  # sampled by a launched step; the value is not on the host yet
    block_table: list[int] = field(default_factory=list)
    slot: int = -1  # row of the device token relay and block tables while running, else -1
    num_synced_blocks: int = 0  # block_table entries already in the device block-table row
    block_hashes: list[bytes] | None = None  # prefix-cache hash chain of the full prompt blocks
    num_hashed_blocks: int = 0  # leading block_table entries the prefix cache has seen
    status: Status = Status.WAITING
    finish_reason: str | None = None
    num_preemptions: int = 0
    num_lost_tokens: int = 0  # most KV tokens a preemption dropped (recomputed below this)
    first_token_time: float = 0.0  # perf_counter when the first token reached the host
    sample_index: int = 0
    num_samples: int = 1
    rng_key: int = 0  # (seed, sample index) hashed: with the position, the sampler's randomness
    text: str | None = None  # output text cut at a stop string, once one matched
    logprobs: list[TokenLogprobs] = field(default_factory=list)  # when params.logprobs is set
    children: list[Request] = field(default_factory=list)  # samples waiting for this prompt
    # the sample that prefilled this one's prompt (n > 1), whose blocks it may start from
    prompt_source: Request | None = field(default=None, repr=False)
    grammar: Any = None  # GrammarState (engine/grammar.py) of a structured output, else None

    @functools.cached_property
    def sampling_constants(self) -> tuple[tuple[int, ...], tuple[float, ...]]:
        """Per-step sampler constants, fixed for the request's life (see step_layout)."""
        return request_constants(self.params)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Tokens the sequence has, counting sampled tokens not yet on the host."""
        return len(self.prompt_token_ids) + len(self.output_token_ids) + self.num_pending

    @property
    def num_known_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @functools.cached_property
    def ending_ids(self) -> frozenset[int]:
        """Tokens that end the sequence: stop_token_ids, and eos unless ignore_eos."""
        eos = frozenset() if self.params.ignore_eos else self.eos_token_ids
        return eos | frozenset(self.params.stop_token_ids)

    @functools.cached_property
    def max_output_tokens(self) -> int:
        return self.max_tokens - len(self.prompt_token_ids)

    def stop_reason(self, token: int) -> str | None:
        """Why the sequence ends after appending `token`, or None."""
        if token in self.ending_ids:
            return "stop"
        if len(self.output_token_ids) >= self.max_output_tokens:
            return "length"
        return None


class Prompt(NamedTuple):
    """One input to Engine.generate: text or token ids, an optional id and sampling overrides.

    seed_key: what a seed derived from the engine seed is keyed by (a job passes the row's id:
    the same samples in every call); None = the request id and the engine's count of generate
    calls, so each call draws new samples, the first as a fresh engine's.
    """

    prompt: str | list[int]
    request_id: str | None = None
    sampling: SamplingParams | dict[str, Any] | None = None  # a dict overrides the call's params
    seed_key: str | None = None


class VocabChecked(list):
    """Prompt ids found inside [0, vocab) before they reached the engine's thread (an
    EngineProcess checks them in the job's process): the engine takes them without looking
    at each id again, for that vocabulary only."""

    __slots__ = ("vocab",)

    def __init__(self, ids: Iterable[int], vocab: int) -> None:
        super().__init__(ids)
        self.vocab = vocab


def outside_vocab(ids: Sequence[int], vocab: int) -> int | None:
    """The first of (non-empty) ids outside [0, vocab), None when every one is inside."""
    if min(ids) >= 0 and max(ids) < vocab:
        return None
    return next(t for t in ids if not 0 <= t < vocab)


def stop_id_problem(bad: int, vocab: int) -> str:
    """Why stop_token_ids cannot hold `bad` on a model of this vocabulary size."""
    return f"stop_token_ids holds {bad}, outside the model's vocabulary [0, {vocab}): remove it"


def int64_ids(prompt: object) -> array | None:
    """A list or tuple of integers as an int64 array; None for anything else, a bool among
    them too (array() takes True as 1: a user's mistake, never a token id)."""
    if not isinstance(prompt, (list, tuple)):
        return None
    try:
        ids = array("q", prompt)
    except (TypeError, OverflowError):
        return None
    if (0 in ids or 1 in ids) and any(type(i) is bool for i in prompt):  # scanned in C first
        return None
    return ids


def not_ids_reason(prompt: object) -> str:
    """Why a prompt that int64_ids refused is not a list of token ids."""
    if not isinstance(prompt, (list, tuple)):
        return f"prompt must be text or a list of token ids, not {type(prompt).__name__}"
    for value in prompt:
        if type(value) is bool or not hasattr(value, "__index__"):
            return f"prompt token ids must be integers, not {type(value).__name__} ({value!r})"
    return "prompt token ids must fit in 64 bits"


class RequestOutput(NamedTuple):
    """What a finished request (one sample of it) yields. finish_reason: stop, length, error.

    A prompt with n > 1 yields n results with sample_index 0..n-1; a prompt rejected before it
    ran yields one error result with sample_index 0.
    """

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    finish_reason: str
    error: str | None = None
    text: str | None = None  # set when decoded (generate(decode=True), or stop strings)
    first_token_time: float = 0.0  # perf_counter when its first token reached the host
    sample_index: int = 0
    num_samples: int = 1
    logprobs: list[TokenLogprobs] | None = None  # when params.logprobs is set
    last: bool = True  # no other sample of this request is still running
    # a structured output that ended `stop`: what its text must match (output_problem, checked
    # where the text is decoded); None otherwise
    check: OutputCheck | None = None
    # the last output token ended the sample (eos or stop_token_ids): it stays in the token ids,
    # its text is left out of the text unless include_stop_str_in_output (as vLLM does)
    stop_token_hidden: bool = False

    @property
    def text_token_ids(self) -> list[int]:
        """The output tokens the text is decoded from."""
        ids = self.output_token_ids
        return ids[:-1] if self.stop_token_hidden else ids
