"""Structured outputs: grammars compiled off the engine thread, one matcher per sample, and the
next-token bitmask filled on the host for the sampler to apply on the device.

Engine: llguidance, chosen over xgrammar by benchmarks/grammar_engines.py: xgrammar 0.2.9
is faster per token (its batched fill of 64 rows took 0.6-0.9x llguidance's time on this
machine's 32k tokenizer) but wrong where batch jobs need it: a string with maxLength may hold
raw control characters (invalid JSON), and escapes are refused there. llguidance refuses the
former, compiles schemas faster, and its fill is cheap enough to hide under the forward.
It is imported lazily: a job without structured outputs never needs it.

Parallel fill: an llguidance matcher's copies share its lexer under one lock (the lexer's
automaton is built lazily while a mask is computed), so the masks of many copies of one
compiled matcher are computed one at a time, whatever the thread count. A grammar used by
more than one sample is therefore compiled into `lanes` (one per fill thread, each with its
own lexer) and samples are spread over the lanes. Each step is two calls into llguidance
from the fill thread, on an executor of Rust threads with the GIL dropped: the matchers
consume their newest tokens, then every constrained row's mask is filled. The work list holds
each lane's rows contiguously: the executor (rayon) splits the list into contiguous ranges,
so a thread mostly meets rows of one lane, and two threads meet on a lane's lock only where a
range boundary falls inside it.

Overlap: the step's fill runs on the fill thread while the engine thread queues the same
step's forward and post-processes the step in flight. The fill thread waits for the in-flight
step's tokens on its device event and consumes them from the pinned copy; the engine thread
reads the same tokens for itself. Only the fill thread touches the matchers while it runs.
A step with prefill chunks queues an eager forward, ~10-16 ms of Python on an 8b model, so its
fill gets a small executor and the engine thread keeps a fast core (`fill_threads`); a
decode-only step replays a CUDA graph and then waits, so its fill gets every spare core. The
GIL switch interval is shortened while a fill runs (and restored after), so the fill thread's
few Python lines between its Rust calls do not wait 5 ms for the busy engine thread.

JSON (json_schema, json_object) is generated compact, without free whitespace between tokens:
a weak model otherwise spends its token budget on newlines.

A sample's matcher has consumed exactly its output tokens known on the host
(`GrammarState.accepted` of them): preemption recomputes KV but keeps the output tokens, so
a matcher is never rolled back. Once the grammar is complete only the model's end-of-sequence
tokens are allowed, so a structured output ends "stop" when its grammar does, or "length"
when max_new_tokens cut it first (then it is incomplete, as with vLLM and OpenAI).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from batchgen.engine.output_check import admits_nothing, endless, unchecked_problem
from batchgen.engine.sampling_params import SamplingParams
from batchgen.engine.transfer import StepOutput
from batchgen.errors import BatchgenError

COMPILE_THREADS = 1  # one compile at a time, beside the engine thread
MAX_FILL_THREADS = 32  # beyond this a step's rows are too few to share out
ALL_ALLOWED = -1  # an int32 bitmask word with every bit set
# llguidance JSON options: "," and ":" alone; oneOf generated as anyOf (pydantic's
# discriminated unions; an output valid under several branches fails the jsonschema check)
COMPACT_JSON = {"whitespace_flexible": False, "coerce_one_of": True}
ANY_OBJECT = {"type": "object"}  # json_object: any JSON object, as OpenAI's json_object mode
FILL_SWITCH_S = 1e-4  # the GIL switch interval while a fill runs beside the engine thread
FORCED_LIMIT = 50_000  # llguidance's limit on the tokens a grammar forces in a row


class GrammarSpec(NamedTuple):
    """What a request's output must match: kind is json_schema, regex, choice or json_object;
    source is the schema's JSON text, the regex, or the choices as a JSON list."""

    kind: str
    source: str


def grammar_spec(params: SamplingParams) -> GrammarSpec | None:
    if params.json_schema is not None:
        return GrammarSpec("json_schema", params.json_schema)
    if params.regex is not None:
        return GrammarSpec("regex", params.regex)
    if params.choice:
        return GrammarSpec("choice", json.dumps(list(params.choice)))
    if params.json_object:
        return GrammarSpec("json_object", json.dumps(ANY_OBJECT))
    return None


def _llguidance() -> Any:
    try:
        import jsonschema  # noqa: F401  (output_check validates complete JSON outputs with it)
        import llguidance
        import llguidance.hf
        import llguidance.torch
    except ImportError as exc:
        raise BatchgenError(
            "structured outputs (json_schema, regex, choice, json_object) need the llguidance "
            "and jsonschema packages: pip install 'batchgen[structured]'"
        ) from exc
    return llguidance


def fill_threads(cpu_threads: int | None) -> tuple[int, int]:
    """-> (busy, idle): threads of the mask fill while the engine thread queues an eager
    forward (a step with prefill chunks: ~10-16 ms of Python on an 8b model, which needs a
    fast core of its own), and while it only replays a decode graph and then waits. Out of
    the engine's cpu_threads when set (a rank's share of the machine), else every core this
    process may use: a quarter of them busy, all but two idle. On a 16-core H200 host (8b, W1,
    a JSON schema on every row, one executor for every step) 4 threads gave 0.83-0.90x the
    unconstrained tok/s, 6 threads 0.85x, 8 threads 0.67x, 12 threads 0.59x. A decode step's
    fill ended 8.2 ms after its launch began with 4 threads and 7.2-7.4 ms with 14 (both
    including the wait for the previous step's tokens), against an 8.8 ms decode step."""
    cores = min(MAX_FILL_THREADS, cpu_threads or len(os.sched_getaffinity(0)))
    busy = max(1, cores // 4)
    return busy, max(busy, cores - 2)


class InFlight(NamedTuple):
    """The step whose tokens are still on their way: its sampled requests in row order."""

    rows: list[Any]
    out: StepOutput


@dataclass(eq=False)
class Compiled:
    """A grammar's lanes: matchers of it in their start state, each with its own lexer.

    Lane 0 is compiled first; the rest once a second sample uses the grammar (a grammar of
    one row costs one compile). The compile thread appends lanes; the engine thread reads.
    """

    spec: GrammarSpec
    lanes: list[Any]  # llguidance.LLMatcher, one per lane
    uses: int = 0  # samples given a matcher so far (they go round the lanes)
    widened: Future | None = None  # the compile of the other lanes, once asked for


@dataclass(eq=False)
class GrammarState:
    """A sample's matcher, its lane's lexer, and how many output tokens it has consumed.

    A matcher that fails on a token (one it allowed, past a limit of the grammar engine's:
    "Too many items") stays failed and allows only the end-of-sequence token from then on:
    its sample ends at once and is an error row naming the failure (failure, output_check),
    never a crash of the step nor an output under `stop`.
    """

    matcher: Any  # llguidance.LLMatcher
    lexer: int  # id of the lane matcher it was copied from: copies of one share a lexer
    spec: GrammarSpec | None = None  # what a complete output must match (output_problem)
    accepted: int = 0
    # the grammar engine's error on this output, set by whichever thread consumed the token
    # it refused (the fill thread, or the engine thread before it starts a fill); read once
    # the sample ended, after the fills that consumed its tokens
    failure: str | None = None


class Grammars:
    """Compiles grammars in a thread (cached by spec), makes matchers, fills step bitmasks.

    Only the engine thread calls it; the compile thread runs `_compile` and `_add_lanes`, the
    executor's Rust threads the consume and the fill (see the module docstring).
    """

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        eos_token_ids: frozenset[int],
        max_rows: int,
        device: torch.device,
        threads: int = 1,
        busy_threads: int | None = None,
    ) -> None:
        self._llg = _llguidance()
        self._pool = ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="batchgen-grammar")
        self._cache: dict[GrammarSpec, Future] = {}  # spec -> future of its Compiled
        eos = sorted(eos_token_ids)
        self._tokenizer = self._pool.submit(self._make_tokenizer, tokenizer, vocab_size, eos)
        self.threads = threads  # fill threads while the engine thread waits (= lanes per grammar)
        self._executor = self._llg.LLExecutor(num_threads=threads)  # its calls drop the GIL
        busy = busy_threads or threads  # while the engine thread queues an eager forward
        self._busy_executor = (
            self._executor if busy == threads else self._llg.LLExecutor(num_threads=busy)
        )
        width = (vocab_size + 31) // 32
        cuda = device.type == "cuda"
        # host_mask[row]: the step's bitmask, bit t of word w allows token 32 * w + t
        self.host_mask = torch.full((max_rows, width), ALL_ALLOWED, dtype=torch.int32)
        if cuda:
            self.host_mask = self.host_mask.pin_memory()
        self.device_mask = self.host_mask.to(device) if cuda else self.host_mask
        self._copied = torch.cuda.Event() if cuda else None  # host_mask may be rewritten
        self._dirty = 0  # host_mask rows below this may hold a mask (the rest allow all)
        self._filler = ThreadPoolExecutor(1, thread_name_prefix="batchgen-fill")
        self._shortened = False  # this object holds a share of the short switch interval

    def _make_tokenizer(self, tokenizer: Any, vocab_size: int, eos: list[int]) -> Any:
        return self._llg.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos)

    def submit(self, spec: GrammarSpec) -> Future:
        """-> a future of the grammar's Compiled, to give each sample a matcher from (its
        exception: ValueError saying why the grammar cannot be compiled)."""
        future = self._cache.get(spec)
        if future is None:
            future = self._cache[spec] = self._pool.submit(self._compile, spec)
        return future

    def prepare(self, spec: GrammarSpec) -> None:
        """Compile spec with all its lanes now, for a grammar every row will use; ValueError."""
        self._widen(self.submit(spec).result()).result()

    def _compile(self, spec: GrammarSpec) -> Compiled:
        _check_checkable(spec)
        lane = self._lane(spec)
        _check_admits_text(spec, lane)
        return Compiled(spec, [lane])

    def _lane(self, spec: GrammarSpec) -> Any:
        llg = self._llg
        tokenizer = self._tokenizer.result()
        try:
            matcher = llg.LLMatcher(tokenizer, _grammar(llg, spec), log_level=0)
            problem = matcher.get_error() if matcher.is_error() else None
        except Exception as exc:  # a schema llguidance cannot read raises ValueError
            problem = str(exc)
        if problem is not None:
            raise _not_compiled(spec, problem)
        return matcher

    def _widen(self, compiled: Compiled) -> Future:
        if compiled.widened is None:
            compiled.widened = self._pool.submit(self._add_lanes, compiled)
        return compiled.widened

    def _add_lanes(self, compiled: Compiled) -> None:
        while len(compiled.lanes) < self.threads:
            compiled.lanes.append(self._lane(compiled.spec))  # append: atomic for the reader

    def matcher(self, compiled: Compiled) -> GrammarState:
        """A new sample's matcher, on the grammar's next lane."""
        lane = compiled.lanes[compiled.uses % len(compiled.lanes)]
        compiled.uses += 1
        if compiled.uses == 2:
            self._widen(compiled)  # a grammar shared by samples: give it every lane
        return GrammarState(lane.deep_copy(), id(lane), compiled.spec)

    def fill(self, rows: list[Any], num_rows: int) -> torch.Tensor:
        """rows: the step's sampled requests in row order (padding rows follow, up to
        num_rows), their output tokens all known. -> device bitmask [num_rows, words] int32
        (all-allowed where unconstrained). start() and finish() in one call."""
        return self.finish(self.start(rows, None), num_rows)

    def start(self, rows: list[Any], in_flight: InFlight | None, busy: bool = False) -> Future:
        """Begin a step's fill on the fill thread; -> its future, for finish(). rows: the
        step's sampled requests in row order; in_flight: the step before it, whose tokens have
        not been read yet (None when every output token is on the host). Each constrained
        matcher consumes its sample's tokens it has not seen (the in-flight one read from
        in_flight.out by the fill thread), then its row's mask is filled. Until finish(), only
        the fill thread uses the matchers. busy: the engine thread has much Python to run
        meanwhile (fewer fill threads).
        """
        pending_row = {} if in_flight is None else {id(r): j for j, r in enumerate(in_flight.rows)}
        lanes: dict[int, tuple[list, list, list]] = {}  # lexer -> (known, pending, work)
        for i, request in enumerate(rows):
            state = request.grammar
            if state is None or request.finish_reason is not None:
                continue  # unconstrained, or ended: the row's token will be dropped
            known, pending, work = lanes.setdefault(state.lexer, ([], [], []))
            outputs, j = request.output_token_ids, pending_row.get(id(request))
            new = len(outputs) - state.accepted
            if new == 1 and j is None:
                known.append((state, outputs[-1]))
            elif new and not state.matcher.consume_tokens(outputs[-new:]):
                _failed(state)  # not sampled for a while, or a token before the in-flight one
            state.accepted = len(outputs)
            if j is not None:
                pending.append((state, j))
                state.accepted += 1
            work.append((state.matcher, i))
        parts = list(lanes.values())
        known = [pair for lane, _, _ in parts for pair in lane]
        pending = [pair for _, lane, _ in parts for pair in lane]
        work = [pair for _, _, lane in parts for pair in lane]
        reset, self._dirty = self._dirty, len(rows)
        out = None if in_flight is None or not pending else in_flight.out
        if not self._shortened:
            _SWITCH.shorten()
            self._shortened = True
        executor = self._busy_executor if busy else self._executor
        return self._filler.submit(self._fill, executor, known, pending, work, out, reset)

    def _fill(
        self,
        executor: Any,
        known: list,
        pending: list,
        work: list,
        out: StepOutput | None,
        reset: int,
    ) -> None:
        """On the fill thread: wait for the device, consume, reset the mask rows, fill."""
        if self._copied is not None:
            self._copied.synchronize()  # the previous step's mask has left host_mask
        if out is not None:
            if out.ready_event is not None:
                out.ready_event.synchronize()
            tokens = out.tokens_host.tolist()
            known = known + [(state, tokens[j]) for state, j in pending]
        if known:
            verdicts = executor.consume_token_par([(s.matcher, t) for s, t in known])
            for (state, _), ok in zip(known, verdicts, strict=True):
                if not ok:
                    _failed(state)
        self._allow_all(self.host_mask[:reset])
        if work:
            self._llg.torch.fill_next_token_bitmask_par(executor, work, self.host_mask)

    def finish(self, job: Future, num_rows: int) -> torch.Tensor:
        """Wait for a fill (num_rows >= its rows: padding rows are all-allowed); -> the
        device bitmask [num_rows, words], its copy queued on the current stream."""
        self._wait(job)  # a token a matcher refused leaves it failed (GrammarState)
        mask = self.host_mask[:num_rows]
        if self._copied is None:
            return mask
        out = self.device_mask[:num_rows]
        out.copy_(mask, non_blocking=True)
        self._copied.record()
        return out

    def abandon(self, job: Future) -> None:
        """Wait out a fill whose step failed (its result, an error too, is dropped)."""
        with contextlib.suppress(Exception):
            self._wait(job)

    def _wait(self, job: Future) -> None:
        try:
            job.result()
        finally:
            self._unshorten()

    @staticmethod
    def _allow_all(mask: torch.Tensor) -> None:
        """Every bit of mask set, by numpy: torch's fill_ wakes its OpenMP threads, which then
        spin on the cores the executor's threads need (2-3x slower fills measured)."""
        mask.numpy().fill(ALL_ALLOWED)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._filler.shutdown(wait=True)
        self._unshorten()  # a fill that was started and never waited for

    def _unshorten(self) -> None:
        if self._shortened:
            self._shortened = False
            _SWITCH.restore()


class _SwitchInterval:
    """The process's GIL switch interval, shortened while any fill runs (fills of several
    engines may overlap): the first share saves the interval, the last one restores it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._shares = 0
        self._saved = 0.0

    def shorten(self) -> None:
        with self._lock:
            if not self._shares:
                self._saved = sys.getswitchinterval()
                sys.setswitchinterval(FILL_SWITCH_S)
            self._shares += 1

    def restore(self) -> None:
        with self._lock:
            self._shares -= 1
            if not self._shares:
                sys.setswitchinterval(self._saved)


_SWITCH = _SwitchInterval()


def _failed(state: GrammarState) -> None:
    """A matcher refused a token: it stays failed and allows only the end (GrammarState)."""
    if state.failure is None:
        state.failure = state.matcher.get_error() or "a token the grammar allowed was refused"


def check_grammar(spec: GrammarSpec, tokenizer: Any = None, vocab_size: int | None = None) -> None:
    """What compiling spec for a model would refuse (`batchgen validate`): ValueError saying
    why, as the compile's own would. With the model's tokenizer (and its vocabulary size),
    also a grammar no text matches or whose forced output never ends, as the run finds."""
    _check_checkable(spec)
    llg = _llguidance()
    try:
        problem = llg.LLMatcher.validate_grammar(_grammar(llg, spec), None)
    except Exception as exc:  # a schema llguidance cannot read raises ValueError
        problem = str(exc)
    if problem:
        raise _not_compiled(spec, problem)
    if tokenizer is None or vocab_size is None:
        return
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    ours = llg.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos)
    matcher = llg.LLMatcher(ours, _grammar(llg, spec), log_level=0)
    if matcher.is_error():
        raise _not_compiled(spec, matcher.get_error())
    _check_admits_text(spec, matcher)


def _check_checkable(spec: GrammarSpec) -> None:
    """ValueError where a complete output could not be checked against spec (output_check)."""
    problem = unchecked_problem(spec)
    if problem is not None:
        raise ValueError(f"{spec.kind} cannot be compiled: {problem}")


def _grammar(llg: Any, spec: GrammarSpec) -> str:
    """spec as llguidance's grammar text."""
    if spec.kind == "regex":
        return llg.LLMatcher.grammar_from_regex(spec.source)
    if spec.kind == "choice":
        return llg.LLMatcher.grammar_from_lark(_choice_lark(json.loads(spec.source)))
    return llg.LLMatcher.grammar_from_json_schema(spec.source, COMPACT_JSON)


def _check_admits_text(spec: GrammarSpec, lane: Any) -> None:
    """ValueError for a grammar that no text matches (a regex of an empty class, [^\\s\\S]):
    its matcher is dead from the start, where each sample would end at once, empty, as if
    it matched. Schemas that admit no value are refused as they compile."""
    probe = lane.deep_copy()
    probe.compute_bitmask()
    if probe.is_error() and not probe.is_accepting():
        raise ValueError(admits_nothing(spec))
    if len(lane.deep_copy().compute_ff_tokens()) >= FORCED_LIMIT:
        raise ValueError(endless(spec, FORCED_LIMIT))


def _not_compiled(spec: GrammarSpec, problem: str) -> ValueError:
    reason = " ".join(problem.split())[:300]
    return ValueError(f"{spec.kind} cannot be compiled ({reason}): fix it")


def _choice_lark(choices: list[str]) -> str:
    """start: "a" | "b", each choice a JSON-escaped string literal."""
    return "start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


# An extraction schema of the kind batch jobs run: nested object, enum, integer, array, string.
EXAMPLE_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 80},
        "category": {"enum": ["news", "review", "question", "other"]},
        "rating": {"type": "integer", "minimum": 1, "maximum": 5},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 4},
        "author": {
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 40},
                "verified": {"type": "boolean"},
            },
            "required": ["name", "verified"],
            "additionalProperties": False,
        },
    },
    "required": ["title", "category", "rating", "tags", "author"],
    "additionalProperties": False,
}
EXAMPLE_VALUE: dict[str, Any] = {
    "title": "A quiet week in the valley",
    "category": "news",
    "rating": 4,
    "tags": ["local", "weather"],
    "author": {"name": "Ann Smith", "verified": True},
}
