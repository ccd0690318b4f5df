"""The `batchgen` command line. Options map onto the spec's dataclasses; defaults live there."""

from __future__ import annotations

import functools
import json
import os
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

import click

from batchgen.__main__ import INTERRUPTED
from batchgen.errors import BatchgenError, JobStopped, lead_reports
from batchgen.home import logs_dir
from batchgen.process_start import heavy_imports, prepare_imports

EXIT_INCOMPLETE = 1  # the job ended with rows not committed
EXIT_USER_ERROR = 2  # a bad spec, input, path or environment: one line says what to do
EXIT_INTERNAL_ERROR = 70  # a bug: one line and the path of a log file with the traceback
# Shortcut options -> spec keys (a shortcut is the same as --set key=value).
SHORTCUTS = {
    "model": "model.path",
    "input": "input.path",
    "input_format": "input.format",
    "output": "output.dir",
    "output_format": "output.format",
    "prompt_column": "prompt.column",
    "template": "prompt.template",
    "messages_column": "prompt.messages_column",
    "max_new_tokens": "sampling.max_new_tokens",
    "temperature": "sampling.temperature",
}


def _fail(exc: BaseException) -> None:
    from batchgen.distributed import LAUNCHED

    if not (getattr(exc, "lead_reports", False) and os.environ.get(LAUNCHED)):
        click.echo(f"batchgen: error: {_one_line(str(exc))}", err=True)
    sys.exit(EXIT_INCOMPLETE if isinstance(exc, JobStopped) else EXIT_USER_ERROR)


def _reports() -> bool:
    """Whether this process says why the command stopped: not a rank other than 0 started
    by `--gpus` (their launcher's terminal is rank 0's; under torchrun every rank says it)."""
    from batchgen.distributed import LAUNCHED, place_from_env

    if not os.environ.get(LAUNCHED):
        return True
    place = place_from_env()
    return place is None or place.rank == 0


def _one_line(text: str) -> str:
    return " ".join(text.split()).encode("utf-8", "backslashreplace").decode("utf-8")


def _guarded(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Every command: a user error is one line (exit 2); anything unexpected is one line with
    the path of a log file holding the traceback (exit 70); nothing is shown raw."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except BatchgenError as exc:
            _fail(exc)
        except KeyboardInterrupt:  # only a run has rows to keep
            if _reports():
                click.echo(f"\n{ABORTED if fn.__name__ == 'run' else INTERRUPTED}", err=True)
            sys.exit(128 + signal.SIGINT)
        except (click.exceptions.Exit, click.ClickException, SystemExit):
            raise
        except Exception as exc:
            log = _write_crash_log()
            click.echo(
                f"batchgen: internal error ({type(exc).__name__}: {_one_line(str(exc))[:200]}); "
                f"this is a bug: the traceback is in {log}",
                err=True,
            )
            sys.exit(EXIT_INTERNAL_ERROR)

    return wrapper


def _write_crash_log() -> str:
    text = traceback.format_exc()
    for folder in (logs_dir(), Path(tempfile.gettempdir()) / "logs"):
        try:
            path = folder / f"crash-{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}.log"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(" ".join(sys.argv) + "\n\n" + text, errors="backslashreplace")
            return str(path)
        except OSError:
            continue
    return "(no writable folder for a log)"


def _spec_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    options = [
        click.argument("job", required=False, type=click.Path(dir_okay=False)),
        click.option(
            "--set",
            "sets",
            multiple=True,
            metavar="SECTION.KEY=VALUE",
            help="Override one spec value (repeatable), e.g. sampling.temperature=0.7",
        ),
        click.option("--model", help="Model folder, hub id or 'default'."),
        click.option("--input", help="Input file, glob, directory, saved dataset or hub name."),
        click.option(
            "--input-format",
            "--format",
            "input_format",
            help="auto, parquet, jsonl, arrow, hub or openai-batch (OpenAI Batch request lines).",
        ),
        click.option("--output", help="Output directory (the checkpoint)."),
        click.option("--output-format", help="parquet or jsonl."),
        click.option("--prompt-column", help="Text column holding the prompt."),
        click.option("--template", help="Prompt template over columns, e.g. 'Q: {question}'."),
        click.option("--messages-column", help="Column of chat messages."),
        click.option("--max-new-tokens", type=int),
        click.option("--temperature", type=float),
    ]
    for option in reversed(options):
        fn = option(fn)
    return fn


def _load(
    job: str | None, sets: tuple[str, ...], shortcuts: dict[str, Any], flags: tuple[str, ...] = ()
) -> Any:
    """The spec from the job file, --set items, shortcut options and on/off flags (`flags`:
    "quiet", "profile": runtime.<flag> = true), each named as given where two say one key."""
    from batchgen.spec import check_distinct_overrides, load_spec

    check_distinct_overrides(list(sets))
    values = {
        key: shortcuts[name] for name, key in SHORTCUTS.items() if shortcuts.get(name) is not None
    }
    options = {key: "--" + name.replace("_", "-") for name, key in SHORTCUTS.items()}
    for flag in flags:
        values[f"runtime.{flag}"], options[f"runtime.{flag}"] = True, f"--{flag}"
    return load_spec(job, list(sets), values, options)


class _OneLineErrors(click.Group):
    """Click's own usage errors (an unknown option or command, a value out of range) as one
    line, like every other error of the command line: what was wrong and where the help is."""

    def main(self, *args: Any, standalone_mode: bool = True, **kwargs: Any) -> Any:
        if not standalone_mode:
            return super().main(*args, standalone_mode=False, **kwargs)
        try:
            code = super().main(*args, standalone_mode=False, **kwargs)
        except click.UsageError as exc:
            if isinstance(exc, getattr(click.exceptions, "NoArgsIsHelpError", ())):
                exc.show()  # no command given: the help, as click shows it
                sys.exit(exc.exit_code)
            where = exc.ctx.command_path if exc.ctx is not None else "batchgen"
            message = exc.format_message().rstrip(".")
            click.echo(f"batchgen: error: {_one_line(message)} (see {where} --help)", err=True)
            sys.exit(exc.exit_code)
        except click.ClickException as exc:
            click.echo(f"batchgen: error: {_one_line(exc.format_message())}", err=True)
            sys.exit(exc.exit_code)
        except click.Abort:
            click.echo(INTERRUPTED, err=True)
            sys.exit(128 + signal.SIGINT)
        sys.exit(code if isinstance(code, int) else 0)


@click.group(cls=_OneLineErrors)
def main() -> None:
    """Offline batch generation with a continuous-batching engine."""
    prepare_imports()  # before any command imports torch


@main.command()
@_spec_options
@click.option("--quiet", is_flag=True, help="No progress bar.")
@click.option(
    "--force-resume", is_flag=True, help="Resume an output directory whose job spec differs."
)
@click.option(
    "--gpus",
    type=click.IntRange(min=1),
    help="Start N ranks on this machine, one per GPU, that share the rows (without GPUs: N "
    "CPU processes). Under torchrun, leave it out.",
)
@click.option(
    "--profile",
    is_flag=True,
    help="Record every engine step into OUTPUT/profile/ (see them with `batchgen report`).",
)
@_guarded
def run(
    job: str | None,
    sets: tuple[str, ...],
    quiet: bool,
    force_resume: bool,
    gpus: int | None,
    profile: bool,
    **shortcuts: Any,
) -> None:
    """Run JOB (a TOML spec) or a job given by options; resumes where it stopped. Under
    torchrun, each process is one rank of a data-parallel job."""
    from batchgen.distributed import LAUNCHED, RANK_CPP_LOG_LEVEL, place_from_env

    place = place_from_env()
    if gpus is not None and place is not None and not os.environ.get(LAUNCHED):
        raise BatchgenError("--gpus starts the ranks itself: leave it out under torchrun")
    if gpus is not None and gpus > 1 and place is None:
        from batchgen.launch import launch

        sys.exit(launch(gpus, sys.argv[1:]))
    if os.environ.get(LAUNCHED):
        from batchgen.launch import watch_launcher

        watch_launcher()
    lead = place is None or place.rank == 0  # the rank that reports the job
    if place is not None:  # before torch loads: its C++ log lines (a peer's closed socket, a
        # store it cannot reach, each with a stack) would bury the line that says which rank
        # stopped and why; =WARNING shows them
        os.environ.setdefault("TORCH_CPP_LOG_LEVEL", RANK_CPP_LOG_LEVEL)
    flags = (("quiet",) if quiet else ()) + (("profile",) if profile else ())
    server = _start_engine_server(place)  # before the spec: its imports start at once
    try:
        try:
            spec = _load(job, sets, shortcuts, flags)
        except BatchgenError as exc:  # every rank reads the same spec: rank 0 says what is wrong
            raise exc if lead else lead_reports(exc) from None
        server = _early_engine_server(spec, place, server)
        stop = threading.Event()
        received: list[int] = []
        with _stop_on_signals(stop, received, echo=lead):
            result = _run(spec, place, force_resume, stop, server)
    except BatchgenError as exc:
        _fail(exc)
    finally:
        if server is not None:
            server.close()
    if lead:
        click.echo(json.dumps(result.summary.to_dict(), indent=2))
    if result.stopped_by is not None:
        click.echo(
            f"batchgen: error: {result.stopped_by}: the committed rows are kept in "
            f"{spec.output.dir}; run the same command again to resume",
            err=True,
        )
        sys.exit(EXIT_INCOMPLETE)
    if not lead:
        sys.exit(_exit_code(result, received))
    if result.profile_file is not None:
        each = " (rank 0's; each rank writes its own)" if result.summary.world_size > 1 else ""
        click.echo(
            f"batchgen: step records in {result.profile_file}{each}: "
            f"batchgen report {spec.output.dir}",
            err=True,
        )
    if not result.interrupted and not result.complete:
        committed = result.rows_committed
        click.echo(
            f"batchgen: error: the job ended with rows not committed ({committed} are in "
            f"{spec.output.dir}): run the same command again to finish it",
            err=True,
        )
        sys.exit(EXIT_INCOMPLETE)
    if result.interrupted:
        click.echo(
            f"batchgen: interrupted; {result.rows_committed} rows are committed in "
            f"{spec.output.dir}. Run the same command again to resume.",
            err=True,
        )
        sys.exit(128 + (received[0] if received else signal.SIGINT))


def _start_engine_server(place: Any) -> Any:
    """Before the job's spec is read: the process a job's engine gets where one is likely
    (a GPU is visible, one process runs the job). It starts importing torch and the engine at
    once (its imports are the longest part of a job's start-up); _early_engine_server asks it
    for the model, or closes it where the spec keeps the engine here."""
    from batchgen.engine.remote.client import EngineServer
    from batchgen.engine.remote.placement import gpu_visible

    if (place is not None and place.world_size > 1) or not gpu_visible():
        return None
    return EngineServer()


def _early_engine_server(spec: Any, place: Any, started: Any) -> Any:
    """A job whose engine gets a process of its own takes the one started before its spec
    (else starts it now) and asks it for the job's model: it imports torch and the engine and
    loads the model while this one imports the job's modules and checks the job. The job
    takes the loaded engine if it asks for the same (EngineProcess); a job that stops first
    (a bad input, an output from another job) closes it unused, before any output is
    written. Any other job closes `started`."""
    from batchgen.engine.model_path import DEFAULT_MODEL, resolve_model_path
    from batchgen.engine.remote.client import EngineServer, load_key
    from batchgen.engine.remote.placement import gpu_visible, keep_process_off

    cuda = spec.engine.device != "cpu" and gpu_visible()
    one = place is None or place.world_size == 1
    if not one or not spec.pipeline.own_engine_process(cuda):
        if started is not None:
            started.close()
        return None
    server = started or EngineServer()
    # the job's engine_cores decision, made once: after the next line this process's own
    # affinity no longer holds the cores kept for the engine (the job takes server.cpus)
    server.cpus = spec.engine_cores(os.sched_getaffinity(0))
    keep_process_off(server.cpus)  # this process's threads, and those it starts, leave them
    if spec.model.path != DEFAULT_MODEL:  # the default is built (once) by the job's process
        try:
            source = resolve_model_path(spec.model.path)
        except BatchgenError:
            return server  # the job says what is wrong with it, in its own order
        server.load(load_key(source, spec.engine, spec.pipeline.quiet, None), server.cpus)
    return server


def _run(spec: Any, place: Any, force_resume: bool, stop: threading.Event, server: Any) -> Any:
    """The job alone, or this process's rank of it (a place in a world of several)."""
    if place is None or place.world_size == 1:
        with heavy_imports():
            from batchgen.job import run_job
        from batchgen.summary import process_age_s

        return run_job(
            spec, force_resume=force_resume, stop=stop, process_s=process_age_s(),
            engine_server=server,
        )  # fmt: skip
    import torch

    from batchgen.data_parallel import run_ranks
    from batchgen.distributed import joined
    from batchgen.summary import process_age_s

    cuda = spec.engine.device != "cpu" and torch.cuda.is_available()
    with joined(place, spec.pipeline.rank_timeout_s, cuda) as group:
        process_s = process_age_s()  # meeting the other ranks included
        return run_ranks(spec, group, force_resume=force_resume, stop=stop, process_s=process_s)


def _exit_code(result: Any, received: list[int]) -> int:
    """A quiet rank's exit status: the one the reporting rank exits with."""
    if result.interrupted:
        return 128 + (received[0] if received else signal.SIGINT)
    return 0 if result.complete else EXIT_INCOMPLETE


@main.command()
@_spec_options
@click.option(
    "--force-resume", is_flag=True, help="Check as `run --force-resume` would run the job."
)
@_guarded
def validate(job: str | None, sets: tuple[str, ...], force_resume: bool, **shortcuts: Any) -> None:
    """Check JOB, its input, model path and output directory without loading the model or
    writing anything; print the resolved spec."""
    from batchgen.formats import input_format
    from batchgen.job import (
        check_job,
        check_model_before_load,
        check_output_dir_before_lock,
        check_tokenizer_before_load,
        file_model_defaults,
        model_defaults_line,
    )

    spec = _load(job, sets, shortcuts)
    source = check_job(spec)
    check_model_before_load(spec)
    check_tokenizer_before_load(spec)
    check_output_dir_before_lock(spec, source, force_resume)
    click.echo(json.dumps(spec.to_dict(), indent=2))
    taken = file_model_defaults(spec)
    if taken:  # the spec above is the job's; the run takes these too
        click.echo(f"batchgen: {model_defaults_line(taken, 'the run takes')}", err=True)
    click.echo(f"ok: {input_format(spec.input.format).report(spec, source)}", err=True)


@main.command()
@click.argument("out_dir", type=click.Path())
@click.option(
    "--out",
    type=click.Path(file_okay=False),
    help="Folder for the timeline PNG and the trace (default: OUT_DIR/profile).",
)
@click.option("--run", "run_token", help="The run to report (default: the newest profiled one).")
@click.option(
    "--top", type=click.IntRange(min=0), default=10, show_default=True, help="Largest gaps to list."
)
@_guarded
def report(out_dir: str, out: str | None, run_token: str | None, top: int) -> None:
    """Idle time per cause of a job run with --profile, its largest gaps, a timeline picture
    and a Chrome trace."""
    from batchgen.io.fs import scheme_of
    from batchgen.profile.report import write_report

    if scheme_of(out_dir):
        raise BatchgenError(
            f"batchgen report reads a local output directory, not {out_dir}: copy its "
            "profile/ folder to a local OUT_DIR/profile (e.g. aws s3 cp --recursive) and "
            "report on OUT_DIR"
        )
    result = write_report(Path(out_dir), None if out is None else Path(out), run_token, top)
    click.echo(result.text)


@main.group()
def model() -> None:
    """The embedded default model."""


@model.command("build-default")
@_guarded
def build_default() -> None:
    """Build the embedded tiny model (deterministic, offline) and print its folder."""
    from batchgen.models import default_model_path

    click.echo(default_model_path())


ABORTED = "batchgen: aborted; committed rows are kept: run again to resume"


def _abort(echo: bool = True) -> NoReturn:
    """Leave at once, as SIGKILL would: committed shards are whole, a rerun redoes the rest.
    Not by raising KeyboardInterrupt from the handler: where that lands in a weakref callback
    or a __del__, Python prints it as a traceback and carries on. echo: say so (the ranks of
    a job but the one that reports it leave quietly)."""
    if echo:
        sys.stderr.write(f"\n{ABORTED}\n")
        sys.stderr.flush()
    os._exit(128 + signal.SIGINT)


class _stop_on_signals:
    """SIGINT/SIGTERM set `stop` (finish the step, commit, exit); a second SIGINT aborts."""

    def __init__(self, stop: threading.Event, received: list[int], echo: bool = True) -> None:
        self.stop, self.received, self.echo = stop, received, echo
        self.previous: dict[int, Any] = {}

    def _handle(self, signum: int, frame: Any) -> None:
        if self.stop.is_set() and signum == signal.SIGINT:
            _abort(self.echo)
        self.received.append(signum)
        self.stop.set()
        if self.echo:
            again = " (Ctrl-C again to abort)" if signum == signal.SIGINT else ""
            click.echo(f"\nbatchgen: stopping after the step in flight{again}", err=True)

    def __enter__(self) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            self.previous[sig] = signal.signal(sig, self._handle)

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)


@main.command()
@click.option("--shape", type=click.Choice(["8b", "1b"]), default="1b", show_default=True)
@click.option(
    "--workload", type=click.Choice(["W1", "W2", "W3", "W4"]), default="W1", show_default=True
)
@click.option(
    "--systems",
    default="overlap,sync,hf-static,hf-batch",
    show_default=True,
    help="Comma-separated: overlap, sync, hf-static, hf-batch.",
)
@click.option(
    "--requests", type=click.IntRange(min=1), help="Run fewer requests than the workload has."
)
@click.option(
    "--job",
    "job_rows",
    type=click.IntRange(min=1),
    metavar="ROWS",
    help="Instead: the full job path (text Parquet -> shards) against the engine alone on the "
    "same ROWS text prompts (workload's prompt lengths and output tokens; --new-tokens).",
)
@click.option("--new-tokens", type=click.IntRange(min=1), help="With --job: output tokens per row.")
@click.option(
    "--prefix-caching",
    type=click.Choice(["on", "off", "both"]),
    help="Prefix caching for the batchgen runs; both = each loop with and without it "
    "(default: runtime.enable_prefix_caching, on).",
)
@click.option(
    "--set",
    "sets",
    multiple=True,
    metavar="runtime.KEY=VALUE",
    help="Engine settings, e.g. runtime.max_num_seqs=128.",
)
@click.option(
    "--precisions",
    default="bf16",
    show_default=True,
    help="Comma-separated, of bf16, fp8 (FP8 weights), fp8-kv (FP8 weights and KV cache): "
    "each batchgen loop runs once per precision on the same prompts.",
)
@click.option(
    "--results",
    type=click.Path(dir_okay=False),
    default="benchmarks/RESULTS.md",
    show_default=True,
    help="Markdown file the table is appended to.",
)
@_guarded
def bench(
    shape: str,
    workload: str,
    systems: str,
    requests: int | None,
    job_rows: int | None,
    new_tokens: int | None,
    prefix_caching: str | None,
    sets: tuple[str, ...],
    precisions: str,
    results: str,
) -> None:
    """Time batchgen against Hugging Face on a random-weight model (needs a GPU)."""
    from batchgen.bench.run import (
        BENCH_SETTINGS,
        PRECISIONS,
        SYSTEMS,
        record,
        run_bench,
        run_job_bench,
        table,
    )
    from batchgen.spec import engine_config

    command = "batchgen bench " + " ".join(sys.argv[2:])
    sets = (*BENCH_SETTINGS, *sets)  # a --set may say otherwise
    _bench_options_apply(job_rows is not None)
    out = _results_file(results)  # before the run: its table is never lost to the path
    if job_rows is not None:
        try:
            text = run_job_bench(shape, workload, job_rows, new_tokens, engine_config(list(sets)))
        except BatchgenError as exc:
            _fail(exc)
        click.echo(text)
        record(f"job path, {shape}", text, out, command)
        return
    try:
        chosen = tuple(s.strip() for s in systems.split(",") if s.strip())
        unknown = [s for s in chosen if s not in SYSTEMS]
        if unknown or not chosen:
            what = f"unknown system {unknown[0]!r}" if unknown else f"no system in {systems!r}"
            raise BatchgenError(f"{what}: use {', '.join(SYSTEMS)}")
        if prefix_caching and any("enable_prefix_caching" in s for s in sets):
            raise BatchgenError(
                "--prefix-caching and --set runtime.enable_prefix_caching: give one"
            )
        wanted = tuple(p.strip() for p in precisions.split(",") if p.strip())
        bad = [p for p in wanted if p not in PRECISIONS]
        if bad or not wanted:
            raise BatchgenError(
                f"unknown precision {bad[0] if bad else precisions!r}: use {', '.join(PRECISIONS)}"
            )
        config = engine_config(list(sets))
        report = run_bench(shape, workload, chosen, config, requests, prefix_caching, wanted)
    except BatchgenError as exc:
        _fail(exc)
    text = table(report)
    click.echo(text)
    record(f"{report['shape']} {report['workload']}", text, out, command)


def _bench_options_apply(job: bool) -> None:
    """Options given on the command line that the chosen bench does not use: one line (the
    job-path bench times one system, in bf16, on its own rows; the others, no --new-tokens)."""
    context = click.get_current_context()
    given = [
        name for name in context.params
        if context.get_parameter_source(name) is click.core.ParameterSource.COMMANDLINE
    ]  # fmt: skip
    loops_only = ("systems", "precisions", "prefix_caching", "requests")
    unused = (
        [n for n in given if n in loops_only] if job else [n for n in given if n == "new_tokens"]
    )
    if unused:
        option = "--" + unused[0].replace("_", "-")
        where = "does not apply to --job" if job else "goes with --job"
        _fail(BatchgenError(f"{option} {where}: leave it out (see batchgen bench --help)"))


def _results_file(given: str) -> Any:
    """The bench's --results file, checked before the run (nothing made yet): a file that can
    be written, or one whose folder can be made; one line where not."""
    path = Path(given)
    if not given:
        _fail(BatchgenError("--results is empty: give the Markdown file to append the table to"))
    target = path.absolute()
    existing = target
    while not existing.exists():
        existing = existing.parent
    if existing == target:
        ok = target.is_file() and os.access(target, os.W_OK)
    else:
        ok = existing.is_dir() and os.access(existing, os.W_OK)
    if not ok:
        _fail(BatchgenError(f"--results {given!r} cannot be written: give another file"))
    return path
