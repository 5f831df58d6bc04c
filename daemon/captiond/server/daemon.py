"""The websocket daemon: routing, one handler per connection, resume.

A thin asyncio shell on the event-loop thread around the Sans-I/O StreamSession. It runs as the
whole daemon (listening itself, the engine in the same process), or as one worker process of
several (`slot` set: the main process hands it accepted connections, see workers/pool.py, and its
decodes go to the main process's engine core). A request head websockets cannot parse is
answered by server/handshake.py; the rest are checked before the upgrade (server/access.py: Origin,
token); connections per IP and the session limit right after it. A stream's session lives in a
LiveStream (server/connection.py: reader, pump, journal, limits, close codes) that outlives its
connection: this module opens it, gives it back to a client that presents its resume token
(from memory, or after a restart from the journal), and writes its log line and journal end
record when it is over. A resume of a session another live instance holds asks that one to let
it go (journal/handover.py), and this one, holding sessions, lets go of those others ask for.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import socket
import ssl
import time
import uuid
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from urllib.parse import urlsplit

import websockets.http11
from websockets.asyncio.server import Server, ServerConnection
from websockets.exceptions import ConnectionClosed, InvalidHandshake

from captiond.config import Config, ServerConfig
from captiond.decoding.gate import GatedDecoder
from captiond.decoding.scheduler import HEALTHY_WITHIN_S, Decoder
from captiond.dialects import Dialect
from captiond.dialects.endpoints import ENDPOINTS
from captiond.dialects.native import NativeDialect, Query, ResumeRequest, parse_resume, parse_since
from captiond.engines.models import SPEAKER_MODEL_HINT, TURN_MODEL_HINT
from captiond.engines.rules import token_counter
from captiond.engines.speech_gate import applies
from captiond.errors import (
    CLOSE_GOING_AWAY,
    BadMessageError,
    ConfigError,
    OverloadedError,
    ResumeFailedError,
    SessionError,
    ShuttingDownError,
    SourceNotFoundError,
)
from captiond.journal import handover
from captiond.journal.reader import JournalSession, find_session
from captiond.journal.writer import (
    JOURNAL_FILE_NAME,
    Journal,
    JournalError,
    Ownership,
    SessionOwnedError,
    file_safe_id,
    open_journal,
)
from captiond.ops.memory import trim_after_peaks
from captiond.ops.metrics import Metrics
from captiond.server.access import ConnectionsPerIp, client_address
from captiond.server.connection import AnsweringConnection, LiveStream, send_error
from captiond.server.handshake import AnsweringProtocol
from captiond.server.http import HttpAnswers
from captiond.server.load import LoadWatch, agent_reply, serve_agent, watch_loop
from captiond.server.resume import MAX_HELD_FINALS, ResumeKey, session_id, session_of_token
from captiond.server.routing import WorkerSlot
from captiond.sources.capture import microphone
from captiond.sources.daemon import AudioInput, daemon_sources
from captiond.streaming.events import Final, Ready, Resumed, StreamParams
from captiond.streaming.session import SessionState, StreamSession
from captiond.streaming.utterance import StreamOrigin
from captiond.streaming.vad import Vad, webrtc_vad
from captiond.whisper import SAMPLE_RATE_HZ

log = logging.getLogger(__name__)

# websockets itself refuses frames this many times over our limit, without reading them; up to
# there, a too-large frame is ours to answer, after the stream's finals.
_HARD_LIMIT_FACTOR = 4
# Frames websockets queues per connection before it stops reading the socket.
_MAX_QUEUE_FRAMES = 4
# How long a closing handshake may take before the connection is dropped.
_CLOSE_TIMEOUT_S = 2.0
# How long the opening handshake (TLS included) may take.
_OPEN_TIMEOUT_S = 10.0
# The longest request line websockets reads (its WEBSOCKETS_MAX_LINE_LENGTH, 8 KiB unless
# set, read at each request): a `?prompt=` of MAX_PROMPT_CHARS in a script of 3- or 4-byte
# characters is 9-12 kB URL-encoded, and was cut off there unanswered.
websockets.http11.MAX_LINE_LENGTH = max(websockets.http11.MAX_LINE_LENGTH, 16 * 1024)
# Websocket keepalive pings, and how long a pong may take before the connection is dropped.
_PING_INTERVAL_S = 20.0
_PING_TIMEOUT_S = 20.0


class _HandedServer(Server):
    """A worker's server: it never listens, connections are handed to it, so it serves (answers
    handshakes) until it is closed."""

    def is_serving(self) -> bool:
        return self.close_task is None


class Daemon:
    """Serves every endpoint with one decoder (engine) shared by every session."""

    def __init__(
        self,
        config: Config,
        decoder: Decoder,
        vad_factory: Callable[[], Vad] | None = None,
        audio_input: AudioInput = microphone,
        *,
        slot: WorkerSlot | None = None,
    ) -> None:
        self.config = config
        self.decoder: Decoder = (
            GatedDecoder(decoder) if applies(config.engine, decoder.engine_info.name) else decoder
        )
        self._slot = slot
        self._vad_factory = vad_factory or (lambda: webrtc_vad(config.vad.aggressiveness))
        self.sources = (
            daemon_sources(config, self.decoder, self._vad_factory, audio_input)
            if slot is None or slot.runs_sources
            else {}
        )
        self._live: dict[str, LiveStream] = {}  # by session id, detached ones too
        self._tasks: set[asyncio.Task[None]] = set()
        self._trimmer: asyncio.Task[None] | None = None
        self._loop_watch: asyncio.Task[None] | None = None
        self._handovers: asyncio.Task[None] | None = None
        self._max_sessions = self._share(config.server.max_sessions)
        self._per_ip = ConnectionsPerIp(self._share(config.server.max_sessions_per_ip))
        # Every worker writes its own sessions' files; one of them applies retention.
        self._journal: Journal | None = open_journal(
            config.journal, retain=slot is None or slot.index == 0
        )
        self.metrics: Metrics = decoder.metrics
        self.http = HttpAnswers(
            config,
            self.metrics,
            unhealthy=self._unhealthy,
            not_ready=self._not_ready,
            check_query=self._stream_params,
        )
        self._server: Server | None = None
        self._taking_back: dict[str, _TakingBack] = {}  # by session id
        self.load = LoadWatch(config.server.max_lag_ms, config.server.max_loop_busy)
        self._agent: asyncio.Server | None = None
        # Set when the shutdown begins: /readyz fails and new connections are refused, while
        # the live streams get their last finals (`shutdown`).
        self.draining = False
        self.sessions_total = 0

    def _share(self, limit: int) -> int:
        return self._slot.share(limit) if self._slot else limit

    def status_line(self) -> str:
        """One line for systemd's STATUS=."""
        line = f"{self.sessions_open} streams open, {self.sessions_total} served"
        return f"{line}; sources: {sources}" if (sources := self.sources_status()) else line

    def sources_status(self) -> str:
        """The sources' part of the STATUS= line ("" without sources); with workers, the
        worker that runs them reports it to the main process's line."""
        return ", ".join(
            f"{s.name} {s.state} ({s.broadcast.viewers} viewers)" for s in self.sources.values()
        )

    def healthy(self, within_s: float) -> bool:
        return time.monotonic() - self.decoder.stats.heartbeat_monotonic < within_s

    def _unhealthy(self) -> str:
        """Why /healthz fails now ("": it does not). With workers the pool answers /healthz
        (workers/pool.py): a worker's engine is remote."""
        if self._slot is None and not self.healthy(HEALTHY_WITHIN_S):
            return f"no heartbeat from the engine for over {HEALTHY_WITHIN_S:g} s"
        return ""

    def _not_ready(self) -> str:
        """Why /readyz fails now ("": this instance takes new streams): the engine is not
        alive, or the daemon drains for its shutdown. A full daemon is still ready: a load
        balancer caps each instance's connections itself (deploy/haproxy), and the sessions it
        holds must still be able to come back to it."""
        if self.draining:
            return "draining: no new streams"
        return self._unhealthy()

    @property
    def sessions_open(self) -> int:
        """Streams not yet done (a done one may be held a while for a resume: not counted)."""
        return sum(not live.finished.is_set() for live in self._live.values())

    @property
    def port(self) -> int:
        assert self._server is not None, "not started"
        sock = next(iter(self._server.sockets))
        port: int = sock.getsockname()[1]
        return port

    async def start(self) -> None:
        """Listen (a worker only takes connections handed to `adopt`) and start the sources."""
        cfg = self.config.server
        logging.getLogger("websockets.server").addFilter(_quiet_client_faults)
        # The model's tokenizer, loaded now (about 60 ms), not in the first stream's turn.
        token_counter(self.decoder.engine_info.tokenizer_path)
        if self._journal is not None:
            self._journal.start()
        # websockets' documented way to a server with our own connection factory: a Server,
        # a factory that refers to it, and the asyncio server it wraps.
        self._server = (Server if self._slot is None else _HandedServer)(
            self._handle,
            process_request=self.http.process_request,
            server_header="captiond",
            open_timeout=_OPEN_TIMEOUT_S,
        )
        loop = asyncio.get_running_loop()
        listener: asyncio.Server
        if self._slot is None:
            tls = tls_context(cfg)
            listener = await loop.create_server(
                self._new_connection,
                cfg.host,
                cfg.port,
                ssl=tls,
                ssl_handshake_timeout=_OPEN_TIMEOUT_S if tls else None,
                ssl_shutdown_timeout=_CLOSE_TIMEOUT_S if tls else None,
            )
            self._server.wrap(listener)
            log.info("listening on %s:%d", cfg.host, self.port)
        else:
            # Never listening: it only gives websockets' Server its close and wait_closed.
            listener = await loop.create_unix_server(
                self._new_connection, sock=socket.socket(socket.AF_UNIX), start_serving=False
            )
            self._server.wrap(listener)
        for source in self.sources.values():
            source.start(self._journal)
        if self._slot is None and cfg.agent_port:
            self._agent = await serve_agent(cfg.host, cfg.agent_port, self.agent_reply)
        self._trimmer = asyncio.create_task(trim_after_peaks(lambda: self.sessions_open))
        if self.load.max_loop_busy:
            self._loop_watch = asyncio.create_task(watch_loop(self._observe_loop))
        if self._journal is not None and self.config.server.instance:
            # A named instance may share its journal folder with others (deploy/haproxy).
            self._handovers = asyncio.create_task(self._let_go_when_asked(self._journal.dir))

    def _observe_loop(self, now_s: float, cpu_s: float) -> None:
        self.load.observe_loop(now_s, cpu_s, self.sessions_open)
        self.metrics.loop_busy.set(self.load.busy_share())

    async def _let_go_when_asked(self, folder: Path) -> None:
        """For ever: every handover.POLL_S, let go of the live sessions another instance asks
        for (journal/handover.py), as a drain does, so that it takes them back."""
        while True:
            await asyncio.sleep(handover.POLL_S)
            if not self._live:
                continue
            try:
                asked = await asyncio.to_thread(handover.requested, folder)
            except OSError as exc:
                log.warning("cannot read handover requests in %s: %s", folder, exc)
                continue
            for live in list(self._live.values()):
                if file_safe_id(live.id) in asked and not live.finished.is_set():
                    log.info("session %s let go: another instance takes it back", live.id)
                    live.end_for_shutdown(
                        "the session moved to another instance; reconnect to resume"
                    )
                    # Answered: a request whose asker died waiting must not let the session go
                    # again each time it is taken back here.
                    try:
                        await asyncio.to_thread(handover.withdraw, folder, live.id)
                    except OSError as exc:
                        log.warning("cannot remove the handover request of %s: %s", live.id, exc)

    def _new_connection(self) -> AnsweringConnection:
        assert self._server is not None
        # No extensions: permessage-deflate would spend the event loop's time compressing
        # audio frames that barely compress.
        protocol = AnsweringProtocol(
            max_size=self.config.server.max_frame_bytes * _HARD_LIMIT_FACTOR,
            logger=self._server.logger,
            refused=self.http.count_refused,
        )
        return AnsweringConnection(
            protocol,
            self._server,
            ping_interval=_PING_INTERVAL_S,
            ping_timeout=_PING_TIMEOUT_S,
            close_timeout=_CLOSE_TIMEOUT_S,
            max_queue=_MAX_QUEUE_FRAMES,
        )

    async def adopt(self, sock: socket.socket) -> None:
        """Serve a connection the main process accepted (worker mode)."""
        if self._server is None or self._server.close_task is not None:
            sock.close()  # stopping: the client reconnects to a running worker
            return
        await asyncio.get_running_loop().connect_accepted_socket(self._new_connection, sock)

    async def shutdown(self) -> None:
        """Drain: /readyz fails and every new connection is refused with `shutting_down`
        (1001; the client goes to another instance), while every open stream is finalized
        (last finals sent and journaled) and closed with 1001; then stop listening. Whatever
        is still open after `[server] drain_timeout_s` is cut off. The port stays open while
        the streams finish so that a load balancer's health check sees the instance drain
        (503) rather than vanish."""
        if self._server is None:
            return
        self.draining = True
        if self._agent is not None:
            self._agent.close()
        for live in list(self._live.values()):
            live.end_for_shutdown()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self.config.server.drain_timeout_s):
                await asyncio.gather(*(source.stop() for source in self.sources.values()))
                while self._live:
                    await asyncio.sleep(0.05)
                self._server.close(close_connections=True)  # viewers, stragglers: 1001
                await self._server.wait_closed()
        self._server.close(close_connections=False)  # past the timeout: stop listening now
        for conn in self._server.connections:  # a client that never completes its close
            if conn.transport is not None:
                conn.transport.abort()
        await self._server.wait_closed()
        for task in (self._trimmer, self._loop_watch, self._handovers):
            if task is not None:
                task.cancel()
        if self._journal is not None:
            self._journal.stop()

    # -- websocket side ----------------------------------------------------------------------

    async def _handle(self, conn: ServerConnection) -> None:
        assert conn.request is not None
        url = urlsplit(conn.request.path)
        query = Query(url.query)
        endpoint = ENDPOINTS.get(url.path)
        dialect = endpoint.dialect(query) if endpoint else NativeDialect(query)
        if isinstance(conn, AnsweringConnection):
            conn.dialect = dialect
        ip = self._client_ip(conn)
        if self.draining:
            self.metrics.refused.labels(reason="draining").inc()
            await send_error(conn, ShuttingDownError("the daemon is shutting down"), dialect)
            return
        if not self._per_ip.try_open(ip):
            self.metrics.refused.labels(reason="connections per IP").inc()
            limit = self.config.server.max_sessions_per_ip
            error = OverloadedError(f"{limit} connections from {ip} are open")
            await send_error(conn, error, dialect)
            return
        try:
            if endpoint is None:
                since = parse_since(query)
                await self._watch(conn, query.get("source", ""), since, query.get("run"))
            else:
                await self._stream(conn, ip, query, dialect, endpoint.resumable)
        except SessionError as exc:
            await send_error(conn, exc, dialect)
        finally:
            self._per_ip.close(ip)

    async def _watch(
        self, conn: ServerConnection, name: str, since: int | None, run: str | None
    ) -> None:
        """A viewer of a daemon-side source: its feed until it leaves or the daemon stops;
        a viewer that reconnects gets the held finals from segment `since`. A `since` of
        another `run` (the viewer's count from before a restart) is ignored: the new run's
        segments start at 0 again, and skipping them would lose its first captions."""
        source = self.sources.get(name)
        if source is None:
            known = ", ".join(sorted(self.sources)) or "none configured"
            raise SourceNotFoundError(f"no daemon-side source named {name!r} (sources: {known})")
        if run is not None and run != source.run:
            since = None
        log.debug("open viewer source=%s peer=%s", name, conn.remote_address)
        with contextlib.suppress(ConnectionClosed):
            await source.broadcast.watch(conn, since)
            await conn.close(CLOSE_GOING_AWAY)
        log.debug("close viewer source=%s peer=%s", name, conn.remote_address)

    async def _stream(
        self,
        conn: ServerConnection,
        ip: str,
        query: dict[str, str],
        dialect: Dialect,
        resumable: bool,
    ) -> None:
        resume = parse_resume(query) if resumable else None
        if resume is not None:
            live = await self._take_back(conn, resume, dialect)
        else:
            params = self._stream_params(dialect)
            # At its limit, an address's new stream ends its oldest one held for a resume
            # (a reload, a client that did not resume): the new one is the one in use.
            for session_id in self._per_ip.over_limit(ip):
                if (held := self._live.get(session_id)) is not None:
                    log.info("session %s let go: %s opened a stream at its limit", held.id, ip)
                    held.let_go()
            self._admit()
            key: ResumeKey | None = None
            token: str | None = None
            if resumable and self.config.server.resume_s > 0:
                key, token = ResumeKey.new(self._new_session_id())
            live = self._open_stream(conn, params, resume_key=key)
            ready = self._ready(live, token)
            await live.serve(conn, dialect, lambda _: ready)
        if live.detached_at_s is not None and not live.finished.is_set() and live.resumable:
            self._per_ip.hold(live.id, ip)  # until it is resumed, ends or is let go

    def _client_ip(self, conn: ServerConnection) -> str:
        """The client's address (a trusted load balancer's X-Forwarded-For: access.py)."""
        peer = str(conn.remote_address[0]) if conn.remote_address else "?"
        forwarded = conn.request.headers.get("X-Forwarded-For") if conn.request else None
        return client_address(peer, forwarded, self.config.server.trusted_proxies)

    def _peer(self, conn: ServerConnection) -> str:
        """The client for the log and the journal: its address and port, or the address a
        trusted load balancer forwarded for it."""
        address = conn.remote_address
        peer = f"{address[0]}:{address[1]}" if address else "?"
        ip = self._client_ip(conn)
        return peer if address and ip == str(address[0]) else ip

    def _admit(self) -> None:
        """A new stream only while the daemon keeps up (server/load.py)."""
        now_s = asyncio.get_running_loop().time()
        why = self.load.why_behind(now_s, self.sessions_open)
        if why is not None:
            self.metrics.refused.labels(reason="behind").inc()
            raise OverloadedError(f"{why}; try again later")

    def agent_reply(self) -> str:
        """HAProxy's agent check answer for this daemon (server/load.py)."""
        now_s = asyncio.get_running_loop().time()
        full = self.sessions_open >= self._max_sessions
        return agent_reply(behind=self.load.behind(now_s, self.sessions_open), full=full)

    def _stream_params(self, dialect: Dialect) -> StreamParams:
        engine = self.decoder.engine_info
        params = dialect.stream_params(self.config.stream.language, engine.check_can)
        engine.check_can(params.language, params.task, params.candidates)
        diarize = self.config.stream.diarize if params.diarize is None else params.diarize
        if diarize and not engine.diarizes:
            raise BadMessageError(SPEAKER_MODEL_HINT)
        if params.turn.end_of_turn == "model" and not engine.judges_turns:
            raise BadMessageError(TURN_MODEL_HINT)
        return params

    def _open_stream(
        self,
        conn: ServerConnection,
        params: StreamParams,
        *,
        resume_key: ResumeKey | None,
        origin: StreamOrigin | None = None,
        received_bytes: int = 0,
        continues: str | None = None,
        owner: Ownership | None = None,
    ) -> LiveStream:
        """A new live stream (or one taken back from the journal, with its lock), its pump
        started."""
        if self.sessions_open >= self._max_sessions:
            self.metrics.refused.labels(reason="session limit").inc()
            raise OverloadedError(
                f"session limit reached ({self.config.server.max_sessions}); try again later"
            )
        engine = self.decoder.engine_info
        params = dataclasses.replace(params, language=engine.stream_language(params.language))
        session = StreamSession(
            config=self.config,
            vad=self._vad_factory(),
            params=params,
            origin=origin,
            count_tokens=token_counter(engine.tokenizer_path),
        )
        session_id = resume_key.session if resume_key else self._new_session_id()
        journal = None
        if self._journal is not None:
            journal = self._journal.open_session(
                session=session_id,
                peer=self._peer(conn),
                source=None,
                language=params.language_setting,
                model=engine.model_name,
                engine=engine.name,
                stream={
                    "sample_rate": params.sample_rate_hz,
                    "encoding": params.encoding,
                    "task": params.task,
                    "prompt": params.prompt,
                    "chinese_variant": params.chinese_variant,
                    "diarize": params.diarize,
                    "max_speakers": params.max_speakers,
                    "turn": params.turn.journal(),
                    "resume_sha256": resume_key.secret_sha256 if resume_key else None,
                },
                continues=continues,
                owner=owner,
            )
        live = LiveStream(
            session_id=session_id,
            session=session,
            config=self.config.server,
            submit=self.decoder.stream(session_id),
            metrics=self.metrics,
            journal=journal,
            resume_key=resume_key,
            received_bytes=received_bytes,
            engine=self.decoder.engine_info,
            load=self.load,
        )
        self._live[session_id] = live
        self.sessions_total += 1
        self.metrics.sessions.inc()
        task = asyncio.create_task(self._keep(live, self._peer(conn)))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return live

    def _new_session_id(self) -> str:
        instance = self.config.server.instance
        if self._slot:
            return self._slot.new_session_id(instance)
        return session_id(instance, uuid.uuid4().hex[:12])

    def _ready(self, live: LiveStream, token: str | None) -> Ready:
        engine = self.decoder.engine_info
        return Ready(
            session=live.id,
            sample_rate=SAMPLE_RATE_HZ,
            model=engine.model_name,
            engine=engine.name,
            resume_token=token,
            resume_s=self.config.server.resume_s if token else 0.0,
            max_audio_speed=self.config.server.max_audio_speed,
            audio_burst_s=self.config.server.audio_burst_s,
        )

    async def _keep(self, live: LiveStream, peer: str) -> None:
        """A stream's life: its pump until the session is done (then its log line, counters
        and journal end record), then held until it can no longer be taken back."""
        pump = asyncio.create_task(live.run())
        try:
            await live.finished.wait()
            self._per_ip.release(live.id)  # it takes no session slot any more
            # Its audio is needed no more (a resume only replays finals): the engine's copy
            # goes now, not when the stream is let go.
            self.decoder.forget(live.id)
            await self._ended(live, peer)
            await pump
        finally:
            pump.cancel()
            if self._live.get(live.id) is live:
                del self._live[live.id]
                self._per_ip.release(live.id)
            self.decoder.forget(live.id)  # a stream cut off before it finished (shutdown)

    async def _ended(self, live: LiveStream, peer: str) -> None:
        code = live.final_code
        self.metrics.closes.labels(code=str(code)).inc()
        session = live.session
        log.info(
            "session %s peer=%s language=%s audio_s=%.1f finals=%d close=%d",
            live.id,
            peer,
            session.params.language,
            session.audio_ms / 1000,
            session.segments,
            code,
        )
        if live.journal is not None:
            await live.journal.close(
                audio_ms=session.audio_ms,
                segments=session.segments,
                close_code=code,
                received_bytes=live.received_bytes,
            )

    async def _take_back(
        self, conn: ServerConnection, resume: ResumeRequest, dialect: Dialect
    ) -> LiveStream:
        """Give the stream a resume token names, from memory or (after a restart) the journal,
        to `conn`: `resumed`, the finals to replay, then the stream goes on until `conn`
        ends."""
        session_id = session_of_token(resume.token)
        live = self._live.get(session_id)
        gap_ms = None
        if live is None:
            # One take-back of a session at a time here: a second resume of it waits, then
            # takes it over from the first, as from memory.
            taking = self._taking_back.setdefault(session_id, _TakingBack())
            taking.resumes += 1
            try:
                async with taking.lock:
                    live, gap_ms = await self._from_journal_once(conn, session_id, resume)
            finally:
                taking.resumes -= 1
                if not taking.resumes:
                    del self._taking_back[session_id]
        if gap_ms is None:
            if live.resume_key is None or not live.resumable:
                raise ResumeFailedError(f"session {session_id} has ended")
            live.resume_key.check(resume.token)
            now_s = asyncio.get_running_loop().time()
            gap_ms = round((now_s - (live.detached_at_s or now_s)) * 1000)
        ready = self._ready(live, resume.token)

        def resumed(replay: list[Final]) -> Resumed:
            log.info(
                "session %s resumed after %d ms, %d finals replayed", live.id, gap_ms, len(replay)
            )
            return Resumed(
                **{f.name: getattr(ready, f.name) for f in dataclasses.fields(Ready)},
                audio_ms=live.session.audio_ms,
                received_bytes=live.received_bytes,
                ended=live.session.state is not SessionState.STREAMING,
                gap_ms=gap_ms,
                replayed=len(replay),
            )

        self._per_ip.release(live.id)  # streamed again: counted by its connection
        await live.serve(conn, dialect, resumed, resume=True, since=resume.since)
        return live

    async def _from_journal_once(
        self, conn: ServerConnection, session_id: str, resume: ResumeRequest
    ) -> tuple[LiveStream, int | None]:
        """The session from memory if an earlier resume took it back meanwhile (no gap yet),
        else taken back from the journal (`_from_journal`) with the gap since it stopped."""
        live = self._live.get(session_id)
        if live is not None:
            return live, None
        found, owner = await self._journaled(session_id)
        live = self._live.get(session_id)
        if live is not None:
            if owner is not None:
                owner.release()
            return live, None
        if owner is None:
            # Its journal is locked by another live daemon: a load balancer sent the resume
            # here while the instance that holds it still runs. That one is asked to let it go;
            # if it does not in time, the client tries again.
            found, owner = await self._handed_over(found, resume)
            if owner is None:
                self.metrics.refused.labels(reason="session held elsewhere").inc()
                raise OverloadedError(f"session {session_id} is held by another instance")
        try:
            return self._from_journal(conn, found, resume, owner)
        except BaseException:
            owner.release()
            raise

    async def _handed_over(
        self, found: JournalSession, resume: ResumeRequest
    ) -> tuple[JournalSession, Ownership | None]:
        """Ask the live daemon that holds `found` to let it go (only for its own client: the
        token is checked against the journal first), and wait up to handover.WAIT_S for its
        lock; then the journal's record, read again under it. No lock: not let go in time."""
        assert self._journal is not None
        folder = self._journal.dir
        _journal_key(found).check(resume.token)
        loop = asyncio.get_running_loop()
        deadline_s = loop.time() + handover.WAIT_S
        try:
            await asyncio.to_thread(handover.request, folder, found.session)
        except OSError as exc:
            log.warning("cannot ask for session %s in %s: %s", found.session, folder, exc)
            return found, None
        try:
            while loop.time() < deadline_s:
                await asyncio.sleep(handover.LOCK_POLL_S)
                try:
                    again, owner = await asyncio.to_thread(_locked_read, folder, found)
                except JournalError:
                    raise ResumeFailedError(f"unknown session {found.session}") from None
                if owner is not None:
                    return again, owner
            return found, None
        finally:
            with contextlib.suppress(OSError):
                await asyncio.to_thread(handover.withdraw, folder, found.session)

    async def _journaled(self, session_id: str) -> tuple[JournalSession, Ownership | None]:
        """The journal's record of a session this daemon does not hold and, unless another
        live daemon holds it, the session's lock, taken before the record is read (on a
        thread: the folder may be on NFS)."""
        if self._journal is None:
            raise ResumeFailedError(f"unknown session {session_id} (no journal to resume from)")
        folder = self._journal.dir

        def read() -> tuple[JournalSession, Ownership | None]:
            return _locked_read(folder, find_session(folder, session_id))

        try:
            return await asyncio.to_thread(read)
        except JournalError:
            raise ResumeFailedError(f"unknown session {session_id}") from None

    def _from_journal(
        self,
        conn: ServerConnection,
        found: JournalSession,
        resume: ResumeRequest,
        owner: Ownership,
    ) -> tuple[LiveStream, int]:
        """A session taken back from its journal, whose lock `owner` this daemon now holds:
        one a daemon stopped (close 1001), or one whose daemon died (no end record: nobody
        else holds its lock), less than `resume_s` ago. Its finals, stream clock and segment
        numbers continue; its earlier text is the prompt; its audio is gone (after a death,
        the client sends again what came after the last final). Also the gap since then."""
        session_id = session_of_token(resume.token)
        end = found.end
        stopped = end is not None and end.get("close_code") == CLOSE_GOING_AWAY
        died = end is None
        resume_bytes = found.resume_bytes()
        if found.session != session_id or not (stopped or died) or resume_bytes is None:
            raise ResumeFailedError(f"session {session_id} cannot be resumed")
        key = _journal_key(found)
        key.check(resume.token)
        since = str(end["at"]) if end is not None else found.last_written()
        gap_s = (datetime.now(UTC) - datetime.fromisoformat(since)).total_seconds()
        if gap_s > self.config.server.resume_s:
            raise ResumeFailedError(f"session {session_id} stopped {gap_s:.0f} s ago")
        params = found.stream_params()
        # The daemon may have restarted on another model: refused as the stream's connect
        # would be (one the model cannot prompt would fail the batch of every stream with it).
        self.decoder.engine_info.check_can(params.language, params.task, params.candidates)
        origin = found.origin()
        live = self._open_stream(
            conn,
            params,
            resume_key=key,
            origin=origin,
            received_bytes=resume_bytes,
            continues=JOURNAL_FILE_NAME.match(found.files[0].name)["stem"],  # type: ignore[index]
            owner=owner,
        )
        if died:
            log.warning("session %s taken back from the journal: its daemon died", session_id)
        for final in found.finals[-MAX_HELD_FINALS:]:
            live.held.add(
                Final(
                    segment=final.segment,
                    start_ms=final.start_ms,
                    end_ms=final.end_ms,
                    text=final.text,
                    language=final.language,
                    words=final.words,
                    speaker=final.speaker,
                    speech=final.speech,
                )
            )
        return live, round(gap_s * 1000)


def _journal_key(found: JournalSession) -> ResumeKey:
    """What the journal keeps of a session's resume token."""
    return ResumeKey(session=found.session, secret_sha256=str(found.header.get("resume_sha256")))


def _locked_read(folder: Path, found: JournalSession) -> tuple[JournalSession, Ownership | None]:
    """`found`'s lock, then its record read again under it (its last owner may have written
    since); with no lock (a live daemon holds it), `found` as it was. Blocking: on a thread."""
    try:
        owner = Ownership.take(found.files[0])
    except SessionOwnedError:
        return found, None
    try:
        return find_session(folder, found.session), owner
    except BaseException:
        owner.release()
        raise


@dataclasses.dataclass(slots=True)
class _TakingBack:
    """A session being taken back from the journal: the resumes of it, one at a time."""

    lock: asyncio.Lock = dataclasses.field(default_factory=asyncio.Lock)
    resumes: int = 0  # waiting or taking it: the entry goes with the last


def tls_context(server: ServerConfig) -> ssl.SSLContext | None:
    """The TLS context of `[server] tls_cert`/`tls_key` (None: plain ws://). A file that cannot
    be read, or is no PEM certificate and key, is a ConfigError, not a traceback."""
    if server.tls_key and not server.tls_cert:
        raise ConfigError("[server] tls_key is set without tls_cert")
    for key in ("tls_cert", "tls_key"):
        path = getattr(server, key)
        if not path:
            continue
        try:
            Path(path).read_bytes()
        except OSError as exc:
            raise ConfigError(f"[server] {key} {path!r}: cannot read it: {exc.strerror}") from None
    if not server.tls_cert:
        return None
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_cert_chain(server.tls_cert, server.tls_key or None)
    except ssl.SSLError as exc:
        files = f"tls_cert {server.tls_cert!r}"
        files += f" and tls_key {server.tls_key!r}" if server.tls_key else " (no tls_key)"
        detail = f" ({exc.reason})" if exc.reason else ""
        raise ConfigError(
            f"[server] {files}: not a PEM certificate and its private key{detail}"
        ) from None
    return context


def _quiet_client_faults(record: logging.LogRecord) -> bool:
    """websockets logs every failed opening handshake as an ERROR with its traceback, a
    malformed request (POST, HTTP/1.0, an 8-kB header, not HTTP at all) too: anyone could fill
    the log with them. A client's fault becomes one DEBUG line; our own (an exception in
    `process_request`, answered 500) stays an ERROR."""
    if record.msg != "opening handshake failed" or record.exc_info is None:
        return True
    exc = record.exc_info[1]
    if not isinstance(exc, InvalidHandshake | EOFError | ConnectionError):
        return True
    cause = exc.__cause__ or exc.__context__
    log.debug("refused a request: %s%s", exc, f" ({cause})" if cause else "")
    return False
