"""`batchgen run --gpus N`: start N ranks of the same command on this machine (what torchrun does
for one node, without torchrun).

Each rank is the same command again, with the environment torchrun would give it: RANK,
WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR=127.0.0.1 and a free MASTER_PORT (rank 0
hosts the store), OMP_NUM_THREADS=1 and TORCH_CPP_LOG_LEVEL=FATAL unless set. The ranks run in
a session of their own: each SIGINT or SIGTERM this process gets is passed on to every rank
once, so Ctrl-C stops the job and a second Ctrl-C aborts it, as for one process. A rank that
exits with an error stops the others through the heartbeat; a rank killed by a signal is not
heard from, so the others are sent SIGTERM at once (they commit and exit). Any rank still
running GRACE_S later is sent SIGTERM, and SIGKILL after GRACE_S more. The exit status is rank
0's (where a signal killed rank 0, another rank's, whose line says so). A rank whose launcher
dies (SIGKILL, which it cannot pass on) sends itself SIGTERM (`watch_launcher`): it commits and
exits instead of running on unattended, holding the output directory. The launcher notes each
rank's exit status in a folder the ranks know (RANK_EXITS): the others' heartbeat counts a rank
whose exit is noted lost at once, and a rank still waiting to meet the others stops at once,
naming it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from batchgen.distributed import LAUNCHED, RANK_CPP_LOG_LEVEL, RANK_EXITS

GRACE_S = 30.0  # how long ranks may take to stop on their own once one has failed
POLL_S = 0.1
LAUNCHER_PID = "BATCHGEN_LAUNCHER_PID"  # the launcher's pid, in each rank's environment
WATCH_S = 0.5  # how often a rank looks for its launcher


def launch(ranks: int, argv: list[str]) -> int:
    """Run `batchgen <argv>` as `ranks` ranks; -> the exit status for this process."""
    with tempfile.TemporaryDirectory(prefix="batchgen-ranks-") as exits:
        return _launch(ranks, argv, Path(exits))


def _launch(ranks: int, argv: list[str], exits: Path) -> int:
    env = {
        **os.environ,
        RANK_EXITS: str(exits),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(_free_port()),
        "WORLD_SIZE": str(ranks),
        "LOCAL_WORLD_SIZE": str(ranks),
        LAUNCHED: "1",
        LAUNCHER_PID: str(os.getpid()),
    }
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("TORCH_CPP_LOG_LEVEL", RANK_CPP_LOG_LEVEL)  # before the rank imports torch
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "batchgen", *argv],
            env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
            start_new_session=True,
        )
        for rank in range(ranks)
    ]

    def forward(signum: int, frame: Any) -> None:
        _signal_all(procs, signum)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        _wait_all(procs, exits)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        _signal_all(procs, signal.SIGKILL)
    return _job_status([p.returncode for p in procs])


def _job_status(codes: list[int]) -> int:
    """Rank 0's exit status; where rank 0 was killed by a signal, that of the first rank that
    stopped on its own (its line names rank 0's end), else 128 + the signal."""
    code = codes[0]
    if code >= 0:
        return code
    return next((c for c in codes[1:] if c > 0), 128 - code)


def watch_launcher() -> None:
    """In a rank this launcher started: SIGTERM to itself once the launcher is gone (its parent
    is no longer the launcher), from a daemon thread."""
    launcher = int(os.environ.get(LAUNCHER_PID, "0"))
    if not launcher:
        return

    def watch() -> None:
        while os.getppid() == launcher:
            time.sleep(WATCH_S)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="batchgen-launcher-watch", daemon=True).start()


def _wait_all(procs: list[subprocess.Popen], exits: Path | None = None) -> None:
    failed_at: float | None = None  # when a rank first exited with an error
    termed_at: float | None = None  # when the others were sent SIGTERM
    while _running(procs):
        codes, now = [p.returncode for p in procs], time.monotonic()
        if exits is not None:
            _note_exits(codes, exits)
        if termed_at is None:
            if any(c for c in codes) and failed_at is None:
                failed_at = now
            killed = any(c is not None and c < 0 for c in codes)
            if killed or (failed_at is not None and now - failed_at > GRACE_S):
                _signal_all(procs, signal.SIGTERM)
                termed_at = now
        elif now - termed_at > GRACE_S:
            _signal_all(procs, signal.SIGKILL)
        time.sleep(POLL_S)


def _running(procs: list[subprocess.Popen]) -> bool:
    """Polls every rank (each poll records its exit status); -> whether any still runs."""
    return [p.poll() for p in procs].count(None) > 0


def _note_exits(codes: list[int | None], exits: Path) -> None:
    """Each rank's exit status, once it has one, in the file named by its rank (written whole
    under another name first: a rank reads it complete or not at all)."""
    for rank, code in enumerate(codes):
        note = exits / str(rank)
        if code is not None and not note.exists():
            (exits / f".{rank}").write_text(str(code))
            os.replace(exits / f".{rank}", note)


def _signal_all(procs: list[subprocess.Popen], signum: int) -> None:
    for p in procs:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):  # it has just exited
                p.send_signal(signum)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
