"""Where a job renders, tokenizes and detokenizes: tokenizer processes beside the engine's.

The engine thread launches every step from Python, so any other thread of its process that
runs Python (rendering a prompt, decoding an output) can make it wait for the GIL, up to the
switch interval each time, while the GPU idles. vLLM and SGLang tokenize and detokenize in
other processes for this reason, and so does a job with `runtime.tokenizer_processes` > 0:

- Each worker is a fresh `python -m batchgen.tokenizer_pool` connected by its stdin and
  stdout. It gets the job's prompt builder and tokenizer once, then answers tasks in order.
- `prepare(rows)` turns input rows into RowPrompts in a worker (one task per PREPARE_ROWS).
- `decode(seqs)` turns outputs' token ids into their text in the workers, for the writer.
- What crosses a pipe is plain data: row values in, token ids and text out.
- A worker exits when its stdin closes: at the end of the job, or when the job's process dies
  (even by SIGKILL). It never imports the caller's main module, so a script without an
  `if __name__ == "__main__"` guard is not run again. It ignores SIGINT and SIGTERM: a signal
  sent to the job's whole process group is the job's to handle (commit its rows, then exit).
- A worker that ends mid-job anyway (the OOM killer) costs no rows: its tasks, and every task
  after them, run in the job's own process, with one warning.

Until the first worker has started (it imports the tokenizer's module, a second or more), tasks
run on the job's own threads, so the first rows do not wait for it. Either way the same
builder code runs on the same values, so rows come out the same.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import itertools
import json
import os
import pickle
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import IO, TYPE_CHECKING, Any

from batchgen.engine.detokenize import TextIds, output_texts
from batchgen.process_start import heavy_imports, prepare_imports
from batchgen.prompts import RowPrompt

if TYPE_CHECKING:  # a worker does not import pyarrow for a type
    from batchgen.io import RawRow

# tokens per decode task: a task's round trip (pickling both ways) costs the job's process
# about what decoding a few thousand tokens there does (72 us per 256 on an H200 host)
DECODE_CHUNK_TOKENS = 4096
PICKLE = pickle.HIGHEST_PROTOCOL


class WorkerDied(RuntimeError):
    """A tokenizer process ended before answering a task (its task did not fail)."""


def row_hash(row: RawRow) -> str:
    """A stable hash of what was read for a row (its values, or why they could not be read)."""
    body = row.error if row.values is None else row.values
    text = json.dumps(body, sort_keys=True, ensure_ascii=True, default=repr)
    return hashlib.sha256(text.encode("ascii")).hexdigest()[:32]


def prepare_rows(
    builder: Any, rows: list[tuple[RawRow, str | None]], id_column: str | None, hash_rows: bool
) -> list[RowPrompt]:
    """(input row, the duplicate id it repeats or None) -> one RowPrompt each, in order: built
    by the builder, or an error row (unreadable, or a duplicate id)."""
    readable = [(row.index, row.values) for row, _ in rows if row.values is not None]
    built = iter(builder.build_many(readable))
    out = []
    for row, duplicate in rows:
        digest = row_hash(row) if hash_rows else None
        if row.values is None:
            row_id = str(row.index) if id_column is None else ""
            out.append(RowPrompt(row.index, row_id, None, {}, {}, row.error, digest))
            continue
        prepared = next(built)._replace(input_hash=digest)
        if duplicate is not None:
            prepared = prepared._replace(
                prompt_ids=None, error=f"duplicate id {duplicate!r}: an earlier row has it"
            )
        out.append(prepared)
    return out


class TokenizerPool:
    """The job's tokenizer threads and, with processes > 0, its tokenizer processes."""

    def __init__(
        self,
        builder: Any,
        tokenizer: Any,
        id_column: str | None,
        *,
        threads: int,
        processes: int,
        warn: Callable[[str], None] | None = None,
    ) -> None:
        self.builder, self.tokenizer, self.id_column = builder, tokenizer, id_column
        self.threads = ThreadPoolExecutor(threads, thread_name_prefix="batchgen-tokenizer")
        self.workers: list[_Worker] = []
        self._turn = itertools.count()  # round robin over the workers
        self._started: Future[bool] | None = None  # done once every worker has answered
        self._warn = warn or (lambda line: print(line, file=sys.stderr))
        self._closing = threading.Lock()
        self._closed = False
        self._lost = False  # a worker ended mid-job: tasks run in this process from then on
        if processes > 0:
            self._started = Future()
            threading.Thread(
                target=self._start, args=(processes,), name="batchgen-tokenizer-start", daemon=True
            ).start()

    def _start(self, processes: int) -> None:
        """Start the workers (on a thread of its own: each imports the tokenizer's module
        first) and send each the builder and tokenizer; tasks go to threads meanwhile."""
        assert self._started is not None
        workers: list[_Worker] = []
        try:
            payload = pickle.dumps((self.builder, self.tokenizer), PICKLE)
            workers += [_Worker(payload) for _ in range(processes)]
            for worker in workers:
                worker.call("ping").result()
        except BaseException as exc:  # reported once, by in_processes
            for worker in workers:
                worker.close()
            self._started.set_exception(exc)
            return
        with self._closing:
            if self._closed:
                for worker in workers:
                    worker.close()
                return
            self.workers = workers
        self._started.set_result(True)

    @property
    def in_processes(self) -> bool:
        """Whether tasks go to the worker processes now (they have started)."""
        started = self._started
        if self._lost or started is None or not started.done():
            return False
        exc = started.exception()
        if exc is not None:  # a worker could not start: stay in threads
            self._warn(
                f"tokenizer processes did not start ({type(exc).__name__}: {exc}): "
                "tokenizing in threads of the job's process"
            )
            self._started = None
            return False
        return True

    def prepare(
        self, rows: list[tuple[RawRow, str | None]], hash_rows: bool
    ) -> Future[list[RowPrompt]]:
        """Build the rows' prompts in a worker process (a thread until they run)."""
        if not self.in_processes:
            return self._prepare_here(rows, hash_rows)
        out: Future[list[RowPrompt]] = Future()
        task = self._next_worker().call("prepare", rows, self.id_column, hash_rows)
        task.add_done_callback(lambda done: self._prepared(done, out, rows, hash_rows))
        return out

    def _prepare_here(
        self, rows: list[tuple[RawRow, str | None]], hash_rows: bool
    ) -> Future[list[RowPrompt]]:
        return self.threads.submit(prepare_rows, self.builder, rows, self.id_column, hash_rows)

    def _prepared(
        self,
        done: Future[list[RowPrompt]],
        out: Future[list[RowPrompt]],
        rows: list[tuple[RawRow, str | None]],
        hash_rows: bool,
    ) -> None:
        """A worker's answer into `out`; a task whose worker ended is run again here."""
        exc = done.exception()
        if not isinstance(exc, WorkerDied):
            _copy(done, out)
            return
        self._lose(exc)
        try:
            again = self._prepare_here(rows, hash_rows)
        except RuntimeError as late:  # the pool is closed: nobody waits for these rows
            out.set_exception(late)
            return
        again.add_done_callback(lambda task: _copy(task, out))

    def _lose(self, exc: WorkerDied) -> None:
        """A worker ended: from now on every task runs in this process (warned once)."""
        with self._closing:
            if self._lost:
                return
            self._lost = True
        self._warn(f"{exc}: tokenizing in threads of the job's process from here on")

    def decode(self, seqs: list[TextIds]) -> list[str]:
        """The output texts of (context, ids) pairs (detokenize.output_text). With
        DECODE_CHUNK_TOKENS tokens or more they are decoded in the worker processes (once they
        run), in chunks of about that many, while the calling thread (the writer's) waits
        without the GIL; fewer cost less here than a task's round trip does."""
        if not self.in_processes or sum(len(ids) for _, ids in seqs) < DECODE_CHUNK_TOKENS:
            return output_texts(self.tokenizer, seqs)
        chunks: list[list[TextIds]] = [[]]
        tokens = 0
        for item in seqs:
            if tokens >= DECODE_CHUNK_TOKENS:
                chunks.append([])
                tokens = 0
            chunks[-1].append(item)
            tokens += len(item[1])
        tasks = [self._next_worker().call("decode", chunk) for chunk in chunks]
        texts: list[str] = []
        for chunk, task in zip(chunks, tasks, strict=True):
            try:
                texts += task.result()
            except WorkerDied as exc:
                self._lose(exc)
                texts += output_texts(self.tokenizer, chunk)
        return texts

    def _next_worker(self) -> _Worker:
        return self.workers[next(self._turn) % len(self.workers)]

    def close(self) -> None:
        """No more tasks: workers exit once they see their stdin closed."""
        self.threads.shutdown(wait=False)
        with self._closing:
            self._closed = True
            for worker in self.workers:
                worker.close()


class _Worker:
    """One worker process and the tasks sent to it, answered in the order sent."""

    def __init__(self, payload: bytes) -> None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        self.process = subprocess.Popen(
            [sys.executable, "-m", __name__],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
        )
        assert self.process.stdin is not None and self.process.stdout is not None
        self._to, self._from = self.process.stdin, self.process.stdout
        self._lock = threading.Lock()  # one message at a time on the pipe
        self._waiting: collections.deque[Future[Any]] = collections.deque()
        self._to.write(payload)  # the first message: (builder, tokenizer), pickled
        self._to.flush()
        threading.Thread(
            target=self._answers, name="batchgen-tokenizer-answers", daemon=True
        ).start()

    def call(self, kind: str, *args: Any) -> Future[Any]:
        task: Future[Any] = Future()
        with self._lock:
            self._waiting.append(task)
            try:
                pickle.dump((kind, args), self._to, PICKLE)
                self._to.flush()
            except (BrokenPipeError, ValueError, OSError) as exc:
                self._waiting.remove(task)
                task.set_exception(self._died(exc))
        return task

    def _answers(self) -> None:
        """Resolve the waiting tasks in order; at the pipe's end, fail those left."""
        try:
            while True:
                ok, value = pickle.load(self._from)
                task = self._waiting.popleft()
                if ok:
                    task.set_result(value)
                else:
                    task.set_exception(RuntimeError(f"a tokenizer process failed: {value}"))
        except (EOFError, OSError, pickle.UnpicklingError) as exc:
            with self._lock:
                while self._waiting:
                    self._waiting.popleft().set_exception(self._died(exc))

    def _died(self, exc: BaseException) -> WorkerDied:
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(1.0)  # its exit status, once the pipe shows it gone
        code = self.process.poll()
        return WorkerDied(
            f"a tokenizer process (pid {self.process.pid}) ended"
            + ("" if code is None else f" with exit code {code}")
            + f" ({type(exc).__name__})"
        )

    def close(self) -> None:
        with self._lock, contextlib.suppress(OSError):
            self._to.close()


def _copy(task: Future[Any], out: Future[Any]) -> None:
    """`task`'s result or exception into `out`."""
    exc = task.exception()
    if exc is None:
        out.set_result(task.result())
    else:
        out.set_exception(exc)


def _serve(requests: IO[bytes], answers: IO[bytes]) -> None:
    """A worker: the (builder, tokenizer), then one answer per task until stdin ends."""
    with heavy_imports():  # unpickling the tokenizer imports transformers
        builder, tokenizer = pickle.load(requests)
    tasks: dict[str, Callable[..., Any]] = {
        "ping": lambda: True,
        "prepare": lambda rows, id_column, hash_rows: prepare_rows(
            builder, rows, id_column, hash_rows
        ),
        "decode": lambda seqs: output_texts(tokenizer, seqs),
    }
    while True:
        try:
            kind, args = pickle.load(requests)
        except EOFError:
            return
        try:
            answer = (True, tasks[kind](*args))
        except Exception as exc:
            answer = (False, f"{type(exc).__name__}: {exc}")
        try:
            pickle.dump(answer, answers, PICKLE)
            answers.flush()
        except OSError:  # the job's process is gone (killed): nobody waits for the answer
            with contextlib.suppress(OSError):  # closed now: nothing is flushed at exit
                answers.close()
            return


def main() -> None:
    # Ctrl-C and SIGTERM (to the job's process group) are the job's to handle: it commits its
    # rows and closes this worker's stdin
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    prepare_imports()  # before the tokenizer's modules are imported
    answers = os.fdopen(os.dup(1), "wb")  # the protocol's; prints go to stderr
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    _serve(sys.stdin.buffer, answers)


if __name__ == "__main__":
    main()
