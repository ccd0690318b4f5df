"""Step metadata: built on the host into one flat int64 buffer, sent to the device in one copy.

Layout for T tokens, B sequences, S sampled rows and U block-table updates:
  ids[T] relay_src[T] positions[T] seq_idx[T] cu_seqlens[B+1] context_lens[B] seq_slots[B]
  sample_idx[S] sample_slots[S] seeds[S] sample_pos[S] temperatures[S] | updates[3U]
temperatures travel as float64 bits. relay_src is the relay row holding a token's value (the
newest token of a request whose value is still on the device), else -1. Block tables live on
the device, one row per relay slot; a step sends only new entries as (slot, column, block)
updates, placed last so that the fixed part has the same offsets for a given (T, B, S).
A decode step may be padded to a CUDA-graph batch size: padding rows use the pad slot, whose
block-table row points at a scratch block, so padded work touches nothing real.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from batchgen.engine.scheduler import Batch


class Layout(NamedTuple):
    T: int
    B: int
    S: int
    U: int

    @property
    def fixed_size(self) -> int:
        return 4 * self.T + 3 * self.B + 1 + 5 * self.S

    @property
    def size(self) -> int:
        return self.fixed_size + 3 * self.U


class HostStep(NamedTuple):
    """What the host knows of a step once its inputs are written."""

    layout: Layout
    cu_seqlens: list[int]
    context_lens: list[int]
    num_decodes: int
    any_random: bool
    padded_from: int  # real sequences before padding (== layout.B when not padded)


class DeviceStep(NamedTuple):
    """Views into the device copy of the flat buffer's fixed part."""

    ids: torch.Tensor
    relay_src: torch.Tensor
    positions: torch.Tensor
    seq_idx: torch.Tensor
    cu_seqlens: torch.Tensor
    context_lens: torch.Tensor
    seq_slots: torch.Tensor
    sample_idx: torch.Tensor
    sample_slots: torch.Tensor
    seeds: torch.Tensor
    sample_pos: torch.Tensor
    temperatures: torch.Tensor  # float64 view


class _Lists:
    """Python lists of one step's metadata, in layout order."""

    def __init__(self) -> None:
        self.ids: list[int] = []
        self.relay_src: list[int] = []
        self.positions: list[int] = []
        self.seq_idx: list[int] = []
        self.cu = [0]
        self.ctx: list[int] = []
        self.slots: list[int] = []
        self.sample_idx: list[int] = []
        self.sample_slots: list[int] = []
        self.seeds: list[int] = []
        self.sample_pos: list[int] = []
        self.temps: list[float] = []
        self.updates: list[int] = []


def prepare_step(batch: Batch, out: torch.Tensor, pad_to: int = 0, pad_slot: int = -1) -> HostStep:
    """Write batch's metadata into out (flat int64, pinned on CUDA).

    pad_to > len(batch.chunks) pads a decode-only batch with one-token rows in pad_slot.
    """
    lists = _Lists()
    for i, chunk in enumerate(batch.chunks):
        _add_chunk(lists, i, chunk)
    real = len(batch.chunks)
    for i in range(real, pad_to):
        _add_padding(lists, i, pad_slot)
    layout = Layout(len(lists.ids), len(lists.ctx), len(lists.sample_idx), len(lists.updates) // 3)
    ints = (
        lists.ids
        + lists.relay_src
        + lists.positions
        + lists.seq_idx
        + lists.cu
        + lists.ctx
        + lists.slots
        + lists.sample_idx
        + lists.sample_slots
        + lists.seeds
        + lists.sample_pos
    )
    n, s = len(ints), layout.S
    out[:n].copy_(torch.tensor(ints, dtype=torch.int64))
    out[n : n + s].view(torch.float64).copy_(torch.tensor(lists.temps, dtype=torch.float64))
    if lists.updates:
        out[n + s : n + s + len(lists.updates)].copy_(
            torch.tensor(lists.updates, dtype=torch.int64)
        )
    num_decodes = sum(c.num_tokens == 1 for c in batch.chunks) + (len(lists.ctx) - real)
    return HostStep(layout, lists.cu, lists.ctx, num_decodes, any(t > 0 for t in lists.temps), real)


def _add_chunk(lists: _Lists, i: int, chunk) -> None:
    r, start, n = chunk.request, chunk.start, chunk.num_tokens
    end = start + n
    known_end = end - 1 if chunk.relay_last else end
    lists.ids.extend(_token_slice(r.prompt_token_ids, r.output_token_ids, start, known_end))
    lists.relay_src.extend([-1] * (known_end - start))
    if chunk.relay_last:
        lists.ids.append(0)
        lists.relay_src.append(r.slot)
    lists.positions.extend(range(start, end))
    lists.seq_idx.extend([i] * n)
    lists.cu.append(lists.cu[-1] + n)
    lists.ctx.append(end)
    lists.slots.append(r.slot)
    for col in range(r.num_synced_blocks, len(r.block_table)):
        lists.updates.extend((r.slot, col, r.block_table[col]))
    r.num_synced_blocks = len(r.block_table)
    if chunk.samples:
        lists.sample_idx.append(lists.cu[-1] - 1)
        lists.sample_slots.append(r.slot)
        lists.seeds.append(r.seed)
        lists.sample_pos.append(end)
        lists.temps.append(float(r.params.temperature))


def _add_padding(lists: _Lists, i: int, pad_slot: int) -> None:
    lists.ids.append(0)
    lists.relay_src.append(-1)
    lists.positions.append(0)
    lists.seq_idx.append(i)
    lists.cu.append(lists.cu[-1] + 1)
    lists.ctx.append(1)
    lists.slots.append(pad_slot)
    lists.sample_idx.append(lists.cu[-1] - 1)
    lists.sample_slots.append(pad_slot)
    lists.seeds.append(0)
    lists.sample_pos.append(1)
    lists.temps.append(0.0)


def _token_slice(prompt: list[int], output: list[int], start: int, end: int) -> list[int]:
    n = len(prompt)
    if end <= n:
        return prompt[start:end]
    return prompt[start:] + output[max(0, start - n) : end - n]


def unpack_step(flat: torch.Tensor, layout: Layout) -> DeviceStep:
    """Views of the fixed part of a device buffer per Layout (no copies)."""
    T, B, S, _ = layout
    sizes = [T, T, T, T, B + 1, B, B, S, S, S, S, S]
    parts = list(torch.split(flat[: layout.fixed_size], sizes))
    parts[-1] = parts[-1].view(torch.float64)
    return DeviceStep(*parts)


def unpack_updates(flat: torch.Tensor, layout: Layout) -> torch.Tensor:
    """-> [U, 3] (slot, column, block) block-table updates."""
    return flat[layout.fixed_size : layout.size].view(layout.U, 3)
