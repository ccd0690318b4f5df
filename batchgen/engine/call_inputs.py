"""What one generate call is given, read as vLLM's LLM.generate reads it."""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Iterable, Iterator, Mapping, Sequence, Sized
from numbers import Integral
from typing import Any

from batchgen.engine.request import Prompt
from batchgen.engine.sampling_params import SamplingParams, with_defaults
from batchgen.errors import BatchgenError

CallParams = SamplingParams | Sequence[SamplingParams] | None
MAX_DIGITS = 18  # a decimal id of up to this many digits is kept as a number


def as_prompts(prompts: Any) -> Iterable[Any]:
    """generate's `prompts` as an iterable of prompts. One text, one Prompt, one mapping or
    one flat list (or tuple) of token ids is a single prompt, as vLLM reads a completion's
    `prompt`; anything else is an iterable of prompts."""
    if isinstance(prompts, (str, bytes, bytearray, Prompt, Mapping)):
        return (prompts,)
    if isinstance(prompts, (list, tuple)) and prompts and all(_is_id(t) for t in prompts):
        return (list(prompts),)
    return prompts


def _is_id(item: object) -> bool:
    return isinstance(item, Integral)


def call_params(params: CallParams, defaults: dict[str, Any]) -> CallParams:
    """A call's params: as given, or where it gives none the model's recommended values
    (`defaults`) over batchgen's; BatchgenError for one no request could take."""
    if params is not None or not defaults:
        return params
    try:
        return with_defaults(SamplingParams(), defaults)
    except ValueError as exc:
        raise BatchgenError(str(exc)) from None


def with_params(prompts: Iterable[Any], params: CallParams) -> Iterator[tuple[Any, SamplingParams]]:
    """Each prompt with its params: the call's one SamplingParams (None: the defaults), or a
    sequence of them paired one by one with a sized sequence of prompts of the same length.
    BatchgenError for anything else."""
    if params is None or isinstance(params, SamplingParams):
        one = params or SamplingParams()
        return ((prompt, one) for prompt in prompts)
    odd = _not_params(params)
    if odd is not None:
        raise BatchgenError(
            f"params must be a SamplingParams or a list of them (one per prompt), not {odd}"
        )
    if not isinstance(prompts, Sized):
        raise BatchgenError(
            f"a list of {len(params)} SamplingParams pairs with a list of prompts, not "
            f"{_kind(prompts)}: pass the prompts as a list, or one SamplingParams for all"
        )
    if len(prompts) != len(params):
        raise BatchgenError(
            f"{len(prompts)} prompts but {len(params)} SamplingParams: give one per prompt, or "
            "one SamplingParams for all"
        )
    return zip(prompts, params, strict=True)


def check_one_call(generating: bool) -> None:
    """One generate call at a time per engine: a second one would take the first's results."""
    if generating:
        raise BatchgenError(
            "this engine's previous generate call is still open: take its results to the "
            "end or close() it before the next call (one call at a time per engine)"
        )


def one_params(params: CallParams) -> SamplingParams:
    """The call's one SamplingParams, for an engine served in another process, which takes one
    per call (per-prompt settings ride on each Prompt's sampling overrides)."""
    if params is None or isinstance(params, SamplingParams):
        return params or SamplingParams()
    raise BatchgenError(
        f"an engine in its own process takes one SamplingParams per generate call, not "
        f"{_kind(params)}: give per-prompt settings as Prompt(..., sampling={{...}})"
    )


def _kind(value: object) -> str:
    return type(value).__name__


def _not_params(params: object) -> str | None:
    """What in params is not a sequence of SamplingParams, None when nothing."""
    if not isinstance(params, Sequence) or isinstance(params, str):
        return _kind(params)
    odd = next((p for p in params if not isinstance(p, SamplingParams)), None)
    return None if odd is None else f"a list holding a {_kind(odd)}"


class CallIds:
    """The request ids a generate call has given out, each to one prompt only: a prompt's own
    request_id, or its position in the call ("0", "1", ...) when it has none.

    Decimal ids (every position, and a job's row numbers) are kept as runs of consecutive
    numbers, so a call of millions of numbered prompts holds a few runs, not millions of
    strings; other ids are kept as they are.
    """

    def __init__(self) -> None:
        self._starts: list[int] = []  # sorted, disjoint runs [start, end) of decimal ids
        self._ends: list[int] = []
        self._names: set[str] = set()

    def claim(self, request_id: str, given: bool) -> str | None:
        """Give request_id to a prompt (given: its own request_id, else its position); -> why
        it cannot have it (an earlier prompt of the call has it), None when it can."""
        if self._add(request_id):
            return None
        if given:
            return (
                f"id {request_id!r} was given to an earlier prompt of this call (a prompt "
                "without a request_id has its position as id): ids must be unique"
            )
        return (
            f"without a request_id its id is its position, {request_id!r}, but an earlier "
            "prompt of this call was given that request_id: give this prompt one of its own"
        )

    def _add(self, request_id: str) -> bool:
        number = _decimal(request_id)
        if number is not None:
            return self._add_number(number)
        if request_id in self._names:
            return False
        self._names.add(request_id)
        return True

    def _add_number(self, number: int) -> bool:
        starts, ends = self._starts, self._ends
        i = bisect_right(starts, number) - 1  # the run starting at or before number
        if i >= 0 and number < ends[i]:
            return False
        left = i >= 0 and ends[i] == number
        right = i + 1 < len(starts) and starts[i + 1] == number + 1
        if left and right:  # fills the gap between two runs
            ends[i] = ends[i + 1]
            del starts[i + 1], ends[i + 1]
        elif left:
            ends[i] = number + 1
        elif right:
            starts[i + 1] = number
        else:
            starts.insert(i + 1, number)
            ends.insert(i + 1, number + 1)
        return True


def _decimal(request_id: str) -> int | None:
    """The number a canonical decimal id writes ("0", "17"; not "017" or "+1"), else None."""
    if not (0 < len(request_id) <= MAX_DIGITS and request_id.isascii() and request_id.isdigit()):
        return None
    if request_id[0] == "0" and len(request_id) > 1:
        return None
    return int(request_id)
