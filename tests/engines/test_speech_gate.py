"""The speech gate (engines/speech_gate.py, decoding/gate.py): real Silero VAD, a scripted decoder
behind it."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from synth_sounds import SOUNDS
from testkit import vad_spans

from captiond.config import EngineConfig
from captiond.decoding.gate import GatedDecoder
from captiond.decoding.scheduler import SchedulerStats
from captiond.engines.base import DecodeKind, EngineInfo, EngineRequest, EngineResult, Submit
from captiond.engines.speech_gate import NO_SPEECH, applies, has_speech
from captiond.ops.metrics import Metrics


class Recording:
    """A Decoder whose every decode says "words", remembering what reached it."""

    def __init__(self) -> None:
        self.engine_info = EngineInfo("faster-whisper", "tiny.en", False, 8)
        self.metrics = Metrics()
        self.stats = SchedulerStats()
        self.seen: list[EngineRequest] = []

    def stream(self, key: str) -> Submit:
        async def submit(request: EngineRequest) -> EngineResult:
            self.seen.append(request)
            return EngineResult(text="words")

        return submit

    def forget(self, key: str) -> None:
        pass


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
    """Before a decode reaches the engine: the whale song stops there, speech goes on, and a
    request that does not ask is not checked."""
    whale = SOUNDS["whale_song"](seconds=8.0)
    inner = Recording()
    gated = GatedDecoder(inner)
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

    async def decode_all() -> list[EngineResult]:
        submit = gated.stream("s")
        decodes = [submit(r) for r in requests]
        return await asyncio.gather(*decodes)

    results = asyncio.run(decode_all())
    assert results == [NO_SPEECH, EngineResult(text="words"), EngineResult(text="words"), NO_SPEECH]
    # Checks run side by side: what reached the decoder, in any order.
    assert sorted(map(id, inner.seen)) == sorted(map(id, requests[1:3]))
    registry = inner.metrics.registry
    checks = {
        speech: registry.get_sample_value("captiond_speech_gate_checks_total", {"speech": speech})
        for speech in ("true", "false")
    }
    assert checks == {"true": 1, "false": 2}


def test_the_fake_engine_and_the_setting_turn_the_gate_off() -> None:
    assert applies(EngineConfig(), "faster-whisper") and applies(EngineConfig(), "torch_graph")
    assert not applies(EngineConfig(speech_gate=False), "faster-whisper")
    assert not applies(EngineConfig(), "fake")
