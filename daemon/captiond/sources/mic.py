"""Microphone capture with sounddevice (PortAudio): input devices, and blocks of audio as an
async iterator (captiond_client.mic streams them to a daemon; sources/capture.py captures a
source's device for the daemon).

Threads: PortAudio calls `capture`'s callback on its own audio thread; the callback only copies
the block and hands it to the caller's event loop with `call_soon_threadsafe`. Every PortAudio
call that talks to the audio server (opening, starting and closing a stream, `_refresh`'s
re-initialisation, the device queries) blocks for as long as that server hangs (a stopped
PulseAudio): `capture` makes them on a daemon thread of their own (`_in_thread`);
`input_devices` and `find_device` block, for callers without an event loop (the CLIs, at
start-up, and the daemon's capture process, captiond.sources.capture, which does nothing else).
`_PORTAUDIO` serialises those calls across threads. The generator's queue, its stall check and
its blocks run on the event-loop thread. sounddevice is imported lazily, since it needs
libportaudio2 at import time.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt

Block = npt.NDArray[np.float32]
T = TypeVar("T")
_POLL_S = 0.25
# How long the end of `capture` waits for its stream to close. A device that fails because its
# audio server hangs is reported after this, not when the server comes back; the close goes on
# on its thread (and holds _PORTAUDIO, so the next open waits for it there).
_CLOSE_WAIT_S = 2.0
# PortAudio's global state is not for concurrent calls, and re-initialising it (_refresh) with a
# stream open would pull the stream from under its owner: held across every PortAudio call.
# Reentrant: find_device holds it across input_devices' refresh and its own query.
_PORTAUDIO = threading.RLock()
_open_streams = 0  # guarded by _PORTAUDIO; the device list is refreshed only while it is 0


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


def _in_thread(
    call: Callable[[], T], discard: Callable[[T], None] | None = None
) -> asyncio.Future[T]:
    """`call()` on a daemon thread of its own; its outcome arrives on the running loop's future.

    Not asyncio.to_thread: a call stuck on a hung audio server would hold one of the default
    executor's few workers, and the interpreter's exit waits for those. When the future was
    cancelled (its waiter went) by the time `call` returns, its result goes to `discard` (on a
    thread: a stream opened too late is closed, which can block too)."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()

    def settle(outcome: tuple[T] | Exception) -> None:  # the loop's thread
        if not future.cancelled():
            if isinstance(outcome, Exception):
                future.set_exception(outcome)
            else:
                future.set_result(outcome[0])
        elif not isinstance(outcome, Exception) and discard is not None:
            threading.Thread(target=discard, args=outcome, daemon=True).start()

    def run() -> None:
        outcome: tuple[T] | Exception
        try:
            outcome = (call(),)
        except Exception as exc:
            outcome = exc
        try:
            loop.call_soon_threadsafe(settle, outcome)
        except RuntimeError:  # the loop closed: nobody waits any more
            if not isinstance(outcome, Exception) and discard is not None:
                discard(outcome[0])

    threading.Thread(target=run, name="portaudio", daemon=True).start()
    return future


def _refresh(sd: Any) -> None:
    """Let PortAudio enumerate devices again (one plugged in since start-up, or one back).
    The caller holds _PORTAUDIO."""
    if _open_streams == 0:
        sd._terminate()
        sd._initialize()


def input_devices() -> list[InputDevice]:
    """The input devices, enumerated afresh. Blocks while the audio server hangs."""
    sd = _sounddevice()
    with _PORTAUDIO:
        try:
            _refresh(sd)
            infos = sd.query_devices()
        except sd.PortAudioError as exc:  # not an OSError: Pa_Initialize or a query failed
            raise DeviceError(f"cannot list the input devices: {exc}") from exc
    return [
        InputDevice(
            index=int(info["index"]),
            name=str(info["name"]),
            channels=int(info["max_input_channels"]),
            default_rate_hz=round(float(info["default_samplerate"])),
        )
        for info in infos
        if int(info["max_input_channels"]) > 0
    ]


def find_device(device: str | int) -> InputDevice:
    """An input device by index, by name (exact, else a unique case-insensitive part), or the
    system's default input for "default". Blocks while the audio server hangs."""
    with _PORTAUDIO:  # the default's index belongs to the enumeration just made
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


def _close(stream: Any) -> None:
    """Close a stream `capture` opened (on a thread: it can block on the audio server)."""
    global _open_streams
    with _PORTAUDIO:
        try:
            stream.close(ignore_errors=True)
        finally:
            _open_streams -= 1


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
    when the stream cannot start, stops by itself, or sends nothing for `stall_s`. Close the
    generator (`contextlib.aclosing`) when done with it early: that closes the stream.
    """
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

    def open_stream() -> Any:  # an _in_thread thread
        global _open_streams
        with _PORTAUDIO:
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
            except sd.PortAudioError as exc:
                _close(stream)
                raise DeviceError(f"cannot start {device.name}: {exc}") from exc
        return stream

    stream = await _in_thread(open_stream, discard=_close)
    try:
        idle_s = 0.0
        while stop is None or not stop.is_set():
            try:
                # Not asyncio.wait_for: in Python 3.11 it returns a block that came as the task
                # was cancelled, and the cancellation is lost.
                async with asyncio.timeout(_POLL_S):
                    block = await queue.get()
            except TimeoutError:
                idle_s += _POLL_S
                if idle_s >= stall_s:
                    raise DeviceError(f"{device.name}: no audio for {stall_s:.0f} s") from None
                continue
            if block is None:
                raise DeviceError(f"{device.name}: the input stream stopped")
            idle_s = 0.0
            yield block
    finally:
        closed = _in_thread(lambda: _close(stream))
        await asyncio.wait({closed}, timeout=_CLOSE_WAIT_S)
