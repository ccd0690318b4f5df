"""CUDA's first-use costs paid while the engine's process imports (first_use.py)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from batchgen.engine import first_use
from batchgen.engine.config import EngineConfig
from batchgen.engine.remote import server


def test_the_device_a_setting_names() -> None:
    assert first_use.device_index("auto") == 0
    assert first_use.device_index("cuda") == 0
    assert first_use.device_index("cuda:3") == 3
    assert first_use.device_index("cpu") is None
    assert first_use.device_index("cuda:x") is None


def test_no_driver_library_makes_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(first_use, "DRIVER_LIBRARY", "libcuda-not-here.so.1")
    assert first_use.init_driver(0) is False


def test_an_engine_on_the_cpu_starts_nothing_on_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    called = []
    monkeypatch.setattr(first_use, "init_driver", called.append)
    monkeypatch.setattr(first_use, "warm_first_use", lambda *a: called.append(a))
    assert server._start_on_device("default", EngineConfig(device="cpu")) is None
    assert called == []


SAME_CONTEXT = """
import ctypes, torch
from batchgen.engine.first_use import init_driver
made = init_driver(0)
x = torch.full((4,), 2.0, device="cuda")
driver = ctypes.CDLL("libcuda.so.1")
current, primary, device = ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_int()
driver.cuCtxGetCurrent(ctypes.byref(current))
driver.cuDeviceGet(ctypes.byref(device), 0)
driver.cuDevicePrimaryCtxRetain(ctypes.byref(primary), device)
print(made, current.value == primary.value, x.sum().item())
"""


@pytest.mark.gpu
def test_torch_runs_in_the_context_the_driver_made_first() -> None:
    out = subprocess.run(
        [sys.executable, "-c", SAME_CONTEXT], capture_output=True, text=True, check=True
    )
    assert out.stdout.split("\n")[0] == "True True 8.0"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_the_first_use_kernels_run_in_each_dtype(dtype: torch.dtype) -> None:
    first_use.warm_first_use(torch.device("cuda"), dtype)  # raises where a call fails
    a = torch.randn(3, 8, device="cuda", dtype=dtype)
    assert torch.equal(torch.nn.functional.linear(a, torch.eye(8, device="cuda", dtype=dtype)), a)
