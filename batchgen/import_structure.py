"""transformers' import structure, kept between runs.

As `import transformers` runs, transformers 5.x builds the map of what each of its ~450 model
folders exports (`define_import_structure`: every module's source read and its `__all__` and
`@requires` lines parsed, ~3,300 files) twice, once for `transformers/__init__.py` and once for
`transformers/models/__init__.py`: 0.2 s each on the development CPU, for the same answer at
every start.

`keep_import_structure()` has that function answer from $BATCHGEN_HOME
(`home.import_structure_dir`) while the folder it reads is unchanged, and compute it (and keep
it) otherwise. Unchanged means: the same Python, the same source of the module that defines the
function, the same folders under the folder read (`__pycache__` aside), and every file in them
with the same path, size and modification time; an upgraded or edited transformers changes
one of them. The function is replaced as its module finishes loading, before transformers
first calls it; a transformers without it, or one imported already, is left as it is.

transformers changes the structure it gets back (its top-level names are merged into the
models' one): what is kept is the answer as computed, and within a process every call with the
same arguments gets the same object, as transformers' own cache gives it.

Only batchgen's own processes do this (process_start.py); BATCHGEN_IMPORT_STRUCTURE_CACHE=0
turns it off.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.abc
import os
import pickle
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from batchgen.home import import_structure_dir, turned_off

ENV = "BATCHGEN_IMPORT_STRUCTURE_CACHE"
MODULE = "transformers.utils.import_utils"
FUNCTION = "define_import_structure"
_SKIPPED_FOLDERS = ("__pycache__",)


def keep_import_structure() -> bool:
    """Have MODULE's FUNCTION kept once MODULE loads; -> whether that was arranged."""
    if turned_off(ENV) or MODULE in sys.modules:
        return False
    if any(isinstance(finder, _Patcher) for finder in sys.meta_path):
        return False
    sys.meta_path.insert(0, _Patcher())
    return True


class _Patcher(importlib.abc.MetaPathFinder):
    """Finds MODULE through the other finders and wraps its loader so that FUNCTION is
    replaced as soon as the module's code has run. Used once."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != MODULE:
            return None
        with contextlib.suppress(ValueError):
            sys.meta_path.remove(self)
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            spec = find(name, path, target) if find is not None else None
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        run = getattr(loader, "exec_module", None)
        if run is None:
            return spec

        def exec_module(module: Any) -> None:
            run(module)
            original = getattr(module, FUNCTION, None)
            source = getattr(module, "__file__", None)
            if callable(original) and source:
                setattr(module, FUNCTION, kept(original, source))

        loader.exec_module = exec_module  # this spec's own loader object
        return spec


def kept(compute: Callable[..., Any], source: str) -> Callable[..., Any]:
    """`compute(module_path, ...)` answered from the kept file while what it reads is
    unchanged (see the module's docstring); in this process, once per arguments."""
    answers: dict[str, Any] = {}

    @functools.wraps(compute)
    def define_import_structure(*args: Any, **kwargs: Any) -> Any:
        call = repr((args, sorted(kwargs.items())))
        if call in answers:
            return answers[call]
        key = _key(source, args[0] if args else kwargs.get("module_path"))
        path = import_structure_dir() / f"{hashlib.sha256(call.encode()).hexdigest()[:32]}.pickle"
        answer = None
        if key is not None:
            with contextlib.suppress(Exception):  # missing, damaged or stale: computed again
                stored_key, stored = pickle.loads(path.read_bytes())
                if stored_key == key:
                    answer = stored
        if answer is None:
            answer = compute(*args, **kwargs)
            if key is not None:
                _store(path, (key, answer))
        answers[call] = answer
        return answer

    define_import_structure.cache_clear = lambda: (  # type: ignore[attr-defined]
        answers.clear(),
        getattr(compute, "cache_clear", lambda: None)(),
    )
    return define_import_structure


def _store(path: Path, value: Any) -> None:
    with contextlib.suppress(Exception):  # kept where it can be
        from batchgen.io.atomic import write_atomic  # (pyarrow: only when writing)

        data = pickle.dumps(value, pickle.HIGHEST_PROTOCOL)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, lambda f: f.write(data))


def _key(source: str, module_path: Any) -> str | None:
    """A digest of what the answer depends on; None where it cannot be read."""
    if module_path is None:
        return None
    folder = Path(module_path)
    if not folder.is_dir():
        folder = folder.parent  # a file stands for its folder, as transformers takes it
    try:
        parts = [sys.version, _stamp(source), str(folder.resolve())]
        stack = [str(folder)]
        while stack:
            with os.scandir(stack.pop()) as listing:
                for entry in listing:
                    if entry.name in _SKIPPED_FOLDERS:
                        continue
                    if entry.is_dir(follow_symlinks=False):
                        parts.append(entry.path)  # what it holds counts, not its own time
                        stack.append(entry.path)
                    else:
                        parts.append(f"{entry.path}|{_stamp(entry)}")
    except OSError:
        return None
    return hashlib.sha256("\n".join(sorted(parts)).encode()).hexdigest()


def _stamp(entry: Any) -> str:
    stat = entry.stat(follow_symlinks=False) if isinstance(entry, os.DirEntry) else os.stat(entry)
    return f"{stat.st_size}|{stat.st_mtime_ns}"
