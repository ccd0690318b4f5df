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
    padded_from: int  # real sequences before padding (== layout.B when not padded)


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
            "sample_idx",
            "sample_slots",
            "rng_keys",
            "sample_pos",
            "top_k",
            "logprobs_k",
            "track",
            "temperature",
            "top_p",
            "min_p",
            "repetition",
            "presence",
            "frequency",
            "updates",
            "resets",
            "prompt_marks",
            "output_counts",
            "bans",
        ):
            setattr(self, name, [])
        self.cu = [0]


def prepare_step(
    batch: Batch, pad_to: int = 0, pad_slot: int = -1
) -> tuple[HostStep, torch.Tensor]:
    """-> the step's host facts and its flat int64 metadata (a CPU tensor of layout.size).

    pad_to > len(batch.chunks) pads a decode-only batch with one-token rows in pad_slot.
    """
    lists = _Lists()
    for i, chunk in enumerate(batch.chunks):
        _add_chunk(lists, i, chunk)
    real = len(batch.chunks)
    for i in range(real, pad_to):
        _add_padding(lists, i, pad_slot)
    L = lists
    layout = Layout(
        len(L.ids),
        len(L.ctx),
        len(L.sample_idx),
        len(L.updates) // 3,
        len(L.resets),
        len(L.prompt_marks) // 2,
        len(L.output_counts) // 2,
        len(L.bans) // 2,
    )
    ints = (
        L.ids
        + L.relay_src
        + L.positions
        + L.seq_idx
        + L.cu
        + L.ctx
        + L.slots
        + L.sample_idx
        + L.sample_slots
        + L.rng_keys
        + L.sample_pos
        + L.top_k
        + L.logprobs_k
        + L.track
    )
    floats = L.temperature + L.top_p + L.min_p + L.repetition + L.presence + L.frequency
    tail = L.updates + L.resets + L.prompt_marks + L.output_counts + L.bans
    flat = torch.cat(
        [
            torch.tensor(ints, dtype=torch.int64),
            torch.tensor(floats, dtype=torch.float64).view(torch.int64),
            torch.tensor(tail, dtype=torch.int64),
        ]
    )
    num_decodes = sum(c.num_tokens == 1 for c in batch.chunks) + (len(L.ctx) - real)
    return HostStep(layout, L.cu, L.ctx, num_decodes, _flags(L), real), flat


def _flags(L: _Lists) -> SamplingFlags:
    return SamplingFlags(
        any_random=any(t > 0 for t in L.temperature),
        any_top_k=any(k > 0 for k in L.top_k),
        any_top_p_min_p=any(p < 1.0 for p in L.top_p) or any(m > 0 for m in L.min_p),
        any_penalty=any(L.track),
        logprobs_k=max(L.logprobs_k, default=-1),
    )


def _add_chunk(L: _Lists, i: int, chunk: ScheduledChunk) -> None:
    r, start, n = chunk.request, chunk.start, chunk.num_tokens
    end = start + n
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
    p = r.params
    row = len(L.sample_idx)
    L.sample_idx.append(row_token)
    L.sample_slots.append(r.slot)
    L.rng_keys.append(r.rng_key)
    L.sample_pos.append(position)
    L.top_k.append(p.top_k)
    L.logprobs_k.append(-1 if p.logprobs is None else p.logprobs)
    L.track.append(int(p.uses_penalties))
    L.temperature.append(float(p.temperature))
    L.top_p.append(float(p.top_p))
    L.min_p.append(float(p.min_p))
    L.repetition.append(float(p.repetition_penalty))
    L.presence.append(float(p.presence_penalty))
    L.frequency.append(float(p.frequency_penalty))
    generated_before = position - r.num_prompt_tokens  # outputs before this sample
    if generated_before < p.min_new_tokens:
        for token in r.banned_before_min_tokens:
            L.bans.extend((row, token))


def _add_padding(L: _Lists, i: int, pad_slot: int) -> None:
    L.ids.append(0)
    L.relay_src.append(-1)
    L.positions.append(0)
    L.seq_idx.append(i)
    L.cu.append(L.cu[-1] + 1)
    L.ctx.append(1)
    L.slots.append(pad_slot)
    L.sample_idx.append(L.cu[-1] - 1)
    L.sample_slots.append(pad_slot)
    L.rng_keys.append(0)
    L.sample_pos.append(1)
    L.top_k.append(0)
    L.logprobs_k.append(-1)
    L.track.append(0)
    L.temperature.append(0.0)
    L.top_p.append(1.0)
    L.min_p.append(0.0)
    L.repetition.append(1.0)
    L.presence.append(0.0)
    L.frequency.append(0.0)


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
