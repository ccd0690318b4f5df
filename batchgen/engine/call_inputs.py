"""What one generate call is given, read as vLLM's LLM.generate reads it."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from numbers import Integral
from typing import Any

from batchgen.engine.request import Prompt


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
