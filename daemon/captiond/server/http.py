"""The daemon's plain HTTP side: /healthz, /metrics and the pre-upgrade checks of every
websocket endpoint (`HttpAnswers`), and the browser client's static files (clients/web, shipped
as the `captiond_web` package).

Owns the allow-list of URL paths the daemon serves over plain HTTP besides its websocket
endpoints, with their content types and cache headers. Runs on the event-loop thread, inside
websockets' `process_request`; files are read once, on first use, and kept in memory (a few KiB).

Only the exact paths in `ROUTES` are served: the request path is compared as sent, never joined
to a filesystem path, so `..`, percent-encoding and unknown names simply do not match.
"""

from __future__ import annotations

import email.utils
import functools
import hashlib
import http
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from importlib.resources import files
from urllib.parse import urlsplit

from websockets.asyncio.server import ServerConnection
from websockets.datastructures import Headers, MultipleValuesError
from websockets.http11 import Request, Response

from captiond.config import Config
from captiond.dialects import Dialect
from captiond.dialects.endpoints import ENDPOINTS, Endpoint
from captiond.dialects.native import Query
from captiond.errors import (
    RequestRejectedError,
    SessionError,
)
from captiond.ops.metrics import Metrics
from captiond.server.access import (
    check_host,
    check_origin,
    check_token,
    machine_names,
)

log = logging.getLogger(__name__)

PACKAGE = "captiond_web"
_HTML = "text/html; charset=utf-8"
_JS = "text/javascript; charset=utf-8"
_CSS = "text/css; charset=utf-8"

# URL path → (file in the package, content type).
ROUTES: dict[str, tuple[str, str]] = {
    "/": ("index.html", _HTML),
    "/index.html": ("index.html", _HTML),
    "/app.js": ("app.js", _JS),
    "/capture.js": ("capture.js", _JS),
    "/caption-view.js": ("caption-view.js", _JS),
    "/link.js": ("link.js", _JS),
    "/settings.js": ("settings.js", _JS),
    "/transcript.js": ("transcript.js", _JS),
    "/worklet.js": ("worklet.js", _JS),
    "/style.css": ("style.css", _CSS),
    "/favicon.svg": ("favicon.svg", "image/svg+xml"),
}

# The page talks only to its own origin (ws:/wss: included under 'self' in CSP 3) and loads
# nothing from elsewhere, which also makes it work offline.
_SECURITY_HEADERS = (
    (
        "Content-Security-Policy",
        "default-src 'self'; connect-src 'self'; img-src 'self' data:; "
        "object-src 'none'; base-uri 'none'; frame-ancestors 'none'",
    ),
    ("X-Content-Type-Options", "nosniff"),
    ("Referrer-Policy", "no-referrer"),
    # Microphone for this origin only; nothing else a caption page needs.
    ("Permissions-Policy", "microphone=(self), camera=(), geolocation=()"),
)


@dataclass(frozen=True, slots=True, kw_only=True)
class StaticFile:
    body: bytes
    content_type: str
    etag: str


@functools.cache
def load(name: str, content_type: str) -> StaticFile:
    """One file of the package, read once: the daemon's files do not change while it runs."""
    body = files(PACKAGE).joinpath(name).read_bytes()
    etag = '"' + hashlib.sha256(body).hexdigest()[:20] + '"'
    return StaticFile(body=body, content_type=content_type, etag=etag)


def static_response(path: str, request_headers: Headers) -> Response | None:
    """The response for an allow-listed `path`, or None when the path is not a static file.

    Files are served with `Cache-Control: no-cache` and an ETag: browsers revalidate on every
    load (a daemon upgrade shows at once) and get a bodiless 304 when nothing changed.
    """
    route = ROUTES.get(path)
    if route is None:
        return None
    page = load(*route)
    headers = Headers(
        [
            ("Date", email.utils.formatdate(usegmt=True)),
            ("Connection", "close"),
            ("Cache-Control", "no-cache"),
            ("ETag", page.etag),
            *_SECURITY_HEADERS,
        ]
    )
    if page.etag in request_headers.get("If-None-Match", ""):
        status = http.HTTPStatus.NOT_MODIFIED
        return Response(status.value, status.phrase, headers, b"")
    status = http.HTTPStatus.OK
    headers["Content-Type"] = page.content_type
    headers["Content-Length"] = str(len(page.body))
    return Response(status.value, status.phrase, headers, page.body)


__all__ = ["ROUTES", "StaticFile", "load", "static_response"]


# Liveness (the engine answers) and readiness (it also takes new streams: not draining).
PROBES = ("/healthz", "/readyz")


def probe_answer(path: str, why_not: str) -> tuple[http.HTTPStatus, str]:
    """A probe's status and one-line body: 200 "ok" ("ready"), or 503 and why not."""
    if why_not:
        return http.HTTPStatus.SERVICE_UNAVAILABLE, why_not + "\n"
    return http.HTTPStatus.OK, ("ok" if path == "/healthz" else "ready") + "\n"


class HttpAnswers:
    """What the daemon answers over plain HTTP, before a websocket upgrade or instead of one:
    /healthz, /readyz, /metrics, the page's files, and refusals of a websocket request whose origin,
    token or query is refused (in the endpoint's own protocol's form where it has one).
    Event-loop thread (websockets calls `process_request` there)."""

    def __init__(
        self,
        config: Config,
        metrics: Metrics,
        *,
        unhealthy: Callable[[], str],
        not_ready: Callable[[], str],
        check_query: Callable[[Dialect], object],
    ) -> None:
        self._config = config
        self._metrics = metrics
        # Why /healthz (alive) and /readyz (takes new streams) fail ("": they do not); with
        # workers the pool answers both (workers/).
        self._unhealthy = unhealthy
        self._not_ready = not_ready
        # Parses a dialect's stream parameters, raising SessionError for a bad query.
        self._check_query = check_query
        self._machine_names = machine_names()  # the names its own page may be reached by

    def process_request(self, connection: ServerConnection, request: Request) -> Response | None:
        """websockets' `process_request`: None lets the websocket handshake go on."""
        try:
            return self._answer_request(connection, request)
        except MultipleValuesError as exc:
            # Two Origin, Host or Authorization headers (…): refused, never one of them picked.
            log.info("refused %s from %s: repeated header", request.path, connection.remote_address)
            return connection.respond(
                http.HTTPStatus.BAD_REQUEST, f"more than one {exc.args[0]} header\n"
            )

    def count_refused(self, status: int) -> None:
        self._metrics.refused.labels(reason=http.HTTPStatus(status).phrase).inc()

    def _answer_request(self, connection: ServerConnection, request: Request) -> Response | None:
        url = urlsplit(request.path)
        if url.path in PROBES:
            why = self._unhealthy() if url.path == "/healthz" else self._not_ready()
            status, body = probe_answer(url.path, why)
            return connection.respond(status, body)
        endpoint = ENDPOINTS.get(url.path)
        if endpoint is not None or url.path in ("/v1/captions", "/metrics"):
            try:
                check_origin(
                    request.headers.get("Origin"),
                    request.headers.get("Host"),
                    self._config.server.allowed_origins,
                    self._machine_names,
                )
                check_token(
                    self._config.auth.token,
                    Query(url.query).every("token"),
                    request.headers.get("Authorization"),
                    endpoint.auth_schemes if endpoint else ("bearer",),
                )
                if url.path == "/metrics" and not self._config.auth.token:
                    check_host(
                        request.headers.get("Host"),
                        self._config.server.allowed_origins,
                        self._machine_names,
                    )
            except RequestRejectedError as exc:
                log.info("refused %s from %s: %s", url.path, connection.remote_address, exc)
                self.count_refused(exc.status)
                response = _refuse(connection, endpoint, exc.status, str(exc))
                if exc.status == http.HTTPStatus.UNAUTHORIZED:
                    response.headers["WWW-Authenticate"] = 'Bearer realm="captiond"'
                return response
            if url.path == "/metrics":
                body, content_type = self._metrics.render()
                response = connection.respond(http.HTTPStatus.OK, body)
                return _with_headers(response, {"Content-Type": content_type})
            if endpoint is not None and endpoint.check_query_first:
                query = Query(url.query)
                try:
                    self._check_query(endpoint.dialect(query))
                except SessionError as exc:
                    self._metrics.refused.labels(reason="bad query").inc()
                    return _refuse(connection, endpoint, http.HTTPStatus.BAD_REQUEST, str(exc))
            if "upgrade" not in request.headers.get("Connection", "").lower():
                return connection.respond(
                    http.HTTPStatus.UPGRADE_REQUIRED, f"{url.path} is a websocket endpoint\n"
                )
            return None
        return static_response(url.path, request.headers) or connection.respond(
            http.HTTPStatus.NOT_FOUND, "not found\n"
        )


def _refuse(
    connection: ServerConnection, endpoint: Endpoint | None, status: int, reason: str
) -> Response:
    """A refused handshake: in the endpoint's protocol's own form where it has one."""
    if endpoint is None or endpoint.refusal is None:
        return connection.respond(http.HTTPStatus(status), f"{reason}\n")
    body, headers = endpoint.refusal(status, reason)
    return _with_headers(connection.respond(http.HTTPStatus(status), body), headers)


def _with_headers(response: Response, headers: Mapping[str, str]) -> Response:
    """`response` with each of `headers` in place of any it had of that name: websockets'
    `Headers` adds a value on assignment, and `respond` has set a text/plain Content-Type."""
    for name, value in headers.items():
        if name in response.headers:
            del response.headers[name]
        response.headers[name] = value
    return response
