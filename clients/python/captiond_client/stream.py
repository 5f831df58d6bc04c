"""Streaming audio to a daemon over protocol v1 (asyncio, the caller's event loop).

`stream_samples` paces 16 kHz mono audio at `speed` times real time (0: as fast as the socket
takes it), sends `end`, and hands every server message to `on_message` until `done`.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import numpy as np
import numpy.typing as npt
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed

from captiond_client.wavfile import TARGET_RATE_HZ, to_pcm_s16le

Message = dict[str, Any]
CHUNK_MS = 100


class StreamError(RuntimeError):
    """The daemon refused or ended the stream with an error."""

    def __init__(self, message: str, close_code: int | None = None) -> None:
        super().__init__(message)
        self.close_code = close_code


def stream_url(url: str, sample_rate_hz: int = TARGET_RATE_HZ) -> str:
    sep = "&" if "?" in url else "?"
    return f"{url}{sep}sample_rate={sample_rate_hz}&encoding=pcm_s16le"


async def _receive(conn: ClientConnection, on_message: Callable[[Message], None]) -> None:
    try:
        async for raw in conn:
            if isinstance(raw, bytes):
                continue
            message: Message = json.loads(raw)
            on_message(message)
            if message.get("type") == "error":
                raise StreamError(f"{message.get('code')}: {message.get('message')}")
            if message.get("type") == "done":
                return
    except ConnectionClosed as exc:
        raise StreamError(f"connection closed: {exc}", exc.rcvd.code if exc.rcvd else None) from exc
    code = conn.close_code
    raise StreamError(f"the daemon closed the stream before 'done' (code {code})", code)


async def send_chunks(
    conn: ClientConnection, chunks: AsyncIterator[bytes], finish: bool = True
) -> None:
    async for chunk in chunks:
        await conn.send(chunk)
    if finish:
        await conn.send(json.dumps({"type": "end"}))


async def paced_chunks(samples: npt.NDArray[np.float32], speed: float) -> AsyncIterator[bytes]:
    """100 ms PCM chunks, sent on the schedule of real time divided by `speed`."""
    chunk = TARGET_RATE_HZ * CHUNK_MS // 1000
    started = time.monotonic()
    for i, start in enumerate(range(0, len(samples), chunk)):
        if speed > 0:
            due = started + i * CHUNK_MS / 1000 / speed
            await asyncio.sleep(max(0.0, due - time.monotonic()))
        yield to_pcm_s16le(samples[start : start + chunk])


async def stream_samples(
    url: str,
    samples: npt.NDArray[np.float32],
    *,
    speed: float = 1.0,
    on_message: Callable[[Message], None],
) -> None:
    """Stream `samples` (16 kHz mono) and report every message; raises StreamError on errors."""
    async with connect(stream_url(url), max_size=None) as conn:
        receiver = asyncio.create_task(_receive(conn, on_message))
        sender = asyncio.create_task(send_chunks(conn, paced_chunks(samples, speed)))
        try:
            await receiver
        finally:
            sender.cancel()
