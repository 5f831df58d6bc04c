"""WorkerPool: the main process of `captiond serve` with `[server] workers` > 1.

One Python process is bounded by its GIL: websocket framing, VAD and session logic for many
streams leave the engine thread waiting. So the main process keeps only what must be one: the
engine (the InferenceScheduler and its engine thread, behind `engine_core.EngineCore`) and the
listening socket. N worker processes (`python -m captiond.workers.main`, workers/main.py) each run a
`Daemon` for their share of the connections.

All of this runs on the main process's event-loop thread:
- accept each connection, read its request line without consuming it (MSG_PEEK), pick the
  worker by server/routing.py's rules, and pass the socket over the worker's `ctrl` socket pair
  (SCM_RIGHTS): the worker's websockets reads the request as if it had accepted it;
- serve every worker's decodes over its `link` socket pair (decoding/core.py);
- restart a worker that exits, or that sends nothing for `_SILENT_S` (killed first): only
  its own sessions are lost, clients resume or reconnect;
- on shutdown, stop accepting, ask every worker to drain (SIGTERM: last finals, then 1001) and
  wait for them, and only then let the engine stop.
Metrics: every process writes prometheus_client's multiprocess files into one folder, and a
worker's /metrics adds them up.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from http import HTTPStatus
from pathlib import Path
from urllib.parse import urlsplit

from websockets.datastructures import Headers
from websockets.http11 import Response

from captiond.config import Config, dump_toml
from captiond.decoding import link as ipc
from captiond.decoding.core import EngineCore
from captiond.decoding.scheduler import HEALTHY_WITHIN_S, InferenceScheduler
from captiond.errors import CaptiondError
from captiond.ops.memory import trim_after_peaks
from captiond.server.http import PROBES, probe_answer
from captiond.server.load import agent_reply, serve_agent
from captiond.server.routing import MAX_REQUEST_LINE_BYTES, request_target, worker_for

log = logging.getLogger(__name__)

# A worker imports numpy, websockets and webrtcvad and opens its journal before it is ready.
_READY_TIMEOUT_S = 60.0
# A worker reports once a second; one that sends nothing at all (no status, no decode) this
# long is hung and is replaced. Generous: an overloaded machine delays reports, and replacing
# a slow worker would drop every stream it serves.
_SILENT_S = 60.0
# A connection that has not sent its request line, and found its worker ready, by then is
# closed (as websockets closes a silent one).
_REQUEST_LINE_TIMEOUT_S = 10.0
# Between restarts of a worker that keeps failing: first, then doubling up to the second.
_RESTART_BACKOFF_S = (0.5, 30.0)
# A worker that ran this long before it failed starts again without delay.
_STABLE_S = 60.0
# After the drain timeout, how long workers get to close before they are killed.
_EXIT_GRACE_S = 5.0
# The environment of the daemon's own supervisor: the workers must not speak to systemd.
_NOT_FOR_WORKERS = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID", "LISTEN_FDS", "LISTEN_PID")
# A worker's big arrays are its streams' audio, filled 100 ms at a time. numpy asks for
# transparent hugepages for every array of 4 MiB or more, and the kernel then clears (and may
# compact) 2 MiB at each first touch: 400 streams' buffers over their first minute took 4.1 s
# of CPU with hugepages and 2.3 s without. Workers run without them unless the user says so.
_WORKER_ENV_DEFAULTS = {"NUMPY_MADVISE_HUGEPAGE": "0"}


@dataclass(eq=False)
class _Worker:
    index: int
    process: asyncio.subprocess.Process | None = None
    ctrl: socket.socket | None = None  # connections go to the worker through this
    link: asyncio.Task[None] | None = None  # the engine core serving its decodes
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    status: ipc.Status | None = None
    seen_monotonic: float = 0.0
    served_before: int = 0  # sessions its earlier processes served (a restart counts from 0)
    started_monotonic: float = 0.0
    backoff_s: float = _RESTART_BACKOFF_S[0]


class WorkerPool:
    def __init__(
        self,
        config: Config,
        scheduler: InferenceScheduler,
        *,
        metrics_dir: Path | None = None,
        worker_args: Sequence[str] = (),
        worker_env: Mapping[str, str] | None = None,
    ) -> None:
        self.config = config
        self._core = EngineCore(scheduler)
        # The workers' metrics; this process's own only when the caller set the variable
        # before importing prometheus_client (see cli/).
        self._own_metrics_dir = metrics_dir is None
        self._metrics_dir = metrics_dir or Path(tempfile.mkdtemp(prefix="captiond-metrics-"))
        self._worker_args = tuple(worker_args)
        self._worker_env = dict(worker_env or {})
        self._workers = [_Worker(i) for i in range(config.server.workers)]
        self._listener: socket.socket | None = None
        self._agent: asyncio.Server | None = None
        self._turn = 0
        self._stopping = False
        self._tasks: set[asyncio.Task[None]] = set()
        self._silence_checked_monotonic = time.monotonic()  # by _watch_silence
        # Until every worker was ready once, a worker that exits fails the start: what stops
        # it (a journal dir it cannot write) would stop every restart too.
        self._started = False
        self._start_failed: asyncio.Future[str] | None = None  # made by start()
        self.restarts = 0

    @property
    def port(self) -> int:
        assert self._listener is not None, "not started"
        port: int = self._listener.getsockname()[1]
        return port

    @property
    def pids(self) -> list[int]:
        """This process and every running worker."""
        running = [w.process for w in self._workers if w.process is not None]
        return [os.getpid()] + [p.pid for p in running if p.returncode is None]

    async def start(self) -> None:
        """Listen, start every worker and wait until each is ready."""
        cfg = self.config.server
        self._listener = _listen(cfg.host, cfg.port)
        self._listener.setblocking(False)
        start_failed = self._start_failed = asyncio.get_running_loop().create_future()
        for worker in self._workers:
            await self._spawn(worker)
        all_ready = asyncio.ensure_future(asyncio.gather(*(w.ready.wait() for w in self._workers)))
        await asyncio.wait(
            (all_ready, start_failed), timeout=_READY_TIMEOUT_S, return_when=asyncio.FIRST_COMPLETED
        )
        if not all_ready.done():
            all_ready.cancel()
            # The gather ends holding its waits' CancelledError as its exception: taken here,
            # or asyncio logs it as never retrieved when the future is collected.
            await asyncio.wait((all_ready,))
            if not all_ready.cancelled():
                all_ready.exception()
            await self.shutdown()
            raise CaptiondError(
                start_failed.result()
                if start_failed.done()
                else f"worker processes did not start within {_READY_TIMEOUT_S:g} s"
            )
        self._started = True
        asyncio.get_running_loop().add_reader(self._listener.fileno(), self._accept)
        if cfg.agent_port:
            self._agent = await serve_agent(cfg.host, cfg.agent_port, self._agent_reply)
        self._spawn_task(self._watch_silence())
        self._spawn_task(trim_after_peaks(lambda: self._core.streams_held))
        log.info("listening on %s:%d with %d workers", cfg.host, self.port, len(self._workers))

    async def shutdown(self) -> None:
        """Stop accepting, drain every worker (their last finals go out), then return."""
        self._stopping = True
        if self._agent is not None:
            self._agent.close()
        if self._listener is not None:
            asyncio.get_running_loop().remove_reader(self._listener.fileno())
            self._listener.close()
        for worker in self._workers:
            if worker.process is not None and worker.process.returncode is None:
                worker.process.send_signal(signal.SIGTERM)
        wait_s = self.config.server.drain_timeout_s + _EXIT_GRACE_S
        for worker in self._workers:
            if worker.process is None:
                continue
            try:
                async with asyncio.timeout(wait_s):
                    await worker.process.wait()
            except TimeoutError:
                log.error("worker %d did not stop: killing it", worker.index)
                worker.process.kill()
                await worker.process.wait()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for worker in self._workers:
            self._close_ctrl(worker)
        if self._own_metrics_dir:
            shutil.rmtree(self._metrics_dir, ignore_errors=True)

    def status_line(self) -> str:
        statuses = [w.status for w in self._workers if w.status is not None]
        open_now = sum(s.sessions_open for s in statuses)
        served = sum(w.served_before for w in self._workers)
        served += sum(s.sessions_total for s in statuses)
        alive = sum(w.ready.is_set() for w in self._workers)
        line = (
            f"{open_now} streams open, {served} served; "
            f"{alive}/{len(self._workers)} workers, {self.restarts} restarts"
        )
        sources = ", ".join(s.sources for s in statuses if s.sources)
        return f"{line}; sources: {sources}" if sources else line

    def healthy(self, within_s: float) -> bool:
        """The engine thread's heartbeat and the check that replaces hung workers both ran
        within `within_s`. A worker's own hang is the pool's to mend (after `_SILENT_S`): it
        costs that worker's streams, not, through systemd's watchdog, every stream and the
        engine's model load."""
        now = time.monotonic()
        engine_age_s = now - self._core.scheduler.stats.heartbeat_monotonic
        return engine_age_s < within_s and now - self._silence_checked_monotonic < within_s

    # -- workers -----------------------------------------------------------------------------

    async def _spawn(self, worker: _Worker) -> None:
        ctrl, ctrl_child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        link, link_child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        env = _WORKER_ENV_DEFAULTS | {
            k: v for k, v in os.environ.items() if k not in _NOT_FOR_WORKERS
        }
        env |= {"PROMETHEUS_MULTIPROC_DIR": str(self._metrics_dir), **self._worker_env}
        command = [
            sys.executable,
            "-m",
            "captiond.workers.main",
            "--index",
            str(worker.index),
            "--count",
            str(len(self._workers)),
            "--ctrl-fd",
            str(ctrl_child.fileno()),
            "--link-fd",
            str(link_child.fileno()),
            "--log-level",
            logging.getLevelName(logging.getLogger().getEffectiveLevel()).lower(),
            *self._worker_args,
        ]
        try:
            process = await asyncio.create_subprocess_exec(
                *command,
                stdin=asyncio.subprocess.PIPE,
                pass_fds=(ctrl_child.fileno(), link_child.fileno()),
                env=env,
            )
        finally:
            ctrl_child.close()
            link_child.close()
        assert process.stdin is not None
        process.stdin.write(dump_toml(self.config).encode())  # the config, secrets included
        process.stdin.close()
        ctrl.setblocking(False)
        worker.process, worker.ctrl, worker.status = process, ctrl, None
        worker.started_monotonic = worker.seen_monotonic = time.monotonic()
        reader, writer = await asyncio.open_unix_connection(sock=link)

        def on_status(status: ipc.Status | None) -> None:
            worker.seen_monotonic = time.monotonic()
            if status is not None:  # its first one says it is ready
                worker.status = status
                worker.ready.set()

        worker.link = self._spawn_task(self._core.serve(reader, writer, on_status))
        self._spawn_task(self._watch_exit(worker, process))

    async def _watch_exit(self, worker: _Worker, process: asyncio.subprocess.Process) -> None:
        code = await process.wait()
        worker.ready.clear()
        if worker.status is not None:
            worker.served_before += worker.status.sessions_total
            worker.status = None
        self._close_ctrl(worker)
        if worker.link is not None:
            worker.link.cancel()
        _mark_dead(self._metrics_dir, process.pid)
        if self._stopping:
            return
        if not self._started:
            if self._start_failed is not None and not self._start_failed.done():
                self._start_failed.set_result(
                    f"worker {worker.index} exited with {code} as it started (its log says why)"
                )
            return
        self.restarts += 1
        ran_s = time.monotonic() - worker.started_monotonic
        if ran_s > _STABLE_S:
            worker.backoff_s = _RESTART_BACKOFF_S[0]
        log.error(
            "worker %d (pid %d) exited with %s after %.0f s: restarting in %.1f s",
            worker.index,
            process.pid,
            code,
            ran_s,
            worker.backoff_s,
        )
        await asyncio.sleep(worker.backoff_s)
        worker.backoff_s = min(2 * worker.backoff_s, _RESTART_BACKOFF_S[1])
        if not self._stopping:
            await self._spawn(worker)

    async def _watch_silence(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            now = self._silence_checked_monotonic = time.monotonic()
            for worker in self._workers:
                process = worker.process
                if (
                    process is not None
                    and process.returncode is None
                    and now - worker.seen_monotonic > _SILENT_S
                ):
                    log.error("worker %d silent for %.0f s: killing it", worker.index, _SILENT_S)
                    worker.seen_monotonic = now  # once
                    process.kill()

    def _close_ctrl(self, worker: _Worker) -> None:
        if worker.ctrl is not None:
            worker.ctrl.close()
            worker.ctrl = None

    # -- connections -------------------------------------------------------------------------

    def _accept(self) -> None:
        assert self._listener is not None
        while True:
            try:
                conn, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # EMFILE and the like: the backlog waits for the next try
                log.warning("accept failed: %s", exc)
                return
            conn.setblocking(False)
            self._spawn_task(self._route(conn))

    async def _route(self, conn: socket.socket) -> None:
        """Hand `conn` to the worker its request line asks for."""
        with contextlib.closing(conn):
            try:
                async with asyncio.timeout(_REQUEST_LINE_TIMEOUT_S):
                    target = await _peek_request_target(conn)
                    if target is None:
                        return  # the client left before its request
                    path = urlsplit(target).path
                    if path in PROBES:
                        await _answer_plain(conn, *probe_answer(path, self._why_not(path)))
                        return
                    worker = self._workers[
                        worker_for(target, len(self._workers), self._next_in_turn())
                    ]
                    await worker.ready.wait()  # restarting: it is back within the timeout
            except TimeoutError:
                return
            if worker.ctrl is None or self._stopping:
                return
            try:
                socket.send_fds(worker.ctrl, [b"c"], [conn.fileno()])
            except OSError as exc:  # its queue is full or it just died: the client retries
                log.warning("could not hand a connection to worker %d: %s", worker.index, exc)

    def _agent_reply(self) -> str:
        """HAProxy's agent check (server/load.py): drained while any worker is behind (it
        would refuse its share of new streams) or the workers hold `max_sessions`."""
        statuses = [w.status for w in self._workers if w.status is not None]
        full = sum(s.sessions_open for s in statuses) >= self.config.server.max_sessions
        return agent_reply(behind=any(s.behind for s in statuses), full=full)

    def _why_not(self, probe: str) -> str:
        """Why `/healthz` or `/readyz` fails ("": it does not), answered here: a worker sees
        the engine only through its answers, and an idle engine answers nothing."""
        if probe == "/readyz" and self._stopping:
            return "draining: no new streams"
        if not self.healthy(HEALTHY_WITHIN_S):
            return f"no heartbeat from the engine for over {HEALTHY_WITHIN_S:g} s"
        if not any(w.ready.is_set() for w in self._workers):
            return "no worker is ready"
        return ""

    def _next_in_turn(self) -> int:
        self._turn = (self._turn + 1) % len(self._workers)
        return self._turn

    def _spawn_task(self, coro: asyncio._CoroutineLike[None]) -> asyncio.Task[None]:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task


def _listen(host: str, port: int) -> socket.socket:
    """A listening socket on `host`, an IPv4 or IPv6 address or a name (its first address as
    getaddrinfo orders them): `create_server` alone takes IPv4 only."""
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]
    return socket.create_server((host, port), family=family, backlog=4096)


async def _answer_plain(conn: socket.socket, status: HTTPStatus, body: str) -> None:
    """A plain-text HTTP answer, once the request's head is read (closing a socket with
    unread data would reset the connection, and the client could lose the answer)."""
    loop = asyncio.get_running_loop()
    head = b""
    while b"\r\n\r\n" not in head and len(head) < MAX_REQUEST_LINE_BYTES:
        chunk = await loop.sock_recv(conn, MAX_REQUEST_LINE_BYTES)
        if not chunk:
            return
        head += chunk
    data = body.encode()
    headers = Headers(
        [
            ("Content-Type", "text/plain; charset=utf-8"),
            ("Content-Length", str(len(data))),
            ("Connection", "close"),
        ]
    )
    response = Response(status.value, status.phrase, headers, data)
    await loop.sock_sendall(conn, response.serialize())


async def _peek_request_target(conn: socket.socket) -> str | None:
    """The request target, read without consuming it; None if the client closed first."""
    loop = asyncio.get_running_loop()
    while True:
        try:
            head = conn.recv(MAX_REQUEST_LINE_BYTES, socket.MSG_PEEK)
        except (BlockingIOError, InterruptedError):
            head = None
        except OSError:
            return None
        if head == b"":
            return None
        if head is not None and (target := request_target(head)) is not None:
            return target
        # Wait for more: readable while nothing arrived, then a pause, because peeked bytes
        # keep the socket readable and would spin.
        if head is None:
            readable = loop.create_future()
            loop.add_reader(conn.fileno(), readable.set_result, None)
            try:
                await readable
            finally:
                loop.remove_reader(conn.fileno())
        else:
            await asyncio.sleep(0.01)


def _mark_dead(metrics_dir: Path, pid: int) -> None:
    """Drop a dead process's live gauges from the metrics (its counters stay)."""
    from prometheus_client import multiprocess

    multiprocess.mark_process_dead(pid, str(metrics_dir))  # type: ignore[no-untyped-call]
