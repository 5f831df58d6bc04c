"""Helpers every test folder shares (on pytest's pythonpath): the repository's paths, the
shared speech corpora's paths, a skip that fails in CI, and WAV and VAD helpers."""

from __future__ import annotations

import os
import wave
from pathlib import Path
from typing import NoReturn

import numpy as np
import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
SPEECH_DIR = REPO_ROOT.parent / "shared" / "speech"
SPEECH_MULTI_DIR = REPO_ROOT.parent / "shared" / "speech-multi"


def missing_tool(message: str) -> NoReturn:
    """A system tool a test needs is absent: skip locally, fail in CI (.ci/run installs it)."""
    if os.environ.get("CI"):
        pytest.fail(f"{message}; CI must run this test (.ci/run installs it)")
    pytest.skip(message)


def vad_spans(samples: np.ndarray) -> list[tuple[int, int]]:
    """[start, end) of every utterance the default webrtcvad segmentation finds in `samples`."""
    from captiond.config import Config
    from captiond.streaming.vad import utterance_spans, webrtc_vad

    config = Config()
    return utterance_spans(
        samples, webrtc_vad(config.vad.aggressiveness), config.vad, config.stream
    )


def read_wav_int16(path: Path) -> np.ndarray:
    """A 16-bit mono WAV as int16 samples."""
    with wave.open(str(path), "rb") as wf:
        assert wf.getsampwidth() == 2 and wf.getnchannels() == 1
        return np.frombuffer(wf.readframes(wf.getnframes()), dtype="<i2").copy()
