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
own lexer) and samples are spread over the lanes. Each step is two calls into llguidance from
the engine thread, both on one executor of `threads` Rust threads with the GIL dropped: the
matchers consume their newest tokens, then every constrained row's mask is filled. No Python
thread takes part, so no fill waits on the GIL. The work list holds each lane's rows
contiguously: the executor (rayon) splits the list into contiguous ranges, so a thread mostly
meets rows of one lane, and two threads meet on a lane's lock only where a range boundary
falls inside it.

JSON (json_schema, json_object) is generated compact, without free whitespace between tokens:
a weak model otherwise spends its token budget on newlines.

A sample's matcher has consumed exactly its output tokens known on the host
(`GrammarState.accepted` of them): preemption recomputes KV but keeps the output tokens, so
a matcher is never rolled back. Once the grammar is complete only the model's end-of-sequence
tokens are allowed, so a structured output ends "stop" when its grammar does, or "length"
when max_new_tokens cut it first (then it is incomplete, as with vLLM and OpenAI).
"""

from __future__ import annotations

import json
import os
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from batchgen.engine.sampling_params import SamplingParams
from batchgen.errors import BatchgenError

COMPILE_THREADS = 1  # one compile at a time, beside the engine thread
MAX_FILL_THREADS = 32  # beyond this a step's rows are too few to share out
ALL_ALLOWED = -1  # an int32 bitmask word with every bit set
COMPACT_JSON = {"whitespace_flexible": False}  # llguidance JSON options: "," and ":" alone
ANY_OBJECT = {"type": "object"}  # json_object: any JSON object, as OpenAI's json_object mode


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
        import llguidance
        import llguidance.hf
        import llguidance.torch
    except ImportError as exc:
        raise BatchgenError(
            "structured outputs (json_schema, regex, choice, json_object) need the llguidance "
            "package: pip install llguidance"
        ) from exc
    return llguidance


def fill_threads(cpu_threads: int | None) -> int:
    """Threads of the mask fill: the engine's cpu_threads when set (a rank's share of the
    machine), else every core this process may use (the engine thread waits meanwhile)."""
    threads = cpu_threads or len(os.sched_getaffinity(0))
    return max(1, min(MAX_FILL_THREADS, threads))


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
    """A sample's matcher, its lane's lexer, and how many output tokens it has consumed."""

    matcher: Any  # llguidance.LLMatcher
    lexer: int  # id of the lane matcher it was copied from: copies of one share a lexer
    accepted: int = 0


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
    ) -> None:
        self._llg = _llguidance()
        self._pool = ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="batchgen-grammar")
        self._cache: dict[GrammarSpec, Future] = {}  # spec -> future of its Compiled
        eos = sorted(eos_token_ids)
        self._tokenizer = self._pool.submit(self._make_tokenizer, tokenizer, vocab_size, eos)
        self.threads = threads
        self._executor = self._llg.LLExecutor(num_threads=threads)  # its calls drop the GIL
        width = (vocab_size + 31) // 32
        cuda = device.type == "cuda"
        # host_mask[row]: the step's bitmask, bit t of word w allows token 32 * w + t
        self.host_mask = torch.full((max_rows, width), ALL_ALLOWED, dtype=torch.int32)
        if cuda:
            self.host_mask = self.host_mask.pin_memory()
        self.device_mask = self.host_mask.to(device) if cuda else self.host_mask
        self._copied = torch.cuda.Event() if cuda else None  # host_mask may be rewritten

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
        return Compiled(spec, [self._lane(spec)])

    def _lane(self, spec: GrammarSpec) -> Any:
        llg = self._llg
        tokenizer = self._tokenizer.result()
        try:
            if spec.kind == "regex":
                grammar = llg.LLMatcher.grammar_from_regex(spec.source)
            elif spec.kind == "choice":
                grammar = llg.LLMatcher.grammar_from_lark(_choice_lark(json.loads(spec.source)))
            else:
                grammar = llg.LLMatcher.grammar_from_json_schema(spec.source, COMPACT_JSON)
            matcher = llg.LLMatcher(tokenizer, grammar, log_level=0)
            problem = matcher.get_error() if matcher.is_error() else None
        except Exception as exc:  # a schema llguidance cannot read raises ValueError
            problem = str(exc)
        if problem is not None:
            reason = " ".join(problem.split())[:300]
            raise ValueError(f"{spec.kind} cannot be compiled ({reason}): fix it")
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
        return GrammarState(lane.deep_copy(), id(lane))

    def fill(self, rows: list[Any], num_rows: int) -> torch.Tensor:
        """rows: the step's sampled requests in row order (padding rows follow, up to
        num_rows). -> device bitmask [num_rows, words] int32 (all-allowed where unconstrained).

        Each constrained matcher first consumes its sample's newest output token, then its
        row's mask is filled: one call each, on the executor's threads.
        """
        if self._copied is not None:
            self._copied.synchronize()  # the previous step's mask has left host_mask
        mask = self.host_mask[:num_rows]
        self._allow_all(mask)
        consume, work = self._step_work(rows)
        if consume:
            matchers = [m for m, _ in consume]
            _check_consumed(matchers, self._executor.consume_token_par(consume))
        if work:
            self._llg.torch.fill_next_token_bitmask_par(self._executor, work, mask)
        if self._copied is None:
            return mask
        out = self.device_mask[:num_rows]
        out.copy_(mask, non_blocking=True)
        self._copied.record()
        return out

    @staticmethod
    def _allow_all(mask: torch.Tensor) -> None:
        """Every bit of mask set, by numpy: torch's fill_ wakes its OpenMP threads, which then
        spin on the cores the executor's threads need (2-3x slower fills measured)."""
        mask.numpy().fill(ALL_ALLOWED)

    def _step_work(self, rows: list[Any]) -> tuple[list, list]:
        """-> ([(matcher, newest token)], [(matcher, row)]) of the constrained rows, each
        lane's rows contiguous in both lists (lanes in order of their first row)."""
        lanes: dict[int, tuple[list, list]] = {}  # lexer -> (consume pairs, work pairs)
        for i, request in enumerate(rows):
            state = request.grammar
            if state is None or request.finish_reason is not None:
                continue  # unconstrained, or ended: the row's token will be dropped
            consume, work = lanes.setdefault(state.lexer, ([], []))
            outputs = request.output_token_ids
            new = len(outputs) - state.accepted
            if new == 1:
                consume.append((state.matcher, outputs[-1]))
            elif new > 1:  # not sampled for a while (does not happen in the engine's loop)
                _check_consumed([state.matcher], [state.matcher.consume_tokens(outputs[-new:])])
            state.accepted = len(outputs)
            work.append((state.matcher, i))
        consume = [pair for lane, _ in lanes.values() for pair in lane]
        return consume, [pair for _, lane in lanes.values() for pair in lane]

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _check_consumed(matchers: list[Any], accepted: list[bool]) -> None:
    for matcher, ok in zip(matchers, accepted, strict=True):
        if not ok:
            raise RuntimeError(f"grammar refused a token it allowed: {matcher.get_error()}")


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
