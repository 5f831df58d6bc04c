"""One stream connection: its StreamSession, the reader that feeds it and the pump that runs its
decodes and delivers what they produce.

Event-loop thread. server.py accepts the connection, builds the session and maps the error
this ends with to its close code; this module owns what happens in between: the stream's limits
(frame sizes, idle time, audio speed, buffered audio), journaling each final before it is sent,
the latency metrics, and the rule that a client error ends the input while the finals of the
audio received so far are still delivered. `AnsweringConnection` makes websockets' own
refusals answer with our `error` message too.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any

from websockets.asyncio.server import ServerConnection
from websockets.frames import CloseCode
from websockets.protocol import State

from captiond import SAMPLE_RATE_HZ
from captiond.config import ServerConfig
from captiond.engines import EngineRequest, EngineResult
from captiond.errors import (
    BadMessageError,
    FrameTooLargeError,
    IdleTimeoutError,
    SessionError,
)
from captiond.journal import JournalError, SessionJournal
from captiond.limits import AudioSpeedLimit
from captiond.metrics import Metrics
from captiond.protocol import Control, Done, Error, Final, Partial, parse_control
from captiond.scheduler import drive_session
from captiond.session import SessionState, StreamSession

log = logging.getLogger(__name__)

CLOSE_NORMAL = 1000
CLOSE_GOING_AWAY = 1001
# The `error` code sent before websockets' own close, for what it refuses itself: a frame over
# the hard size limit, invalid UTF-8 in a text frame, a frame no websocket may send.
_TRANSPORT_ERRORS: dict[int, str] = {
    CloseCode.MESSAGE_TOO_BIG: FrameTooLargeError.code,
    CloseCode.INVALID_DATA: BadMessageError.code,
    CloseCode.PROTOCOL_ERROR: BadMessageError.code,
}
# Control messages are a few dozen bytes; a text frame this long is not one.
_MAX_CONTROL_BYTES = 4_096


class AnsweringConnection(ServerConnection):
    """A connection that answers websockets' own refusals (see `_TRANSPORT_ERRORS`) with our
    `error` message before its close frame, as it answers ours."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        fail = self.protocol.fail

        def fail_with_error(code: int, reason: str = "") -> None:
            error_code = _TRANSPORT_ERRORS.get(code)
            if error_code is not None and self.protocol.state is State.OPEN:
                message = Error(code=error_code, message=reason or "invalid frame")
                self.protocol.send_text(message.to_json().encode())
            fail(code, reason)

        self.protocol.fail = fail_with_error  # type: ignore[method-assign]


class StreamConnection:
    """A stream's session between `ready` and the close: `run` until the session is done."""

    def __init__(
        self,
        *,
        conn: ServerConnection,
        session: StreamSession,
        config: ServerConfig,
        submit: Callable[[EngineRequest], Awaitable[EngineResult]],
        metrics: Metrics,
        journal: SessionJournal | None,
    ) -> None:
        self.session = session
        self.journal = journal
        self.error: SessionError | None = None  # why the input ended early: sent after finals
        self.close_code = CLOSE_NORMAL
        self._conn = conn
        self._config = config
        self._submit = submit
        self._metrics = metrics
        self.wake = asyncio.Event()  # the session has work
        self.drained = asyncio.Event()  # a decode finished
        # (stream audio ms after a frame, loop time it arrived): when a final's end arrived.
        self.arrivals: deque[tuple[int, float]] = deque()

    def end_for_shutdown(self) -> None:
        """The daemon is stopping: end the input now; the finals still come, then 1001."""
        self.close_code = CLOSE_GOING_AWAY
        if self.session.state is SessionState.STREAMING:
            self.session.receive_control(Control.END)
        self.wake.set()

    def final_latency_s(self, end_ms: int, now_s: float) -> float | None:
        """Time since the audio up to `end_ms` arrived; forgets arrivals before it (finals
        come in stream order)."""
        while self.arrivals and self.arrivals[0][0] < end_ms:
            self.arrivals.popleft()
        return now_s - self.arrivals[0][1] if self.arrivals else None

    async def run(self) -> None:
        """Reader and pump side by side until the session is done. A client error ends the
        input, and the finals of the audio received so far are still delivered before it; an
        engine failure, or a vanished client, ends both at once."""
        reader = asyncio.create_task(self._read())
        pump = asyncio.create_task(self._pump())
        try:
            await asyncio.wait({reader, pump}, return_when=asyncio.FIRST_COMPLETED)
            if reader.done() and not pump.done():
                error = reader.exception()
                if isinstance(error, SessionError):
                    self.error = error
                    if self.session.state is SessionState.STREAMING:
                        self.session.receive_control(Control.END)
                    self.wake.set()
                elif error is not None:
                    raise error
            await pump
        finally:
            reader.cancel()
            pump.cancel()

    async def _read(self) -> None:
        """Feed frames to the session until the client goes away or breaks a rule. Frames
        after `end` are still read: one that is not a keepalive is a protocol violation,
        answered after the finals."""
        cfg = self._config
        session = self.session
        loop = asyncio.get_running_loop()
        speed = AudioSpeedLimit(
            max_speed=cfg.max_audio_speed, burst_s=cfg.audio_burst_s, now_s=loop.time()
        )
        bytes_per_s = session.params.sample_rate_hz * session.params.bytes_per_sample
        max_buffered_samples = round(cfg.max_buffered_s * SAMPLE_RATE_HZ)
        last_audio_s = loop.time()
        while True:
            streaming = session.state is SessionState.STREAMING
            if streaming and session.buffered_samples > max_buffered_samples:
                # Decodes are behind: stop reading until they catch up, so the client's
                # socket fills and it waits (TCP backpressure) instead of our memory growing.
                self.drained.clear()
                await self.drained.wait()
                last_audio_s = loop.time()
                continue
            try:
                async with asyncio.timeout_at(
                    last_audio_s + cfg.idle_timeout_s if streaming else None
                ):
                    message = await self._conn.recv()
            except TimeoutError:
                raise IdleTimeoutError(
                    f"no audio for {cfg.idle_timeout_s:g} s (keepalives do not hold a session)"
                ) from None
            if self.close_code == CLOSE_GOING_AWAY and session.state is not SessionState.STREAMING:
                continue  # the daemon ended the stream for its shutdown: late audio is dropped
            if isinstance(message, bytes):
                if len(message) > cfg.max_frame_bytes:
                    raise FrameTooLargeError(
                        f"frame of {len(message)} bytes; the limit is {cfg.max_frame_bytes}"
                    )
                last_audio_s = loop.time()
                speed.add(len(message) / bytes_per_s, last_audio_s)
                session.receive_audio(message)
                self._metrics.audio_seconds.inc(len(message) / bytes_per_s)
                self.arrivals.append((session.audio_ms, last_audio_s))
                horizon_ms = session.audio_ms - round(cfg.max_buffered_s * 1000)
                while self.arrivals[0][0] < horizon_ms:
                    self.arrivals.popleft()  # no final can end there: no speech for a while
            else:
                if len(message) > _MAX_CONTROL_BYTES:
                    raise BadMessageError(
                        f"text frame of {len(message)} characters is not a control message"
                    )
                session.receive_control(parse_control(message))
            self.wake.set()

    async def _pump(self) -> None:
        """Run the session's decodes one at a time and deliver what they produce."""

        async def deliver() -> None:
            self.drained.set()
            await self._deliver()

        await drive_session(self.session, self._submit, self.wake, deliver)
        await self._deliver()

    async def _deliver(self) -> None:
        """Send what the session produced; a final is journaled before it is sent. A stream
        that ends with an error gets its finals, then the error instead of `done`. A journal
        that fails (disk full) is logged and given up for the session: captions keep flowing."""
        for message in self.session.take_messages():
            self._observe(message)
            if isinstance(message, Done) and self.error is not None:
                continue
            if isinstance(message, Final) and self.journal is not None:
                try:
                    await self.journal.append_final(message)
                except JournalError as exc:
                    log.error("journal failed, the session is no longer journaled: %s", exc)
                    self.journal = None
            await self._conn.send(message.to_json())

    def _observe(self, message: object) -> None:
        now_s = asyncio.get_running_loop().time()
        if isinstance(message, Partial):
            lag_ms = self.session.audio_ms - message.end_ms
            self._metrics.partial_lag_seconds.observe(max(0, lag_ms) / 1000)
        elif isinstance(message, Final):
            latency_s = self.final_latency_s(message.end_ms, now_s)
            if latency_s is not None:
                self._metrics.final_latency_seconds.observe(latency_s)
