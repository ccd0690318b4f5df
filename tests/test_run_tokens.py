"""A run's token orders its runs by when they started, whatever time zone each ran in."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from batchgen.io import OutputLayout, ShardWriter
from batchgen.io.output_schema import BASE


@pytest.fixture
def time_zone(monkeypatch):
    """Set the process's time zone (as a run on another machine, or after a DST change)."""

    def set_zone(name: str) -> None:
        monkeypatch.setenv("TZ", name)
        time.tzset()

    yield set_zone
    monkeypatch.undo()
    time.tzset()


def _profiled_run(layout: OutputLayout) -> str:
    token = ShardWriter(layout, "jsonl", BASE, 10, 3600).token
    path = layout.profile_steps(token)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"")
    return token


def test_the_newest_run_is_the_one_started_last_across_time_zones(
    tmp_path: Path, time_zone, monkeypatch
) -> None:
    layout = OutputLayout(tmp_path)
    now = time.time()
    starts = []
    for i, zone in enumerate(("Etc/GMT-14", "Etc/GMT+12", "Europe/Berlin", "UTC")):
        time_zone(zone)
        monkeypatch.setattr(time, "time", lambda at=now + 60 * i: at)
        starts.append(_profiled_run(layout))
    assert layout.profile_runs() == starts


def test_runs_named_in_local_time_are_ordered_by_their_records(tmp_path: Path) -> None:
    """Tokens written before they named UTC: still listed, oldest records first."""
    layout = OutputLayout(tmp_path)
    names = ["20260101T235900-11-aaaaaa", "20260101T100000-12-bbbbbb"]  # written in that order
    for age, name in zip((120, 60), names, strict=True):
        path = layout.profile_steps(name)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"")
        os.utime(path, (time.time() - age, time.time() - age))
    newer = _profiled_run(layout)
    assert layout.profile_runs() == [*names, newer]
