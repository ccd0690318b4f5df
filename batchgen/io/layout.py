"""The layout of an output directory. Every name under it is declared here, once.

<dir>/job.json            manifest: the job's spec and identity (what resuming must match)
<dir>/job.lock            held by the run writing the directory (pid, host)
<dir>/shards/part-<run>-<seq>-n<rows>.<ext>   committed shards: the checkpoint
<dir>/damaged/            shards found unreadable on resume, moved aside (rows regenerated)
<dir>/summary.json        the job's counts (all its committed rows), the last run's counts and rates
<dir>/results.<ext>       every committed row in input order (when the job completes; removed
                          when a later run starts, written again when it completes the job)
<dir>/errors.jsonl        OpenAI Batch error lines (openai-batch input only)
<dir>/profile/steps-<run>.parquet     per-step records of a run with --profile, one per rank
                          (never read by resuming: outside shards/)
<dir>/profile/timeline-<run>.png, trace-<run>.json    `batchgen report`'s picture and trace
.tmp-*                    a file being written atomically (never read; removed on resume)

<dir> may be an object-store URL (io/fs.py): the same names, as keys under that prefix.
"""

from __future__ import annotations

import calendar
import os
import re
import secrets
import time
from dataclasses import dataclass

from batchgen.io.fs import AnyPath, as_path, check_output_url

OUTPUT_FORMATS = ("parquet", "jsonl")
TEMP_PREFIX = ".tmp-"
SHARD_PREFIX = "part-"
PROFILE_PREFIX = "steps-"
_ROWS = re.compile(r"-n(\d+)\.[a-z]+$")
RUN_STAMP = "%Y%m%dT%H%M%S"  # a run token's start; in UTC with a "Z" after it (older: local)
_UTC_STAMP = re.compile(r"^(\d{8}T\d{6})Z-")


_TOKEN = re.compile(r"^([^-]+)-\d+(?:-r(\d+))?-([0-9a-f]+)$")


def new_run_name() -> str:
    """A run's name: its start in UTC, then a random tag ("20261130T120000Z-a1b2c3")."""
    return f"{time.strftime(RUN_STAMP, time.gmtime(time.time()))}Z-{secrets.token_hex(3)}"


def new_run_token(where: str, run: str | None = None) -> str:
    """A writer's run token: the run's name (new_run_name; the ranks of a data-parallel run
    share rank 0's) around where it writes from ("20261130T120000Z-4242-r3-a1b2c3"): unique,
    its start in UTC first, so that it orders its run whatever time zone it ran in."""
    stamp, tag = (run or new_run_name()).split("-")
    return f"{stamp}-{where}-{tag}"


def run_of(token: str) -> tuple[str, int | None]:
    """A writer's token -> (the name of its run, which the ranks of a data-parallel run share;
    its rank, None for a job run alone)."""
    match = _TOKEN.match(token)
    if match is None:
        return token, None
    return f"{match.group(1)}-{match.group(3)}", None if match.group(2) is None else int(
        match.group(2)
    )


def run_started(run_token: str) -> float | None:
    """A run's start (seconds since the epoch) as its token says, None for a token that does
    not say it in UTC (one written before tokens did)."""
    match = _UTC_STAMP.match(run_token)
    if match is None:
        return None
    return float(calendar.timegm(time.strptime(match.group(1), RUN_STAMP)))


def temp_path(path: AnyPath) -> AnyPath:
    """Where `path` is written before its atomic rename."""
    return path.with_name(f"{TEMP_PREFIX}{os.getpid()}-{path.name}")


@dataclass(frozen=True)
class OutputLayout:
    dir: AnyPath  # a Path, or an ObjectPath for an object-store URL

    def __post_init__(self) -> None:
        check_output_url(str(self.dir))
        object.__setattr__(self, "dir", as_path(self.dir))

    @property
    def manifest(self) -> AnyPath:
        return self.dir / "job.json"

    @property
    def lock(self) -> AnyPath:
        return self.dir / "job.lock"

    @property
    def summary(self) -> AnyPath:
        return self.dir / "summary.json"

    @property
    def shards(self) -> AnyPath:
        return self.dir / "shards"

    @property
    def damaged(self) -> AnyPath:
        return self.dir / "damaged"

    @property
    def profile(self) -> AnyPath:
        return self.dir / "profile"

    def profile_steps(self, run_token: str) -> AnyPath:
        return self.profile / f"{PROFILE_PREFIX}{run_token}.parquet"

    def profile_runs(self) -> list[str]:
        """Run tokens with profile records, oldest first: by the start their token names in
        UTC, or (a token in local time) by when the records were last written; a directory's
        runs never overlap (its lock), so either orders them. The ranks of a data-parallel run
        (one file each) follow each other in rank order."""
        runs = {
            p.name.removeprefix(PROFILE_PREFIX).removesuffix(".parquet"): p
            for p in self.profile.glob(f"{PROFILE_PREFIX}*.parquet")
        }

        def started(token: str) -> tuple[float, str, int, str]:
            at = run_started(token)
            name, rank = run_of(token)
            when = getattr(runs[token].stat(), "st_mtime", 0.0) if at is None else at
            return (when, name, -1 if rank is None else rank, token)

        return sorted(runs, key=started)

    @staticmethod
    def profile_timeline(folder: AnyPath, run_token: str) -> AnyPath:
        return folder / f"timeline-{run_token}.png"

    @staticmethod
    def profile_trace(folder: AnyPath, run_token: str) -> AnyPath:
        return folder / f"trace-{run_token}.json"

    def results(self, format: str) -> AnyPath:
        return self.dir / f"results.{format}"

    @property
    def openai_results(self) -> AnyPath:
        return self.dir / "results.jsonl"

    @property
    def openai_errors(self) -> AnyPath:
        return self.dir / "errors.jsonl"

    def result_files(self) -> list[AnyPath]:
        """Every name a completed job's result files may have (any format)."""
        return [*(self.results(f) for f in OUTPUT_FORMATS), self.openai_errors]

    def shard(self, run_token: str, seq: int, rows: int, format: str) -> AnyPath:
        return self.shards / f"{SHARD_PREFIX}{run_token}-{seq:06d}-n{rows}.{format}"

    @staticmethod
    def shard_rows(path: AnyPath) -> int | None:
        """The row count a shard's name declares (None for a name without one)."""
        match = _ROWS.search(path.name)
        return int(match.group(1)) if match else None

    def shard_paths(self, format: str | None = None) -> list[AnyPath]:
        """Committed shards (of one format, or both), oldest run first."""
        exts = OUTPUT_FORMATS if format is None else (format,)
        return sorted(p for ext in exts for p in self.shards.glob(f"{SHARD_PREFIX}*.{ext}"))

    def temp_files(self) -> list[AnyPath]:
        folders = (self.dir, self.shards, self.profile)
        return [p for folder in folders for p in folder.glob(f"{TEMP_PREFIX}*")]

    def holds_anything_but_leftovers(self) -> bool:
        """True when the folder holds files other than temp files and a lock."""
        if not self.dir.is_dir():
            return False
        ignore = {self.lock.name}
        return any(
            not p.name.startswith(TEMP_PREFIX) and p.name not in ignore for p in self.dir.iterdir()
        )
