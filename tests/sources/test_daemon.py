"""Daemon-captured sources: viewers, backlog, device loss and shutdown with a scripted input and
the fake engine; then the real thing, a PulseAudio virtual microphone captured by the daemon
(`serve --source`) and by `captiond-client mic` at once."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from daemon_harness import make_config, running_daemon, tone_bursts, url
from testkit import missing_tool, read_wav_int16
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed

from captiond.bench.wer import word_errors
from captiond.config import Config, SourceConfig
from captiond.engines.fake import FakeEngine
from captiond.errors import OverloadedError
from captiond.server.daemon import Daemon
from captiond.sources.broadcast import Broadcast
from captiond.streaming.events import Final, SourceStatus

Message = dict[str, Any]


class PortAudioLikeError(Exception):
    """What sounddevice raises (PortAudioError): an Exception, not an OSError."""


class ScriptedInput:
    """An AudioInput fed by the test: blocks from a queue; None makes the device vanish, an
    exception is raised as a failing device's; the first `fail_opens` opens fail as a missing
    device would."""

    def __init__(self, fail_opens: int = 0) -> None:
        self.queue: asyncio.Queue[tuple[int, np.ndarray] | Exception | None] = asyncio.Queue()
        self.fail_opens = fail_opens

    async def __call__(self, source: SourceConfig) -> AsyncGenerator[tuple[int, np.ndarray], None]:
        if self.fail_opens:
            self.fail_opens -= 1
            raise OSError(f"no input device matches {source.device!r}")
        while (item := await self.queue.get()) is not None:
            if isinstance(item, Exception):
                raise item
            yield item
            await asyncio.sleep(0.01)  # 10x real time, so that partials are due
        raise OSError("the input stream stopped")

    async def drained(self) -> None:
        """Until the source has taken every block fed (the generator waits for the next)."""
        while not self.queue.empty():
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.1)

    def feed(self, pcm: np.ndarray, rate_hz: int = 16_000) -> None:
        samples = pcm.astype(np.float32) / 32768
        step = rate_hz // 10
        for start in range(0, len(samples), step):
            self.queue.put_nowait((rate_hz, samples[start : start + step]))


def source_config(**values: Any) -> Any:
    return dataclasses.replace(make_config(), sources=(SourceConfig(name="room", **values),))


async def read_until(
    conn: ClientConnection, done: Callable[[Message], bool], into: list[Message]
) -> None:
    async with asyncio.timeout(30):
        while True:
            message = json.loads(await conn.recv())
            into.append(message)
            if done(message):
                return


@contextlib.asynccontextmanager
async def watched(
    config: Config, source: ScriptedInput
) -> AsyncIterator[tuple[Daemon, ClientConnection]]:
    """A daemon that runs `source` as its source "room", and a viewer of it."""
    async with (
        running_daemon(config, audio_input=source) as daemon,
        connect(url(daemon, "/v1/captions", "source=room")) as viewer,
    ):
        yield daemon, viewer


def texts(messages: list[Message]) -> list[str]:
    return [m["text"] for m in messages if m["type"] == "final"]


def test_viewers_get_live_captions_and_late_ones_the_backlog() -> None:
    source = ScriptedInput()

    async def scenario() -> None:
        config = source_config(backlog_finals=2)
        async with running_daemon(config, audio_input=source) as daemon:
            watch = url(daemon, "/v1/captions", "source=room")
            async with connect(watch) as early:
                source.feed(tone_bursts([1.0, 1.5, 2.0]), rate_hz=16_000)
                seen: list[Message] = []
                await read_until(early, lambda m: len(texts(seen)) == 3, seen)
                assert seen[0] == {
                    "type": "source",
                    "name": "room",
                    "run": daemon.sources["room"].run,
                    "state": "capturing",
                    "message": "capturing at 16000 Hz",
                }
                assert [m["segment"] for m in seen if m["type"] == "final"] == [0, 1, 2]
                assert any(m["type"] == "partial" for m in seen)
                async with connect(watch) as late:
                    joined: list[Message] = []
                    await read_until(late, lambda m: len(joined) == 3, joined)
                    assert joined[0]["type"] == "source"
                    assert texts(joined) == texts(seen)[1:]  # the backlog keeps the last two
                    # A 48 kHz device is resampled; both viewers see the next final.
                    up = np.repeat(tone_bursts([1.0]), 3)
                    source.feed(up, rate_hz=48_000)
                    more: list[Message] = []
                    await read_until(late, lambda m: m["type"] == "final", more)
                    await read_until(early, lambda m: m["type"] == "final", seen)
                    assert more[0]["message"] == "capturing at 48000 Hz"
                    assert texts(more) == texts(seen)[3:] and texts(more)[0]

    asyncio.run(scenario())


def test_a_viewer_that_reconnects_gets_the_finals_from_its_segment() -> None:
    """`/v1/captions?source=NAME&since=N&run=RUN`: the held finals from segment N, then live
    ones. After a restart the source's run is another and its segments count from 0 again: a
    `since` of the old run is ignored, or the new run's first captions would be skipped."""
    source = ScriptedInput()

    async def scenario() -> None:
        async with running_daemon(source_config(), audio_input=source) as daemon:
            async with connect(url(daemon, "/v1/captions", "source=room")) as first:
                source.feed(tone_bursts([1.0, 1.0, 1.0]))
                seen: list[Message] = []
                await read_until(first, lambda m: len(texts(seen)) == 3, seen)
            run = seen[0]["run"]
            for query in ("source=room&since=1", f"source=room&since=1&run={run}"):
                async with connect(url(daemon, "/v1/captions", query)) as again:
                    joined: list[Message] = []
                    await read_until(again, lambda m, got=joined: len(got) == 3, joined)
                assert joined[0]["type"] == "source" and joined[0]["run"] == run
                assert joined[1:] == [m for m in seen if m["type"] == "final"][1:]
        restarted = ScriptedInput()
        async with running_daemon(source_config(), audio_input=restarted) as daemon:
            restarted.feed(tone_bursts([1.0, 1.0]))
            async with connect(url(daemon, "/v1/captions", "source=room")) as first:
                now: list[Message] = []
                await read_until(first, lambda m: len(texts(now)) == 2, now)
            assert now[0]["run"] != run
            async with connect(
                url(daemon, "/v1/captions", f"source=room&since=2&run={run}")
            ) as old:
                joined = []
                await read_until(old, lambda m: len(joined) == 3, joined)
            assert joined[1:] == [m for m in now if m["type"] == "final"]
            assert [m["segment"] for m in joined[1:]] == [0, 1]

    asyncio.run(scenario())


def test_unknown_source_is_an_error() -> None:
    async def scenario() -> None:
        async with running_daemon(source_config(), audio_input=ScriptedInput()) as daemon:
            async with connect(url(daemon, "/v1/captions", "source=nope")) as conn:
                error = json.loads(await conn.recv())
                with contextlib.suppress(ConnectionClosed):
                    await conn.recv()
            assert error["code"] == "no_such_source" and "room" in error["message"]
            assert conn.close_code == 1008

    asyncio.run(scenario())


def test_missing_and_vanishing_device_is_a_state_and_a_retry() -> None:
    source = ScriptedInput(fail_opens=1)

    async def scenario() -> None:
        async with watched(source_config(), source) as (daemon, viewer):
            seen: list[Message] = []
            await read_until(viewer, lambda m: m.get("state") == "waiting_for_device", seen)
            assert "no input device" in seen[-1]["message"]
            # Speech, then the device vanishes mid-utterance: the utterance is still decoded.
            source.feed(tone_bursts([1.0, 2.0], gap_s=1.0)[: -16_000 * 2])
            source.queue.put_nowait(None)
            await read_until(viewer, lambda m: m.get("state") == "waiting_for_device", seen)
            assert "stopped" in seen[-1]["message"]
            source.feed(tone_bursts([1.0]))
            await read_until(viewer, lambda m: len(texts(seen)) == 3, seen)
            assert all(texts(seen))
            assert daemon.sources["room"].state == "capturing"

    asyncio.run(scenario())


def test_shutdown_sends_the_last_final_then_stopped_then_1001() -> None:
    source = ScriptedInput()

    async def scenario() -> None:
        async with running_daemon(source_config(), audio_input=source) as daemon:
            async with connect(url(daemon, "/v1/captions", "source=room")) as viewer:
                seen: list[Message] = []
                source.feed(tone_bursts([2.0], gap_s=0.0))  # the utterance is still open
                await read_until(viewer, lambda m: m["type"] == "speech_started", seen)
                await daemon.shutdown()
                with contextlib.suppress(ConnectionClosed):
                    await read_until(viewer, lambda m: False, seen)
            assert texts(seen) and texts(seen)[0]
            kinds = [m["type"] for m in seen]
            assert kinds.index("final") < len(kinds) - 1
            assert seen[-1] == {
                "type": "source",
                "name": "room",
                "run": daemon.sources["room"].run,
                "state": "stopped",
                "message": "the daemon is shutting down",
            }
            assert viewer.close_code == 1001

    asyncio.run(scenario())


def journaled_source_config(journal_dir: Path) -> Any:
    """source_config() with the transcript journal in `journal_dir`."""
    from captiond.config import JournalConfig

    return dataclasses.replace(source_config(), journal=JournalConfig(dir=str(journal_dir)))


def test_a_device_error_that_is_no_oserror_is_a_retry_too(tmp_path: Path) -> None:
    """PortAudio's errors are no OSErrors: one used to kill the capture silently (the state
    stayed `capturing`, the utterance open) and made the shutdown raise, with no journal end."""
    from captiond.journal.reader import list_sessions

    source = ScriptedInput()
    config = journaled_source_config(tmp_path)

    async def scenario() -> list[Message]:
        async with watched(config, source) as (daemon, viewer):
            seen: list[Message] = []
            source.feed(tone_bursts([1.5], gap_s=0.0))  # the utterance is still open
            await read_until(viewer, lambda m: m["type"] == "speech_started", seen)
            source.queue.put_nowait(PortAudioLikeError("Error querying device -1"))
            waiting: list[Message] = []

            def waiting_and_final(m: Message) -> bool:
                if m.get("state") == "waiting_for_device":
                    waiting.append(m)
                return bool(waiting) and len(texts(seen)) == 1  # the open utterance's final

            await read_until(viewer, waiting_and_final, seen)
            assert "Error querying device -1" in waiting[0]["message"]
            source.feed(tone_bursts([1.0]))
            await read_until(viewer, lambda m: len(texts(seen)) == 2, seen)
            assert daemon.sources["room"].state == "capturing"
            return seen

    seen = asyncio.run(scenario())  # the shutdown raises nothing
    (session,) = list_sessions(tmp_path)
    assert [f.text for f in session.finals] == texts(seen)
    assert session.ended and session.close_code == 1001


def test_decodes_that_fall_behind_drop_the_sources_audio(caplog: pytest.LogCaptureFixture) -> None:
    """A wedged engine: the source's buffered audio stays at `[server] max_buffered_s` (it
    grew by 230 MB an hour), with one warning; once decodes catch up, new audio is captioned."""
    gate = threading.Event()

    class WedgedEngine(FakeEngine):
        def transcribe_batch(self, requests: Any) -> Any:
            gate.wait()
            return super().transcribe_batch(requests)

    source = ScriptedInput()
    config = dataclasses.replace(
        make_config(server={"max_buffered_s": 3.0}), sources=(SourceConfig(name="room"),)
    )

    async def scenario() -> None:
        async with running_daemon(config, engine=WedgedEngine(), audio_input=source) as daemon:
            try:
                async with connect(url(daemon, "/v1/captions", "source=room")) as viewer:
                    session = daemon.sources["room"]._session
                    most_samples = 0
                    source.feed(tone_bursts([1.0] * 12, gap_s=1.5))  # 30.5 s
                    while not source.queue.empty():
                        most_samples = max(most_samples, session.buffered_samples)
                        await asyncio.sleep(0.02)
                    await source.drained()
                    most_samples = max(most_samples, session.buffered_samples)
                    assert most_samples <= 3.5 * 16_000, most_samples / 16_000
                    gate.set()
                    seen: list[Message] = []
                    await read_until(viewer, lambda m: session.buffered_samples == 0, seen)
                    source.feed(tone_bursts([1.0, 1.0]))
                    await read_until(viewer, lambda m: len(texts([m])) == 1 and m["text"], seen)
            finally:
                gate.set()

    with caplog.at_level(logging.INFO, logger="captiond.sources.daemon"):
        asyncio.run(scenario())
    notes = [r.getMessage() for r in caplog.records if r.name == "captiond.sources.daemon"]
    assert len([n for n in notes if "dropping its audio" in n]) == 1, notes
    assert any("decodes caught up" in n for n in notes), notes


def test_the_resamplers_tail_reaches_the_utterance_a_device_loss_or_stop_ends() -> None:
    """soxr holds back 21-66 ms of a 48 kHz device: the final of the utterance that a device
    loss or the shutdown ends reaches to the end of the audio it gave."""
    source = ScriptedInput()
    clip = np.repeat(tone_bursts([1.0], gap_s=0.0), 3)  # 0.5 s of quiet, 1 s of tone

    async def scenario() -> list[Message]:
        async with running_daemon(source_config(), audio_input=source) as daemon:
            async with connect(url(daemon, "/v1/captions", "source=room")) as viewer:
                seen: list[Message] = []
                source.feed(clip, rate_hz=48_000)
                source.queue.put_nowait(None)  # the device vanishes mid-utterance
                await read_until(viewer, lambda m: m.get("state") == "waiting_for_device", seen)
                source.feed(clip, rate_hz=48_000)  # the device is back; the daemon then stops
                await read_until(viewer, lambda m: m["type"] == "speech_started", seen)
                await source.drained()
                await daemon.shutdown()
                with contextlib.suppress(ConnectionClosed):
                    await read_until(viewer, lambda m: False, seen)
            return seen

    finals = [m for m in asyncio.run(scenario()) if m["type"] == "final"]
    assert [f["end_ms"] for f in finals] == [1_500, 3_000]


class _StalledViewer:
    """A connection whose peer never reads: sends block, nothing arrives."""

    def __init__(self) -> None:
        self.never = asyncio.Event()

    async def send(self, text: str) -> None:
        await self.never.wait()

    def __aiter__(self) -> _StalledViewer:
        return self

    async def __anext__(self) -> str:
        await self.never.wait()
        raise StopAsyncIteration


def test_a_viewer_that_falls_behind_is_dropped() -> None:
    async def scenario() -> None:
        broadcast = Broadcast(backlog_finals=5, viewer_queue_limit=3)
        watcher = asyncio.create_task(broadcast.watch(_StalledViewer()))  # type: ignore[arg-type]
        await asyncio.sleep(0)
        assert broadcast.viewers == 1
        for i in range(5):
            broadcast.publish(Final(segment=i, start_ms=0, end_ms=1, text=f"w{i}"))
        broadcast.publish(SourceStatus(name="x", run="r", state="capturing", message=""))
        assert broadcast.viewers == 0
        watcher.cancel()  # its first send never returns; the queue filled up behind it
        with contextlib.suppress(asyncio.CancelledError):
            await watcher

        live = Broadcast(backlog_finals=5, viewer_queue_limit=3)
        queue_full = asyncio.create_task(live.watch(_FastViewer()))  # type: ignore[arg-type]
        await asyncio.sleep(0)
        for i in range(4):
            live.publish(Final(segment=i, start_ms=0, end_ms=1, text=f"w{i}"))
        with pytest.raises(OverloadedError):
            await queue_full

    asyncio.run(scenario())


class _FastViewer(_StalledViewer):
    async def send(self, text: str) -> None:
        return None


# -- the real thing: PulseAudio as a virtual microphone ---------------------------------------

CAPTIOND = [sys.executable, "-m", "captiond.cli"]
CLIENT = [sys.executable, "-m", "captiond_client.cli"]
CLIP = "ljspeech_LJ001-0001"


@dataclasses.dataclass
class VirtualMic:
    env: dict[str, str]
    fifo: Path
    server_pid: int  # the PulseAudio server's


def _pulseaudio_pid(socket_path: Path) -> int:
    """The daemonized PulseAudio serving `socket_path` (its command line names the socket)."""
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        with contextlib.suppress(OSError):
            args = cmdline.read_bytes().split(b"\0")
            if args[0].endswith(b"pulseaudio") and f"socket={socket_path}".encode() in b" ".join(
                args
            ):
                return int(cmdline.parent.name)
    raise AssertionError(f"no pulseaudio process serves {socket_path}")


def load_pipe_source(env: dict[str, str], name: str, fifo: Path) -> None:
    """A PulseAudio source `name` that records what is written into `fifo` (16 kHz s16le)."""
    pactl = ["pactl", "load-module", "module-pipe-source", f"source_name={name}"]
    pactl += [f"file={fifo}", "format=s16le", "rate=16000", "channels=1"]
    subprocess.run(pactl, env=env, check=True, timeout=30, capture_output=True)


@pytest.fixture
def virtual_mic() -> Iterator[VirtualMic]:
    """A private PulseAudio server whose default source is a FIFO the test writes to."""
    if not (shutil.which("pulseaudio") and shutil.which("pactl")):
        missing_tool("pulseaudio/pactl not installed (apt-get install pulseaudio pulseaudio-utils)")
    run_dir = Path(tempfile.mkdtemp(prefix="captiond-pa-", dir="/tmp"))  # short socket paths
    home = run_dir / "home"
    home.mkdir()
    (home / ".asoundrc").write_text("pcm.!default { type pulse }\nctl.!default { type pulse }\n")
    fifo = run_dir / "mic.fifo"  # module-pipe-source makes it
    socket_path = run_dir / "native"
    env = {
        **os.environ,
        "XDG_RUNTIME_DIR": str(run_dir),
        "HOME": str(home),
        "PULSE_SERVER": f"unix:{socket_path}",
    }
    subprocess.run(
        ["pulseaudio", "-n", "--daemonize=yes", "--exit-idle-time=-1", "--use-pid-file=no",
         "--disable-shm=yes", "-L", f"module-native-protocol-unix socket={socket_path} "
         "auth-anonymous=1"],
        env=env, check=True, timeout=30, capture_output=True,
    )  # fmt: skip
    try:
        load_pipe_source(env, "virtual_mic", fifo)
        subprocess.run(["pactl", "set-default-source", "virtual_mic"], env=env, check=True)
        yield VirtualMic(env=env, fifo=fifo, server_pid=_pulseaudio_pid(socket_path))
    finally:
        subprocess.run(["pactl", "exit"], env=env, timeout=30, check=False)
        shutil.rmtree(run_dir, ignore_errors=True)


def play(fifo: Path, pcm: np.ndarray, go: threading.Event, stop: threading.Event) -> None:
    """Write silence into the pipe at real time, the clip once `go` is set, then silence again
    until `stop` (the pipe source neither paces its writer nor makes silence of its own)."""
    chunk = 1_600
    silence = np.zeros(chunk, dtype="<i2").tobytes()
    fd = os.open(fifo, os.O_WRONLY)
    try:
        started = time.monotonic()
        played = i = 0
        while not stop.is_set():
            data = silence
            if go.is_set() and played < len(pcm):
                data = pcm[played : played + chunk].tobytes().ljust(chunk * 2, b"\0")
                played += chunk
            os.write(fd, data)
            i += 1
            time.sleep(max(0.0, started + i * 0.1 - time.monotonic()))
    finally:
        os.close(fd)


def silence_player(fifo: Path) -> tuple[threading.Thread, threading.Event]:
    """A started thread that writes silence into `fifo` at real time until its event is set.
    A daemon thread: the pipe source stops reading once nothing records, and a write into the
    full pipe would then never return."""
    stop = threading.Event()
    player = threading.Thread(
        target=play, args=(fifo, np.zeros(0, "<i2"), threading.Event(), stop), daemon=True
    )
    player.start()
    return player, stop


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def wait_for_line(path: Path, needle: str, proc: subprocess.Popen[Any], limit_s: float) -> None:
    deadline = time.monotonic() + limit_s
    while needle not in path.read_text(errors="replace"):
        assert proc.poll() is None, path.read_text(errors="replace")
        assert time.monotonic() < deadline, path.read_text(errors="replace")
        time.sleep(0.2)


@pytest.mark.model
def test_microphone_captions_reach_viewers_and_the_mic_client(
    virtual_mic: VirtualMic, speech_dir: Path, speech_manifest: list[Message], tmp_path: Path
) -> None:
    clip = next(m for m in speech_manifest if m["id"] == CLIP)
    pcm = np.concatenate([np.zeros(8_000, "<i2"), read_wav_int16(speech_dir / clip["file"])])
    env = virtual_mic.env
    devices = subprocess.run([*CAPTIOND, "devices"], env=env, capture_output=True, text=True)
    assert devices.returncode == 0 and "default" in devices.stdout, devices.stderr

    port = free_port()
    daemon_log = tmp_path / "daemon.log"
    client_log = tmp_path / "client.log"
    serve = [*CAPTIOND, "serve", "--port", str(port), "--engine", "faster-whisper"]
    serve += ["--device", "cpu", "--source", "room"]
    go, stop_playing = threading.Event(), threading.Event()
    player = threading.Thread(target=play, args=(virtual_mic.fifo, pcm, go, stop_playing))
    player.start()
    with daemon_log.open("w") as dlog, client_log.open("w") as clog:
        daemon = subprocess.Popen(serve, env=env, stderr=dlog)
        client: subprocess.Popen[str] | None = None
        try:
            wait_for_line(daemon_log, "ready: ws://", daemon, 180)
            mic = [*CLIENT, "mic", "--url", f"ws://127.0.0.1:{port}/v1/stream", "--json"]
            client = subprocess.Popen(mic, env=env, stdout=subprocess.PIPE, stderr=clog, text=True)
            wait_for_line(client_log, "listening on", client, 60)

            async def watch() -> list[Message]:
                seen: list[Message] = []
                async with connect(f"ws://127.0.0.1:{port}/v1/captions?source=room") as viewer:
                    await read_until(viewer, lambda m: m.get("state") == "capturing", seen)
                    go.set()
                    clip_end = time.monotonic() + len(pcm) / 16_000
                    # Messages until the clip has played and the daemon has been quiet a while.
                    async with asyncio.timeout(clip["duration_s"] + 120):
                        while True:
                            try:
                                async with asyncio.timeout(8):
                                    seen.append(json.loads(await viewer.recv()))
                            except TimeoutError:
                                if time.monotonic() > clip_end:
                                    return seen

            seen = asyncio.run(watch())
            client.send_signal(signal.SIGINT)
            out, _ = client.communicate(timeout=60)
            assert client.returncode == 0, client_log.read_text()
        finally:
            stop_playing.set()
            player.join()
            for proc in (client, daemon):
                if proc is not None and proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)
            assert daemon.wait(timeout=60) == 0, daemon_log.read_text()

    reference = clip["text"]
    viewed = " ".join(texts(seen))
    counts = word_errors(reference, viewed)
    print(f"viewer: {viewed!r} WER {counts.wer:.3f}")
    assert counts.wer <= 0.25, (viewed, reference)
    assert any(m["type"] == "partial" for m in seen)
    client_finals = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert client_finals[-1]["type"] == "done"
    client_text = " ".join(texts(client_finals))
    client_counts = word_errors(reference, client_text)
    print(f"client: {client_text!r} WER {client_counts.wer:.3f}")
    assert client_counts.wer <= 0.25, (client_text, reference)


def test_a_sources_finals_are_journaled_before_viewers_get_them(tmp_path: Path) -> None:
    from captiond.journal.reader import list_sessions

    source = ScriptedInput()
    config = journaled_source_config(tmp_path)

    async def scenario() -> list[Message]:
        async with watched(config, source) as (_, viewer):
            seen: list[Message] = []
            source.feed(tone_bursts([1.0, 1.0]))
            await read_until(viewer, lambda m: len(texts([m])) == 1 and m["segment"] == 1, seen)
            (live,) = list_sessions(tmp_path)
            assert len(live.finals) == 2 and not live.ended
            return seen

    seen = asyncio.run(scenario())
    (session,) = list_sessions(tmp_path)
    assert [f.text for f in session.finals] == texts(seen)
    assert session.ended and session.close_code == 1001


def test_a_final_the_journal_cannot_write_costs_only_that_final(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A source runs for weeks: a disk full for one final used to end its journaling until a
    restart (no later final, no end record). Now that final is missing from the record, the
    next ones and the end record are there, and viewers got every caption."""
    from captiond.journal import writer as journal
    from captiond.journal.reader import list_sessions

    real = journal._write_all
    failed: list[bytes] = []

    def full_once(target: Any, data: bytes) -> None:
        if not failed and b'"segment":1' in data:
            failed.append(data)
            raise OSError(errno.ENOSPC, "No space left on device")
        real(target, data)

    monkeypatch.setattr(journal, "_write_all", full_once)
    source = ScriptedInput()
    config = journaled_source_config(tmp_path)

    async def scenario() -> list[Message]:
        async with watched(config, source) as (_, viewer):
            seen: list[Message] = []
            source.feed(tone_bursts([1.0, 1.0, 1.0]))
            await read_until(viewer, lambda m: len(texts(seen)) == 3, seen)
            return seen

    seen = asyncio.run(scenario())
    assert failed and len(texts(seen)) == 3
    (session,) = list_sessions(tmp_path)
    assert [f.text for f in session.finals] == [texts(seen)[0], texts(seen)[2]]
    assert session.ended and session.close_code == 1001


async def _healthz(port: int) -> str:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        return (await reader.read(100)).decode(errors="replace")
    finally:
        writer.close()


@dataclasses.dataclass
class RoomDaemon:
    """`captiond serve --source room` (fake engine) on the virtual microphone's server."""

    process: subprocess.Popen[bytes]
    port: int
    log: Path
    player: threading.Thread
    stop_playing: threading.Event
    server_stopped: bool = False  # PulseAudio is SIGSTOPped (the fixture's end resumes it)

    def stop_player(self) -> None:
        self.stop_playing.set()
        self.player.join(timeout=30)


@contextlib.contextmanager
def room_daemon(virtual_mic: VirtualMic, tmp_path: Path, *sources: str) -> Iterator[RoomDaemon]:
    """The daemon capturing the pipe, which is fed silence at real time throughout, as source
    "room" (and `sources`, more `--source` values)."""
    port = free_port()
    daemon_log = tmp_path / "daemon.log"
    serve = [*CAPTIOND, "serve", "--port", str(port), "--engine", "fake", "--source", "room"]
    for source in sources:
        serve += ["--source", source]
    player, stop_playing = silence_player(virtual_mic.fifo)
    with daemon_log.open("w") as dlog:
        process = subprocess.Popen(serve, env=virtual_mic.env, stderr=dlog)
        room = RoomDaemon(process, port, daemon_log, player, stop_playing)
        try:
            wait_for_line(daemon_log, "ready: ws://", room.process, 60)
            yield room
        finally:
            if room.server_stopped:
                os.kill(virtual_mic.server_pid, signal.SIGCONT)
            room.stop_player()
            if room.process.poll() is None:
                room.process.kill()
                room.process.wait()


async def stop_audio_server(viewer: ClientConnection, room: RoomDaemon, mic: VirtualMic) -> None:
    """SIGSTOP PulseAudio once the room captures."""
    await read_until(viewer, lambda m: m.get("state") == "capturing", [])
    os.kill(mic.server_pid, signal.SIGSTOP)
    room.server_stopped = True


def test_a_hung_audio_server_stops_its_source_not_the_daemon(
    virtual_mic: VirtualMic, tmp_path: Path
) -> None:
    """PulseAudio stopped (SIGSTOP) for 20 s while the daemon captures from it: PortAudio's calls
    block meanwhile, and they used to block the event loop (health checks, every stream, the
    SIGTERM). Now the daemon answers throughout and reports the source as waiting; once the
    server goes on, the source captures again, and SIGTERM stops the daemon."""
    with room_daemon(virtual_mic, tmp_path) as room:

        async def scenario() -> None:
            async with connect(f"ws://127.0.0.1:{room.port}/v1/captions?source=room") as viewer:
                await stop_audio_server(viewer, room, virtual_mic)
                until = time.monotonic() + 20
                while time.monotonic() < until:
                    async with asyncio.timeout(5):  # generous: it answers in milliseconds
                        assert " 200 " in await _healthz(room.port)
                    await asyncio.sleep(0.5)
                # The stalled device was reported while the server was still stopped.
                async with asyncio.timeout(5):
                    await read_until(viewer, lambda m: m.get("state") == "waiting_for_device", [])
                os.kill(virtual_mic.server_pid, signal.SIGCONT)
                room.server_stopped = False
                await read_until(viewer, lambda m: m.get("state") == "capturing", [])

        asyncio.run(scenario())
        room.stop_player()  # while the daemon still records, the pipe is read
        room.process.send_signal(signal.SIGTERM)
        assert room.process.wait(timeout=60) == 0, room.log.read_text()
        shut_down = room.log.read_text()
        assert " ERROR " not in shut_down and "Traceback" not in shut_down, shut_down


def test_sigterm_while_the_audio_server_is_stopped_ends_the_daemon(
    virtual_mic: VirtualMic, tmp_path: Path
) -> None:
    """systemd stops the daemon while PulseAudio is hung (SIGSTOP): the source's PortAudio calls
    may never return, yet the daemon tells its viewers it is going away and exits cleanly,
    within its drain time, without waiting for the audio server."""
    with room_daemon(virtual_mic, tmp_path) as room:

        async def scenario() -> int:
            async with connect(f"ws://127.0.0.1:{room.port}/v1/captions?source=room") as viewer:
                await stop_audio_server(viewer, room, virtual_mic)
                await read_until(viewer, lambda m: m.get("state") == "waiting_for_device", [])
                # The retry (1 s on) looks the device up again: that call now hangs too.
                await asyncio.sleep(3)
                room.process.send_signal(signal.SIGTERM)
                with pytest.raises(ConnectionClosed) as closed:
                    await read_until(viewer, lambda m: False, [])
                assert closed.value.rcvd is not None
                return closed.value.rcvd.code

        assert asyncio.run(scenario()) == 1001
        assert room.process.wait(timeout=Config().server.drain_timeout_s) == 0
        shut_down = room.log.read_text()
        assert " ERROR " not in shut_down and "Traceback" not in shut_down, shut_down


def test_a_microphone_plugged_in_while_another_captures_is_found(
    virtual_mic: VirtualMic, tmp_path: Path
) -> None:
    """Two sources: "room" captures the default input, "late" names a device that is not there
    yet. It is plugged in (a second PulseAudio source and the ALSA device that reaches it) while
    room's stream is open. PortAudio enumerates devices again only with none of its streams
    open, so late used to wait for it until the daemon restarted; now it finds it, and room
    captures on throughout."""
    late_fifo = virtual_mic.fifo.with_name("late.fifo")
    with room_daemon(virtual_mic, tmp_path, "late=late_mic") as room:

        async def scenario() -> list[Message]:
            room_seen: list[Message] = []
            room_url = f"ws://127.0.0.1:{room.port}/v1/captions?source=room"
            late_url = f"ws://127.0.0.1:{room.port}/v1/captions?source=late"
            async with connect(room_url) as room_viewer, connect(late_url) as late_viewer:
                await read_until(room_viewer, lambda m: m.get("state") == "capturing", room_seen)
                late_seen: list[Message] = []
                await read_until(
                    late_viewer, lambda m: m.get("state") == "waiting_for_device", late_seen
                )
                assert "late_mic" in late_seen[-1]["message"]
                # Plugged in: the ALSA device, and the PulseAudio source behind it.
                with (Path(virtual_mic.env["HOME"]) / ".asoundrc").open("a") as asoundrc:
                    asoundrc.write(
                        "pcm.late_mic { type pulse device late_source hint { show on "
                        'description "late_mic" } }\n'
                    )
                load_pipe_source(virtual_mic.env, "late_source", late_fifo)
                late_player, stop_late = silence_player(late_fifo)
                try:
                    # The retry's backoff doubles from 1 s, to at most 30 s.
                    async with asyncio.timeout(60):
                        await read_until(
                            late_viewer, lambda m: m.get("state") == "capturing", late_seen
                        )
                finally:
                    stop_late.set()
                    late_player.join(timeout=30)
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(1):
                        await read_until(room_viewer, lambda m: False, room_seen)
            return room_seen

        room_seen = asyncio.run(scenario())
        states = [m["state"] for m in room_seen if m.get("type") == "source"]
        assert states == ["capturing"], room_seen
