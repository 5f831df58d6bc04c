"""Which worker process serves a connection, and what each worker owns: Sans-I/O rules.

With `[server] workers` > 1 the main process accepts every connection and hands it to a worker
(workers/pool.py) by its HTTP request line, read without consuming it:
- a resume (`?resume=<session>.<secret>`) goes to the worker that owns the session, so that a
  session held in one worker's memory is found again;
- viewers of daemon-side sources (`/v1/captions`) go to worker `SOURCES_WORKER`, which runs the
  sources;
- everything else goes round the workers in turn.
A worker owns the sessions whose id, read as a hexadecimal number (after the instance's
prefix, resume.session_number), is its index modulo the worker count: ids carry their owner
without a lookup, and after a restart any worker can take a journaled session back.
"""

from __future__ import annotations

import math
import uuid
import zlib
from dataclasses import dataclass
from urllib.parse import parse_qsl, urlsplit

from captiond.errors import ResumeFailedError
from captiond.server.resume import session_id, session_number, session_of_token

SOURCES_WORKER = 0
# The request line is the first line of what a client sends: a longer one is refused by
# websockets anyway, so routing never waits for more than this.
MAX_REQUEST_LINE_BYTES = 8_192


@dataclass(frozen=True, slots=True)
class WorkerSlot:
    """One worker's place among `count`: the session ids it gives out and its share of the
    daemon's limits."""

    index: int
    count: int

    def owns(self, session_id: str) -> bool:
        return worker_of_session(session_id, self.count) == self.index

    def new_session_id(self, instance: str = "") -> str:
        # About `count` draws: ids stay 12 random hex digits, as in a single process.
        while not self.owns(number := uuid.uuid4().hex[:12]):
            pass
        return session_id(instance, number)

    def share(self, limit: int) -> int:
        """This worker's part of a daemon-wide limit (connections are spread evenly)."""
        return math.ceil(limit / self.count)

    @property
    def runs_sources(self) -> bool:
        return self.index == SOURCES_WORKER


def worker_of_session(session: str, count: int) -> int:
    try:
        return int(session_number(session), 16) % count
    except ValueError:  # not one of ours: any worker will refuse it the same way
        return zlib.crc32(session.encode()) % count


def request_target(head: bytes) -> str | None:
    """The request target of an HTTP request's first line; None until the line is complete.
    A line that is not HTTP gives "" (any worker answers it with 400)."""
    line, found, _ = head.partition(b"\r\n")
    if not found:
        return "" if len(head) >= MAX_REQUEST_LINE_BYTES else None
    parts = line.split(b" ")
    if len(parts) != 3 or not parts[2].startswith(b"HTTP/"):
        return ""
    return parts[1].decode("latin-1")


def worker_for(target: str, count: int, next_in_turn: int) -> int:
    """The worker for a request target; `next_in_turn` when nothing pins it."""
    url = urlsplit(target)
    if url.path == "/v1/captions":
        return SOURCES_WORKER
    token = dict(parse_qsl(url.query)).get("resume")
    if not token:
        return next_in_turn
    try:
        return worker_of_session(session_of_token(token), count)
    except ResumeFailedError:  # malformed: whichever worker gets it refuses it
        return next_in_turn
