"""The websocket daemon: routing, one handler per connection, error → close-code mapping.

A thin asyncio shell on the event-loop thread around the Sans-I/O StreamSession. Requests are
checked before the upgrade (access.py: Origin, token). Per stream connection two coroutines
share the session: the reader feeds it frames within the stream's limits (frame sizes, idle
time, audio speed, buffered audio), the pump sends its decode requests to the
InferenceScheduler (engine thread) one at a time and forwards the messages it produces, each
final journaled first when a journal is configured. A client error ends the stream's input, its
finals are still delivered, then the `error` and the close code. Every error that ends a session
is mapped to its close code here, in `CLOSE_CODES`, and nowhere else.
"""

from __future__ import annotations

import asyncio
import contextlib
import http
import logging
import ssl
import uuid
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qsl, urlsplit

from websockets.asyncio.server import Server, ServerConnection, serve
from websockets.exceptions import ConnectionClosed
from websockets.frames import CloseCode
from websockets.http11 import Request, Response
from websockets.protocol import State

from captiond import SAMPLE_RATE_HZ
from captiond.access import ConnectionsPerIp, check_origin, check_token
from captiond.config import Config
from captiond.errors import (
    BadAudioError,
    BadMessageError,
    EngineFailedError,
    FrameTooLargeError,
    IdleTimeoutError,
    OverloadedError,
    RateLimitedError,
    RequestRejectedError,
    SessionError,
    SourceNotFoundError,
)
from captiond.journal import Journal, JournalError, SessionJournal, open_journal
from captiond.limits import AudioSpeedLimit
from captiond.metrics import Metrics
from captiond.protocol import (
    Control,
    Done,
    Error,
    Final,
    Partial,
    Ready,
    parse_control,
    parse_stream_params,
)
from captiond.scheduler import InferenceScheduler, drive_session
from captiond.session import SessionState, StreamSession
from captiond.sources import AudioInput, daemon_sources, microphone
from captiond.vad import Vad, webrtc_vad
from captiond.web import static_response

log = logging.getLogger(__name__)

CLOSE_NORMAL = 1000
CLOSE_GOING_AWAY = 1001
CLOSE_INTERNAL = 1011
CLOSE_CODES: dict[type[SessionError], int] = {
    BadAudioError: 1007,
    BadMessageError: 1008,
    SourceNotFoundError: 1008,
    FrameTooLargeError: 1009,
    EngineFailedError: 1011,
    OverloadedError: 1013,
    RateLimitedError: 4029,
    IdleTimeoutError: 4408,
}
# The `error` code sent before websockets' own close, for what it refuses itself: a frame over
# the hard size limit, invalid UTF-8 in a text frame, a frame no websocket may send.
_TRANSPORT_ERRORS: dict[int, str] = {
    CloseCode.MESSAGE_TOO_BIG: FrameTooLargeError.code,
    CloseCode.INVALID_DATA: BadMessageError.code,
    CloseCode.PROTOCOL_ERROR: BadMessageError.code,
}
# websockets itself refuses frames this many times over our limit, without reading them; up to
# there, a too-large frame is ours to answer, after the stream's finals.
_HARD_LIMIT_FACTOR = 4
# Frames websockets queues per connection before it stops reading the socket.
_MAX_QUEUE_FRAMES = 4
# Control messages are a few dozen bytes; a text frame this long is not one.
_MAX_CONTROL_BYTES = 4_096
# How long a closing handshake may take before the connection is dropped.
_CLOSE_TIMEOUT_S = 2.0


def close_code_for(error: SessionError) -> int:
    for cls in type(error).__mro__:
        if cls in CLOSE_CODES:
            return CLOSE_CODES[cls]
    return CLOSE_INTERNAL


class _Connection(ServerConnection):
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


@dataclass(slots=True)
class _Live:
    """A stream connection: its session, and what its reader and pump share."""

    session: StreamSession
    wake: asyncio.Event = field(default_factory=asyncio.Event)  # the session has work
    drained: asyncio.Event = field(default_factory=asyncio.Event)  # a decode finished
    journal: SessionJournal | None = None
    error: SessionError | None = None  # why the input ended early: sent after the finals
    close_code: int = CLOSE_NORMAL
    # (stream audio ms after a frame, loop time it arrived): when a final's end was received.
    arrivals: deque[tuple[int, float]] = field(default_factory=deque)

    def final_latency_s(self, end_ms: int, now_s: float) -> float | None:
        """Time since the audio up to `end_ms` arrived; forgets arrivals before it (finals
        come in stream order)."""
        while self.arrivals and self.arrivals[0][0] < end_ms:
            self.arrivals.popleft()
        return now_s - self.arrivals[0][1] if self.arrivals else None


class Daemon:
    """Serves protocol v1 with one scheduler and engine shared by every session."""

    def __init__(
        self,
        config: Config,
        scheduler: InferenceScheduler,
        vad_factory: Callable[[], Vad] | None = None,
        audio_input: AudioInput = microphone,
    ) -> None:
        self.config = config
        self.scheduler = scheduler
        self._vad_factory = vad_factory or (lambda: webrtc_vad(config.vad.aggressiveness))
        self.sources = daemon_sources(config, scheduler, self._vad_factory, audio_input)
        self._live: dict[str, _Live] = {}
        self._per_ip = ConnectionsPerIp(config.server.max_sessions_per_ip)
        self._journal: Journal | None = open_journal(config.journal)
        self.metrics: Metrics = scheduler.metrics
        self._server: Server | None = None
        self.sessions_total = 0

    @property
    def sessions_open(self) -> int:
        return len(self._live)

    @property
    def port(self) -> int:
        assert self._server is not None, "not started"
        sock = next(iter(self._server.sockets))
        port: int = sock.getsockname()[1]
        return port

    async def start(self) -> None:
        cfg = self.config.server
        if self._journal is not None:
            self._journal.start()
        self._server = await serve(
            self._handle,
            cfg.host,
            cfg.port,
            process_request=self._process_request,
            create_connection=_Connection,
            max_size=cfg.max_frame_bytes * _HARD_LIMIT_FACTOR,
            max_queue=_MAX_QUEUE_FRAMES,
            close_timeout=_CLOSE_TIMEOUT_S,
            ssl=self._ssl_context(),
            server_header="captiond",
        )
        log.info("listening on %s:%d", cfg.host, self.port)
        for source in self.sources.values():
            source.start(self._journal)

    def _ssl_context(self) -> ssl.SSLContext | None:
        cfg = self.config.server
        if not cfg.tls_cert:
            return None
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(cfg.tls_cert, cfg.tls_key or None)
        return context

    async def shutdown(self) -> None:
        """Stop accepting, finalize every open stream (last finals sent) and close it with
        1001; whatever is still open after `[server] drain_timeout_s` is cut off."""
        if self._server is None:
            return
        self._server.close(close_connections=False)
        for live in list(self._live.values()):
            live.close_code = CLOSE_GOING_AWAY
            if live.session.state is SessionState.STREAMING:
                live.session.receive_control(Control.END)
            live.wake.set()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self.config.server.drain_timeout_s):
                await asyncio.gather(*(source.stop() for source in self.sources.values()))
                while self._live:
                    await asyncio.sleep(0.05)
                self._server.close(close_connections=True)  # viewers, stragglers: 1001
                await self._server.wait_closed()
        for conn in self._server.connections:  # a client that never completes its close
            if conn.transport is not None:
                conn.transport.abort()
        await self._server.wait_closed()
        if self._journal is not None:
            self._journal.stop()

    # -- HTTP side ---------------------------------------------------------------------------

    def _process_request(self, connection: ServerConnection, request: Request) -> Response | None:
        url = urlsplit(request.path)
        if url.path == "/healthz":
            return connection.respond(http.HTTPStatus.OK, "ok\n")
        if url.path in ("/v1/stream", "/v1/captions", "/metrics"):
            try:
                check_origin(
                    request.headers.get("Origin"),
                    request.headers.get("Host"),
                    self.config.server.allowed_origins,
                )
                check_token(
                    self.config.auth.token,
                    dict(parse_qsl(url.query)),
                    request.headers.get("Authorization"),
                )
            except RequestRejectedError as exc:
                log.info("refused %s from %s: %s", url.path, connection.remote_address, exc)
                self.metrics.refused.labels(reason=http.HTTPStatus(exc.status).phrase).inc()
                response = connection.respond(http.HTTPStatus(exc.status), f"{exc}\n")
                if exc.status == http.HTTPStatus.UNAUTHORIZED:
                    response.headers["WWW-Authenticate"] = 'Bearer realm="captiond"'
                return response
            if url.path == "/metrics":
                body, content_type = self.metrics.render()
                response = connection.respond(http.HTTPStatus.OK, body)
                response.headers["Content-Type"] = content_type
                return response
            if "upgrade" not in request.headers.get("Connection", "").lower():
                return connection.respond(
                    http.HTTPStatus.UPGRADE_REQUIRED, f"{url.path} is a websocket endpoint\n"
                )
            return None
        return static_response(url.path, request.headers) or connection.respond(
            http.HTTPStatus.NOT_FOUND, "not found\n"
        )

    # -- websocket side ----------------------------------------------------------------------

    async def _handle(self, conn: ServerConnection) -> None:
        assert conn.request is not None
        url = urlsplit(conn.request.path)
        query = dict(parse_qsl(url.query))
        ip = str(conn.remote_address[0]) if conn.remote_address else "?"
        if not self._per_ip.try_open(ip):
            self.metrics.refused.labels(reason="connections per IP").inc()
            limit = self.config.server.max_sessions_per_ip
            await self._fail(conn, OverloadedError(f"{limit} connections from {ip} are open"))
            return
        try:
            if url.path == "/v1/captions":
                await self._watch(conn, query.get("source", ""))
            else:
                await self._stream(conn, query)
        except SessionError as exc:
            await self._fail(conn, exc)
        finally:
            self._per_ip.close(ip)

    async def _fail(self, conn: ServerConnection, exc: SessionError) -> None:
        code = close_code_for(exc)
        log.info("session error %s (close %d): %s", exc.code, code, exc)
        with contextlib.suppress(ConnectionClosed):
            await conn.send(Error(code=exc.code, message=str(exc)).to_json())
            await conn.close(code, exc.code)

    async def _watch(self, conn: ServerConnection, name: str) -> None:
        """A viewer of a daemon-side source: its feed until it leaves or the daemon stops."""
        source = self.sources.get(name)
        if source is None:
            known = ", ".join(sorted(self.sources)) or "none configured"
            raise SourceNotFoundError(f"no daemon-side source named {name!r} (sources: {known})")
        log.debug("open viewer source=%s peer=%s", name, conn.remote_address)
        with contextlib.suppress(ConnectionClosed):
            await source.broadcast.watch(conn)
            await conn.close(CLOSE_GOING_AWAY)
        log.debug("close viewer source=%s peer=%s", name, conn.remote_address)

    async def _stream(self, conn: ServerConnection, query: dict[str, str]) -> None:
        if len(self._live) >= self.config.server.max_sessions:
            self.metrics.refused.labels(reason="session limit").inc()
            raise OverloadedError(
                f"session limit reached ({self.config.server.max_sessions}); try again later"
            )
        params = parse_stream_params(query, self.config.stream.language)
        session = StreamSession(config=self.config, vad=self._vad_factory(), params=params)
        session_id = uuid.uuid4().hex[:12]
        live = _Live(session=session)
        engine = self.scheduler.engine
        if self._journal is not None:
            live.journal = self._journal.open_session(
                session=session_id,
                peer=_peer(conn),
                source=None,
                language=params.language,
                model=engine.model_name,
                engine=engine.name,
            )
        self._live[session_id] = live
        self.sessions_total += 1
        self.metrics.sessions.inc()
        self.metrics.sessions_open.inc()
        try:
            await conn.send(
                Ready(
                    session=session_id,
                    sample_rate=SAMPLE_RATE_HZ,
                    model=engine.model_name,
                    engine=engine.name,
                ).to_json()
            )
            await self._run_session(conn, live)
        except SessionError as exc:
            live.error = exc
        except ConnectionClosed:
            pass
        finally:
            del self._live[session_id]
            code = close_code_for(live.error) if live.error else live.close_code
            self.metrics.sessions_open.dec()
            self.metrics.closes.labels(code=str(code)).inc()
            log.info(
                "session %s peer=%s language=%s audio_s=%.1f finals=%d close=%d",
                session_id,
                _peer(conn),
                params.language,
                session.audio_ms / 1000,
                session.segments,
                code,
            )
            if live.journal is not None:
                try:
                    await live.journal.close(
                        audio_ms=session.audio_ms, segments=session.segments, close_code=code
                    )
                except JournalError as exc:
                    log.error("session %s: journal end record failed: %s", session_id, exc)
        if live.error is not None:
            await self._fail(conn, live.error)
        else:
            with contextlib.suppress(ConnectionClosed):
                await conn.close(live.close_code)

    async def _run_session(self, conn: ServerConnection, live: _Live) -> None:
        """Reader and pump side by side until the session is done. A client error ends the
        input, and the finals of the audio received so far are still delivered before it; an
        engine failure, or a vanished client, ends both at once."""
        reader = asyncio.create_task(self._read(conn, live))
        pump = asyncio.create_task(self._pump(conn, live))
        try:
            await asyncio.wait({reader, pump}, return_when=asyncio.FIRST_COMPLETED)
            if reader.done() and not pump.done():
                error = reader.exception()
                if isinstance(error, SessionError):
                    live.error = error
                    if live.session.state is SessionState.STREAMING:
                        live.session.receive_control(Control.END)
                    live.wake.set()
                elif error is not None:
                    raise error
            await pump
        finally:
            reader.cancel()
            pump.cancel()

    async def _read(self, conn: ServerConnection, live: _Live) -> None:
        """Feed frames to the session until the client goes away or breaks a rule. Frames
        after `end` are still read: one that is not a keepalive is a protocol violation,
        answered after the finals."""
        cfg = self.config.server
        session = live.session
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
                live.drained.clear()
                await live.drained.wait()
                last_audio_s = loop.time()
                continue
            try:
                async with asyncio.timeout_at(
                    last_audio_s + cfg.idle_timeout_s if streaming else None
                ):
                    message = await conn.recv()
            except TimeoutError:
                raise IdleTimeoutError(
                    f"no audio for {cfg.idle_timeout_s:g} s (keepalives do not hold a session)"
                ) from None
            if live.close_code == CLOSE_GOING_AWAY and session.state is not SessionState.STREAMING:
                continue  # the daemon ended the stream for its shutdown: late audio is dropped
            if isinstance(message, bytes):
                if len(message) > cfg.max_frame_bytes:
                    raise FrameTooLargeError(
                        f"frame of {len(message)} bytes; the limit is {cfg.max_frame_bytes}"
                    )
                last_audio_s = loop.time()
                speed.add(len(message) / bytes_per_s, last_audio_s)
                session.receive_audio(message)
                self.metrics.audio_seconds.inc(len(message) / bytes_per_s)
                live.arrivals.append((session.audio_ms, last_audio_s))
                horizon_ms = session.audio_ms - round(cfg.max_buffered_s * 1000)
                while live.arrivals[0][0] < horizon_ms:
                    live.arrivals.popleft()  # no final can end there: no speech for a while
            else:
                if len(message) > _MAX_CONTROL_BYTES:
                    raise BadMessageError(
                        f"text frame of {len(message)} characters is not a control message"
                    )
                session.receive_control(parse_control(message))
            live.wake.set()

    async def _pump(self, conn: ServerConnection, live: _Live) -> None:
        """Run the session's decodes one at a time and deliver what they produce."""

        async def deliver() -> None:
            live.drained.set()
            await self._deliver(conn, live)

        await drive_session(live.session, self.scheduler.submit, live.wake, deliver)
        await self._deliver(conn, live)

    async def _deliver(self, conn: ServerConnection, live: _Live) -> None:
        """Send what the session produced; a final is journaled before it is sent. A stream
        that ends with an error gets its finals, then the error instead of `done`. A journal
        that fails (disk full) is logged and given up for the session: captions keep flowing."""
        for message in live.session.take_messages():
            self._observe(live, message)
            if isinstance(message, Done) and live.error is not None:
                continue
            if isinstance(message, Final) and live.journal is not None:
                try:
                    await live.journal.append_final(message)
                except JournalError as exc:
                    log.error("journal failed, the session is no longer journaled: %s", exc)
                    live.journal = None
            await conn.send(message.to_json())

    def _observe(self, live: _Live, message: object) -> None:
        now_s = asyncio.get_running_loop().time()
        if isinstance(message, Partial):
            lag_ms = live.session.audio_ms - message.end_ms
            self.metrics.partial_lag_seconds.observe(max(0, lag_ms) / 1000)
        elif isinstance(message, Final):
            latency_s = live.final_latency_s(message.end_ms, now_s)
            if latency_s is not None:
                self.metrics.final_latency_seconds.observe(latency_s)


def _peer(conn: ServerConnection) -> str:
    address = conn.remote_address
    return f"{address[0]}:{address[1]}" if address else "?"


async def run_daemon(
    config: Config,
    scheduler: InferenceScheduler,
    on_ready: Callable[[Daemon], Awaitable[None]] | None = None,
    stop: asyncio.Event | None = None,
) -> None:
    """Serve until `stop` is set (forever when None), then shut down cleanly."""
    daemon = Daemon(config, scheduler)
    await daemon.start()
    try:
        if on_ready is not None:
            await on_ready(daemon)
        await (stop or asyncio.Event()).wait()
    finally:
        await daemon.shutdown()
