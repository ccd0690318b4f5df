"""The one-launch CUDA kernel for a step's token inputs computes what ModelRunner.token_inputs
computes in torch (the CPU path): relayed ids, KV-cache slots (-1 for unused blocks), int32
offsets and context lengths (needs CUDA); and it compiles for sm_90 without per-step variants
(no GPU needed)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from batchgen.engine.runner import ModelRunner
from batchgen.engine.step_layout import DeviceStep


@pytest.mark.gpu
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize(
    ("num_decodes", "prefills"), [(256, ()), (3, (700, 1)), (0, (513,)), (1, ())]
)
def test_step_tokens_kernel_matches_torch(
    block_size: int, num_decodes: int, prefills: tuple
) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from batchgen.engine.kernels.step_tokens import step_tokens

    gen = torch.Generator().manual_seed(block_size + num_decodes)
    slots, width, vocab = 300, 64, 50_000
    block_tables = torch.randint(0, 10_000, (slots + 1, width), generator=gen, dtype=torch.int32)
    block_tables[:, width - 5 :] = -1  # unused entries
    relay = torch.randint(0, vocab, (slots + 1,), generator=gen)
    lengths = [1] * num_decodes + list(prefills)
    seq_slots = torch.randperm(slots, generator=gen)[: len(lengths)]
    positions, seq_idx, relay_src, ids = [], [], [], []
    context = []
    for i, n in enumerate(lengths):
        end = int(torch.randint(n, (width - 4) * block_size, (1,), generator=gen))
        if i == 0 and n == 1:
            end = width * block_size - 1  # the last position of the table: an unused block
        positions += range(end - n, end)
        seq_idx += [i] * n
        relayed = n == 1 or i % 2 == 0  # a prompt chunk whose last token is relayed, or not
        relay_src += [-1] * (n - 1) + [int(seq_slots[i]) if relayed else -1]
        ids += torch.randint(0, vocab, (n,), generator=gen).tolist()
        context.append(end)
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    t = lambda x: torch.tensor(x, dtype=torch.int64)  # noqa: E731
    host_step = DeviceStep(
        t(ids), t(relay_src), t(positions), t(seq_idx), t(cu), t(context), seq_slots, t([0])
    )
    runner = SimpleNamespace(
        config=SimpleNamespace(block_size=block_size), relay=relay, block_tables=block_tables
    )
    expected = ModelRunner.token_inputs(runner, host_step)
    cuda_step = DeviceStep(*(x.cuda() for x in host_step))
    got = step_tokens(cuda_step, relay.cuda(), block_tables.cuda(), block_size)
    for name, e, g in zip(
        ("ids", "slot_mapping", "cu_seqlens", "context_lens"), expected, got, strict=True
    ):
        assert g.dtype == e.dtype, name
        assert torch.equal(g.cpu(), e), name


# compiles the kernel for sm_90 in a process without the interpreter (no GPU needed)
HOPPER_COMPILE = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from batchgen.engine.kernels.step_tokens import _VIEWS, _step_tokens_kernel as kernel

params = {p.name: p for p in kernel.params}
assert params["T"].do_not_specialize and params["B"].do_not_specialize, "T or B specialized"
assert all(params[n].do_not_specialize_on_alignment for n in _VIEWS), "a view's alignment"
names = kernel.arg_names
types = {n: "*i64" for n in names if n.endswith(("_ptr", "_out"))}
types.update(block_tables_ptr="*i32", cu_out="*i32", ctx_out="*i32")
consts = {"BLOCK_SIZE": 16, "BLOCK": 256}
signature = {n: types.get(n, "constexpr" if n in consts else "i32") for n in names}
constexprs = {(names.index(n),): v for n, v in consts.items()}
triton.compile(ASTSource(kernel, signature, constexprs), target=GPUTarget("cuda", 90, 32))
"""


@pytest.mark.slow
def test_step_tokens_kernel_compiles_for_hopper_without_per_step_variants() -> None:
    """Compiled for sm_90 here (no GPU); T, B and the flat buffer's views are not specialized
    on, so a job's varying step sizes never compile new variants mid-run."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run(
        [sys.executable, "-c", HOPPER_COMPILE], env=env, capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0, run.stderr[-3000:]
