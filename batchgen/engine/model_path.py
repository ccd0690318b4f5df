"""Which model folder a job's `model` names (imports nothing heavy: the command line resolves
it before torch is imported, to have its engine process start loading early)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from batchgen.errors import BatchgenError

DEFAULT_MODEL = "default"  # the embedded tiny model, built locally on first use


def resolve_model_path(model: str | Path) -> str:
    """A local folder, the embedded default, or a hub id; a missing local path is an error."""
    if str(model) == DEFAULT_MODEL:
        from batchgen.models import default_model_path

        path = default_model_path()
        _check_config(
            path,
            f"the embedded default model's folder '{path}'",
            "remove the folder, and batchgen builds it again",
        )
        return str(path)
    path = Path(model).expanduser()
    if path.exists():
        if not (path / "config.json").is_file():
            raise BatchgenError(
                f"model folder '{model}' has no config.json: give a Hugging Face "
                "model folder (saved with save_pretrained)"
            )
        _check_config(path, f"model folder '{model}'", "replace it with the model's own")
        return str(path)
    text = str(model)
    if text.startswith((".", "/", "~")) or text.count("/") > 1 or "\\" in text:
        raise BatchgenError(
            f"model path '{model}' does not exist: give a local model folder, "
            "a hub id, or 'default' for the embedded model"
        )
    return text


def _check_config(folder: Path, what: str, fix: str) -> None:
    """BatchgenError where the folder's config.json is not a JSON object (a damaged or
    hand-edited file), before anything reads its fields."""
    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except OSError as exc:
        raise BatchgenError(f"{what}: cannot read config.json ({exc.strerror})") from exc
    except ValueError as exc:
        raise BatchgenError(
            f"{what}: config.json is not valid JSON ({' '.join(str(exc).split())[:120]}): {fix}"
        ) from exc
    if not isinstance(config, dict):
        raise BatchgenError(f"{what}: config.json is not a JSON object: {fix}")


def check_max_model_len(max_model_len: int | None, limit: int) -> None:
    """max_model_len over the model's context (its max_position_embeddings) is refused."""
    if max_model_len is not None and max_model_len > limit:
        raise BatchgenError(
            f"max_model_len={max_model_len:,} is more than the model's context of {limit:,} "
            "tokens (max_position_embeddings in its config): lower it, or leave it unset for "
            "the model's own"
        )


def folder_context(folder: str) -> int | None:
    """max_position_embeddings of a local model folder's config.json (of its text config
    where it has one, as the loaded model's text config gives it); None where the folder or
    the field is missing or unreadable."""
    return _text_config_int(folder, "max_position_embeddings")


def _text_config_int(folder: str | Path, key: str) -> int | None:
    """A positive integer field of a model folder's text config (config.json's text_config
    where it has one, else config.json itself); None where missing or unreadable."""
    try:
        config = json.loads((Path(folder) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict):
        return None
    text = config.get("text_config")
    value = (text if isinstance(text, dict) else config).get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def model_context(model: str, fetch: bool = False) -> int | None:
    """The context a job's model has (max_position_embeddings), read off its config.json
    without loading it: the embedded default's shape, a local folder's; with fetch, a hub id's
    (its config.json fetched, or taken from the cache). None where it cannot be had."""
    if model == DEFAULT_MODEL:
        from batchgen.models import DEFAULT_MODEL_SHAPE

        return DEFAULT_MODEL_SHAPE.max_position_embeddings
    source = resolve_model_path(model)
    if Path(source).is_dir() or not fetch:
        return folder_context(source)
    try:
        from huggingface_hub import hf_hub_download

        return folder_context(str(Path(hf_hub_download(source, "config.json")).parent))
    except Exception:  # not a hub id, offline and not cached: the run says why
        return None


def model_vocab(model: str) -> int | None:
    """The vocabulary size (vocab_size) of a job's model read off its config.json without
    loading or building it: a local folder's, the embedded default's once built; else None."""
    if model == DEFAULT_MODEL:
        from batchgen.models import default_model_folder

        return _text_config_int(default_model_folder(), "vocab_size")
    path = Path(model).expanduser()
    return _text_config_int(path, "vocab_size") if path.is_dir() else None


def prompt_over_context(prompt_tokens: int, max_model_len: int) -> str | None:
    """Why a prompt cannot run in the model's context (no room left for a token), else None."""
    if prompt_tokens < max_model_len:
        return None
    return (
        f"prompt has {prompt_tokens} tokens but the model's context is {max_model_len} "
        "(max_model_len): shorten the prompt"
    )


def file_generation_defaults(model: str) -> dict[str, Any]:
    """The sampling values a local model folder's generation_config.json recommends, read
    without loading it (what the engine takes under runtime.generation_config "auto"; the
    embedded default has none); {} where there is no such file or it cannot be read."""
    from batchgen.engine.sampling_params import MODEL_DEFAULT_FIELDS

    path = Path(model).expanduser() / "generation_config.json"
    if model == DEFAULT_MODEL or not path.is_file():
        return {}
    try:
        given = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(given, dict):
        return {}
    return {k: given[k] for k in sorted(MODEL_DEFAULT_FIELDS) if given.get(k) is not None}
