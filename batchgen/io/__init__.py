"""Input readers and checkpointed output: layout, atomic writes, shards, the final merge."""

from batchgen.io.layout import OutputLayout
from batchgen.io.readers import InputConfig, InputSource, RawRow, dataset_source, open_input
from batchgen.io.writer import OutputConfig, ShardWriter

__all__ = [
    "InputConfig",
    "InputSource",
    "OutputConfig",
    "OutputLayout",
    "RawRow",
    "ShardWriter",
    "dataset_source",
    "open_input",
]
