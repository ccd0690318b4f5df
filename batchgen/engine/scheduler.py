"""Continuous batching: pick each step's decode tokens and prefill chunks under a token budget."""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable, Sequence
from typing import NamedTuple

from batchgen.engine.block_manager import BlockManager
from batchgen.engine.prefix_cache import CacheStats
from batchgen.engine.request import Request, Status


class ScheduledChunk(NamedTuple):
    """One request's share of a step: positions [start, start + num_tokens)."""

    request: Request
    start: int
    num_tokens: int
    samples: bool  # the chunk ends at the request's newest token, so the step samples the next one
    relay_last: bool  # the newest token's value is still on the device (the token relay)
    admitted: bool = False  # the first chunk since the request was (re)admitted


class Batch(NamedTuple):
    """A scheduled step. Chunks with one query token (decodes) come first."""

    chunks: list[ScheduledChunk]
    num_tokens: int

    @property
    def num_samples(self) -> int:
        return sum(c.samples for c in self.chunks)


class Scheduler:
    """Owns the waiting queue and running list; hands blocks out through the BlockManager.

    Scheduling a chunk advances request.num_computed_tokens at once and counts a sampled token
    as pending, so the next step can be planned before this one's tokens reach the host.
    A request admitted with a cached prefix starts after it: cached tokens cost no budget.
    A waiting request holds no blocks: it takes shared ones only when it is admitted.
    """

    def __init__(
        self,
        blocks: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        enable_chunked_prefill: bool,
    ) -> None:
        self.blocks = blocks
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.chunked = enable_chunked_prefill
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._free_slots: list[int] = list(range(max_num_seqs - 1, -1, -1))
        self.num_preemptions = 0
        self._parents: list[Request] = []  # requests whose other samples wait for their prompt
        self.cache_stats = CacheStats()  # over first admissions (a preempted request's next
        # admission recomputes what it lost and is not counted again)
        # (tokens scheduled, tokens admission would bring the step to) -> tokens to stop at
        # (graphs.step_target); None: admit all that fits. Only with chunked prefill, which
        # lets a step stop inside a prompt.
        self.step_target: Callable[[int, int], int] | None = None

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> Batch:
        budget = self.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        i = 0
        block_size = self.blocks.block_size
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            i += 1
            total, computed = request.num_tokens, request.num_computed_tokens
            if total >= request.max_tokens:
                continue  # every token it may produce is launched; only post-processing left
            if total - computed == 1 and len(request.block_table) * block_size > computed:
                chunks.append(self._take_decode(request))  # the hot path: no new block needed
                budget -= 1
                continue
            size = self._chunk_size(request, budget)
            if size == 0 or not self._make_room(request, size):
                continue
            chunks.append(self._take(request, size))
            budget -= chunks[-1].num_tokens
        decodes_only = budget + len(chunks) == self.max_num_batched_tokens
        self._fork_ready()
        before = budget
        budget = self._admit(chunks, budget)
        if not decodes_only or budget != before:  # a longer chunk may precede a decode
            chunks.sort(key=lambda c: c.num_tokens != 1)  # stable: decodes first
        return Batch(chunks, self.max_num_batched_tokens - budget)

    def add_samples(self, first: Request, others: list[Request]) -> None:
        """n samples of one prompt: `first` prefills it; the others wait for that, then start
        from its prompt blocks (all but the block holding the last prompt token, which each
        recomputes, so that no block is ever written by two requests): found in the prefix
        cache, or (caching off) shared from `first` if it still runs, when they are admitted."""
        self.add(first)
        first.children = others
        if others:  # _fork_ready walks these every step: only parents with samples to fork
            self._parents.append(first)

    def _fork_ready(self) -> None:
        for parent in [p for p in self._parents if p.status is not Status.WAITING]:
            if (
                parent.status is Status.RUNNING
                and parent.num_computed_tokens < parent.num_prompt_tokens
            ):
                continue  # its prompt is not fully scheduled yet
            self._parents.remove(parent)
            for child in reversed(parent.children):
                child.block_hashes = parent.block_hashes
                child.prompt_source = parent
                self.waiting.appendleft(child)
            parent.children = []

    def finish(self, request: Request, reason: str) -> None:
        """End a request (stop, length or error) and give back its blocks and relay slot."""
        if request.children:  # samples not forked yet start on their own
            self.waiting.extendleft(reversed(request.children))
            request.children = []
            self._parents.remove(request)
        if request.status is Status.RUNNING:
            self.running.remove(request)
            self._release(request)
        elif request.status is Status.WAITING and request in self.waiting:
            self.waiting.remove(request)
        request.status = Status.FINISHED
        request.finish_reason = reason

    def _chunk_size(self, request: Request, budget: int, start: int | None = None) -> int:
        """Tokens of request to schedule from `start` (default: its computed tokens)."""
        start = request.num_computed_tokens if start is None else start
        remaining = request.num_tokens - start
        if remaining <= budget:
            return remaining
        return budget if self.chunked else 0

    def _make_room(self, request: Request, size: int) -> bool:
        """Preempt the newest running requests until request's chunk fits; False if it was one."""
        end = request.num_computed_tokens + size
        while not self.blocks.can_allocate(request, end):
            victim = self.running[-1]
            self._preempt(victim)
            if victim is request:
                return False
        return True

    def _admit(self, chunks: list[ScheduledChunk], budget: int) -> int:
        """Admit waiting requests into the step; -> the budget left."""
        if self.step_target is None or not self.chunked or not self.waiting:
            return self._admit_within(chunks, budget)
        used = self.max_num_batched_tokens - budget
        natural = used + self._admissible(budget)
        target = self.step_target(used, natural)
        if used < target < natural:  # the rest of the budget stays unspent
            return self._admit_within(chunks, target - used) + used + budget - target
        return self._admit_within(chunks, budget)

    def _admissible(self, budget: int) -> int:
        """The tokens _admit_within(budget) would take, if no request's blocks run out."""
        total = 0
        for request in itertools.islice(self.waiting, self.max_num_seqs - len(self.running)):
            if request.num_pending or total >= budget:
                break
            total += request.num_tokens - len(self._start_blocks(request)) * self.blocks.block_size
        return min(total, budget)

    def _admit_within(self, chunks: list[ScheduledChunk], budget: int) -> int:
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            if request.num_pending:  # preempted with a token in flight: wait for its value
                break
            prefix = self._start_blocks(request)
            start = len(prefix) * self.blocks.block_size
            size = self._chunk_size(request, budget, start)
            if size == 0 or not self.blocks.can_allocate(request, start + size, prefix):
                break
            self.waiting.popleft()
            request.status = Status.RUNNING
            request.slot = self._free_slots.pop()
            self.running.append(request)
            if not request.num_preemptions:
                self._count_admission(request, start if self.blocks.caching else 0)
            request.num_computed_tokens = start
            chunks.append(self._take(request, size, admitted=True, cached=prefix))
            budget -= size
        return budget

    def _start_blocks(self, request: Request) -> list[int]:
        """The blocks a waiting request starts from: its longest cached prompt prefix, or with
        caching off, the full prompt blocks (short of the last prompt token's) that the sample
        which prefilled its prompt holds and has scheduled, while that one runs. Taken only
        now: a waiting request holds no blocks, which preemption could not reclaim."""
        source = request.prompt_source
        if self.blocks.caching or source is None:
            return self.blocks.cached_prefix(request)
        if source.status is not Status.RUNNING:
            return []
        usable = min(request.num_prompt_tokens - 1, source.num_computed_tokens)
        return source.block_table[: usable // self.blocks.block_size]

    def _count_admission(self, request: Request, cached_tokens: int) -> None:
        stats = self.cache_stats
        self.cache_stats = CacheStats(
            stats.prompt_tokens + request.num_prompt_tokens, stats.cached_tokens + cached_tokens
        )

    def _take_decode(self, request: Request) -> ScheduledChunk:
        """_take for one token at the end of a sequence whose last block has room."""
        start = request.num_computed_tokens
        request.num_computed_tokens = start + 1
        relay_last = request.num_pending > 0
        request.num_pending += 1
        return ScheduledChunk(request, start, 1, True, relay_last)

    def _take(
        self, request: Request, size: int, admitted: bool = False, cached: Sequence[int] = ()
    ) -> ScheduledChunk:
        start = request.num_computed_tokens
        self.blocks.allocate(request, start + size, cached)
        request.num_computed_tokens = start + size
        samples = request.num_computed_tokens == request.num_tokens
        relay_last = request.num_pending > 0
        if samples:
            request.num_pending += 1
        return ScheduledChunk(request, start, size, samples, relay_last, admitted)

    def _preempt(self, request: Request) -> None:
        """Recompute later: drop its KV; it goes back to the front of the queue."""
        self.running.remove(request)
        self._release(request)
        request.num_lost_tokens = max(request.num_lost_tokens, request.num_computed_tokens)
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        request.status = Status.WAITING
        self.waiting.appendleft(request)

    def _release(self, request: Request) -> None:
        self.blocks.free(request)
        self._free_slots.append(request.slot)
        request.slot = -1
        request.num_synced_blocks = 0
