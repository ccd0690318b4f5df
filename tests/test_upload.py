"""A loaded model's weights onto the GPU through pinned buffers (engine/upload.py)."""

from __future__ import annotations

import pytest
import torch

from batchgen.engine import upload
from batchgen.engine.upload import unique_tensors, upload_model


class Tied(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(50, 8)
        self.proj = torch.nn.Linear(8, 24)
        self.head = torch.nn.Linear(8, 50, bias=False)
        self.head.weight = self.embed.weight  # tied, as many language models are
        self.register_buffer("scale", torch.arange(5, dtype=torch.float32))
        self.register_buffer("flags", torch.tensor([True, False, True]))
        self.strided = torch.nn.Parameter(torch.randn(6, 4).t(), requires_grad=False)
        self.fp8 = torch.nn.Parameter(torch.randn(16, 16).to(torch.float8_e4m3fn), False)


def test_unique_tensors_counts_a_tied_weight_once() -> None:
    model = Tied()
    tensors = unique_tensors(model)
    assert len(tensors) == len({id(t) for t in tensors})
    assert sum(t is model.embed.weight for t in tensors) == 1
    names = {*dict(model.named_parameters()).values(), *dict(model.named_buffers()).values()}
    assert {id(t) for t in tensors} == {id(t) for t in names}


def test_upload_to_the_cpu_is_torchs_own_move() -> None:
    model = Tied()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert upload_model(model, torch.device("cpu")) is model
    assert all(torch.equal(v.float(), before[k].float()) for k, v in model.state_dict().items())


@pytest.mark.gpu
@pytest.mark.parametrize("chunk", [64 << 20, 100])  # whole tensors; chunks cut mid-element
def test_upload_copies_every_byte_and_keeps_ties(chunk: int, monkeypatch) -> None:
    monkeypatch.setattr(upload, "CHUNK_BYTES", chunk)
    torch.manual_seed(0)
    model = Tied()
    params = {name: id(p) for name, p in model.named_parameters()}
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    device = torch.device("cuda")
    assert upload_model(model, device) is model
    state = model.state_dict()
    assert set(state) == set(expected)
    for name, value in state.items():
        assert value.device.type == "cuda" and value.dtype == expected[name].dtype, name
        assert value.shape == expected[name].shape, name
        got, want = value.cpu().contiguous(), expected[name].contiguous()
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), name
    assert model.head.weight is model.embed.weight  # still one tensor
    assert {name: id(p) for name, p in model.named_parameters()} == params  # same Parameters
    assert model.proj.weight.requires_grad and not model.strided.requires_grad
