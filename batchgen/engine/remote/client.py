"""The job's side of an engine in a process of its own.

The engine thread launches every step from Python. In a job's process the reader, tokenizer
and writer threads run Python too, and whenever one of them holds the GIL the engine thread
waits for it (up to the switch interval) while the GPU idles; vLLM and SGLang run their engine
loop apart from tokenization and detokenization for this reason. EngineProcess has
`python -m batchgen.engine.remote.server` load the model and run Engine.generate; the job's
process keeps the tokenizer, the reader and the writer. The pipes carry protocol.py's messages.

Prompts are sent ahead of the engine by at most WINDOW_SEQS x max_num_seqs not yet taken, so
the server always has some waiting while the job's queues keep their backpressure. The server
exits when its stdin closes (this process ended, even by SIGKILL), and ignores SIGINT and
SIGTERM: stopping is this side's to decide, after the step in flight is written.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import os
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Iterator
from typing import IO, TYPE_CHECKING, Any

from batchgen.engine.config import EngineConfig
from batchgen.engine.model_path import resolve_model_path
from batchgen.engine.prefix_cache import CacheStats
from batchgen.engine.remote.protocol import pack_prompt, receive, send
from batchgen.engine.sampling_params import SamplingParams
from batchgen.errors import BatchgenError, JobStopped, exit_words, first_line

if TYPE_CHECKING:  # the command line starts a server before torch is imported
    from batchgen.engine.call_inputs import CallIds
    from batchgen.engine.request import RequestOutput

WINDOW_SEQS = 2  # prompts sent and not yet taken by the engine: at most this x max_num_seqs
POLL_S = 0.05  # how often a waiting generate looks at its stop event
PROMPT_POLL_S = 0.005  # ... and at its prompt source, when that had nothing ready
CLOSE_WAIT_S = 30.0  # how long close() waits for the server to exit before killing it
# Each pipe's capacity (Linux's default is 64 KiB; an unprivileged process may set up to
# /proc/sys/fs/pipe-max-size, 1 MiB by default). When a wave of requests ends together, the
# engine thread writes all their token ids at once: 256 rows x 256 tokens pickle to ~300 KB,
# and a write larger than the pipe holds waits, the GPU idle, until the job's reader thread
# has drained the rest.
PIPE_BYTES = 1 << 20
_END = object()


def widen(pipe: IO[bytes]) -> int:
    """Give a pipe PIPE_BYTES of capacity where the system allows; -> its capacity (0 where
    it cannot be read: not Linux)."""
    if not hasattr(fcntl, "F_SETPIPE_SZ"):
        return 0
    with contextlib.suppress(OSError):  # above the system's limit: the pipe keeps its own
        fcntl.fcntl(pipe.fileno(), fcntl.F_SETPIPE_SZ, PIPE_BYTES)
    return fcntl.fcntl(pipe.fileno(), fcntl.F_GETPIPE_SZ)


class EngineServer:
    """A started server process and its pipes. It imports the engine's modules as soon as it
    starts, so a caller that starts it early (the command line, before its own imports) finds
    them imported when it asks for a model."""

    def __init__(self) -> None:
        self.cpus: frozenset[int] = frozenset()  # the cores it keeps to once loaded (its
        # starter's decision: set before load, which sends them)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        self.process = subprocess.Popen(
            [sys.executable, "-m", "batchgen.engine.remote.server"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
        )
        assert self.process.stdin is not None and self.process.stdout is not None
        for pipe in (self.process.stdin, self.process.stdout):
            widen(pipe)
        self._to = self.process.stdin
        self.inbox: queue.SimpleQueue[tuple] = queue.SimpleQueue()
        self.closed = False
        self.unreadable: str | None = None  # why an answer could not be read (then it is ended)
        self.loading: tuple | None = None  # what it was asked to load (load_key's form)
        threading.Thread(
            target=self._read, args=(self.process.stdout,), name="batchgen-engine-answers",
            daemon=True,
        ).start()  # fmt: skip

    def load(self, key: tuple, cpus: frozenset[int] = frozenset()) -> None:
        """Ask it to load a model now (see load_key): it starts as soon as its own imports
        are done, while the caller goes on; the answer waits in the pipe for EngineProcess.
        cpus: the cores it keeps to once loaded (kept_cores; empty: all it may use)."""
        self.cpus = frozenset(cpus)
        self.send(("load", *key, tuple(sorted(self.cpus))))
        self.loading = key

    def send(self, message: tuple) -> None:
        try:
            send(self._to, message)
        except (OSError, ValueError) as exc:  # the server has ended: say how
            raise self.failure(("eof",)) from exc

    def tell(self, message: tuple) -> None:
        """send, to a server that may have ended meanwhile (then its eof follows)."""
        with contextlib.suppress(OSError, ValueError):
            send(self._to, message)

    def next(self, wait: float) -> tuple | None:
        """The next message, or None when none came within `wait` seconds."""
        try:
            return self.inbox.get(timeout=wait)
        except queue.Empty:
            return None

    def expect(self, kind: str) -> tuple:
        message = self.inbox.get()
        if message[0] != kind:
            raise self.failure(message)
        return message

    def failure(self, message: tuple) -> BaseException:
        """An "error" or end-of-pipe message as the exception to raise here."""
        if message[0] == "error":
            kind, text = message[1], message[2]
            if kind == "value":
                return ValueError(text)
            if kind == "batchgen":
                return BatchgenError(text)
            failed = RuntimeError(f"the engine process failed: {text}")
            failed.add_note(f"the engine process's traceback:\n{message[3]}")  # for the log
            return failed
        if message[0] == "eof":
            self.inbox.put(message)  # every later call fails the same way
            if self.unreadable is not None:
                return RuntimeError(self.unreadable)
            code = self._wait()
            why = {-9: " (out of memory, or killed by hand)"}.get(code, "")
            how = exit_words(code) + (why if code <= 0 else " (its messages above say why)")
            return JobStopped(
                f"the engine process (pid {self.process.pid}) {how} before it finished: the "
                "committed rows are kept; run the same command again to resume"
            )
        return RuntimeError(f"unexpected message from the engine process: {message[0]!r}")

    def alive(self) -> bool:
        return not self.closed and self.process.poll() is None

    def close(self) -> None:
        """Ask the server to exit (its memory, the GPU's included, goes with it); kill it if
        it has not within CLOSE_WAIT_S."""
        if self.closed:
            return
        self.closed = True
        with contextlib.suppress(OSError, ValueError):
            send(self._to, ("close",))
        with contextlib.suppress(OSError, ValueError):
            self._to.close()
        self._wait()

    def _wait(self) -> int:
        """-> the server's exit code, once it has exited; killed if it has not within
        CLOSE_WAIT_S."""
        try:
            return self.process.wait(CLOSE_WAIT_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait()

    def _read(self, pipe: IO[bytes]) -> None:
        """The pipe from the server -> the inbox; ("eof",) once it is closed, or once an answer
        cannot be read (what it said is lost, so the server is killed and every later call
        fails saying why)."""
        try:
            while True:
                self.inbox.put(receive(pipe))
        except (EOFError, OSError):
            pass
        except Exception as exc:
            self.unreadable = (
                f"cannot read an answer from the engine process ({first_line(exc)}), so it was "
                "stopped: start a new one"
            )
            self.process.kill()
        self.inbox.put(("eof",))


class RemoteRecorder:
    """A job's step recorder for an engine in its own process: the server records the steps
    of the next generate call (profile/recorder.py there) and writes them to `path` when the
    call ends. The same attach() / close() as StepRecorder."""

    def __init__(self, engine: EngineProcess, path: Any, run: str) -> None:
        self.engine, self.path, self.run = engine, path, run
        self.outcome: tuple[str, str] | None = None  # from the call's "done"

    def attach(self) -> RemoteRecorder:
        self.engine.recorder = self
        return self

    def asked(self) -> tuple[str, str]:
        """What the generate message carries: where to write, and the run's token."""
        return (str(self.path), self.run)

    def close(self) -> Any:
        """-> the records' file, once the call has ended; RuntimeError saying why if the
        server wrote none (or the call never reached it)."""
        self.engine.recorder = None
        if self.outcome is None:
            raise RuntimeError("the engine process ended the call without its step records")
        status, detail = self.outcome
        if status != "ok":
            raise RuntimeError(detail)
        return self.path


def load_key(model: str, config: EngineConfig, quiet: bool, step_hook: str | None) -> tuple:
    """What a server is asked to load: a resolved model path (resolve_model_path), the
    engine's config, whether transformers' progress bars stay quiet, the step hook."""
    return (model, config, quiet, step_hook)


def waited_phases(
    asked: float, ready: float, began: float, phases: dict[str, float]
) -> dict[str, float]:
    """The start-up phases a caller waited for, from asking for the engine (`asked`) until it
    was ready (`ready`; time.monotonic, the same clock in both processes): each of the
    engine's phases (consecutive from `began`) counts only its part after `asked`, and
    "engine_process" is the rest of the wait (the server's start and imports, the pipes, the
    tokenizer's load). A server asked early may have done them all before: then they are 0."""
    waited: dict[str, float] = {}
    start = began
    for name, seconds in phases.items():
        end = start + seconds
        waited[name] = round(max(0.0, end - max(start, asked)), 3)
        start = end
    rest = (ready - asked) - sum(waited.values())
    return {"engine_process": round(max(0.0, rest), 3), **waited}


class EngineProcess:
    """An Engine served by a process of its own, with the part of Engine's interface a job
    uses: generate, has_unfinished, check_sampling, close, and the facts (tokenizer, config,
    dtype, max_model_len, num_blocks, fingerprint, startup_s, cache_stats).

    model: a model folder, a hub id or "default". server: an EngineServer started earlier
    (else one starts here, on `cpus`), owned by this object from now on. step_hook:
    "module:Class" of a runner step hook the server makes (a benchmark's timeline); its
    report() after each generate call is `step_report` here. Model-loading errors are raised
    here, in one line. startup_s: the start-up phases this process waited for
    (waited_phases); engine_startup_s: the server's own, whole ("process": its start and
    imports until it began loading, then the engine's phases).
    """

    def __init__(
        self,
        model: str,
        config: EngineConfig | None = None,
        *,
        quiet: bool = False,
        step_hook: str | None = None,
        server: EngineServer | None = None,
        cpus: frozenset[int] = frozenset(),
    ) -> None:
        asked = time.monotonic()  # what follows is waited for, the tokenizer's imports too
        from batchgen.engine.tokenizer_loader import load_tokenizer

        self.config = config or EngineConfig()
        self._calls = 0
        self._taken = 0  # prompts of the current generate call the engine has taken
        self._pending: dict[str, list[int] | None] = {}  # request id -> ids sent, until last
        self._generating = False  # a generate call is open (as Engine's: one at a time)
        self.cache_stats = CacheStats()
        self.step_report: dict | None = None
        self.recorder: RemoteRecorder | None = None  # the next generate call's, if it profiles
        self.server = server
        try:
            source = resolve_model_path(model)  # a missing folder fails before a process starts
            key = load_key(source, self.config, quiet, step_hook)
            early = self.server
            if (
                early is not None
                and early.loading is not None
                and (early.loading != key or early.cpus != frozenset(cpus))
            ):
                early.close()  # loading another model, config or placement: not this one's
                self.server = None
            if self.server is None:
                self.server = EngineServer()
            if self.server.loading is None:
                self.server.load(key, cpus)
            self.tokenizer = load_tokenizer(source)  # while the server loads the model
            facts = self.server.expect("ready")[1]
        except BaseException:
            if self.server is not None:
                self.server.close()
            raise
        import torch

        self.dtype = getattr(torch, facts["dtype"])
        self.max_model_len: int = facts["max_model_len"]
        self.num_blocks: int = facts["num_blocks"]
        self.vocab_size: int = facts["vocab_size"]  # prompt ids are checked against it here
        resolved = {k: facts[k] for k in ("block_size", "max_num_batched_tokens")}
        self.config = dataclasses.replace(self.config, **resolved)
        self.fingerprint = facts["fingerprint"]
        self.generation_defaults: dict[str, Any] = facts["generation_defaults"]
        self.engine_startup_s = {"process": facts["process_s"], **facts["startup_s"]}
        self.startup_s = waited_phases(asked, time.monotonic(), facts["began_at"],
                                       facts["startup_s"])  # fmt: skip

    def generate(
        self,
        prompts: Iterable[Any],
        params: Any = None,
        *,
        decode: bool = True,
        stop: Any = None,
        check_outputs: bool = True,
    ) -> Iterator[RequestOutput]:
        """Engine.generate, served (one SamplingParams per call, or None): prompts are pulled
        while the server's window has room (a source may yield NOT_READY), results yielded as
        they come back. Once `stop` is set, the server finishes the step in flight and drops
        what still runs."""
        from batchgen.engine.call_inputs import (
            CallIds,
            as_prompts,
            call_params,
            check_one_call,
            one_params,
        )
        from batchgen.engine.request import NOT_READY

        self._check_open()
        check_one_call(self._generating)
        params = one_params(call_params(params, self.generation_defaults))
        self._calls += 1
        call_id, self._taken, self._pending = self._calls, 0, {}
        recorder = self.recorder
        profile = None if recorder is None else recorder.asked()
        message = ("generate", call_id, params, decode, check_outputs, profile)
        self.server.send(message)
        window = WINDOW_SEQS * self.config.max_num_seqs
        source, sent = iter(as_prompts(prompts)), 0
        position, ids = 0, CallIds()  # default ids count the prompts; each id once a call
        ended = end_sent = stopping = done = False
        self._generating = True
        try:
            while True:
                starved = False
                rows, refused = [], []
                while not (ended or stopping) and sent + len(rows) - self._taken < window:
                    item = next(source, _END)
                    if item is _END:
                        ended = True
                    elif item is NOT_READY:
                        starved = True
                        break
                    else:
                        row, error = self._pack(item, str(position), ids)
                        position += 1
                        if row is not None:
                            rows.append(row)
                        else:
                            refused.append(error)
                if rows:
                    self.server.send(("prompts", call_id, rows))
                    sent += len(rows)
                yield from refused
                if ended and not end_sent:
                    self.server.send(("end", call_id))
                    end_sent = True
                if stop is not None and not stopping and stop.is_set():
                    self.server.send(("stop", call_id))
                    stopping = True
                message = self.server.next(PROMPT_POLL_S if starved else POLL_S)
                if message is None:
                    continue
                if message[0] == "done" and message[1] == call_id:
                    self._done(message)
                    done = True
                    return
                yield from self._results(message)
        finally:
            try:
                if not done:
                    self._abandon(call_id)
            finally:
                self._pending = {}
                self._generating = False

    def _pack(self, item: Any, default_id: str, ids: CallIds) -> tuple[Any, Any]:
        """-> (the row to send for a prompt, None), its ids kept for its result; or (None,
        its error result) when an earlier prompt of the call has its id (CallIds)."""
        from batchgen.engine.request import Prompt, RequestOutput

        row, packed = pack_prompt(item, default_id, self.vocab_size)
        given = isinstance(item, Prompt) and item.request_id is not None
        taken = ids.claim(row[0], given)
        if taken is not None:
            return None, RequestOutput(row[0], [], [], "error", f"request {row[0]}: {taken}")
        self._pending[row[0]] = packed
        return row, None

    def has_unfinished(self) -> bool:
        """Whether a prompt sent in the current generate call still has a result to come."""
        return bool(self._pending)

    def check_sampling(self, params: SamplingParams) -> None:
        """Engine.check_sampling, in the server: ValueError saying what is wrong."""
        self._call(("sampling", params))

    def clear_prefix_cache(self) -> None:
        """Forget the cached prompt blocks (a benchmark's warm-up would be a head start)."""
        self._call(("clear_cache",))

    def close(self) -> None:
        """The server exits, and the engine's memory (the GPU's included) goes with it."""
        self.server.close()

    def __enter__(self) -> EngineProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, message: tuple) -> None:
        self._check_open()
        self.server.send(message)
        self.server.expect("ok")

    def _results(self, message: tuple) -> Iterator[RequestOutput]:
        """An "outputs" message's results, each with its prompt ids back."""
        if message[0] != "outputs":
            raise self.server.failure(message)
        _, _, results, taken, stats = message
        self._taken, self.cache_stats = taken, stats
        pending = self._pending
        for out in results:
            ids = pending.pop(out.request_id) if out.last else pending[out.request_id]
            yield out if out.prompt_token_ids is not None else out._replace(prompt_token_ids=ids)

    def _abandon(self, call_id: int) -> None:
        """The call ends early (the caller stopped taking results, or it failed): stop the
        server's call and wait for its end. A server that ended has none to send."""
        if not self.server.alive():
            return
        self.server.tell(("stop", call_id))
        while True:
            message = self.server.inbox.get()
            if message[0] == "eof":
                self.server.inbox.put(message)  # there for the next call to raise
                return
            if message[0] == "done" and message[1] == call_id:
                self._done(message)
                return

    def _done(self, message: tuple) -> None:
        """A call's "done": its cache stats, step report and profile outcome."""
        _, _, self.cache_stats, self.step_report, profiled = message
        if self.recorder is not None and profiled is not None:
            self.recorder.outcome = profiled

    def _check_open(self) -> None:
        if self.server.closed:
            raise RuntimeError("this engine process is closed: start a new one")
