"""The web client in a real headless Chromium, against a real daemon: the page on its own.

The proof: Chromium's fake microphone plays a speech clip, the page captures it with its
AudioWorklet, converts it to 16 kHz and streams it; the transcript it shows matches the clip's
reference. The fake device drops or repeats 10 ms buffers, so text is compared, never samples.
The other tests use the fake engine (a word per 250 ms of tone): what a user sees when something
fails, the caption and transcript modes, contrast, and the page's own modules (the transcript
and its exports, the reconnect policy, the audio kept for resending). A meeting that outlives
its connection is test_browser_session.py.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from browser_harness import (
    FINAL_TEXTS_JS,
    FlakyNetwork,
    choose_theme,
    click,
    click_mode,
    launch_chromium,
    notice,
    open_page,
    page_url,
    silence,
    tone,
    write_capture,
)
from daemon_harness import RecordingEngine, make_config, running_daemon
from testkit import REPO_ROOT, read_wav_int16

from captiond.bench.wer import word_errors
from captiond.engines import load_engine

CLIP_ID = "jfk_inaugural_1961"
LEAD_SILENCE_S = 1.0
TAIL_SILENCE_S = 5.0
# Stop this far into the trailing silence: the endpoint has passed, the file has not looped.
STOP_AFTER_TAIL_S = 2.5
MAX_WER = 0.35
ARTIFACTS = REPO_ROOT / "test-artifacts"

TRANSCRIPT_JS = f"{FINAL_TEXTS_JS}.join(' ')"

SHOWS_PARTIAL_JS = (
    "document.querySelectorAll('#transcript .final').length >= 2 && !live.hidden"
    " && live.querySelector('.stable').textContent.trim().length > 0"
    " && live.querySelector('.unstable').textContent.trim().length > 0"
)


@pytest.mark.model
def test_microphone_captions_match_the_reference(
    tmp_path: Path, speech_dir: Path, speech_manifest: list[dict[str, Any]]
) -> None:
    clip = next(m for m in speech_manifest if m["id"] == CLIP_ID)
    samples = read_wav_int16(speech_dir / clip["file"])
    speech = samples.astype(np.float32) / 32768
    padded = np.concatenate([silence(LEAD_SILENCE_S), speech, silence(TAIL_SILENCE_S)])
    capture = write_capture(padded, tmp_path / "capture.wav")
    stop_at_ms = int((LEAD_SILENCE_S + len(samples) / 16_000 + STOP_AFTER_TAIL_S) * 1000)
    engine = load_engine(make_config(engine={"name": "faster-whisper", "device": "cpu"}).engine)
    engine.warmup()

    async def scenario() -> str:
        async with running_daemon(engine=engine, vad_factory=None) as daemon:
            with launch_chromium(tmp_path / "profile", fake_audio=capture) as browser:
                async with open_page(browser) as page:
                    await page.viewport(1920, 1080)
                    await page.navigate(page_url(daemon))
                    await page.evaluate("document.getElementById('start').click()")
                    await page.wait_for("state.dataset.state === 'live'", "live", 60)
                    # The screenshots for the docs (docs/page-*.png): finals, and a partial with
                    # an unstable tail, in each mode (and theme).
                    shot = ARTIFACTS / "page-transcript.png"
                    shot.unlink(missing_ok=True)
                    await page.evaluate(choose_theme("light"))
                    while await page.evaluate(f"+clock.dataset.ms < {stop_at_ms}"):
                        if not shot.exists() and await page.evaluate(SHOWS_PARTIAL_JS):
                            await page.screenshot(shot)
                            await page.evaluate(click_mode("captions") + ";" + choose_theme("dark"))
                            await page.screenshot(ARTIFACTS / "page-captions.png")
                            await page.evaluate(click_mode("transcript"))
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


# Resolves once the page has its audio worklet (capture.js, the module the page imported).
WORKLET_LOADED_JS = "import('/capture.js').then((capture) => capture.workletLoaded()).then(() => 1)"


def test_unreachable_daemon_is_explained(browser: str) -> None:
    async def scenario() -> str:
        async with open_page(browser) as page:
            async with running_daemon() as daemon:
                await page.navigate(page_url(daemon))
                await page.evaluate(WORKLET_LOADED_JS)
            # The daemon has gone away since it served the page.
            await page.evaluate("document.getElementById('start').click()")
            return await notice(page)

    text = asyncio.run(scenario())
    assert "Cannot reach the captiond daemon at ws://127.0.0.1:" in text and "Retrying" in text


@pytest.mark.parametrize("daemon_back", [True, False], ids=["back", "still-away"])
def test_a_worklet_that_did_not_load_with_the_page_loads_at_start(
    browser: str, daemon_back: bool
) -> None:
    """The page's own load of its audio worklet failed (the daemon was away as the page
    loaded): Start loads it again, and says which daemon it cannot reach if that fails too."""

    async def scenario() -> tuple[str, str]:
        async with running_daemon() as daemon, open_page(browser) as page:

            async def first_load_failed() -> None:
                while page.failed_requests == 0:
                    await asyncio.sleep(0.05)

            await page.fail("*/worklet.js*")
            await page.navigate(page_url(daemon))
            await asyncio.wait_for(first_load_failed(), 30)
            if daemon_back:
                await page.stop_intercepting()
            await page.evaluate(click("start"))
            if daemon_back:  # captured and connected
                await page.wait_for("state.dataset.state === 'live'", "the page live")
                return "live", ""
            text = await notice(page)
            return await page.evaluate("state.dataset.state"), text

    state, text = asyncio.run(scenario())
    if not daemon_back:
        assert state == "error"
        assert "Cannot reach the captiond daemon at http://127.0.0.1:" in text
        assert "audio worklet" in text


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


def test_stop_while_the_audio_starts_releases_the_microphone(browser: str) -> None:
    """A slow audio device: Stop while the audio graph is still starting ends it all. No
    microphone stays live, no session is opened, and Start is offered again."""
    slow_audio = """
      const resume = AudioContext.prototype.resume;
      AudioContext.prototype.resume = function () {
        return new Promise((ok) => setTimeout(() => resume.call(this).then(ok), 1500));
      };
      const open = MediaDevices.prototype.getUserMedia;
      MediaDevices.prototype.getUserMedia = async function (constraints) {
        return (window.__stream = await open.call(this, constraints));
      };"""

    async def scenario() -> None:
        async with running_daemon() as daemon, open_page(browser) as page:
            await page.call("Page.addScriptToEvaluateOnNewDocument", source=slow_audio)
            await page.navigate(page_url(daemon))
            await page.evaluate(click("start"))
            await page.wait_for("state.dataset.state === 'connecting'", "connecting")
            await page.evaluate(click("stop"))
            await asyncio.sleep(3)  # the audio graph has started by now
            assert await page.evaluate("window.__stream.getTracks()[0].readyState") == "ended"
            assert await page.evaluate("state.dataset.state") == "stopped"
            assert not await page.evaluate("document.getElementById('start').disabled")
            assert await page.evaluate("document.getElementById('stop').disabled")
            assert daemon.sessions_total == 0
            # And it starts again.
            await page.evaluate(click("start"))
            await page.wait_for("state.dataset.state === 'live'", "live")

    asyncio.run(scenario())


# Each capture processor posts how often process() ran: a copy of worklet.js with this first.
COUNT_PROCESS_CALLS = """const register = registerProcessor;
globalThis.registerProcessor = (name, processor) => {
  const process = processor.prototype.process;
  processor.prototype.process = function (...args) {
    this.calls = (this.calls ?? 0) + 1;
    if (this.calls % 25 === 0) this.port.postMessage({ type: 'calls', calls: this.calls });
    return process.apply(this, args);
  };
  register(name, processor);
};
"""
# The page keeps the newest count of each capture node, in the order they were made.
KEEP_PROCESS_CALLS_JS = """window.__calls = [];
window.AudioWorkletNode = class extends AudioWorkletNode {
  constructor(...args) {
    super(...args);
    const i = window.__calls.push(0) - 1;
    this.port.addEventListener('message', (event) => {
      if (event.data.type === 'calls') window.__calls[i] = event.data.calls;
    });
  }
};"""


def test_a_stopped_capture_stops_processing_audio(browser: str) -> None:
    """Each Start makes a capture processor; once its session stopped, it no longer runs on
    the audio thread (the next session's does)."""
    worklet = (REPO_ROOT / "clients" / "web" / "worklet.js").read_text()

    async def scenario() -> tuple[list[int], list[int]]:
        async with running_daemon() as daemon, open_page(browser) as page:
            await page.serve("*/worklet.js", COUNT_PROCESS_CALLS + worklet)
            await page.call("Page.addScriptToEvaluateOnNewDocument", source=KEEP_PROCESS_CALLS_JS)
            await page.navigate(page_url(daemon))
            for _ in range(2):
                await page.evaluate(click("start"))
                await page.wait_for("state.dataset.state === 'live'", "live")
                await page.wait_for("window.__calls.at(-1) > 0", "the capture running")
                await asyncio.sleep(1)
                await page.evaluate(click("stop"))
                await page.wait_for("state.dataset.state === 'done'", "done")
            await page.evaluate(click("start"))
            await page.wait_for("state.dataset.state === 'live'", "live")
            await asyncio.sleep(0.5)
            first: list[int] = await page.evaluate("window.__calls")
            await asyncio.sleep(1.5)
            later: list[int] = await page.evaluate("window.__calls")
            return first, later

    first, later = asyncio.run(scenario())
    assert len(later) == 3, later
    assert later[:2] == first[:2], (first, later)
    assert later[2] > first[2], (first, later)


def test_a_refused_origin_is_explained_and_not_retried(browser: str) -> None:
    """The daemon refuses the page's origin (403 before the upgrade); the plain request the
    page asks it with carries no Origin and gets 426. The page says what to configure and
    stops trying, rather than "Cannot reach the daemon" for ever."""

    async def scenario() -> None:
        async with (
            running_daemon() as daemon,
            FlakyNetwork(daemon.port, rewrite_host=True) as proxy,
            open_page(browser) as page,
        ):
            await page.navigate(f"http://127.0.0.1:{proxy.port}/")
            await page.evaluate(click("start"))
            await page.wait_for("state.dataset.state === 'error'", "the refusal")
            text = await notice(page)
            assert f"origin (http://127.0.0.1:{proxy.port}) may not connect" in text, text
            assert "allowed_origins" in text, text
            assert not await page.evaluate("document.getElementById('start').disabled")
            tries = proxy.connections
            await asyncio.sleep(3)
            assert proxy.connections == tries
            assert daemon.sessions_total == 0

    asyncio.run(scenario())


def test_token_task_and_the_names_field_reach_the_daemon(tmp_path: Path) -> None:
    """`/?prompt=` fills the page's names field; what the field holds when Start is pressed is
    the stream's prompt, and it cannot change while the session runs."""
    engine = RecordingEngine()
    mic = write_capture(np.concatenate([silence(0.5), tone(1.5), silence(2.0)]), tmp_path / "m.wav")

    async def scenario() -> tuple[str, bool]:
        async with running_daemon(make_config(auth={"token": "s3cret"}), engine=engine) as daemon:
            with launch_chromium(tmp_path / "profile", mic) as browser:
                async with open_page(browser) as page:
                    query = "token=s3cret&task=translate&prompt=Philip+Steels%2C+Grafana"
                    await page.navigate(page_url(daemon, query))
                    filled: str = await page.evaluate("document.getElementById('prompt').value")
                    await page.evaluate(
                        "const field = document.getElementById('prompt');"
                        "field.value += ', Loki  ';"
                        "field.dispatchEvent(new Event('input'));"
                        "document.getElementById('start').click()"
                    )
                    await page.wait_for("+clock.dataset.ms > 3000", "audio to flow")
                    locked: bool = await page.evaluate("document.getElementById('prompt').disabled")
                    await page.evaluate("document.getElementById('stop').click()")
                    await page.wait_for("state.dataset.state === 'done'", "done")
                    assert not await page.evaluate("document.getElementById('prompt').disabled")
                    return filled, locked

    filled, locked = asyncio.run(scenario())
    assert filled == "Philip Steels, Grafana" and locked
    assert engine.prompts and set(engine.prompts) == {"Philip Steels, Grafana, Loki"}
    assert set(engine.tasks) == {"translate"}


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


def test_caption_mode_rolls_three_lines_and_transcript_mode_uses_the_width(
    tmp_path: Path,
) -> None:
    """A room screen at 1920x1080 while one long utterance streams: caption mode shows at most
    three lines, the partial as the last, with nothing to scroll; transcript mode's text runs
    across more than 80 % of the screen."""
    mic = write_capture(
        np.concatenate([silence(1.0), tone(18.0), silence(3.0)]), tmp_path / "mic.wav"
    )
    words_js = "live.textContent.split(/\\s+/).filter(Boolean).length"

    async def scenario() -> None:
        async with running_daemon() as daemon:
            with launch_chromium(tmp_path / "profile", mic) as browser:
                async with open_page(browser) as page:
                    await page.viewport(1920, 1080)
                    await page.navigate(page_url(daemon, "mode=captions"))
                    assert (
                        await page.evaluate("document.documentElement.dataset.mode") == "captions"
                    )
                    await page.evaluate(click("start"))
                    await page.wait_for(f"{words_js} >= 48", "a long partial", 40)
                    box = await page.evaluate(
                        """(() => {
                        const box = document.getElementById('caption-box');
                        const now = box.querySelector('.now');
                        const main = document.getElementById('captions');
                        return {
                          lines: box.clientHeight / parseFloat(getComputedStyle(box).lineHeight),
                          nowBottom: now.getBoundingClientRect().bottom,
                          boxBottom: box.getBoundingClientRect().bottom,
                          clipped: now.scrollHeight > box.clientHeight,
                          scrolls: main.scrollHeight > main.clientHeight,
                          fontPx: parseFloat(getComputedStyle(box).fontSize),
                        };
                        })()"""
                    )
                    await page.screenshot(ARTIFACTS / "browser-caption-mode.png")
                    assert box["lines"] <= 3.01, box
                    assert abs(box["nowBottom"] - box["boxBottom"]) < 1, box
                    assert box["clipped"] and not box["scrolls"], box
                    assert box["fontPx"] >= 60, box
                    await page.evaluate(click_mode("transcript"))
                    right = await page.evaluate(
                        """(() => {
                        const range = document.createRange();
                        range.selectNodeContents(live);
                        const rights = [...range.getClientRects()].map((r) => r.right);
                        return Math.max(...rights) / window.innerWidth;
                        })()"""
                    )
                    assert right > 0.8, right
                    assert "mode=transcript" in await page.evaluate("location.search")

    asyncio.run(scenario())


# Every visible text, button, select and text field: its colour over its effective background
# (the layers behind it, blended), with the opacity of its ancestors, as WCAG contrast ratios.
CONTRAST_JS = """(() => {
  const parse = (c) => {
    const [r, g, b, a = 1] = c.match(/[\\d.]+/g).map(Number);
    return { r, g, b, a };
  };
  const over = (top, under) => {
    const mix = (k) => top[k] * top.a + under[k] * (1 - top.a);
    return { r: mix('r'), g: mix('g'), b: mix('b'), a: 1 };
  };
  const behind = (el) => {
    const layers = [];
    for (let e = el; e; e = e.parentElement) {
      const c = parse(getComputedStyle(e).backgroundColor);
      if (c.a > 0) layers.push(c);
      if (c.a === 1) break;
    }
    const canvas = { r: 255, g: 255, b: 255, a: 1 };
    return layers.reverse().reduce((under, top) => over(top, under), canvas);
  };
  const lum = ({ r, g, b }) => {
    const f = (v) => ((v /= 255) <= 0.03928 ? v / 12.92 : ((v + 0.055) / 1.055) ** 2.4);
    return 0.2126 * f(r) + 0.7152 * f(g) + 0.0722 * f(b);
  };
  const ratio = (x, y) => {
    const [hi, lo] = [lum(x), lum(y)].sort((p, q) => q - p);
    return (hi + 0.05) / (lo + 0.05);
  };
  const found = [];
  for (const el of document.querySelectorAll('body *')) {
    if (el.closest('.visually-hidden, noscript, option')) continue;
    const text = [...el.childNodes].some((n) => n.nodeType === 3 && n.textContent.trim());
    if (!text && !['BUTTON', 'SELECT', 'INPUT'].includes(el.tagName)) continue;
    const box = el.getBoundingClientRect();
    if (!box.width || !box.height || getComputedStyle(el).visibility === 'hidden') continue;
    let opacity = 1;
    for (let e = el; e; e = e.parentElement) opacity *= Number(getComputedStyle(e).opacity);
    const bg = behind(el);
    const fg = parse(getComputedStyle(el).color);
    const seen = over({ ...over(fg, bg), a: opacity }, bg);
    const what = el.id || el.className || el.tagName;
    found.push([what, el.textContent.trim().slice(0, 24), ratio(seen, bg)]);
  }
  return found;
})()"""

SHOW_STATE_JS = """([state, kind]) => {
  const pill = document.getElementById('state');
  pill.dataset.state = state;
  pill.textContent = state;
  notice.dataset.kind = kind;
  notice.textContent = 'A ' + kind + ' notice';
  notice.hidden = false;
}"""


def test_every_text_and_button_has_4_5_to_1_contrast_in_both_themes(browser: str) -> None:
    stored = {
        "version": 1,
        "endMs": 9000,
        "entries": [
            {"start_ms": 1000, "end_ms": 3000, "text": "And so, my fellow Americans,"},
            {"start_ms": 4000, "end_ms": 9000, "text": "ask not what your country can do."},
        ],
    }
    pills = ["idle", "live", "reconnecting", "error", "waiting", "done"]
    kinds = ["error", "warn", "info"]

    async def scenario() -> list[tuple[str, str, str, str, float]]:
        low: list[tuple[str, str, str, str, float]] = []
        async with running_daemon() as daemon, open_page(browser) as page:
            await page.viewport(1280, 800)
            await page.navigate(page_url(daemon))
            await page.evaluate(
                f"localStorage.setItem('captiond.transcript', {json.dumps(json.dumps(stored))})"
            )
            await page.navigate(page_url(daemon))
            # A partial with its unstable tail, in both modes' live lines.
            await page.evaluate(
                "for (const line of [live, document.querySelector('#caption-box .now')]) {"
                " line.hidden = false; line.querySelector('.stable').textContent = 'Ask what';"
                " line.querySelector('.unstable').textContent = 'you can do'; }"
            )
            for theme in ("dark", "light"):
                await page.evaluate(choose_theme(theme))
                for mode in ("transcript", "captions"):
                    await page.evaluate(click_mode(mode))
                    for i, pill in enumerate(pills):
                        kind = kinds[i % len(kinds)]
                        await page.evaluate(f"({SHOW_STATE_JS})({json.dumps([pill, kind])})")
                        for what, text, ratio in await page.evaluate(CONTRAST_JS):
                            if ratio < 4.5:
                                low.append((theme, mode, what, text, round(ratio, 2)))
            # Disabled buttons are in the sample; Stop is disabled while idle.
            assert await page.evaluate("document.getElementById('stop').disabled")
        return low

    low = asyncio.run(scenario())
    assert not low, sorted(set(low))


def test_a_click_in_the_transcript_leaves_it_where_the_reader_scrolled(browser: str) -> None:
    """Rereading a long transcript: a click on a caption (to select it) neither jumps to the
    end nor marks anything pressed; only the mode buttons switch the mode."""
    entries = [
        {"start_ms": i * 4000, "end_ms": i * 4000 + 1500, "text": f"line {i}"} for i in range(200)
    ]
    stored = {"version": 1, "endMs": 800_000, "entries": entries}

    async def scenario() -> tuple[int, int, bool]:
        async with running_daemon() as daemon, open_page(browser) as page:
            await page.navigate(page_url(daemon))
            await page.evaluate(
                f"localStorage.setItem('captiond.transcript', {json.dumps(json.dumps(stored))})"
            )
            await page.navigate(page_url(daemon))
            await page.evaluate("captions.scrollTop = 100")
            await page.evaluate("document.querySelector('#transcript .final .text').click()")
            top, room = await page.evaluate(
                "[captions.scrollTop, captions.scrollHeight - captions.clientHeight]"
            )
            pressed = await page.evaluate("document.documentElement.hasAttribute('aria-pressed')")
            return top, room, pressed

    top, room, pressed = asyncio.run(scenario())
    assert room > 100 and top == 100, (top, room)
    assert not pressed


async def run_in_page(browser: str, script: str) -> Any:
    """`script`'s value in a page of a running daemon (for the page's own modules)."""
    async with running_daemon() as daemon, open_page(browser) as page:
        await page.navigate(page_url(daemon))
        return await page.evaluate(script)


def test_transcript_exports_span_sessions(browser: str) -> None:
    """What the .txt and .vtt downloads hold: each session after the ones before it, replays
    and empty finals left out, cue text escaped."""
    script = """import('/transcript.js').then(({ Transcript }) => {
        const t = new Transcript();
        t.startSession();
        const first = {type: 'final', segment: 0, start_ms: 1230, end_ms: 3723004,
                       text: ' a <b> & c'};
        t.add(first);
        t.add({type: 'final', segment: 1, start_ms: 3723004, end_ms: 3724000, text: ''});
        const replayed = t.add(first);
        const since = t.nextSegment;
        t.startSession();  // Start again: its clock starts at 0
        t.add({type: 'final', segment: 0, start_ms: 500, end_ms: 1500, text: 'd'});
        // A viewer's source whose daemon restarted: the same number for other audio.
        t.add({type: 'final', segment: 0, start_ms: 100, end_ms: 200, text: 'e'});
        return [replayed, since, t.toText(), t.toVtt()];
    })"""
    replayed, since, text, vtt = asyncio.run(run_in_page(browser, script))
    assert replayed is None and since == 2
    assert text == "[0:01] a <b> & c\n[1:02:04] d\n[1:02:05] e\n"
    assert vtt == (
        "WEBVTT\n\n"
        "1\n00:00:01.230 --> 01:02:03.004\na &lt;b&gt; &amp; c\n\n"
        "2\n01:02:04.500 --> 01:02:05.500\nd\n\n"
        "3\n01:02:05.600 --> 01:02:05.700\ne\n"
    )


def test_reconnect_policy(browser: str) -> None:
    """Which closes the page reconnects after, and how long it waits."""
    script = """import('/link.js').then(({ backoffMs, closeAction }) => {
        const after = (code, error = null, extra = {}) =>
            closeAction({ opened: true, code, error: error && { code: error }, ...extra });
        return {
            actions: {
                going_away: after(1001, 'shutting_down'), dropped: after(1006),
                internal: after(1011), restart: after(1012), overloaded: after(1013, 'overloaded'),
                no_connect: closeAction({ opened: false, code: 1006 }),
                refused: closeAction({ opened: false, code: 1006, refusal: 'wrong token' }),
                resume_failed: after(4410, 'resume_failed'), bad_audio: after(1007, 'bad_audio'),
                bad_message: after(1008), too_large: after(1009), rate_limited: after(4029),
                idle: after(4408), done: after(1000, null, { done: {} }),
                user_stop: after(1000, null, { stopped: true }),
            },
            waits: [0, 1, 2, 3, 4, 5, 10].map(
                (n) => [backoffMs(n, () => 0), backoffMs(n, () => 1)]),
        };
    })"""
    result = asyncio.run(run_in_page(browser, script))
    retry = {"going_away", "dropped", "internal", "restart", "overloaded", "no_connect"}
    assert {k for k, v in result["actions"].items() if v == "retry"} == retry
    assert result["actions"]["resume_failed"] == "fresh"
    assert result["actions"]["done"] == "done" and result["actions"]["user_stop"] == "stopped"
    failed = {"refused", "bad_audio", "bad_message", "too_large", "rate_limited", "idle"}
    assert {k for k, v in result["actions"].items() if v == "failed"} == failed
    # 0.5 s doubling to 10 s, each within ±25 % jitter.
    low, high = zip(*result["waits"], strict=True)
    assert low == (375, 750, 1500, 3000, 6000, 7500, 7500)
    assert high == (625, 1250, 2500, 5000, 10000, 12500, 12500)


def test_finals_join_without_spaces_in_chinese_and_japanese(browser: str) -> None:
    """Consecutive finals in caption mode: a space between them, none between two Japanese or
    Chinese sentences; Thai parts sentences with a space."""
    script = """import('/transcript.js').then(({ joinText }) => [
        ['病気のため彼', 'はその'], ['保术,', '我们'], ['And so', 'my fellow'], ['Tokyo', '東京'],
        ['できなかった。', '次は'], ['Hello ', 'world'], ['', 'はい'], ['はい', ''],
        ['مرحبا', 'بالعالم'], ['สวัสดีครับ', 'ยินดี'],
    ].map(([a, b]) => joinText(a, b)))"""
    assert asyncio.run(run_in_page(browser, script)) == [
        "病気のため彼はその",
        "保术,我们",
        "And so my fellow",
        "Tokyo 東京",
        "できなかった。次は",
        "Hello world",
        "はい",
        "はい",
        "مرحبا بالعالم",
        "สวัสดีครับ ยินดี",
    ]


def test_a_caption_reads_in_the_direction_of_most_of_its_letters(browser: str) -> None:
    """An Arabic caption that starts with a Latin name reads right to left (dir="auto" goes by
    its first letter), in the transcript and on the live line; English with an Arabic name
    reads left to right."""
    script = """import('/caption-view.js').then(({ CaptionView }) => {
        const $ = (id) => document.getElementById(id);
        const view = new CaptionView({
            scroller: $('captions'), list: $('transcript'), live: $('live'),
            captionBox: $('caption-box'), announcer: $('announcer'),
        });
        const said = ['Python هي لغة برمجة شائعة', 'We met in مراكش today', '42', 'שלום Tom'];
        return said.map((text, segment) => {
            view.handle({type: 'partial', segment, rev: 1, start_ms: 0, end_ms: 500,
                         stable: text, separator: '', unstable: ''});
            const live = getComputedStyle($('live')).direction;
            view.handle({type: 'final', segment, start_ms: segment * 1000,
                         end_ms: segment * 1000 + 900, text});
            const items = $('transcript').querySelectorAll('.text');
            return [live, getComputedStyle(items[items.length - 1]).direction];
        });
    })"""
    assert asyncio.run(run_in_page(browser, script)) == [
        ["rtl", "rtl"],
        ["ltr", "ltr"],
        ["ltr", "ltr"],  # no letters: dir="auto", which lays digits out left to right
        ["rtl", "rtl"],
    ]


@pytest.mark.parametrize("translated", [False, True])
def test_a_caption_is_marked_with_the_language_it_is_written_in(
    browser: str, translated: bool
) -> None:
    """German speech is German text, or English with ?task=translate (a screen reader reads it
    as English); the language spoken still shows under the time."""
    script = """import('/caption-view.js').then(({ CaptionView }) => {
        const $ = (id) => document.getElementById(id);
        const view = new CaptionView({
            scroller: $('captions'), list: $('transcript'), live: $('live'),
            captionBox: $('caption-box'), announcer: $('announcer'), translated: TRANSLATED,
        });
        view.handle({type: 'partial', segment: 0, rev: 1, start_ms: 0, end_ms: 500,
                     stable: 'Hello', separator: ' ', unstable: 'world', language: 'de'});
        const live = $('live').lang;
        view.handle({type: 'final', segment: 0, start_ms: 0, end_ms: 900, text: 'Hello world.',
                     language: 'de'});
        const item = $('transcript').lastElementChild;
        return [live, item.querySelector('.text').lang, item.querySelector('time').dataset.lang,
                $('announcer').lastElementChild.lang];
    })""".replace("TRANSLATED", "true" if translated else "false")
    written = "en" if translated else "de"
    assert asyncio.run(run_in_page(browser, script)) == [written, written, "de", written]


def test_the_live_line_joins_a_partial_with_its_separator(browser: str) -> None:
    """The live line shows `stable`, the partial's `separator`, then `unstable`: no space inside
    a Japanese sentence or between Chinese and the Latin written onto it, a Thai phrase's."""
    script = """import('/caption-view.js').then(({ CaptionView }) => {
        const $ = (id) => document.getElementById(id);
        const view = new CaptionView({
            scroller: $('captions'), list: $('transcript'), live: $('live'),
            captionBox: $('caption-box'), announcer: $('announcer'),
        });
        return [
            ['And so', ' ', 'my fellow'], ['病気のため彼', '', 'はその'], ['我用', '', 'Python写'],
            ['สวัสดีครับ', ' ', 'ผมชื่อ'], ['', '', 'はい'], ['はい', '', ''],
        ].map(([stable, separator, unstable], rev) => {
            view.handle({type: 'partial', segment: 0, rev, start_ms: 0, end_ms: 500,
                         stable, separator, unstable});
            return $('live').textContent;
        });
    })"""
    assert asyncio.run(run_in_page(browser, script)) == [
        "And so my fellow",
        "病気のため彼はその",
        "我用Python写",
        "สวัสดีครับ ผมชื่อ",
        "はい",
        "はい",
    ]


def test_audio_buffer_keeps_the_newest_and_resends_from_a_byte(browser: str) -> None:
    script = """import('/capture.js').then(({ PcmBuffer }) => {
        const buffer = new PcmBuffer(8);  // 8 bytes kept
        for (let i = 0; i < 16; i += 4) {
            buffer.push(new Uint8Array([i, i + 1, i + 2, i + 3]).buffer);
        }
        const bytes = (pcm) => [...new Uint8Array(pcm)];
        const from = (offset) => [...buffer.from(offset)].flatMap(bytes);
        return [buffer.start, buffer.end, from(10), from(0)];
    })"""
    start, end, from_10, from_0 = asyncio.run(run_in_page(browser, script))
    assert (start, end) == (8, 16)
    assert from_10 == [10, 11, 12, 13, 14, 15]
    assert from_0 == list(range(8, 16))


def test_the_page_shows_who_spoke_and_a_rename_survives_a_reload(tmp_path: Path) -> None:
    """`/?diarize=true`: two voices (ToneEmbedder's tones) get two labels in two colours; a
    speaker renamed ("Speaker 2" → "Dana") is renamed on every caption, in caption mode and in
    the exports, and still after a reload."""
    mic = write_capture(
        np.concatenate(
            [
                silence(0.5),
                tone(1.5, 300),
                silence(1.2),
                tone(1.5, 1_200),
                silence(1.2),
                tone(1.5, 300),
                silence(3.0),
            ]
        ),
        tmp_path / "mic.wav",
    )
    labels_js = "[...document.querySelectorAll('#transcript .speaker')].map(e => e.textContent)"

    async def scenario() -> tuple[list[str], list[str], str, str, list[str]]:
        async with running_daemon() as daemon:
            with launch_chromium(tmp_path / "profile", mic) as browser:
                async with open_page(browser) as page:
                    await page.navigate(page_url(daemon, "diarize=true"))
                    await page.evaluate(click("start"))
                    await page.wait_for(f"{labels_js}.length >= 3", "three labelled finals", 40)
                    await page.evaluate(click("stop"))
                    await page.wait_for("state.dataset.state === 'done'", "done")
                    labels: list[str] = await page.evaluate(labels_js)
                    colours: list[str] = await page.evaluate(
                        "[...document.querySelectorAll('#transcript .speaker')]"
                        ".map(e => getComputedStyle(e).borderLeftColor)"
                    )
                    await page.evaluate(
                        "window.prompt = () => 'Dana';"
                        "document.querySelector('#transcript .speaker[data-speaker=\"1\"]').click()"
                    )
                    captions: str = await page.evaluate(
                        "document.querySelector('#caption-box .said').textContent"
                    )
                    await page.navigate(page_url(daemon, "diarize=true"))
                    await page.wait_for(f"{labels_js}.length >= 3", "the stored transcript")
                    reloaded: list[str] = await page.evaluate(labels_js)
                    vtt: str = await page.evaluate(
                        "import('/transcript.js').then(({ Transcript }) =>"
                        " new Transcript('captiond.transcript').toVtt())"
                    )
                    return labels, colours, captions, vtt, reloaded

    labels, colours, captions, vtt, reloaded = asyncio.run(scenario())
    assert labels[:3] == ["Speaker 1", "Speaker 2", "Speaker 1"]
    assert colours[0] != colours[1] and colours[0] == colours[2]
    assert "Dana: " in captions
    assert reloaded[:3] == ["Speaker 1", "Dana", "Speaker 1"]
    assert "<v Dana>" in vtt and "<v Speaker 1>" in vtt
