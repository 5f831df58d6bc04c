"""The engine core: the main process's end of every worker's decodes.

Runs on the main process's event-loop thread, in front of its one InferenceScheduler (whose
engine thread owns the model and the GPU). Per worker link it keeps each stream's newest audio
(`ipc.AudioCopy`: a worker sends only what the core lacks), turns `Decode` messages into
engine requests, submits them, and answers each with a `Result`; `Cancel` withdraws a decode
the worker no longer wants. A link that closes (the worker exited or crashed) takes its calls
and audio with it; other workers' streams go on.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable
from itertools import count

from captiond.decoding import link as ipc
from captiond.decoding.scheduler import InferenceScheduler
from captiond.engines.base import EngineRequest
from captiond.errors import EngineFailedError

log = logging.getLogger(__name__)


class EngineCore:
    def __init__(self, scheduler: InferenceScheduler) -> None:
        self.scheduler = scheduler
        self._links = count()
        self._copies: dict[int, dict[str, ipc.AudioCopy]] = {}  # per link, per stream

    @property
    def streams_held(self) -> int:
        """Streams whose audio this process keeps, over all links."""
        return sum(len(copies) for copies in self._copies.values())

    async def serve(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        on_status: Callable[[ipc.Status | None], None],
    ) -> None:
        """Serve one worker link until it closes; `on_status` hears of every message (None:
        not a status), since any message shows the worker is alive."""
        ipc.write(writer, ipc.Hello(self.scheduler.engine_info))
        link = next(self._links)
        copies = self._copies[link] = {}
        calls: dict[int, asyncio.Task[None]] = {}
        try:
            while (message := await ipc.read(reader)) is not None:
                on_status(message if isinstance(message, ipc.Status) else None)
                if isinstance(message, ipc.Decode):
                    copy = copies.setdefault(message.stream, ipc.AudioCopy())
                    copy.put(message.audio_from_sample, message.audio)
                    end = message.request.end_sample
                    audio = copy.window(end - message.window_samples, end)
                    # Stream keys are the worker's: named apart from another worker's.
                    request = dataclasses.replace(
                        message.request, audio=audio, stream=f"{link}/{message.stream}"
                    )
                    calls[message.call] = asyncio.create_task(
                        self._decode(message.call, request, writer, calls)
                    )
                elif isinstance(message, ipc.Cancel):
                    if (withdrawn := calls.get(message.call)) is not None:
                        withdrawn.cancel()
                elif isinstance(message, ipc.Forget):
                    copies.pop(message.stream, None)
                elif not isinstance(message, ipc.Status):
                    log.error("unexpected message from a worker: %r", type(message).__name__)
        finally:
            for task in list(calls.values()):
                task.cancel()
            del self._copies[link]
            writer.close()

    async def _decode(
        self,
        call: int,
        request: EngineRequest,
        writer: asyncio.StreamWriter,
        calls: dict[int, asyncio.Task[None]],
    ) -> None:
        try:
            result = await self.scheduler.submit(request)
        except EngineFailedError as exc:
            reply = ipc.Result(call, None, str(exc))
        else:
            reply = ipc.Result(call, result)
        finally:
            calls.pop(call, None)
        if not writer.is_closing():
            ipc.write(writer, reply)
