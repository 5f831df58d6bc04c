"""drive_session (streaming/pump.py): a session's decodes in order; early finals sent, withdrawn."""

from __future__ import annotations

import asyncio
import contextlib

import numpy as np

from captiond.config import Config, VadConfig
from captiond.engines.base import DecodeKind, EngineRequest, EngineResult
from captiond.engines.fake import FakeEngine
from captiond.engines.rules import token_counter
from captiond.streaming.events import Control, Done, Final, ServerMessage, StreamParams
from captiond.streaming.pump import drive_session
from captiond.streaming.session import StreamSession

_GUARD_S = 30.0  # a hang guard only: every wait here ends in milliseconds when the code works


class _Pump:
    """A session fed in 100-ms chunks as the connection feeds it, its pump (drive_session)
    answering through a FakeEngine; a decode of a kind in `hold` waits while it is there."""

    def __init__(self) -> None:
        # A final's tail of 360 ms: in 100-ms chunks, the default's would come with the endpoint.
        config = Config(vad=VadConfig(final_tail_ms=360))
        self.session = StreamSession(
            config=config, vad=_LevelVad(), params=StreamParams(), count_tokens=token_counter()
        )
        self.asked: list[EngineRequest] = []
        self.withdrawn: list[EngineRequest] = []
        self.delivered: list[ServerMessage] = []
        self.wake = asyncio.Event()
        self.hold: set[DecodeKind] = set()
        self.task: asyncio.Future[None] | None = None
        self._engine = FakeEngine()

    async def submit(self, request: EngineRequest) -> EngineResult:
        self.asked.append(request)
        try:
            while request.kind in self.hold:
                await asyncio.sleep(0.001)
        except asyncio.CancelledError:
            self.withdrawn.append(request)
            raise
        return self._engine.transcribe_batch([request])[0]

    async def deliver(self) -> None:
        self.delivered += self.session.take_messages()

    async def feed(self, seconds: float, amplitude: float) -> None:
        for _ in range(round(seconds * 10)):
            chunk = np.full(1_600, amplitude * 32767, dtype="<i2")
            chunk[::2] *= -1  # a square wave: loud enough, and voiced for _LevelVad
            self.session.receive_audio(chunk.tobytes())
            if self.session.needs_pump:
                self.wake.set()
            for _ in range(20):  # let the pump act on it, as the event loop would between chunks
                await asyncio.sleep(0)

    async def speak(self) -> None:
        """Start the pump, then feed every test's utterance: 0.5 s of silence, 1.5 s of tone."""
        self.task = asyncio.ensure_future(
            drive_session(self.session, self.submit, self.wake, self.deliver)
        )
        await self.feed(0.5, 0.0)
        await self.feed(1.5, 0.1)

    async def end(self) -> None:
        """Send `end`, let the pump finish, and deliver as the connection does after it."""
        self.session.receive_control(Control.END)
        self.wake.set()
        await asyncio.wait_for(self.task, _GUARD_S)
        await self.deliver()

    def finals(self) -> list[Final]:
        return [m for m in self.delivered if isinstance(m, Final)]


class _LevelVad:
    def is_speech(self, buf: bytes, sample_rate: int) -> bool:
        return True  # the RMS floor tells silence from the tone


def test_the_pump_sends_a_final_its_early_final_answered_without_another_decode() -> None:
    async def run() -> _Pump:
        pump = _Pump()
        await pump.speak()
        await pump.feed(0.4, 0.0)  # the final's tail: its decode is asked for
        assert [r.kind for r in pump.asked].count(DecodeKind.FINAL) == 1
        assert not pump.finals()
        await pump.feed(0.2, 0.0)  # the endpoint: the final goes out at once
        assert len(pump.finals()) == 1
        await pump.end()
        return pump

    pump = asyncio.run(run())
    assert [r.kind for r in pump.asked].count(DecodeKind.FINAL) == 1
    assert isinstance(pump.delivered[-1], Done)


def test_the_pump_withdraws_an_early_final_when_the_speaker_goes_on() -> None:
    async def run() -> _Pump:
        pump = _Pump()
        await pump.speak()
        pump.hold = {DecodeKind.FINAL}  # the engine is busy: the early final waits in the queue
        await pump.feed(0.4, 0.0)
        (early,) = [r for r in pump.asked if r.kind is DecodeKind.FINAL]
        await pump.feed(0.1, 0.1)
        assert pump.withdrawn == [early]
        pump.hold = set()
        await pump.feed(1.0, 0.1)
        await pump.feed(1.0, 0.0)
        await pump.end()
        return pump

    pump = asyncio.run(run())
    (final,) = pump.finals()
    last = [r for r in pump.asked if r.kind is DecodeKind.FINAL][-1]
    assert final.text and final.end_ms > last.end_sample * 1000 // 16_000


def test_a_final_an_early_final_answered_goes_before_the_next_decode_ends() -> None:
    async def run() -> None:
        pump = _Pump()
        await pump.speak()
        await pump.feed(0.4, 0.0)  # the early final is asked for and answered
        assert not pump.finals()
        # The endpoint and the next utterance arrive before the pump looks again: it has the
        # answered final to send and a partial to ask for, which the engine keeps busy.
        pump.hold = {DecodeKind.PARTIAL}
        for chunk in (np.zeros(1_600 * 2, "<i2"), np.full(1_600 * 15, 3_277, "<i2")):
            chunk[::2] *= -1
            pump.session.receive_audio(chunk.tobytes())
        pump.wake.set()
        for _ in range(50):
            await asyncio.sleep(0)
        assert pump.asked[-1].kind is DecodeKind.PARTIAL
        assert len(pump.finals()) == 1  # sent while the partial is still being decoded
        assert pump.task is not None
        pump.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await pump.task

    asyncio.run(run())
