"""The speech gate (engines/speech_gate.py): real Silero VAD, a scripted engine behind it."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import read_wav_int16
from synth_sounds import SOUNDS

from captiond.engines import DecodeKind, EngineRequest, EngineResult
from captiond.engines.fake import FakeEngine
from captiond.engines.speech_gate import NO_SPEECH, GatedEngine, has_speech


class Recording(FakeEngine):
    def __init__(self) -> None:
        super().__init__()
        self.seen: list[EngineRequest] = []

    def transcribe_batch(self, requests: Sequence[EngineRequest]) -> list[EngineResult]:
        self.seen += requests
        return [EngineResult(text="words") for _ in requests]


@pytest.fixture(scope="module")
def speech(speech_dir: Path, speech_manifest: list[dict[str, Any]]) -> np.ndarray:
    jfk = next(m for m in speech_manifest if m["id"] == "jfk_inaugural_1961")
    return read_wav_int16(speech_dir / jfk["file"]).astype(np.float32) / 32768


@pytest.mark.parametrize("name", sorted(SOUNDS))
def test_made_sounds_are_not_speech(name: str) -> None:
    assert not has_speech(SOUNDS[name]())


def test_speech_is_speech(speech: np.ndarray) -> None:
    assert has_speech(speech)


def test_only_unconfirmed_requests_are_checked(speech: np.ndarray) -> None:
    whale = SOUNDS["whale_song"](seconds=8.0)
    inner = Recording()
    gated = GatedEngine(inner)
    requests = [
        EngineRequest(audio=whale, kind=DecodeKind.FINAL, speech_from_sample=0),
        EngineRequest(audio=speech, kind=DecodeKind.FINAL, speech_from_sample=0),
        # Not asked: decoded whatever the audio (an utterance already confirmed).
        EngineRequest(audio=whale, kind=DecodeKind.PARTIAL),
        # Speech before the offset is context; the whale song after it is checked alone.
        EngineRequest(
            audio=np.concatenate([speech, whale]),
            kind=DecodeKind.FINAL,
            speech_from_sample=len(speech),
        ),
    ]
    results = gated.transcribe_batch(requests)
    assert results == [NO_SPEECH, EngineResult(text="words"), EngineResult(text="words"), NO_SPEECH]
    assert inner.seen == [requests[1], requests[2]]
    assert gated.gated == 2
