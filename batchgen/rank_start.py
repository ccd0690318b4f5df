"""How the ranks of a data-parallel job start: three steps every rank passes together
(Group.agree: when one rank fails, every rank raises the same one-line error).

1. every rank: the checks that need no model (input, columns, model folder, its device);
   rank 0 also takes the directory's lock and compares the settings and input with the
   manifest (nothing is written yet);
2. every rank loads its engine; every rank's identity (settings, input, model) goes to rank 0;
3. rank 0: every rank must run the job rank 0 runs (the same input and model on every node)
   and the one the manifest records; it reads the committed set (under --force-resume, the
   committed rows must keep their input positions), writes the manifest, removes what killed
   writers left, and sends the committed set, with the lock's run, to every rank.
No rank writes into the output directory before step 3 is passed.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any, NamedTuple

from batchgen import distributed
from batchgen.distributed import Group
from batchgen.engine import Engine
from batchgen.engine.model_path import resolve_model_path
from batchgen.errors import BatchgenError
from batchgen.heartbeat import publish_first_beat
from batchgen.io import InputSource, OutputLayout
from batchgen.io.checkpoint import (
    IDENTITY_PARTS,
    Manifest,
    identity_changes,
)
from batchgen.io.layout import new_run_name
from batchgen.io.object_lock import OutputLock
from batchgen.io.output_schema import RowCounts
from batchgen.job import (
    check_job,
    check_model_before_load,
    check_resumable,
    load_engine,
    note_model_defaults,
    previous_run,
    result_settings,
    take_directory,
    with_model_defaults,
)
from batchgen.spec import JobSpec


class Plan(NamedTuple):
    """What rank 0 sends every rank before the rows are shared out."""

    done: set[int]  # input rows in committed shards
    resuming: bool
    run: str  # the run named in the lock file (RankLock)
    name: str  # the run's name in every rank's files (layout.new_run_name)
    num_rows: int | None  # the input's row count rank 0 saw: every rank shares rows by it
    counts: RowCounts  # the committed rows' counts before this run


class Started(NamedTuple):
    """A rank ready to generate its share."""

    spec: JobSpec  # with this rank's engine settings (its device)
    source: InputSource
    engine: Engine
    plan: Plan
    startup_s: dict[str, float]  # phase -> seconds on this rank


def start_rank(
    spec: JobSpec,
    group: Group,
    layout: OutputLayout,
    lock: OutputLock | None,
    note: Callable[[str], None],
    force: bool,
    process_s: float | None = None,
) -> Started:
    """The three steps; lock: rank 0's (None on the other ranks); process_s: the "process"
    start-up phase (from the command line)."""
    started = time.perf_counter()

    def checks() -> tuple[JobSpec, InputSource, Manifest | None]:
        mine = dataclasses.replace(spec, engine=distributed.engine_config(spec.engine, group.place))
        source = check_job(mine)
        resolve_model_path(spec.model.path)
        check_model_before_load(mine)
        previous = None
        if lock is not None:
            lock.acquire()
            previous = previous_run(layout, force)
            current = {"settings": result_settings(mine, None), "input": source.fingerprint()}
            check_resumable(layout, previous, current, ("settings", "input"), force)
        return mine, source, previous

    mine, source, previous = group.agree(checks)
    startup = {} if process_s is None else {"process": process_s}
    startup["checks"] = round(time.perf_counter() - started, 3)
    loaded: list[Engine] = []

    def load() -> dict[str, Any]:
        engine = load_engine(mine, data_parallel=True)
        loaded.append(engine)
        if engine.tokenizer is None:
            raise BatchgenError(
                f"model '{spec.model.path}' has no tokenizer: batchgen jobs need one"
            )
        settings = result_settings(mine, engine)
        return {"settings": settings, "input": source.fingerprint(), "model": engine.fingerprint}

    identities = group.gather(load)
    engine = loaded[0]
    startup |= engine.startup_s

    def prepare() -> Plan:
        assert lock is not None
        for k, other in enumerate(identities[1:], start=1):
            changes = identity_changes(other, identities[0], IDENTITY_PARTS)
            if changes:
                raise BatchgenError(
                    f"rank {k} and rank 0 do not run the same job ({changes[0]}, from rank "
                    f"{k}'s to rank 0's): give every rank the same input, model and settings"
                )
        current = identities[0]  # no rank writes before this step is passed
        resuming, committed = take_directory(spec, source, layout, previous, current, force, note)
        name = new_run_name()
        return Plan(committed.indexes, resuming, lock.run, name, source.num_rows, committed.counts)

    publish_first_beat(group)  # every rank's beat exists once the step below is passed
    plan = group.agree_on_root(prepare)
    source = dataclasses.replace(source, num_rows=plan.num_rows)  # the same on every rank
    if group.rank == 0:  # quiet or not: how the rows are sampled
        note_model_defaults(mine, engine, note)
    return Started(with_model_defaults(mine, engine), source, engine, plan, startup)
