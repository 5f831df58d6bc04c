"""Who may open a websocket, decided before the upgrade: Origin, token, connections per IP.

Sans-I/O (functions of a request's headers and query, and a counter), on the event-loop thread.
server.py calls `check_request` from websockets' `process_request` and turns a refusal into its
HTTP status, so a refused client never gets a websocket.

The rules, as the README's security section states them:
- Origin: browsers send it, other clients do not. A request without Origin is let in; one with
  Origin only when it is the daemon's own origin (the page it serves) or listed in
  `[server] allowed_origins` ("*": any, "null" included).
- Token (when `[auth] token` is set): `Authorization: Bearer TOKEN` (RFC 6750; the scheme is
  case-insensitive) or `?token=TOKEN`. Every credential given must be right: a wrong one is
  never outvoted by a right one, and an Authorization header of another scheme is refused.
  A vendor endpoint also takes the form its SDK sends (dialects/endpoints.py: Deepgram's
  `Token KEY`, AssemblyAI's bare key).
"""

from __future__ import annotations

import hmac
from collections import Counter
from collections.abc import Sequence
from urllib.parse import urlsplit

from captiond.errors import OriginNotAllowedError, UnauthorizedError

_DEFAULT_PORTS = {"http": 80, "https": 443, "ws": 80, "wss": 443}


def check_origin(origin: str | None, host: str | None, allowed: tuple[str, ...]) -> None:
    """Refuse a cross-site page. `host` is the request's Host header."""
    if origin is None or "*" in allowed:
        return
    if origin.lower().rstrip("/") in {a.lower().rstrip("/") for a in allowed}:
        return
    if host is not None and _same_host(origin, host):
        return
    raise OriginNotAllowedError(
        f"origin {origin!r} may not connect; add it to [server] allowed_origins"
    )


def _same_host(origin: str, host: str) -> bool:
    """The Origin names the host (and port) the request was sent to. A Host without a port
    (behind a reverse proxy on 80/443) matches on the name alone."""
    try:
        parts = urlsplit(origin)
        target = urlsplit("//" + host)
        if parts.scheme not in _DEFAULT_PORTS or not parts.hostname:
            return False  # "null" (sandboxed frames, file://) or garbage
        if not target.hostname or parts.hostname != target.hostname.lower():
            return False
        origin_port = parts.port or _DEFAULT_PORTS[parts.scheme]
        host_port = target.port
    except ValueError:  # "http://[::1": no URL at all
        return False
    return host_port is None or host_port == origin_port


def check_token(
    token: str,
    query_tokens: Sequence[str],
    authorization: str | None,
    schemes: tuple[str, ...] = ("bearer",),
) -> None:
    """Refuse a request without the configured token (no token configured: anyone).
    `query_tokens` are every `?token=` given; `schemes` are the Authorization schemes an
    endpoint's clients use (lower case; "" is a bare key, as AssemblyAI's SDK sends it)."""
    if not token:
        return
    given = list(query_tokens)
    if authorization is not None:
        scheme, _, credentials = authorization.strip().partition(" ")
        if not credentials.strip() and "" in schemes:
            scheme, credentials = "", scheme
        if scheme.lower() not in schemes or not credentials.strip():
            forms = " or ".join(f"'{s.title()} TOKEN'" if s else "'TOKEN'" for s in schemes)
            raise UnauthorizedError(f"the Authorization header must be {forms}")
        given.append(credentials.strip())
    if not given:
        raise UnauthorizedError("a token is required: Authorization: Bearer TOKEN, or ?token=")
    for candidate in given:
        # surrogateescape: header bytes that are not UTF-8 compare (unequal), never raise.
        if not hmac.compare_digest(candidate.encode(errors="surrogateescape"), token.encode()):
            raise UnauthorizedError("wrong token")


class ConnectionsPerIp:
    """Open websocket connections per client IP address."""

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._open: Counter[str] = Counter()

    def try_open(self, ip: str) -> bool:
        if self._open[ip] >= self._limit:
            return False
        self._open[ip] += 1
        return True

    def close(self, ip: str) -> None:
        self._open[ip] -= 1
        if self._open[ip] <= 0:
            del self._open[ip]
