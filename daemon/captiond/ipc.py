"""The link between a worker process and the engine core: its messages, their framing, and the
rule that moves each stream's audio to the engine process once.

Both ends run on their process's event-loop thread and were created by the main process as a
socket pair (workers.py), so the peer is always our own code: messages are pickles behind a
4-byte length. A worker sends `Decode` (the window's new audio only, see `AudioSpan`),
`Cancel`, `Forget` and `Status` (once a second: its heartbeat and counters); the core sends
`Hello` once, then `Result` per decode it was not told to cancel.
"""

from __future__ import annotations

import asyncio
import pickle
import struct
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from captiond.audio import AudioBuffer, AudioSpan
from captiond.engines import EngineInfo, EngineRequest, EngineResult

_LENGTH = struct.Struct("!I")
# The biggest message is a Decode with a whole 30-s window of float32 audio (1.9 MB).
MAX_MESSAGE_BYTES = 16 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class Hello:
    engine: EngineInfo


@dataclass(frozen=True, slots=True)
class Decode:
    """Decode the window of `stream` that ends at `request.end_sample` and is `window_samples`
    long. `audio` is what the engine process lacks of it, from `audio_from_sample` on;
    `request` is the engine request without its audio."""

    call: int
    stream: str
    window_samples: int
    audio_from_sample: int
    audio: npt.NDArray[np.float32]
    request: EngineRequest


@dataclass(frozen=True, slots=True)
class Cancel:
    call: int


@dataclass(frozen=True, slots=True)
class Forget:
    stream: str


@dataclass(frozen=True, slots=True)
class Result:
    call: int
    result: EngineResult | None
    error: str | None = None


@dataclass(frozen=True, slots=True)
class Status:
    pid: int
    sessions_open: int
    sessions_total: int


Message = Hello | Decode | Cancel | Forget | Result | Status


def write(writer: asyncio.StreamWriter, message: Message) -> None:
    """Queue one message (the transport buffers it; never blocks)."""
    body = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    writer.writelines((_LENGTH.pack(len(body)), body))  # no copy of the body to prefix it


async def read(reader: asyncio.StreamReader) -> Message | None:
    """The next message, or None when the other process has gone."""
    try:
        (length,) = _LENGTH.unpack(await reader.readexactly(_LENGTH.size))
        if length > MAX_MESSAGE_BYTES:
            raise ValueError(f"message of {length} bytes")
        message: Message = pickle.loads(await reader.readexactly(length))
    except (asyncio.IncompleteReadError, ConnectionError):
        return None
    return message


class AudioCopy:
    """The engine process's copy of one stream's newest audio (event-loop thread of the main
    process): an `AudioBuffer` that follows `span`."""

    def __init__(self) -> None:
        self.span = AudioSpan()
        self._buffer = AudioBuffer()

    def put(self, from_sample: int, samples: npt.NDArray[np.float32]) -> None:
        if not samples.size:
            return
        if from_sample != self.span.end:
            # A new stretch replaces what was held, in a new buffer: windows handed out are
            # views of the old one.
            self._buffer = AudioBuffer(from_sample)
        self.span.advance(from_sample, from_sample + len(samples))
        self._buffer.append(samples)
        self._buffer.discard_before(self.span.start)

    def window(self, start_sample: int, end_sample: int) -> npt.NDArray[np.float32]:
        """Samples [start, end), a read-only view that stays valid while this keeps taking
        audio (the engine thread reads it meanwhile). Copying every decode window here cost a
        30-s copy per decode on the event-loop thread."""
        return self._buffer.view(start_sample, end_sample)
