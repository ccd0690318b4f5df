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


def test_the_ranks_of_a_data_parallel_run_are_one_run_and_rank_0_is_reported(
    tmp_path: Path, monkeypatch
) -> None:
    """Each rank writes its own records, named with the run's shared name: they are listed
    together in rank order (not by pid), and `report` takes rank 0's of the newest run and
    names the other ranks apart from other runs."""
    from batchgen.io.layout import new_run_name, run_of
    from batchgen.profile.report import _others, find_run

    layout = OutputLayout(tmp_path)
    now = time.time()
    monkeypatch.setattr(time, "time", lambda: now - 60)  # a run a minute before
    older = _profiled_run(layout)
    alone = older.replace(f"-{os.getpid()}-", "-")  # a run alone: its name is its token's
    monkeypatch.setattr(time, "time", lambda: now)
    name = new_run_name()
    tokens = {}
    for rank, pid in ((1, 100), (0, 999), (2, 5)):  # pids sort unlike ranks
        monkeypatch.setattr(os, "getpid", lambda pid=pid: pid)
        tokens[rank] = ShardWriter(layout, "jsonl", BASE, 10, 3600, rank=rank, run=name).token
        layout.profile_steps(tokens[rank]).write_bytes(b"")
    assert {run_of(t) for t in tokens.values()} == {(name, 0), (name, 1), (name, 2)}
    assert run_of(older) == (alone, None)
    assert layout.profile_runs() == [older, tokens[0], tokens[1], tokens[2]]
    assert find_run(tmp_path, None) == layout.profile_steps(tokens[0])
    lines = _others(layout.profile_runs(), tokens[0])
    assert (
        f"this is rank 0 of a data-parallel run; its other ranks' records: {tokens[1]}" in lines[0]
    )
    assert lines[1] == "1 other run(s) recorded here: choose one with --run"
    assert _others(layout.profile_runs(), older) == [
        "1 other run(s) recorded here: choose one with --run"
    ]
