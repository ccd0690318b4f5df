"""Step metadata: built on the host into one flat int64 buffer, sent to the device in one copy.

The buffer's segments, their order and sizes are declared in step_layout.py; this module fills
them from a scheduled Batch. relay_src is the relay row holding a token's value (the newest
token of a request whose value is still on the device), else -1. Block tables live on the
device, one row per relay slot; a step sends only new (slot, column, block) entries. Penalty
state (token counts per slot) is reset for slots in `resets`, marked from `prompt_marks` /
`output_counts` (slot, token) pairs known on the host at admission, and counted on the device
as tokens are sampled (`track`). `bans` are (sample row, token) pairs whose logit is -inf
(min_new_tokens). A step may be padded to a CUDA graph's sizes (Pad): padding uses the pad slot,
whose block-table row points at a scratch block, so padded work touches nothing real. A decode
step gets one-token padding rows; any other step gets zero-length padding sequences after its
own, padding tokens after its last sequence's (in no sequence, at position 0), and padding
sampled rows reading token row 0 (whose results are dropped).
prepare_step reads requests and never changes them: what the step sent is returned.
"""

from __future__ import annotations

from array import array
from itertools import chain, islice
from typing import NamedTuple

import numpy
import torch

from batchgen.engine.request import Request
from batchgen.engine.scheduler import Batch, ScheduledChunk
from batchgen.engine.step_layout import (
    MODEL_SEGMENTS,
    PAD_CONSTANTS,
    REQUEST_FLOATS,
    REQUEST_INTS,
    TAIL_SEGMENTS,
    Layout,
)

_TOP_K = list(REQUEST_INTS).index("top_k")
_LOGPROBS_K = list(REQUEST_INTS).index("logprobs_k")
_TRACK = list(REQUEST_INTS).index("track")
_TEMPERATURE = list(REQUEST_FLOATS).index("temperature")
_TOP_P = list(REQUEST_FLOATS).index("top_p")
_MIN_P = list(REQUEST_FLOATS).index("min_p")


class SamplingFlags(NamedTuple):
    """What the sampler must do this step (the host knows; the device never syncs for it)."""

    any_random: bool = False
    any_top_k: bool = False
    any_top_p_min_p: bool = False
    any_penalty: bool = False
    logprobs_k: int = -1  # the most alternatives any row asked for; -1 = no logprobs


class HostStep(NamedTuple):
    """What the host knows of a step once its inputs are written."""

    layout: Layout
    cu_seqlens: list[int]
    context_lens: list[int]
    num_decodes: int
    flags: SamplingFlags
    synced: list[tuple[Request, int]]  # (request, block-table entries now on the device)
    # padded to a graph of steps with prefill chunks: the counts that differ between steps
    # of one padded shape (decode rows, the prefill rows' sequences) are read on the device
    shape_only: bool = False


class Pad(NamedTuple):
    """The model-part sizes a step is padded to (a CUDA graph's): T tokens, B sequences, S
    sampled rows. T == B == S: a decode graph (one-token padding rows); otherwise a graph of
    steps with prefill chunks (B > S: room for one padding sequence after any step's own)."""

    T: int
    B: int
    S: int

    @property
    def decode(self) -> bool:
        return self.T == self.B == self.S


_MINUS_ONE, _ZERO = array("q", (-1,)), array("q", (0,))
_PER_TOKEN = tuple(name for name, rows in MODEL_SEGMENTS if rows == "T")
_POSITIONS = array("q", range(4096))  # positions [a, b) of a chunk: a slice (grown on demand)


def _positions(start: int, end: int) -> array:
    global _POSITIONS
    if end > len(_POSITIONS):
        _POSITIONS = array("q", range(max(end, 2 * len(_POSITIONS))))
    return _POSITIONS[start:end]


class _Lists:
    """One step's metadata, named as the layout's segments: an int64 array per per-token
    segment (a prefill chunk's tokens go in by slices and repeats, not one Python int each),
    Python lists for the rest."""

    def __init__(self) -> None:
        for name, _ in MODEL_SEGMENTS:
            setattr(self, name, array("q") if name in _PER_TOKEN else [])
        for name, _, _ in TAIL_SEGMENTS:
            setattr(self, name, [])
        self.cu_seqlens = [0]
        self.samples: list[tuple[int, int, int]] = []  # (slot, rng key, position) per row
        self.sample_ints: list[tuple[int, ...]] = []
        self.sample_floats: list[tuple[float, ...]] = []
        self.synced: list[tuple[Request, int]] = []


def prepare_step(
    batch: Batch, pad_to: int | Pad = 0, pad_slot: int = -1
) -> tuple[HostStep, torch.Tensor]:
    """-> the step's host facts and its flat int64 metadata (a CPU tensor of layout.size).

    pad_to: a Pad, or B for Pad(B, B, B): a decode-only batch of fewer rows gets one-token
    rows in pad_slot; for a Pad with B > S (any batch that fits it), see _add_shape_padding.
    """
    pad = Pad(pad_to, pad_to, pad_to) if isinstance(pad_to, int) else pad_to
    L = _Lists()
    chunks = batch.chunks
    real = len(chunks)
    i = 0
    while i < real:
        plain = _plain_run(chunks, i)
        if plain > i:  # rows [i, plain) in bulk
            _add_plain_decodes(L, i, chunks[i:plain])
            i = plain
        else:
            _add_chunk(L, i, chunks[i])
            i += 1
    shape_only = not pad.decode
    if shape_only:
        _add_shape_padding(L, pad, pad_slot)
    else:
        for i in range(real, pad.B):
            _add_padding(L, i, pad_slot)
    S = len(L.samples)
    tail_rows = [len(getattr(L, name)) // width for name, _, width in TAIL_SEGMENTS]
    layout = Layout(len(L.ids), len(L.context_lens), S, *tail_rows)
    # columns of the per-row values, transposed once: packed, and read for the flags
    int_cols = list(zip(*L.sample_ints, strict=True)) if S else []
    float_cols = list(zip(*L.sample_floats, strict=True)) if S else []
    # array.array packs Python ints ~10x faster than torch.tensor(list)
    ints = array("q")
    for name, _ in MODEL_SEGMENTS:  # fromlist: 2.5x faster than from an iterator
        segment = getattr(L, name)
        if name in _PER_TOKEN:
            ints.extend(segment)  # an array: one copy
        else:
            ints.fromlist(segment)
    ints.extend(chain.from_iterable((*zip(*L.samples, strict=True), *int_cols)))
    ints.frombytes(array("d", chain.from_iterable(float_cols)).tobytes())  # float64 bits
    ints.extend(chain.from_iterable(getattr(L, name) for name, _, _ in TAIL_SEGMENTS))
    # a view of the array (which it keeps alive): no copy here, one into the pinned buffer
    flat = torch.frombuffer(ints, dtype=torch.int64) if ints else torch.empty(0).long()
    num_decodes = sum(c.num_tokens == 1 for c in batch.chunks)
    if not shape_only:  # one-token padding rows are decodes too
        num_decodes += len(L.context_lens) - real
    flags = _flags(int_cols, float_cols) if S else SamplingFlags()
    host = HostStep(layout, L.cu_seqlens, L.context_lens, num_decodes, flags, L.synced, shape_only)
    return host, flat


class StepPacker:
    """prepare_step for one runner's steps, in launch order, with a fast path for steady
    decoding. A step whose rows are decodes of the same requests, in the same order and
    padding, as the step packed just before it (each with its newest token in flight, none
    admitted since, none inside min_new_tokens) differs from that one only in each row's
    position and context length, and in the block-table entries of rows that opened a block:
    everything else such a row packs (its relay slot, row indices, sampler key and sampling
    constants) is fixed from its admission to its end, and a request released or admitted
    again since comes with an admitted chunk. So such a step copies the previous buffer up to
    its tail, writes those columns, and appends the new entries."""

    def __init__(self) -> None:
        self._last: _SteadyStep | None = None

    def prepare(
        self, batch: Batch, pad_to: int | Pad = 0, pad_slot: int = -1
    ) -> tuple[HostStep, torch.Tensor]:
        chunks = batch.chunks
        last = self._last
        if last is not None and last.pad == (pad_to, pad_slot):
            grown = _steady_rows(chunks, last.requests)
            if grown is not None:
                return last.repeat(chunks, grown)
        host, flat = prepare_step(batch, pad_to, pad_slot)
        requests = [c.request for c in chunks]
        steady = bool(chunks) and _steady_rows(chunks, requests) is not None
        self._last = _SteadyStep(requests, host, flat, (pad_to, pad_slot)) if steady else None
        return host, flat


def _steady_rows(chunks: list[ScheduledChunk], requests: list[Request]) -> list[Request] | None:
    """None unless chunks are decodes of `requests`, in order, each relaying its newest token,
    not admitted, and past min_new_tokens (no bans); -> those with block-table entries to send."""
    if len(chunks) != len(requests):
        return None
    grown = []
    for c, r in zip(chunks, requests, strict=True):
        # _plain_run's conditions less the block entries, written out: a shared predicate
        # costs ~15 us per 256-row step on this hot path (development CPU)
        if (
            c.request is not r
            or c.num_tokens != 1
            or not c.relay_last
            or c.admitted
            or c.start + 1 - len(r.prompt_token_ids) < r.params.min_new_tokens
        ):
            return None
        if r.num_synced_blocks != len(r.block_table):
            grown.append(r)
    return grown


class _SteadyStep:
    """A packed step of steady decodes only, kept to pack the next one like it."""

    def __init__(
        self, requests: list[Request], host: HostStep, flat: torch.Tensor, pad: tuple[int, int]
    ) -> None:
        self.requests, self.pad = requests, pad
        layout, real = host.layout, len(requests)
        self.layout = layout._replace(U=0)  # its only tail: block-table entries (updates)
        self.host = host._replace(layout=self.layout, synced=[])
        self.values = flat.numpy()[: layout.tail_offset].copy()
        self.positions = _rows(layout.model_offset("positions"), real)  # a row's: its start
        self.ends = (  # start + 1: the context length, and the position of the sampled token
            _rows(layout.model_offset("context_lens"), real),
            _rows(layout.sample_offset("positions"), real),
        )
        self.padding = host.context_lens[real:]

    def repeat(
        self, chunks: list[ScheduledChunk], grown: list[Request]
    ) -> tuple[HostStep, torch.Tensor]:
        values = self.values.copy()
        starts = [c.start for c in chunks]
        ends = [s + 1 for s in starts]
        values[self.positions] = starts
        for rows in self.ends:
            values[rows] = ends
        host = self.host._replace(
            cu_seqlens=list(self.host.cu_seqlens), context_lens=ends + self.padding
        )
        if grown:  # the updates segment, as _add_chunk writes it
            updates = array("q")
            for r in grown:
                for col in range(r.num_synced_blocks, len(r.block_table)):
                    updates.extend((r.slot, col, r.block_table[col]))
            values = numpy.concatenate((values, numpy.frombuffer(updates, dtype=numpy.int64)))
            host = host._replace(
                layout=self.layout._replace(U=len(updates) // 3),
                synced=[(r, len(r.block_table)) for r in grown],
            )
        return host, torch.from_numpy(values)


def _rows(offset: int, count: int) -> slice:
    return slice(offset, offset + count)


def _flags(int_cols: list[tuple[int, ...]], float_cols: list[tuple[float, ...]]) -> SamplingFlags:
    temperature, top_p, min_p = float_cols[_TEMPERATURE], float_cols[_TOP_P], float_cols[_MIN_P]
    return SamplingFlags(
        any_random=any(temperature),
        any_top_k=any(int_cols[_TOP_K]),
        any_top_p_min_p=min(top_p) < 1.0 or any(min_p),
        any_penalty=any(int_cols[_TRACK]),
        logprobs_k=max(int_cols[_LOGPROBS_K]),
    )


def _plain_run(chunks: list[ScheduledChunk], first: int) -> int:
    """End of the run of plain decodes from chunks[first]: one relayed token, sampled, no new
    block entries, no penalty state to send, no tokens banned (what _add_chunk would do in
    bulk). first itself when chunks[first] is not one."""
    k = first
    for c in islice(chunks, first, None):  # no copy of the step's tail per call
        r = c.request
        if (  # (_steady_rows checks the same, block entries aside)
            c.num_tokens != 1
            or not c.relay_last
            or c.admitted
            or r.num_synced_blocks != len(r.block_table)
            or c.start + 1 - len(r.prompt_token_ids) < r.params.min_new_tokens
        ):
            break
        k += 1
    return k


def _add_plain_decodes(L: _Lists, first: int, chunks: list[ScheduledChunk]) -> None:
    """_add_chunk for the plain decodes chunks, rows first.. of the step, list by list."""
    k = len(chunks)
    token = L.cu_seqlens[-1]  # one token per row: row first + j is token token + j
    requests = [c.request for c in chunks]
    slots = [r.slot for r in requests]
    starts = [c.start for c in chunks]
    ends = [s + 1 for s in starts]
    constants = [r.sampling_constants for r in requests]
    L.ids.extend(_ZERO * k)
    L.relay_src.fromlist(slots)
    L.positions.fromlist(starts)
    L.seq_idx.extend(_positions(first, first + k))
    L.cu_seqlens.extend(range(token + 1, token + k + 1))
    L.context_lens.extend(ends)
    L.seq_slots.extend(slots)
    L.sample_idx.extend(range(token, token + k))
    L.samples.extend(zip(slots, [r.rng_key for r in requests], ends, strict=True))
    L.sample_ints.extend(c[0] for c in constants)
    L.sample_floats.extend(c[1] for c in constants)


def _add_chunk(L: _Lists, i: int, chunk: ScheduledChunk) -> None:
    r, start, n = chunk.request, chunk.start, chunk.num_tokens
    end = start + n
    if n == 1 and chunk.relay_last:  # the common decode: the input is the relayed token
        L.ids.append(0)
        L.relay_src.append(r.slot)
        L.positions.append(start)
        L.seq_idx.append(i)
    else:
        known_end = end - 1 if chunk.relay_last else end
        L.ids.fromlist(_token_slice(r.prompt_token_ids, r.output_token_ids, start, known_end))
        L.relay_src.extend(_MINUS_ONE * (known_end - start))
        if chunk.relay_last:
            L.ids.append(0)
            L.relay_src.append(r.slot)
        L.positions.extend(_positions(start, end))
        L.seq_idx.extend(array("q", (i,)) * n)
    L.cu_seqlens.append(L.cu_seqlens[-1] + n)
    L.context_lens.append(end)
    L.seq_slots.append(r.slot)
    if r.num_synced_blocks < len(r.block_table):
        for col in range(r.num_synced_blocks, len(r.block_table)):
            L.updates.extend((r.slot, col, r.block_table[col]))
        L.synced.append((r, len(r.block_table)))
    if chunk.admitted and r.params.uses_penalties:
        _add_penalty_state(L, r)
    if chunk.samples:
        _add_sample(L, r, L.cu_seqlens[-1] - 1, end)


def _add_penalty_state(L: _Lists, r: Request) -> None:
    """A (re)admitted request with penalties: reset its slot's counts, mark what is known."""
    L.resets.append(r.slot)
    for token in set(r.prompt_token_ids):
        L.prompt_marks.extend((r.slot, token))
    for token in r.output_token_ids:
        L.output_counts.extend((r.slot, token))


def _add_sample(L: _Lists, r: Request, row_token: int, position: int) -> None:
    if position - r.num_prompt_tokens < r.params.min_new_tokens:  # outputs before this one
        row = len(L.samples)
        for token in r.ending_ids:
            L.bans.extend((row, token))
    L.sample_idx.append(row_token)
    L.samples.append((r.slot, r.rng_key, position))
    ints, floats = r.sampling_constants
    L.sample_ints.append(ints)
    L.sample_floats.append(floats)


def _add_padding(L: _Lists, i: int, pad_slot: int) -> None:
    L.ids.append(0)
    L.relay_src.append(-1)
    L.positions.append(0)
    L.seq_idx.append(i)
    L.cu_seqlens.append(L.cu_seqlens[-1] + 1)
    L.context_lens.append(1)
    L.seq_slots.append(pad_slot)
    L.sample_idx.append(L.cu_seqlens[-1] - 1)
    L.samples.append((pad_slot, 0, 1))
    L.sample_ints.append(PAD_CONSTANTS[0])
    L.sample_floats.append(PAD_CONSTANTS[1])


def _add_shape_padding(L: _Lists, pad: Pad, pad_slot: int) -> None:
    """Pad a step's lists to pad's sizes: zero-length sequences in pad_slot after the step's
    own (at least one: the padding tokens' row in seq_idx), padding tokens after the last
    sequence's tokens (in no sequence: attention never reads or writes their rows; their K/V
    go to the scratch block), and sampled rows of token row 0 (a real row: finite logits)."""
    T, B, S = len(L.ids), len(L.context_lens), len(L.samples)
    if T > pad.T or B >= pad.B or S > pad.S:
        raise ValueError(f"a step of {T} tokens, {B} sequences, {S} samples exceeds {pad}")
    L.cu_seqlens.extend([T] * (pad.B - B))
    L.context_lens.extend([0] * (pad.B - B))
    L.seq_slots.extend([pad_slot] * (pad.B - B))
    n = pad.T - T
    L.ids.extend(_ZERO * n)
    L.relay_src.extend(_MINUS_ONE * n)
    L.positions.extend(_ZERO * n)
    L.seq_idx.extend(array("q", (pad.B - 1,)) * n)
    n = pad.S - S
    L.sample_idx.extend([0] * n)
    L.samples.extend([(pad_slot, 0, 1)] * n)
    L.sample_ints.extend([PAD_CONSTANTS[0]] * n)
    L.sample_floats.extend([PAD_CONSTANTS[1]] * n)


def _token_slice(prompt: list[int], output: list[int], start: int, end: int) -> list[int]:
    n = len(prompt)
    if end <= n:
        return prompt[start:end]
    return prompt[start:] + output[max(0, start - n) : end - n]
