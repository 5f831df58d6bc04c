"""The speech gate (engines/speech_gate.py): real Silero VAD, a scripted engine behind it."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest
from conftest import vad_spans
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


@pytest.mark.parametrize("name", sorted(SOUNDS))
def test_made_sounds_are_not_speech(name: str) -> None:
    assert not has_speech(SOUNDS[name]())


def test_speech_is_speech(jfk: np.ndarray) -> None:
    assert has_speech(jfk)


# JFK's "ask not" (2.94-4.89 s), short and quiet (Silero: 6 frames at p >= 0.5, 20 at
# p >= 0.3): webrtcvad cut it out as an utterance of its own before it was shown quiet frames.
ASK_NOT = slice(47_040, 78_240)


def test_every_utterance_of_a_speech_is_speech(jfk: np.ndarray) -> None:
    spans = vad_spans(jfk)
    assert len(spans) >= 3
    assert all(has_speech(jfk[s:e]) for s, e in spans)
    assert has_speech(jfk[ASK_NOT])


def test_only_unconfirmed_requests_are_checked(jfk: np.ndarray) -> None:
    whale = SOUNDS["whale_song"](seconds=8.0)
    inner = Recording()
    gated = GatedEngine(inner)
    requests = [
        EngineRequest(audio=whale, kind=DecodeKind.FINAL, speech_from_sample=0),
        EngineRequest(audio=jfk, kind=DecodeKind.FINAL, speech_from_sample=0),
        # Not asked: decoded whatever the audio (an utterance already confirmed).
        EngineRequest(audio=whale, kind=DecodeKind.PARTIAL),
        # Speech before the offset is context; the whale song after it is checked alone.
        EngineRequest(
            audio=np.concatenate([jfk, whale]),
            kind=DecodeKind.FINAL,
            speech_from_sample=len(jfk),
        ),
    ]
    results = gated.transcribe_batch(requests)
    assert results == [NO_SPEECH, EngineResult(text="words"), EngineResult(text="words"), NO_SPEECH]
    assert inner.seen == [requests[1], requests[2]]
    assert gated.gated == 2
