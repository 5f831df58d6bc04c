"""The browser client's files as the daemon serves them: allow-list, types, caching, TLS."""

from __future__ import annotations

import asyncio
import http.client
import json
import shutil
import ssl
import subprocess
import sys
from pathlib import Path

import pytest
from daemon_harness import make_config, running_daemon
from websockets.asyncio.client import connect

from captiond.server.http import ROUTES, load


def run(coro: object) -> None:
    asyncio.run(coro)  # type: ignore[arg-type]


def get(
    port: int,
    path: str,
    headers: dict[str, str] | None = None,
    context: ssl.SSLContext | None = None,
) -> tuple[int, http.client.HTTPMessage, bytes]:
    """One GET with the path sent exactly as given (http.client does not normalise it)."""
    if context is None:
        conn: http.client.HTTPConnection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    else:
        conn = http.client.HTTPSConnection("localhost", port, timeout=10, context=context)
    try:
        conn.request("GET", path, headers=headers or {})
        resp = conn.getresponse()
        return resp.status, resp.headers, resp.read()
    finally:
        conn.close()


@pytest.mark.parametrize(
    ("path", "content_type", "marker"),
    [
        ("/", "text/html; charset=utf-8", b'<script type="module" src="app.js">'),
        ("/?watch=room", "text/html; charset=utf-8", b"<!doctype html>"),
        ("/index.html", "text/html; charset=utf-8", b"<!doctype html>"),
        ("/app.js", "text/javascript; charset=utf-8", b"/v1/stream"),
        ("/caption-view.js", "text/javascript; charset=utf-8", b"export class CaptionView"),
        ("/worklet.js", "text/javascript; charset=utf-8", b"registerProcessor"),
        ("/favicon.svg", "image/svg+xml", b"<svg"),
        ("/style.css", "text/css; charset=utf-8", b".captions"),
    ],
)
def test_page_files_are_served_with_their_types(
    path: str, content_type: str, marker: bytes
) -> None:
    async def scenario() -> None:
        async with running_daemon() as daemon:
            status, headers, body = await asyncio.to_thread(get, daemon.port, path)
            assert status == 200
            assert headers["Content-Type"] == content_type
            assert headers["Cache-Control"] == "no-cache"
            assert headers["X-Content-Type-Options"] == "nosniff"
            assert "default-src 'self'" in headers["Content-Security-Policy"]
            assert int(headers["Content-Length"]) == len(body)
            assert marker in body
            # Revalidation: the same ETag gets a bodiless 304.
            etag = headers["ETag"]
            status, headers, body = await asyncio.to_thread(
                get, daemon.port, path, {"If-None-Match": etag}
            )
            assert (status, body, headers["ETag"]) == (304, b"", etag)

    run(scenario())


@pytest.mark.parametrize(
    "path",
    [
        "/../pyproject.toml",
        "/%2e%2e/",
        "/%2e%2e/pyproject.toml",
        "/..%2fpyproject.toml",
        "/app.js/../../pyproject.toml",
        "//etc/passwd",
        "/__init__.py",
        "/web.py",
        "/clients/web/index.html",
        "/App.js",
        "/app.js.map",
        "/favicon.ico",
    ],
)
def test_only_listed_paths_are_served(path: str) -> None:
    async def scenario() -> None:
        async with running_daemon() as daemon:
            status, headers, body = await asyncio.to_thread(get, daemon.port, path)
            assert status == 404, body
            assert headers["Content-Type"] == "text/plain; charset=utf-8"
            assert b"[project]" not in body and b"root:" not in body

    run(scenario())


def test_every_route_ships_as_package_data() -> None:
    for name, content_type in ROUTES.values():
        assert load(name, content_type).body, name


def make_self_signed(folder: Path) -> tuple[Path, Path]:
    """docs/guides/browsers.md's openssl command: a certificate for localhost and 127.0.0.1."""
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("the openssl command is not installed")
    cert, key = folder / "cert.pem", folder / "key.pem"
    subprocess.run(
        [
            openssl,
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=localhost",
            "-addext",
            "subjectAltName=DNS:localhost,IP:127.0.0.1",
            "-keyout",
            str(key),
            "-out",
            str(cert),
        ],
        check=True,
        capture_output=True,
    )
    return cert, key


def test_tls_serves_https_page_and_wss_stream(tmp_path: Path) -> None:
    cert, key = make_self_signed(tmp_path)
    config = make_config(server={"tls_cert": str(cert), "tls_key": str(key)})
    trust = ssl.create_default_context(cafile=str(cert))

    async def scenario() -> None:
        async with running_daemon(config) as daemon:
            status, headers, body = await asyncio.to_thread(get, daemon.port, "/", None, trust)
            assert status == 200 and headers["Content-Type"] == "text/html; charset=utf-8"
            assert b"app.js" in body
            target = f"wss://localhost:{daemon.port}/v1/stream"
            async with connect(target, ssl=trust) as conn:
                ready = json.loads(await conn.recv())
                assert ready["type"] == "ready"
                await conn.send(json.dumps({"type": "end"}))
                assert json.loads(await conn.recv())["type"] == "done"
            # Plain HTTP on the TLS port is not served.
            with pytest.raises((http.client.HTTPException, ConnectionError)):
                await asyncio.to_thread(get, daemon.port, "/")

    run(scenario())


def test_the_ready_line_names_wss_with_tls(tmp_path: Path) -> None:
    cert, key = make_self_signed(tmp_path)
    serve = [sys.executable, "-m", "captiond.cli", "serve", "--engine=fake", "--port=0"]
    proc = subprocess.Popen(
        [*serve, "--tls-cert", str(cert), "--tls-key", str(key)], stderr=subprocess.PIPE, text=True
    )
    assert proc.stderr is not None
    try:
        lines = [proc.stderr.readline()]
        while "ready: " not in lines[-1] and lines[-1]:
            lines.append(proc.stderr.readline())
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    assert "ready: wss://127.0.0.1:" in lines[-1], "".join(lines)
