"""Static files of the browser client (clients/web, shipped as the `captiond_web` package).

Owns the allow-list of URL paths the daemon serves over plain HTTP besides its websocket
endpoints, with their content types and cache headers. Runs on the event-loop thread, inside
`Daemon._process_request`; files are read once, on first use, and kept in memory (a few KiB).

Only the exact paths in `ROUTES` are served: the request path is compared as sent, never joined
to a filesystem path, so `..`, percent-encoding and unknown names simply do not match.
"""

from __future__ import annotations

import email.utils
import functools
import hashlib
import http
from dataclasses import dataclass
from importlib.resources import files

from websockets.datastructures import Headers
from websockets.http11 import Response

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
