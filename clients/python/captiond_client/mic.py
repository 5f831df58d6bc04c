"""`captiond-client mic`: a microphone (captiond.sources.mic's capture) streamed to a daemon over
protocol v1, resumed across dropped connections. Event-loop thread; PortAudio's callbacks run on
its own thread, as captiond.sources.mic says."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

from captiond.sources.audiofile import to_pcm_s16le
from captiond.sources.mic import Block, InputDevice, capture
from captiond_client.stream import Message, Stream


async def _pcm(blocks: AsyncIterator[Block]) -> AsyncIterator[bytes]:
    async for block in blocks:
        yield to_pcm_s16le(block)


async def stream_microphone(
    url: str,
    device: InputDevice,
    *,
    channel: int | None = None,
    stop: asyncio.Event,
    on_message: Callable[[Message], None],
    retry_for_s: float = 300.0,
) -> None:
    """Send the microphone at its own rate until `stop` is set, then `end`; report every message
    until `done`. A dropped connection is resumed (stream.py) while capture goes on. Raises
    StreamError (daemon) or DeviceError (microphone)."""
    stream = Stream(
        url,
        sample_rate_hz=device.default_rate_hz,
        on_message=on_message,
        retry_for_s=retry_for_s,
    )
    await stream.run(_pcm(capture(device, channel=channel, stop=stop)))
