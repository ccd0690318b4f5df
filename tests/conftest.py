"""Shared fixtures: tiny random models of several architectures, built once per test run."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from batchgen.models import build_tiny_model

ARCHS = ("llama", "qwen2", "qwen3", "mistral")

# Tiny models on a 2-core machine: one intra-op thread is faster than two fighting for cores.
torch.set_num_threads(1)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory):
    """model_dir(arch, **overrides) -> a saved tiny model folder (cached per arguments)."""
    cache: dict[tuple, Path] = {}
    root = tmp_path_factory.mktemp("models")

    def build(arch: str = "llama", **overrides: object) -> Path:
        key = (arch, tuple(sorted(overrides.items())))
        if key not in cache:
            out = root / f"{arch}-{len(cache)}"
            cache[key] = build_tiny_model(out, arch=arch, seed=0, **overrides)
        return cache[key]

    return build


@pytest.fixture(autouse=True)
def _same_random_inputs() -> None:
    """Each test draws the same torch.randn inputs whichever tests ran before it in its worker
    (xdist hands files to workers in no fixed order): a failure on some input repeats."""
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _batchgen_home(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch):
    """Keep the embedded default model out of the user's cache during tests."""
    home = tmp_path_factory.getbasetemp() / "batchgen-home"
    monkeypatch.setenv("BATCHGEN_HOME", str(home))
