"""The job's threads around the engine: a producer that reads and tokenizes ahead through a
bounded queue, and a consumer that detokenizes and writes shards off the engine thread."""

from __future__ import annotations

import collections
import concurrent.futures
import queue
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from batchgen.engine import NOT_READY
from batchgen.engine.detokenize import CONTEXT_TOKENS, TextIds
from batchgen.engine.output_check import output_problem
from batchgen.engine.request import RequestOutput, TokenLogprobs
from batchgen.io import RawRow, ShardWriter
from batchgen.io.output_schema import OutputRow, RowCounts
from batchgen.io.writer import warm_encoders
from batchgen.prompts import RowPrompt
from batchgen.row_share import ALONE, RankRows
from batchgen.tokenizer_pool import TokenizerPool

_POLL_S = 0.2
PREPARE_ROWS = 128  # rows per tokenizer task: the engine's first rows wait for one task only
# the job's first task: the engine's first step waits for 16 rows' prompts, not 128 (on a
# 2-core machine, 8,192 text rows: first step 0.19 -> 0.08 s after the job starts); each next
# task has twice as many rows, up to PREPARE_ROWS
FIRST_PREPARE_ROWS = 16
WRITE_ROWS = 512  # finished requests the writer takes together (their texts decoded at once)


class Producer(threading.Thread):
    """Streams input batches, skips committed rows, flags duplicate ids, has the tokenizer
    pool prepare the rest (in its processes, or threads).

    With several ranks (share), a rank is given every row (another rank's with its id alone)
    and tracks every id, so a duplicate id is flagged alike at any world size, but prepares
    only its own rows.
    """

    def __init__(
        self,
        batches: Iterator[list[RawRow]],
        tokenizers: TokenizerPool,
        done: set[int],
        id_column: str | None,
        prefetch_rows: int,
        stop: threading.Event,
        hash_rows: bool = False,
        share: RankRows | None = None,
    ) -> None:
        super().__init__(name="batchgen-producer", daemon=True)
        self.batches = batches
        self.tokenizers = tokenizers
        self.done = done
        self.id_column = id_column
        self.hash_rows = hash_rows  # record each row's hash (sources without a fingerprint)
        self.share = share or ALONE.rows(None, done)  # None: every row not committed
        self._past = 0  # rows not committed read so far at or past share.num_rows (row_share)
        self.queue: queue.Queue[Future[list[RowPrompt]] | None]
        self.queue = queue.Queue(maxsize=max(1, prefetch_rows // PREPARE_ROWS))
        self.stop = stop
        self.error: BaseException | None = None
        self.rows_read = 0  # rows of the input read so far (committed ones included)
        self.finished = False  # the whole input was read
        self._ids: set[str] = set()
        self._current: Future[list[RowPrompt]] | None = None  # the engine thread's side
        self._ready: collections.deque[RowPrompt] = collections.deque()
        self._ended = False
        # ready_rows() = prepared - taken: rows tokenized and not yet given to the engine
        self._prepared = 0  # written by the futures' callbacks, under _count_lock
        self._taken = 0  # written by the engine thread
        self._count_lock = threading.Lock()
        self._task_rows = FIRST_PREPARE_ROWS  # the next task's size

    def run(self) -> None:
        try:
            for batch in self.batches:
                if self.stop.is_set():
                    return
                todo = [(row, dup) for row in batch for keep, dup in [self._check(row)] if keep]
                start = 0
                while start < len(todo):  # the first rows go out soon
                    rows = todo[start : start + self._task_rows]
                    start += len(rows)
                    self._task_rows = min(2 * self._task_rows, PREPARE_ROWS)
                    task = self.tokenizers.prepare(rows, self.hash_rows)
                    task.add_done_callback(self._count)
                    if not self._put(task):
                        return
            self.finished = True  # every row was read and handed on
        except BaseException as exc:  # re-raised on the engine thread
            self.error = exc
        finally:
            self._put(None)

    def next_row(self, wait: float) -> RowPrompt | object | None:
        """The next prepared row in input order; None at the end of the input (or when
        stopped); NOT_READY when none is ready within `wait` seconds."""
        while not self._ready:
            if self._ended or self.stop.is_set():
                return None
            if self._current is None:
                try:
                    item = self.queue.get(timeout=wait) if wait > 0 else self.queue.get_nowait()
                except queue.Empty:
                    return NOT_READY
                if item is None:
                    self._ended = True
                    return None
                self._current = item
            try:
                rows = self._current.result(timeout=wait)
            except concurrent.futures.TimeoutError:
                return NOT_READY
            self._current = None
            self._ready.extend(rows)
        self._taken += 1
        return self._ready.popleft()

    def ready_rows(self) -> int:
        """Rows tokenized ahead and waiting for the engine (the tokenizer queue's depth)."""
        return self._prepared - self._taken

    def _check(self, row: RawRow) -> tuple[bool, str | None]:
        """Count the row and its id -> (not yet committed and this rank's, the id if an
        earlier row had it)."""
        self.rows_read += 1
        duplicate = None
        if self.id_column is not None and row.values is not None:
            value = row.values.get(self.id_column)
            key = None if value is None else str(value)
            if key in self._ids:
                duplicate = key
            elif key is not None:
                self._ids.add(key)
        if row.index in self.done:
            return False, duplicate
        past = self._past
        self._past += row.index >= self.share.num_rows
        return self.share.owns(row.index, past), duplicate

    def _count(self, task: Future[list[RowPrompt]]) -> None:
        if not task.cancelled() and task.exception() is None:
            with self._count_lock:
                self._prepared += len(task.result())

    def _put(self, item: Future[list[RowPrompt]] | None) -> bool:
        while True:
            try:
                self.queue.put(item, timeout=_POLL_S)
                return True
            except queue.Full:
                if self.stop.is_set():
                    return False


@dataclass
class Stats(RowCounts):
    """The rows this run wrote (RowCounts), and when the first one was finished."""

    first_row_at: float | None = None  # perf_counter


class Consumer(threading.Thread):
    """Turns finished requests (and error rows) into output rows and commits shards.

    It takes the finished requests queued so far together (up to WRITE_ROWS), has their texts
    decoded in one call (the tokenizer processes, when the job has them), then builds rows.
    A failure (a shard that cannot be written) is kept in `error` and sets `failed` at once,
    so the engine stops instead of generating rows that cannot be saved.
    """

    def __init__(
        self,
        writer: ShardWriter,
        decode: Callable[[list[TextIds]], list[str]],
        token_text: Callable[[int], str],
        include_token_ids: bool,
        on_row: Callable[[Stats], None],
        on_rows: Callable[[list[dict[str, Any]]], None] | None = None,
    ) -> None:
        super().__init__(name="batchgen-writer", daemon=True)
        self.writer = writer
        self.decode = decode  # (context, ids) -> their texts (detokenize.output_texts)
        self.token_text = token_text  # a logprob entry's token as text (token_bytes.TokenBytes)
        self.include_token_ids = include_token_ids
        self.on_row = on_row
        self.on_rows = on_rows  # also given every finished group of rows (the lazy API)
        self.queue: queue.Queue[tuple[RowPrompt, RequestOutput | None] | None] = queue.Queue()
        self._samples: dict[int, list[OutputRow]] = {}  # index -> finished samples so far
        self.stats = Stats()
        self.error: BaseException | None = None
        self.failed = threading.Event()
        self.handed = 0  # items given to hand() (the engine thread's count)

    def hand(self, prompt: RowPrompt, out: RequestOutput | None) -> None:
        """Queue a finished sample (or an error row: out None): one output row each."""
        self.handed += 1
        self.queue.put((prompt, out))

    def lag(self) -> int:
        """Rows handed to the writer and not yet committed in a shard."""
        return self.handed - self.writer.rows_committed

    def run(self) -> None:
        try:
            # pyarrow's first-use imports: while the first rows are generated (not inside the
            # first commit), and after the start-up's imports on the main thread, not beside
            # them (two threads importing at once is where one start was seen to hang)
            warm_encoders(self.writer.format)
            ended = False
            while not ended:
                try:
                    item = self.queue.get(timeout=_POLL_S)
                except queue.Empty:
                    self.writer.maybe_commit()
                    continue
                items = []
                while item is not None:
                    items.append(item)
                    if len(items) == WRITE_ROWS or self.queue.empty():
                        break
                    item = self.queue.get_nowait()
                ended = item is None
                self._write(items)
            self.writer.commit()
        except BaseException as exc:
            self.error = exc
            self.failed.set()

    def _write(self, items: list[tuple[RowPrompt, RequestOutput | None]]) -> None:
        """Decode the items' texts in one call, then collect their rows in order."""
        wanted = [_texts_wanted(prompt, out) for prompt, out in items]
        texts = iter(self.decode([ids for seqs in wanted for ids in seqs]))
        for (prompt, out), seqs in zip(items, wanted, strict=True):
            self._collect(prompt, out, [next(texts) for _ in seqs])

    def _collect(self, prompt: RowPrompt, out: RequestOutput | None, texts: list[str]) -> None:
        """Write an input row's samples together, once the last of them has finished."""
        if self.stats.first_row_at is None:
            self.stats.first_row_at = time.perf_counter()
        group = self._samples.setdefault(prompt.index, [])
        group.append(self._row(prompt, out, texts))
        if out is None or out.last:
            del self._samples[prompt.index]
            group.sort(key=lambda r: r.sample_index)
            records = [row.record(self.writer.columns) for row in group]
            self.writer.add_group(records)
            for row in group:
                self.stats.add(row.error, row.num_prompt_tokens, row.num_generated_tokens)
            if self.on_rows is not None:
                self.on_rows(records)
            self.on_row(self.stats)

    def _row(self, prompt: RowPrompt, out: RequestOutput | None, texts: list[str]) -> OutputRow:
        """texts: those of _texts_wanted(prompt, out), in its order."""
        error = prompt.error if out is None else _own_error(out)
        generated = [] if out is None or error else out.output_token_ids
        if out is not None and out.text is not None:
            text = out.text
        else:
            text, texts = texts[0], texts[1:]
        if out is not None and out.check is not None and error is None:
            error = output_problem(out.check, text)  # a complete structured output
        logprobs = None
        if out is not None and out.logprobs is not None and not error:
            logprobs = [_logprob_entry(lp, self.token_text) for lp in out.logprobs]
        ids = self.include_token_ids
        return OutputRow(
            index=prompt.index,
            id=prompt.id,
            sample_index=0 if out is None else out.sample_index,
            text=None if error else text,
            finish_reason="error" if error else out.finish_reason,
            num_prompt_tokens=len(prompt.prompt_ids or []),
            num_generated_tokens=len(generated),
            error=error,
            logprobs=logprobs,
            prompt_token_ids=list(prompt.prompt_ids or []) if ids else None,
            token_ids=list(generated) if ids else None,
            passthrough=prompt.passthrough,
            input_hash=prompt.input_hash,
        )


def _own_error(out: RequestOutput) -> str | None:
    """The engine's error for a row, without the "request <id>: " it begins with (the job's
    request ids are row positions; the row itself says which it is)."""
    if out.error is None:
        return None
    return out.error.removeprefix(f"request {out.request_id}: ")


def _texts_wanted(prompt: RowPrompt, out: RequestOutput | None) -> list[TextIds]:
    """The (context, ids) an item's row shows as text (detokenize.output_text): its output
    after its prompt, unless the engine gave its text (an error row: no ids)."""
    error = prompt.error if out is None else out.error
    if out is None or error:
        return [((), ())]
    if out.text is not None:
        return []
    return [(out.prompt_token_ids[-CONTEXT_TOKENS:], out.text_token_ids)]


def _logprob_entry(lp: TokenLogprobs, token_text: Callable[[int], str]) -> dict[str, Any]:
    """An output row's logprob entry, each token shown as its own text (TokenBytes.text)."""
    top = [
        {"token": token_text(t), "token_id": t, "logprob": v}
        for t, v in zip(lp.top_ids, lp.top_logprobs, strict=True)
    ]
    token = token_text(lp.token_id)
    return {"token": token, "token_id": lp.token_id, "logprob": lp.logprob, "top_logprobs": top}


def wait_for(thread: threading.Thread, poll_s: float = _POLL_S) -> None:
    """join() that lets the main thread handle signals meanwhile."""
    while thread.is_alive():
        thread.join(poll_s)
    time.sleep(0)
