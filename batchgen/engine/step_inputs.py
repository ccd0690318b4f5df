"""Step metadata: built on the host into one flat int64 buffer, sent to the device in one copy.

Model part (copied into a CUDA graph's static buffer for graphed decode steps), for T tokens,
B sequences and S sampled rows:
  ids[T] relay_src[T] positions[T] seq_idx[T] cu_seqlens[B+1] context_lens[B] seq_slots[B]
  sample_idx[S]
Sampling part (used by the eager sampler):
  sample_slots[S] rng_keys[S] sample_pos[S] top_k[S] logprobs_k[S] track[S]
  temperature[S] top_p[S] min_p[S] repetition[S] presence[S] frequency[S]   (float64 bits)
  updates[3U] resets[R] prompt_marks[2M] output_counts[2C] bans[2Z]
relay_src is the relay row holding a token's value (the newest token of a request whose value
is still on the device), else -1. Block tables live on the device, one row per relay slot; a
step sends only new (slot, column, block) entries. Penalty state (token counts per slot) is
reset for slots in `resets`, marked from `prompt_marks`/`output_counts` (slot, token) pairs
known on the host at admission, and counted on the device as tokens are sampled (`track`).
`bans` are (sample row, token) pairs whose logit is -inf (min_new_tokens). A decode step may
be padded to a CUDA-graph batch size: padding rows use the pad slot, whose block-table row
points at a scratch block, so padded work touches nothing real.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from batchgen.engine.request import Request
from batchgen.engine.scheduler import Batch, ScheduledChunk

NUM_SAMPLE_INTS = 6
NUM_SAMPLE_FLOATS = 6


class Layout(NamedTuple):
    T: int
    B: int
    S: int
    U: int = 0
    R: int = 0
    M: int = 0
    C: int = 0
    Z: int = 0

    @property
    def fixed_size(self) -> int:
        return 4 * self.T + 3 * self.B + 1 + self.S

    @property
    def size(self) -> int:
        sampling = (NUM_SAMPLE_INTS + NUM_SAMPLE_FLOATS) * self.S
        return self.fixed_size + sampling + 3 * self.U + self.R + 2 * (self.M + self.C + self.Z)


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


class DeviceStep(NamedTuple):
    """Views of the model part of the device buffer."""

    ids: torch.Tensor
    relay_src: torch.Tensor
    positions: torch.Tensor
    seq_idx: torch.Tensor
    cu_seqlens: torch.Tensor
    context_lens: torch.Tensor
    seq_slots: torch.Tensor
    sample_idx: torch.Tensor


class SamplingInputs(NamedTuple):
    """Views of the sampling part of the device buffer."""

    slots: torch.Tensor  # [S]
    rng_keys: torch.Tensor
    positions: torch.Tensor  # position the sampled token will take
    top_k: torch.Tensor
    logprobs_k: torch.Tensor
    track: torch.Tensor  # 1 = count sampled tokens for penalties
    temperature: torch.Tensor  # [S] float64 views from here on
    top_p: torch.Tensor
    min_p: torch.Tensor
    repetition: torch.Tensor
    presence: torch.Tensor
    frequency: torch.Tensor
    updates: torch.Tensor  # [U, 3]
    resets: torch.Tensor  # [R]
    prompt_marks: torch.Tensor  # [M, 2]
    output_counts: torch.Tensor  # [C, 2]
    bans: torch.Tensor  # [Z, 2]


class _Lists:
    """Python lists of one step's metadata, in layout order."""

    def __init__(self) -> None:
        for name in (
            "ids",
            "relay_src",
            "positions",
            "seq_idx",
            "ctx",
            "slots",
            "samples",
            "sample_ints",
            "sample_floats",
            "updates",
            "resets",
            "prompt_marks",
            "output_counts",
            "bans",
        ):
            setattr(self, name, [])
        self.cu = [0]


_PAD_SAMPLE_INTS = (0, -1, 0)  # top_k off, no logprobs, no penalty tracking
_PAD_SAMPLE_FLOATS = (0.0, 1.0, 0.0, 1.0, 0.0, 0.0)  # greedy, no filters, no penalties


def prepare_step(
    batch: Batch, pad_to: int = 0, pad_slot: int = -1
) -> tuple[HostStep, torch.Tensor]:
    """-> the step's host facts and its flat int64 metadata (a CPU tensor of layout.size).

    pad_to > len(batch.chunks) pads a decode-only batch with one-token rows in pad_slot.
    """
    L = _Lists()
    for i, chunk in enumerate(batch.chunks):
        _add_chunk(L, i, chunk)
    real = len(batch.chunks)
    for i in range(real, pad_to):
        _add_padding(L, i, pad_slot)
    S = len(L.samples)
    layout = Layout(
        len(L.ids),
        len(L.ctx),
        S,
        len(L.updates) // 3,
        len(L.resets),
        len(L.prompt_marks) // 2,
        len(L.output_counts) // 2,
        len(L.bans) // 2,
    )
    # per-sample columns: sample_idx, sample_slots, rng_keys, sample_pos, then the constants
    sample_cols = (
        [
            c
            for cols in (zip(*L.samples, strict=True), zip(*L.sample_ints, strict=True))
            for c in cols
        ]
        if S
        else []
    )
    float_cols = list(zip(*L.sample_floats, strict=True)) if S else []
    ints = L.ids + L.relay_src + L.positions + L.seq_idx + L.cu + L.ctx + L.slots
    for col in sample_cols:
        ints.extend(col)
    floats = [v for col in float_cols for v in col]
    flat = torch.cat(
        [
            torch.tensor(ints, dtype=torch.int64),
            torch.tensor(floats, dtype=torch.float64).view(torch.int64),
            torch.tensor(
                L.updates + L.resets + L.prompt_marks + L.output_counts + L.bans, dtype=torch.int64
            ),
        ]
    )
    num_decodes = sum(c.num_tokens == 1 for c in batch.chunks) + (len(L.ctx) - real)
    return HostStep(layout, L.cu, L.ctx, num_decodes, _flags(sample_cols, float_cols)), flat


def _flags(sample_cols: list[tuple], float_cols: list[tuple]) -> SamplingFlags:
    if not sample_cols:
        return SamplingFlags()
    top_k, logprobs_k, track = sample_cols[4:7]
    temperature, top_p, min_p = float_cols[:3]
    return SamplingFlags(
        any_random=any(temperature),
        any_top_k=any(top_k),
        any_top_p_min_p=min(top_p) < 1.0 or any(min_p),
        any_penalty=any(track),
        logprobs_k=max(logprobs_k),
    )


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
        L.ids.extend(_token_slice(r.prompt_token_ids, r.output_token_ids, start, known_end))
        L.relay_src.extend([-1] * (known_end - start))
        if chunk.relay_last:
            L.ids.append(0)
            L.relay_src.append(r.slot)
        L.positions.extend(range(start, end))
        L.seq_idx.extend([i] * n)
    L.cu.append(L.cu[-1] + n)
    L.ctx.append(end)
    L.slots.append(r.slot)
    if r.num_synced_blocks < len(r.block_table):
        for col in range(r.num_synced_blocks, len(r.block_table)):
            L.updates.extend((r.slot, col, r.block_table[col]))
        r.num_synced_blocks = len(r.block_table)
    if chunk.admitted and r.params.uses_penalties:
        _add_penalty_state(L, r)
    if chunk.samples:
        _add_sample(L, r, L.cu[-1] - 1, end)


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
        for token in r.banned_before_min_tokens:
            L.bans.extend((row, token))
    L.samples.append((row_token, r.slot, r.rng_key, position))
    L.sample_ints.append(r.sample_ints)
    L.sample_floats.append(r.sample_floats)


def _add_padding(L: _Lists, i: int, pad_slot: int) -> None:
    L.ids.append(0)
    L.relay_src.append(-1)
    L.positions.append(0)
    L.seq_idx.append(i)
    L.cu.append(L.cu[-1] + 1)
    L.ctx.append(1)
    L.slots.append(pad_slot)
    L.samples.append((L.cu[-1] - 1, pad_slot, 0, 1))
    L.sample_ints.append(_PAD_SAMPLE_INTS)
    L.sample_floats.append(_PAD_SAMPLE_FLOATS)


def _token_slice(prompt: list[int], output: list[int], start: int, end: int) -> list[int]:
    n = len(prompt)
    if end <= n:
        return prompt[start:end]
    return prompt[start:] + output[max(0, start - n) : end - n]


def unpack_step(flat: torch.Tensor, layout: Layout) -> DeviceStep:
    """Views of the model part of a device buffer per Layout (no copies)."""
    T, B, S = layout.T, layout.B, layout.S
    return DeviceStep(*torch.split(flat[: layout.fixed_size], [T, T, T, T, B + 1, B, B, S]))


def unpack_sampling(flat: torch.Tensor, layout: Layout) -> SamplingInputs:
    """Views of the sampling part of a device buffer per Layout (no copies)."""
    S = layout.S
    sizes = [S] * (NUM_SAMPLE_INTS + NUM_SAMPLE_FLOATS) + [
        3 * layout.U,
        layout.R,
        2 * layout.M,
        2 * layout.C,
        2 * layout.Z,
    ]
    parts = list(torch.split(flat[layout.fixed_size : layout.size], sizes))
    for i in range(NUM_SAMPLE_INTS, NUM_SAMPLE_INTS + NUM_SAMPLE_FLOATS):
        parts[i] = parts[i].view(torch.float64)
    tail = len(parts) - 5
    parts[tail] = parts[tail].view(-1, 3)
    for i in (tail + 2, tail + 3, tail + 4):
        parts[i] = parts[i].view(-1, 2)
    return SamplingInputs(*parts)
