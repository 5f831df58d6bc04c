"""EngineClient: a worker process's `Decoder`, decoding in the main process's engine core.

Runs on the worker's event-loop thread. Each stream's audio moves to the engine process once:
per stream an `AudioSpan` says what the core holds, and a decode sends only the part of its
window the core lacks (normally the audio since the stream's previous decode). A withdrawn
decode is cancelled in the core as well. When the link closes (the main process is gone), every
waiting decode fails and `closed` is set: the worker then shuts down.
"""

from __future__ import annotations

import asyncio
import os
import time
from itertools import count

from captiond.decoding import link as ipc
from captiond.decoding.scheduler import SchedulerStats
from captiond.engines.base import EngineInfo, EngineRequest, EngineResult, Submit
from captiond.errors import CaptiondError, EngineFailedError
from captiond.ops.metrics import Metrics
from captiond.samples import AudioSpan


class EngineClient:
    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        engine_info: EngineInfo,
        metrics: Metrics | None = None,
    ) -> None:
        self._reader = reader
        self._writer = writer
        self._engine_info = engine_info
        self._metrics = metrics or Metrics()
        self._stats = SchedulerStats()
        self._calls = count()
        self._waiting: dict[int, asyncio.Future[EngineResult]] = {}
        self._spans: dict[str, AudioSpan] = {}
        self.closed = asyncio.Event()

    @classmethod
    async def connect(
        cls, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> EngineClient:
        """Read the core's `Hello` (its engine's facts)."""
        hello = await ipc.read(reader)
        if not isinstance(hello, ipc.Hello):
            raise CaptiondError("the engine process did not answer")
        return cls(reader, writer, hello.engine)

    @property
    def engine_info(self) -> EngineInfo:
        return self._engine_info

    @property
    def metrics(self) -> Metrics:
        return self._metrics

    @property
    def stats(self) -> SchedulerStats:
        """Decodes answered; the heartbeat is the last answer (or status sent)."""
        return self._stats

    def stream(self, key: str) -> Submit:
        span = self._spans.setdefault(key, AudioSpan())

        async def submit(request: EngineRequest) -> EngineResult:
            if self.closed.is_set():
                raise EngineFailedError("the engine process is gone")
            audio = request.audio
            end = request.end_sample
            start = end - len(audio)
            send_from = span.send_from(start, end)
            if send_from < end:
                span.advance(send_from, end)
            call = next(self._calls)
            future: asyncio.Future[EngineResult] = asyncio.get_running_loop().create_future()
            self._waiting[call] = future
            ipc.write(
                self._writer,
                ipc.Decode(
                    call=call,
                    stream=key,
                    window_samples=len(audio),
                    audio_from_sample=send_from,
                    audio=audio[send_from - start :],
                    request=request,
                ),
            )
            try:
                return await future
            except asyncio.CancelledError:
                if not self._writer.is_closing():
                    ipc.write(self._writer, ipc.Cancel(call))
                raise
            finally:
                self._waiting.pop(call, None)

        return submit

    def forget(self, key: str) -> None:
        if self._spans.pop(key, None) is not None and not self._writer.is_closing():
            ipc.write(self._writer, ipc.Forget(key))

    def report(self, sessions_open: int, sessions_total: int, sources: str, behind: bool) -> None:
        """Tell the main process this worker is alive, its counters, its sources' states and
        whether it is behind (it refuses new streams)."""
        if not self._writer.is_closing():
            status = ipc.Status(os.getpid(), sessions_open, sessions_total, sources, behind)
            ipc.write(self._writer, status)

    async def run(self) -> None:
        """Deliver results until the link closes, then fail whatever still waits."""
        try:
            while (message := await ipc.read(self._reader)) is not None:
                if not isinstance(message, ipc.Result):
                    continue
                future = self._waiting.get(message.call)
                if future is None or future.done():
                    continue  # withdrawn meanwhile
                if message.result is not None:
                    future.set_result(message.result)
                else:
                    future.set_exception(EngineFailedError(message.error or "the engine failed"))
                self._stats.requests += 1
                self._stats.heartbeat_monotonic = time.monotonic()
        finally:
            self.closed.set()
            gone = EngineFailedError("the engine process is gone")
            for future in self._waiting.values():
                if not future.done():
                    future.set_exception(gone)
            self._writer.close()
