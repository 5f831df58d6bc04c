"""InferenceScheduler: which requests make a batch, and when the engine thread wakes for them;
drive_session: which decodes a stream's pump asks for, sends and withdraws."""

from __future__ import annotations

import asyncio
import dataclasses
import sys
import threading
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt
import pytest

from captiond.config import SchedulerConfig
from captiond.decoding import scheduler as scheduler_module
from captiond.decoding.scheduler import ENGINE_SWITCH_INTERVAL_S, InferenceScheduler
from captiond.engines.base import DecodeKind, EngineRequest, EngineResult
from captiond.engines.fake import FakeEngine
from captiond.errors import EngineFailedError

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


class _UnitEmbedder:
    """Every window the same voice."""

    concurrent = False

    def embed(self, windows: Sequence[npt.NDArray[np.float32]]) -> npt.NDArray[np.float32]:
        return np.ones((len(windows), 4), np.float32) / 2


@pytest.mark.parametrize("at_start", [False, True])
def test_the_speaker_model_loads_once_at_start_or_at_the_first_diarized_final(
    at_start: bool,
) -> None:
    """A daemon that diarizes every stream loads the model before it serves; one that diarizes
    only the streams that ask loads it when a diarized final first needs it. Either way, once."""
    loads: list[str] = []

    def load() -> _UnitEmbedder:
        loads.append(threading.current_thread().name)
        return _UnitEmbedder()

    scheduler = InferenceScheduler(
        FakeEngine(), SchedulerConfig(), embedder=load, load_embedder_at_start=at_start
    )
    scheduler.start()
    try:
        assert len(loads) == (1 if at_start else 0)
        plain = asyncio.run(scheduler.submit(_request(DecodeKind.FINAL)))
        assert plain.speaker_embeddings == () and len(loads) == (1 if at_start else 0)
        diarized = dataclasses.replace(
            _request(DecodeKind.FINAL), speaker_windows=((0, 800), (800, 1_600))
        )
        for _ in range(2):
            result = asyncio.run(scheduler.submit(diarized))
            assert result.speaker_embeddings == ((0.5,) * 4, (0.5,) * 4)
        assert loads == ["MainThread" if at_start else "captiond-engine"]
    finally:
        scheduler.stop()


class _MeetingEmbedder:
    """A CPU-like model (`concurrent`) that says which thread called it, and fails on demand."""

    concurrent = True

    def __init__(self, *, fails: bool = False) -> None:
        self.called = threading.Event()
        self.threads: list[str] = []
        self.fails = fails

    def embed(self, windows: Sequence[npt.NDArray[np.float32]]) -> npt.NDArray[np.float32]:
        self.threads.append(threading.current_thread().name)
        self.called.set()
        if self.fails:
            raise RuntimeError("out of memory")
        return np.ones((len(windows), 4), np.float32) / 2


class _WaitsForEmbeddings(FakeEngine):
    """Decodes only once the embedder was called, and says whether it was by then: the
    embeddings ran beside the decode, not after it. Optionally fails a batch of several."""

    def __init__(self, embedder: _MeetingEmbedder, *, fails_batches: bool = False) -> None:
        super().__init__()
        self._embedder = embedder
        self.embedded_during_decode: list[bool] = []
        self._fails_batches = fails_batches

    def transcribe_batch(self, requests: Sequence[EngineRequest]) -> list[EngineResult]:
        self.embedded_during_decode.append(self._embedder.called.wait(_GUARD_S))
        if self._fails_batches and len(requests) > 1:
            raise RuntimeError("one request of this batch cannot be decoded")
        return super().transcribe_batch(requests)


def _diarized(kind: DecodeKind = DecodeKind.FINAL) -> EngineRequest:
    return dataclasses.replace(_request(kind), speaker_windows=((0, 800), (800, 1_600)))


def test_a_cpu_speaker_model_embeds_on_its_own_thread_while_the_engine_decodes() -> None:
    embedder = _MeetingEmbedder()
    engine = _WaitsForEmbeddings(embedder)
    scheduler = InferenceScheduler(engine, SchedulerConfig(), embedder=lambda: embedder)
    scheduler.start()
    try:
        result = asyncio.run(scheduler.submit(_diarized()))
    finally:
        scheduler.stop()
    assert engine.embedded_during_decode == [True]
    assert embedder.threads == ["captiond-speakers_0"]
    assert result.speaker_embeddings == ((0.5,) * 4, (0.5,) * 4) and result.language == "en"


def test_a_failing_speaker_model_beside_the_engine_costs_the_speakers_not_the_text(
    caplog: pytest.LogCaptureFixture,
) -> None:
    embedder = _MeetingEmbedder(fails=True)
    scheduler = InferenceScheduler(
        _WaitsForEmbeddings(embedder), SchedulerConfig(), embedder=lambda: embedder
    )
    scheduler.start()
    try:
        result = asyncio.run(scheduler.submit(_diarized()))
    finally:
        scheduler.stop()
    assert result.speaker_embeddings == () and result.language == "en"
    assert "speaker embeddings failed" in caplog.text


def test_a_batch_the_engine_fails_is_decoded_again_alone_with_the_embeddings_it_had() -> None:
    embedder = _MeetingEmbedder()
    engine = _WaitsForEmbeddings(embedder, fails_batches=True)
    scheduler = InferenceScheduler(
        engine, SchedulerConfig(max_batch=2, max_wait_ms=3_600_000), embedder=lambda: embedder
    )
    scheduler.start()

    async def run() -> list[EngineResult]:
        requests = (_diarized(), _request(DecodeKind.PARTIAL))
        return list(
            await asyncio.wait_for(
                asyncio.gather(*(scheduler.submit(r) for r in requests)), _GUARD_S
            )
        )

    try:
        diarized, plain = asyncio.run(run())
    finally:
        scheduler.stop()
    assert len(engine.embedded_during_decode) == 3  # the batch, then each request alone
    assert len(embedder.threads) == 1  # embedded once, for the batch
    assert diarized.speaker_embeddings == ((0.5,) * 4, (0.5,) * 4)
    assert plain.speaker_embeddings == () and plain.language == "en"


class _LoudTurns:
    """A scripted end-of-turn model: a turn is over as loud as its audio's peak."""

    def __init__(self) -> None:
        self.calls: list[int] = []

    def complete(self, turns: Sequence[npt.NDArray[np.float32]]) -> list[float]:
        self.calls.append(len(turns))
        return [float(np.abs(turn).max()) for turn in turns]


def _turn(peak: float) -> EngineRequest:
    return EngineRequest(audio=np.full(1_600, peak, dtype=np.float32), kind=DecodeKind.TURN)


def test_turn_requests_are_answered_first_in_one_call_and_never_reach_the_engine() -> None:
    engine = _RecordingEngine()
    model = _LoudTurns()
    scheduler = InferenceScheduler(
        engine, SchedulerConfig(max_batch=8, max_wait_ms=0), turn_model=lambda: model
    )
    scheduler.start()

    async def run() -> list[EngineResult]:
        first = asyncio.ensure_future(scheduler.submit(_request(DecodeKind.PARTIAL)))
        assert await asyncio.to_thread(engine.busy.wait, _GUARD_S)
        queued = [
            asyncio.ensure_future(scheduler.submit(r))
            for r in (_request(DecodeKind.FINAL), _turn(0.25), _turn(0.75))
        ]
        await asyncio.sleep(0)
        engine.release.set()
        return list(await asyncio.wait_for(asyncio.gather(first, *queued), _GUARD_S))

    try:
        _, final, quiet, loud = asyncio.run(run())
    finally:
        scheduler.stop()
    assert engine.batches == [[DecodeKind.PARTIAL], [DecodeKind.FINAL]]
    assert model.calls == [2]
    assert (quiet.turn_probability, loud.turn_probability) == (0.25, 0.75)
    assert final.turn_probability is None


@pytest.mark.parametrize("model", ["missing", "failing"])
def test_without_a_working_turn_model_a_turn_request_gets_no_verdict(
    model: str, caplog: pytest.LogCaptureFixture
) -> None:
    def failing() -> _LoudTurns:
        raise RuntimeError("no such file")

    scheduler = InferenceScheduler(
        FakeEngine(), SchedulerConfig(), turn_model=None if model == "missing" else failing
    )
    scheduler.start()
    try:
        result = asyncio.run(scheduler.submit(_turn(0.9)))
        final = asyncio.run(scheduler.submit(_request(DecodeKind.FINAL)))
    finally:
        scheduler.stop()
    assert result.turn_probability is None and result.text == ""
    assert final.language == "en"  # decoded: the daemon goes on
    assert scheduler.engine_info.judges_turns is (model == "failing")
    if model == "failing":
        assert "the end-of-turn model did not load" in caplog.text
