"""$BATCHGEN_HOME's bytecode cache: used only where Python would compile every import each run."""

from __future__ import annotations

import json
import os
import py_compile
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
# Runs in a fresh interpreter: decides with a stand-in for torch, then imports it.
SCRIPT = """
import json, sys
import batchgen.home as home
home.PROBE_PACKAGE = "probepkg"
used = home.use_bytecode_cache()
import probepkg
print(json.dumps({"used": used, "cached": probepkg.__cached__, "value": probepkg.VALUE,
                  "prefix": sys.pycache_prefix}))
"""


@pytest.fixture
def probe(tmp_path: Path) -> Path:
    """A package standing in for torch, installed without compiled bytecode."""
    site = tmp_path / "site"
    (site / "probepkg").mkdir(parents=True)
    (site / "probepkg" / "__init__.py").write_text("VALUE = 42\n")
    return site


def _start(site: Path, home: Path, **env: str) -> dict:
    environ = {
        k: v
        for k, v in os.environ.items()
        if k not in ("PYTHONPYCACHEPREFIX", "BATCHGEN_BYTECODE_CACHE")
    }
    environ.update(
        PYTHONDONTWRITEBYTECODE="1",
        BATCHGEN_HOME=str(home),
        PYTHONPATH=os.pathsep.join([str(site), str(REPO)]),
        **env,
    )
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT], env=environ, capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout)


def test_bytecode_is_kept_under_home_when_the_environment_keeps_none(
    probe: Path, tmp_path: Path
) -> None:
    home = tmp_path / "home"
    first = _start(probe, home)
    assert first["used"] and first["value"] == 42
    assert first["prefix"] == str(home / "pycache")
    cached = Path(first["cached"])
    assert cached.is_file() and cached.is_relative_to(home / "pycache")
    assert not (probe / "probepkg" / "__pycache__").exists()  # site-packages never written
    stamp = cached.stat().st_mtime_ns
    second = _start(probe, home)
    assert second["used"] and second["cached"] == first["cached"]
    assert cached.stat().st_mtime_ns == stamp  # read back, not compiled again


def test_nothing_changes_where_python_keeps_bytecode_or_the_user_opts_out(
    probe: Path, tmp_path: Path
) -> None:
    home = tmp_path / "home"
    off = _start(probe, home, BATCHGEN_BYTECODE_CACHE="0")
    assert not off["used"] and off["prefix"] is None and not home.exists()
    py_compile.compile(str(probe / "probepkg" / "__init__.py"))  # as pip installs by default
    kept = _start(probe, home)
    assert not kept["used"] and kept["prefix"] is None and not home.exists()
