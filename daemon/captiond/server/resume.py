"""Session resume, the Sans-I/O part: resume tokens and the finals a client may still lack.

Pure values used on the event-loop thread. A token is `<session id>.<secret>`: the id finds the
session (in memory, or in the journal after a restart or on another instance), the secret
proves the client is the one that got `ready`. Only the secret's SHA-256 is kept, so neither
the journal nor a memory dump hands out tokens; comparisons are constant-time.

A session id is 12 hexadecimal digits, after `<instance>_` when the daemon has a `[server]
instance` name: a load balancer in front of several instances reads the prefix to send a
resume to the instance that holds the session (deploy/haproxy/haproxy.cfg).
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
from collections import deque
from dataclasses import dataclass

from captiond.config import INSTANCE_NAME
from captiond.errors import ResumeFailedError
from captiond.streaming.events import Final

# `[server] instance` (config.INSTANCE_NAME: never a `_`, which ends it here), then the number.
_SESSION_ID = re.compile(rf"^(?:{INSTANCE_NAME.pattern.strip('^$')}_)?[A-Za-z0-9]+$")

# Finals held for one session while its client has not acknowledged them: a client that never
# acknowledges still gets the newest hour or so of a meeting replayed, never unbounded memory.
MAX_HELD_FINALS = 2_000


@dataclass(frozen=True, slots=True, kw_only=True)
class ResumeKey:
    """What the daemon keeps of a session's token."""

    session: str
    secret_sha256: str

    @classmethod
    def new(cls, session: str) -> tuple[ResumeKey, str]:
        """A fresh key for `session` and the token to give its client."""
        secret = secrets.token_urlsafe(24)
        return cls(session=session, secret_sha256=_sha256(secret)), f"{session}.{secret}"

    def check(self, token: str) -> None:
        """Raise ResumeFailedError unless `token` is this session's."""
        session, _, secret = token.partition(".")
        if session != self.session or not hmac.compare_digest(_sha256(secret), self.secret_sha256):
            raise ResumeFailedError("wrong resume token")


def session_of_token(token: str) -> str:
    """The session id a token names (not yet checked)."""
    session, dot, secret = token.partition(".")
    if not (dot and secret and _SESSION_ID.match(session)):
        raise ResumeFailedError("malformed resume token")
    return session


def session_id(instance: str, number: str) -> str:
    """The id of session `number` (hexadecimal) on `instance` ("": a daemon with no name)."""
    return f"{instance}_{number}" if instance else number


def session_number(session: str) -> str:
    """The hexadecimal part of a session id, whichever instance gave it out."""
    return session.rpartition("_")[2]


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


class HeldFinals:
    """A session's finals from the oldest one its client has not acknowledged, in order."""

    def __init__(self, limit: int = MAX_HELD_FINALS) -> None:
        self._finals: deque[Final] = deque(maxlen=limit)

    def add(self, final: Final) -> None:
        self._finals.append(final)

    def ack(self, segment: int) -> None:
        """The client holds every final up to `segment`: stop holding them."""
        while self._finals and self._finals[0].segment <= segment:
            self._finals.popleft()

    def replay(self, since: int | None) -> list[Final]:
        """What a resuming client gets: finals from segment `since` (None: all held)."""
        return [f for f in self._finals if since is None or f.segment >= since]

    def __len__(self) -> int:
        return len(self._finals)
