"""`bench capacity`'s clients: one level's streams, each started at its moment on the wall clock,
run in client processes (multiprocessing, spawn) or in the bench's own event loop.

The bench's main thread starts one client process per share of a level's streams and talks to
each over a pipe: the plan goes out (URL, protocol, the level's audio, each stream's start
offset), the child answers `ready`, the bench sends the level's start epoch (time.time(), the
one clock all processes share), and the child's main thread runs its streams with asyncio and
sends back one `StreamOutcome` per stream. A child that dies, says nothing or overruns its
deadline costs its streams, reported as failed: never a hang. The bench waits on the pipes from
worker threads (asyncio.to_thread), so that an in-process daemon's event loop keeps serving.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import os
import resource
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import numpy.typing as npt

from captiond.bench.metrics import Trace
from captiond.bench.pacing import stream_native
from captiond.bench.peer_whisperlive import stream_whisperlive
from captiond.ops.loop import run as run_loop
from captiond.whisper import SAMPLE_RATE_HZ

PROTOCOLS = ("native", "whisperlive")
# After its audio a stream has this long to finish: far beyond any latency bound, so only a
# stuck stream reaches it (the WhisperLive adapter itself waits at most 40 s after its audio).
STREAM_TAIL_S = 60.0
# A spawned interpreter imports numpy, websockets and the bench before it is ready.
_READY_TIMEOUT_S = 120.0
# Beyond a plan's last stream deadline, for the child to pickle and send its outcomes.
_SEND_GRACE_S = 30.0

Streamer = Callable[[str, npt.NDArray[np.float32], Trace], Awaitable[Trace]]


@dataclass(frozen=True, slots=True)
class PlannedStream:
    index: int  # the stream's number in its level, 0 to N-1
    audio: int  # which of the plan's audio arrays it plays
    offset_s: float  # its start, after the level's start epoch


@dataclass(frozen=True, slots=True, kw_only=True)
class ClientPlan:
    protocol: str  # one of PROTOCOLS
    url: str
    audio: list[npt.NDArray[np.float32]]  # 16 kHz mono, played at real time
    streams: list[PlannedStream]
    peer_language: str | None  # WhisperLive's (None: it detects); captiond's is its own

    def stream_timeout_s(self, stream: PlannedStream) -> float:
        return len(self.audio[stream.audio]) / SAMPLE_RATE_HZ + STREAM_TAIL_S

    def deadline_s(self) -> float:
        """After the level's start epoch: when the last of these streams must have ended."""
        return max(s.offset_s + self.stream_timeout_s(s) for s in self.streams)


@dataclass(slots=True, kw_only=True)
class StreamOutcome:
    index: int
    scheduled_epoch_s: float  # when it was due to start (time.time())
    trace: Trace  # what was recorded, also of a failed stream (possibly nothing)
    error: str | None = None


def plan_level(
    n: int,
    *,
    procs: int,
    protocol: str,
    url: str,
    audio: list[npt.NDArray[np.float32]],
    start_within_s: float,
    peer_language: str | None = "en",
) -> list[ClientPlan]:
    """Stream i starts at i/N of `start_within_s`, plays audio i mod len(audio), and goes to
    client i mod `procs` (procs 0: one plan, for the bench's own loop); no empty plans."""
    shares: list[list[PlannedStream]] = [[] for _ in range(max(1, min(procs, n)))]
    for i in range(n):
        shares[i % len(shares)].append(PlannedStream(i, i % len(audio), i / n * start_within_s))
    return [
        ClientPlan(protocol=protocol, url=url, audio=audio, streams=s, peer_language=peer_language)
        for s in shares
    ]


def raise_fd_limit() -> None:
    """Soft open-file limit up to the hard one: a level holds a socket per stream, often more
    than the usual soft 1024 in one process."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def _streamer(plan: ClientPlan) -> Streamer:
    if plan.protocol == "whisperlive":
        language = plan.peer_language
        return lambda url, samples, trace: stream_whisperlive(
            url, samples, language=language, trace=trace
        )
    return lambda url, samples, trace: stream_native(url, samples, trace=trace)


async def run_streams(plan: ClientPlan, start_epoch_s: float) -> list[StreamOutcome]:
    """Every stream of the plan, each from its moment on, in this event loop."""
    stream = _streamer(plan)

    async def one(planned: PlannedStream) -> StreamOutcome:
        scheduled_epoch_s = start_epoch_s + planned.offset_s
        await asyncio.sleep(max(0.0, scheduled_epoch_s - time.time()))
        outcome = StreamOutcome(
            index=planned.index, scheduled_epoch_s=scheduled_epoch_s, trace=Trace()
        )
        try:
            await asyncio.wait_for(
                stream(plan.url, plan.audio[planned.audio], outcome.trace),
                plan.stream_timeout_s(planned),
            )
        except Exception as exc:  # any failure of one stream is that stream's outcome
            outcome.error = f"{type(exc).__name__}: {exc}"
        return outcome

    return list(await asyncio.gather(*(one(s) for s in plan.streams)))


def _failed(plan: ClientPlan, start_epoch_s: float, error: str) -> list[StreamOutcome]:
    return [
        StreamOutcome(
            index=s.index, scheduled_epoch_s=start_epoch_s + s.offset_s, trace=Trace(), error=error
        )
        for s in plan.streams
    ]


def _child_main(conn: Connection) -> None:
    """A client process: plan in, `ready` out, start epoch in, outcomes out."""
    try:
        plan: ClientPlan = conn.recv()
        raise_fd_limit()
        conn.send(("ready", os.getpid()))
        start_epoch_s: float = conn.recv()
        conn.send(("done", run_loop(run_streams(plan, start_epoch_s))))
    except (EOFError, KeyboardInterrupt):
        return  # the bench gave up on this level, or is gone (Ctrl-C reaches us too)
    except Exception as exc:
        with contextlib.suppress(OSError):
            conn.send(("error", f"{type(exc).__name__}: {exc}"))


class ClientProcess:
    """One client process, from the bench's side. Its methods block (pipe and process waits):
    call them from a worker thread, except the constructor, which only spawns."""

    def __init__(self, plan: ClientPlan) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.plan = plan
        self.error: str | None = None
        self._sender: threading.Thread | None = None
        self._conn, child_conn = ctx.Pipe()
        self._proc = ctx.Process(
            target=_child_main, args=(child_conn,), name="captiond-bench-client", daemon=True
        )
        self._proc.start()
        child_conn.close()
        self.pid: int = self._proc.pid or 0

    def _receive(self, deadline_epoch_s: float) -> tuple[str, Any] | None:
        """The child's next message, or None (and `error` says why)."""
        try:
            while not self._conn.poll(0.2):
                if not self._proc.is_alive() and not self._conn.poll(0):
                    self.error = f"client process exited with code {self._proc.exitcode}"
                    return None
                if time.time() > deadline_epoch_s:
                    self.error = "client process overran its deadline"
                    return None
            message: tuple[str, Any] = self._conn.recv()
        except (EOFError, OSError) as exc:
            self._proc.join(1)
            self.error = f"client process gone ({exc!r}, exit code {self._proc.exitcode})"
            return None
        if message[0] == "error":
            self.error = f"client process failed: {message[1]}"
            return None
        return message

    def hand_over(self) -> bool:
        """Send the plan and wait until the child is ready. The send blocks until the child
        reads it all, so it runs on a thread of its own: a child stuck before reading costs a
        timeout, not a hang (stopping the child breaks that send)."""
        deadline_epoch_s = time.time() + _READY_TIMEOUT_S
        self._sender = threading.Thread(target=self._send_plan, name="bench-plan-send", daemon=True)
        self._sender.start()
        self._sender.join(_READY_TIMEOUT_S)
        if self._sender.is_alive():
            self.error = "client process did not take its plan"
        return self.error is None and self._receive(deadline_epoch_s) is not None

    def _send_plan(self) -> None:
        try:
            self._conn.send(self.plan)
        except OSError as exc:
            self.error = f"client process unreachable: {exc!r}"

    def go(self, start_epoch_s: float) -> None:
        if self.error is not None:
            return
        try:
            self._conn.send(start_epoch_s)
        except OSError as exc:
            self.error = f"client process unreachable: {exc!r}"

    def outcomes(self, start_epoch_s: float) -> list[StreamOutcome]:
        """The child's outcomes, or all its streams failed with the reason."""
        if self.error is None:
            deadline = start_epoch_s + self.plan.deadline_s() + _SEND_GRACE_S
            reply = self._receive(deadline)
            if reply is not None and reply[0] == "done":
                done: list[StreamOutcome] = reply[1]
                return done
            self.error = self.error or f"client process said {reply!r}"
        return _failed(self.plan, start_epoch_s, self.error)

    def stop(self) -> None:
        """Wait briefly for a child that has sent its outcomes to exit, end any other; then
        close the pipe (after a pending plan send has seen the child go)."""
        self._proc.join(2)
        if self._proc.is_alive():
            self._proc.terminate()
            self._proc.join(5)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join()
        if self._sender is not None:
            self._sender.join(5)
        self._conn.close()
        self._proc.close()


class LevelClients:
    """One level's plans, run in client processes (`in_process` False) or in this event loop.

    `start` spawns the processes and waits until each is ready; `run` starts every stream on the
    schedule from `start_epoch_s` and returns the outcomes of all of them, by stream index;
    `stop` ends whatever is left. Event-loop thread.
    """

    def __init__(self, plans: list[ClientPlan], *, in_process: bool) -> None:
        self._plans = plans
        self._in_process = in_process
        self._procs: list[ClientProcess] = []

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    async def start(self) -> None:
        if self._in_process:
            return
        # Spawning only forks and execs; the plans (the audio: megabytes) go over the pipes
        # from threads, all at once.
        for plan in self._plans:
            self._procs.append(ClientProcess(plan))
        await asyncio.gather(*(asyncio.to_thread(p.hand_over) for p in self._procs))

    async def run(self, start_epoch_s: float) -> list[StreamOutcome]:
        if self._in_process:
            runs = [run_streams(plan, start_epoch_s) for plan in self._plans]
            shares = await asyncio.gather(*runs)
        else:
            for proc in self._procs:
                proc.go(start_epoch_s)
            waits = [asyncio.to_thread(p.outcomes, start_epoch_s) for p in self._procs]
            shares = await asyncio.gather(*waits)
        return sorted((o for share in shares for o in share), key=lambda o: o.index)

    async def stop(self) -> None:
        await asyncio.gather(*(asyncio.to_thread(p.stop) for p in self._procs))
        self._procs = []
