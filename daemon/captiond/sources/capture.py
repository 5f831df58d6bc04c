"""A source's microphone, captured in a process of its own (`python -m captiond.sources.capture`).

PortAudio enumerates the devices when it is initialised, and it can be initialised again only
while none of its streams is open: in the daemon's own process, one source's open stream kept
every other source from finding a microphone plugged in after start-up. So each capture runs
in a child process, and each retry starts a new one, which sees the devices there are now. A
child whose audio server hangs is killed, not waited for: no thread of the daemon blocks on
PortAudio.

`microphone` (the daemon's side, event-loop thread; sources/daemon.py's AudioInput) starts the
child, reads its device and its blocks from the child's stdout, and kills it when the source is done
with it or it sends nothing for `_STALL_S`. `main` (the child) finds the device and runs
captiond_client.mic's `capture` on an event loop of its own, writing each block as it comes.
The child's stderr is the daemon's (ALSA's and Python's own messages reach its log).

The pipe carries records of one tag byte each: b"D" and a JSON line (the device: index, name,
rate_hz), then b"A", a little-endian uint32 sample count and that many float32 samples, per
block; or b"E" and a JSON line with the error that ended the capture.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal
import struct
import sys
from collections.abc import AsyncGenerator
from typing import Any, BinaryIO

import numpy as np

from captiond.config import SourceConfig
from captiond.samples import Samples

log = logging.getLogger(__name__)

_DEVICE, _AUDIO, _ERROR = b"D", b"A", b"E"
_COUNT = struct.Struct("<I")
# Longer than the child's own stall check (5 s) and its stream's close (2 s), so that a device
# that stops is reported by the child, with its reason, unless the child itself hangs.
_STALL_S = 10.0


class CaptureError(OSError):
    """The capture process found no device, lost it, or ended."""


async def microphone(source: SourceConfig) -> AsyncGenerator[tuple[int, Samples], None]:
    """The production AudioInput: the configured device at its own rate, captured by a child
    process started for this call."""
    args = [sys.executable, "-m", "captiond.sources.capture", str(source.device)]
    if source.channel is not None:
        args += ["--channel", str(source.channel)]
    child = await asyncio.create_subprocess_exec(
        *args, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE
    )
    assert child.stdout is not None
    try:
        # No time limit: the device lookup waits for a hung audio server as long as it hangs.
        device = await _expect(child.stdout, _DEVICE, child)
        rate_hz = int(device["rate_hz"])
        name = device["name"]
        log.info("source %s: device %d %r at %d Hz", source.name, device["index"], name, rate_hz)
        while True:
            try:
                async with asyncio.timeout(_STALL_S):
                    block = await _expect(child.stdout, _AUDIO, child)
            except TimeoutError:
                raise CaptureError(f"{name}: no audio for {_STALL_S:.0f} s") from None
            yield rate_hz, block
    finally:
        if child.returncode is None:
            child.kill()
        await child.wait()


async def _expect(
    stdout: asyncio.StreamReader, expected: bytes, child: asyncio.subprocess.Process
) -> Any:
    """The child's next record, which must be `expected`: the device's JSON or a block's
    samples. Its error record, or its end, is a CaptureError."""
    try:
        tag = await stdout.readexactly(1)
        if tag == _AUDIO:
            (count,) = _COUNT.unpack(await stdout.readexactly(_COUNT.size))
            payload: Any = np.frombuffer(await stdout.readexactly(4 * count), dtype="<f4")
        else:
            payload = json.loads(await stdout.readline())
    except asyncio.IncompleteReadError:
        raise CaptureError(f"the capture process ended (exit code {await child.wait()})") from None
    if tag == _ERROR:
        raise CaptureError(str(payload["error"]))
    if tag != expected:
        raise CaptureError(f"the capture process sent {tag!r} where {expected!r} was due")
    return payload


# -- the child ------------------------------------------------------------------------------


def _write(out: BinaryIO, tag: bytes, payload: bytes) -> None:
    out.write(tag + payload)
    out.flush()


def _json_line(value: dict[str, object]) -> bytes:
    return json.dumps(value).encode() + b"\n"


async def _capture(device_spec: str, channel: int | None, out: BinaryIO) -> None:
    from captiond.sources.mic import capture, find_device

    # This process does nothing else, so the lookup may block (while the audio server hangs).
    device = find_device(int(device_spec) if device_spec.isdigit() else device_spec)
    found = {"index": device.index, "name": device.name, "rate_hz": device.default_rate_hz}
    _write(out, _DEVICE, _json_line(found))
    async for block in capture(device, channel=channel):
        samples = block.astype("<f4", copy=False)
        _write(out, _AUDIO, _COUNT.pack(len(samples)) + samples.tobytes())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m captiond.sources.capture")
    parser.add_argument("device", help='"default", an index, or (part of) a device name')
    parser.add_argument("--channel", type=int, default=None)
    args = parser.parse_args(argv)
    # The daemon ends this process (SIGKILL); a Ctrl-C meant for the daemon is not for it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # The records go to the pipe on a descriptor of their own; fd 1 becomes stderr, so that
    # whatever else writes to stdout (a C library's message) cannot break a record.
    out = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    try:
        asyncio.run(_capture(args.device, args.channel, out))
    except BrokenPipeError:  # the daemon is gone
        return 1
    except Exception as exc:  # any device error: PortAudio's, for one, is no OSError
        message = str(exc) if isinstance(exc, OSError) else f"{type(exc).__name__}: {exc}"
        with contextlib.suppress(BrokenPipeError):
            _write(out, _ERROR, _json_line({"error": message}))
    return 1


if __name__ == "__main__":
    sys.exit(main())
