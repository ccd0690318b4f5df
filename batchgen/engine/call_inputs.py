"""What one generate call is given, read as vLLM's LLM.generate reads it."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence, Sized
from numbers import Integral
from typing import Any

from batchgen.engine.request import Prompt
from batchgen.engine.sampling_params import SamplingParams
from batchgen.errors import BatchgenError

CallParams = SamplingParams | Sequence[SamplingParams] | None


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


def _kind(value: object) -> str:
    return type(value).__name__


def _not_params(params: object) -> str | None:
    """What in params is not a sequence of SamplingParams, None when nothing."""
    if not isinstance(params, Sequence) or isinstance(params, str):
        return _kind(params)
    odd = next((p for p in params if not isinstance(p, SamplingParams)), None)
    return None if odd is None else f"a list holding a {_kind(odd)}"
