"""The speech gate (engines/speech_gate.py): real Silero VAD, a scripted engine behind it."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import read_wav_int16
from synth_sounds import SOUNDS

from captiond.audio import FRAME_SAMPLES
from captiond.config import Config
from captiond.engines import DecodeKind, EngineRequest, EngineResult
from captiond.engines.fake import FakeEngine
from captiond.engines.speech_gate import NO_SPEECH, GatedEngine, has_speech
from captiond.vad import UtteranceEnd, UtteranceStart, VadSegmenter, webrtc_vad


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


def test_every_utterance_of_a_speech_is_speech(speech: np.ndarray) -> None:
    """webrtcvad cuts JFK's sentence into four utterances; the second, "ask not", is short and
    quiet (Silero: 6 frames at p >= 0.5, 20 at p >= 0.3) and still speech."""
    config = Config()
    segmenter = VadSegmenter(webrtc_vad(config.vad.aggressiveness), config.vad, config.stream)
    frames = len(speech) // FRAME_SAMPLES
    events = [
        e
        for i in range(frames)
        for e in segmenter.push(speech[i * FRAME_SAMPLES :][:FRAME_SAMPLES])
    ]
    events += segmenter.flush(frames * FRAME_SAMPLES)
    starts = [e.start_sample for e in events if isinstance(e, UtteranceStart)]
    ends = [e.end_sample for e in events if isinstance(e, UtteranceEnd)]
    assert len(starts) == len(ends) == 4
    assert [has_speech(speech[s:e]) for s, e in zip(starts, ends, strict=True)] == [True] * 4


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
