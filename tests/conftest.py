"""Shared fixtures: the real speech corpus (../shared/speech), the bundled model, and small
helpers."""

from __future__ import annotations

import json
import os
import wave
from pathlib import Path
from typing import Any, NoReturn

import numpy as np
import pytest

from captiond.config import EngineConfig
from captiond.engines import Engine, load_engine

REPO_ROOT = Path(__file__).resolve().parents[1]
SPEECH_DIR = REPO_ROOT.parent / "shared" / "speech"
SPEECH_MULTI_DIR = REPO_ROOT.parent / "shared" / "speech-multi"


def _corpus(folder: Path) -> Path:
    if not (folder / "manifest.jsonl").is_file():
        missing_tool(f"real speech corpus not found at {folder} (it lives beside the repo)")
    return folder


def _manifest(folder: Path) -> list[dict[str, Any]]:
    with (folder / "manifest.jsonl").open(encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


@pytest.fixture(scope="session")
def tiny_en() -> Engine:
    """The bundled tiny.en on faster-whisper (CPU), loaded and warmed up once for the tests
    that share it."""
    engine = load_engine(EngineConfig(name="faster-whisper", device="cpu"))
    engine.warmup()
    return engine


@pytest.fixture(scope="session")
def speech_dir() -> Path:
    """The shared English speech corpus; every test that needs real speech goes through here."""
    return _corpus(SPEECH_DIR)


@pytest.fixture(scope="session")
def speech_manifest(speech_dir: Path) -> list[dict[str, Any]]:
    return _manifest(speech_dir)


@pytest.fixture(scope="session")
def jfk(speech_dir: Path, speech_manifest: list[dict[str, Any]]) -> np.ndarray:
    """JFK's "ask not" sentence (11 s) as float32 samples."""
    clip = next(m for m in speech_manifest if m["id"] == "jfk_inaugural_1961")
    return read_wav_int16(speech_dir / clip["file"]).astype(np.float32) / 32768


@pytest.fixture(scope="session")
def speech_multi_dir() -> Path:
    """The shared multilingual corpus (13 languages, `language` per clip)."""
    return _corpus(SPEECH_MULTI_DIR)


@pytest.fixture(scope="session")
def speech_multi_manifest(speech_multi_dir: Path) -> list[dict[str, Any]]:
    return _manifest(speech_multi_dir)


def missing_tool(message: str) -> NoReturn:
    """A system tool a test needs is absent: skip locally, fail in CI (.ci/run installs it)."""
    if os.environ.get("CI"):
        pytest.fail(f"{message}; CI must run this test (.ci/run installs it)")
    pytest.skip(message)


def vad_spans(samples: np.ndarray) -> list[tuple[int, int]]:
    """[start, end) of every utterance the default webrtcvad segmentation finds in `samples`."""
    from captiond.config import Config
    from captiond.vad import utterance_spans, webrtc_vad

    config = Config()
    return utterance_spans(
        samples, webrtc_vad(config.vad.aggressiveness), config.vad, config.stream
    )


def read_wav_int16(path: Path) -> np.ndarray:
    """A 16-bit mono WAV as int16 samples."""
    with wave.open(str(path), "rb") as wf:
        assert wf.getsampwidth() == 2 and wf.getnchannels() == 1
        return np.frombuffer(wf.readframes(wf.getnframes()), dtype="<i2").copy()
