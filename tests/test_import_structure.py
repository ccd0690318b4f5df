"""transformers' import structure kept between runs (import_structure.py): the answer transformers
computes itself, computed again whenever a file under the folder it reads changes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from batchgen import import_structure


class Counted:
    """A stand-in for define_import_structure: the folder's file names and sizes."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, module_path: str, prefix: str | None = None) -> dict:
        self.calls += 1
        return {
            (prefix, p.name): p.stat().st_size
            for p in sorted(Path(module_path).rglob("*.py"))
            if "__pycache__" not in p.parts
        }


@pytest.fixture
def tree(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("BATCHGEN_HOME", str(tmp_path / "home"))
    folder = tmp_path / "models"
    (folder / "llama").mkdir(parents=True)
    (folder / "llama" / "modeling_llama.py").write_text("__all__ = ['A']\n")
    (folder / "__init__.py").write_text("")
    (tmp_path / "source.py").write_text("def define_import_structure(): ...\n")
    return folder


def _new_process(compute: Counted, tree: Path):
    """The wrapper a new process would install (its in-process answers start empty)."""
    return import_structure.kept(compute, str(tree.parent / "source.py"))


def test_the_answer_is_computed_once_then_read_back(tree: Path) -> None:
    compute = Counted()
    first = _new_process(compute, tree)(str(tree), prefix="models")
    again = _new_process(compute, tree)(str(tree), prefix="models")
    assert again == first == compute(str(tree), prefix="models")
    assert compute.calls == 2  # the first process's and this test's own call
    other = _new_process(compute, tree)(str(tree))  # other arguments: their own answer
    assert other == compute(str(tree)) and compute.calls == 4


def test_an_edited_added_or_removed_file_computes_it_again(tree: Path) -> None:
    compute = Counted()
    ask = lambda: _new_process(compute, tree)(str(tree))  # noqa: E731
    ask()
    (tree / "llama" / "modeling_llama.py").write_text("__all__ = ['A', 'Bee']\n")
    assert ask()[(None, "modeling_llama.py")] == len("__all__ = ['A', 'Bee']\n")
    (tree / "llama" / "configuration_llama.py").write_text("__all__ = []\n")
    assert (None, "configuration_llama.py") in ask()
    (tree / "llama" / "configuration_llama.py").unlink()
    assert (None, "configuration_llama.py") not in ask()
    assert compute.calls == 4


def test_bytecode_folders_do_not_count_but_the_defining_source_does(tree: Path) -> None:
    compute = Counted()
    ask = lambda: _new_process(compute, tree)(str(tree))  # noqa: E731
    ask()
    (tree / "llama" / "__pycache__").mkdir()
    (tree / "llama" / "__pycache__" / "modeling_llama.cpython-311.pyc").write_bytes(b"x")
    ask()
    assert compute.calls == 1
    source = tree.parent / "source.py"
    source.write_text("def define_import_structure(): return 2\n")
    ask()
    assert compute.calls == 2


def test_a_damaged_file_is_computed_again(tree: Path) -> None:
    compute = Counted()
    answer = _new_process(compute, tree)(str(tree))
    (kept_file,) = import_structure.import_structure_dir().iterdir()
    kept_file.write_bytes(b"not a pickle")
    assert _new_process(compute, tree)(str(tree)) == answer
    assert compute.calls == 2


CHECK = """
import hashlib
from batchgen.process_start import prepare_imports
prepare_imports()
from pathlib import Path
import transformers
import transformers.models
from transformers import LlamaForCausalLM
from transformers.utils import import_utils
define = import_utils.define_import_structure
raw = define
while hasattr(raw, "__wrapped__"):
    raw = raw.__wrapped__
llama = Path(transformers.__file__).parent / "models" / "llama"
names = sorted(dir(transformers)) + sorted(dir(transformers.models))
print(type(define).__name__ == "function", define(llama, prefix="t") == raw(llama, prefix="t"),
      LlamaForCausalLM.__name__, len(names), hashlib.sha256(repr(names).encode()).hexdigest())
"""


def _run(tmp_path: Path, **env: str) -> list[str]:
    out = subprocess.run(
        [sys.executable, "-c", CHECK], capture_output=True, text=True, check=True,
        env={**os.environ, "BATCHGEN_HOME": str(tmp_path / "home"), **env},
    )  # fmt: skip
    return out.stdout.split("\n")[0].split()


def test_transformers_imports_with_the_structure_it_computes_itself(tmp_path: Path) -> None:
    own = _run(tmp_path / "own", BATCHGEN_IMPORT_STRUCTURE_CACHE="0")
    assert own[:3] == ["False", "True", "LlamaForCausalLM"]  # transformers' own function
    assert int(own[3]) > 1000  # every name transformers exports
    first = _run(tmp_path)
    assert any((tmp_path / "home" / "import_structure").iterdir())
    again = _run(tmp_path)  # read back
    assert first[:3] == again[:3] == ["True", "True", "LlamaForCausalLM"]
    assert first[3:] == again[3:] == own[3:]  # the same names, from the same structure
    assert not (tmp_path / "own" / "home" / "import_structure").exists()
