"""The StreamSession test kit: synthetic audio, a fake decoder and a Driver that feeds a session
and answers its requests as the pump would (used by tests/streaming/)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np

from captiond.config import Config, StreamConfig, VadConfig
from captiond.engines.base import EngineRequest, EngineResult
from captiond.engines.fake import FakeEngine
from captiond.engines.rules import token_counter
from captiond.samples import Samples
from captiond.streaming.events import Control, ServerMessage, StreamParams
from captiond.streaming.session import StreamSession
from captiond.streaming.utterance import DecodeRequest, StreamOrigin

RATE = 16_000
CHUNK_MS = 100
# Every utterance decoded alone: older finals reach the decode through the prompt only.
NO_CONTEXT = StreamConfig(context_s=0, partial_context_s=0)

Decoder = Callable[[EngineRequest], EngineResult]


class LevelVad:
    """Scripted VAD: every frame that reaches it is speech. The session's RMS floor keeps the
    silent frames from it, so a tone is speech and digital silence is not."""

    def is_speech(self, buf: bytes, sample_rate: int) -> bool:
        return True


def tone(seconds: float, *, rate: int = RATE, amplitude: float = 0.1) -> Samples:
    t = np.arange(round(seconds * rate)) / rate
    return (amplitude * np.sin(2 * np.pi * 440.0 * t)).astype(np.float32)


def silence(seconds: float, *, rate: int = RATE) -> Samples:
    return np.zeros(round(seconds * rate), dtype=np.float32)


def s16(samples: Samples) -> bytes:
    return (np.clip(samples, -1, 1) * 32767).astype("<i2").tobytes()


def fake_decoder() -> Decoder:
    engine = FakeEngine()

    def decode(request: EngineRequest) -> EngineResult:
        return engine.transcribe_batch([request])[0]

    return decode


class Driver:
    """Feeds a session chunk by chunk and answers its requests at once, recording everything."""

    def __init__(
        self,
        decoder: Decoder | None = None,
        *,
        partials: bool = True,
        early_finals: bool = True,
        params: StreamParams | None = None,
        stream: StreamConfig | None = None,
        vad: VadConfig | None = None,
        origin: StreamOrigin | None = None,
    ) -> None:
        config = Config(stream=stream or StreamConfig(), vad=vad or VadConfig())
        self.session = StreamSession(
            config=config,
            vad=LevelVad(),
            params=params or StreamParams(),
            origin=origin,
            partials=partials,
            early_finals=early_finals,
            count_tokens=token_counter(),
        )
        self.decoder = decoder or fake_decoder()
        self.requests: list[DecodeRequest] = []
        self.asked_at_ms: list[int] = []  # the stream's audio when each request was made
        self.messages: list[ServerMessage] = []

    def pump(self) -> None:
        while (request := self.session.next_request()) is not None:
            self.requests.append(request)
            self.asked_at_ms.append(self.session.audio_ms)
            # At most one request in flight: nothing more until this one is answered.
            assert self.session.next_request() is None
            self.session.on_result(request, self.decoder(request.engine_request))
        self.messages += self.session.take_messages()

    def send(self, samples: Samples, *, encode: Callable[[Samples], bytes] = s16) -> None:
        rate = (self.session_rate_hz * CHUNK_MS) // 1000
        for i in range(0, len(samples), rate):
            self.session.receive_audio(encode(samples[i : i + rate]))
            # As the connection does: the pump is woken only when the session says it has work,
            # so every test that feeds audio checks that no due decode goes unnoticed.
            if self.session.needs_pump:
                self.pump()
            else:
                assert self.session.next_request() is None, "a decode was due, the pump slept"

    @property
    def session_rate_hz(self) -> int:
        return self.session._params.sample_rate_hz

    def control(self, control: Control) -> None:
        self.session.receive_control(control)
        self.pump()

    def of(self, kind: type[Any]) -> list[Any]:
        return [m for m in self.messages if isinstance(m, kind)]


def two_utterances(driver: Driver) -> None:
    driver.send(silence(1.0))
    driver.send(tone(2.0))
    driver.send(silence(1.0))
    driver.send(tone(1.5))
    driver.send(silence(1.0))


def after_prefix(request: EngineRequest, result: EngineResult) -> EngineResult:
    """A scripted whole-utterance result as an engine returns it: the words after the prefix."""
    words, forced = result.text.split(), request.prefix.split()
    if words[: len(forced)] != forced:
        return result
    return dataclasses.replace(result, text=" ".join(words[len(forced) :]))
