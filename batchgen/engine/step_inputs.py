"""Step metadata: built on the host into one flat int64 buffer, sent to the device in one copy.

Layout of a step with T tokens, B sequences, W block-table columns and S sampled rows:
  ids[T] relay_src[T] positions[T] seq_idx[T] cu_seqlens[B+1] context_lens[B]
  block_tables[B*W] sample_idx[S] sample_slots[S] seeds[S] sample_pos[S] temperatures[S]
temperatures travel as float64 bits. relay_src is the relay row that holds a token's value
(the newest token of a request whose value is still on the device), else -1.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from batchgen.engine.scheduler import Batch


class Layout(NamedTuple):
    T: int
    B: int
    W: int
    S: int

    @property
    def size(self) -> int:
        return 4 * self.T + 2 * self.B + 1 + self.B * self.W + 5 * self.S

    @staticmethod
    def max_size(max_tokens: int, max_seqs: int, max_blocks: int) -> int:
        return Layout(max_tokens, max_seqs, max_blocks, max_seqs).size


class HostStep(NamedTuple):
    """What the host knows of a step once its inputs are written."""

    layout: Layout
    cu_seqlens: list[int]
    context_lens: list[int]
    num_decodes: int
    any_random: bool


class DeviceStep(NamedTuple):
    """Views into the device copy of the flat buffer."""

    ids: torch.Tensor
    relay_src: torch.Tensor
    positions: torch.Tensor
    seq_idx: torch.Tensor
    cu_seqlens: torch.Tensor
    context_lens: torch.Tensor
    block_tables: torch.Tensor  # [B, W]
    sample_idx: torch.Tensor
    sample_slots: torch.Tensor
    seeds: torch.Tensor
    sample_pos: torch.Tensor
    temperatures: torch.Tensor  # float32


def prepare_step(batch: Batch, block_size: int, out: torch.Tensor) -> HostStep:
    """Write batch's metadata into out (a flat int64 buffer, pinned on CUDA)."""
    ids: list[int] = []
    relay_src: list[int] = []
    positions: list[int] = []
    seq_idx: list[int] = []
    cu, ctx, tables = [0], [], []
    sample_idx: list[int] = []
    slots: list[int] = []
    seeds: list[int] = []
    sample_pos: list[int] = []
    temps: list[float] = []
    for i, c in enumerate(batch.chunks):
        r, end = c.request, c.start + c.num_tokens
        known_end = end - 1 if c.relay_last else end
        ids.extend(_token_slice(r.prompt_token_ids, r.output_token_ids, c.start, known_end))
        relay_src.extend([-1] * (known_end - c.start))
        if c.relay_last:
            ids.append(0)
            relay_src.append(r.slot)
        positions.extend(range(c.start, end))
        seq_idx.extend([i] * c.num_tokens)
        cu.append(cu[-1] + c.num_tokens)
        ctx.append(end)
        tables.append(r.block_table)
        if c.samples:
            sample_idx.append(cu[-1] - 1)
            slots.append(r.slot)
            seeds.append(r.seed)
            sample_pos.append(end)
            temps.append(float(r.params.temperature))
    width = max((end + block_size - 1) // block_size for end in ctx) if ctx else 0
    flat_tables = [b for t in tables for b in (t[:width] + [-1] * (width - len(t[:width])))]
    layout = Layout(len(ids), len(batch.chunks), width, len(sample_idx))
    ints = (
        ids
        + relay_src
        + positions
        + seq_idx
        + cu
        + ctx
        + flat_tables
        + sample_idx
        + slots
        + seeds
        + sample_pos
    )
    n = len(ints)
    out[:n].copy_(torch.tensor(ints, dtype=torch.int64))
    out[n : n + len(temps)].view(torch.float64).copy_(torch.tensor(temps, dtype=torch.float64))
    num_decodes = sum(c.num_tokens == 1 for c in batch.chunks)
    return HostStep(layout, cu, ctx, num_decodes, any(t > 0 for t in temps))


def _token_slice(prompt: list[int], output: list[int], start: int, end: int) -> list[int]:
    n = len(prompt)
    if end <= n:
        return prompt[start:end]
    return prompt[start:] + output[max(0, start - n) : end - n]


def unpack_step(flat: torch.Tensor, layout: Layout) -> DeviceStep:
    """Views of the device buffer per Layout (no copies except the float conversion)."""
    T, B, W, S = layout
    sizes = [T, T, T, T, B + 1, B, B * W, S, S, S, S, S]
    parts = list(torch.split(flat[: sum(sizes)], sizes))
    parts[6] = parts[6].view(B, W)
    parts[11] = parts[11].view(torch.float64).float()
    return DeviceStep(*parts)
