"""What an input format supplies to a job, so the job runs every format the same way."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

from batchgen.io import InputSource, OutputLayout
from batchgen.io.fs import AnyPath
from batchgen.prompts import RowPrompt

if TYPE_CHECKING:
    from batchgen.io.writer import Columns
    from batchgen.spec import JobSpec


class FinalFiles(NamedTuple):
    """The files a completed job's results are in: an object-store URL, or an absolute path
    (summary.json names it the same from whichever folder the job was started)."""

    result_file: str
    error_file: str | None = None  # where the format writes error lines apart

    @classmethod
    def at(cls, result: AnyPath, errors: AnyPath | None = None) -> FinalFiles:
        def name(path: AnyPath) -> str:
            return str(path.absolute()) if isinstance(path, Path) else str(path)

        return cls(name(result), None if errors is None else name(errors))


class RowBuilder(Protocol):
    """Turns one input row's values into a prompt for the engine (or an error row)."""

    def build(self, index: int, values: dict[str, Any]) -> RowPrompt: ...

    def build_many(self, rows: list[tuple[int, dict[str, Any]]]) -> list[RowPrompt]:
        """build() for many rows at once (their texts tokenized in one batch call)."""


class InputFormat(Protocol):
    """An input format: how it is read, how its rows become prompts, what its output holds
    beyond batchgen's own columns, and which final files it writes."""

    def check(self, spec: JobSpec) -> None:
        """Job-level checks of the spec for this format (BatchgenError, one line)."""

    def open(self, spec: JobSpec) -> InputSource: ...

    def read_columns(self, spec: JobSpec) -> list[str] | None:
        """The input columns the rows need (None = all)."""

    def check_columns(self, spec: JobSpec, source: InputSource) -> None:
        """BatchgenError (one line) when the opened input lacks a column the job needs."""

    def id_column(self, spec: JobSpec) -> str | None: ...

    def passthrough(self, spec: JobSpec, source: InputSource) -> Columns:
        """Columns copied from the input into every output row, with their types."""

    def may_ask_logprobs(self, spec: JobSpec) -> bool: ...

    def builder(self, spec: JobSpec, tokenizer: Any, max_prompt_tokens: int) -> RowBuilder: ...

    def write_results(self, spec: JobSpec, layout: OutputLayout, tokenizer: Any) -> FinalFiles:
        """Write the final file(s) from the committed shards (tokenizer: the model's)."""

    def report(self, spec: JobSpec, source: InputSource) -> str:
        """A line for `batchgen validate` about the rows (e.g. how many cannot run and why)."""
