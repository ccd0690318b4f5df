"""Attention temperature tuning (Llama-4's NoPE layers) from each token's real position.

transformers scales such a layer's queries by log1p(floor((pos + 1) / floor_scale)) *
attn_scale + 1 with pos = arange(tokens of the forward) + the cache's length: a token's
position only for one sequence run with its cache. A batchgen step packs chunks of several
sequences and runs without a cache, so inside a step each such attention module gets a
stand-in cache whose length is, per token, its position less its index in the step (and
which stores nothing): the modeling file's own formula then sees every token's position.
Outside a step the module runs its own forward unchanged.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from torch import nn

from batchgen.engine.attention.hf_adapter import step_metadata
from batchgen.errors import BatchgenError

CACHE_ARGUMENTS = ("cache", "past_key_values")  # what the forward calls its cache (by release)


class StepPositions:
    """A cache that holds nothing: its length is [T] (position - index in the step) per
    token, and update() hands keys and values back unchanged."""

    def __init__(self, past: torch.Tensor) -> None:
        self.past = past

    def get_seq_length(self, layer_idx: int | None = 0) -> torch.Tensor:
        return self.past

    def update(
        self, key: torch.Tensor, value: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return key, value


def tuned_attention(model: nn.Module) -> list[nn.Module]:
    """The model's attention modules that tune their temperature by position: those with
    tuning on that apply no rotary embedding (a layer whose `use_rope` is set never tunes)."""
    return [
        m
        for m in model.modules()
        if getattr(m, "attn_temperature_tuning", False) is True
        and hasattr(m, "floor_scale")
        and not getattr(m, "use_rope", False)
    ]


def position_tuned(modules: list[nn.Module]) -> Callable[[], None]:
    """Give each module a forward that tunes by real positions inside a step; -> the undo.
    BatchgenError for a module whose forward takes no cache (its scale cannot be given
    positions)."""
    names = []
    for module in modules:
        if (name := _cache_argument(module)) is None:
            raise BatchgenError(
                f"batchgen cannot run {type(module).__name__} exactly: its attention "
                "temperature tuning counts positions within each forward pass, and its forward "
                "takes no cache to count them from"
            )
        names.append(name)
    kept = [module.__dict__.get("forward") for module in modules]  # a caller's own, or None
    for module, name, own in zip(modules, names, kept, strict=True):
        module.forward = _forward(module, name, own)

    def undo() -> None:
        for module, own in zip(modules, kept, strict=True):
            if own is None:
                module.__dict__.pop("forward", None)
            else:
                module.forward = own

    return undo


def _cache_argument(module: nn.Module) -> str | None:
    parameters = inspect.signature(type(module).forward).parameters
    return next((n for n in CACHE_ARGUMENTS if n in parameters), None)


def _forward(
    module: nn.Module, cache_name: str, instance: Callable[..., Any] | None
) -> Callable[..., Any]:
    """`instance`: a forward set on the module itself (a caller's hook), which then runs in
    place of the class's."""
    own = instance if instance is not None else partial(type(module).forward, module)

    def forward(*args: Any, **kwargs: Any) -> Any:
        meta = kwargs.get("batchgen_meta") or step_metadata()
        if meta is None or meta.positions is None or kwargs.get(cache_name) is not None:
            return own(*args, **kwargs)  # outside a step: the module's own forward
        positions = meta.positions
        index = torch.arange(positions.shape[0], device=positions.device)
        kwargs[cache_name] = StepPositions(positions - index)
        return own(*args, **kwargs)

    return forward
