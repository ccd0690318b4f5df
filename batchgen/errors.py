"""Errors a user can cause and act on: the CLI prints them as one line."""


class BatchgenError(Exception):
    """A problem with what the user asked for: the message says what was wrong and what to do.

    lead_reports: every rank of a data-parallel job raised it alike (a step they agreed on,
    the spec they all read). The ranks `batchgen run --gpus N` starts share its stderr, so
    there the command line prints it on rank 0 only and the other ranks exit with its status
    silently; under torchrun, whose ranks may each have a log of their own, every rank
    prints it.
    """

    lead_reports = False


def lead_reports(exc: BatchgenError) -> BatchgenError:
    """exc, marked as one rank 0 prints for every rank (BatchgenError.lead_reports)."""
    exc.lead_reports = True
    return exc


def exit_words(code: int) -> str:
    """A process's exit status (Popen's: -N = killed by signal N) as words: "exited with
    status 4", "was killed by SIGKILL"."""
    import signal

    if code >= 0:
        return f"exited with status {code}"
    try:
        return f"was killed by {signal.Signals(-code).name}"
    except ValueError:
        return f"was killed by signal {-code}"


def check_field(ok: bool, name: str, value: object, allowed: str) -> None:
    """A config field's rule: ValueError "name=value is not allowed: use allowed" unless ok.
    (Config dataclasses call it in __post_init__; the spec loader adds the section.)"""
    if not ok:
        raise ValueError(f"{name}={value!r} is not allowed: use {allowed}")


class JobStopped(BatchgenError):
    """A process the job runs with stopped (or was lost): another rank of a data-parallel
    job, or the job's engine process, so the job stopped too: the message names it; the
    committed rows are kept and the same command resumes (exit 1)."""


def first_line(exc: BaseException) -> str:
    """An exception as one short line for a user's message: its type and first line."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0][:300]}" if lines else type(exc).__name__
