"""GatedDecoder: the speech gate (engines/speech_gate.py) in front of a daemon process's Decoder.

A decode that asks for the gate (`EngineRequest.speech_from_sample`: an utterance without
confirmed speech yet) is checked before it is queued for the engine, on a thread pool of this
process, and answered as no speech here when Silero finds too little. So the checks run in the
processes that serve the streams (every front-end worker with `[server] workers` > 1), side by
side with the engine thread rather than on it, and a decode the gate stops never takes a row
of a batch. The event-loop thread awaits each check; the pool's threads run them.
"""

from __future__ import annotations

import asyncio
import functools
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from captiond.decoding.scheduler import Decoder, SchedulerStats
from captiond.engines.base import EngineInfo, EngineRequest, EngineResult, Submit
from captiond.engines.speech_gate import GATE_THREADS, gate, has_speech
from captiond.ops.metrics import Metrics
from captiond.whisper import SAMPLE_RATE_HZ


@functools.cache
def _pool() -> ThreadPoolExecutor:
    """The process's gate threads, shared by its daemons (tests run several in one process)."""
    has_speech(np.zeros(SAMPLE_RATE_HZ, dtype=np.float32))  # loads Silero before the first check
    return ThreadPoolExecutor(GATE_THREADS, thread_name_prefix="captiond-gate")


class GatedDecoder:
    def __init__(self, decoder: Decoder) -> None:
        self._decoder = decoder
        self._pool = _pool()

    @property
    def engine_info(self) -> EngineInfo:
        return self._decoder.engine_info

    @property
    def metrics(self) -> Metrics:
        return self._decoder.metrics

    @property
    def stats(self) -> SchedulerStats:
        return self._decoder.stats

    def forget(self, key: str) -> None:
        self._decoder.forget(key)

    def stream(self, key: str) -> Submit:
        decode = self._decoder.stream(key)
        metrics = self._decoder.metrics

        async def submit(request: EngineRequest) -> EngineResult:
            if request.speech_from_sample is not None:
                started = time.perf_counter()
                loop = asyncio.get_running_loop()
                stopped = await loop.run_in_executor(self._pool, gate, request)
                metrics.speech_gate_seconds.inc(time.perf_counter() - started)
                metrics.speech_gate_checks.labels(speech=str(stopped is None).lower()).inc()
                if stopped is not None:
                    return stopped
            return await decode(request)

        return submit
