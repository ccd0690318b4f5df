"""Generation over Hugging Face datasets: a Dataset, IterableDataset or DatasetDict in, the same
kind out with the output columns added; a `Generator` keeps its engine loaded across calls.

Each call runs a batchgen job (tokenizer threads, the engine, checkpointed shards) on the
dataset, in `checkpoint_dir` when given (call again after an interruption to resume) or in a
temporary folder. Output rows keep the input's order and columns; a row with n > 1 samples
becomes n consecutive rows (`sample_index` 0..n-1) with the input columns repeated.
"""

from __future__ import annotations

import contextlib
import dataclasses
import tempfile
import threading
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from batchgen.engine import Engine, EngineConfig, SamplingParams
from batchgen.engine.sampling_params import resolve_aliases
from batchgen.errors import BatchgenError
from batchgen.formats import input_format
from batchgen.io import InputConfig, OutputConfig, dataset_source
from batchgen.io.arrow_values import holds_nanoseconds
from batchgen.io.fs import arrow_file, scheme_of
from batchgen.io.output_schema import output_columns as schema_columns
from batchgen.job import run_job
from batchgen.prompts import PromptConfig
from batchgen.spec import JobSpec, ModelConfig, PipelineConfig
from batchgen.streaming import stream_rows

JOIN_KEYS = ("index", "id")  # output columns the joined dataset does not repeat


class Generator:
    """A loaded engine that generates over datasets. Keep one to reuse the engine across calls
    (model load and graph capture are paid once); calls run one at a time.

    model: a model folder, a hub id, "default" (the embedded tiny model), a loaded
    PreTrainedModel (pass its tokenizer) or an Engine to use as it is.
    """

    def __init__(
        self,
        model: Any = "default",
        config: EngineConfig | None = None,
        *,
        tokenizer: Any = None,
    ) -> None:
        self._owns_engine = not isinstance(model, Engine)
        self.engine = Engine(model, config, tokenizer) if self._owns_engine else model
        # an engine of its own is closed with the generator, if not before (close())
        self._release = weakref.finalize(self, self.engine.close if self._owns_engine else _no_op)
        self._release.atexit = False
        if isinstance(model, (str, Path)):
            self.model_name = str(model)
        else:
            self.model_name = getattr(self.engine.model, "name_or_path", "") or "model"
        self._lock = threading.Lock()
        self._holder: int | None = None  # the thread whose call (or streamed result) has it

    def generate(
        self,
        dataset: Any,
        *,
        prompt_column: str | None = None,
        template: str | None = None,
        messages_column: str | None = None,
        system_prompt: str | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        sampling: SamplingParams | dict[str, Any] | None = None,
        sampling_column: str | None = None,
        truncate: str = "error",
        include_token_ids: bool = False,
        output_prefix: str = "",
        checkpoint_dir: str | Path | None = None,
        progress: bool = True,
        batch_rows: int = 1024,
    ) -> Any:
        """Generate for every row of `dataset` -> the same kind with output columns added.

        The prompt is one of prompt_column (default "prompt"), template ("Q: {question}") or
        messages_column (chat messages, rendered as vLLM's LLM.chat renders them: with
        system_prompt, chat_template_kwargs, add_generation_prompt and
        continue_final_message); sampling is a SamplingParams or a dict of its fields;
        sampling_column names a column of per-row overrides. Output columns (each prefixed by
        output_prefix): sample_index, text, finish_reason, num_prompt_tokens,
        num_generated_tokens, error; logprobs when sampling asks for them (or with
        sampling_column); prompt_token_ids and token_ids with include_token_ids.
        A Dataset is generated now; an IterableDataset lazily, each time it is iterated: each
        input row is read once and carried to its result, rows come out in input order as
        they finish, and only about as many rows are generated as are taken; a DatasetDict or
        IterableDatasetDict split by split, checkpointed under checkpoint_dir/<split>.
        """
        prompt = {
            "column": prompt_column,
            "template": template,
            "messages_column": messages_column,
            "system_prompt": system_prompt,
            "chat_template_kwargs": chat_template_kwargs,
            "add_generation_prompt": add_generation_prompt,
            "continue_final_message": continue_final_message,
            "sampling_column": sampling_column,
            "truncate": truncate,
        }
        spec = self._spec(prompt, sampling, include_token_ids, progress, batch_rows)
        input_format(spec.input.format).check(spec)  # now, not when a lazy result is read
        if checkpoint_dir is not None and scheme_of(str(checkpoint_dir)):
            raise BatchgenError(
                f"checkpoint_dir={str(checkpoint_dir)!r}: the datasets API keeps its checkpoint "
                "in a local folder; give a local path (batchgen run writes to object stores)"
            )
        import datasets

        columns = output_columns(spec)
        if isinstance(dataset, (datasets.DatasetDict, datasets.IterableDatasetDict)):
            for split, ds in dataset.items():  # every split's, before any split runs
                try:
                    _check_dataset(ds, spec, columns, output_prefix)
                except BatchgenError as exc:
                    raise BatchgenError(f"split {split!r}: {exc}") from None
            return type(dataset)(
                {
                    split: self._one(
                        ds,
                        dataclasses.replace(spec, seed_scope=split),
                        _split_dir(checkpoint_dir, split),
                        output_prefix,
                    )
                    for split, ds in dataset.items()
                }
            )
        _check_dataset(dataset, spec, columns, output_prefix)
        return self._one(dataset, spec, checkpoint_dir, output_prefix)

    __call__ = generate

    def reset_prefix_cache(self) -> None:
        """Forget the engine's cached prompt blocks (Engine.reset_prefix_cache)."""
        self.engine.reset_prefix_cache()

    def close(self) -> None:
        """Release the engine (a caller's Engine is left as it is)."""
        self._release()

    def __enter__(self) -> Generator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @contextlib.contextmanager
    def _exclusive(self) -> Iterator[None]:
        """The engine for one call at a time: another thread waits its turn; the thread that
        holds it in a streamed result it has not finished is refused (it would wait forever)."""
        if self._holder == threading.get_ident():
            raise BatchgenError(
                "another result of this Generator is still being iterated: exhaust or close it "
                "first (iterate streamed splits one after another, not side by side)"
            )
        with self._lock:
            self._holder = threading.get_ident()
            try:
                yield
            finally:
                self._holder = None

    def _spec(
        self,
        prompt: dict[str, Any],
        sampling: SamplingParams | dict[str, Any] | None,
        include_token_ids: bool,
        progress: bool,
        batch_rows: int,
    ) -> JobSpec:
        if sampling is not None and not isinstance(sampling, (SamplingParams, dict)):
            raise BatchgenError(
                f"generate: sampling must be a SamplingParams or a dict of its fields, not "
                f"{type(sampling).__name__}: it applies to every row (per-row values: "
                "sampling_column)"
            )
        try:
            given = None  # a SamplingParams: used as it is, as vLLM's generate uses one
            if not isinstance(sampling, SamplingParams):  # a dict: the model's for the rest
                given = tuple(sorted(resolve_aliases(sampling or {})))
                sampling = SamplingParams().replace(**(sampling or {}))
            return JobSpec(
                input=InputConfig(path="dataset", batch_rows=batch_rows),
                output=OutputConfig(dir="checkpoint", include_token_ids=include_token_ids),
                model=ModelConfig(self.model_name),
                prompt=PromptConfig(**prompt),
                sampling=sampling,
                engine=self.engine.config,
                pipeline=PipelineConfig(quiet=not progress),
                sampling_given=given,
            )
        except ValueError as exc:
            raise BatchgenError(f"generate: {exc}") from exc

    def _one(self, ds: Any, spec: JobSpec, checkpoint_dir: Any, prefix: str) -> Any:
        """Generate over one Dataset or IterableDataset (checked by _check_dataset)."""
        import datasets

        columns = output_columns(spec)
        if isinstance(ds, datasets.IterableDataset):  # read as Python rows, whatever its format
            return self._stream(ds.with_format(None), spec, checkpoint_dir, columns, prefix)
        with _job_dir(checkpoint_dir) as out_dir:
            result = self._run(ds, spec, out_dir, checkpoint_dir is not None)
            with arrow_file(result) as f:
                table = pq.read_table(f)
        with _datasets_bars(shown=not spec.pipeline.quiet):
            return _join(ds, table, columns, prefix)

    def _stream(
        self, ds: Any, spec: JobSpec, checkpoint_dir: Any, columns: list[str], prefix: str
    ) -> Any:
        import datasets

        features = None
        if ds.features is not None and not _holds_nanoseconds(ds.features.arrow_schema):
            out = {prefix + c: f for c, f in output_features(spec).items() if c in columns}
            features = datasets.Features({**ds.features, **out})
        read = spec.prompt.columns_used() or None

        def check(names: list[str], first: bool) -> None:
            _check_clash(names, columns, prefix)
            if first:
                _check_required(names, spec)

        def rows() -> Iterator[dict[str, Any]]:
            with self._exclusive(), _job_dir(checkpoint_dir) as out_dir:
                job = self._job_spec(ds, spec, out_dir, final_file=checkpoint_dir is not None)
                yield from stream_rows(ds, job, self.engine, out_dir, columns, prefix, read, check)

        return datasets.IterableDataset.from_generator(rows, features=features)

    def _job_spec(self, ds: Any, spec: JobSpec, out_dir: Path, final_file: bool = True) -> JobSpec:
        kind = type(ds).__name__
        size = f"{len(ds)} rows, " if hasattr(ds, "__len__") else ""
        description = f"datasets.{kind}({size}columns {ds.column_names})"
        return dataclasses.replace(
            spec,
            input=dataclasses.replace(spec.input, path=description),
            output=dataclasses.replace(spec.output, dir=str(out_dir), final_file=final_file),
        )

    def _run(self, ds: Any, spec: JobSpec, out_dir: Path, kept: bool) -> Path:
        """Run (or resume) the job over ds in out_dir -> its results.parquet."""
        spec = self._job_spec(ds, spec, out_dir)
        source = dataset_source(ds.with_format(None), spec.input.batch_rows, spec.input.path)
        with self._exclusive():
            result = run_job(spec, force_resume=None, engine=self.engine, source=source)
        if not result.complete:
            hint = (
                f"finished rows are kept in {out_dir}: call again to resume"
                if kept
                else "pass checkpoint_dir= to keep finished rows across an interruption"
            )
            raise BatchgenError(f"generation stopped before the end; {hint}")
        return Path(result.result_file)


def generate(
    dataset: Any,
    model: Any = "default",
    *,
    engine_config: EngineConfig | None = None,
    tokenizer: Any = None,
    **options: Any,
) -> Any:
    """Load `model` and generate over `dataset` once; options as in Generator.generate.
    To run several calls on one loaded engine, keep a Generator instead. The engine is closed
    before a Dataset (or DatasetDict) is returned; a streamed result keeps it until the result
    is dropped."""
    import datasets

    from batchgen.engine.model_loader import hf_progress_bars

    with hf_progress_bars(shown=options.get("progress", True) is not False):
        gen = Generator(model, engine_config, tokenizer=tokenizer)
    try:
        out = gen.generate(dataset, **options)
    except BaseException:
        gen.close()
        raise
    if not isinstance(out, (datasets.IterableDataset, datasets.IterableDatasetDict)):
        gen.close()
    return out


def _holds_nanoseconds(schema: pa.Schema) -> bool:
    """Whether a column holds timestamps or durations in nanoseconds (at any depth). datasets
    gives them as pandas values, and a stream declared with features encodes each example
    again, which cuts pandas values to microseconds: such a stream is returned without
    features, its rows as the input gives them."""
    return any(holds_nanoseconds(field.type) for field in schema)


def _no_op() -> None:
    pass


def _check_dataset(ds: Any, spec: JobSpec, columns: list[str], prefix: str) -> None:
    """Every refusal that needs no generation: the kind, a transform, an input column an output
    column would overwrite, the prompt's columns (where the dataset declares its columns)."""
    import datasets

    if not isinstance(ds, (datasets.Dataset, datasets.IterableDataset)):
        raise BatchgenError(
            f"generate takes a datasets Dataset, IterableDataset or DatasetDict, not "
            f"{type(ds).__name__}: wrap the data, e.g. datasets.Dataset.from_list(rows)"
        )
    _check_transform(ds)
    _check_clash(ds.column_names or [], columns, prefix)
    if ds.column_names is not None:
        source = dataset_source(ds, spec.input.batch_rows, f"datasets.{type(ds).__name__}")
        input_format(spec.input.format).check_columns(spec, source)


def _check_transform(ds: Any) -> None:
    """Refuse a Dataset whose rows read through a transform: the job reads the stored rows."""
    if getattr(ds, "format", {}).get("type") == "custom":  # with_transform / set_transform
        raise BatchgenError(
            "the dataset has a transform (with_transform / set_transform), which generation "
            "would not see: apply it with ds.map(transform, batched=True) instead"
        )


def _check_clash(names: list[str], columns: list[str], prefix: str) -> None:
    """Refuse input columns that an output column would overwrite."""
    clash = [prefix + c for c in columns if prefix + c in names]
    if clash:
        free = next(
            p for p in ("gen_", *(f"gen{i}_" for i in range(1, len(names) + 2)))
            if not any(p + c in names for c in columns)
        )  # fmt: skip
        given = f" (output_prefix={prefix!r})" if prefix else ""
        raise BatchgenError(
            f"the dataset already has a column {clash[0]!r}{given}: pass "
            f"output_prefix={free!r} (or rename the column)"
        )


def _check_required(names: list[str], spec: JobSpec) -> None:
    """Refuse a stream without a schema whose first example lacks the prompt's columns."""
    missing = [c for c in spec.prompt.required_columns() if c not in names]
    if missing:
        raise BatchgenError(
            f"input has no column {missing[0]!r} (keys of its first example: "
            f"{', '.join(names)}): fix the prompt arguments or the input"
        )


def output_columns(spec: JobSpec) -> list[str]:
    """The columns a call adds, decided by its arguments (not by what the rows hold)."""
    logprobs = input_format(spec.input.format).may_ask_logprobs(spec)
    own = schema_columns(logprobs=logprobs, token_ids=spec.output.include_token_ids)
    return [c for c in own if c not in JOIN_KEYS]


def output_features(spec: JobSpec) -> Any:
    """datasets Features of every column a call can add (from the one output schema)."""
    import datasets

    every = [c for c in schema_columns(logprobs=True, token_ids=True) if c not in JOIN_KEYS]
    return datasets.Features.from_arrow_schema(output_features_schema(every))


@contextlib.contextmanager
def _job_dir(checkpoint_dir: str | Path | None) -> Iterator[Path]:
    if checkpoint_dir is not None:
        yield Path(checkpoint_dir)
        return
    with tempfile.TemporaryDirectory(prefix="batchgen-") as tmp:
        yield Path(tmp) / "job"


def _split_dir(checkpoint_dir: str | Path | None, split: str) -> Path | None:
    return None if checkpoint_dir is None else Path(checkpoint_dir) / split


def _datasets_bars(shown: bool) -> contextlib.AbstractContextManager[None]:
    """datasets' own progress bars (flattening a selected dataset's indices) off inside, where
    progress=False; as they were after."""
    import datasets

    from batchgen.engine.model_loader import library_bars

    return library_bars(
        shown,
        lambda: not datasets.are_progress_bars_disabled(),
        datasets.disable_progress_bars,
        datasets.enable_progress_bars,
    )


def _join(ds: Any, table: pa.Table, columns: list[str], prefix: str) -> Any:
    """The input rows (repeated per sample) side by side with the typed output columns."""
    import datasets

    schema = output_features_schema(columns)
    arrays = [
        table.column(c).cast(schema.field(c).type)
        if c in table.column_names
        else pa.nulls(table.num_rows, schema.field(c).type)
        for c in columns
    ]
    outputs = pa.Table.from_arrays(arrays, names=[prefix + c for c in columns])
    index = table.column("index").to_pylist() if "index" in table.column_names else []
    base = ds if index == list(range(len(ds))) else ds.select(index)
    if not len(base):  # concatenating along columns drops a 0-row table's columns
        features = {**base.features, **datasets.Features.from_arrow_schema(outputs.schema)}
        return datasets.Dataset.from_dict(
            {name: [] for name in features}, features=datasets.Features(features)
        )
    return datasets.concatenate_datasets([base, datasets.Dataset(outputs)], axis=1)


def output_features_schema(columns: list[str]) -> pa.Schema:
    own = schema_columns(logprobs=True, token_ids=True)
    return pa.schema([(c, own[c]) for c in columns])
