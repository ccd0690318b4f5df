"""A step's per-token inputs on the device in one launch: input ids (relayed tokens taken from
the relay), KV-cache slots, and the int32 query offsets and context lengths the attention
kernels read. In torch these are ~16 small kernels per step, each a few microseconds of GPU
time and a gap before the next, inside every decode graph (ModelRunner.token_inputs is the
same computation in torch: the CPU path and this kernel's reference)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from batchgen.engine.kernels.launch import cdiv, launch

BLOCK = 256  # tokens per program


# The inputs are views at offsets of one flat buffer, so their 16-byte alignment follows the
# parity of T and B, which change from step to step: specializing on it (or on T and B) would
# compile new variants in the middle of a job.
_VIEWS = (
    "ids_ptr",
    "relay_src_ptr",
    "positions_ptr",
    "seq_idx_ptr",
    "seq_slots_ptr",
    "cu_seqlens_ptr",
    "context_lens_ptr",
)


@triton.jit(do_not_specialize=["T", "B"], do_not_specialize_on_alignment=list(_VIEWS))
def _step_tokens_kernel(
    ids_ptr,  # [T] int64 prompt ids (unused where relay_src >= 0)
    relay_src_ptr,  # [T] int64 relay slot holding the token's value, -1 = ids
    positions_ptr,  # [T] int64
    seq_idx_ptr,  # [T] int64 sequence of each token
    seq_slots_ptr,  # [B] int64 block-table row of each sequence
    cu_seqlens_ptr,  # [B + 1] int64
    context_lens_ptr,  # [B] int64
    relay_ptr,  # [slots] int64 newest sampled token per slot
    block_tables_ptr,  # [slots, W] int32, -1 = unused
    ids_out,  # [T] int64
    slot_out,  # [T] int64 flat cache slot, -1 where the block is unused
    cu_out,  # [B + 1] int32
    ctx_out,  # [B] int32
    T,
    B,
    stride_bt,
    BLOCK_SIZE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tok = i < T
    src = tl.load(relay_src_ptr + i, mask=tok, other=-1)
    relayed = tl.load(relay_ptr + tl.maximum(src, 0), mask=tok & (src >= 0), other=0)
    given = tl.load(ids_ptr + i, mask=tok & (src < 0), other=0)
    tl.store(ids_out + i, tl.where(src >= 0, relayed, given), mask=tok)
    pos = tl.load(positions_ptr + i, mask=tok, other=0)
    seq = tl.load(seq_idx_ptr + i, mask=tok, other=0)
    row = tl.load(seq_slots_ptr + seq, mask=tok, other=0)
    block = tl.load(block_tables_ptr + row * stride_bt + pos // BLOCK_SIZE, mask=tok, other=-1)
    slot = tl.where(block >= 0, block.to(tl.int64) * BLOCK_SIZE + pos % BLOCK_SIZE, -1)
    tl.store(slot_out + i, slot, mask=tok)
    cu = tl.load(cu_seqlens_ptr + i, mask=i <= B, other=0)
    tl.store(cu_out + i, cu.to(tl.int32), mask=i <= B)
    ctx = tl.load(context_lens_ptr + i, mask=i < B, other=0)
    tl.store(ctx_out + i, ctx.to(tl.int32), mask=i < B)


def step_tokens(
    step: object, relay: torch.Tensor, block_tables: torch.Tensor, block_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """step: the step's DeviceStep views -> (ids [T] int64, slot_mapping [T] int64,
    cu_seqlens [B + 1] int32, context_lens [B] int32). No host synchronization."""
    t, b = step.ids.shape[0], step.context_lens.shape[0]
    device = step.ids.device
    ids = torch.empty(t, dtype=torch.int64, device=device)
    slots = torch.empty(t, dtype=torch.int64, device=device)
    cu = torch.empty(b + 1, dtype=torch.int32, device=device)
    ctx = torch.empty(b, dtype=torch.int32, device=device)
    launch(
        _step_tokens_kernel, (cdiv(max(t, b + 1), BLOCK),),
        step.ids, step.relay_src, step.positions, step.seq_idx, step.seq_slots, step.cu_seqlens,
        step.context_lens, relay, block_tables, ids, slots, cu, ctx, t, b,
        block_tables.stride(0), BLOCK_SIZE=block_size, BLOCK=BLOCK,
    )  # fmt: skip
    return ids, slots, cu, ctx
