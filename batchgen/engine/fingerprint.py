"""A cheap fingerprint of a loaded model: what decides its outputs besides the settings.

Config (without bookkeeping keys), a sample of every weight tensor (evenly spaced elements,
in the loaded dtype), the tokenizer (vocabulary, normalization, special tokens, chat template)
and the end-of-sequence ids. Two loads of the same checkpoint agree; a retrained or edited
checkpoint, another tokenizer or chat template does not.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import torch
from transformers import PreTrainedModel

SAMPLES_PER_TENSOR = 64
_CONFIG_SKIP = {"transformers_version", "dtype", "torch_dtype", "attn_implementation"}


def model_fingerprint(
    model: PreTrainedModel, tokenizer: Any, eos_token_ids: frozenset[int]
) -> dict[str, str]:
    return {
        "name": str(getattr(model, "name_or_path", "") or type(model).__name__),
        "config": _digest(json.dumps(_clean(model.config.to_dict()), sort_keys=True, default=str)),
        "weights": _weights_digest(model),
        "tokenizer": _tokenizer_digest(tokenizer),
        "eos_token_ids": ",".join(str(i) for i in sorted(eos_token_ids)),
    }


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
    h = hashlib.sha256()
    samples = []
    for name, tensor in sorted(model.state_dict().items()):
        h.update(f"{name}:{tuple(tensor.shape)}:{tensor.dtype};".encode())
        flat = tensor.detach().reshape(-1)
        if flat.numel():
            count = min(SAMPLES_PER_TENSOR, flat.numel())
            steps = torch.arange(count, dtype=torch.int64, device=flat.device)
            index = steps * (flat.numel() - 1) // max(count - 1, 1)  # exact in int64
            samples.append(flat[index].to(torch.float64))
    if samples:
        h.update(torch.cat([s.to(samples[0].device) for s in samples]).cpu().numpy().tobytes())
    return h.hexdigest()


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


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()
