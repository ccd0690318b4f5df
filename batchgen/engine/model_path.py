"""Which model folder a job's `model` names (imports nothing heavy: the command line resolves
it before torch is imported, to have its engine process start loading early)."""

from __future__ import annotations

from pathlib import Path

from batchgen.errors import BatchgenError

DEFAULT_MODEL = "default"  # the embedded tiny model, built locally on first use


def resolve_model_path(model: str | Path) -> str:
    """A local folder, the embedded default, or a hub id; a missing local path is an error."""
    if str(model) == DEFAULT_MODEL:
        from batchgen.models import default_model_path

        return str(default_model_path())
    path = Path(model).expanduser()
    if path.exists():
        if not (path / "config.json").is_file():
            raise BatchgenError(
                f"model folder '{model}' has no config.json: give a Hugging Face "
                "model folder (saved with save_pretrained)"
            )
        return str(path)
    text = str(model)
    if text.startswith((".", "/", "~")) or text.count("/") > 1 or "\\" in text:
        raise BatchgenError(
            f"model path '{model}' does not exist: give a local model folder, "
            "a hub id, or 'default' for the embedded model"
        )
    return text
