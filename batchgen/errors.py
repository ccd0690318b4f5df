"""Errors a user can cause and act on: the CLI prints them as one line."""


class BatchgenError(Exception):
    """A problem with what the user asked for: the message says what was wrong and what to do."""


def check_field(ok: bool, name: str, value: object, allowed: str) -> None:
    """A config field's rule: ValueError "name=value is not allowed: use allowed" unless ok.
    (Config dataclasses call it in __post_init__; the spec loader adds the section.)"""
    if not ok:
        raise ValueError(f"{name}={value!r} is not allowed: use {allowed}")


class JobStopped(BatchgenError):
    """Another rank of a data-parallel job stopped (or was lost), so this one stopped too: the
    message names it; the committed rows are kept and the same command resumes (exit 1)."""


def first_line(exc: BaseException) -> str:
    """An exception as one short line for a user's message: its type and first line."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0][:300]}" if lines else type(exc).__name__
