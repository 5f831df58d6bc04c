"""The link between a worker process and the engine core: its messages, their framing, and the
rule that moves each stream's audio to the engine process once.

Both ends run on their process's event-loop thread and were created by the main process as a
socket pair (workers/pool.py), so the peer is always our own code: messages are pickles behind a
4-byte length. A worker sends `Decode` (the window's new audio only, see `AudioSpan`),
`Cancel`, `Forget` and `Status` (once a second: its heartbeat and counters); the core sends
`Hello` once, then `Result` per decode it was not told to cancel.

`Decode` and `Result`, one each per decode, pickle as flat values (their `__reduce__`): the
default pickling of slotted dataclasses and of a numpy array took 20-25 µs per message at each
end, which summed to a tenth of a worker's CPU at 1,000 fake-engine streams.
"""

from __future__ import annotations

import asyncio
import dataclasses
import pickle
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from captiond.engines.base import EngineInfo, EngineRequest, EngineResult
from captiond.samples import AudioBuffer, AudioSpan

_LENGTH = struct.Struct("!I")
_REQUEST_FIELDS = tuple(f.name for f in dataclasses.fields(EngineRequest) if f.name != "audio")
_RESULT_FIELDS = tuple(f.name for f in dataclasses.fields(EngineResult))
_NO_AUDIO = np.zeros(0, dtype=np.float32)
# The biggest message is a Decode with a whole 30-s window of float32 audio (1.9 MB).
MAX_MESSAGE_BYTES = 16 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class Hello:
    engine: EngineInfo


@dataclass(frozen=True, slots=True)
class Decode:
    """Decode the window of `stream` that ends at `request.end_sample` and is `window_samples`
    long. `audio` is what the engine process lacks of it, from `audio_from_sample` on;
    `request` is the engine request, whose own audio does not travel (it arrives empty)."""

    call: int
    stream: str
    window_samples: int
    audio_from_sample: int
    audio: npt.NDArray[np.float32]
    request: EngineRequest

    def __reduce__(self) -> tuple[Any, ...]:
        request = tuple(getattr(self.request, name) for name in _REQUEST_FIELDS)
        fields = (self.call, self.stream, self.window_samples, self.audio_from_sample)
        return (_decode, (*fields, self.audio.astype("<f4", copy=False).tobytes(), request))


def _decode(
    call: int,
    stream: str,
    window_samples: int,
    audio_from_sample: int,
    audio: bytes,
    request: tuple[Any, ...],
) -> Decode:
    return Decode(
        call,
        stream,
        window_samples,
        audio_from_sample,
        np.frombuffer(audio, dtype="<f4"),
        EngineRequest(audio=_NO_AUDIO, **dict(zip(_REQUEST_FIELDS, request, strict=True))),
    )


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

    def __reduce__(self) -> tuple[Any, ...]:
        result = self.result
        fields = None if result is None else tuple(getattr(result, n) for n in _RESULT_FIELDS)
        return (_result, (self.call, fields, self.error))


def _result(call: int, fields: tuple[Any, ...] | None, error: str | None) -> Result:
    if fields is None:
        return Result(call, None, error)
    return Result(call, EngineResult(**dict(zip(_RESULT_FIELDS, fields, strict=True))), error)


@dataclass(frozen=True, slots=True)
class Status:
    pid: int
    sessions_open: int
    sessions_total: int
    sources: str  # Daemon.sources_status(): "" but in the worker that runs the sources
    behind: bool  # past `max_lag_ms`: it refuses new streams (server/load.py)


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
