"""Pre-quantized FP8 checkpoints, detected from the model folder's config.json.

Formats (both E4M3 weights; activations are always quantized per token at run time, so a
checkpoint's static `input_scale`s are not used):
- "compressed-tensors": quant_method "compressed-tensors", format "float-quantized", 8-bit
  float weights with strategy "channel" (`weight_scale` [N, 1]) or "tensor" (one scale).
  Loaded exactly: the same FP8 values, the per-tensor scale repeated per channel.
- "fp8": transformers' FineGrainedFP8Config (quant_method "fp8"): `weight_scale_inv` per
  [128, 128] block (weight_block_size) or one per tensor. Block scales are converted: each
  weight is dequantized and quantized again per output channel (one more FP8 rounding; a
  block-scaled GEMM is not implemented). AutoFP8 checkpoints (the same quant_method) store a
  per-tensor `weight_scale` instead, loaded exactly.
The model is built from its config without the quantization section (transformers' own FP8
integration is not used), its 16-bit tensors loaded as usual, and every Linear whose weight
is stored in FP8 replaced by an Fp8Linear built from the stored tensors.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from batchgen.engine.quant.fp8 import Fp8Linear, quantize_weight
from batchgen.errors import BatchgenError

FORMATS = ("compressed-tensors", "fp8")
# tensors of an FP8 checkpoint that are not module weights: the weight scales are read here,
# static activation and KV scales deliberately not used (activations are scaled per token)
WEIGHT_SCALES = ("weight_scale", "weight_scale_inv")
SCALE_SUFFIXES = ("weight_scale", "weight_scale_inv", "input_scale", "k_scale", "v_scale")


SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
MAX_HEADER_BYTES = 100_000_000  # the safetensors format's own bound on a header
MODELOPT_FILE = "hf_quant_config.json"  # NVIDIA TensorRT Model Optimizer's quantization
FLOAT_DTYPES = ("BF16", "F16", "F32", "F64")  # safetensors names of 16/32/64-bit floats
E4M3 = "F8_E4M3"


def checkpoint_folder(source: str) -> str:
    """The folder whose files describe the model: source itself, or for a hub id its snapshot
    in the Hugging Face cache, with its .json files and, where its config names a
    quantization, the weight files from_pretrained reads (fetched as from_pretrained would,
    or taken from the cache offline). source as it is where the hub id cannot be had
    (from_pretrained then says why)."""
    if Path(source).is_dir():
        return source
    try:
        from huggingface_hub import snapshot_download

        folder = Path(snapshot_download(source, allow_patterns=["*.json"]))
        config = json.loads((folder / "config.json").read_text())
        quant = config.get("quantization_config") if isinstance(config, dict) else None
    except Exception:  # not a hub id, offline and not cached, no config: from_pretrained says
        return source
    if not quant:
        return str(folder)
    quantization_format(quant, source)  # a quantization batchgen refuses: before any weights
    try:
        names = [f.name for f in weight_files(folder)] or [SINGLE_FILE]
        folder = Path(snapshot_download(source, allow_patterns=["*.json", *names]))
    except Exception:
        return source
    return str(folder)


def checkpoint_format(source: str) -> str | None:
    """A local folder's FP8 format (one of FORMATS); None for a 16-bit model or a hub id
    (checkpoint_folder gives a hub id's folder);
    BatchgenError for a quantization batchgen does not run, or for a folder whose config
    describes no quantization yet whose weights are stored quantized."""
    folder = Path(source)
    path = folder / "config.json"
    if not path.is_file():
        return None
    if (folder / MODELOPT_FILE).is_file():
        raise BatchgenError(
            f"model '{source}' has {MODELOPT_FILE} (quantized by NVIDIA TensorRT Model "
            "Optimizer): batchgen does not run ModelOpt checkpoints; use a 16-bit, "
            "compressed-tensors FP8 or transformers FP8 checkpoint"
        )
    quant = json.loads(path.read_text()).get("quantization_config")
    if not quant:
        _check_unquantized(source)
        return None
    return quantization_format(quant, source)


def quantization_format(quant: dict[str, Any], source: str) -> str:
    """The FP8 format (one of FORMATS) of a config's quantization_config; BatchgenError for
    a quantization batchgen does not run."""
    method = quant.get("quant_method")
    if method == "fp8" and quant.get("activation_scheme", "dynamic") == "dynamic":
        return "fp8"
    if method == "compressed-tensors" and _float8_groups(quant):
        feature = _compressed_tensors_extra(quant)
        if feature is None:
            return "compressed-tensors"
        raise BatchgenError(
            f"model '{source}' is compressed-tensors FP8 with {feature}: batchgen loads "
            "dense, symmetric FP8 weights without transforms only; use such a checkpoint or "
            "the 16-bit model"
        )
    raise BatchgenError(
        f"model '{source}' is quantized as {method!r} "
        f"({json.dumps(quant, sort_keys=True)[:160]}): batchgen runs 16-bit checkpoints, "
        "compressed-tensors float-quantized FP8 and transformers' FP8 checkpoints only"
    )


def _check_unquantized(source: str) -> None:
    """BatchgenError for a folder without a quantization config whose weights are stored in
    a low-precision type (FP8, integers): they would be cast to 16 bits without their scales.
    Reads the safetensors headers only."""
    for name, dtype in safetensors_dtypes(Path(source)).items():
        if dtype not in FLOAT_DTYPES and (name.endswith(".weight") or dtype.startswith("F8")):
            raise BatchgenError(
                f"model '{source}' stores '{name}' as {dtype} but its config.json has no "
                "quantization_config: batchgen cannot tell how to scale it; use a 16-bit "
                "checkpoint, or one whose config.json describes its quantization"
            )


def weight_files(folder: Path) -> list[Path]:
    """The safetensors files from_pretrained reads: model.safetensors, else those its index
    names ([] where there are none, or the index cannot be read)."""
    if (folder / SINGLE_FILE).is_file():
        return [folder / SINGLE_FILE]
    try:
        weight_map = json.loads((folder / INDEX_FILE).read_text())["weight_map"]
        return sorted({folder / name for name in weight_map.values()})
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return []


def safetensors_dtypes(folder: Path) -> dict[str, str]:
    """name -> safetensors dtype ("BF16", "F8_E4M3", ...) of every tensor in the folder's
    weight files, from their JSON headers (the tensors are not read)."""
    out: dict[str, str] = {}
    for file in weight_files(folder):
        try:
            with file.open("rb") as f:
                size = int.from_bytes(f.read(8), "little")
                if not 0 < size <= min(MAX_HEADER_BYTES, file.stat().st_size - 8):
                    continue  # not a safetensors file: from_pretrained says what is wrong
                header = json.loads(f.read(size))
        except (OSError, ValueError):
            continue  # from_pretrained says what is wrong with the file
        for name, info in header.items():
            if name != "__metadata__" and isinstance(info, dict):
                out[name] = str(info.get("dtype"))
    return out


def _compressed_tensors_extra(quant: dict[str, Any]) -> str | None:
    """What a compressed-tensors FP8 config asks beyond weights x scales, which batchgen's
    loader would drop (sparse storage, rotations, zero points), or None."""
    sparsity = quant.get("sparsity_config") or {}
    if sparsity and sparsity.get("format", "dense") != "dense":
        return f"sparsity_config format {sparsity.get('format')!r} (compressed sparse weights)"
    if quant.get("transform_config"):
        return "a transform_config (weights stored rotated, e.g. by Hadamard transforms)"
    for group in (quant.get("config_groups") or {}).values():
        weights = group.get("weights") or {}
        if weights.get("symmetric", True) is not True:
            return "asymmetric weights (symmetric: false, zero points)"
        if weights.get("dynamic", False) is not False:
            return f"dynamic weight scales (dynamic: {weights.get('dynamic')!r})"
    return None


def _float8_groups(quant: dict[str, Any]) -> bool:
    """Every config group is 8-bit float weights, per channel or per tensor."""
    groups = quant.get("config_groups") or {}
    top = quant.get("format")
    for group in groups.values():
        weights = group.get("weights") or {}
        if (
            group.get("format", top) != "float-quantized"
            or weights.get("num_bits") != 8
            or weights.get("type") != "float"
            or weights.get("strategy") not in ("channel", "tensor")
        ):
            return False
    return bool(groups)


def load_fp8_checkpoint(source: str, fmt: str, dtype: torch.dtype, attention: str) -> nn.Module:
    """The model of a pre-quantized folder: 16-bit modules in dtype, FP8 Linear layers.
    The folder's weight files are those from_pretrained reads (model.safetensors, else the
    files its index names), checked from their headers before anything is loaded."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import logging

    folder = Path(source)
    config = AutoConfig.from_pretrained(source)
    quant = dict(config.quantization_config)
    block = quant.get("weight_block_size") or (128, 128)  # [rows, cols] of one scale block
    del config.quantization_config
    dtypes = safetensors_dtypes(folder)
    _check_stored_types(source, dtypes)
    names = sorted(name for name, stored in dtypes.items() if stored == E4M3)
    if not names:
        raise BatchgenError(f"model '{source}' says it is FP8 but stores no FP8 weights")
    _check_linear_targets(source, config, names)
    layers = [name.removesuffix(".weight") for name in names]
    scales = {f"{layer}.{suffix}" for layer in layers for suffix in WEIGHT_SCALES}
    tensors = _read_tensors(folder, set(names) | (scales & set(dtypes)))
    verbosity = logging.get_verbosity()
    logging.set_verbosity_error()  # FP8 weights and their scales are read below
    try:
        model, info = AutoModelForCausalLM.from_pretrained(
            source,
            config=config,
            dtype=dtype,
            attn_implementation=attention,
            output_loading_info=True,
        )
    finally:
        logging.set_verbosity(verbosity)
    check_loading_info(source, model, info, SCALE_SUFFIXES)
    for layer in layers:
        weight = tensors[f"{layer}.weight"]
        parent_name, _, child = layer.rpartition(".")
        parent = model.get_submodule(parent_name)
        old = getattr(parent, child)
        scale = _channel_scale(fmt, tensors, layer, weight)
        if fmt == "fp8" and scale.dim() == 2:  # [N/128, K/128] block scales
            weight, scale = _requantize_blocks(weight, scale, block)
        bias = None if old.bias is None else old.bias.detach()
        setattr(parent, child, Fp8Linear(weight, scale.reshape(-1).float(), bias))
    return model


def _check_linear_targets(source: str, config: Any, names: list[str]) -> None:
    """BatchgenError, before anything is loaded, for an FP8 weight that is not the weight of
    an nn.Linear of the model the config builds (an embedding, fused mixture-of-experts
    parameters, a name of another layout): only Linear layers are loaded in FP8."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    for name in names:
        try:
            module = skeleton.get_submodule(name.removesuffix(".weight"))
        except AttributeError:
            module = None
        if not isinstance(module, nn.Linear):
            there = "no module" if module is None else type(module).__name__
            raise BatchgenError(
                f"FP8 model '{source}' stores '{name}', which is not the weight of an "
                f"nn.Linear of its {type(skeleton).__name__} ({there} there): batchgen loads "
                "FP8 weights of Linear layers only (not embeddings, fused mixture-of-experts "
                "parameters or other layouts)"
            )


def _check_stored_types(source: str, dtypes: dict[str, str]) -> None:
    """BatchgenError for a tensor stored other than in 16/32/64-bit floats or as an E4M3
    weight: batchgen runs E4M3 weights only (E5M2 and other 8-bit types are refused)."""
    for name, dtype in dtypes.items():
        if dtype in FLOAT_DTYPES or (dtype == E4M3 and name.endswith(".weight")):
            continue
        raise BatchgenError(
            f"FP8 model '{source}' stores '{name}' as {dtype}: batchgen loads FP8 E4M3 weights "
            "(safetensors F8_E4M3) with float scales, and 16/32-bit tensors, only"
        )


def check_loading_info(
    source: str, model: nn.Module, info: dict[str, Any], consumed: tuple[str, ...] | None = None
) -> None:
    """BatchgenError where from_pretrained left weights of the model uninitialized (random),
    or, for an FP8 folder (`consumed` given), where it holds tensors the model does not take,
    other than those ending in one of `consumed` (read or deliberately ignored by the caller).
    A 16-bit folder's leftovers (buffers older transformers saved, such as GPT-2's
    masked_bias) are ignored, as transformers ignores them."""
    missing = sorted(info.get("missing_keys") or ())
    if missing:
        raise BatchgenError(
            f"model '{source}' lacks {len(missing)} tensor(s) its {type(model).__name__} "
            f"needs ({_names(missing)}): they would be random; check the model folder (an "
            "incomplete download or a conversion that dropped them)"
        )
    if consumed is None:
        return
    unexpected = sorted(k for k in info.get("unexpected_keys") or () if not k.endswith(consumed))
    if unexpected:
        raise BatchgenError(
            f"model '{source}' stores {len(unexpected)} tensor(s) its "
            f"{type(model).__name__} does not take ({_names(unexpected)}): batchgen would run "
            "without them; check the model folder and its quantization"
        )


def _names(keys: list[str], shown: int = 3) -> str:
    more = f", ... {len(keys) - shown} more" if len(keys) > shown else ""
    return ", ".join(repr(k) for k in keys[:shown]) + more


def _read_tensors(folder: Path, wanted: set[str]) -> dict[str, torch.Tensor]:
    """The tensors named in `wanted` from the folder's weight files."""
    tensors: dict[str, torch.Tensor] = {}
    for file in weight_files(folder):
        with safe_open(file, framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                if key in wanted:
                    tensors[key] = f.get_tensor(key)
    return tensors


def _channel_scale(
    fmt: str, tensors: dict[str, torch.Tensor], layer: str, weight: torch.Tensor
) -> torch.Tensor:
    """[N] per-channel scales (a per-tensor one repeated), or [N/128, K/128] block scales.
    transformers' FP8 stores `weight_scale_inv`, AutoFP8 (the same quant_method) and
    compressed-tensors `weight_scale`: each is what the FP8 values are multiplied by."""
    key = f"{layer}.weight_scale"
    if fmt == "fp8" and f"{key}_inv" in tensors:
        key = f"{key}_inv"
    if key not in tensors:
        raise BatchgenError(f"FP8 weight '{layer}.weight' has no '{key}' in the checkpoint")
    scale = tensors[key].float()
    rows = weight.shape[0]
    if scale.numel() == 1:
        return scale.reshape(1).expand(rows).clone()
    if scale.shape in ((rows, 1), (rows,)):
        return scale.reshape(rows)
    if fmt == "fp8" and scale.dim() == 2:
        return scale
    raise BatchgenError(f"'{key}' has shape {tuple(scale.shape)}: not per tensor or per channel")


def _requantize_blocks(
    weight: torch.Tensor, blocks: torch.Tensor, block: tuple[int, int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8 [N, K] with block scales [ceil(N/bn), ceil(K/bk)] -> per-channel (fp8, [N])."""
    rows, cols = weight.shape
    bn, bk = block
    if blocks.shape != (-(-rows // bn), -(-cols // bk)):
        raise BatchgenError(
            f"block scales {tuple(blocks.shape)} do not tile a {rows}x{cols} weight in "
            f"{bn}x{bk} blocks"
        )
    full = blocks.repeat_interleave(bn, 0)[:rows].repeat_interleave(bk, 1)[:, :cols]
    return quantize_weight(weight.float() * full)
