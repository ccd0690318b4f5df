"""A model folder's weights read onto the device while the engine's process still imports.

An engine process spends seconds importing transformers' model code before it can call
`from_pretrained`. Reading the weights needs none of it: the safetensors files are a JSON
header and raw bytes, which threads read (`preadv`, the GIL released, nothing mapped) into
pinned buffers and copy to the GPU (upload.py). `Preload` starts that on a thread as soon as
the process knows its model; `load_model` then builds the model from these tensors with
transformers' own loading (`from_pretrained(state_dict=...)`: the same key conversions, ties,
dtype casts and buffers; on a GPU its device map needs accelerate).

Only what that path loads exactly is read ahead: a local folder of safetensors files, no
quantization config, no weight files outside the safetensors index. Anything else (and any
error here) leaves the model to the usual `from_pretrained` of the folder.
"""

from __future__ import annotations

import json
import os
import struct
import threading
from pathlib import Path

import torch

from batchgen.engine.upload import FileBytes, Source, copy_to_device

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
DTYPES = {
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F32": torch.float32,
    "F64": torch.float64,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}


def weight_files(folder: str | Path) -> list[Path] | None:
    """The folder's safetensors files when its weights are all in them and it carries no
    quantization config; None otherwise (the folder is loaded the usual way)."""
    folder = Path(folder)
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict) or config.get("quantization_config"):
        return None
    if (folder / INDEX_FILE).is_file():
        try:
            weight_map = json.loads((folder / INDEX_FILE).read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError):
            return None
        files = sorted({folder / name for name in weight_map.values()})
    elif (folder / SINGLE_FILE).is_file():
        files = [folder / SINGLE_FILE]
    else:
        return None
    return files if all(f.is_file() for f in files) else None


def read_safetensors(files: list[Path], device: torch.device) -> dict[str, torch.Tensor]:
    """Every tensor of the files, on `device`, as stored (dtype and shape). ValueError for a
    file this reader does not take (an unknown dtype, a damaged header)."""
    pairs: list[tuple[Source, torch.Tensor]] = []
    tensors: dict[str, torch.Tensor] = {}
    fds = []
    try:
        for file in files:
            fd = os.open(file, os.O_RDONLY)
            fds.append(fd)
            for name, (dtype, shape, begin, end) in _header(fd).items():
                if name in tensors:
                    raise ValueError(f"tensor {name!r} is stored twice")
                tensor = torch.empty(shape, dtype=dtype, device=device)
                if end - begin != tensor.numel() * tensor.element_size():
                    raise ValueError(f"tensor {name!r} has {end - begin} bytes for {shape}")
                tensors[name] = tensor
                if end > begin:
                    pairs.append((FileBytes(fd, begin, end - begin), _bytes(tensor)))
        copy_to_device(pairs)
    finally:
        for fd in fds:
            os.close(fd)
    return tensors


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.view(-1).view(torch.uint8)


def _header(fd: int) -> dict[str, tuple[torch.dtype, list[int], int, int]]:
    """name -> (dtype, shape, first byte, end byte) in the file, from its JSON header."""
    length = os.fstat(fd).st_size
    if length < 8:
        raise ValueError("file too short for a safetensors header")
    (size,) = struct.unpack("<Q", os.pread(fd, 8, 0))
    if 8 + size > length:
        raise ValueError("header longer than the file")
    header = json.loads(os.pread(fd, size, 8))
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] not in DTYPES:
            raise ValueError(f"dtype {info['dtype']!r} of {name!r} is not read here")
        begin, end = (8 + size + int(x) for x in info["data_offsets"])
        if not 8 + size <= begin <= end <= length:
            raise ValueError(f"tensor {name!r} lies outside the file")
        out[name] = (DTYPES[info["dtype"]], [int(n) for n in info["shape"]], begin, end)
    return out


class Preload:
    """`read_safetensors` of a folder on a thread of its own, started at once; `take` waits
    for it. Failures are kept quiet: `take` then answers None."""

    def __init__(self, folder: str, device: torch.device) -> None:
        self.folder, self.device = str(folder), device
        self._tensors: dict[str, torch.Tensor] | None = None
        self._thread = threading.Thread(target=self._read, name="batchgen-preload", daemon=True)
        self._thread.start()

    def _read(self) -> None:
        files = weight_files(self.folder)
        if files is None:
            return
        try:
            self._tensors = read_safetensors(files, self.device)
        except Exception:  # the usual load reads the folder and says what is wrong
            self._tensors = None

    def take(self, folder: str, device: torch.device) -> dict[str, torch.Tensor] | None:
        """The tensors read for `folder` on `device` (once), or None."""
        self._thread.join()
        tensors, self._tensors = self._tensors, None
        if tensors is None or str(folder) != self.folder or device != self.device:
            return None
        return tensors
