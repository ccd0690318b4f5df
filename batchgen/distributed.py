"""One process among the ranks of a data-parallel job: its place, how the ranks meet, the
start-up steps they pass together, and its device.

torchrun (or `batchgen run --gpus N`) gives each process its place in the environment (RANK,
WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE) and where the ranks meet (MASTER_ADDR, MASTER_PORT).
They meet through torch.distributed: a key-value store (the heartbeat's, see heartbeat.py) and
a process group: gloo carries the Python objects the ranks exchange; on GPU ranks NCCL is
declared for CUDA tensors (created lazily: the engines exchange no tensor, so never).

Invariant: every start-up step all ranks pass goes through `agree`: each rank runs its part,
the outcomes are exchanged in one collective, and when any rank failed every rank raises the
same one-line error, so that no rank waits in a later collective for one that stopped. A
collective that fails (a peer died and its connections closed) or times out (a peer hangs)
raises JobStopped.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar

from batchgen.errors import BatchgenError, JobStopped, exit_words, lead_reports
from batchgen.row_share import RowShare

if TYPE_CHECKING:  # torch is imported where it is used: reading the place needs none of it
    import torch.distributed as dist

    from batchgen.engine.config import EngineConfig

LAUNCHED = "BATCHGEN_LAUNCHED"  # set in the ranks `batchgen run --gpus N` starts
RANK_CPP_LOG_LEVEL = "FATAL"  # TORCH_CPP_LOG_LEVEL in a rank unless set: no C++ log lines
RANK_EXITS = "BATCHGEN_RANK_EXITS"  # where `batchgen run --gpus N` notes its ranks' exits
STORE_PREFIX = "batchgen"
MEET_POLL_S = 0.05  # how often a rank meeting the others looks whether they have come
CONNECT_TRY_S = 1.0  # how long one try to connect to the store lasts
T = TypeVar("T")


@dataclass(frozen=True)
class Place:
    """Where this process is among the job's ranks."""

    rank: int
    world_size: int
    local_rank: int = 0  # among the ranks on this machine (its GPU)
    local_world_size: int = 1

    @property
    def share(self) -> RowShare:
        return RowShare(self.rank, self.world_size)


def place_from_env(env: dict[str, str] | os._Environ[str] = os.environ) -> Place | None:
    """This process's place when a launcher started it as a rank; None otherwise."""
    if "RANK" not in env and "WORLD_SIZE" not in env:
        return None
    names = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
    try:
        rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
        local = int(env.get("LOCAL_RANK", rank))
        local_world = int(env.get("LOCAL_WORLD_SIZE", world))
    except (KeyError, ValueError):
        found = ", ".join(f"{n}={env.get(n)!r}" for n in names)
        raise BatchgenError(
            f"the environment names no valid rank ({found}): start the ranks with torchrun, "
            "or unset RANK and WORLD_SIZE to run alone"
        ) from None
    if not (0 <= rank < world and 0 <= local < local_world):
        raise BatchgenError(
            f"RANK={rank} of WORLD_SIZE={world} (LOCAL_RANK={local} of {local_world}) is not a "
            "valid place: start the ranks with torchrun"
        )
    return Place(rank, world, local, local_world)


def engine_config(config: EngineConfig, place: Place) -> EngineConfig:
    """This rank's engine settings: its own GPU (cuda:LOCAL_RANK) for device auto or cuda, and
    its part of the machine's cores on the CPU."""
    import torch

    device = config.device
    if device in ("auto", "cuda") and torch.cuda.is_available():
        visible = torch.cuda.device_count()
        if place.local_rank >= visible:
            raise BatchgenError(
                f"rank {place.rank} is local rank {place.local_rank} but this machine shows "
                f"{visible} GPU(s): start at most {visible} ranks per machine"
            )
        device = f"cuda:{place.local_rank}"
    elif device.startswith("cuda:") and place.local_world_size > 1:
        raise BatchgenError(
            f"runtime.device={device!r} puts every rank of this machine on one GPU: use "
            "device 'auto' or 'cuda' (each rank takes the GPU of its LOCAL_RANK)"
        )
    threads = config.cpu_threads
    if threads is None and not os.environ.get("OMP_NUM_THREADS"):
        threads = max(1, len(os.sched_getaffinity(0)) // place.local_world_size - 1)
    return dataclasses.replace(config, device=device, cpu_threads=threads)


class Failure(NamedTuple):
    """Why a rank's part of a step (or of the job) failed."""

    user: bool  # an error the user can act on (BatchgenError), else a bug
    message: str  # one line

    @classmethod
    def of(cls, exc: BaseException) -> Failure:
        if isinstance(exc, BatchgenError):
            return cls(True, " ".join(str(exc).split()))
        return cls(False, f"{type(exc).__name__}: {_first_line(exc)}")


class Group:
    """The ranks of one job, met: collectives over the process group, and the store."""

    def __init__(self, place: Place, store: dist.Store) -> None:
        import torch.distributed as dist

        self.place = place
        self.store = dist.PrefixStore(STORE_PREFIX, store)

    @property
    def rank(self) -> int:
        return self.place.rank

    @property
    def world_size(self) -> int:
        return self.place.world_size

    def agree(self, fn: Callable[[], T]) -> T:
        """Every rank runs fn; each gets its own value, or every rank raises the first
        failure."""
        return self._step(fn, runs=True, send=False)

    def agree_on_root(self, fn: Callable[[], T]) -> T:
        """Rank 0 runs fn; every rank gets its value, or raises its failure."""
        return self._step(fn, runs=self.rank == 0, send=True)[0]

    def gather(self, fn: Callable[[], T]) -> list[T]:
        """Every rank runs fn; every rank gets every rank's value (by rank)."""
        return self._step(fn, runs=True, send=True)

    def _step(self, fn: Callable[[], T], runs: bool, send: bool) -> Any:
        """-> every rank's value (send) or this rank's own."""
        value: Any = None
        failure: Failure | None = None
        own: BaseException | None = None
        if runs:
            try:
                value = fn()
            except Exception as exc:
                failure, own = Failure.of(exc), exc
        items = self.exchange((failure, value if send else None))
        failed = [(k, f) for k, (f, _) in enumerate(items) if f is not None]
        if failed:
            first, why = failed[0]
            if first == self.rank and own is not None:
                if isinstance(own, BatchgenError) and self.rank != 0:
                    raise lead_reports(own)
                raise own  # an internal error: this rank's traceback, in its own log
            if why.user:
                error = BatchgenError(why.message)  # the same line on every rank
            else:
                error = JobStopped(
                    f"rank {first} stopped with an internal error ({why.message[:200]}); its "
                    "log holds the traceback"
                )
            raise error if self.rank == 0 else lead_reports(error)
        return [v for _, v in items] if send else value

    def exchange(self, item: Any) -> list[Any]:
        """all_gather_object; a peer lost (closed connection, timeout) raises JobStopped."""
        import torch.distributed as dist

        out: list[Any] = [None] * self.world_size
        try:
            dist.all_gather_object(out, item)
        except (RuntimeError, ValueError) as exc:  # DistError, gloo's connection errors
            raise JobStopped(
                f"another rank stopped before the job started ({_first_line(exc)[:200]}): run "
                "the same command again to resume"
            ) from exc
        return out


def store_address() -> str:
    """Where the ranks meet (MASTER_ADDR:MASTER_PORT), as lines name it."""
    return f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"


@contextlib.contextmanager
def joined(place: Place, timeout_s: float, cuda: bool) -> Iterator[Group]:
    """Meet the other ranks (the store at MASTER_ADDR:MASTER_PORT, then the process group);
    leave the group on exit. timeout_s bounds every wait for the others: the meeting's, and
    each collective's."""
    import torch
    import torch.distributed as dist

    store = attempt_store(_connect(place, timeout_s))
    meet(store, place, timeout_s)
    if cuda:
        torch.cuda.set_device(place.local_rank)
    backend = "cpu:gloo,cuda:nccl" if cuda else "gloo"
    try:
        dist.init_process_group(
            backend,
            store=store,
            rank=place.rank,
            world_size=place.world_size,
            timeout=timedelta(seconds=timeout_s),
        )
    except (RuntimeError, ValueError) as exc:  # DistError, gloo's enforce and timeout errors
        raise BatchgenError(
            f"rank {place.rank} could not set up the process group with the other ranks "
            f"({_first_line(exc)[:200]}): check that GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME, "
            "where set, name a network interface of this machine through which the ranks "
            "reach each other, and that WORLD_SIZE is the same on every rank"
        ) from exc
    try:
        yield Group(place, store)
    finally:
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


def _connect(place: Place, timeout_s: float) -> dist.Store:
    """The store at MASTER_ADDR:MASTER_PORT: rank 0 hosts it (unless torchrun's agent does),
    the others connect to it, in tries of CONNECT_TRY_S (between them, a rank looks whether
    another rank has exited) until timeout_s is over. It waits for no other rank: `meet`
    does."""
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    hosts = place.rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
    deadline = time.monotonic() + timeout_s
    while True:
        try_s = timeout_s if hosts else min(CONNECT_TRY_S, max(deadline - time.monotonic(), 0))
        try:
            if not addr or not port:
                raise ValueError("MASTER_ADDR and MASTER_PORT must both be set")
            return _tcp_store(addr, int(port), place.world_size, hosts, try_s, timeout_s)
        except (RuntimeError, ValueError) as exc:
            tried = not hosts and not isinstance(exc, ValueError)  # tries until the deadline
            if not tried or time.monotonic() >= deadline:
                within = f" within runtime.rank_timeout_s={timeout_s:g} s" if tried else ""
                raise BatchgenError(
                    f"rank {place.rank} could not meet the other ranks at {addr}:{port}{within} "
                    f"({_first_line(exc)[:200]}): check MASTER_ADDR / MASTER_PORT, or start "
                    "the ranks with torchrun"
                ) from exc
        _peer_exited(place)


def _tcp_store(
    addr: str, port: int, world_size: int, hosts: bool, connect_s: float, timeout_s: float
) -> dist.Store:
    """A store hosted here (hosts) or a connection to it; its waits time out after
    timeout_s."""
    import torch.distributed as dist

    store = dist.TCPStore(
        addr,
        port,
        world_size,
        is_master=hosts,
        timeout=timedelta(seconds=connect_s),
        wait_for_workers=False,
        multi_tenant=hosts,
    )
    store.set_timeout(timedelta(seconds=timeout_s))
    return store


def meet(store: dist.Store, place: Place, timeout_s: float) -> None:
    """Wait (in steps of MEET_POLL_S) until every rank has come to the store, each publishing
    its WORLD_SIZE. One that differs from this rank's (rank 0's first) raises one line naming
    it, as does the meeting's wait past timeout_s (naming the ranks that have not come)."""
    import torch.distributed as dist

    sizes = dist.PrefixStore(f"{STORE_PREFIX}/world_size", store)
    deadline = time.monotonic() + timeout_s
    try:
        sizes.set(str(place.rank), str(place.world_size))
        sizes.add("come", 1)
        while not _met(sizes, place):
            _peer_exited(place)
            if time.monotonic() > deadline:
                _not_come(sizes, place, timeout_s)
            time.sleep(MEET_POLL_S)
    except (RuntimeError, ValueError) as exc:  # the store's host is gone (rank 0 stopped)
        where = store_address()
        raise JobStopped(
            f"rank {place.rank} lost the store at {where} before the ranks met "
            f"({_first_line(exc)[:200]}): the rank that hosts it (rank 0) stopped; its lines "
            "say why"
        ) from exc


def _met(sizes: dist.Store, place: Place) -> bool:
    """Whether every rank has come (rank 0's and then every rank's WORLD_SIZE checked)."""
    if not sizes.check(["0"]):
        return False
    _same_world(place, 0, int(sizes.get("0")))
    if int(sizes.add("come", 0)) < place.world_size:
        return False
    got = sizes.multi_get([str(k) for k in range(place.world_size)])
    for k, size in enumerate(got):
        _same_world(place, k, int(size))
    return True


def _peer_exited(place: Place) -> None:
    """Raises JobStopped where `batchgen run --gpus N` noted that another of its ranks exited
    (it cannot come to the meeting any more)."""
    for rank, code in peer_exits(place.rank).items():
        raise JobStopped(
            f"rank {rank} {exit_words(code)} before the ranks met (its own lines say why), so "
            f"rank {place.rank} stops too: run the same command again once that is fixed"
        )


def peer_exits(me: int) -> dict[int, int]:
    """The other ranks `batchgen run --gpus N` saw exit: rank -> its exit status (-N: killed by
    signal N); none under another launcher."""
    folder = os.environ.get(RANK_EXITS)
    found: dict[int, int] = {}
    if not folder:
        return found
    with contextlib.suppress(OSError):  # the launcher is gone, and its folder with it
        for name in os.listdir(folder):
            if name.isdigit() and int(name) != me:
                found[int(name)] = int(Path(folder, name).read_text())
    return dict(sorted(found.items()))


def _same_world(place: Place, rank: int, world_size: int) -> None:
    if world_size != place.world_size:
        raise BatchgenError(
            f"rank {rank} has WORLD_SIZE={world_size} but rank {place.rank} has "
            f"WORLD_SIZE={place.world_size}: start every rank with the same WORLD_SIZE (torchrun "
            "sets it from --nnodes and --nproc-per-node)"
        )


def _not_come(sizes: dist.Store, place: Place, timeout_s: float) -> None:
    missing = [k for k in range(place.world_size) if not sizes.check([str(k)])]
    where = store_address()
    raise BatchgenError(
        f"rank {place.rank} could not meet the other ranks at {where}: rank(s) "
        f"{', '.join(map(str, missing))} had not come within runtime.rank_timeout_s="
        f"{timeout_s:g} s: start every rank (with the same MASTER_ADDR / MASTER_PORT and "
        "WORLD_SIZE), or start the ranks with torchrun"
    )


def attempt_store(store: dist.Store) -> dist.Store:
    """The store's keys of this attempt alone: torchrun's restarts (--max-restarts) keep its
    store, where the attempt before left its process group's addresses and its heartbeat."""
    import torch.distributed as dist

    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT") or "0"
    return dist.PrefixStore(f"attempt{attempt}", store)


def _first_line(exc: BaseException) -> str:
    """The message's first line, without the "[source.cc:553] " that gloo puts first."""
    lines = str(exc).strip().splitlines()
    return (
        re.sub(r"^\[[^\]]*\.(cc|cpp|h|hpp):\d+\]\s*", "", lines[0]) if lines else type(exc).__name__
    )
