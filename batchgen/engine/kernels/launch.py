"""Kernel launches with less host work than `kernel[grid](...)`.

Triton's own launch binds and specializes the arguments, then builds a string cache key from
them and the options, reads its knobs, makes launch metadata for hooks and checks the kernel's
globals: about 65 us of host time per launch on an H200 host, ~100 launches per eager 1b step
(~6 ms of host time that the GPU can end up waiting for). `launch` keeps Triton's binder, so a
kernel is specialized exactly as Triton would specialize it, and looks the compiled kernel up
by that specialization in a dict of its own; a key seen for the first time goes through
Triton's own path (which compiles and launches it). Launch hooks (profilers that register
them) and the CPU interpreter get Triton's own path every time.
"""

from __future__ import annotations

from typing import Any

from triton import knobs
from triton.runtime.driver import driver
from triton.runtime.jit import JITFunction

# (kernel, device, specialization, options) -> compiled kernel; None: this Triton's internals
# are not the ones this module knows, so every launch takes Triton's own path
_compiled: dict[tuple, Any] | None = {}


def cdiv(a: int, b: int) -> int:
    """triton.cdiv for host code: Triton's is a constexpr function, ~2 us per call from Python
    (100x this; ~160 calls per eager 1b step)."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """triton.next_power_of_2 for host code (the smallest power of 2 >= n; 0 for 0)."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


def launch(kernel: Any, grid: tuple[int, ...], *args: Any, **kwargs: Any) -> None:
    """kernel[grid](*args, **kwargs), through the compiled kernel when it was seen before."""
    hooks = knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook
    if _compiled is None or not isinstance(kernel, JITFunction) or any(h.calls for h in hooks):
        kernel[grid](*args, **kwargs)
        return
    device = driver.active.get_current_device()
    caches = kernel.device_caches.get(device)
    if caches is None:  # the kernel's first launch on this device creates its binder
        _first(kernel, grid, device, args, kwargs)
        return
    params, specialization, options = caches[4](*args, **kwargs)
    key = (kernel, device, tuple(specialization), tuple(options.items()))
    compiled = _compiled.get(key)
    if compiled is None:
        _first(kernel, grid, device, args, kwargs, key)
        return
    stream = driver.active.get_current_stream(device)
    grid = (*grid, 1, 1)
    compiled.run(
        grid[0], grid[1], grid[2], stream, compiled.function, compiled.packed_metadata,
        None, None, None, *params.values(),
    )  # fmt: skip


def _first(
    kernel: JITFunction,
    grid: tuple[int, ...],
    device: int,
    args: tuple,
    kwargs: dict,
    key: tuple | None = None,
) -> None:
    """Triton's own launch (compiling if needed); its compiled kernel is kept under key."""
    global _compiled
    compiled = kernel[grid](*args, **kwargs)
    if key is None:
        return
    compiled = compiled.result() if hasattr(compiled, "result") else compiled
    caches = kernel.device_caches.get(device)
    known = (
        isinstance(caches, tuple)
        and len(caches) == 5
        and callable(caches[4])
        and all(hasattr(compiled, a) for a in ("run", "function", "packed_metadata"))
    )
    if not known:
        _compiled = None  # another Triton: its own path from now on
        return
    _compiled[key] = compiled
