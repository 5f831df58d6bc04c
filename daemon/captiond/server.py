"""The websocket daemon: routing, one handler per connection, error → close-code mapping.

A thin asyncio shell on the event-loop thread around the Sans-I/O StreamSession. Requests are
checked before the upgrade (access.py: Origin, token); connections per IP and the session limit
right after it. A stream connection's session runs in connection.py (reader, pump, journal,
limits); its error, if any, comes back here. Every error that ends a session is mapped to its
close code here, in `CLOSE_CODES`, and nowhere else.
"""

from __future__ import annotations

import asyncio
import contextlib
import http
import logging
import ssl
import uuid
from collections.abc import Awaitable, Callable
from urllib.parse import parse_qsl, urlsplit

from websockets.asyncio.server import Server, ServerConnection, serve
from websockets.exceptions import ConnectionClosed
from websockets.http11 import Request, Response

from captiond import SAMPLE_RATE_HZ
from captiond.access import ConnectionsPerIp, check_origin, check_token
from captiond.config import Config
from captiond.connection import CLOSE_GOING_AWAY, AnsweringConnection, StreamConnection
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
from captiond.journal import Journal, JournalError, open_journal
from captiond.metrics import Metrics
from captiond.protocol import Error, Ready, parse_stream_params
from captiond.scheduler import InferenceScheduler
from captiond.session import StreamSession
from captiond.sources import AudioInput, daemon_sources, microphone
from captiond.vad import Vad, webrtc_vad
from captiond.web import static_response

log = logging.getLogger(__name__)

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
# websockets itself refuses frames this many times over our limit, without reading them; up to
# there, a too-large frame is ours to answer, after the stream's finals.
_HARD_LIMIT_FACTOR = 4
# Frames websockets queues per connection before it stops reading the socket.
_MAX_QUEUE_FRAMES = 4
# How long a closing handshake may take before the connection is dropped.
_CLOSE_TIMEOUT_S = 2.0


def close_code_for(error: SessionError) -> int:
    for cls in type(error).__mro__:
        if cls in CLOSE_CODES:
            return CLOSE_CODES[cls]
    return CLOSE_INTERNAL


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
        self._live: dict[str, StreamConnection] = {}
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
            create_connection=AnsweringConnection,
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
            live.end_for_shutdown()
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
        engine = self.scheduler.engine
        journal = None
        if self._journal is not None:
            journal = self._journal.open_session(
                session=session_id,
                peer=_peer(conn),
                source=None,
                language=params.language,
                model=engine.model_name,
                engine=engine.name,
            )
        live = StreamConnection(
            conn=conn,
            session=session,
            config=self.config.server,
            submit=self.scheduler.submit,
            metrics=self.metrics,
            journal=journal,
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
            await live.run()
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
