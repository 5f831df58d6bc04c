"""The websocket daemon: routing, one handler per connection, error → close-code mapping.

A thin asyncio shell on the event-loop thread around the Sans-I/O StreamSession. Per stream
connection two coroutines share the session: the reader feeds it frames, the pump sends its
decode requests to the InferenceScheduler (engine thread) one at a time and forwards the
messages it produces. Every error that ends a session is mapped to its close code here, in
`CLOSE_CODES`, and nowhere else.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import http
import logging
import ssl
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from urllib.parse import parse_qsl, urlsplit

from websockets.asyncio.server import Server, ServerConnection, serve
from websockets.datastructures import Headers
from websockets.exceptions import ConnectionClosed
from websockets.http11 import Request, Response

from captiond import SAMPLE_RATE_HZ
from captiond.config import Config
from captiond.errors import (
    BadAudioError,
    BadMessageError,
    EngineFailedError,
    FrameTooLargeError,
    OverloadedError,
    SessionError,
    SourceNotFoundError,
    UnauthorizedError,
)
from captiond.protocol import Control, Error, Ready, parse_control, parse_stream_params
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
    UnauthorizedError: 4401,
}
# websockets itself drops frames this many times over our limit, without reading them.
_HARD_LIMIT_FACTOR = 4


def close_code_for(error: SessionError) -> int:
    for cls in type(error).__mro__:
        if cls in CLOSE_CODES:
            return CLOSE_CODES[cls]
    return CLOSE_INTERNAL


@dataclass(slots=True)
class _Live:
    """A stream connection the daemon may have to finalize at shutdown."""

    session: StreamSession
    wake: asyncio.Event
    close_code: int = CLOSE_NORMAL


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
        self._server = await serve(
            self._handle,
            cfg.host,
            cfg.port,
            process_request=self._process_request,
            max_size=cfg.max_frame_bytes * _HARD_LIMIT_FACTOR,
            ssl=self._ssl_context(),
            server_header="captiond",
        )
        log.info("listening on %s:%d", cfg.host, self.port)
        for source in self.sources.values():
            source.start()

    def _ssl_context(self) -> ssl.SSLContext | None:
        cfg = self.config.server
        if not cfg.tls_cert:
            return None
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(cfg.tls_cert, cfg.tls_key or None)
        return context

    async def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop accepting, finalize every open stream (last finals sent), close them with 1001."""
        if self._server is None:
            return
        self._server.close(close_connections=False)
        for live in list(self._live.values()):
            live.close_code = CLOSE_GOING_AWAY
            if live.session.state is SessionState.STREAMING:
                live.session.receive_control(Control.END)
            live.wake.set()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                await asyncio.gather(*(source.stop() for source in self.sources.values()))
                while self._live:
                    await asyncio.sleep(0.05)
        self._server.close(close_connections=True)
        await self._server.wait_closed()

    # -- HTTP side ---------------------------------------------------------------------------

    def _process_request(self, connection: ServerConnection, request: Request) -> Response | None:
        path = urlsplit(request.path).path
        if path == "/healthz":
            return connection.respond(http.HTTPStatus.OK, "ok\n")
        if path in ("/v1/stream", "/v1/captions"):
            if "upgrade" not in request.headers.get("Connection", "").lower():
                return connection.respond(
                    http.HTTPStatus.UPGRADE_REQUIRED, f"{path} is a websocket endpoint\n"
                )
            return None
        return static_response(path, request.headers) or connection.respond(
            http.HTTPStatus.NOT_FOUND, "not found\n"
        )

    # -- websocket side ----------------------------------------------------------------------

    async def _handle(self, conn: ServerConnection) -> None:
        assert conn.request is not None
        url = urlsplit(conn.request.path)
        query = dict(parse_qsl(url.query))
        try:
            self._authorize(query, conn.request.headers)
            if url.path == "/v1/captions":
                await self._watch(conn, query.get("source", ""))
                return
            await self._stream(conn, query)
        except SessionError as exc:
            await self._fail(conn, exc)

    def _authorize(self, query: dict[str, str], headers: Headers) -> None:
        token = self.config.auth.token
        if not token:
            return
        bearer = headers.get("Authorization", "").removeprefix("Bearer ").strip()
        given = query.get("token") or bearer
        if not hmac.compare_digest(given.encode(), token.encode()):
            raise UnauthorizedError("missing or wrong token")

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
        log.info("open viewer source=%s peer=%s", name, conn.remote_address)
        with contextlib.suppress(ConnectionClosed):
            await source.broadcast.watch(conn)
            await conn.close(CLOSE_GOING_AWAY)
        log.info("close viewer source=%s peer=%s", name, conn.remote_address)

    async def _stream(self, conn: ServerConnection, query: dict[str, str]) -> None:
        if len(self._live) >= self.config.server.max_sessions:
            raise OverloadedError(
                f"session limit reached ({self.config.server.max_sessions}); try again later"
            )
        params = parse_stream_params(query, self.config.stream.language)
        session = StreamSession(config=self.config, vad=self._vad_factory(), params=params)
        session_id = uuid.uuid4().hex[:12]
        live = _Live(session=session, wake=asyncio.Event())
        self._live[session_id] = live
        self.sessions_total += 1
        engine = self.scheduler.engine
        log.info("open session=%s peer=%s params=%s", session_id, conn.remote_address, params)
        error: SessionError | None = None
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
            error = exc
        except ConnectionClosed:
            pass
        finally:
            del self._live[session_id]
            log.info(
                "close session=%s audio_ms=%d segments=%d state=%s",
                session_id,
                session.audio_ms,
                session.segments,
                session.state.value,
            )
        if error is not None:
            await self._fail(conn, error)

    async def _run_session(self, conn: ServerConnection, live: _Live) -> None:
        """Reader and pump side by side; the first to fail, or a vanished client, ends both."""
        reader = asyncio.create_task(self._read(conn, live))
        pump = asyncio.create_task(self._pump(conn, live))
        try:
            done, _ = await asyncio.wait({reader, pump}, return_when=asyncio.FIRST_COMPLETED)
            if pump in done and pump.exception() is None:
                await reader  # the pump closed the connection: the reader ends with it
            for task in done:
                task.result()
        finally:
            reader.cancel()
            pump.cancel()

    async def _read(self, conn: ServerConnection, live: _Live) -> None:
        """Feed frames to the session until the stream is done or the client goes away."""
        limit = self.config.server.max_frame_bytes
        session = live.session
        async for message in conn:
            if session.done:
                break
            if live.close_code == CLOSE_GOING_AWAY and session.state is not SessionState.STREAMING:
                continue  # the daemon ended the stream for its shutdown: late audio is dropped
            if isinstance(message, bytes):
                if len(message) > limit:
                    raise FrameTooLargeError(f"frame of {len(message)} bytes; the limit is {limit}")
                session.receive_audio(message)
            else:
                session.receive_control(parse_control(message))
            await _send_all(conn, session)
            live.wake.set()
            if session.done:
                break

    async def _pump(self, conn: ServerConnection, live: _Live) -> None:
        """Run the session's decodes one at a time; close the connection once it is done."""
        await drive_session(
            live.session, self.scheduler.submit, live.wake, lambda: _send_all(conn, live.session)
        )
        await _send_all(conn, live.session)
        await conn.close(live.close_code)


async def _send_all(conn: ServerConnection, session: StreamSession) -> None:
    for message in session.take_messages():
        await conn.send(message.to_json())


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
