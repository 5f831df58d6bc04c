"""Shared fixtures: the real speech corpora (../shared/speech, ../shared/speech-multi) and the
bundled model. Plain helpers are in helpers/testkit.py."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from testkit import SPEECH_DIR, SPEECH_MULTI_DIR, missing_tool, read_wav_int16

from captiond.config import EngineConfig
from captiond.engines import load_engine
from captiond.engines.base import Engine


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


@pytest.fixture(autouse=True)
def _root_logging_restored() -> Iterator[None]:
    """`captiond.cli.main` configures the root logger with a handler on the sys.stderr of its
    test (capsys's, closed afterwards); a later test that logs would write to that closed
    stream. Each test gets the root logger back as it found it."""
    handlers, level = logging.root.handlers[:], logging.root.level
    yield
    logging.root.handlers[:] = handlers
    logging.root.setLevel(level)
