"""A meeting that outlives its connection, in a real headless Chromium against real daemons.

Chromium's fake microphone says a sentence every 4 s (tone bursts; the fake engine makes a word
of each 250 ms): Stop and Start keep the transcript and the .vtt spans the sessions; a daemon
restart (SIGTERM's Daemon.shutdown, a new daemon on the same port), with or without a journal,
and a 20 s network drop lose no final and no audio; Stop works through a drop; a viewer comes
back after a restart and says when the source's microphone is missing.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import re
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from browser_harness import (
    FINAL_TEXTS_JS,
    FlakyNetwork,
    Page,
    browser_context,
    click,
    finals_at_least,
    launch_chromium,
    notice,
    open_page,
    page_url,
    silence,
    tone,
    write_capture,
)
from daemon_harness import make_config, running_daemon
from testkit import REPO_ROOT
from websockets.asyncio.client import connect

from captiond.config import Config, SourceConfig

BURST_S = 1.5
PERIOD_S = 4.0  # a burst every 4 s: 1 s of silence, the burst, 1.5 s of silence
# The microphone page's transcript as it keeps it for a reload.
STORED_JS = "JSON.parse(localStorage.getItem('captiond.transcript')).entries"
# Clicking .vtt or .txt hands the file to the test instead of the downloads folder.
CATCH_DOWNLOADS_JS = """window.__files = [];
URL.createObjectURL = (blob) => { window.__files.push(blob); return '#'; };
HTMLAnchorElement.prototype.click = () => {};"""


def bursts() -> np.ndarray:
    return np.concatenate([silence(1.0), tone(BURST_S), silence(PERIOD_S - 1.0 - BURST_S)])


@pytest.fixture(scope="module")
def burst_browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Chromium whose microphone says a 6-word sentence every 4 s."""
    folder = tmp_path_factory.mktemp("bursts")
    with launch_chromium(folder / "profile", write_capture(bursts(), folder / "mic.wav")) as url:
        yield url


def assert_on_the_burst_schedule(entries: list[dict[str, Any]]) -> None:
    """Finals one burst apart, in order: no burst lost, no audio lost or sent twice (either
    would shift every later final), on the page's timeline across sessions too."""
    starts = [e["start_ms"] for e in entries]
    gaps = [b - a for a, b in itertools.pairwise(starts)]
    assert all(abs(gap - PERIOD_S * 1000) < 600 for gap in gaps), starts
    assert all(a["end_ms"] <= b["start_ms"] for a, b in itertools.pairwise(entries))


def vtt_cue_times(vtt: str) -> list[tuple[str, str]]:
    """(start, end) of each cue; hh:mm:ss.ttt compare in time order as strings."""
    return [
        (start, end)
        for line in vtt.splitlines()
        if "-->" in line
        for start, end in [line.split(" --> ")]
    ]


def test_start_keeps_the_transcript_and_the_vtt_spans_sessions(burst_browser: str) -> None:
    async def scenario() -> None:
        async with running_daemon() as daemon, open_page(burst_browser) as page:
            await page.navigate(page_url(daemon))
            # One sentence, then Stop in the silence after it: one segment, said so.
            await page.evaluate(click("start"))
            first = await finals_at_least(page, 1)
            await page.evaluate(click("stop"))
            assert await page.wait_for(
                "state.dataset.state === 'done' && state.textContent", "done"
            )
            assert await page.evaluate("state.textContent") == "done · 1 segment"
            # Each final names its language and reads in its own direction (RTL scripts).
            shown = await page.evaluate(
                "[...document.querySelectorAll('#transcript .final')].map(f =>"
                " [f.querySelector('time').dataset.lang, f.querySelector('.text').dir])"
            )
            assert shown == [["en", "ltr"]]
            # Start again: the first session's final stays; the second session's follow it.
            await page.evaluate(click("start"))
            await page.wait_for("state.dataset.state === 'live'", "live")
            assert await page.evaluate(FINAL_TEXTS_JS) == first
            texts = await finals_at_least(page, 3)
            await page.evaluate(click("stop"))
            await page.wait_for("state.dataset.state === 'done'", "done")
            texts = await page.evaluate(FINAL_TEXTS_JS)
            # A screen reader hears the finals, each once, never a partial.
            announced = await page.evaluate("[...announcer.children].map(p => p.textContent)")
            assert announced == texts[-3:]
            live_regions = await page.evaluate(
                "[...document.querySelectorAll('[aria-live]')].map(e => e.id)"
            )
            assert live_regions == ["announcer"]
            assert not await page.evaluate(
                "!!captions.closest('[role=status],[role=alert],[role=log]')"
            )
            # A reload keeps the transcript; the .vtt holds every final, in increasing times.
            await page.navigate(page_url(daemon))
            assert await page.evaluate(FINAL_TEXTS_JS) == texts
            await page.evaluate(CATCH_DOWNLOADS_JS)
            await page.evaluate(click("download-vtt"))
            vtt: str = await page.evaluate("window.__files[0].text()")
            cues = vtt_cue_times(vtt)
            assert len(cues) == len(texts) >= 3
            assert all(start < end for start, end in cues)
            assert all(a[1] <= b[0] for a, b in itertools.pairwise(cues)), cues
            # Clear asks first: "no" keeps everything, "yes" erases the page and the storage.
            await page.evaluate("window.confirm = () => false")
            await page.evaluate(click("clear"))
            assert await page.evaluate(FINAL_TEXTS_JS) == texts
            await page.evaluate("window.confirm = () => true")
            await page.evaluate(click("clear"))
            assert await page.evaluate(FINAL_TEXTS_JS) == []
            assert await page.evaluate(STORED_JS) == []
            assert await page.evaluate("document.getElementById('download-vtt').disabled")

    asyncio.run(scenario())


# A speed limit a restart's backlog passes at once: the page must pace it.
TIGHT_LIMIT = {"audio_burst_s": 1.0, "max_audio_speed": 2.0}


@pytest.mark.parametrize(
    ("journal", "limit"),
    [(True, {}), (False, {}), (True, TIGHT_LIMIT)],
    ids=["journal", "no-journal", "journal-tight-speed-limit"],
)
def test_daemon_restart_mid_session_reconnects_and_keeps_every_final(
    burst_browser: str, tmp_path: Path, journal: bool, limit: dict[str, float]
) -> None:
    """What SIGTERM does (Daemon.shutdown), then a new daemon on the same port: with a journal
    the page resumes its session, without one it starts a new session; either way it says the
    daemon is restarting (not "done"), reconnects by itself, and loses no final and no audio.
    The audio recorded meanwhile goes out as fast as the daemon's `ready` allows: the limit
    counts anew for a session taken back from the journal, and a backlog of a few seconds at
    once would pass a tight one (rate_limited)."""
    sections: dict[str, dict[str, Any]] = {"journal": {"dir": str(tmp_path)}} if journal else {}

    async def scenario() -> None:
        async with open_page(burst_browser) as page:
            async with running_daemon(make_config(server=limit, **sections)) as first:
                port = first.port
                await page.navigate(page_url(first))
                await page.evaluate(click("start"))
                await finals_at_least(page, 2)
            # Stopped: its last finals arrived, then `shutting_down` and 1001.
            before = await page.evaluate(FINAL_TEXTS_JS)
            text = await notice(page)
            assert "Daemon restarting" in text, text
            assert await page.evaluate("state.dataset.state") == "reconnecting"
            assert await page.evaluate("live.hidden"), "a partial outlived its connection"
            await asyncio.sleep(2)  # down a while: the microphone keeps recording
            restarted = make_config(server={"port": port, **limit}, **sections)
            async with running_daemon(restarted) as second:
                await page.wait_for("state.dataset.state === 'live'", "the reconnect", 30)
                text = await notice(page)
                if journal:
                    assert "Reconnected" in text and "nothing was lost" in text, text
                else:
                    assert "A new session started" in text, text
                after = await finals_at_least(page, len(before) + 2)
                await page.evaluate(click("stop"))
                await page.wait_for("state.dataset.state === 'done'", "done")
                assert second.sessions_total == 1
            assert after[: len(before)] == before
            assert_on_the_burst_schedule(await page.evaluate(STORED_JS))

    asyncio.run(scenario())


def test_a_20_s_network_drop_loses_no_speech(burst_browser: str) -> None:
    async def scenario() -> None:
        async with (
            running_daemon() as daemon,
            FlakyNetwork(daemon.port) as network,
            open_page(burst_browser) as page,
        ):
            await page.navigate(f"http://127.0.0.1:{network.port}/")
            await page.evaluate(click("start"))
            before = await finals_at_least(page, 2)
            network.cut()
            text = await notice(page)
            assert "connection to the daemon was lost" in text, text
            await asyncio.sleep(20)  # five sentences said while the page has no daemon
            assert await page.evaluate("state.dataset.state") == "reconnecting"
            network.down = False
            await page.wait_for("state.dataset.state === 'live'", "the reconnect", 30)
            assert "nothing was lost" in await notice(page)
            # The daemon got the 20 s again and captions them; the burst after that is live.
            after = await finals_at_least(page, len(before) + 6, 60)
            await page.evaluate(click("stop"))
            await page.wait_for("state.dataset.state === 'done'", "done")
            assert after[: len(before)] == before
            assert_on_the_burst_schedule(await page.evaluate(STORED_JS))
            assert daemon.sessions_total == 1

    asyncio.run(scenario())


def test_a_drop_longer_than_a_new_session_takes_says_what_was_skipped(burst_browser: str) -> None:
    """Away longer than the daemon keeps a session (2 s here) and longer than a new session
    takes at once (50 s, here 5 s): the page says how much audio was not transcribed, and the
    new session's finals keep the times they were said at on the page's timeline."""
    app = (REPO_ROOT / "clients" / "web" / "app.js").read_text()
    scaled = app.replace("const FRESH_RESEND_MS = 50_000;", "const FRESH_RESEND_MS = 5_000;")
    assert scaled != app

    async def scenario() -> None:
        async with (
            running_daemon(make_config(server={"resume_s": 2.0})) as daemon,
            FlakyNetwork(daemon.port) as network,
            open_page(burst_browser) as page,
        ):
            await page.serve("*/app.js", scaled)
            await page.navigate(f"http://127.0.0.1:{network.port}/")
            await page.evaluate(click("start"))
            before = await finals_at_least(page, 2)
            network.cut()
            await asyncio.sleep(14)
            network.down = False
            await page.wait_for("state.dataset.state === 'live'", "the reconnect", 30)
            text = await notice(page)
            assert "A new session started" in text, text
            skipped = re.search(r"([\d.]+) s of audio recorded while disconnected were not", text)
            assert skipped and float(skipped[1]) > 14 - 5 - 1, text
            await finals_at_least(page, len(before) + 2, 30)
            await page.evaluate(click("stop"))
            await page.wait_for("state.dataset.state === 'done'", "done")
            assert daemon.sessions_total == 2
            # Each final ends a burst, on the bursts' schedule, but the last (cut by Stop).
            ends = [e["end_ms"] for e in await page.evaluate(STORED_JS)][:-1]
            offsets = [(end - ends[0]) % (PERIOD_S * 1000) for end in ends]
            assert all(min(o, PERIOD_S * 1000 - o) < 600 for o in offsets), ends

    asyncio.run(scenario())


def test_stop_during_a_drop_still_gets_the_last_finals(burst_browser: str) -> None:
    """Stop: the last audio and `end` are lost with the connection. The page resumes the
    session, sends them again and gets the last final and `done`."""

    async def scenario() -> None:
        async with (
            running_daemon() as daemon,
            FlakyNetwork(daemon.port) as network,
            open_page(burst_browser) as page,
        ):
            await page.navigate(f"http://127.0.0.1:{network.port}/")
            await page.evaluate(click("start"))
            before = await finals_at_least(page, 1)
            await page.wait_for("!live.hidden", "a sentence under way")
            network.held = True
            await page.evaluate(click("stop"))
            await asyncio.sleep(1)  # the last audio and `end` wait in the network
            network.cut()
            await page.wait_for("state.dataset.state === 'reconnecting'", "reconnecting")
            assert await page.evaluate(FINAL_TEXTS_JS) == before
            network.down = network.held = False
            await page.wait_for("state.dataset.state === 'done'", "done", 30)
            after = await page.evaluate(FINAL_TEXTS_JS)
            assert after[: len(before)] == before and len(after) == len(before) + 1
            assert await page.evaluate("state.textContent") == f"done · {len(after)} segments"
            assert daemon.sessions_total == 1

    asyncio.run(scenario())


def test_stop_while_reconnecting_stops_trying(burst_browser: str) -> None:
    async def scenario() -> None:
        async with open_page(burst_browser) as page:
            async with running_daemon() as first:
                port = first.port
                await page.navigate(page_url(first))
                await page.evaluate(click("start"))
                await page.wait_for("state.dataset.state === 'live'", "live")
            await page.wait_for("state.dataset.state === 'reconnecting'", "reconnecting")
            await asyncio.sleep(1)
            await page.evaluate(click("stop"))
            await page.wait_for("state.dataset.state === 'stopped'", "stopped")
            assert "Stopped while disconnected" in await notice(page)
            assert not await page.evaluate("document.getElementById('start').disabled")
            async with running_daemon(make_config(server={"port": port})) as second:
                await asyncio.sleep(4)  # past several backoffs
                assert second.sessions_total == 0

    asyncio.run(scenario())


def test_two_tabs_keep_each_others_finals(burst_browser: str) -> None:
    """Two tabs of the page share the stored transcript: each shows the other's finals as they
    are stored, and neither's session overwrites the other's."""

    async def session(page: Page, finals: int) -> None:
        await page.evaluate(click("start"))
        await finals_at_least(page, finals)
        await page.evaluate(click("stop"))
        await page.wait_for("state.dataset.state === 'done'", "done")

    async def scenario() -> None:
        async with (
            running_daemon() as daemon,
            browser_context(burst_browser) as shared,
            open_page(burst_browser, shared) as first,
            open_page(burst_browser, shared) as second,
        ):
            await first.navigate(page_url(daemon))
            await second.navigate(page_url(daemon))
            await session(second, 2)
            theirs = await second.evaluate(FINAL_TEXTS_JS)
            assert await first.evaluate(FINAL_TEXTS_JS) == theirs
            await session(first, len(theirs) + 1)
            both = await first.evaluate(FINAL_TEXTS_JS)
            assert both[: len(theirs)] == theirs
            assert await second.evaluate(FINAL_TEXTS_JS) == both
            await second.navigate(page_url(daemon))
            assert await second.evaluate(FINAL_TEXTS_JS) == both

    asyncio.run(scenario())


# The state pill's background, and the theme's "ok" green.
PILL_AND_GREEN_JS = """(() => {
  const probe = document.createElement('span');
  probe.style.background = 'var(--ok)';
  document.body.append(probe);
  const green = getComputedStyle(probe).backgroundColor;
  probe.remove();
  return [getComputedStyle(state).backgroundColor, green];
})()"""


class LoopingInput:
    """A daemon-side microphone (AudioInput) playing `pcm` in a loop in real time; while
    `present` is false, opening it fails as a missing device does."""

    def __init__(self, pcm: np.ndarray, present: bool = True) -> None:
        self.samples = pcm.astype(np.float32)
        self.present = present

    async def __call__(self, source: SourceConfig) -> AsyncIterator[tuple[int, np.ndarray]]:
        if not self.present:
            raise OSError(f"no input device matches {source.device!r}")
        while True:
            for start in range(0, len(self.samples), 1600):
                yield 16_000, self.samples[start : start + 1600]
                await asyncio.sleep(0.1)


def test_viewer_reconnects_after_a_restart_and_shows_a_missing_microphone(
    burst_browser: str,
) -> None:
    def with_room(port: int = 0) -> Config:
        config = make_config(server={"port": port})
        return dataclasses.replace(config, sources=(SourceConfig(name="room"),))

    async def scenario() -> None:
        async with open_page(burst_browser) as page:
            async with running_daemon(with_room(), audio_input=LoopingInput(bursts())) as first:
                port = first.port
                await page.navigate(page_url(first, "watch=room"))
                await page.wait_for("state.dataset.state === 'watching'", "watching")
                before = await finals_at_least(page, 2)
            # The source's own "stopped" may show first; the daemon's close follows it.
            await page.wait_for(
                "!notice.hidden && notice.textContent.includes('Daemon restarting')",
                "the restarting notice",
            )
            assert await page.evaluate("state.dataset.state") == "reconnecting"
            # Back, but its microphone is missing: said in the pill and a notice, never green.
            device = LoopingInput(bursts(), present=False)
            async with running_daemon(with_room(port), audio_input=device):
                await page.wait_for("state.dataset.state === 'waiting'", "waiting_for_device")
                text = await notice(page)
                assert 'microphone of "room" is not available' in text, text
                assert "no input device matches" in text, text
                assert await page.evaluate("state.textContent") == "no microphone"
                pill, green = await page.evaluate(PILL_AND_GREEN_JS)
                assert pill != green, pill
                assert await page.evaluate(FINAL_TEXTS_JS) == before
                # Plugged in: the source retries, captures, and its finals follow the old ones.
                device.present = True
                await page.wait_for("state.dataset.state === 'watching'", "capturing", 30)
                after = await finals_at_least(page, len(before) + 1)
                assert after[: len(before)] == before
                assert await page.evaluate("notice.hidden")

    asyncio.run(scenario())


class PlayedOnce:
    """A daemon-side microphone (AudioInput) that plays `pcm` once in real time, then only
    silence: the captions it gives are those of `pcm`, however long the test waits."""

    def __init__(self, pcm: np.ndarray) -> None:
        self.samples = pcm.astype(np.float32)

    async def __call__(self, source: SourceConfig) -> AsyncIterator[tuple[int, np.ndarray]]:
        quiet = np.zeros(1600, np.float32)
        for start in itertools.count(0, 1600):
            yield 16_000, self.samples[start : start + 1600] if start < len(self.samples) else quiet
            await asyncio.sleep(0.1)


def test_a_viewer_back_after_a_crash_gets_the_new_runs_first_finals(burst_browser: str) -> None:
    """A daemon that died without a close (a crash, a killed worker) comes back with its
    source's segments counted from 0 again. The page reconnects asking for the finals after
    the ones it holds (`since=2` or more); those are of the old run, and the daemon's new
    finals 0 and 1 must reach the page, after the old ones, not be skipped as already held."""
    config = dataclasses.replace(make_config(), sources=(SourceConfig(name="room"),))

    async def scenario() -> None:
        async with (
            open_page(burst_browser) as page,
            running_daemon(config, audio_input=LoopingInput(bursts())) as first,
            FlakyNetwork(first.port) as network,
        ):
            await page.navigate(f"http://127.0.0.1:{network.port}/?watch=room")
            await page.wait_for("state.dataset.state === 'watching'", "watching")
            await finals_at_least(page, 2)
            network.cut()  # the daemon is gone without a word: no close frame, no 1001
            before = await page.evaluate(FINAL_TEXTS_JS)
            again = PlayedOnce(np.concatenate([bursts(), bursts()]))
            async with running_daemon(config, audio_input=again) as second:
                watch = f"ws://127.0.0.1:{second.port}/v1/captions?source=room"
                async with connect(watch) as viewer:  # until its two finals are made
                    finals: list[str] = []
                    while len(finals) < 2:
                        message = json.loads(await asyncio.wait_for(viewer.recv(), 30))
                        if message["type"] == "final" and message["text"].strip():
                            finals.append(message["text"])
                network.target_port = second.port
                network.down = False
                after = await finals_at_least(page, len(before) + 2)
                assert after == [*before, *finals]

    asyncio.run(scenario())


# The segments of the finals with text that reached the page, over all its connections.
RECORD_FINALS_JS = """window.__segments = new Set();
window.WebSocket = class extends WebSocket {
  constructor(...args) {
    super(...args);
    this.addEventListener('message', (event) => {
      const msg = JSON.parse(event.data);
      if (msg.type === 'final' && msg.text.trim()) window.__segments.add(msg.segment);
    });
  }
};"""


def test_a_viewer_stopped_and_watching_again_shows_each_final_once(burst_browser: str) -> None:
    """Watch after Stop goes on from the finals the page holds: the daemon's backlog is not
    appended a second time."""

    async def scenario() -> None:
        config = dataclasses.replace(make_config(), sources=(SourceConfig(name="room"),))
        async with (
            running_daemon(config, audio_input=LoopingInput(bursts())) as daemon,
            open_page(burst_browser) as page,
        ):
            await page.call("Page.addScriptToEvaluateOnNewDocument", source=RECORD_FINALS_JS)
            await page.navigate(page_url(daemon, "watch=room"))
            await page.wait_for("state.dataset.state === 'watching'", "watching")
            await finals_at_least(page, 2)
            await page.evaluate(click("stop"))
            await page.wait_for("state.dataset.state === 'stopped'", "stopped")
            before = await page.evaluate(FINAL_TEXTS_JS)
            await page.evaluate(click("start"))  # "Watch"
            await page.wait_for("state.dataset.state === 'watching'", "watching again")
            after = await finals_at_least(page, len(before) + 1)
            assert after[: len(before)] == before
            assert len(after) == await page.evaluate("window.__segments.size"), after

    asyncio.run(scenario())
