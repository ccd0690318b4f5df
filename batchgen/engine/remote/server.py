"""The engine's side of EngineProcess (`python -m batchgen.engine.remote.server`): one Engine,
its generate calls fed from stdin, their results sent back on a copy of stdout (protocol.py;
anything printed goes to stderr).

Two threads run Python here: the engine's (the main thread) and the pipe reader, which only
unpickles prompt batches (their ids arrive as bytes) and sets flags. The engine's modules are
imported before the first message is read, so a server started early has them ready.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import importlib
import importlib.util
import os
import queue
import signal
import sys
import threading
import time
import traceback
from typing import IO, Any

from batchgen.engine.remote.placement import pin_process
from batchgen.engine.remote.protocol import receive, send, unpack_prompt
from batchgen.errors import BatchgenError, first_line
from batchgen.process_start import heavy_imports, prepare_imports
from batchgen.summary import process_age_s

IDLE_WAIT_S = 0.05  # how long an idle engine waits for the next prompt before asking again
PR_SET_PDEATHSIG = 1
_FIRST_MODULES = (
    "torch",
    "batchgen.engine.config",
    "batchgen.engine.device",
    "batchgen.engine.first_use",
    "batchgen.engine.model_path",
    "batchgen.engine.preload",
)
_END = object()


class Feed:
    """Prompt rows of the current generate call, filled by the reader thread. Rows of another
    (earlier) call are dropped; end and stop are kept per call too."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.call_id = 0
        self._rows: collections.deque[tuple[int, tuple]] = collections.deque()
        self._ended = 0  # the last call whose prompts all came
        self._stopped = 0  # the last call asked to stop

    def begin(self, call_id: int) -> None:
        with self.cond:
            self.call_id = call_id
            while self._rows and self._rows[0][0] < call_id:
                self._rows.popleft()

    def add(self, call_id: int, rows: list[tuple]) -> None:
        with self.cond:
            self._rows.extend((call_id, row) for row in rows)
            self.cond.notify()

    def end(self, call_id: int) -> None:
        with self.cond:
            self._ended = max(self._ended, call_id)
            self.cond.notify()

    def stop(self, call_id: int) -> None:
        with self.cond:
            self._stopped = max(self._stopped, call_id)
            self.cond.notify()

    def stopped(self) -> bool:
        return self._stopped >= self.call_id

    def depth(self) -> int:
        """Rows that came and wait for the engine to take them (a profile's tokenizer gauge)."""
        return len(self._rows)

    def take(self, wait: float) -> tuple | object | None:
        """The next row of this call, _END when it has no more, None if none came within
        `wait` seconds."""
        deadline = None
        with self.cond:
            while True:
                rows = self._rows
                while rows and rows[0][0] < self.call_id:
                    rows.popleft()
                if rows and rows[0][0] == self.call_id:
                    return rows.popleft()[1]
                if self._ended >= self.call_id or self.stopped():
                    return _END
                now = time.monotonic()
                deadline = deadline or now + wait
                if now >= deadline:
                    return None
                self.cond.wait(deadline - now)


class Call:
    """One generate call: results go back once per step (when the engine asks whether to
    stop, before each step), with the count of prompts taken so far."""

    def __init__(self, engine: Any, feed: Feed, answers: IO[bytes], call_id: int) -> None:
        self.engine, self.feed, self.answers, self.call_id = engine, feed, answers, call_id
        self.outbox: list = []
        self.taken = 0
        self._sent_taken = 0
        self._sent: dict[str, list[int]] = {}  # request id -> its prompt ids, while it runs

    def is_set(self) -> bool:  # Engine.generate's stop: asked once before every step
        self.flush()
        return self.feed.stopped()

    def flush(self) -> None:
        if self.outbox or self.taken != self._sent_taken:
            message = ("outputs", self.call_id, self.outbox, self.taken, self.engine.cache_stats)
            send(self.answers, message)
            self.outbox, self._sent_taken = [], self.taken

    def prompts(self) -> Any:
        from batchgen.engine.request import NOT_READY

        while True:
            row = self.feed.take(0.0)
            if row is None and not self.engine.has_unfinished():
                self.flush()
                row = self.feed.take(IDLE_WAIT_S)
            if row is None:
                yield NOT_READY
                continue
            if row is _END:
                return
            prompt, packed = unpack_prompt(row)
            if packed:
                self._sent[prompt.request_id] = prompt.prompt
            self.taken += 1
            yield prompt

    def keep(self, out: Any) -> None:
        """A result, sent without its prompt ids when they are the ones that came."""
        sent = self._sent.pop(out.request_id, None) if out.last else self._sent.get(out.request_id)
        if sent is not None and out.prompt_token_ids == sent:
            out = out._replace(prompt_token_ids=None)
        self.outbox.append(out)


class FirstMessage:
    """The first message on stdin, read on a thread while this process imports the engine's
    modules. A load onto a GPU starts there and then what needs no model code: the driver, a
    local folder's weights (preload.py), the first kernels (first_use.py); the seconds of
    transformers' imports are spent on them meanwhile."""

    def __init__(self, requests: IO[bytes]) -> None:
        self.message: tuple | None = None
        self.error: BaseException | None = None
        self.preload: Any = None
        self._thread = threading.Thread(
            target=self._read, args=(requests,), name="batchgen-engine-first", daemon=True
        )
        self._thread.start()

    def get(self) -> tuple:
        self._thread.join()
        if self.error is not None:
            raise self.error
        return self.message

    def _read(self, requests: IO[bytes]) -> None:
        try:
            self.message = receive(requests)
        except BaseException as exc:  # raised again by get()
            self.error = exc
            return
        if self.message[0] == "load":
            self.preload = _start_on_device(*self.message[1:3])


def _start_on_device(model: str, config: Any) -> Any:
    """Where the engine will run on a GPU, what its start-up there needs that the imports do
    not: the driver and its context (first_use.py), the weights of a local folder read ahead
    (a Preload), the first use of cuBLAS and the first forward pass's kernels, and Triton's
    key. -> the Preload, or None. Uses only modules main() imported before this thread
    started (no import races)."""
    from batchgen.engine.device import resolve_device, resolve_dtype
    from batchgen.engine.first_use import device_index, init_driver, warm_first_use, warm_triton
    from batchgen.engine.model_path import DEFAULT_MODEL, resolve_model_path
    from batchgen.engine.preload import Preload

    index = device_index(config.device)
    if index is None:
        return None
    init_driver(index)  # before torch's own initialization, which holds the GIL
    try:
        device = resolve_device(config)
    except Exception:  # the engine's own load reports it
        return None
    if device.type != "cuda":
        return None
    preload = None
    # (transformers loads onto a GPU through a device map: accelerate's)
    if model != DEFAULT_MODEL and importlib.util.find_spec("accelerate") is not None:
        with contextlib.suppress(Exception):  # the engine's own load reports it
            preload = Preload(resolve_model_path(model), device)
    with contextlib.suppress(Exception):  # the engine's start-up meets it again
        warm_first_use(device, resolve_dtype(config, device))
        warm_triton()
    return preload


def serve(requests: IO[bytes], answers: IO[bytes], first: FirstMessage | None = None) -> None:
    """Load the engine the first message asks for (keeping to the cores it names once
    loaded), then answer until told to close. first: that message, read by a FirstMessage
    (else read here)."""
    try:
        message = first.get() if first is not None else receive(requests)
    except EOFError:
        return  # the job's process ended first
    except Exception as exc:
        _unreadable(answers, exc)
        return
    if message[0] != "load":
        return  # closed before it was asked for a model (an early server the job did not use)
    _, model, config, quiet, step_hook, cores = message
    cpus = frozenset(cores)
    began, process_s = time.monotonic(), process_age_s()
    feed, control = Feed(), queue.SimpleQueue()
    threading.Thread(  # from now on: the job's process closing stdin ends this one at once,
        # mid-load too (a job that stopped before it needed its engine does not wait for it)
        target=_read,
        args=(requests, answers, feed, control),
        name="batchgen-engine-requests",
        daemon=True,
    ).start()
    try:
        engine, hook = _load(model, config, quiet, step_hook, first and first.preload)
    except BaseException as exc:
        _report(answers, exc)
        return
    pin_process(cpus)  # start-up ran on every core; the engine thread now has these alone
    send(answers, ("ready", {**_facts(engine), "began_at": began, "process_s": process_s}))
    while True:
        message = control.get()
        kind = message[0]
        if kind == "generate":
            _generate(engine, hook, feed, answers, *message[1:])
        elif kind == "sampling":
            try:
                engine.check_sampling(message[1])
                send(answers, ("ok",))
            except BaseException as exc:
                _report(answers, exc)
        elif kind == "clear_cache":
            engine.blocks.clear_cache()
            send(answers, ("ok",))
        elif kind == "close":
            return


def _generate(
    engine: Any, hook: Any, feed: Feed, answers: IO[bytes], call_id: int, params: Any,
    decode: bool, check_outputs: bool, profile: tuple[str, str] | None,
) -> None:  # fmt: skip
    feed.begin(call_id)
    current = Call(engine, feed, answers, call_id)
    if hook is not None:
        hook.open()
    started = time.perf_counter()
    recorder = failed = None
    if profile is not None:
        try:
            recorder = _start_recorder(engine, feed, *profile)
        except Exception as exc:
            failed = f"{type(exc).__name__}: {exc}"
    try:
        for out in engine.generate(
            current.prompts(), params, decode=decode, stop=current, check_outputs=check_outputs
        ):
            current.keep(out)
        current.flush()
    except BaseException as exc:
        _report(answers, exc)
    profiled = None if profile is None else _stop_recorder(recorder, failed)
    report = None
    if hook is not None:
        hook.close()
        report = hook.report(time.perf_counter() - started)
    send(answers, ("done", call_id, engine.cache_stats, report, profiled))


def _start_recorder(engine: Any, feed: Feed, path: str, run: str) -> Any:
    """The call's step recorder (profile/recorder.py), writing to `path`. Its tokenizer gauge
    counts the rows that came and wait here; the writer is the job's, out of sight (no gauge)."""
    from batchgen.io.fs import as_path
    from batchgen.profile.recorder import Gauges, StepRecorder

    gauges = Gauges(feed.depth, lambda: -1)
    return StepRecorder(engine, as_path(path), run, gauges).attach()


def _stop_recorder(recorder: Any, failed: str | None) -> tuple[str, str]:
    """Write the records -> ("ok", their file) or ("error", why): the rows are what the job
    is for, so a profile that fails is reported, not raised."""
    if recorder is None:
        return ("error", failed or "the step recorder did not start")
    try:
        return ("ok", str(recorder.close()))
    except Exception as exc:
        return ("error", f"{type(exc).__name__}: {exc}")


def _report(answers: IO[bytes], exc: BaseException) -> None:
    """Send an error; one the user did not cause goes with its traceback (the job's crash
    log holds it; stderr only where it cannot be sent), and ends this process (the engine's
    state is unknown)."""
    if isinstance(exc, BatchgenError | ValueError):
        kind = "batchgen" if isinstance(exc, BatchgenError) else "value"
        send(answers, ("error", kind, str(exc)))
        return
    line = str(exc).strip().splitlines()
    text = f"{type(exc).__name__}: {line[0] if line else ''}"
    try:
        send(answers, ("error", "internal", text, "".join(traceback.format_exception(exc))))
    except (OSError, ValueError):
        traceback.print_exception(exc, file=sys.stderr)
    sys.stderr.flush()
    os._exit(1)


def _load(
    model: str, config: Any, quiet: bool, step_hook: str | None, preload: Any = None
) -> tuple[Any, Any]:
    """-> (the engine, its step hook or None)."""
    from batchgen.engine.engine import Engine
    from batchgen.engine.model_loader import hf_progress_bars

    with hf_progress_bars(shown=not quiet):
        engine = Engine(model, config, preload=preload)
    hook = None
    if step_hook is not None:
        module, name = step_hook.split(":")
        hook = getattr(importlib.import_module(module), name)()
        engine.runner.step_hook = hook
    return engine, hook


def _facts(engine: Any) -> dict[str, Any]:
    return {
        "dtype": str(engine.dtype).removeprefix("torch."),
        "max_model_len": engine.max_model_len,
        "num_blocks": engine.num_blocks,
        "vocab_size": engine.shape.vocab_size,
        # resolved where the config left them unset
        "block_size": engine.config.block_size,
        "max_num_batched_tokens": engine.config.max_num_batched_tokens,
        "fingerprint": engine.fingerprint,
        "generation_defaults": engine.generation_defaults,
        "startup_s": engine.startup_s,
    }


def _read(requests: IO[bytes], answers: IO[bytes], feed: Feed, control: queue.SimpleQueue) -> None:
    """stdin -> the feed (prompts, end, stop) and the control queue (the rest). When stdin
    ends, the job's process has: this one exits at once (nothing here is worth keeping). A
    message it cannot read ends it too, saying why (_unreadable)."""
    try:
        while True:
            message = receive(requests)
            kind = message[0]
            if kind == "prompts":
                feed.add(message[1], message[2])
            elif kind == "end":
                feed.end(message[1])
            elif kind == "stop":
                feed.stop(message[1])
            else:
                control.put(message)
    except (EOFError, OSError):
        pass
    except Exception as exc:
        _unreadable(answers, exc)
    sys.stderr.flush()
    os._exit(0)


def _unreadable(answers: IO[bytes], exc: Exception) -> None:
    """A message from the job's process that cannot be read here (an object of a type only
    that process can import): what it asked for is lost, so the call it belonged to cannot
    go on. Say why as an internal error, and exit."""
    error = RuntimeError(
        f"cannot read a message from the job's process ({first_line(exc)}): pass prompts and "
        "sampling overrides as plain values (str, int, float, list, dict)"
    )
    error.__cause__ = exc  # its traceback too
    _report(answers, error)


def _die_with_parent() -> None:
    """Linux: SIGKILL this process when the job's process dies, even if a step holds it."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() == 1:  # the parent died before the line above
        os._exit(0)


def main() -> None:
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C and SIGTERM are the job's to handle
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    prepare_imports()  # before torch is imported
    answers = os.fdopen(os.dup(1), "wb")  # the protocol's; prints go to stderr
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    with heavy_imports():
        for module in _FIRST_MODULES:  # what FirstMessage's thread uses, imported before it runs
            importlib.import_module(module)
        if importlib.util.find_spec("triton") is not None:
            importlib.import_module("triton.runtime.cache")  # warm_triton's
        first = FirstMessage(sys.stdin.buffer)
        importlib.import_module("batchgen.engine.engine")  # while the job's process starts too
    serve(sys.stdin.buffer, answers, first)
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
