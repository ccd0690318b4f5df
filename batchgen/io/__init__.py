"""Input readers and checkpointed output writers."""

from batchgen.io.readers import InputConfig, InputSource, RawRow, dataset_source, open_input
from batchgen.io.writer import (
    OutputConfig,
    ShardWriter,
    committed_indexes,
    remove_temp_files,
    write_final,
)

__all__ = [
    "InputConfig",
    "InputSource",
    "OutputConfig",
    "RawRow",
    "ShardWriter",
    "committed_indexes",
    "dataset_source",
    "open_input",
    "remove_temp_files",
    "write_final",
]
