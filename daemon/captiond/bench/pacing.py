"""Real-time clients for the benchmarks (asyncio, the bench's event loop).

`send_paced` sends 100 ms chunks on the schedule of real time divided by `speed` and records
each send on the trace; `stream_native` streams one clip over protocol v1 and records every
message's arrival, so that `metrics` can put sends and arrivals on one clock.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable

import numpy as np
import numpy.typing as npt
from websockets.asyncio.client import connect

from captiond.bench.metrics import Trace
from captiond.samples import samples_to_ms
from captiond.sources.audiofile import to_pcm_s16le
from captiond.whisper import SAMPLE_RATE_HZ
from captiond_client.stream import stream_url

CHUNK_MS = 100
_CHUNK_SAMPLES = SAMPLE_RATE_HZ * CHUNK_MS // 1000


class BenchStreamError(RuntimeError):
    """The daemon ended a benchmark stream with an error or without `done`."""


async def send_paced(
    audio: bytes,
    bytes_per_sample: int,
    speed: float,
    send: Callable[[bytes], Awaitable[None]],
    trace: Trace,
) -> None:
    """Send `audio` (16 kHz, encoded once for the whole clip: converting each chunk was a
    tenth of a client process's CPU) in 100 ms chunks."""
    started = time.monotonic()
    trace.speed = speed
    n_samples = len(audio) // bytes_per_sample
    for i, start in enumerate(range(0, n_samples, _CHUNK_SAMPLES)):
        await asyncio.sleep(max(0.0, started + i * CHUNK_MS / 1000 / speed - time.monotonic()))
        end = min(start + _CHUNK_SAMPLES, n_samples)
        await send(audio[start * bytes_per_sample : end * bytes_per_sample])
        trace.record_sent(time.monotonic(), samples_to_ms(end))


async def stream_native(
    url: str,
    samples: npt.NDArray[np.float32],
    *,
    speed: float = 1.0,
    trace: Trace | None = None,
) -> Trace:
    """Stream one clip to a captiond daemon, then `end`; the trace up to `done`. Pass `trace` to
    keep what was recorded (the connect and close epochs too) when the stream fails."""
    trace = Trace() if trace is None else trace
    try:
        async with connect(stream_url(url), max_size=None) as conn:
            trace.connect_epoch_s = time.time()

            async def receive() -> None:
                async for raw in conn:
                    if isinstance(raw, bytes):
                        continue
                    message = json.loads(raw)
                    trace.record_message(time.monotonic(), message)
                    if message["type"] == "error":
                        raise BenchStreamError(f"{message['code']}: {message['message']}")
                    if message["type"] == "done":
                        trace.ended_s = time.monotonic()
                        return
                raise BenchStreamError(f"closed before 'done' (code {conn.close_code})")

            receiver = asyncio.create_task(receive())

            try:
                await send_paced(to_pcm_s16le(samples), 2, speed, conn.send, trace)
                await conn.send(json.dumps({"type": "end"}))
                await receiver
            finally:
                receiver.cancel()
    finally:
        # After the closing handshake (or the failure): the stream counts as live until here.
        if trace.connect_epoch_s is not None:
            trace.close_epoch_s = time.time()
    return trace
