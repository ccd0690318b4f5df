"""The start-up check's requests (batchgen/engine/probe.py): their sizes and the KV cache room
they need. Light (no model code): the job's process checks a run's settings against them
before the model loads."""

from __future__ import annotations

from batchgen.engine.block_manager import blocks_for
from batchgen.errors import BatchgenError

PROBE_LENGTHS = (11, 37)  # prompt tokens of the probe requests
PROBE_NEW_TOKENS = 3


def prompt_room(max_model_len: int) -> int:
    """Prompt tokens a probe request may have in this context (its outputs fit after)."""
    return max(2, max_model_len - PROBE_NEW_TOKENS - 1)


def probe_tokens(max_model_len: int) -> int:
    """Tokens of the start-up check's longest request (prompt and output) in this context."""
    return min(max(PROBE_LENGTHS), prompt_room(max_model_len)) + PROBE_NEW_TOKENS


def check_probe_room(num_blocks: int, block_size: int, tokens: int) -> None:
    """A KV cache set too small for the probe's requests (num_kv_blocks given) is the
    setting's fault, not the model's: one line naming it."""
    need = blocks_for(tokens, block_size)
    if num_blocks < need:
        raise BatchgenError(
            f"num_kv_blocks={num_blocks} is too small: the start-up check of the model "
            f"runs a {tokens}-token request, which needs {need} blocks of "
            f"{block_size} tokens: give at least {need}, and enough for the "
            "longest prompt plus max_new_tokens"
        )
