"""The model fingerprint's weights checksum: every element counts, the same on every device."""

from __future__ import annotations

import pytest
import torch

from batchgen.engine.fingerprint import CHUNK, weights_sums

DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int8, torch.bool)


@pytest.mark.parametrize("dtype", [*DTYPES, torch.float8_e4m3fn])
def test_a_change_of_any_one_element_changes_the_sums(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    tensor = (torch.randn(3 * CHUNK + 17) * 4).to(dtype)
    sums = weights_sums(tensor)
    assert torch.equal(sums, weights_sums(tensor.clone()))
    for spot in (0, 1, CHUNK - 1, CHUNK, 2 * CHUNK + 5, tensor.numel() - 1):
        edited = tensor.clone()
        edited.view(torch.uint8)[spot * tensor.element_size()] ^= 1  # its lowest bit
        assert not torch.equal(weights_sums(edited), sums), (dtype, spot)


def test_swapped_rows_change_the_sums() -> None:
    torch.manual_seed(0)
    table = torch.randn(4 * CHUNK // 64, 64, dtype=torch.bfloat16)
    swapped = table.clone()
    swapped[[3, 3 + CHUNK // 64]] = table[[3 + CHUNK // 64, 3]]  # the same place in two chunks
    assert not torch.equal(weights_sums(swapped), weights_sums(table))
    assert torch.equal(weights_sums(table.t()), weights_sums(table.t().contiguous()))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_cpu_and_cuda_give_the_same_sums(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    for size in (3, CHUNK + 1, (1 << 24) + 5):
        tensor = (torch.randn(size) * 100).to(dtype)
        assert torch.equal(weights_sums(tensor), weights_sums(tensor.cuda()).cpu())
