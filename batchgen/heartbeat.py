"""How the ranks of a data-parallel job follow each other while they generate, and how they
end together.

Only over the group's key-value store, never a collective, so that a rank that died cannot
block the others. Each rank runs a thread that, every BEAT_S:
- publishes its beat: a counter and its progress so far (rank 0 sums every rank's progress
  for the one progress bar);
- reads every rank's beat: a rank whose counter has not moved for `timeout_s` is lost (dead,
  or hung), as is one whose exit `batchgen run --gpus N` noted (at once); the first rank to
  see a loss, to fail or to be interrupted announces it under `stop`, and every rank that
  reads `stop` sets its job's stop event (the step in flight finishes, the rows done are
  committed). A rank lost after it ended (its beat says so: its
  rows are committed) stops no one.
A store call has no time limit of its own (a frozen host never answers), so a second thread
watches the first: a step that has not ended within `timeout_s` is the store lost.
At the end every rank publishes its RankEnd; rank 0 waits for every rank's end (or its loss),
writes the final file and the summary, and publishes the outcome; every other rank waits for
it (or rank 0's loss), acknowledges it and leaves; rank 0 leaves once every rank not lost has
acknowledged, so that a store rank 0 hosts outlives its readers.
"""

from __future__ import annotations

import os
import pickle
import threading
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import torch.distributed as dist

from batchgen.distributed import RANK_EXITS, Failure, Group, peer_exits, store_address
from batchgen.errors import exit_words

BEAT_S = 0.5  # how often a rank publishes its beat and reads the others'
EXIT_NOTE_S = 5.0  # how long a rank that lost the store waits for the launcher's note of rank 0
WAIT_POLL_S = 0.2  # the main thread's wait, in steps that let it take signals


class Progress(NamedTuple):
    """A rank's counts in this run so far."""

    rows_ok: int = 0
    rows_error: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    admitted_prompt_tokens: int = 0  # the prefix cache's counts (CacheStats)
    cached_prompt_tokens: int = 0

    def __add__(self, other: Progress) -> Progress:  # type: ignore[override]
        return Progress(*(a + b for a, b in zip(self, other, strict=True)))

    @property
    def rows(self) -> int:
        return self.rows_ok + self.rows_error


def total(progress: list[Progress]) -> Progress:
    out = Progress()
    for p in progress:
        out = out + p
    return out


class RankEnd(NamedTuple):
    """How one rank's part of the run ended."""

    rank: int
    read_all: bool  # it read the whole input and was not stopped
    failure: Failure | None  # its pipeline raised
    progress: Progress
    startup_s: dict[str, float]


class Beat(NamedTuple):
    """What a rank publishes every BEAT_S."""

    count: int  # moves on every beat: a rank whose count stays put is lost
    progress: Progress
    ended: bool  # its RankEnd is published: its rows are committed


class Stop(NamedTuple):
    """Why every rank stops: announced once, by the first rank to know."""

    rank: int  # the rank that stopped (or was lost); -1: the group's store was lost
    why: str  # one line naming it
    failure: Failure | None = None


def _store_lost(me: int, exc: Exception) -> Stop:
    """Why the store went: rank 0's exit where `batchgen run --gpus N` notes it (its launcher
    notes an exit within a poll; waited for up to EXIT_NOTE_S), else the store's own error."""
    deadline = time.monotonic() + EXIT_NOTE_S
    while os.environ.get(RANK_EXITS):
        code = peer_exits(me).get(0)
        if code is not None:
            return Stop(0, f"rank 0 {exit_words(code)}")
        if time.monotonic() > deadline:
            break
        time.sleep(0.05)
    lines = str(exc).strip().splitlines()
    where = store_address()
    return Stop(
        -1,
        f"lost the job's store at {where} ({(lines or [type(exc).__name__])[0][:200]}): "
        "rank 0, or the torchrun that hosts the store, stopped",
    )


def _store_silent(timeout_s: float) -> Stop:
    """The store has not answered for timeout_s: its host is frozen or its machine lost."""
    where = store_address()
    silent = f"its store at {where} has not answered for {timeout_s:g} s"
    if os.environ.get(RANK_EXITS):  # `batchgen run --gpus N`: rank 0 hosts the store
        return Stop(0, f"rank 0 stopped ({silent})")
    return Stop(
        -1, f"lost the job's store ({silent}): rank 0, or the torchrun that hosts it, stopped"
    )


def publish_first_beat(group: Group) -> None:
    """Before the last start-up collective: every rank's beat exists once it is passed."""
    group.store.set(f"beat/{group.rank}", pickle.dumps(Beat(0, Progress(), False)))


class Heartbeat:
    """One rank's view of the others while the job runs (see the module's docstring)."""

    def __init__(
        self,
        group: Group,
        stop: threading.Event,
        timeout_s: float,
        progress: Callable[[], Progress],
        on_beat: Callable[[list[Progress]], None] | None = None,
    ) -> None:
        self.group, self.store = group, group.store
        self.rank, self.world = group.rank, group.world_size
        self.stop = stop  # the job's: set here when another rank stops the job
        self.timeout_s = timeout_s
        self.progress = progress
        self.on_beat = on_beat
        self.stopped_by: Stop | None = None  # set before `stop` when another rank stopped it
        self.lost: set[int] = set()
        self.ends: dict[int, RankEnd] = {}  # rank 0: every rank's end read so far
        self.last: list[Progress] = [Progress()] * self.world  # every rank's latest beat
        self.outcome: Any = None  # others: what rank 0 published
        self._count = 0
        self._announced = False
        self._end: RankEnd | None = None  # to publish
        self._outcome: bytes | None = None  # rank 0: to publish
        self._sent: set[str] = set()
        self._acked: set[int] = set()
        self._counts: list[int] = [-1] * self.world
        self._seen: list[float] = [time.monotonic()] * self.world
        self._ended = threading.Event()  # rank 0: all ends known; others: the outcome known
        self._done = threading.Event()  # the loop is over
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="batchgen-heartbeat", daemon=True)
        self._stepped = time.monotonic()  # when the loop last ended a step (the store answered)
        self._watch = threading.Thread(target=self._watchdog, name="batchgen-watch", daemon=True)

    # -- the main thread's side --------------------------------------------------------------

    def start(self) -> None:
        now = time.monotonic()
        self._seen = [now] * self.world
        self._stepped = now
        self._thread.start()
        self._watch.start()

    def finish(self, end: RankEnd) -> None:
        """This rank's part is over (published by the loop; a failure stops every rank)."""
        self._end = end

    def wait_ends(self) -> dict[int, RankEnd]:
        """Rank 0: every rank's end, once each rank ended or was lost."""
        _wait(self._ended)
        return dict(self.ends)

    def publish_outcome(self, outcome: Any) -> None:
        """Rank 0: give every rank the outcome; return once all not lost have read it."""
        self._outcome = pickle.dumps(outcome)
        _wait(self._done)

    def wait_outcome(self) -> Any:
        """Other ranks: rank 0's outcome (None when rank 0 was lost)."""
        _wait(self._ended)
        return self.outcome

    def close(self) -> None:
        """Stop and join both threads: one that ended during the interpreter's exit would free
        the tensors its target holds (through `progress`) without the GIL, and abort."""
        self._closing.set()
        for thread in (self._thread, self._watch):  # the watchdog wakes when the loop ends
            if thread.is_alive():
                thread.join(timeout=5 * BEAT_S)

    # -- the thread ------------------------------------------------------------------------

    def _loop(self) -> None:
        try:
            while not self._closing.is_set() and not self._done.is_set():
                self._tick()
                self._stepped = time.monotonic()
                self._closing.wait(BEAT_S)
        except Exception as exc:  # the store is gone: its host (rank 0 or torchrun) stopped
            self._stop_by(_store_lost(self.rank, exc))
        finally:
            self._ended.set()
            self._done.set()

    def _watchdog(self) -> None:
        """The loop stuck in a store call for timeout_s: the store is lost, every wait ends."""
        while not self._done.wait(BEAT_S) and not self._closing.is_set():
            if time.monotonic() - self._stepped > self.timeout_s:
                self._stop_by(_store_silent(self.timeout_s))
                self._ended.set()
                self._done.set()

    def _tick(self) -> None:
        store, me = self.store, self.rank
        self._count += 1
        end = self._end
        if end is not None and end.failure is not None:
            self._announce(Stop(me, f"rank {me} failed", end.failure))
        self._send(f"end/{me}", None if end is None else pickle.dumps(end))  # before `ended`
        store.set(f"beat/{me}", pickle.dumps(Beat(self._count, self.progress(), end is not None)))
        self._send("outcome", self._outcome)
        beats = [pickle.loads(b) for b in store.multi_get([f"beat/{k}" for k in range(self.world)])]
        now = time.monotonic()
        for k, beat in enumerate(beats):
            if beat.count != self._counts[k]:
                self._counts[k], self._seen[k] = beat.count, now
        self.last = [b.progress for b in beats]
        on_beat = self.on_beat
        if on_beat is not None:
            on_beat(self.last)
        if self.stop.is_set() and self.stopped_by is None:
            self._announce(Stop(me, f"rank {me} was interrupted"))
        if self.stopped_by is None and not self._announced and store.check(["stop"]):
            self._stop_by(pickle.loads(store.get("stop")))
        self._find_lost(beats, now)
        if me == 0:
            self._rank0_waits()
        elif self._end is not None and not self._ended.is_set():
            if store.check(["outcome"]):
                self.outcome = pickle.loads(store.get("outcome"))
                store.set(f"ack/{me}", b"1")
                self._ended.set()
                self._done.set()
            elif 0 in self.lost:
                self._ended.set()
                self._done.set()

    def _find_lost(self, beats: list[Beat], now: float) -> None:
        """Ranks not heard from for timeout_s, or seen to exit by `batchgen run --gpus N`, are
        lost; one lost before its end stops the job."""
        exits = peer_exits(self.rank)
        for k in range(self.world):
            if k == self.rank or k in self.lost:
                continue
            if k in exits:
                why = f"rank {k} {exit_words(exits[k])}"
            elif now - self._seen[k] > self.timeout_s:
                why = f"rank {k} stopped (no word from it for {self.timeout_s:g} s)"
            else:
                continue
            self.lost.add(k)
            # a rank lost after its end (its rows committed) or after the outcome stops no one
            if not beats[k].ended and "outcome" not in self._sent:
                self._announce(Stop(k, why))
                self._stop_by(Stop(k, why))

    def _rank0_waits(self) -> None:
        store = self.store
        for k in range(self.world):
            if k not in self.ends and store.check([f"end/{k}"]):
                self.ends[k] = pickle.loads(store.get(f"end/{k}"))
        if self._end is not None and set(self.ends) | self.lost >= set(range(self.world)):
            self._ended.set()
        if "outcome" in self._sent:
            for k in range(1, self.world):
                if k not in self._acked and store.check([f"ack/{k}"]):
                    self._acked.add(k)
            if self._acked | self.lost >= set(range(1, self.world)):
                self._done.set()

    def _send(self, key: str, value: bytes | None) -> None:
        if value is not None and key not in self._sent:
            self.store.set(key, value)
            self._sent.add(key)

    def _announce(self, stop: Stop) -> None:
        """Tell every rank to stop (the first announcement stands)."""
        if self._announced:
            return
        self._announced = True
        try:
            if not self.store.check(["stop"]):
                self.store.set("stop", pickle.dumps(stop))
        except dist.DistError:
            pass  # the loop finds the store gone on its next step

    def _stop_by(self, stop: Stop) -> None:
        if self.stopped_by is None and stop.rank != self.rank:
            self.stopped_by = stop
        self.stop.set()


def _wait(event: threading.Event) -> None:
    while not event.wait(WAIT_POLL_S):
        pass
