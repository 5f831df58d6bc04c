"""InferenceScheduler: which requests make a batch, and when the engine thread wakes for them."""

from __future__ import annotations

import asyncio
import sys
import threading
from collections.abc import Sequence

import numpy as np

from captiond.config import SchedulerConfig
from captiond.engines import DecodeKind, EngineRequest, EngineResult
from captiond.engines.fake import FakeEngine
from captiond.scheduler import ENGINE_SWITCH_INTERVAL_S, InferenceScheduler

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
