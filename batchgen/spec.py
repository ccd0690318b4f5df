"""Job specs: TOML files with model, input, prompt, sampling, output and runtime sections.

Each section maps onto a frozen dataclass that owns its defaults and validation; [runtime]
holds the EngineConfig and PipelineConfig fields. An unknown key or a value of the wrong type is
an error naming the key. (pydantic was considered: its messages are no clearer than these, which
name the section, key, value and what is allowed, and the dataclasses need no dependency.)
"""

from __future__ import annotations

import dataclasses
import glob
import json
import math
import os
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from batchgen.engine.config import EngineConfig
from batchgen.engine.sampling_params import ALIASES, SamplingParams, resolve_aliases
from batchgen.errors import BatchgenError, check_field
from batchgen.formats.openai_batch.requests import OPENAI_DEFAULTS
from batchgen.io import InputConfig, OutputConfig
from batchgen.io.fs import local_path, scheme_of
from batchgen.io.readers import OPENAI_BATCH
from batchgen.prompts import PromptConfig


@dataclass(frozen=True)
class ModelConfig:
    path: str = "default"  # a local model folder, a hub id, or "default" (the embedded model)
    # names the model answers to in OpenAI Batch lines (body.model); () = the path as given
    served_model_name: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        path_ok = isinstance(self.path, str) and bool(self.path.strip())
        check_field(path_ok, "path", self.path, 'a model folder, a hub id or "default"')
        object.__setattr__(self, "served_model_name", tuple(self.served_model_name))
        if not all(isinstance(n, str) and n for n in self.served_model_name):
            raise ValueError(
                f"served_model_name={list(self.served_model_name)!r}: use non-empty strings"
            )

    @property
    def names(self) -> tuple[str, ...]:
        """The names a request may give for this model; the first one labels responses."""
        return self.served_model_name or (self.path,)


ENGINE_PLACES = ("auto", "process", "thread")
MAX_TIMEOUT_S = 1e7  # ~116 days: longer waits overflow torch.distributed's timeouts


@dataclass(frozen=True)
class PipelineConfig:
    tokenizer_threads: int = 2  # threads rendering and tokenizing prompts ahead of the engine
    # processes that render, tokenize and detokenize beside the engine's process (0 = the
    # threads above do it all); measured slower than threads on the job-path bench so far
    tokenizer_processes: int = 0
    prefetch_batches: int = 4  # tokenized input batches queued ahead of the engine
    quiet: bool = False  # no progress bar
    # how long a thread may hold the GIL while another waits for it (sys.setswitchinterval,
    # Python's default 5 ms): shorter makes the engine thread wait less for the GIL after a
    # device sync but makes every thread switch more often (0.5 ms measured slower)
    switch_interval_ms: float = 5.0
    # data-parallel jobs (torchrun): how long a rank waits for the others at a start-up step
    # (their model loads included) before it gives up ...
    rank_timeout_s: float = 1800.0
    # ... and how long a rank may go unheard while the job runs before the others take it as
    # stopped (dead or hung) and stop too
    heartbeat_timeout_s: float = 60.0
    # record every engine step into <output>/profile/ for `batchgen report` (changes no row)
    profile: bool = False
    # where the engine runs: "process" = a process of its own, so no reader, tokenizer or
    # writer thread of the job's process ever holds the GIL its loop needs; "thread" = the
    # job's process; "auto" = its own process on a GPU, the job's on the CPU (where the
    # engine's compute, not the GIL, sets the pace, and two processes share few cores) and in
    # the ranks of a data-parallel job. A job that profiles records its engine's steps where
    # the engine runs
    engine_process: str = "auto"
    # with the engine in its own process: cores it runs on alone, the job's own threads
    # (reader, tokenizer, writer, and the pools they start) on the others; None = 2 where the
    # job may use 8 cores or more, unless its rows may ask for structured outputs (their mask
    # fill runs in the engine's process on as many cores as it has), else 0 (none kept)
    engine_cpus: int | None = None

    def __post_init__(self) -> None:
        if self.tokenizer_threads < 1:
            raise ValueError(f"tokenizer_threads={self.tokenizer_threads} must be >= 1")
        if not 0 <= self.tokenizer_processes <= 64:
            raise ValueError(f"tokenizer_processes={self.tokenizer_processes} must be in [0, 64]")
        if self.prefetch_batches < 1:
            raise ValueError(f"prefetch_batches={self.prefetch_batches} must be >= 1")
        if not 0 < self.switch_interval_ms <= 100:
            raise ValueError(f"switch_interval_ms={self.switch_interval_ms} must be in (0, 100]")
        if not 0 < self.rank_timeout_s <= MAX_TIMEOUT_S:
            raise ValueError(
                f"rank_timeout_s={self.rank_timeout_s} must be in (0, {MAX_TIMEOUT_S:g}]"
            )
        if not 2 <= self.heartbeat_timeout_s <= MAX_TIMEOUT_S:
            raise ValueError(
                f"heartbeat_timeout_s={self.heartbeat_timeout_s} must be in [2, {MAX_TIMEOUT_S:g}]"
            )
        if self.engine_cpus is not None and self.engine_cpus < 0:
            raise ValueError(f"engine_cpus={self.engine_cpus} must be >= 0 (or unset)")
        check_field(
            self.engine_process in ENGINE_PLACES,
            "engine_process",
            self.engine_process,
            " or ".join(ENGINE_PLACES),
        )
        if self.engine_cpus is not None and self.engine_process == "thread":
            raise ValueError(
                f"engine_cpus={self.engine_cpus} places the engine's own process, and "
                'engine_process = "thread" runs none: leave one of them out'
            )

    def own_engine_process(self, cuda: bool, data_parallel: bool = False) -> bool:
        """Whether the engine runs in a process of its own (engine_process; "auto": on a
        GPU, unless the job is a data-parallel rank, whose engine stays in it)."""
        if self.engine_process != "auto":
            return self.engine_process == "process"
        return cuda and not data_parallel


@dataclass(frozen=True)
class JobSpec:
    input: InputConfig
    output: OutputConfig
    model: ModelConfig = field(default_factory=ModelConfig)
    prompt: PromptConfig = field(default_factory=PromptConfig)
    sampling: SamplingParams = field(default_factory=SamplingParams)
    engine: EngineConfig = field(default_factory=EngineConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    # the [sampling] fields the job itself sets; the others take the model's recommended
    # values where it has some (runtime.generation_config); None: every field is the job's
    sampling_given: tuple[str, ...] | None = None
    # a DatasetDict split's name: its rows' seeds derived from runtime.seed are keyed by it
    # and their ids, apart from the rows at the same positions of the other splits
    seed_scope: str | None = None

    def engine_cores(self, allowed: set[int]) -> frozenset[int]:
        """The cores of `allowed` kept for the engine's own process (engine_cpus)."""
        from batchgen.engine.remote.placement import kept_cores

        setting = self.pipeline.engine_cpus
        if setting is None and self.may_ask_structured():
            setting = 0
        return kept_cores(setting, allowed)

    def may_ask_structured(self) -> bool:
        """Whether some row may ask for a structured output: the job's [sampling] does, or a
        column or the format gives rows their own sampling."""
        p = self.prompt
        return (
            self.sampling.structured
            or p.json_schema_column is not None
            or p.sampling_column is not None
            or self.input.format == OPENAI_BATCH
        )

    def to_dict(self) -> dict[str, Any]:
        """The resolved spec, in the TOML's shape (engine and pipeline merged into runtime)."""
        d = {
            name: dataclasses.asdict(getattr(self, name)) for name in SECTIONS if name != "runtime"
        }
        d["runtime"] = {**dataclasses.asdict(self.engine), **dataclasses.asdict(self.pipeline)}
        return _jsonable(d)


SECTIONS: dict[str, tuple[type, ...]] = {
    "model": (ModelConfig,),
    "input": (InputConfig,),
    "prompt": (PromptConfig,),
    "sampling": (SamplingParams,),
    "output": (OutputConfig,),
    "runtime": (EngineConfig, PipelineConfig),
}


def load_spec(
    path: str | Path | None,
    overrides: list[str] = (),
    values: dict[str, Any] | None = None,
    options: dict[str, str] | None = None,
) -> JobSpec:
    """Read a TOML job file (or none), apply `section.key=value` overrides (TOML values, as
    --set gives them), then `values` ({"section.key": value}, as the CLI's shortcut options
    give them; `options` names the option that gave each). A key given both ways is an
    error: which one was meant is not clear."""
    table: dict[str, Any] = {}
    if path is not None:
        file = Path(path)
        if not file.is_file():
            what = "is not a file" if file.exists() else "does not exist"
            raise BatchgenError(f"job file '{path}' {what}: give a TOML job file")
        try:
            table = tomllib.loads(file.read_bytes().decode("utf-8"))
        except UnicodeDecodeError as exc:
            raise BatchgenError(
                f"job file '{path}' is not UTF-8 text (byte {exc.start}): save it as UTF-8"
            ) from exc
        except tomllib.TOMLDecodeError as exc:
            raise BatchgenError(f"job file '{path}' is not valid TOML: {exc}") from exc
        except OSError as exc:
            raise BatchgenError(f"cannot read job file '{path}' ({exc.strerror})") from exc
        _resolve_paths(table, file.parent)
    filed = table.get("sampling")
    filed_sampling = set(filed) if isinstance(filed, dict) else set()  # the job file's keys
    set_keys = []
    for item in overrides:
        set_keys.append(apply_override(table, item))
    for key, value in (values or {}).items():
        if key in set_keys:
            option = (options or {}).get(key, "a shortcut option")
            raise BatchgenError(
                f"{key} is given twice (--set {key}=... and {option}): give it once"
            )
        section, _, name = key.partition(".")
        _section(table, section)[name] = value
        set_keys.append(key)
    _drop_replaced_spellings(table, filed_sampling, set_keys)
    _local_paths(table)
    return spec_from_table(table)


def _drop_replaced_spellings(table: dict[str, Any], filed: set[str], set_keys: list[str]) -> None:
    """An option or --set of a sampling field replaces the job file's value of it under its
    other name too (vLLM's max_tokens for max_new_tokens, and back): the option wins, as it
    does over the same name. filed: the job file's [sampling] keys."""
    sampling = table.get("sampling")
    if not isinstance(sampling, dict):
        return
    for alias, name in ALIASES.items():
        for given, other in ((alias, name), (name, alias)):
            replaced = f"sampling.{given}" in set_keys and f"sampling.{other}" not in set_keys
            if replaced and other in filed:
                sampling.pop(other, None)


def _local_paths(table: dict[str, Any]) -> None:
    """input.path, model.path and output.dir written with ~ or file://, from an option or
    --set as from a job file: the local path they name (as_path's rule)."""
    for section, key in (("output", "dir"), ("input", "path"), ("model", "path")):
        values = table.get(section)
        value = values.get(key) if isinstance(values, dict) else None
        if isinstance(value, str) and _written_local(value):
            values[key] = str(local_path(value))


def _written_local(value: str) -> bool:
    """Whether a path is written in a local form local_path turns into another: ~ or file://."""
    return value.startswith("~") or value[:7].lower() == "file://"


def _section(table: dict[str, Any], section: str) -> dict[str, Any]:
    """The table of `section`, made where absent; a section given as a plain value is an
    error (keys cannot be set inside it)."""
    values = table.setdefault(section, {})
    if not isinstance(values, dict):
        raise _not_a_table(section, values)
    return values


def _not_a_table(section: str, value: Any) -> BatchgenError:
    kind = "a list" if isinstance(value, list) else _name(type(value))
    return BatchgenError(
        f"[{section}] must be a table of keys, not {kind} ({section} = {value!r}): write "
        f"[{section}] on a line of its own, then key = value lines"
    )


def _resolve_paths(table: dict[str, Any], base: Path) -> None:
    """Relative paths in a job file are relative to the file's folder: output.dir always;
    input.path and model.path where something exists there (otherwise they may name a hub
    dataset or model, or a path relative to the working directory). A local path written
    with ~ or file:// is normalised first (as_path's rule), so it is never joined."""
    for section, key, always in (
        ("output", "dir", True),
        ("input", "path", False),
        ("model", "path", False),
    ):
        values = table.get(section)
        value = values.get(key) if isinstance(values, dict) else None
        if not isinstance(value, str) or not value or scheme_of(value):
            continue  # an object-store URL is absolute
        if _written_local(value):
            values[key] = value = str(local_path(value))
        joined = base / value
        if Path(value).is_absolute():
            continue
        if always or glob.glob(str(joined)) or joined.exists():
            values[key] = os.path.normpath(joined)


def check_distinct_overrides(items: list[str]) -> None:
    """Two --set of one key: which was meant is not clear (the later would win silently).
    A malformed item is left to apply_override to name."""
    seen: dict[str, str] = {}
    for item in items:
        parts = _override_parts(item)
        if parts is None:
            continue
        key = f"{parts[0]}.{parts[1]}"
        if key in seen:
            raise BatchgenError(
                f"{key} is given twice (--set {seen[key]!r} and --set {item!r}): give it once"
            )
        seen[key] = item


def _override_parts(item: str) -> tuple[str, str, str] | None:
    """`section.key=value` -> (section, key, the value's text); None where it is not so."""
    key, sep, raw = item.partition("=")
    section, dot, name = key.strip().partition(".")
    if not sep or not dot or not name:
        return None
    return section.strip(), name.strip(), raw


def apply_override(table: dict[str, Any], item: str) -> str:
    """Apply one `section.key=value` (a TOML value, or a bare word) -> "section.key"."""
    parts = _override_parts(item)
    if parts is None:
        raise BatchgenError(f"--set {item!r}: use section.key=value, e.g. sampling.temperature=0.7")
    section, name, raw = parts
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError as exc:
        value = _untyped_value(item, raw, _takes_text(section, name), exc)
    _section(table, section)[name] = value
    return f"{section}.{name}"


def _untyped_value(item: str, raw: str, text: bool, exc: tomllib.TOMLDecodeError) -> Any:
    """A --set value that is not TOML: a bare word is text; one that opens a list or a table
    is JSON where it parses as JSON, else text where the key takes text (a template such as
    "{question}" or "[INST] {q}"); one that opens a quote, or a list or table for a key that
    takes none, was meant as TOML and is refused (it would be kept with its brackets)."""
    start = raw.lstrip()[:1]
    if start in ("[", "{"):
        try:
            return json.loads(raw)
        except ValueError:
            if text:
                return raw
    elif start not in ('"', "'"):
        return raw  # a bare word is a string
    raise BatchgenError(
        f"--set {item!r}: the value is not valid TOML ({_reason(exc)}): quote each string, "
        "in single quotes to keep backslashes, e.g. sampling.stop=['END', 'STOP'] "
        "or sampling.regex='\\d+'"
    ) from exc


def _field(section: str, name: str) -> dataclasses.Field | None:
    """The field a section's key names, None for a key the section does not have."""
    fields = (f for cls in SECTIONS.get(section, ()) for f in dataclasses.fields(cls))
    return next((f for f in fields if f.name == name), None)


def _takes_text(section: str, name: str) -> bool:
    """Whether the key's field is text (its annotation a str, not a list of them)."""
    f = _field(section, name)
    kind = "" if f is None else str(f.type)
    return "str" in kind and not any(t in kind for t in ("tuple", "list", "["))


def _reason(exc: tomllib.TOMLDecodeError) -> str:
    """The TOML error without its position (that of the value inside a wrapper line)."""
    return str(exc).split(" (at line", 1)[0]


def spec_from_table(table: dict[str, Any]) -> JobSpec:
    unknown = sorted(set(table) - set(SECTIONS))
    if unknown:
        name = unknown[0]
        if not isinstance(table[name], dict):  # `key = value` written above any [section]
            owners = [section for section in SECTIONS if _field(section, name) is not None]
            where = f"it belongs under [{owners[0]}]" if owners else "keys belong under a section"
            raise BatchgenError(
                f"{name} = {table[name]!r} is outside any [section]: {where} "
                f"(sections are {', '.join(SECTIONS)})"
            )
        raise BatchgenError(f"unknown section [{name}]: sections are {', '.join(SECTIONS)}")
    for name in ("input", "output"):
        if name in table and not isinstance(table[name], dict):
            raise _not_a_table(name, table[name])
        if not table.get(name):
            hint = "path" if name == "input" else "dir"
            raise BatchgenError(
                f"[{name}] {hint} is required (in the job file or with "
                f"--{name} / --set {name}.{hint}=...)"
            )
    built = {
        name: _build_section(name, table.get(name, {}), classes)
        for name, classes in SECTIONS.items()
    }
    engine, pipeline = built.pop("runtime")
    given = resolve_aliases(table.get("sampling", {}))
    if built["input"][0].format == OPENAI_BATCH:  # what a line's body does not give
        defaults = {k: v for k, v in OPENAI_DEFAULTS.items() if k not in given}
        built["sampling"] = [built["sampling"][0].replace(**defaults)]
    return JobSpec(
        engine=engine,
        pipeline=pipeline,
        sampling_given=tuple(sorted(given)),
        **{k: v[0] for k, v in built.items()},
    )


def engine_config(overrides: list[str]) -> EngineConfig:
    """An EngineConfig from `runtime.key=value` items (the bench command's --set)."""
    table: dict[str, Any] = {}
    for item in overrides:
        apply_override(table, item)
    if set(table) - {"runtime"}:
        raise BatchgenError("only runtime.* settings apply here, e.g. runtime.max_num_seqs=128")
    return _build_section("runtime", table.get("runtime", {}), (EngineConfig,))[0]


def _build_section(section: str, values: Any, classes: tuple[type, ...]) -> list[Any]:
    if not isinstance(values, dict):
        raise _not_a_table(section, values)
    if section == "sampling":
        try:
            values = resolve_aliases(values)
        except ValueError as exc:
            raise BatchgenError(f"[sampling] {exc}") from exc
    known = {f.name: cls for cls in classes for f in dataclasses.fields(cls)}
    for key in values:
        if key not in known:
            raise BatchgenError(
                f"unknown key {section}.{key}: [{section}] takes {', '.join(sorted(known))}"
            )
    out = []
    for cls in classes:
        hints = typing.get_type_hints(cls)
        kwargs = {
            k: _coerce(v, hints[k], f"{section}.{k}") for k, v in values.items() if known[k] is cls
        }
        try:
            out.append(cls(**kwargs))
        except ValueError as exc:
            raise BatchgenError(f"[{section}] {exc}") from exc
    return out


# list-of-strings keys that take one string as a list of one (OpenAI's `stop` is either);
# `choice` is not one of them: it is a list in every other place it is given
ONE_STRING_LISTS = ("sampling.stop", "prompt.passthrough", "model.served_model_name")


def _coerce(value: Any, hint: Any, where: str) -> Any:
    """Check value against a field's annotation; tuples come from TOML arrays."""
    options = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    for option in options:
        if option is type(None) and value is None:
            return None
        origin = typing.get_origin(option)
        if origin is tuple and isinstance(value, str) and where in ONE_STRING_LISTS:
            return (value,)  # one string where a list of strings is expected
        if where == "sampling.choice" and value == []:
            raise BatchgenError(f"{where} = []: give at least one string, or leave choice out")
        if origin is tuple and isinstance(value, list):
            item = typing.get_args(option)[0]
            if all(_is(v, item) for v in value):
                return tuple(value)
        elif origin is None and option is not type(None) and _is(value, option):
            return _finite(value, where) if option is float else value
    expected = " or ".join(_name(o) for o in options)
    raise BatchgenError(f"{where} = {value!r}: expected {expected}")


def _finite(value: float, where: str) -> float:
    """A number as a float; inf, nan or one too large for a float is an error naming the key."""
    try:
        number = float(value)
    except OverflowError:
        number = math.inf
    if not math.isfinite(number):
        raise BatchgenError(f"{where} = {value!r}: expected a finite number")
    return number


def _is(value: Any, kind: type) -> bool:
    if kind is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, kind)


def _name(kind: Any) -> str:
    if typing.get_origin(kind) is tuple:
        item = typing.get_args(kind)[0]
        plural = {int: "integers", float: "numbers", str: "strings"}.get(item, str(item))
        return "a string or a list of strings" if item is str else f"a list of {plural}"
    return {
        int: "an integer",
        float: "a number",
        bool: "true/false",
        str: "a string",
        dict: "a table",
        type(None): "nothing",
    }.get(kind, str(kind))


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value
