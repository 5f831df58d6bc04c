"""Headless Chromium for tests of the web client, driven over the DevTools protocol (CDP).

`launch_chromium` starts the Debian `chromium` with a fresh profile and fake media devices and
yields its DevTools URL; `open_page` opens a tab, in a browser context of its own unless given
one, and speaks CDP to it with `websockets`. Below them: small helpers to drive the captions
page, and WAV files for the fake microphone.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import json
import shutil
import subprocess
import time
import wave
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import soxr
from testkit import missing_tool
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed

from captiond.server.daemon import Daemon

FLAGS = [
    "--headless=new",
    "--no-sandbox",
    "--use-fake-ui-for-media-stream",
    "--use-fake-device-for-media-stream",
    "--autoplay-policy=no-user-gesture-required",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--disable-gpu",
    "--remote-debugging-port=0",
]


def chromium_or_skip() -> str:
    """The chromium binary; a missing one skips the test locally and fails it in CI."""
    path = shutil.which("chromium")
    if path is None:
        missing_tool("chromium is not installed (apt-get install chromium)")
    return path


@contextlib.contextmanager
def launch_chromium(profile: Path, fake_audio: Path | None = None) -> Iterator[str]:
    """Run headless Chromium with a fresh profile; yield its browser DevTools websocket URL."""
    args = [chromium_or_skip(), *FLAGS, f"--user-data-dir={profile}"]
    if fake_audio is not None:
        args.append(f"--use-file-for-fake-audio-capture={fake_audio}")
    profile.mkdir(parents=True, exist_ok=True)
    log_path = profile.parent / f"{profile.name}.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen([*args, "about:blank"], stdout=log, stderr=log)
    try:
        port_file = profile / "DevToolsActivePort"
        deadline = time.monotonic() + 60
        while not (port_file.is_file() and port_file.read_text().count("\n") >= 1):
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"chromium did not start: {log_path.read_text(errors='replace')}")
            time.sleep(0.1)
        port, path = port_file.read_text().split()[:2]
        yield f"ws://127.0.0.1:{port}{path}"
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class Page:
    """One tab: CDP commands by id, with console output kept for failure messages."""

    def __init__(self, conn: ClientConnection) -> None:
        self._conn = conn
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self.console: list[str] = []
        # What `serve` answers for its URL pattern (None: `fail` fails it); the tasks
        # answering requests; how many requests `fail` failed.
        self._served: str | None = ""
        self.failed_requests = 0
        self._answers: set[asyncio.Task[Any]] = set()
        self._reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        with contextlib.suppress(ConnectionClosed):
            await self._dispatch()

    async def _dispatch(self) -> None:
        async for raw in self._conn:
            msg = json.loads(raw)
            if "id" in msg:
                self._pending.pop(msg["id"]).set_result(msg)
            elif msg.get("method") == "Runtime.consoleAPICalled":
                args = msg["params"]["args"]
                self.console.append(
                    " ".join(str(a.get("value", a.get("description"))) for a in args)
                )
            elif msg.get("method") == "Runtime.exceptionThrown":
                self.console.append(str(msg["params"]["exceptionDetails"]))
            elif msg.get("method") == "Fetch.requestPaused":
                # Answered by a task: a call waits for its reply, which this loop reads.
                answer = asyncio.create_task(self._answer(msg["params"]["requestId"]))
                self._answers.add(answer)
                answer.add_done_callback(self._answers.discard)

    async def _answer(self, request_id: str) -> None:
        if self._served is None:
            await self.call("Fetch.failRequest", requestId=request_id, errorReason="Failed")
            self.failed_requests += 1
            return
        body = base64.b64encode(self._served.encode()).decode()
        headers = [{"name": "Content-Type", "value": "text/javascript"}]
        await self.call(
            "Fetch.fulfillRequest",
            requestId=request_id,
            responseCode=200,
            responseHeaders=headers,
            body=body,
        )

    async def call(self, method: str, **params: Any) -> dict[str, Any]:
        msg_id = next(self._ids)
        future = asyncio.get_running_loop().create_future()
        self._pending[msg_id] = future
        await self._conn.send(json.dumps({"id": msg_id, "method": method, "params": params}))
        reply = await asyncio.wait_for(future, 30)
        if "error" in reply:
            raise RuntimeError(f"{method}: {reply['error']}")
        result: dict[str, Any] = reply["result"]
        return result

    async def evaluate(self, expression: str) -> Any:
        result = await self.call(
            "Runtime.evaluate", expression=expression, awaitPromise=True, returnByValue=True
        )
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    async def serve(self, url_pattern: str, script: str) -> None:
        """Answer the page's requests for `url_pattern` (`*` wildcards) with `script`: a test's
        instrumented copy of one of the page's scripts."""
        self._served = script
        await self.call("Fetch.enable", patterns=[{"urlPattern": url_pattern}])

    async def fail(self, url_pattern: str) -> None:
        """Fail the page's requests for `url_pattern` as a network fault would, until
        `stop_intercepting`."""
        self._served = None
        await self.call("Fetch.enable", patterns=[{"urlPattern": url_pattern}])

    async def stop_intercepting(self) -> None:
        await self.call("Fetch.disable")

    async def navigate(self, url: str) -> None:
        await self.call("Page.navigate", url=url)
        await self.wait_for("document.readyState === 'complete' && !!document.body", "page load")

    async def wait_for(self, expression: str, what: str, timeout_s: float = 30) -> Any:
        """Poll `expression` until it is truthy; fail with the page's state if it never is."""
        deadline = time.monotonic() + timeout_s
        while True:
            value = await self.evaluate(expression)
            if value:
                return value
            if time.monotonic() > deadline:
                state = await self.evaluate(
                    "JSON.stringify(['state', 'notice', 'clock', 'transcript', 'live']"
                    ".map((id) => document.getElementById(id)?.textContent))"
                )
                raise AssertionError(f"timed out waiting for {what}: {state}; {self.console}")
            await asyncio.sleep(0.2)

    async def screenshot(self, path: Path) -> None:
        shot = await self.call("Page.captureScreenshot", format="png")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(shot["data"]))

    async def viewport(self, width: int, height: int, mobile: bool = False) -> None:
        await self.call(
            "Emulation.setDeviceMetricsOverride",
            width=width,
            height=height,
            deviceScaleFactor=1,
            mobile=mobile,
        )


@contextlib.asynccontextmanager
async def browser_context(browser_url: str) -> AsyncIterator[str]:
    """A new context of the browser at `browser_url`: its own storage, as a fresh profile's.
    Yields its id for `open_page`; disposed of afterwards."""
    async with connect(browser_url, max_size=None) as conn:
        browser = Page(conn)
        created = await browser.call("Target.createBrowserContext")
        context_id: str = created["browserContextId"]
        try:
            yield context_id
        finally:
            await browser.call("Target.disposeBrowserContext", browserContextId=context_id)


@contextlib.asynccontextmanager
async def open_page(browser_url: str, context_id: str | None = None) -> AsyncIterator[Page]:
    """A new tab of the browser at `browser_url` (from `launch_chromium`), closed afterwards.
    It opens in `context_id` (tabs that share a transcript) or in a context of its own: tests
    share a browser, and a page at a port an earlier test's page used would otherwise load
    that test's stored transcript."""
    if context_id is None:
        async with browser_context(browser_url) as own, open_page(browser_url, own) as tab:
            yield tab
        return
    base = browser_url.split("/devtools/")[0]
    async with connect(browser_url, max_size=None) as browser:
        page = Page(browser)
        target = await page.call(
            "Target.createTarget", url="about:blank", browserContextId=context_id
        )
        target_id = target["targetId"]
        try:
            async with connect(f"{base}/devtools/page/{target_id}", max_size=None) as conn:
                tab = Page(conn)
                await tab.call("Runtime.enable")
                await tab.call("Page.enable")
                yield tab
        finally:
            await page.call("Target.closeTarget", targetId=target_id)


# -- the page ---------------------------------------------------------------------------------

# The transcript's final texts, as the page shows them.
FINAL_TEXTS_JS = (
    "[...document.querySelectorAll('#transcript .final .text')].map(e => e.textContent)"
)


def page_url(daemon: Daemon, query: str = "") -> str:
    return f"http://127.0.0.1:{daemon.port}/{'?' + query if query else ''}"


def click(button_id: str) -> str:
    return f"document.getElementById({button_id!r}).click()"


def click_mode(mode: str) -> str:
    return f"document.querySelector('button[data-mode={mode}]').click()"


def choose_theme(theme: str) -> str:
    return f"theme.value = '{theme}'; theme.dispatchEvent(new Event('change'))"


async def notice(page: Page) -> str:
    """The notice, once one shows."""
    text: str = await page.wait_for("!notice.hidden && notice.textContent", "a notice")
    return text


async def finals_at_least(page: Page, count: int, timeout_s: float = 30) -> list[str]:
    texts: list[str] = await page.wait_for(
        f"(t => t.length >= {count} && t)({FINAL_TEXTS_JS})", f"{count} finals", timeout_s
    )
    return texts


# -- the fake microphone: Chromium plays a WAV file in a loop -----------------------------------


def tone(seconds: float, hz: float = 220.0) -> np.ndarray:
    """A loud tone (speech to LoudnessVad and the fake engine; a voice to ToneEmbedder)."""
    t = np.arange(int(seconds * 16_000)) / 16_000
    return 0.3 * np.sin(2 * np.pi * hz * t)


def silence(seconds: float) -> np.ndarray:
    return np.zeros(int(seconds * 16_000))


def write_capture(samples: np.ndarray, path: Path) -> Path:
    """Float samples at 16 kHz as the 48 kHz WAV Chromium's fake microphone plays in a loop."""
    at_48k = soxr.resample(samples.astype(np.float32), 16_000, 48_000)
    with wave.open(str(path), "wb") as wf:
        wf.setnchannels(1)
        wf.setsampwidth(2)
        wf.setframerate(48_000)
        wf.writeframes((np.clip(at_48k, -1, 1) * 32767).astype("<i2").tobytes())
    return path


class FlakyNetwork:
    """A TCP relay between the page and the daemon that can be cut, as a Wi-Fi drop cuts it:
    open connections break (no close frame: 1006) and new ones are refused until it is back.
    While `held`, what the page sends waits in the network."""

    def __init__(self, target_port: int, *, rewrite_host: bool = False) -> None:
        self.target_port = target_port
        # Forward with the daemon's own Host, as nginx does without `proxy_set_header Host`:
        # the page's Origin, its own address, is then not the daemon's.
        self.rewrite_host = rewrite_host
        self.port = 0
        self.connections = 0
        self.down = False
        self.held = False
        self._writers: set[asyncio.StreamWriter] = set()

    async def __aenter__(self) -> FlakyNetwork:
        self._server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.cut()
        self._server.close()
        await self._server.wait_closed()

    def cut(self) -> None:
        self.down = True
        for writer in self._writers:
            writer.transport.abort()

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.down:
            writer.transport.abort()
            return
        self.connections += 1
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        self._writers |= {writer, up_writer}
        if self.rewrite_host:
            head = await reader.readuntil(b"\r\n\r\n")
            host = f"Host: 127.0.0.1:{self.target_port}".encode()
            lines = head.split(b"\r\n")
            up_writer.write(
                b"\r\n".join(host if h.lower().startswith(b"host:") else h for h in lines)
            )

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            with contextlib.suppress(ConnectionError):
                while data := await src.read(65536):
                    while dst is up_writer and self.held and not self.down:
                        await asyncio.sleep(0.05)
                    if self.down:
                        break
                    dst.write(data)
                    await dst.drain()
            # One side is gone: the other goes too, without a word, as on a broken network.
            writer.transport.abort()
            up_writer.transport.abort()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))
        self._writers -= {writer, up_writer}
