"""Packages batchgen's own processes keep from being imported (skipped_imports.py)."""

from __future__ import annotations

import os
import subprocess
import sys

CHECK = """
import importlib.util, sys
from batchgen.skipped_imports import SKIPPED, skip_unused_imports
marked = skip_unused_imports()
from transformers.utils import is_scipy_available, is_sklearn_available
print(marked, [importlib.util.find_spec(n) is None for n in SKIPPED], is_sklearn_available(),
      is_scipy_available())
for name in SKIPPED:
    try:
        __import__(name)
        print("imported")
    except ImportError:
        print("refused")
"""


def _run(**env: str) -> list[str]:
    out = subprocess.run(
        [sys.executable, "-c", CHECK], env={**os.environ, **env}, capture_output=True, text=True,
        check=True,
    )  # fmt: skip
    return out.stdout.split("\n")


def test_skipped_packages_look_missing_to_transformers_and_imports() -> None:
    lines = _run()
    assert lines[0] == "('sklearn', 'scipy') [True, True] False False"
    assert lines[1:3] == ["refused", "refused"]  # an import fails loudly, never a substitute


def test_skipping_can_be_turned_off() -> None:
    line = _run(BATCHGEN_SKIP_IMPORTS="0")[0]
    assert line.startswith("() ")  # nothing marked; the package is as installed


CLI = """
import sys
from click.testing import CliRunner
from batchgen.cli import main
CliRunner().invoke(main, ["report", "/nonexistent-output"])
from batchgen.skipped_imports import SKIPPED
print([sys.modules.get(name, "absent") for name in SKIPPED])
"""

SERVER = """
import sys
from batchgen.engine.remote import server
from batchgen.skipped_imports import SKIPPED
server.serve = lambda *pipes: print([sys.modules.get(name, "absent") for name in SKIPPED])
server.main()
"""


def test_the_command_line_and_the_engine_server_skip_them() -> None:
    for code in (CLI, SERVER):
        out = subprocess.run(
            [sys.executable, "-c", code], stdin=subprocess.DEVNULL, capture_output=True,
            text=True, check=True,
        )  # fmt: skip
        lines = (out.stdout + out.stderr).split("\n")  # the server prints to stderr
        assert "[None, None]" in lines, out
