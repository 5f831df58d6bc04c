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
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Callable

log = logging.getLogger(__name__)

# The lag is judged over this much of the past: long enough for one slow batch not to close
# the door, short enough to open it again soon after the backlog is gone.
WINDOW_S = 5.0
# Fewer partials than this in the window say nothing about the lag (a quiet daemon).
_MIN_SAMPLES = 5
_PERCENTILE = 0.9


class LoadWatch:
    """The partial lags seen in the last WINDOW_S, and the admission rule on them."""

    def __init__(self, max_lag_ms: float, window_s: float = WINDOW_S) -> None:
        self.max_lag_ms = max_lag_ms  # 0: no bound
        self._window_s = window_s
        self._lags: deque[tuple[float, float]] = deque()  # (loop time, lag ms)

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

    def behind(self, now_s: float) -> bool:
        """Past the bound: new streams go elsewhere."""
        return self.max_lag_ms > 0 and self.behind_ms(now_s) > self.max_lag_ms

    def _trim(self, now_s: float) -> None:
        while self._lags and self._lags[0][0] < now_s - self._window_s:
            self._lags.popleft()


def agent_reply(*, behind: bool, full: bool) -> str:
    """HAProxy's agent check answer: `up ready` with its full weight while the daemon takes new
    streams; `up drain` (weight 0: only a resume's `use-server` still reaches it, which a full
    or lagging daemon must still take) while it is behind or at `max_sessions`. Whether it is
    alive at all is the HTTP check's (/readyz)."""
    return "up drain\n" if behind or full else "up ready 100%\n"


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
