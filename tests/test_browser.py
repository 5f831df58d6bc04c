"""The web client in a real headless Chromium, against a real daemon.

The proof: Chromium's fake microphone plays a speech clip, the page captures it with its
AudioWorklet, converts it to 16 kHz and streams it; the transcript it shows matches the clip's
reference. The fake device drops or repeats 10 ms buffers, so text is compared, never samples.
The other tests check the messages a user sees when something fails, with the fake engine.
"""

from __future__ import annotations

import asyncio
import json
import wave
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import soxr
from browser_harness import Page, launch_chromium, open_page
from conftest import REPO_ROOT, read_wav_int16
from daemon_harness import make_config, running_daemon

from captiond.bench.wer import word_errors
from captiond.engines import load_engine
from captiond.server import Daemon

CLIP_ID = "jfk_inaugural_1961"
LEAD_SILENCE_S = 1.0
TAIL_SILENCE_S = 5.0
# Stop this far into the trailing silence: the endpoint has passed, the file has not looped.
STOP_AFTER_TAIL_S = 2.5
MAX_WER = 0.35
ARTIFACTS = REPO_ROOT / "test-artifacts"

TRANSCRIPT_JS = (
    "[...document.querySelectorAll('#transcript .final .text')].map(e => e.textContent).join(' ')"
)

SHOWS_PARTIAL_JS = (
    "document.querySelectorAll('#transcript .final').length >= 2 && !live.hidden"
    " && live.querySelector('.stable').textContent.trim().length > 0"
    " && live.querySelector('.unstable').textContent.trim().length > 0"
)


def page_url(daemon: Daemon, query: str = "") -> str:
    return f"http://127.0.0.1:{daemon.port}/{'?' + query if query else ''}"


def write_fake_capture(samples_16k: np.ndarray, path: Path) -> None:
    """The clip between silences, at 48 kHz as a real microphone delivers it."""
    lead = np.zeros(int(LEAD_SILENCE_S * 16_000), np.int16)
    tail = np.zeros(int(TAIL_SILENCE_S * 16_000), np.int16)
    padded = np.concatenate([lead, samples_16k, tail]).astype(np.float32) / 32768
    at_48k = soxr.resample(padded, 16_000, 48_000)
    with wave.open(str(path), "wb") as wf:
        wf.setnchannels(1)
        wf.setsampwidth(2)
        wf.setframerate(48_000)
        wf.writeframes((np.clip(at_48k, -1, 1) * 32767).astype("<i2").tobytes())


async def notice(page: Page) -> str:
    text: str = await page.wait_for("!notice.hidden && notice.textContent", "a notice")
    return text


@pytest.mark.model
def test_microphone_captions_match_the_reference(
    tmp_path: Path, speech_dir: Path, speech_manifest: list[dict[str, Any]]
) -> None:
    clip = next(m for m in speech_manifest if m["id"] == CLIP_ID)
    samples = read_wav_int16(speech_dir / clip["file"])
    capture = tmp_path / "capture.wav"
    write_fake_capture(samples, capture)
    stop_at_ms = int((LEAD_SILENCE_S + len(samples) / 16_000 + STOP_AFTER_TAIL_S) * 1000)
    engine = load_engine(make_config(engine={"name": "faster-whisper", "device": "cpu"}).engine)
    engine.warmup()

    async def scenario() -> str:
        async with running_daemon(engine=engine, vad_factory=None) as daemon:
            with launch_chromium(tmp_path / "profile", fake_audio=capture) as browser:
                async with open_page(browser) as page:
                    await page.viewport(1280, 720)
                    await page.navigate(page_url(daemon))
                    await page.evaluate("document.getElementById('start').click()")
                    await page.wait_for("state.dataset.state === 'live'", "live", 60)
                    # The screenshot for the docs: finals, and a partial with an unstable tail.
                    shot = ARTIFACTS / "browser-captions.png"
                    shot.unlink(missing_ok=True)
                    while await page.evaluate(f"+clock.dataset.ms < {stop_at_ms}"):
                        if not shot.exists() and await page.evaluate(SHOWS_PARTIAL_JS):
                            await page.screenshot(shot)
                        await asyncio.sleep(0.1)
                    await page.wait_for("!!document.querySelector('#transcript .final')", "a final")
                    if not shot.exists():
                        await page.screenshot(shot)
                    await page.evaluate("document.getElementById('stop').click()")
                    await page.wait_for("state.dataset.state === 'done'", "done", 120)
                    await page.screenshot(ARTIFACTS / "browser-captions-done.png")
                    text: str = await page.evaluate(TRANSCRIPT_JS)
                    return text

    hypothesis = asyncio.run(scenario())
    counts = word_errors(clip["text"], hypothesis)
    print(f"browser transcript: {hypothesis!r}; WER {counts.wer:.3f}")
    (ARTIFACTS / "browser-captions.json").write_text(
        json.dumps({"clip": CLIP_ID, "hypothesis": hypothesis, "wer": counts.wer}, indent=1)
    )
    assert counts.wer <= MAX_WER, hypothesis


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """One Chromium (with the default fake microphone) for the tests of failure messages."""
    with launch_chromium(tmp_path_factory.mktemp("chromium") / "profile") as url:
        yield url


def test_denied_microphone_is_explained(browser: str) -> None:
    async def scenario() -> str:
        async with running_daemon() as daemon, open_page(browser) as page:
            await page.call(
                "Page.addScriptToEvaluateOnNewDocument",
                source="navigator.mediaDevices.getUserMedia = () => Promise.reject("
                "new DOMException('Permission denied', 'NotAllowedError'));",
            )
            await page.navigate(page_url(daemon))
            await page.evaluate("document.getElementById('start').click()")
            text = await notice(page)
            assert await page.evaluate("state.dataset.state") == "error"
            assert daemon.sessions_total == 0
            return text

    assert "Microphone access was denied" in asyncio.run(scenario())


def test_unreachable_daemon_is_explained(browser: str) -> None:
    async def scenario() -> str:
        async with open_page(browser) as page:
            async with running_daemon() as daemon:
                await page.navigate(page_url(daemon))
            # The daemon has gone away since it served the page.
            await page.evaluate("document.getElementById('start').click()")
            return await notice(page)

    assert "Cannot reach the captiond daemon" in asyncio.run(scenario())


def test_refused_session_shows_the_error_code(browser: str) -> None:
    async def scenario() -> str:
        async with (
            running_daemon(make_config(auth={"token": "s3cret"})) as daemon,
            open_page(browser) as page,
        ):
            await page.navigate(page_url(daemon))
            await page.evaluate("document.getElementById('start').click()")
            return await notice(page)

    text = asyncio.run(scenario())
    assert "refused" in text and "token is required" in text and "HTTP 401" in text


def test_token_in_the_page_url_reaches_the_daemon(browser: str) -> None:
    async def scenario() -> None:
        async with (
            running_daemon(make_config(auth={"token": "s3cret"})) as daemon,
            open_page(browser) as page,
        ):
            await page.navigate(page_url(daemon, "token=s3cret"))
            await page.evaluate("document.getElementById('start').click()")
            await page.wait_for("+clock.dataset.ms > 500", "audio to flow")
            await page.evaluate("document.getElementById('stop').click()")
            await page.wait_for("state.dataset.state === 'done'", "done")

    asyncio.run(scenario())


def test_viewer_of_a_missing_source_says_so_on_a_phone(browser: str) -> None:
    async def scenario() -> tuple[str, bool]:
        async with running_daemon() as daemon, open_page(browser) as page:
            await page.viewport(390, 844, mobile=True)
            await page.navigate(page_url(daemon, "watch=room"))
            text = await notice(page)
            await page.screenshot(ARTIFACTS / "browser-viewer-phone.png")
            fits = await page.evaluate("document.documentElement.scrollWidth <= window.innerWidth")
            return text, fits

    text, fits = asyncio.run(scenario())
    assert 'no caption source named "room"' in text and "no_such_source" in text
    assert fits, "the page scrolls sideways on a phone"


def test_transcript_exports(browser: str) -> None:
    """What the .txt and .vtt downloads hold, built by the page's own module."""
    script = """import('/caption-view.js').then((m) => {
        const live = document.createElement('p');
        live.innerHTML = '<span class="stable"></span><span class="unstable"></span>';
        const v = new m.CaptionView({scroller: document.createElement('div'),
                                     transcript: document.createElement('ol'), live});
        v.handle({type: 'partial', segment: 0, rev: 0, start_ms: 0, end_ms: 900,
                  stable: 'a', unstable: 'b'});
        const shown = live.textContent;
        v.handle({type: 'final', segment: 0, start_ms: 1230, end_ms: 3723004, text: ' a <b> & c'});
        v.handle({type: 'final', segment: 1, start_ms: 3723004, end_ms: 3724000, text: ''});
        return [shown, live.hidden, v.toText(), v.toVtt()];
    })"""

    async def scenario() -> list[Any]:
        async with running_daemon() as daemon, open_page(browser) as page:
            await page.navigate(page_url(daemon))
            result: list[Any] = await page.evaluate(script)
            return result

    shown, hidden, text, vtt = asyncio.run(scenario())
    assert shown == "a b" and hidden is True
    assert text == "[0:01] a <b> & c\n"
    assert vtt == "WEBVTT\n\n1\n00:00:01.230 --> 01:02:03.004\na &lt;b&gt; &amp; c\n"
