"""Whether this daemon keeps up: how far behind its streams are, whether it takes another
stream, and what it tells HAProxy's agent check. Sans-I/O values, and `serve_agent`, the agent's
thin asyncio listener; event-loop thread.

A daemon past what it can decode does not fail: every stream falls further behind, and a
service that admitted 1,000 streams on a machine that holds 600 showed its finals 58 s late.
So a new stream is admitted only while the daemon keeps up, measured, not counted: the
partial lag of its streams (the stream's audio that a partial, when it is sent, does not cover
yet) over the last `WINDOW_S`, at its 90th percentile, must be at most `[server] max_lag_ms`.
A stream that resumes its session is always let in (its session already holds a place). Past
the bound a new stream gets `overloaded` (1013), which clients retry, and `agent_reply` tells
HAProxy to send new streams elsewhere (`drain`: only a resume's `use-server` still reaches it)
until the lag is back under the bound. Finals are decoded before partials (decoding/
scheduler.py), and a partial whose utterance has ended is withdrawn (streaming/pump.py), so the
streams already admitted keep their finals first.

The lag comes too late for a burst: 450 streams that all arrive within 5 s on an instance that
holds 300 are all in before any of them is behind. So, with `[server] max_loop_busy`, a new
stream is also refused when it would take the event loop past that share of its thread's time:
`watch_loop` samples the loop thread's CPU time every LOOP_TICK_S, and the busy share of the
last BUSY_WINDOW_S, divided by the streams open meanwhile, is what one stream costs, learned
only while the count holds steady (arrivals' handshakes cost far more than audio). Streams cost
more as they age (finals), so the highest cost seen over the last COST_MEMORY_S is the one
projected onto the streams open now, plus the newcomer. With none learned yet (a burst into an
idle instance, whose count never holds steady while it pours in), the highest cost of any
window since is projected, arrivals and all: a handshake costs the loop about what a second of
a stream's audio does, so this overstates a stream while streams arrive, which is the side to
err on for an instance that has measured nothing. The door closes early in the burst, the
count holds, a steady cost is learned BUSY_WINDOW_S later, and the door opens as far as that
cost allows. (Projecting the latest window's cost instead let the door open again as the
arrivals left the window, before the streams had aged: 363 of 450 let in, p95 final 1.2 s.)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable

log = logging.getLogger(__name__)

# The lag is judged over this much of the past: long enough for one slow batch not to close
# the door, short enough to open it again soon after the backlog is gone.
WINDOW_S = 5.0
# Fewer partials than this in the window say nothing about the lag (a quiet daemon).
_MIN_SAMPLES = 5
_PERCENTILE = 0.9
# The loop thread's CPU time is read this often (a timer on the loop: 10 wake-ups a second)...
LOOP_TICK_S = 0.1
# ... and its busy share taken over this much of the past: a second of arrivals is seen within
# it, and one slow tick does not swing it.
BUSY_WINDOW_S = 2.0
# A stream's cost is remembered this long: a burst's streams cost less while they are young
# (measured on the 2-core VM, fake engine: 0.0016 of the loop per stream 5 s into a burst of
# 300, 0.0023 a minute in).
COST_MEMORY_S = 60.0
# Fewer streams than this say little about what one costs (the loop's own work dominates).
_MIN_STREAMS_FOR_COST = 10
# A stream's cost is learned only from a window whose stream count moved by at most this share:
# opening handshakes cost the loop far more than a stream's audio (a burst of 300 in 5 s made
# one stream look 5 times as dear as it is).
_STEADY_SHARE = 0.1


class LoadWatch:
    """The partial lags seen in the last WINDOW_S, the event loop's busy share, and the
    admission rule on them."""

    def __init__(
        self, max_lag_ms: float, max_loop_busy: float = 0.0, window_s: float = WINDOW_S
    ) -> None:
        self.max_lag_ms = max_lag_ms  # 0: no bound
        self.max_loop_busy = max_loop_busy  # 0: no bound
        self._window_s = window_s
        self._lags: deque[tuple[float, float]] = deque()  # (loop time, lag ms)
        # (loop time, the loop thread's CPU seconds, streams open) every LOOP_TICK_S
        self._ticks: deque[tuple[float, float, int]] = deque()
        self._costs: deque[tuple[float, float]] = deque()  # (loop time, busy share per stream)
        # The highest busy share per stream of a whole window since the last steady one (0:
        # none, or the streams fell below _MIN_STREAMS_FOR_COST): projected while no steady
        # cost is known.
        self._unsteady_cost = 0.0

    def observe(self, now_s: float, lag_ms: float) -> None:
        if not self.max_lag_ms:
            return  # no bound (the default): nothing to keep on every partial
        self._lags.append((now_s, max(0.0, lag_ms)))
        self._trim(now_s)

    def behind_ms(self, now_s: float) -> float:
        """The window's 90th-percentile partial lag (0 with too few partials to tell)."""
        self._trim(now_s)
        if len(self._lags) < _MIN_SAMPLES:
            return 0.0
        ordered = sorted(lag for _, lag in self._lags)
        return ordered[min(len(ordered) - 1, int(_PERCENTILE * len(ordered)))]

    def observe_loop(self, now_s: float, cpu_s: float, streams: int) -> None:
        """One tick of `watch_loop`: the loop thread's CPU time so far, and the open streams."""
        self._ticks.append((now_s, cpu_s, streams))
        while len(self._ticks) > 2 and self._ticks[1][0] <= now_s - BUSY_WINDOW_S:
            self._ticks.popleft()
        counts = [n for _, _, n in self._ticks]
        streams_meanwhile = sum(counts) / len(counts)
        whole = now_s - self._ticks[0][0] >= BUSY_WINDOW_S - LOOP_TICK_S / 2
        steady = max(counts) - min(counts) <= _STEADY_SHARE * streams_meanwhile
        if whole and streams_meanwhile >= _MIN_STREAMS_FOR_COST:
            cost = self.busy_share() / streams_meanwhile
            if steady:
                self._costs.append((now_s, cost))
                self._unsteady_cost = 0.0
            else:
                self._unsteady_cost = max(self._unsteady_cost, cost)
        elif streams_meanwhile < _MIN_STREAMS_FOR_COST:
            self._unsteady_cost = 0.0
        while self._costs and self._costs[0][0] < now_s - COST_MEMORY_S:
            self._costs.popleft()

    def busy_share(self) -> float:
        """The share of the last BUSY_WINDOW_S the loop thread spent on the CPU (0 before two
        ticks)."""
        if len(self._ticks) < 2:
            return 0.0
        (first_s, first_cpu_s, _), (last_s, last_cpu_s, _) = self._ticks[0], self._ticks[-1]
        return (last_cpu_s - first_cpu_s) / (last_s - first_s) if last_s > first_s else 0.0

    def projected_busy(self, streams: int) -> float:
        """The loop's busy share with one more stream than `streams`: the highest cost of a
        stream in the last COST_MEMORY_S times `streams + 1` (with none learned while the
        count held steady, the highest since, arrivals included), or the share now if that is
        more."""
        cost = max((c for _, c in self._costs), default=self._unsteady_cost)
        return max(self.busy_share(), cost * (streams + 1))

    def why_behind(self, now_s: float, streams: int) -> str | None:
        """Why a new stream would be refused now (None: it is let in)."""
        if self.max_lag_ms > 0 and (lag_ms := self.behind_ms(now_s)) > self.max_lag_ms:
            return f"this instance is {lag_ms:.0f} ms behind (max_lag_ms {self.max_lag_ms:g})"
        if self.max_loop_busy > 0 and (busy := self.projected_busy(streams)) > self.max_loop_busy:
            return (
                f"another stream would keep this instance's event loop {busy:.0%} busy "
                f"(max_loop_busy {self.max_loop_busy:g})"
            )
        return None

    def behind(self, now_s: float, streams: int) -> bool:
        """Past a bound: new streams go elsewhere."""
        return self.why_behind(now_s, streams) is not None

    def _trim(self, now_s: float) -> None:
        while self._lags and self._lags[0][0] < now_s - self._window_s:
            self._lags.popleft()


def agent_reply(*, behind: bool, full: bool) -> str:
    """HAProxy's agent check answer: `up ready` with its full weight while the daemon takes new
    streams; `up drain` (weight 0: only a resume's `use-server` still reaches it, which a full
    or lagging daemon must still take) while it is behind or at `max_sessions`. Whether it is
    alive at all is the HTTP check's (/readyz)."""
    return "up drain\n" if behind or full else "up ready 100%\n"


async def watch_loop(observe: Callable[[float, float], None]) -> None:
    """Sample the running loop for ever: every LOOP_TICK_S, `observe(now_s, cpu_s)` with the
    loop thread's CPU time (this coroutine runs on that thread)."""
    loop = asyncio.get_running_loop()
    while True:
        observe(loop.time(), time.thread_time())
        await asyncio.sleep(LOOP_TICK_S)


async def serve_agent(host: str, port: int, reply: Callable[[], str]) -> asyncio.Server:
    """Answer HAProxy's agent check on `port`: one line (`reply()`), then close."""

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError):
            writer.write(reply().encode())
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(answer, host, port)
    log.info("HAProxy agent on %s:%d", host, port)
    return server
