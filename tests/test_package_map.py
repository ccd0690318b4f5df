"""importlib.metadata's package -> distribution map kept between runs (package_map.py): the same
answer as importlib's own, computed again whenever a distribution is installed or removed."""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from batchgen import package_map


def _install(site: Path, dist: str, package: str) -> Path:
    info = site / f"{dist}-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.0\n")
    (info / "top_level.txt").write_text(f"{package}\n")
    return info


@pytest.fixture
def site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    folder = tmp_path / "site"
    folder.mkdir()
    monkeypatch.setattr(sys, "path", [*sys.path, str(folder)])
    monkeypatch.setenv("BATCHGEN_HOME", str(tmp_path / "home"))
    return folder


class Counted:
    def __init__(self) -> None:
        self.calls = 0

    def __call__(self) -> dict[str, list[str]]:
        self.calls += 1
        return importlib.metadata.packages_distributions()


def test_the_map_is_computed_once_then_read_back(site: Path) -> None:
    _install(site, "fakedist", "fakepkg")
    compute = Counted()
    kept = package_map._kept(compute)
    first = kept()
    assert first["fakepkg"] == ["fakedist"]
    assert kept() == first
    assert compute.calls == 1
    assert json.loads(package_map.package_map_file().read_text())["map"] == first


def test_installing_upgrading_or_removing_a_distribution_computes_it_again(site: Path) -> None:
    compute = Counted()
    kept = package_map._kept(compute)
    assert "newpkg" not in kept()
    info = _install(site, "newdist", "newpkg")
    assert kept()["newpkg"] == ["newdist"]
    shutil.rmtree(info)
    (site / "other").mkdir()  # the folder's own time may not move on a coarse clock
    _install(site, "newdist2", "newpkg")  # an upgrade: another distribution provides it
    assert kept()["newpkg"] == ["newdist2"]
    shutil.rmtree(site / "newdist2-1.0.dist-info")
    assert "newpkg" not in kept()
    assert compute.calls == 4


def test_a_damaged_file_is_computed_again_and_replaced(site: Path) -> None:
    compute = Counted()
    kept = package_map._kept(compute)
    answer = kept()
    package_map.package_map_file().write_text('{"key": [')
    assert kept() == answer
    assert compute.calls == 2
    assert json.loads(package_map.package_map_file().read_text())["map"] == answer


class ExtraFinder:
    @staticmethod
    def find_distributions(context: object = None) -> list:
        return []


def test_nothing_is_kept_where_another_finder_reports_distributions(
    site: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sys, "meta_path", [*sys.meta_path, ExtraFinder])
    compute = Counted()
    kept = package_map._kept(compute)
    kept()
    kept()
    assert compute.calls == 2
    assert not package_map.package_map_file().exists()


CHECK = """
import importlib.metadata, json
original = importlib.metadata.packages_distributions
from batchgen.process_start import prepare_imports
prepare_imports()
kept = importlib.metadata.packages_distributions
answers = [kept(), kept()]
import transformers.utils.import_utils
print(kept is not original, answers[0] == answers[1] == original(), answers[0].get("fakepkg"))
"""


def _run(tmp_path: Path, **env: str) -> str:
    site = tmp_path / "site"
    if not site.exists():
        _install(site, "fakedist", "fakepkg")
    path = os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), str(site)]))
    out = subprocess.run(
        [sys.executable, "-c", CHECK], capture_output=True, text=True, check=True,
        env={**os.environ, "BATCHGEN_HOME": str(tmp_path / "home"), "PYTHONPATH": path, **env},
    )  # fmt: skip
    return out.stdout.split("\n")[0]


def test_batchgens_processes_answer_as_importlib_does(tmp_path: Path) -> None:
    assert _run(tmp_path) == "True True ['fakedist']"
    assert (tmp_path / "home" / "package_map.json").is_file()
    assert _run(tmp_path) == "True True ['fakedist']"  # read back, same answer


def test_keeping_can_be_turned_off(tmp_path: Path) -> None:
    assert _run(tmp_path, BATCHGEN_PACKAGE_MAP_CACHE="0") == "False True ['fakedist']"
    assert not (tmp_path / "home" / "package_map.json").exists()
