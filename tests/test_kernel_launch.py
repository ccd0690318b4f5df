"""Kernel launches through batchgen.engine.kernels.launch: the compiled kernel Triton chose for
the same specialization, or Triton's own path. Needs CUDA (the CPU interpreter always takes
Triton's own path)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _cuda() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")


def test_repeated_launches_specialize_as_triton_does() -> None:
    """Integer arguments of 1, multiples of 16 and others, and pointers aligned to 16 bytes
    or not, each get their own compiled kernel; every launch, the first (Triton's own path)
    and the later ones (the kept kernel), computes the right values."""
    from batchgen.engine.kernels import launch as launch_module
    from batchgen.engine.kernels.fused_ops import _silu_mul_kernel, silu_mul

    gen = torch.Generator(device="cuda").manual_seed(0)
    base = torch.randn(2, 8192 + 8, device="cuda", generator=gen)
    for n in (1, 16, 17, 4096, 4099):
        for offset in (0, 1):  # float32 at offset 1: 4 bytes past a 16-byte boundary
            gate, up = base[0, offset : offset + n], base[1, offset : offset + n]
            expected = F.silu(gate) * up
            for _ in range(3):
                torch.testing.assert_close(silu_mul(gate, up), expected)
    kept = launch_module._compiled
    assert kept is not None, "this Triton's internals were not recognised"
    specializations = {key[2] for key in kept if key[0] is _silu_mul_kernel}
    assert len(specializations) >= 4  # n: 1 / 16k / other, pointers: aligned / not


def test_launches_inside_a_cuda_graph_replay_the_kept_kernel() -> None:
    from batchgen.engine.kernels.fused_ops import silu_mul

    gate = torch.randn(1000, device="cuda")
    up = torch.randn(1000, device="cuda")
    for _ in range(2):
        silu_mul(gate, up)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph):
        out = silu_mul(gate, up)
    gate.copy_(torch.randn(1000, device="cuda"))
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, F.silu(gate) * up)
