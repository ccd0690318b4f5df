"""How batchgen's own processes import their heavy modules (process_start.py): the collector is
paused while they load, then what they made is frozen and collections run again."""

from __future__ import annotations

import gc
import os
import subprocess
import sys

from batchgen.process_start import heavy_imports

INSIDE = """
import gc
from batchgen.process_start import heavy_imports, prepare_imports
prepare_imports()
with heavy_imports():
    inside = gc.isenabled()
    import torch
print(inside, gc.isenabled(), gc.get_freeze_count() > 10_000)
"""


def _run(code: str, **env: str) -> list[str]:
    out = subprocess.run(
        [sys.executable, "-c", code], env={**os.environ, **env}, stdin=subprocess.DEVNULL,
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    return (out.stdout + out.stderr).split("\n")


def test_the_collector_is_paused_while_heavy_modules_load_then_runs_again() -> None:
    assert _run(INSIDE)[0] == "False True True"  # torch's objects are frozen, not walked


def test_pausing_can_be_turned_off() -> None:
    assert _run(INSIDE, BATCHGEN_PAUSE_GC="0")[0] == "True True False"


def test_a_collector_paused_by_the_caller_stays_paused() -> None:
    gc.disable()
    try:
        frozen = gc.get_freeze_count()
        with heavy_imports():
            assert not gc.isenabled()
        assert not gc.isenabled()  # the caller's choice, not undone
        assert gc.get_freeze_count() == frozen
    finally:
        gc.enable()


def test_the_collector_runs_again_when_an_import_fails() -> None:
    try:
        with heavy_imports():
            raise ImportError("no such module")
    except ImportError:
        pass
    assert gc.isenabled()
    gc.unfreeze()  # this test process's objects go back to the collector


SERVER = """
import gc
from batchgen.engine.remote import server
server.serve = lambda *pipes: print("serving", gc.isenabled(), gc.get_freeze_count() > 10_000)
server.main()
"""

WORKER = """
import gc, io, pickle, sys
from batchgen import tokenizer_pool
sys.stdin = io.TextIOWrapper(io.BytesIO(pickle.dumps((None, None))))
serve = tokenizer_pool._serve
def seen(requests, answers):
    print("serving", gc.isenabled())
    serve(requests, answers)
    print("served", gc.isenabled(), gc.get_freeze_count() > 0)
tokenizer_pool._serve = seen
tokenizer_pool.main()
"""


def test_the_engine_server_and_the_tokenizer_workers_import_so() -> None:
    assert "serving True True" in _run(SERVER)  # its engine's modules in, frozen
    lines = _run(WORKER)
    assert "serving True" in lines and "served True True" in lines


def test_tritons_own_key_is_computed_ahead_for_its_first_launch() -> None:
    """The key warm_triton computes (on a thread, while the model loads) is the one Triton's
    compiles and cache lookups take, kept for the process."""
    code = """
from batchgen.engine.first_use import warm_triton
from triton.runtime import cache
warm_triton()
info = cache.triton_key.cache_info()
print(info.currsize, cache.triton_key() == cache.triton_key.__wrapped__())
"""
    assert _run(code)[0] == "1 True"
