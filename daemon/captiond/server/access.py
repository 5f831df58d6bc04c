"""Who may open a websocket, decided before the upgrade: Origin, token, connections per IP.

Sans-I/O (functions of a request's headers and query, and a counter), on the event-loop thread.
server/daemon.py calls `check_request` from websockets' `process_request` and turns a refusal into
its HTTP status, so a refused client never gets a websocket.

The rules, as docs/operations/security.md states them:
- Origin: browsers send it, other clients do not. A request without Origin is let in; one with
  Origin only when it is the daemon's own origin (the page it serves) or listed in
  `[server] allowed_origins` ("*": any, "null" included). The daemon's own origin is one whose
  host the request was sent to (its Host) *and* that names this machine: an IP address,
  `localhost`, or the machine's host name. Otherwise a site whose DNS name is rebound to
  127.0.0.1 would be the daemon's own origin in the browser's eyes (DNS rebinding); a name
  that reaches the daemon through a reverse proxy is listed in `allowed_origins`.
- Host, for `/metrics` without a token: a page's GET of its own origin carries no Origin, so a
  site rebound to 127.0.0.1 could read the metrics; the name the request was sent to must name
  this machine, as above, or be the host of an origin in `allowed_origins`.
- Token (when `[auth] token` is set): `Authorization: Bearer TOKEN` (RFC 6750; the scheme is
  case-insensitive) or `?token=TOKEN`. Every credential given must be right: a wrong one is
  never outvoted by a right one, and an Authorization header of another scheme is refused.
  A vendor endpoint also takes the form its SDK sends (dialects/endpoints.py: Deepgram's
  `Token KEY`, AssemblyAI's bare key).
- Connections per IP count the client's address: behind a load balancer listed in
  `[server] trusted_proxies`, the last address of its X-Forwarded-For (`client_address`).
"""

from __future__ import annotations

import hmac
import ipaddress
import socket
from collections import Counter
from collections.abc import Sequence
from urllib.parse import urlsplit

from captiond.errors import HostNotAllowedError, OriginNotAllowedError, UnauthorizedError

_DEFAULT_PORTS = {"http": 80, "https": 443, "ws": 80, "wss": 443}


def machine_names() -> frozenset[str]:
    """This machine's names a browser may reach the daemon by, besides IP addresses and
    `localhost`: its host name (and first label) and that as an mDNS `.local` name. No DNS
    lookup: one could stall the daemon's start."""
    name = socket.gethostname().lower().rstrip(".")
    short = name.split(".")[0]
    return frozenset(n for n in (name, short, f"{short}.local") if n and n != ".local")


def check_origin(
    origin: str | None, host: str | None, allowed: tuple[str, ...], names: frozenset[str]
) -> None:
    """Refuse a cross-site page. `host` is the request's Host header; `names` the machine's
    own (`machine_names`)."""
    if origin is None or "*" in allowed:
        return
    if origin.lower().rstrip("/") in {a.lower().rstrip("/") for a in allowed}:
        return
    same_host = host is not None and _same_host(origin, host)
    if same_host and _names_this_machine(str(urlsplit(origin).hostname), names):
        return
    reason = "it is not this daemon's origin" if not same_host else "its host is not this machine"
    raise OriginNotAllowedError(
        f"origin {origin!r} may not connect ({reason}); add it to [server] allowed_origins"
    )


def check_host(host: str | None, allowed: tuple[str, ...], names: frozenset[str]) -> None:
    """Refuse a request sent to a name that may be an outside site's (see the module
    docstring): one that names neither this machine nor an allowed origin's host. A request
    without a Host header comes from no browser and passes."""
    if host is None or "*" in allowed:
        return
    try:
        name = urlsplit("//" + host).hostname
    except ValueError:  # "[::1": no host at all
        name = None
    if name and (
        _names_this_machine(name, names) or name in {urlsplit(a).hostname for a in allowed}
    ):
        return
    raise HostNotAllowedError(
        f"host {host!r} does not name this machine (a site's name rebound to it?); add its "
        "origin to [server] allowed_origins, or set a token"
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


def _names_this_machine(hostname: str, names: frozenset[str]) -> bool:
    """An IP address, `localhost` (RFC 6761: `*.localhost` too) or one of `names`: never a
    name whose DNS an outside site controls."""
    try:
        ipaddress.ip_address(hostname)
        return True
    except ValueError:
        pass
    name = hostname.rstrip(".")
    return name == "localhost" or name.endswith(".localhost") or name in names


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
    """Open websocket connections per client IP address, and the streams each address left
    held for a resume (dropped, not ended): those still take a session slot, so they count
    with the address's open connections when it opens a new stream, or one address could
    fill the daemon by connecting and dropping."""

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._open: Counter[str] = Counter()
        self._held: dict[str, str] = {}  # session id -> the address that last streamed it

    def hold(self, session_id: str, ip: str) -> None:
        self._held[session_id] = ip

    def release(self, session_id: str) -> None:
        """The stream is streamed again (resumed), has ended, or was let go."""
        self._held.pop(session_id, None)

    def over_limit(self, ip: str) -> list[str]:
        """The streams `ip` holds to let go, oldest first, so that they and its open
        connections (the new stream's included) fit its limit; they are released here."""
        held = [session_id for session_id, held_ip in self._held.items() if held_ip == ip]
        excess = self._open[ip] + len(held) - self._limit
        let_go = held[: max(0, excess)]
        for session_id in let_go:
            del self._held[session_id]
        return let_go

    def try_open(self, ip: str) -> bool:
        if self._open[ip] >= self._limit:
            return False
        self._open[ip] += 1
        return True

    def close(self, ip: str) -> None:
        self._open[ip] -= 1
        if self._open[ip] <= 0:
            del self._open[ip]


def client_address(peer: str, forwarded_for: str | None, trusted: Sequence[str]) -> str:
    """The client's address: `peer`, or, when `peer` is a trusted load balancer's, the last
    address of its X-Forwarded-For (the one it appended: earlier ones are the client's word).
    A header that is missing or not an address leaves `peer`."""
    if not forwarded_for or not trusted:
        return peer
    try:
        address = ipaddress.ip_address(peer)
    except ValueError:
        return peer
    if not any(address in ipaddress.ip_network(net, strict=False) for net in trusted):
        return peer
    last = forwarded_for.rsplit(",", 1)[-1].strip()
    try:
        return str(ipaddress.ip_address(last))
    except ValueError:
        return peer
