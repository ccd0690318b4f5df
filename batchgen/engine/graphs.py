"""CUDA graphs for whole steps at padded sizes: decode steps, and steps with prefill chunks.

A decode-only step (every sequence has one query token and samples) of B sequences is padded
to the smallest decode size >= B; a step with prefill chunks (or a decode step larger than every
decode size) of T tokens is padded to the smallest token size >= T, with room for every
sequence and sampled row a step can have (Pad in step_inputs), where that padding is cheap
(SMALL_STEP, PAD_SHARE; other steps run eagerly as they are). The scheduler stops admitting
prompts at a token size where a step would otherwise fall between sizes with costly padding
(step_target): the step then replays that size's graph unpadded, and the rest of its last
prompt joins the next step. The step's fixed metadata is
copied into the graph's static input buffer and the graph replays the whole forward pass to
logits. Sampling stays outside the graph.

A graph of a padded step reads nothing that differs between steps of its shape on the host:
the attention backend takes the step's decode count on the device (AttentionMetadata), so one
graph serves every mix of decode rows and prefill chunks that fits it. Without graphs such a
step's forward is launched op by op, which on a 1b model takes longer on the host than the
device takes to run it.

The largest decode size is captured at start-up, and with it the memory pool all graphs share.
The other decode sizes are captured at start-up too, or (first_use) before their
CAPTURE_AT_STEP-th step, the steps before it replaying the smallest larger graph captured: a
job's start-up then skips most of the capture (1.3-1.9 s on an 8b model), and sizes met only a
few times (a job's last steps) cost padding rows instead of captures. Token sizes are captured
at start-up ("startup"), or (first_use) at their second step: the first runs eagerly at the
padded shape, which warms what the capture records (kernel compiles, GEMM choices), so a token
size met once costs nothing extra. The steps of all token sizes return their logits in one
buffer (the first such graph's), so their outputs do not each hold memory. Captures at start-up
wait for the device and release the allocator's cache (torch.cuda.graph); one between steps is
recorded while the step in flight runs on (its padding inputs reach the static buffer in stream
order, after that step has read it), and keeps the cache the next eager step allocates from. A
capture that fails leaves that size to run eagerly (the same inputs, padding included), with a
warning.
"""

from __future__ import annotations

import bisect
import contextlib
import time
import warnings
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from typing import NamedTuple

import torch

from batchgen.engine.scheduler import Batch
from batchgen.engine.step_inputs import HostStep, Pad, prepare_step
from batchgen.engine.step_layout import Layout

Forward = Callable[[torch.Tensor, HostStep], torch.Tensor]  # (flat step buffer, host) -> logits

# token sizes of steps with prefill chunks (about 1.5x apart: padding adds at most half a
# step's tokens); those above the token budget give way to the budget itself
TOKEN_LADDER = (256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144, 8192, 12288, 16384)
# A step padded to at most SMALL_STEP tokens always replays its graph: its GEMMs are short, so
# launching it op by op would leave the device waiting on the host. A larger step runs long
# enough on the device to hide its launches, while its padding costs compute in proportion:
# it replays only when padding adds at most 1/PAD_SHARE of the padded size (a step that
# fills the token budget); the scheduler stops admitting at a token size for the others
# (step_target), and the few it cannot cut (no prompt to admit) run eagerly as they are. (1b
# job, 8,192 rows x 16 tokens on an H200: padding every such step up the ladder cost 6.5% more
# device time.)
SMALL_STEP = 1024
PAD_SHARE = 32
# first_use: a decode size without its graph replays the smallest captured decode graph above
# it until its CAPTURE_AT_STEP-th step, which captures its own. Padding rows cost device time
# on every step (at most ~7 ms on an 8b model: a 256-row step against a few rows); a capture
# costs the host a warm-up forward and the recording while the device waits (~50 ms on 8b),
# so a size met a few times (the shrinking tail of a job: 192, 128, 96, 32, 16, 4 and 2
# sequences, one step each, end a 1,024 x 256 job) is cheaper padded than captured. (The
# larger graph's decode attention is split for its own row count, so a few rows of very long
# contexts read their KV with fewer programs on those steps: a cost bounded by the steps.)
# The real rows of a larger graph get the logits that batch size computes: in bfloat16 they
# may differ from their own size's in the last bits (GEMM and attention split choices), as
# they do between any two batch sizes, and a greedy tie can then break the other way.
CAPTURE_AT_STEP = 8


def token_sizes(budget: int, wanted: tuple[int, ...] | None) -> tuple[int, ...]:
    """The token sizes graphs are captured at: wanted (None = TOKEN_LADDER), those above the
    budget dropped, and the budget itself added where a ladder was asked for."""
    if wanted is None:
        return tuple(sorted({s for s in TOKEN_LADDER if s < budget} | {budget}))
    return tuple(sorted({s for s in wanted if s <= budget}))


def step_target(sizes: Sequence[int], used: int, natural: int) -> int:
    """Where a step should stop admitting prompts, given the token sizes with graphs (sorted):
    it has `used` tokens scheduled, and admitting all it may would bring it to `natural`.
    natural where that step replays a graph (small, or padded cheaply) or no size is near;
    else the largest size above `used` and below natural, so the step replays that size's
    graph unpadded and the rest of its last prompt goes to the next step (chunked prefill)."""
    i = bisect.bisect_left(sizes, natural)
    if i == 0 or i == len(sizes) or pads_cheaply(sizes[i], natural):
        return natural
    below = sizes[i - 1]
    return below if below > used else natural


def pads_cheaply(size: int, tokens: int) -> bool:
    """Does a step of `tokens` replay the graph of token size `size` (>= tokens)?"""
    return size <= SMALL_STEP or (size - tokens) * PAD_SHARE <= size


class CaptureReport(NamedTuple):
    sizes: tuple[int, ...]
    seconds: float
    pool_bytes: int  # device memory the graphs hold (allocated while capturing)


class StepGraphs:
    """forward: the runner's forward pass (capturable for padded layouts); pad_slot: the relay
    slot padding uses; sizes: decode batch sizes, those above limit dropped; tokens: token
    sizes of steps with prefill chunks (token_sizes); max_seqs: the most sequences a step
    has; first_use: capture all but the largest decode size at their CAPTURE_AT_STEP-th
    step (and token sizes at their second), not now."""

    def __init__(
        self,
        forward: Forward,
        device: torch.device,
        pad_slot: int,
        sizes: tuple[int, ...],
        limit: int,
        first_use: bool = False,
        tokens: tuple[int, ...] = (),
        max_seqs: int = 0,
    ) -> None:
        self.sizes = sorted({s for s in sizes if s <= limit})
        self.tokens = sorted(tokens) if max_seqs else []
        self.max_seqs = max_seqs
        self.forward, self.device, self.pad_slot = forward, device, pad_slot
        pads = [self._decode_pad(s) for s in self.sizes[-1:]]
        pads += [self._token_pad(t) for t in self.tokens[-1:]]
        biggest = max((Layout(*p).fixed_size for p in pads), default=0)
        self.static = torch.zeros(biggest, dtype=torch.int64, device=device)
        self.graphs: dict[Pad, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.eager: set[Pad] = set()  # pads whose capture failed: their steps run eagerly
        self.seen: set[Pad] = set()  # token pads run once eagerly (first_use)
        self.borrowed: Counter[Pad] = Counter()  # decode pads' steps on a larger graph (first_use)
        self.first_use = first_use
        self.pool = torch.cuda.graph_pool_handle()
        self.stream = torch.cuda.Stream(device)  # every capture's (warmed once, then reused)
        self._token_logits: torch.Tensor | None = None  # the token pads' shared output
        decode = [self._decode_pad(s) for s in (self.sizes[-1:] if first_use else self.sizes)]
        token = [] if first_use else [self._token_pad(t) for t in self.tokens]
        self.report = self._capture_all(decode, token)

    def close(self) -> None:
        """Release the graphs and their memory pool now (not at the next garbage collection)."""
        for graph, _ in self.graphs.values():
            graph.reset()
        self.graphs.clear()
        self.static = None
        self.forward = None
        self._token_logits = None

    def _decode_pad(self, size: int) -> Pad:
        return Pad(size, size, size)

    def _token_pad(self, tokens: int) -> Pad:
        # one sequence more than a step can have: the padding tokens' sequence (step_inputs)
        return Pad(tokens, self.max_seqs + 1, self.max_seqs)

    def padded_size(self, batch: Batch) -> Pad | None:
        """The padded shape this step replays at, or None to run it as it is."""
        b, t = len(batch.chunks), batch.num_tokens
        if b == 0:
            return None
        if t == b and batch.num_samples == b:
            i = bisect.bisect_left(self.sizes, b)
            if i < len(self.sizes):
                return self._decode_step_pad(i)
        if b > self.max_seqs or batch.num_samples > self.max_seqs:
            return None
        i = bisect.bisect_left(self.tokens, t)
        if i == len(self.tokens):
            return None
        size = self.tokens[i]
        if not pads_cheaply(size, t):
            return None  # too much padding for a step this long
        return self._token_pad(size)

    def _decode_step_pad(self, i: int) -> Pad:
        """The pad of a decode step whose size is sizes[i]: its own, or (first_use, before its
        CAPTURE_AT_STEP-th step) the smallest larger one with a graph. Counts the step."""
        pad = self._decode_pad(self.sizes[i])
        if not self.first_use or pad in self.graphs or pad in self.eager:
            return pad
        self.borrowed[pad] += 1
        if self.borrowed[pad] >= CAPTURE_AT_STEP:
            return pad  # replay() captures it
        larger = (self._decode_pad(s) for s in self.sizes[i + 1 :])
        return next((p for p in larger if p in self.graphs), pad)

    def replay(self, flat: torch.Tensor, host: HostStep) -> torch.Tensor:
        """The step's logits, by its graph (captured now if this is its size's first step, or
        under first_use a decode size's CAPTURE_AT_STEP-th or a token size's second)."""
        layout = host.layout
        pad = Pad(layout.T, layout.B, layout.S)
        if pad not in self.graphs:
            if pad in self.eager:
                return self.forward(flat, host)
            if not pad.decode and self.first_use and pad not in self.seen:
                self.seen.add(pad)  # the first step of a token size warms its capture
                return self.forward(flat, host)
            if not self._capture_now(pad):
                return self.forward(flat, host)
        graph, logits = self.graphs[pad]
        self.static[: layout.fixed_size].copy_(flat[: layout.fixed_size])
        graph.replay()
        return logits

    @torch.inference_mode()
    def _capture_all(self, decode: list[Pad], token: list[Pad]) -> CaptureReport:
        device = self.device
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        started = time.perf_counter()
        # largest first: smaller graphs reuse its pool; each warmed on the capture stream
        for pad in [*reversed(decode), *reversed(token)]:
            self._warm(pad)
            self.graphs[pad] = self._capture(pad)
        torch.cuda.synchronize(device)
        return CaptureReport(
            tuple(p.B for p in decode) + tuple(p.T for p in token),
            time.perf_counter() - started,
            torch.cuda.memory_allocated(device) - before,
        )

    def _capture_now(self, pad: Pad) -> bool:
        """Capture `pad` between steps (first_use); False: it failed, and runs eagerly."""
        try:
            with torch.inference_mode():
                if pad.decode:  # a token size ran eagerly at its shape before (seen)
                    self._warm(pad)
                self.graphs[pad] = self._capture(pad, drain=False)
            return True
        except Exception as exc:  # the device stays usable; this size's steps run eagerly
            with contextlib.suppress(Exception):
                torch.cuda.synchronize(self.device)
            self.eager.add(pad)
            text = str(exc).strip().splitlines()
            reason = f"{type(exc).__name__}: {text[0][:160]}" if text else type(exc).__name__
            what = (
                f"decode steps of {pad.B} sequences"
                if pad.decode
                else f"steps of up to {pad.T} tokens"
            )
            warnings.warn(
                f"batchgen: the CUDA graph for {what} could not be captured, those steps run "
                f"eagerly ({reason})",
                stacklevel=3,
            )
            return False

    @contextlib.contextmanager
    def _recording(self, graph: torch.cuda.CUDAGraph) -> Iterator[None]:
        """torch.cuda.graph without its device synchronize and cache release."""
        with torch.cuda.stream(self.stream):
            graph.capture_begin(pool=self.pool, capture_error_mode="thread_local")
            try:
                yield
            finally:
                graph.capture_end()

    def _padding_step(self, pad: Pad) -> HostStep:
        """An all-padding step of pad's shape, its inputs in the static buffer: valid inputs
        that touch only scratch."""
        host, staged = prepare_step(Batch([], 0), pad, self.pad_slot)
        self.static[: host.layout.fixed_size].copy_(staged[: host.layout.fixed_size])
        return host

    def _warm(self, pad: Pad) -> None:
        """Run pad's forward on the capture stream (kernel compiles, cuBLAS's workspace for
        this stream, lazy initialisation stay out of the graph): the first pad twice (it
        warms what all share), the others once."""
        host = self._padding_step(pad)
        stream = self.stream
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(1 if self.graphs else 2):
                self.forward(self.static, host)
        torch.cuda.current_stream(self.device).wait_stream(stream)

    def _capture(self, pad: Pad, drain: bool = True) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """Capture an all-padding step of pad's shape. Only this thread's CUDA calls are
        checked while it captures: the engine's other threads (a grammar's mask fill waits on
        a copy event) go on. drain: first wait for the device and release the allocator's
        cached memory (torch.cuda.graph's way, at start-up); else (between steps) the step in
        flight runs on while this one is recorded, and the next eager step finds its memory
        still cached."""
        host = self._padding_step(pad)  # stream-ordered after the step in flight
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        graph = torch.cuda.CUDAGraph()
        with (
            torch.cuda.graph(
                graph, pool=self.pool, stream=self.stream, capture_error_mode="thread_local"
            )
            if drain
            else self._recording(graph)
        ):
            logits = self.forward(self.static, host)
            if not pad.decode:  # every token size's logits in the first one's buffer
                if self._token_logits is None:
                    self._token_logits = logits
                else:
                    self._token_logits.copy_(logits)
                    logits = self._token_logits
        return graph, logits
