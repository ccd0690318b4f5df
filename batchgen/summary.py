"""What a job run reports: counts, throughput and start-up phases (summary.json holds it)."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from typing import Any

from batchgen.io.output_schema import RowCounts

COUNTS = ("rows_ok", "rows_error", "prompt_tokens", "generated_tokens")  # RowCounts' fields


def process_age_s() -> float | None:
    """Seconds since this process started (Linux: /proc), None where unknown. The CLI reports
    it as the "process" start-up phase: interpreter start, imports, reading the job spec."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()  # after the command name: field 3 on
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return round(uptime - int(fields[19]) / os.sysconf("SC_CLK_TCK"), 3)  # field 22
    except (OSError, ValueError, IndexError):
        return None


@dataclass(frozen=True)
class JobSummary:
    """A job after one of its runs. rows_ok, rows_error, prompt_tokens, generated_tokens and
    rows_committed_total are the job's: every committed row, whichever run wrote it (as one
    uninterrupted run would count them); rows_ok and rows_error count output rows (n per input
    row that ran), rows_committed_total input rows. The run_* counts, the prefix cache's,
    wall_s, the rates and the start-up phases are this run's."""

    rows_ok: int
    rows_error: int
    prompt_tokens: int  # of the samples the engine ran (not of prompts it refused)
    generated_tokens: int
    run_rows_ok: int
    run_rows_error: int
    run_prompt_tokens: int
    run_generated_tokens: int
    # of the prompt tokens the engine admitted in this run, those the prefix cache served
    prompt_tokens_cached: int
    prefix_cache_hit_rate: float
    wall_s: float
    rows_committed_total: int
    resumed: bool
    complete: bool
    result_file: str | None = None  # the final file, when the job completed
    error_file: str | None = None  # OpenAI Batch input: the error lines' file
    # phase -> seconds, in order; from the CLI the first is "process" (from the process's
    # start) and the phases add up to the time from process start to the first committed row
    startup_s: dict[str, float] = field(default_factory=dict)
    # an engine in a process of its own: that process's phases, whole ("process": its start
    # and imports, then the engine's). Where it began loading before the job asked for it,
    # they overlap the job's, and startup_s counts only what the job waited for
    engine_startup_s: dict[str, float] = field(default_factory=dict)
    # ranks that ran the job (data-parallel): the counts are their totals, each start-up
    # phase the slowest rank's
    world_size: int = 1

    @staticmethod
    def counts(job: RowCounts, run: RowCounts) -> dict[str, int]:
        """The count fields: the job's (its committed rows), then this run's."""
        out = {k: getattr(job, k) for k in COUNTS}
        return out | {f"run_{k}": getattr(run, k) for k in COUNTS}

    @property
    def generated_tokens_per_s(self) -> float:
        """This run's."""
        return round(self.run_generated_tokens / max(self.wall_s, 1e-9), 1)

    @property
    def rows_per_s(self) -> float:
        """This run's."""
        return round((self.run_rows_ok + self.run_rows_error) / max(self.wall_s, 1e-9), 2)

    def to_dict(self) -> dict[str, Any]:
        """summary.json's content (the error file only where the format writes one)."""
        out = asdict(self)
        out["wall_s"] = round(self.wall_s, 3)
        out["generated_tokens_per_s"] = self.generated_tokens_per_s
        out["rows_per_s"] = self.rows_per_s
        if self.error_file is None:
            del out["error_file"]
        return out
