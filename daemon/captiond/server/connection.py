"""One live stream: its StreamSession, the connections that feed it (one at a time: a dropped
client resumes), the pump that runs its decodes, and the error → close-code mapping.

Event-loop thread. server/daemon.py accepts a connection and finds or builds the stream; this module
owns what happens from there: the stream's limits (frame sizes, idle time, audio speed,
buffered audio), journaling each final before it is sent, holding finals until the client
acknowledges them, the latency metrics, and the rule that a client error ends the input while
the finals of the audio received so far are still delivered. A connection that drops without
`end` detaches: the stream waits `[server] resume_s` for a resume (server/daemon.py checks the
token), replaying what the client did not acknowledge. Its open utterance stays open for
`[server] drop_grace_s`, so that a client back sooner continues it; then it is finalised.
`AnsweringConnection` makes websockets' own refusals answer with our `error` message too.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import logging
from collections import deque
from collections.abc import Callable
from typing import Any

from websockets.asyncio.server import ServerConnection
from websockets.exceptions import ConnectionClosed
from websockets.frames import CloseCode
from websockets.protocol import State

from captiond.config import ServerConfig
from captiond.dialects import Dialect
from captiond.dialects.native import NativeDialect
from captiond.engines.base import EngineInfo, Submit
from captiond.engines.models import TURN_MODEL_HINT
from captiond.errors import (
    CLOSE_DROPPED,
    CLOSE_NORMAL,
    BadMessageError,
    FrameTooLargeError,
    IdleTimeoutError,
    SessionError,
    ShuttingDownError,
    close_code_for,
)
from captiond.journal.writer import SessionJournal
from captiond.ops.metrics import Metrics
from captiond.server.limits import AudioSpeedLimit
from captiond.server.load import LoadWatch
from captiond.server.resume import HeldFinals, ResumeKey
from captiond.streaming.events import Ack, Control, Done, Error, Final, Partial, ServerMessage
from captiond.streaming.pump import drive_session
from captiond.streaming.session import SessionState, StreamSession
from captiond.whisper import SAMPLE_RATE_HZ

log = logging.getLogger(__name__)

# When audio arrived, kept at most per this much of it (for the final-latency metric): one
# record per frame let a client of 2-byte frames grow a stream's list by 16,000 a second.
_ARRIVAL_STEP_MS = 30

# The `error` code sent before websockets' own close, for what it refuses itself: a frame over
# the hard size limit, invalid UTF-8 in a text frame, a frame no websocket may send.
_TRANSPORT_ERRORS: dict[int, str] = {
    CloseCode.MESSAGE_TOO_BIG: FrameTooLargeError.code,
    CloseCode.INVALID_DATA: BadMessageError.code,
    CloseCode.PROTOCOL_ERROR: BadMessageError.code,
}


async def send_error(conn: ServerConnection, error: SessionError, dialect: Dialect) -> None:
    """The `error` in the connection's protocol, then the close frame it maps to there."""
    code, reason = dialect.close_frame(error)
    log.info("session error %s (close %d): %s", error.code, code, error)
    with contextlib.suppress(ConnectionClosed):
        for text in dialect.render(Error(code=error.code, message=str(error))):
            await conn.send(text)
        await conn.close(code, reason)


async def _send(conn: ServerConnection, dialect: Dialect, message: ServerMessage) -> None:
    for text in dialect.render(message):
        await conn.send(text)


class AnsweringConnection(ServerConnection):
    """A connection that answers websockets' own refusals (see `_TRANSPORT_ERRORS`) with our
    `error` message before its close frame, as it answers ours."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.dialect: Dialect = NativeDialect({})  # server/daemon.py sets the endpoint's
        fail = self.protocol.fail

        def fail_with_error(code: int, reason: str = "") -> None:
            error_code = _TRANSPORT_ERRORS.get(code)
            if error_code is not None and self.protocol.state is State.OPEN:
                message = Error(code=error_code, message=reason or "invalid frame")
                for text in self.dialect.render(message):
                    self.protocol.send_text(text.encode())
            fail(code, reason)

        self.protocol.fail = fail_with_error  # type: ignore[method-assign]


class LiveStream:
    """A stream's session from its first `ready` to its end, over one connection at a time:
    `run` (the pump) for the session's life, `serve` once per connection."""

    def __init__(
        self,
        *,
        session_id: str,
        session: StreamSession,
        config: ServerConfig,
        submit: Submit,
        metrics: Metrics,
        journal: SessionJournal | None,
        resume_key: ResumeKey | None,
        engine: EngineInfo,
        load: LoadWatch,
        received_bytes: int = 0,
    ) -> None:
        self.id = session_id
        self._load = load  # the daemon's: every partial's lag counts towards admission
        self._engine = engine  # what a session update's language is checked against
        self.session = session
        self.journal = journal
        self.resume_key = resume_key
        self.held = HeldFinals()
        self.received_bytes = received_bytes  # audio bytes taken from clients, for resends
        self.error: SessionError | None = None  # why the input ended early: sent after finals
        self.close_code = CLOSE_NORMAL
        self.detached_at_s: float | None = None  # loop time the last connection dropped
        # The close code websockets sent when it refused the last connection's frame (invalid
        # UTF-8, bad framing, too large): that drop was the client's fault, and says so.
        self._refused_code: int | None = None
        self.finished = asyncio.Event()  # the pump is done: every final is out
        self.released = asyncio.Event()  # nobody can take the session back any more
        self._conn: ServerConnection | None = None
        self._config = config
        self._submit = submit
        self._metrics = metrics
        metrics.sessions_open.inc()  # until the stream is done (not while it is only held)
        self._done: Done | None = None
        self._dialect: Dialect = NativeDialect({})  # the attached connection's protocol
        self._send_lock = asyncio.Lock()  # one sender at a time: a resume's replay, or the pump
        self._expiry: asyncio.TimerHandle | None = None
        self._drop_final: asyncio.TimerHandle | None = None
        loop = asyncio.get_running_loop()
        self._speed = AudioSpeedLimit(
            max_speed=config.max_audio_speed, burst_s=config.audio_burst_s, now_s=loop.time()
        )
        self.wake = asyncio.Event()  # the session has work
        self.drained = asyncio.Event()  # a decode finished
        # Loop time of the attached connection's last audio; None while its reader waits
        # for decodes to catch up (no idle time counts then).
        self._last_audio_s: float | None = loop.time()
        # (stream audio ms after a frame, loop time it arrived): when a final's end arrived.
        self.arrivals: deque[tuple[int, float]] = deque()

    @property
    def resumable(self) -> bool:
        return self.resume_key is not None and not self.released.is_set()

    @property
    def final_code(self) -> int:
        """The close code the session ended with (journal, log)."""
        if self.error is not None:
            return close_code_for(self.error)  # the journal and the log speak protocol v1
        if self.detached_at_s is not None:
            return self._refused_code or CLOSE_DROPPED
        return self.close_code

    def end_for_shutdown(self, why: str = "the daemon is stopping; reconnect to resume") -> None:
        """The daemon is stopping, or another instance takes the session back: end the input
        now; the finals still come, then the `shutting_down` error (`why`) and 1001 (a
        journaled session can be taken back after the restart, or by the other instance)."""
        if self.error is None and not self.finished.is_set():
            self.error = ShuttingDownError(why)
        self._end_input()
        self._release()

    def final_latency_s(self, end_ms: int, now_s: float) -> float | None:
        """Time since the audio up to `end_ms` arrived; forgets arrivals before it (finals
        come in stream order)."""
        while self.arrivals and self.arrivals[0][0] < end_ms:
            self.arrivals.popleft()
        return now_s - self.arrivals[0][1] if self.arrivals else None

    def _arrival_wait_s(self, end_ms: int, now_s: float) -> float | None:
        """Time since the audio up to `end_ms` arrived (as `final_latency_s`, forgetting
        nothing: a final may still ask for earlier arrivals)."""
        at = bisect.bisect_left(self.arrivals, end_ms, key=lambda arrival: arrival[0])
        return now_s - self.arrivals[at][1] if at < len(self.arrivals) else None

    async def run(self) -> None:
        """Run the session's decodes, one at a time, until it is done, delivering what they
        produce to whichever connection is attached; then wait until it can no longer be
        resumed. An engine failure ends the session with its error."""
        try:
            await drive_session(self.session, self._submit, self.wake, self._deliver)
            await self._deliver()
        except SessionError as exc:
            self.error = exc
        except Exception:
            log.exception("session %s failed", self.id)
            self.error = SessionError("internal error")
        finally:
            self.finished.set()
            self._metrics.sessions_open.dec()
        if self.resume_key is None or self.error is not None:
            self._release()
        await self.released.wait()

    async def serve(
        self,
        conn: ServerConnection,
        dialect: Dialect,
        hello: Callable[[list[Final]], ServerMessage],
        *,
        resume: bool = False,
        since: int | None = None,
    ) -> None:
        """Feed the session from `conn` until it drops, another connection takes the session
        over, or the session ends (then close `conn` with the session's code); `dialect` is the
        protocol `conn` speaks. `hello` makes the first message from the finals replayed after
        it (a resume: the held ones from segment `since`)."""
        if self._conn is not None and self._conn.transport is not None:
            self._conn.transport.abort()  # half-open after a network drop: the new one wins
        self._cancel_timers()  # none may end the session while this one waits for the lock
        try:
            # Under the send lock: no live message overtakes the replay, none falls between.
            async with self._send_lock:
                self._conn = conn
                # Again: a connection taken over may have detached (and set them) meanwhile.
                self.detached_at_s = None
                self._refused_code = None
                self._cancel_timers()
                replay = self.held.replay(since) if resume else []
                self._dialect = dialect
                for message in [hello(replay), *replay]:
                    await _send(conn, dialect, message)
                if self.finished.is_set() and self.error is None and self._done is not None:
                    await _send(conn, dialect, self._done)  # it ended while the client was away
            self._last_audio_s = asyncio.get_running_loop().time()
            reader = asyncio.create_task(self._read(conn, dialect))
            idle = asyncio.create_task(self._watch_idle())
            finished = asyncio.create_task(self.finished.wait())
            try:
                await asyncio.wait({reader, idle, finished}, return_when=asyncio.FIRST_COMPLETED)
                error = (
                    reader.exception()
                    if reader.done()
                    else idle.exception()
                    if idle.done()
                    else None
                )
                if error is not None and not isinstance(error, SessionError | ConnectionClosed):
                    # A bug in reading this client's input: it ends this stream as the rules
                    # it broke would (finals, an `internal` error, 1011), never by leaving the
                    # session open and holding its slot.
                    log.error("session %s: reading its input failed", self.id, exc_info=error)
                    error = SessionError("internal error")
                if isinstance(error, SessionError) and self._done is not None:
                    # A rule broken once the stream was over (`done` on its way: audio sent
                    # right after `end`) changes nothing: `done`, then close 1000, never both
                    # `done` and an error.
                    await self.finished.wait()
                elif isinstance(error, SessionError):
                    reader.cancel()  # the input ends here, whichever task found the error
                    idle.cancel()
                    self.error = error
                    self._end_input()
                    await self.finished.wait()
                elif reader.done():
                    if self._conn is conn:
                        sent = error.sent if isinstance(error, ConnectionClosed) else None
                        if sent is not None and sent.code in _TRANSPORT_ERRORS:
                            self._refused_code = sent.code
                        self._detach()
                    return
            finally:
                reader.cancel()
                idle.cancel()
                finished.cancel()
        except ConnectionClosed:
            if self._conn is conn:
                self._detach()
            return
        if self._conn is not conn:
            return
        if self.error is not None:
            self._release()
            await send_error(conn, self.error, dialect)
        else:
            # `done` and the last finals may still be lost in flight: the session stays
            # resumable for `resume_s` (its held finals only; the stream has ended).
            self._linger()
            with contextlib.suppress(ConnectionClosed):
                await conn.close(self.close_code)

    # -- detaching ---------------------------------------------------------------------------

    def _detach(self) -> None:
        """The connection dropped without `end`: wait `resume_s` for the client (without
        resume, the session ends here), and finalise the open utterance after `drop_grace_s`
        unless the client is back by then."""
        self._conn = None
        self._cancel_timers()
        loop = asyncio.get_running_loop()
        self.detached_at_s = loop.time()
        if self.finished.is_set():
            if self.error is not None or self.resume_key is None:
                self._release()
        elif self.resume_key is None:
            self._end_input()
        elif self.session.state is SessionState.STREAMING:
            # A client back soon resends from `received_bytes`, so the utterance's audio goes
            # on where it stopped; finalised at once, the word said at the drop would be cut in
            # two, and a short half decodes to nothing (JFK's "what" was lost that way).
            self._drop_final = loop.call_later(self._config.drop_grace_s, self._finalize_dropped)
        if self.resume_key is not None and not self.released.is_set():
            self._expiry = loop.call_later(self._config.resume_s, self.let_go)

    def _finalize_dropped(self) -> None:
        """The client did not come back within `drop_grace_s`: the open utterance's final is
        decoded now, for the journal and for the client's replay if it comes back later."""
        if self._conn is None and self.session.state is SessionState.STREAMING:
            self.session.receive_control(Control.FINALIZE)
            self.wake.set()

    def _linger(self) -> None:
        if self.resume_key is None:
            self._release()
        elif not self.released.is_set():
            self._expiry = asyncio.get_running_loop().call_later(
                self._config.resume_s, self._release
            )

    def let_go(self) -> None:
        """Nobody resumed it in time (`resume_s`), or its address needs the slot: its input
        ends (the finals due still come, for the journal) and it can no longer be resumed."""
        if self._conn is None:
            self._end_input()
            self._release()

    def _end_input(self) -> None:
        if self.session.state is SessionState.STREAMING:
            self.session.receive_control(Control.END)
        self.wake.set()

    def _release(self) -> None:
        self._cancel_timers()
        self.released.set()

    def _cancel_timers(self) -> None:
        for timer in (self._expiry, self._drop_final):
            if timer is not None:
                timer.cancel()

    # -- input -------------------------------------------------------------------------------

    async def _read(self, conn: ServerConnection, dialect: Dialect) -> None:
        """Feed frames to the session until the client goes away or breaks a rule. Frames
        after `end` are still read: one that is not a keepalive or ack is a protocol
        violation, answered after the finals."""
        cfg = self._config
        session = self.session
        loop = asyncio.get_running_loop()
        bytes_per_s = session.params.sample_rate_hz * session.params.bytes_per_sample
        max_buffered_samples = round(cfg.max_buffered_s * SAMPLE_RATE_HZ)
        max_buffered_ms = round(cfg.max_buffered_s * 1000)
        unreported_audio_s = 0.0  # added to the audio counter once a second of it came
        try:
            while True:
                if (
                    session.state is SessionState.STREAMING
                    and session.buffered_samples > max_buffered_samples
                ):
                    # Decodes are behind: stop reading until they catch up, so the client's
                    # socket fills and it waits (TCP backpressure) instead of our memory
                    # growing. No idle time counts meanwhile.
                    self._last_audio_s = None
                    self.drained.clear()
                    await self.drained.wait()
                    self._last_audio_s = loop.time()
                    continue
                message = await conn.recv()
                if isinstance(message, str) and len(message) > dialect.max_text_bytes:
                    raise BadMessageError(
                        f"text frame of {len(message)} characters is not a control message"
                    )
                if isinstance(message, bytes) and len(message) > cfg.max_frame_bytes:
                    raise FrameTooLargeError(
                        f"frame of {len(message)} bytes; the limit is {cfg.max_frame_bytes}"
                    )
                received = dialect.receive(message)
                for reply in received.replies:
                    async with self._send_lock:
                        await conn.send(reply)
                control, audio = received.control, received.audio
                if received.language is not None:
                    # Dialects refuse what the model cannot caption in their protocol's way;
                    # this guards the batch (a code without a token fails every stream in it).
                    language = received.language
                    self._engine.check_can(language.code, candidates=language.candidates)
                    session.set_language(self._engine.stream_setting(language))
                if received.prompt is not None:
                    session.set_prompt(received.prompt)
                if received.ends_at_pauses is not None:
                    session.set_ends_at_pauses(received.ends_at_pauses)
                if received.turn is not None:
                    if received.turn.end_of_turn == "model" and not self._engine.judges_turns:
                        raise BadMessageError(TURN_MODEL_HINT)
                    session.set_turn(received.turn)
                if isinstance(control, Ack):
                    self.held.ack(control.segment)
                    continue
                if isinstance(self.error, ShuttingDownError):
                    continue  # the daemon ended the stream for its shutdown: late audio is dropped
                if audio:
                    now_s = self._last_audio_s = loop.time()
                    audio_s = len(audio) / bytes_per_s
                    self._speed.add(audio_s, now_s)
                    session.receive_audio(audio)
                    self.received_bytes += len(audio)
                    unreported_audio_s += audio_s
                    if unreported_audio_s >= 1.0:
                        self._metrics.audio_seconds.inc(unreported_audio_s)
                        unreported_audio_s = 0.0
                    audio_ms = session.audio_ms
                    if not self.arrivals or audio_ms - self.arrivals[-1][0] >= _ARRIVAL_STEP_MS:
                        self.arrivals.append((audio_ms, now_s))
                    horizon_ms = audio_ms - max_buffered_ms
                    while self.arrivals[0][0] < horizon_ms:
                        self.arrivals.popleft()  # no final can end there: no speech for a while
                if control is not None:
                    if not session.receive_control(control):
                        for reply in received.if_nothing_ends:
                            async with self._send_lock:
                                await conn.send(reply)
                    self.wake.set()
                elif session.needs_pump:
                    self.wake.set()
        finally:
            self._metrics.audio_seconds.inc(unreported_audio_s)

    async def _watch_idle(self) -> None:
        """Raise IdleTimeoutError once the attached client sent no audio for `idle_timeout_s`
        while streaming. One timer per stream, re-armed when it fires: a timeout around every
        recv() was 4 % of a worker's CPU at 600 streams."""
        idle_s = self._config.idle_timeout_s
        loop = asyncio.get_running_loop()
        while True:
            last_s = self._last_audio_s
            streaming = self.session.state is SessionState.STREAMING
            if last_s is None or not streaming:
                await asyncio.sleep(idle_s)
            elif (wait_s := last_s + idle_s - loop.time()) > 0:
                await asyncio.sleep(wait_s)
            else:
                raise IdleTimeoutError(
                    f"no audio for {idle_s:g} s (keepalives do not hold a session)"
                )

    # -- output ------------------------------------------------------------------------------

    async def _deliver(self) -> None:
        """Send what the session produced to the attached connection, if any. A final is
        journaled first and held until the client acknowledges it; other messages are only
        worth sending live. A stream that ends with an error gets its finals, then the error
        instead of `done`. A final the journal fails to write (disk full) is logged and the
        next one tries again (`SessionJournal.record_final`): captions keep flowing."""
        self.drained.set()
        for message in self.session.take_messages():
            self._observe(message)
            if isinstance(message, Done):
                self._done = message
                if self.error is not None:
                    continue
            async with self._send_lock:
                if isinstance(message, Final):
                    self.held.add(message)
                    if self.journal is not None:
                        await self.journal.record_final(message, end_byte=self._end_byte(message))
                if self._conn is not None:
                    with contextlib.suppress(ConnectionClosed):  # its reader sees the drop
                        await _send(self._conn, self._dialect, message)

    def _end_byte(self, final: Final) -> int:
        """Where `final` ends in the client's audio, in bytes: what it sent so far, less the
        audio the session has had since the final's end (a whole sample)."""
        params = self.session.params
        behind_ms = max(0, self.session.audio_ms - final.end_ms)
        behind_samples = behind_ms * params.sample_rate_hz // 1000
        return max(0, self.received_bytes - behind_samples * params.bytes_per_sample)

    def _observe(self, message: object) -> None:
        now_s = asyncio.get_running_loop().time()
        if isinstance(message, Partial):
            lag_ms = self.session.audio_ms - message.end_ms
            self._metrics.partial_lag_seconds.observe(max(0, lag_ms) / 1000)
            # Admission counts wall time since the partial's audio arrived, not audio: a
            # client sending faster than real time is ahead, not behind.
            waited_s = self._arrival_wait_s(message.end_ms, now_s)
            if waited_s is not None:
                self._load.observe(now_s, 1000 * waited_s)
        elif isinstance(message, Final):
            latency_s = self.final_latency_s(message.end_ms, now_s)
            # One decoded while the client is away waited for it (drop_grace_s), not for us.
            if latency_s is not None and self.detached_at_s is None:
                self._metrics.final_latency_seconds.observe(latency_s)
