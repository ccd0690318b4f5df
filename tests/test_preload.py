"""Weights read ahead (preload.py): a model built from them is the model `from_pretrained`
reads from its folder, for every family; folders the reader does not take, and damaged ones,
go the usual way (with its errors)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from batchgen import BatchgenError
from batchgen.engine import model_loader
from batchgen.engine.model_loader import load_model
from batchgen.engine.preload import Preload, read_safetensors, weight_files
from tests.families import FAMILIES, build_family_model

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def built(monkeypatch) -> list:
    """The model each load given weights read ahead built from them (None: it read the
    folder instead)."""
    seen: list = []
    real = model_loader._from_weights

    def spy(source, weights, *args):
        result = real(source, weights, *args)
        if weights is not None:
            seen.append(result[0])
        return result

    monkeypatch.setattr(model_loader, "_from_weights", spy)
    return seen


def _load(folder: Path, dtype: torch.dtype, preload: Preload | None = None):
    try:
        return load_model(str(folder), CPU, dtype, preload=preload)
    except BatchgenError as exc:
        return str(exc)


def _same_model(a, b) -> None:
    assert type(a) is type(b)
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    for name in sa:
        assert sa[name].dtype == sb[name].dtype, (name, sa[name].dtype, sb[name].dtype)
        assert torch.equal(sa[name], sb[name]), (name, (sa[name] - sb[name]).abs().max())
    for (name, x), (_, y) in zip(a.named_buffers(), b.named_buffers(), strict=True):
        assert x.dtype == y.dtype and torch.equal(x, y), (name, x, y)  # non-persistent too
    tied = [(p.data_ptr() == q.data_ptr()) for p, q in ((a.get_input_embeddings().weight,
            a.get_output_embeddings().weight), (b.get_input_embeddings().weight,
            b.get_output_embeddings().weight))]  # fmt: skip
    assert tied[0] == tied[1]
    ca, cb = a.config.to_dict(), b.config.to_dict()
    assert ca == cb, {
        k: (ca.get(k), cb.get(k)) for k in ca.keys() | cb.keys() if ca.get(k) != cb.get(k)
    }
    assert a.generation_config.to_dict() == b.generation_config.to_dict()
    assert a.name_or_path == b.name_or_path
    assert a.training is False and b.training is False


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_model_from_weights_read_ahead_is_the_one_read_from_its_folder(
    tmp_path, family, built
) -> None:
    folder = build_family_model(family, tmp_path / family)
    for dtype in (torch.float32, torch.bfloat16):
        usual = _load(folder, dtype)
        ahead = _load(folder, dtype, Preload(str(folder), CPU))
        if isinstance(usual, str):
            assert ahead == usual
        else:
            assert built[-1] is not None  # built from the weights read ahead, not the folder
            _same_model(usual, ahead)


def test_tied_weights_and_a_generation_config(model_dir, built) -> None:
    folder = model_dir("llama", tie_word_embeddings=True)
    (folder / "generation_config.json").write_text(
        json.dumps({"eos_token_id": [2, 7], "do_sample": True, "temperature": 0.6})
    )
    usual = load_model(str(folder), CPU, torch.float32)
    ahead = load_model(str(folder), CPU, torch.float32, preload=Preload(str(folder), CPU))
    assert built == [ahead]
    _same_model(usual, ahead)
    assert ahead.generation_config.eos_token_id == [2, 7]


def test_sharded_files_are_read_whole(tmp_path: Path, built) -> None:
    from transformers import AutoModelForCausalLM

    folder = build_family_model("llama", tmp_path / "one")
    model = AutoModelForCausalLM.from_pretrained(folder)
    model.save_pretrained(tmp_path / "shards", max_shard_size="40KB")
    files = weight_files(tmp_path / "shards")
    assert files is not None and len(files) > 2
    read = read_safetensors(files, CPU)
    expected: dict[str, torch.Tensor] = {}
    for file in files:
        expected |= load_file(file)
    assert sorted(read) == sorted(expected)
    assert all(torch.equal(read[k], expected[k]) and read[k].dtype == expected[k].dtype
               for k in expected)  # fmt: skip
    usual = load_model(str(tmp_path / "shards"), CPU, torch.float32)
    ahead = load_model(
        str(tmp_path / "shards"), CPU, torch.float32, preload=Preload(str(tmp_path / "shards"), CPU)
    )
    assert built == [ahead]
    _same_model(usual, ahead)


def test_folders_the_reader_does_not_take(tmp_path: Path) -> None:
    folder = build_family_model("llama", tmp_path / "m")
    assert weight_files(folder) == [folder / "model.safetensors"]
    config = json.loads((folder / "config.json").read_text())
    quantized = tmp_path / "q"
    quantized.mkdir()
    (quantized / "model.safetensors").write_bytes((folder / "model.safetensors").read_bytes())
    (quantized / "config.json").write_text(json.dumps({**config, "quantization_config": {
        "quant_method": "fp8", "activation_scheme": "dynamic"}}))  # fmt: skip
    assert weight_files(quantized) is None
    missing = tmp_path / "missing-shard"
    missing.mkdir()
    (missing / "config.json").write_text(json.dumps(config))
    (missing / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"lm_head.weight": "model-00002-of-00002.safetensors"}})
    )
    assert weight_files(missing) is None
    assert weight_files(tmp_path) is None  # no config.json


def test_a_damaged_file_loads_the_usual_way_with_its_error(tmp_path: Path) -> None:
    folder = build_family_model("llama", tmp_path / "m")
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="outside the file"):
        read_safetensors([folder / "model.safetensors"], CPU)
    preload = Preload(str(folder), CPU)
    assert preload.take(str(folder), CPU) is None
    with pytest.raises(BatchgenError, match="could not load model"):
        load_model(str(folder), CPU, torch.float32, preload=Preload(str(folder), CPU))


def test_weights_read_for_another_folder_or_device_are_not_used(tmp_path: Path) -> None:
    folder = build_family_model("llama", tmp_path / "m")
    assert Preload(str(folder), CPU).take(str(tmp_path / "other"), CPU) is None
    assert Preload(str(folder), CPU).take(str(folder), torch.device("meta")) is None
    preload = Preload(str(folder), CPU)
    assert preload.take(str(folder), CPU) is not None
    assert preload.take(str(folder), CPU) is None  # taken once


@pytest.mark.gpu
def test_weights_read_ahead_onto_the_gpu(tmp_path: Path, built) -> None:
    pytest.importorskip("accelerate", reason="transformers places weights on a GPU through it")
    cuda = torch.device("cuda")
    folder = build_family_model("qwen3_moe", tmp_path / "m")
    usual = load_model(str(folder), cuda, torch.bfloat16)
    ahead = load_model(str(folder), cuda, torch.bfloat16, preload=Preload(str(folder), cuda))
    assert built == [ahead]
    assert all(p.device.type == "cuda" for p in ahead.parameters())
    _same_model(usual, ahead)
