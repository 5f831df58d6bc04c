"""Several instances behind real HAProxy on loopback: deploy/haproxy/run-local.sh runs the
shipped haproxy.cfg in front of `captiond serve --engine fake` instances that share one journal
folder, and real clients (captiond_client's `stream_samples`, which resumes across drops)
stream real speech through it.

- New streams spread over every instance (leastconn), each captioned as the clip streamed
  directly.
- kill -9 of an instance mid-stream: its clients (captiond_client's streams, and the page in
  real Chromium) resume through HAProxy on another instance, which takes each session back
  from the shared journal; every journaled final reaches its client exactly once, and the
  audio the dead instance had not captioned is sent again.
- A session that moved while its instance was down goes back to it once it is up: the
  instance that holds it meanwhile hands it over through the shared journal.
- A rolling restart of every instance during live streams loses no final and ends no stream
  in an error.
- A forged token, or one of a finished session, is refused with 4410 by every instance.
- With every instance at its limit a newcomer gets HTTP 503 at once, not a hang.

Timings printed (kill to resume) are figures, not assertions: the bounds are hang guards.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
from browser_harness import click, finals_at_least, launch_chromium, open_page, write_capture
from testkit import REPO_ROOT, missing_tool, read_wav_int16
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from captiond.journal.reader import list_sessions
from captiond_client.stream import stream_samples

RUN_LOCAL = REPO_ROOT / "deploy" / "haproxy" / "run-local.sh"
CLIP = "meeting_pub_00"
_START_LIMIT_S = 90.0  # a hang guard: three instances start in about 10 s on 2 cores


@dataclass
class LocalSet:
    """A running run-local.sh: HAProxy on `port`, instance i on `port + i`."""

    state: Path
    port: int
    instances: int
    proc: subprocess.Popen[bytes]
    up_lines: int = 0  # "is UP" lines in HAProxy's log seen so far

    def url(self, port: int | None = None, query: str = "") -> str:
        return f"ws://127.0.0.1:{port or self.port}/v1/stream{'?' + query if query else ''}"

    def pid(self, i: int) -> int:
        return int((self.state / f"i{i}.pid").read_text())

    def haproxy_ups(self) -> int:
        log = self.state / "haproxy.log"
        if not log.exists():
            return 0
        # HAProxy writes each event twice (stderr's [WARNING] line, then the log's).
        lines = log.read_text(errors="replace").splitlines()
        return sum(line.startswith("Server captiond/") and " is UP" in line for line in lines)

    def wait_up(self, instances: list[int]) -> None:
        """Until each of `instances` answers /readyz and HAProxy has marked them up again."""
        deadline = time.monotonic() + _START_LIMIT_S
        want = self.up_lines + len(instances)
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"run-local.sh exited: {self.proc.returncode}")
            ready = all(_status(self.port + i, "/readyz") == 200 for i in instances)
            if ready and self.haproxy_ups() >= want:
                self.up_lines = self.haproxy_ups()
                return
            time.sleep(0.2)
        raise AssertionError(f"instances {instances} not up behind HAProxy")


def _status(port: int, path: str) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=2) as answer:
            return int(answer.status)
    except urllib.error.HTTPError as exc:
        return exc.code
    except (OSError, http.client.HTTPException):  # not listening yet, or not an HTTP answer
        return 0


def _free_ports(count: int) -> int:
    """A base port whose `count` ports from it are all free on loopback, below the kernel's
    ephemeral range: a probe of an instance not listening yet on a port in that range can
    connect to itself (its own source port) and read its request back as the answer."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    for _ in range(200):
        base = random.randrange(10_000, max(10_001, low - count))
        try:
            with contextlib.ExitStack() as stack:
                for port in range(base, base + count):
                    s = stack.enter_context(socket.socket())
                    s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
    raise AssertionError("no free port range")


@contextlib.contextmanager
def local_set(tmp_path: Path, instances: int, *serve_options: str) -> Iterator[LocalSet]:
    if shutil.which("haproxy") is None:
        missing_tool("haproxy is not installed (apt-get install haproxy)")
    port = _free_ports(2 * instances + 1)  # HAProxy, the instances, their agents
    state = tmp_path / "state"
    argv = ["bash", str(RUN_LOCAL), "--instances", str(instances), "--port", str(port)]
    argv += ["--state", str(state), "--", "--engine", "fake", *serve_options]
    proc = subprocess.Popen(
        argv, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True
    )
    local = LocalSet(state=state, port=port, instances=instances, proc=proc)
    try:
        local.wait_up(list(range(1, instances + 1)))
        yield local
    finally:
        # Ctrl-C, as a person stops it: the script stops every instance and HAProxy.
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise AssertionError("run-local.sh did not stop on Ctrl-C") from None


@dataclass
class Run:
    """One client stream's messages, as `stream_samples` reports them."""

    messages: list[dict[str, Any]] = field(default_factory=list)
    resumed_at_s: list[float] = field(default_factory=list)  # monotonic, per `resumed`
    error: str | None = None

    def add(self, message: dict[str, Any]) -> None:
        self.messages.append(message)
        if message["type"] == "resumed":
            self.resumed_at_s.append(time.monotonic())

    @property
    def finals(self) -> list[dict[str, Any]]:
        return [m for m in self.messages if m["type"] == "final"]

    @property
    def session(self) -> str:
        ready = next(m for m in self.messages if m["type"] == "ready")
        return str(ready["resume_token"]).partition(".")[0]

    @property
    def instance(self) -> str:
        """The instance the session started on (its id's prefix)."""
        return self.session.partition("_")[0]


async def _stream(
    url: str, samples: npt.NDArray[np.float32], speed: float, run: Run | None = None
) -> Run:
    run = run or Run()
    try:
        await stream_samples(url, samples, speed=speed, on_message=run.add, retry_for_s=60)
    except Exception as exc:  # StreamError: reported, and asserted on by the test
        run.error = f"{type(exc).__name__}: {exc}"
    return run


def _texts(run: Run) -> list[str]:
    return [f["text"] for f in run.finals]


def _check_exactly_once(local: LocalSet, runs: list[Run]) -> None:
    """Each client got finals 0, 1, 2, ... once each, and they are what the shared journal
    holds for its session, whichever instances wrote it."""
    journaled = {s.session: s for s in list_sessions(local.state / "journal")}
    for run in runs:
        assert run.error is None, run.error
        segments = [f["segment"] for f in run.finals]
        assert segments == list(range(len(segments))), segments
        session = journaled[run.session]
        assert [(f.segment, f.text) for f in session.finals] == [
            (f["segment"], f["text"]) for f in run.finals
        ]


@pytest.fixture(scope="module")
def speech(speech_dir: Path, speech_manifest: list[dict[str, Any]]) -> npt.NDArray[np.float32]:
    """The first 20 s of a public meeting (three voices): five utterances."""
    (clip,) = [m for m in speech_manifest if m["id"] == CLIP]
    samples = read_wav_int16(speech_dir / clip["file"]).astype(np.float32) / 32768
    return samples[: 20 * 16_000]


def test_three_instances_spread_streams_fail_over_and_restart_one_by_one(
    tmp_path: Path, speech: npt.NDArray[np.float32]
) -> None:
    with local_set(tmp_path, 3) as local:
        _spread(local, speech)
        _kill_one(local, speech)
        _handed_back(local, speech)
        _rolling_restart(local, speech)
        _bad_tokens(local)


def _spread(local: LocalSet, speech: npt.NDArray[np.float32]) -> None:
    """30 streams through HAProxy reach all three instances; each is captioned as the clip
    streamed straight to one instance."""

    async def scenario() -> tuple[Run, list[Run]]:
        direct = await _stream(local.url(local.port + 1), speech, speed=4)
        runs = await asyncio.gather(*(_stream(local.url(), speech, speed=4) for _ in range(30)))
        return direct, list(runs)

    direct, runs = asyncio.run(scenario())
    assert direct.error is None and len(direct.finals) >= 4
    counts = {name: sum(r.instance == name for r in runs) for name in ("i1", "i2", "i3")}
    print(f"30 streams over the instances: {counts}")
    assert all(counts.values()), counts
    for run in runs:
        assert run.error is None, run.error
        assert _texts(run) == _texts(direct)
    _check_exactly_once(local, runs)


def _kill_one(local: LocalSet, speech: npt.NDArray[np.float32]) -> None:
    """kill -9 of the instance that holds the first of six live streams: they resume through
    HAProxy on the others, from the shared journal."""
    killed: dict[str, Any] = {}

    async def killer(runs_started: list[Run]) -> None:
        await asyncio.sleep(7.0)  # mid-stream: some finals journaled, more to come
        victim = runs_started[0].instance
        i = int(victim.removeprefix("i"))
        (local.state / f"i{i}.hold").touch()  # it stays down: the resumes go elsewhere
        killed.update(name=victim, at_s=time.monotonic(), index=i)
        os.kill(local.pid(i), signal.SIGKILL)

    async def scenario() -> list[Run]:
        runs = [Run() for _ in range(6)]
        await asyncio.gather(killer(runs), *(_stream(local.url(), speech, 1.0, r) for r in runs))
        return runs

    runs = asyncio.run(scenario())
    hit = [r for r in runs if r.instance == killed["name"]]
    assert hit, "the killed instance held a stream"
    gaps_ms = [round((r.resumed_at_s[0] - killed["at_s"]) * 1000) for r in hit if r.resumed_at_s]
    assert len(gaps_ms) == len(hit), "every stream of the killed instance resumed"
    print(f"kill -9 {killed['name']}: {len(hit)} streams resumed after {sorted(gaps_ms)} ms")
    _check_exactly_once(local, runs)
    for run in hit:
        resumed = next(m for m in run.messages if m["type"] == "resumed")
        # Taken back from its last journaled final: the client sends the audio after it
        # again (whole samples), and the finals go on past the kill to the clip's end.
        assert 0 <= resumed["received_bytes"] < 2 * len(speech)
        assert resumed["received_bytes"] % 2 == 0
        assert run.finals[-1]["end_ms"] > 17_000
    (local.state / f"i{killed['index']}.hold").unlink()
    local.wait_up([killed["index"]])


def _handed_back(local: LocalSet, speech: npt.NDArray[np.float32]) -> None:
    """A session that moved while its instance was down goes back to it: HAProxy sends a
    resume by the session's prefix to the instance that started it once it is up again, and
    the instance that holds the session meanwhile hands it over through the shared journal.
    The client's finals are 0, 1, 2, ... once each, as journaled across three parts."""
    pcm = (np.clip(speech, -1.0, 1.0) * 32767).astype(np.int16).tobytes()
    third = len(pcm) // 6 * 2  # a third of the clip, in whole samples
    finals: list[dict[str, Any]] = []

    async def read_until(conn: ClientConnection, *kinds: str) -> dict[str, Any]:
        while True:
            message = json.loads(await asyncio.wait_for(conn.recv(), 20))
            if message["type"] == "final":
                finals.append(message)
            if message["type"] in kinds:
                return dict(message)

    async def resume(token: str) -> tuple[ClientConnection, dict[str, Any], int]:
        """As a client resumes: again after a refusal (`shutting_down` from an instance still
        draining, before HAProxy's checks mark it down), with the finals it lacks; also the
        tries it took."""
        for tries in range(1, 41):
            conn = await connect(local.url(query=f"resume={token}&since={len(finals)}"))
            with contextlib.suppress(ConnectionClosed):
                message = await read_until(conn, "resumed", "error")
                if message["type"] == "resumed":
                    return conn, message, tries
            await conn.close()
            await asyncio.sleep(0.5)
        raise AssertionError("the session was not resumed")

    async def scenario() -> tuple[str, float]:
        async with connect(local.url()) as conn:
            token = json.loads(await conn.recv())["resume_token"]
            await conn.send(pcm[:third])
            await asyncio.sleep(1.0)
            victim = int(token.partition("_")[0].removeprefix("i"))
            (local.state / f"i{victim}.hold").touch()
            os.kill(local.pid(victim), signal.SIGTERM)  # a drain: its finals, then 1001
            assert (await read_until(conn, "error"))["code"] == "shutting_down"
        # Its instance is down: HAProxy sends the resume to another, which takes it back.
        elsewhere, resumed, _ = await resume(token)
        await elsewhere.send(pcm[resumed["received_bytes"] : 2 * third])
        await asyncio.sleep(1.0)
        (local.state / f"i{victim}.hold").unlink()
        await asyncio.to_thread(local.wait_up, [victim])
        assert elsewhere.transport is not None
        elsewhere.transport.abort()  # the client's network drops
        started_s = time.monotonic()
        back, resumed, tries = await resume(token)
        waited_s = time.monotonic() - started_s
        # Handed over at the first try: refused, it would have got `overloaded` until the
        # instance holding it let it go `resume_s` after the drop.
        assert tries == 1, tries
        async with back:
            await back.send(pcm[resumed["received_bytes"] :])
            await back.send(json.dumps({"type": "end"}))
            await read_until(back, "done")
        return token, waited_s

    token, waited_s = asyncio.run(scenario())
    print(f"handed back to its restarted instance: resumed after {1000 * waited_s:.0f} ms")
    session = token.partition(".")[0]
    (journaled,) = [s for s in list_sessions(local.state / "journal") if s.session == session]
    assert [f["segment"] for f in finals] == list(range(len(finals))) and len(finals) >= 4
    assert [(f.segment, f.text) for f in journaled.finals] == [
        (f["segment"], f["text"]) for f in finals
    ]
    assert len(journaled.files) == 3, journaled.files  # its instance, another, its instance


def _rolling_restart(local: LocalSet, speech: npt.NDArray[np.float32]) -> None:
    """SIGTERM each instance in turn (run-local.sh starts it again) during 20 live streams."""

    async def restarts() -> None:
        await asyncio.sleep(3.0)
        for i in range(1, local.instances + 1):
            pid = local.pid(i)
            os.kill(pid, signal.SIGTERM)
            await asyncio.to_thread(_wait_new_pid, local, i, pid)
            await asyncio.to_thread(local.wait_up, [i])

    async def scenario() -> list[Run]:
        runs = asyncio.gather(*(_stream(local.url(), speech, speed=0.6) for _ in range(20)))
        await restarts()
        return list(await runs)

    started = time.monotonic()
    runs = asyncio.run(scenario())
    print(f"rolling restart of {local.instances} instances in {time.monotonic() - started:.0f} s")
    assert sum(len(r.resumed_at_s) for r in runs) >= 1, "the restarts moved streams"
    _check_exactly_once(local, runs)


def _wait_new_pid(local: LocalSet, i: int, old: int) -> None:
    deadline = time.monotonic() + _START_LIMIT_S
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError, ValueError):
            if local.pid(i) != old:
                return
        time.sleep(0.1)
    raise AssertionError(f"instance i{i} was not started again")


def _bad_tokens(local: LocalSet) -> None:
    """A forged token, an unknown session and a finished session's token: 4410 everywhere."""
    finished = next(s for s in list_sessions(local.state / "journal") if s.ended)
    tokens = [f"{finished.session}.forged", "i2_0123456789ab.forged", "i1_.x", "nonsense"]

    async def refused(port: int, token: str) -> tuple[str, int | None]:
        async with connect(local.url(port, f"resume={token}")) as conn:
            message = json.loads(await conn.recv())
            with contextlib.suppress(Exception):
                await conn.recv()
            return str(message.get("code")), conn.close_code

    for port in [local.port, *(local.port + i for i in range(1, local.instances + 1))]:
        for token in tokens:
            code, close = asyncio.run(refused(port, token))
            assert (code, close) == ("resume_failed", 4410), (port, token, code, close)


def test_a_full_instance_takes_no_new_stream_but_its_resumes(
    tmp_path: Path, speech: npt.NDArray[np.float32]
) -> None:
    """Two instances of one session each. A stream's connection drops: its instance still
    holds the session (full), so its agent tells HAProxy `drain`. A new stream goes to the
    other instance, and the dropped stream's resume still reaches its own."""
    with local_set(tmp_path, 2, "--max-sessions", "1") as local:

        async def scenario() -> tuple[str, dict[str, Any], dict[str, Any]]:
            conn = await connect(local.url())
            ready = json.loads(await conn.recv())
            await conn.send((speech[:16_000] * 32767).astype(np.int16).tobytes())
            await asyncio.sleep(0.3)
            conn.transport.abort()  # dropped: the session waits for its resume
            await asyncio.sleep(2.5)  # the agent is asked every second
            async with connect(local.url()) as other:
                newcomer = json.loads(await other.recv())
                await other.close()
            async with connect(local.url(query=f"resume={ready['resume_token']}")) as back:
                resumed = json.loads(await back.recv())
            return str(ready["session"]), newcomer, resumed

        session, newcomer, resumed = asyncio.run(scenario())
        log = (local.state / "haproxy.log").read_text(errors="replace")
    holder = session.partition("_")[0]
    assert f"Server captiond/{holder} enters drain state" in log
    assert newcomer["type"] == "ready" and not newcomer["session"].startswith(holder + "_")
    assert resumed["type"] == "resumed" and resumed["session"] == session


def test_a_full_set_answers_503_at_once(tmp_path: Path, speech: npt.NDArray[np.float32]) -> None:
    """Two instances of one session each, both taken: a third stream gets HAProxy's 503 after
    `timeout queue` (2 s), which the client retries, instead of waiting for a slot."""
    with local_set(tmp_path, 2, "--max-sessions", "1") as local:

        async def scenario() -> float:
            holders = [
                asyncio.create_task(_stream(local.url(), speech, speed=0.5)) for _ in range(2)
            ]
            await asyncio.sleep(2.0)
            started = time.monotonic()
            with pytest.raises(InvalidStatus) as refused:
                async with connect(local.url()):
                    pass
            assert refused.value.response.status_code == 503
            elapsed_s = time.monotonic() - started
            for task in holders:
                task.cancel()
            await asyncio.gather(*holders, return_exceptions=True)
            return elapsed_s

        elapsed_s = asyncio.run(scenario())
        print(f"503 after {elapsed_s:.1f} s")
        assert elapsed_s < 10.0  # a hang guard: HAProxy's timeout queue is 2 s


def test_the_page_fails_over_to_another_instance(
    tmp_path: Path, speech: npt.NDArray[np.float32]
) -> None:
    """The page in real Chromium, its microphone saying the meeting, through HAProxy: kill -9
    of the instance that holds its session; the page resumes on the other instance (the
    journal's session, "nothing was lost") and its transcript keeps every final."""
    mic = write_capture(speech, tmp_path / "mic.wav")
    with (
        local_set(tmp_path, 2) as local,
        launch_chromium(tmp_path / "profile", mic) as browser,
    ):

        async def scenario() -> tuple[list[str], list[str], str]:
            async with open_page(browser) as page:
                await page.navigate(f"http://127.0.0.1:{local.port}/")
                await page.evaluate(click("start"))
                before = await finals_at_least(page, 2, timeout_s=60)
                (session,) = list_sessions(local.state / "journal")
                victim = int(session.session.partition("_")[0].removeprefix("i"))
                (local.state / f"i{victim}.hold").touch()
                os.kill(local.pid(victim), signal.SIGKILL)
                text = await page.wait_for(
                    "!notice.hidden && notice.textContent.includes('Reconnected')"
                    " && notice.textContent",
                    "the resume on the other instance",
                    60,
                )
                after = await finals_at_least(page, len(before) + 2, timeout_s=60)
                return before, after, str(text)

        before, after, text = asyncio.run(scenario())
    assert "nothing was lost" in text, text
    assert after[: len(before)] == before
