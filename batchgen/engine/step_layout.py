"""The per-step host buffer layout, declared once: every segment of the flat int64 buffer a
step sends to the device, in order, with its row count and width. Packing (step_inputs),
unpacking (the views the runner and sampler read) and the request's per-step constants all
derive from these tables: adding a sampling field touches this file only.

For T tokens, B sequences and S sampled rows:
  model part (copied into a CUDA graph's static buffer for graphed decode steps):
    ids[T] relay_src[T] positions[T] seq_idx[T] cu_seqlens[B+1] context_lens[B]
    seq_slots[B] sample_idx[S]
  sampling part (read by the eager sampler):
    one column of S values per SAMPLE_INTS name, then per SAMPLE_FLOATS name (float64 bits),
    then updates[U, 3] resets[R] prompt_marks[M, 2] output_counts[C, 2] bans[Z, 2].
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from batchgen.engine.sampling_params import SamplingParams

# model part: (name, rows); rows "B+1" is B + 1
MODEL_SEGMENTS = (
    ("ids", "T"),
    ("relay_src", "T"),
    ("positions", "T"),
    ("seq_idx", "T"),
    ("cu_seqlens", "B+1"),
    ("context_lens", "B"),
    ("seq_slots", "B"),
    ("sample_idx", "S"),
)
# per sampled row, set by the step: relay slot, sampler key, position of the sampled token
STEP_INTS = ("slots", "rng_keys", "positions")
# per sampled row, constant for a request's life: name -> value from its SamplingParams
REQUEST_INTS: dict[str, Callable[[SamplingParams], int]] = {
    "top_k": lambda p: p.top_k,
    "logprobs_k": lambda p: -1 if p.logprobs is None else p.logprobs,
    "track": lambda p: int(p.uses_penalties),  # count sampled tokens for penalties
}
REQUEST_FLOATS: dict[str, Callable[[SamplingParams], float]] = {
    "temperature": lambda p: float(p.temperature),
    "top_p": lambda p: float(p.top_p),
    "min_p": lambda p: float(p.min_p),
    "repetition": lambda p: float(p.repetition_penalty),
    "presence": lambda p: float(p.presence_penalty),
    "frequency": lambda p: float(p.frequency_penalty),
}
SAMPLE_INTS = (*STEP_INTS, *REQUEST_INTS)
SAMPLE_FLOATS = tuple(REQUEST_FLOATS)
SAMPLE_COLUMNS = (*SAMPLE_INTS, *SAMPLE_FLOATS)  # the [S] columns, in buffer order
# variable-length tail: (name, rows, width)
TAIL_SEGMENTS = (
    ("updates", "U", 3),  # (slot, column, block) block-table entries new this step
    ("resets", "R", 1),  # slots whose penalty state restarts
    ("prompt_marks", "M", 2),  # (slot, token) in a (re)admitted request's prompt
    ("output_counts", "C", 2),  # (slot, token) generated before a readmission
    ("bans", "Z", 2),  # (sampled row, token) banned this step (min_new_tokens)
)


def request_constants(params: SamplingParams) -> tuple[tuple[int, ...], tuple[float, ...]]:
    """A request's per-step sampling constants, in SAMPLE_INTS / SAMPLE_FLOATS order."""
    ints = tuple(get(params) for get in REQUEST_INTS.values())
    return ints, tuple(get(params) for get in REQUEST_FLOATS.values())


PAD_CONSTANTS = request_constants(SamplingParams())  # padding rows: greedy, no filters


class Layout(NamedTuple):
    T: int
    B: int
    S: int
    U: int = 0
    R: int = 0
    M: int = 0
    C: int = 0
    Z: int = 0

    def rows(self, spec: str) -> int:
        return self.B + 1 if spec == "B+1" else getattr(self, spec)

    @property
    def model_sizes(self) -> list[int]:
        return [self.rows(rows) for _, rows in MODEL_SEGMENTS]

    @property
    def fixed_size(self) -> int:
        return sum(self.model_sizes)

    def model_offset(self, name: str) -> int:
        """Where the model segment `name` starts in the buffer."""
        names = [segment for segment, _ in MODEL_SEGMENTS]
        return sum(self.model_sizes[: names.index(name)])

    def sample_offset(self, name: str) -> int:
        """Where the per-sampled-row column `name` (SAMPLE_INTS or SAMPLE_FLOATS) starts."""
        return self.fixed_size + self.S * SAMPLE_COLUMNS.index(name)

    @property
    def tail_offset(self) -> int:
        """Where the variable-length tail (TAIL_SEGMENTS) starts."""
        return self.fixed_size + self.S * len(SAMPLE_COLUMNS)

    @property
    def sampling_sizes(self) -> list[int]:
        return [self.S] * len(SAMPLE_COLUMNS) + [
            self.rows(rows) * width for _, rows, width in TAIL_SEGMENTS
        ]

    @property
    def size(self) -> int:
        return self.fixed_size + sum(self.sampling_sizes)


DeviceStep = NamedTuple("DeviceStep", [(name, torch.Tensor) for name, _ in MODEL_SEGMENTS])
SamplingInputs = NamedTuple(
    "SamplingInputs",
    [(name, torch.Tensor) for name in SAMPLE_COLUMNS]
    + [(name, torch.Tensor) for name, _, _ in TAIL_SEGMENTS],
)
SamplingInputs.__doc__ = """Views of the sampling part: [S] columns (float64 for the floats),
then the tail segments shaped [rows, width]."""


def unpack_step(flat: torch.Tensor, layout: Layout) -> Any:
    """DeviceStep views of the model part of a device buffer (no copies)."""
    return DeviceStep(*torch.split(flat[: layout.fixed_size], layout.model_sizes))


def unpack_sampling(flat: torch.Tensor, layout: Layout) -> Any:
    """SamplingInputs views of the sampling part of a device buffer (no copies)."""
    parts = list(torch.split(flat[layout.fixed_size : layout.size], layout.sampling_sizes))
    floats = range(len(SAMPLE_INTS), len(SAMPLE_COLUMNS))
    for i in floats:
        parts[i] = parts[i].view(torch.float64)
    first_tail = len(SAMPLE_COLUMNS)
    for i, (_, _, width) in enumerate(TAIL_SEGMENTS, start=first_tail):
        if width > 1:
            parts[i] = parts[i].view(-1, width)
    return SamplingInputs(*parts)
