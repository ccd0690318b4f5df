"""CUDA's first-use costs, paid on a side thread while the engine's process still imports.

The engine process spends seconds importing transformers' model code, one thread holding the
GIL. Work that releases the GIL can run beside it for free; work that holds it delays the
imports by as long. The first-use costs below are of the second kind or sit later on the way
to the first row, so this module pays them early, on the thread that reads the first message
(engine/remote/server.py):

- `init_driver`: the CUDA driver's initialization and the device's primary context. torch's
  own lazy initialization makes them with the GIL held (~0.19 s on an H200 host, every import
  stopped meanwhile); through ctypes, which releases the GIL around a foreign call, they cost
  the imports nothing, and torch then finds them made.
- `warm_triton`: Triton's per-process key, the hashes of its sources and of libtriton.
- `warm_first_use`: cuBLAS's first GEMM (loading its libraries and kernels, ~0.12 s) and the
  first launch of the elementwise kernels a model's first forward pass and the engine's
  fingerprint use, which the engine's start-up would otherwise meet one by one after its
  imports.

They only change how soon things happen: where they fail, the engine's own start-up meets the
same work, and its error, as before.
"""

from __future__ import annotations

import ctypes

import torch

DRIVER_LIBRARY = "libcuda.so.1"


def device_index(setting: str) -> int | None:
    """The CUDA device an engine setting names (`auto` and `cuda` mean device 0, as torch
    takes them); None for a CPU setting."""
    if setting in ("auto", "cuda"):
        return 0
    kind, _, index = setting.partition(":")
    if kind != "cuda" or not index.isdigit():
        return None
    return int(index)


def init_driver(index: int) -> bool:
    """cuInit and the primary context of device `index` (as CUDA_VISIBLE_DEVICES numbers it),
    made with the GIL released; -> whether both were made (False where there is no driver or
    no such device)."""
    try:
        driver = ctypes.CDLL(DRIVER_LIBRARY)
    except OSError:
        return False
    device, context = ctypes.c_int(), ctypes.c_void_p()
    return (
        driver.cuInit(0) == 0
        and driver.cuDeviceGet(ctypes.byref(device), index) == 0
        and driver.cuDevicePrimaryCtxRetain(ctypes.byref(context), device) == 0
    )  # the context is kept for the process's life: torch's runtime uses this same one


@torch.inference_mode()
def warm_first_use(device: torch.device, dtype: torch.dtype) -> None:
    """One tiny call of each kernel family a decoder's first forward pass (embedding, norms,
    projections, activations, rotary tables, log-softmax) and the fingerprint's samples use,
    in the model's dtype and in float32."""
    with torch.cuda.device(device):
        ids = torch.zeros(1, 2, dtype=torch.long, device=device)
        weight = torch.ones(64, 64, dtype=dtype, device=device)
        for kind in dict.fromkeys((dtype, torch.float32)):
            w = weight.to(kind)
            x = torch.nn.functional.embedding(ids, w)
            h = x.float()
            h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
            x = w[0] * h.to(kind) + x
            x = torch.nn.functional.linear(x, w)
            x = torch.nn.functional.silu(x) * x
            x = torch.cat((x, -x), dim=-1).transpose(1, 2).contiguous()
            torch.log_softmax(x.float(), dim=-1).topk(2, dim=-1)
        positions = torch.arange(8, dtype=torch.int64, device=device)
        angles = torch.outer(positions.float(), torch.ones(4, device=device))
        torch.cat((angles.cos(), angles.sin()), dim=-1).to(dtype)
        flat = weight.reshape(-1)
        flat[positions * (flat.numel() - 1) // 7].to(torch.float64).cpu()
        torch.cuda.synchronize(device)


def warm_triton() -> None:
    """What Triton computes at a process's first compile or cache lookup, computed now: its
    own version key, the hashes of its sources and of libtriton (~400 MB; 0.42 s on an H200
    host, inside the engine's first kernel launch), which Triton keeps for the process. The
    hashing and the reads leave the GIL to other threads. A Triton without this function
    computes its key where it always does. Call it where `triton.runtime.cache` is imported
    already (the function imports Triton's compiler packages it hashes)."""
    try:
        from triton.runtime.cache import triton_key
    except ImportError:
        return
    triton_key()
