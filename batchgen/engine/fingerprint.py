"""A fingerprint of a loaded model: what decides its outputs besides the settings.

Config (without bookkeeping keys), a checksum of every element of every weight tensor (in the
loaded dtype, computed where the weights are), the tokenizer (vocabulary, normalization, special
tokens and which part each plays, the flags that change encoding or decoding, chat template) and
the end-of-sequence ids. Two loads of the same checkpoint agree, on
any device; a retrained or edited checkpoint (a single element changed), another tokenizer or
chat template does not. A model with adapter layers (peft's LoRA and other tuners) adds their
state (which adapters are active, disabled, merged, their scales); a caller's model adds its
non-persistent buffers (a rotary table its config no longer describes once changed in place)
and its module tree (an activation swapped, a norm's eps changed).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import numpy as np
import torch
from transformers import PreTrainedModel

_CONFIG_SKIP = {"transformers_version", "dtype", "torch_dtype", "attn_implementation"}
CHUNK = 1 << 16  # elements per weights checksum
BLOCK = 1 << 24  # elements multiplied at once (a multiple of CHUNK): bounds the temporaries
_WORDS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}  # by element size
_MULTIPLIERS: dict[str, torch.Tensor] = {}  # device -> CHUNK multipliers


def model_fingerprint(
    model: PreTrainedModel, tokenizer: Any, eos_token_ids: frozenset[int], adopted: bool = False
) -> dict[str, str]:
    """adopted: the caller's model (its buffers count)."""
    out = {
        "name": str(getattr(model, "name_or_path", "") or type(model).__name__),
        "config": _digest(json.dumps(_clean(model.config.to_dict()), sort_keys=True, default=str)),
        "weights_checksum": _weights_digest(model),
        **tokenizer_fingerprint(tokenizer),
        **eos_fingerprint(eos_token_ids),
    }
    adapters = adapter_state(model)
    if adapters:  # a model without adapter layers keeps the fingerprint it always had
        out["adapters"] = _digest(repr(adapters))
    if adopted:
        out["buffers"] = buffers_digest(nonpersistent_buffers(model)).hex()
        out["modules"] = modules_digest(model)
    return out


def modules_digest(model: torch.nn.Module) -> str:
    """The module tree as its repr shows it: each module's class and its own settings (an
    activation swapped, a norm's eps, a layer wrapped), which change outputs without changing
    any tensor."""
    return _digest(repr(model))


def eos_fingerprint(eos_token_ids: frozenset[int]) -> dict[str, str]:
    """The end-of-sequence ids' part of model_fingerprint."""
    return {"eos_token_ids": ",".join(str(i) for i in sorted(eos_token_ids))}


# attributes of an adapter layer (peft's BaseTunerLayer) that decide its forward
ADAPTER_STATE = ("active_adapters", "disable_adapters", "merged_adapters", "scaling")


def adapter_state(model: torch.nn.Module) -> tuple[tuple[Any, ...], ...]:
    """(module name, active adapters, disabled, merged adapters, scales) of each adapter layer,
    known by its attributes (no peft import): what switching, disabling, merging or scaling
    adapters changes without changing any tensor's version."""
    out = []
    for name, module in model.named_modules():
        values = [getattr(module, a, None) for a in ADAPTER_STATE]
        if any(v is not None and not callable(v) for v in values[:3]):
            out.append((name, *map(_plain, values)))
    return tuple(out)


def _plain(value: Any) -> Any:
    """value as nested tuples of plain values (comparable, with a stable repr)."""
    if isinstance(value, dict):
        return tuple(sorted((str(k), _plain(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return tuple(_plain(v) for v in value)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return repr(value)


def nonpersistent_buffers(model: torch.nn.Module) -> list[torch.Tensor]:
    """The floating-point buffers state_dict leaves out (rotary inv_freq and the like)."""
    return [
        t
        for module in model.modules()
        for name, t in module._buffers.items()
        if t is not None
        and name in module._non_persistent_buffers_set
        and t.is_floating_point()
        and t.device.type != "meta"
    ]


@torch.inference_mode()
def buffers_digest(buffers: list[torch.Tensor]) -> bytes:
    """16 bytes over non-persistent floating-point buffers' (nonpersistent_buffers) shapes,
    dtypes and contents (weights_sums): their version counters say nothing (LongRoPE copies
    its factors into inv_freq at every forward)."""
    h = hashlib.blake2b(digest_size=16)
    sums = []
    for tensor in buffers:
        h.update(f"{tuple(tensor.shape)}:{tensor.dtype};".encode())
        if tensor.numel():
            sums.append(weights_sums(tensor).cpu())
    if sums:
        h.update(torch.cat(sums).numpy().tobytes())
    return h.digest()


def _clean(value: Any) -> Any:
    if isinstance(value, dict):
        return {
            k: _clean(v)
            for k, v in value.items()
            if not str(k).startswith("_") and k not in _CONFIG_SKIP
        }
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


@torch.inference_mode()
def _weights_digest(model: PreTrainedModel) -> str:
    """sha256 over each tensor's name, shape and dtype and its chunk checksums (weights_sums),
    moved off the device once."""
    h = hashlib.sha256()
    sums = []
    seen: dict[tuple[Any, ...], torch.Tensor] = {}  # tied weights are summed once
    for name, tensor in sorted(model.state_dict().items()):
        h.update(f"{name}:{tuple(tensor.shape)}:{tensor.dtype};".encode())
        if tensor.numel():
            key = (tensor.device, tensor.data_ptr(), tensor.shape, tensor.stride(), tensor.dtype)
            if key not in seen:
                seen[key] = weights_sums(tensor)
            sums.append(seen[key])
    if sums:
        h.update(torch.cat([s.to(sums[0].device) for s in sums]).cpu().numpy().tobytes())
    return h.hexdigest()


def weights_sums(tensor: torch.Tensor) -> torch.Tensor:
    """One int64 per CHUNK elements of the tensor (on its device): the sum of its raw words
    (the elements' bytes as integers of their width), each times a fixed odd pseudo-random
    multiplier of its place in the chunk, wrapping modulo 2**64. Integer sums wrap the same in
    any order, so every device gives the same values; a change of one element always changes
    its chunk's (an odd multiplier times a change below 2**64 is never 0 modulo 2**64), and
    chunks are hashed in order. The product is made in blocks of BLOCK elements."""
    flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    words = flat.view(_WORDS.get(tensor.element_size(), torch.int64))
    multipliers = _multipliers(words.device)
    out = []
    for start in range(0, words.numel(), BLOCK):
        block = words[start : start + BLOCK].to(torch.int64)
        full = block.numel() // CHUNK * CHUNK
        if full:
            out.append((block[:full].view(-1, CHUNK) * multipliers).sum(dim=1))
        if full < block.numel():
            rest = block[full:]
            out.append((rest * multipliers[: rest.numel()]).sum().reshape(1))
    return torch.cat(out)


def _multipliers(device: torch.device) -> torch.Tensor:
    """CHUNK fixed odd 64-bit multipliers (splitmix64 of their place), on `device`."""
    key = str(device)
    if key not in _MULTIPLIERS:
        x = np.arange(CHUNK, dtype=np.uint64) + np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        x = (x ^ (x >> np.uint64(31))) | np.uint64(1)
        _MULTIPLIERS[key] = torch.from_numpy(x.view(np.int64)).to(device)
    return _MULTIPLIERS[key]


def tokenizer_fingerprint(tokenizer: Any) -> dict[str, str]:
    """The tokenizer's part of model_fingerprint, as the tokenizer is now (a caller's tokenizer
    can be changed between calls: its chat template set, tokens added)."""
    return {
        "tokenizer": _tokenizer_digest(tokenizer),
        "tokenizer_settings": _tokenizer_settings_digest(tokenizer),
    }


def _tokenizer_digest(tokenizer: Any) -> str:
    if tokenizer is None:
        return "none"
    backend = getattr(tokenizer, "backend_tokenizer", None) or getattr(
        tokenizer, "_tokenizer", None
    )
    if backend is not None and hasattr(backend, "to_str"):
        body = backend.to_str()
    else:
        body = json.dumps(sorted(tokenizer.get_vocab().items()))
    extra = {
        "chat_template": getattr(tokenizer, "chat_template", None),
        "special": sorted(map(str, getattr(tokenizer, "all_special_tokens", []))),
        "bos": getattr(tokenizer, "add_bos_token", None),
        "eos": getattr(tokenizer, "add_eos_token", None),
    }
    return _digest(body + json.dumps(extra, sort_keys=True, default=str))


# tokenizer attributes that change the ids of a text or the text of ids, beside its backend's
# own description: a flag is recorded only where it is set, so a transformers that lacks it
# records the same as one where it is off
TOKENIZER_FLAGS = (
    "split_special_tokens",  # special tokens' text encoded as plain text
    "clean_up_tokenization_spaces",  # spaces before punctuation dropped when decoding
    "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output",
    "add_prefix_space",
    "do_lower_case",
)


def _tokenizer_settings_digest(tokenizer: Any) -> str:
    """Which token plays which part (BOS, EOS, PAD, UNK, extra special tokens: a chat template's
    {{ bos_token }} renders the BOS's text) and the flags that change encoding or decoding."""
    if tokenizer is None:
        return "none"
    roles = {
        role: value if isinstance(value, str) else [str(v) for v in value]
        for role, value in (getattr(tokenizer, "special_tokens_map", None) or {}).items()
        if value
    }
    flags = {name: getattr(tokenizer, name, None) for name in TOKENIZER_FLAGS}
    flags = {name: value for name, value in flags.items() if value not in (None, False)}
    return _digest(json.dumps({"roles": roles, "flags": flags}, sort_keys=True, default=str))


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()
