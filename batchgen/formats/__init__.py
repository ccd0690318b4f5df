"""Input formats: how a job reads rows, turns them into prompts and writes final files."""

from __future__ import annotations

from batchgen.formats.base import InputFormat, RowBuilder
from batchgen.formats.openai_batch import OpenAIBatchFormat
from batchgen.formats.rows import RowsFormat
from batchgen.io.readers import OPENAI_BATCH

__all__ = ["InputFormat", "OpenAIBatchFormat", "RowBuilder", "RowsFormat", "input_format"]


def input_format(name: str) -> InputFormat:
    """The format adapter for an [input] format name."""
    return OpenAIBatchFormat() if name == OPENAI_BATCH else RowsFormat()
