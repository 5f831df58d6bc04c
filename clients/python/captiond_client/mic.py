"""Microphone capture with sounddevice (PortAudio): input devices, and blocks of audio as an
async iterator; `stream_microphone` sends them to a daemon over protocol v1.

PortAudio calls `capture`'s callback on its own audio thread; the callback only copies the block
and hands it to the caller's event loop with `call_soon_threadsafe`. Everything else runs on the
event-loop thread. sounddevice is imported lazily, since it needs libportaudio2 at import time.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from captiond_client.audiofile import to_pcm_s16le
from captiond_client.stream import Message, Stream

Block = npt.NDArray[np.float32]
_POLL_S = 0.25
_open_streams = 0  # PortAudio's device list may only be refreshed while no stream is open


class DeviceError(OSError):
    """No such input device, no PortAudio, or the device stopped delivering audio."""


@dataclass(frozen=True, slots=True, kw_only=True)
class InputDevice:
    index: int
    name: str
    channels: int
    default_rate_hz: int


def _sounddevice() -> Any:
    try:
        import sounddevice
    except OSError as exc:  # raised at import when libportaudio2 is missing
        raise DeviceError(f"PortAudio is not available ({exc}): install libportaudio2") from exc
    return sounddevice


def _refresh(sd: Any) -> None:
    """Let PortAudio enumerate devices again (one plugged in since start-up, or one back)."""
    if _open_streams == 0:
        sd._terminate()
        sd._initialize()


def input_devices() -> list[InputDevice]:
    sd = _sounddevice()
    _refresh(sd)
    return [
        InputDevice(
            index=int(info["index"]),
            name=str(info["name"]),
            channels=int(info["max_input_channels"]),
            default_rate_hz=round(float(info["default_samplerate"])),
        )
        for info in sd.query_devices()
        if int(info["max_input_channels"]) > 0
    ]


def find_device(device: str | int) -> InputDevice:
    """An input device by index, by name (exact, else a unique case-insensitive part), or the
    system's default input for "default"."""
    devices = input_devices()
    if device == "default":
        sd = _sounddevice()
        try:
            device = int(sd.query_devices(kind="input")["index"])
        except sd.PortAudioError as exc:
            raise DeviceError("there is no default input device") from exc
    if isinstance(device, int):
        found = [d for d in devices if d.index == device]
    else:
        found = [d for d in devices if d.name == device] or [
            d for d in devices if device.lower() in d.name.lower()
        ]
    if len(found) != 1:
        names = ", ".join(f"{d.index}: {d.name}" for d in devices) or "none"
        what = "no" if not found else "more than one"
        raise DeviceError(f"{what} input device matches {device!r} (inputs: {names})")
    return found[0]


async def capture(
    device: InputDevice,
    *,
    channel: int | None = None,
    block_ms: int = 100,
    stall_s: float = 5.0,
    stop: asyncio.Event | None = None,
) -> AsyncIterator[Block]:
    """Mono float32 blocks at the device's default rate, until `stop` is set.

    `channel` picks one input channel; None takes the mean of the first two. Raises DeviceError
    when the stream cannot start, stops by itself, or sends nothing for `stall_s`.
    """
    global _open_streams
    sd = _sounddevice()
    channels = min(2, device.channels) if channel is None else channel + 1
    if channels > device.channels:
        raise DeviceError(f"{device.name} has {device.channels} input channel(s), not {channels}")
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[Block | None] = asyncio.Queue()

    def hand_over(block: Block | None) -> None:  # PortAudio's thread
        with contextlib.suppress(RuntimeError):  # the loop closed: the block is dropped
            loop.call_soon_threadsafe(queue.put_nowait, block)

    def on_audio(indata: Block, frames: int, time_info: Any, status: Any) -> None:
        mono = indata.mean(axis=1) if channel is None else indata[:, channel]
        hand_over(mono.astype(np.float32))

    try:
        stream = sd.InputStream(
            device=device.index,
            channels=channels,
            samplerate=device.default_rate_hz,
            blocksize=device.default_rate_hz * block_ms // 1000,
            dtype="float32",
            callback=on_audio,
            finished_callback=lambda: hand_over(None),
        )
    except sd.PortAudioError as exc:
        raise DeviceError(f"cannot open {device.name}: {exc}") from exc
    _open_streams += 1
    try:
        stream.start()
        idle_s = 0.0
        while stop is None or not stop.is_set():
            try:
                block = await asyncio.wait_for(queue.get(), _POLL_S)
            except TimeoutError:
                idle_s += _POLL_S
                if idle_s >= stall_s:
                    raise DeviceError(f"{device.name}: no audio for {stall_s:.0f} s") from None
                continue
            if block is None:
                raise DeviceError(f"{device.name}: the input stream stopped")
            idle_s = 0.0
            yield block
    except sd.PortAudioError as exc:
        raise DeviceError(f"{device.name}: {exc}") from exc
    finally:
        _open_streams -= 1
        stream.close(ignore_errors=True)


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
