"""InferenceScheduler: which requests make a batch, and when the engine thread wakes for them;
drive_session: which decodes a stream's pump asks for, sends and withdraws."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import sys
import threading
from collections.abc import Sequence

import numpy as np
import pytest

from captiond import scheduler as scheduler_module
from captiond.config import Config, SchedulerConfig, VadConfig
from captiond.engines import DecodeKind, EngineRequest, EngineResult, token_counter
from captiond.engines.fake import FakeEngine
from captiond.errors import EngineFailedError
from captiond.protocol import Control, Done, Final, ServerMessage, StreamParams
from captiond.scheduler import ENGINE_SWITCH_INTERVAL_S, InferenceScheduler, drive_session
from captiond.session import DecodeRequest, StreamSession

_GUARD_S = 30.0  # a hang guard only: every wait here ends in milliseconds when the code works


class _RecordingEngine(FakeEngine):
    """Records each batch's request kinds; the first batch waits for `release`."""

    def __init__(self) -> None:
        super().__init__()
        self.batches: list[list[DecodeKind]] = []
        self.busy = threading.Event()
        self.release = threading.Event()

    def transcribe_batch(self, requests: Sequence[EngineRequest]) -> list[EngineResult]:
        if not self.batches:
            self.busy.set()
            self.release.wait(_GUARD_S)
        self.batches.append([r.kind for r in requests])
        return super().transcribe_batch(requests)


def _request(kind: DecodeKind) -> EngineRequest:
    return EngineRequest(audio=np.zeros(1_600, dtype=np.float32), kind=kind, language="en")


def test_finals_first_then_partials_in_order_up_to_max_batch() -> None:
    engine = _RecordingEngine()
    scheduler = InferenceScheduler(engine, SchedulerConfig(max_batch=4, max_wait_ms=0))
    scheduler.start()
    # torch releases the GIL around every operator: the engine thread must get it back soon.
    assert sys.getswitchinterval() <= ENGINE_SWITCH_INTERVAL_S

    async def run() -> None:
        first = asyncio.ensure_future(scheduler.submit(_request(DecodeKind.PARTIAL)))
        assert await asyncio.to_thread(engine.busy.wait, _GUARD_S)
        # Queued while the engine is busy: the next batches are taken from all of them.
        kinds = [DecodeKind.PARTIAL] * 3 + [DecodeKind.FINAL] * 3
        queued = [asyncio.ensure_future(scheduler.submit(_request(k))) for k in kinds]
        await asyncio.sleep(0)
        engine.release.set()
        await asyncio.wait_for(asyncio.gather(first, *queued), _GUARD_S)

    try:
        asyncio.run(run())
    finally:
        scheduler.stop()
    final, partial = DecodeKind.FINAL, DecodeKind.PARTIAL
    assert engine.batches == [[partial], [final, final, final, partial], [partial, partial]]


def test_stop_leaves_a_wedged_engine_behind(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A stop (SIGTERM) does not wait for a batch that never ends: the process would outlive
    its drain until systemd killed it. It waits `_STOP_WAIT_S` (here 0.2 s) and says so."""
    monkeypatch.setattr(scheduler_module, "_STOP_WAIT_S", 0.2)
    engine = _RecordingEngine()
    scheduler = InferenceScheduler(engine, SchedulerConfig(max_batch=4, max_wait_ms=0))
    scheduler.start()

    async def wedge() -> None:
        decode = asyncio.ensure_future(scheduler.submit(_request(DecodeKind.FINAL)))
        assert await asyncio.to_thread(engine.busy.wait, _GUARD_S)
        decode.cancel()  # its client is gone; the engine is still in its batch

    asyncio.run(wedge())
    stopping = threading.Thread(target=scheduler.stop)
    stopping.start()
    stopping.join(_GUARD_S)
    stopped = not stopping.is_alive()
    engine.release.set()
    assert stopped, "stop() waited for the wedged batch"
    assert "did not finish its batch" in caplog.text


class _PickyEngine(FakeEngine):
    """Fails any batch holding a request in Cantonese (a model without `yue`), as torch_graph's
    prompt builder does for the whole batch."""

    def __init__(self) -> None:
        super().__init__()
        self.batch_sizes: list[int] = []

    def transcribe_batch(self, requests: Sequence[EngineRequest]) -> list[EngineResult]:
        self.batch_sizes.append(len(requests))
        if any(r.language == "yue" for r in requests):
            raise ValueError("the model knows no language 'yue'")
        return super().transcribe_batch(requests)


def test_a_request_the_engine_refuses_fails_only_its_own_stream() -> None:
    engine = _PickyEngine()
    scheduler = InferenceScheduler(engine, SchedulerConfig(max_batch=4, max_wait_ms=200))
    scheduler.start()
    languages = ["en", "yue", "en", "en"]

    async def run() -> list[EngineResult | BaseException]:
        decodes = [
            scheduler.submit(dataclasses.replace(_request(DecodeKind.FINAL), language=language))
            for language in languages
        ]
        return await asyncio.wait_for(asyncio.gather(*decodes, return_exceptions=True), _GUARD_S)

    try:
        results = asyncio.run(run())
    finally:
        scheduler.stop()
    assert engine.batch_sizes == [4, 1, 1, 1, 1]
    assert isinstance(results[1], EngineFailedError) and "yue" in str(results[1])
    assert all(isinstance(results[i], EngineResult) for i in (0, 2, 3))


def test_stop_answers_what_is_queued_without_decoding_it() -> None:
    """After the drain, a stop finishes the batch in progress only: the requests still queued
    are failed at once, not decoded one batch after another (up to `_STOP_WAIT_S`)."""
    engine = _RecordingEngine()
    scheduler = InferenceScheduler(engine, SchedulerConfig(max_batch=1, max_wait_ms=0))
    scheduler.start()

    async def run() -> list[EngineResult | BaseException]:
        decodes = [
            asyncio.ensure_future(scheduler.submit(_request(DecodeKind.FINAL))) for _ in range(4)
        ]
        assert await asyncio.to_thread(engine.busy.wait, _GUARD_S)
        stopping = asyncio.ensure_future(asyncio.to_thread(scheduler.stop))
        await asyncio.sleep(0.1)  # stop() has marked the scheduler stopping
        engine.release.set()
        await stopping
        return await asyncio.wait_for(asyncio.gather(*decodes, return_exceptions=True), _GUARD_S)

    results = asyncio.run(run())
    assert len(engine.batches) == 1
    assert isinstance(results[0], EngineResult)
    assert all(isinstance(r, EngineFailedError) for r in results[1:])


def test_a_full_batch_goes_at_once_however_long_max_wait_is() -> None:
    """The engine thread waits up to max_wait_ms for a batch to fill, and the request that
    fills it wakes the thread: it is not woken for every request, so the one that completes
    the batch must be."""
    engine = _RecordingEngine()
    engine.release.set()
    scheduler = InferenceScheduler(engine, SchedulerConfig(max_batch=4, max_wait_ms=3_600_000))
    scheduler.start()

    async def run() -> list[EngineResult]:
        first = asyncio.ensure_future(scheduler.submit(_request(DecodeKind.PARTIAL)))
        await asyncio.sleep(0.2)  # the engine thread wakes for it and waits for three more
        rest = [scheduler.submit(_request(DecodeKind.PARTIAL)) for _ in range(3)]
        return await asyncio.wait_for(asyncio.gather(first, *rest), _GUARD_S)

    try:
        assert len(asyncio.run(run())) == 4
    finally:
        scheduler.stop()
    assert engine.batches == [[DecodeKind.PARTIAL] * 4]


# -- drive_session ----------------------------------------------------------------------------


class _Pump:
    """A session fed in 100-ms chunks as the connection feeds it, its pump (drive_session)
    answering through a FakeEngine; a decode of a kind in `hold` waits while it is there."""

    def __init__(self) -> None:
        # A final's tail of 360 ms: in 100-ms chunks, the default's would come with the endpoint.
        config = Config(vad=VadConfig(final_tail_ms=360))
        self.session = StreamSession(
            config=config, vad=_LevelVad(), params=StreamParams(), count_tokens=token_counter()
        )
        self.asked: list[DecodeRequest] = []
        self.withdrawn: list[DecodeRequest] = []
        self.delivered: list[ServerMessage] = []
        self.wake = asyncio.Event()
        self.hold: set[DecodeKind] = set()
        self.task: asyncio.Future[None] | None = None
        self._engine = FakeEngine()

    async def submit(self, request: DecodeRequest) -> EngineResult:
        self.asked.append(request)
        try:
            while request.kind in self.hold:
                await asyncio.sleep(0.001)
        except asyncio.CancelledError:
            self.withdrawn.append(request)
            raise
        return self._engine.transcribe_batch([request.engine_request])[0]

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
