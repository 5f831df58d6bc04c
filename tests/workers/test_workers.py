"""The multi-process daemon (`[server] workers` > 1): the same protocol, invariants, hardening
and resume as one process, over real worker processes and the engine core in this process;
a crashed worker loses only its own sessions and is restarted; SIGTERM drains every worker;
systemd notify and the watchdog still hold. Plus the Sans-I/O parts: routing and the rule that
moves each stream's audio to the engine process once."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pytest
from daemon_harness import (
    NotifyListener,
    check_invariants,
    collect,
    make_config,
    running_daemon,
    running_pool,
    stream_pcm,
    tone_bursts,
    url,
)
from testkit import read_wav_int16
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from captiond.config import SourceConfig
from captiond.decoding import link as ipc
from captiond.decoding.link import AudioCopy
from captiond.engines.base import DecodeKind, EngineRequest, EngineResult
from captiond.engines.fake import FakeEngine
from captiond.errors import CaptiondError
from captiond.samples import KEEP_SAMPLES, AudioSpan
from captiond.server import daemon as server
from captiond.server.routing import SOURCES_WORKER, WorkerSlot, request_target, worker_for
from captiond.server.routing import worker_of_session as owner
from captiond.workers import pool as workers

BURSTS = tone_bursts([0.6, 1.2, 0.6, 2.0, 0.6], gap_s=1.0)


def run(coro: Any, timeout_s: float = 90) -> Any:
    return asyncio.run(asyncio.wait_for(coro, timeout_s))


@contextlib.asynccontextmanager
async def daemon_of(kind: str) -> AsyncIterator[Any]:
    if kind == "one process":
        async with running_daemon() as daemon:
            yield daemon
    else:
        async with running_pool(workers=2) as pool:
            yield pool


@pytest.mark.parametrize("kind", ["one process", "two workers"])
def test_same_captions_invariants_and_refusals(kind: str) -> None:
    async def scenario() -> list[list[str]]:
        async with daemon_of(kind) as daemon:
            exchanges = await asyncio.gather(
                *(stream_pcm(url(daemon), BURSTS, pause_s=0.01) for _ in range(4))
            )
            for ex in exchanges:
                check_invariants(ex)
                assert ex.close_code == 1000
            # Hardening answers the same: a foreign Origin is refused before the upgrade...
            with pytest.raises(InvalidStatus) as refused:
                await connect(url(daemon), origin="https://evil.example")  # type: ignore[arg-type]
            assert refused.value.response.status_code == 403
            # ...and an unknown message gets its error and close code.
            async with connect(url(daemon)) as conn:
                await conn.recv()
                await conn.send(json.dumps({"type": "nonsense"}))
                bad = await collect(conn)
            assert bad.of("error")[0]["code"] == "bad_message" and bad.close_code == 1008
            # A request websockets cannot parse is answered too, not met with an empty reply.
            post = await _answer(daemon.port, b"POST /v1/stream HTTP/1.1\r\nHost: h\r\n\r\n")
            assert post.startswith(b"HTTP/1.1 405 ") and b"\r\nAllow: GET\r\n" in post
            head = await _answer(daemon.port, b"HEAD / HTTP/1.1\r\nHost: h\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 405 ") and head.endswith(b"\r\n\r\n")  # no body
            for request, reason in [
                (b"GET / HTTP/1.0\r\n\r\n", b"unsupported protocol"),
                (b"GET / HTTP/1.1\r\nno colon\r\n\r\n", b"invalid HTTP header line"),
                (b"GET / HTTP/1.1\r\nX: " + b"x" * 20_000 + b"\r\n\r\n", b"line too long"),
                (b"\x16\x03\x01\x02\x00\r\n\r\n", b"invalid HTTP request line"),  # TLS
            ]:
                answer = await _answer(daemon.port, request)
                assert answer.startswith(b"HTTP/1.1 400 ") and reason in answer, answer
            return [[f["text"] for f in ex.of("final")] for ex in exchanges]

    finals = run(scenario())
    assert all(f == finals[0] for f in finals) and len(finals[0]) == 5


def test_sessions_spread_over_workers_and_resume_finds_its_worker() -> None:
    async def scenario() -> None:
        async with running_pool(workers=2) as pool:
            sessions: list[tuple[str, str]] = []
            for _ in range(6):
                conn = await connect(url(pool))
                ready = json.loads(await conn.recv())
                sessions.append((ready["session"], ready["resume_token"]))
                await conn.send(tone_bursts([0.6], gap_s=1.0).tobytes())
                while json.loads(await conn.recv())["type"] != "final":
                    pass
                assert conn.transport is not None
                conn.transport.abort()  # the network went away
            assert {owner(s, 2) for s, _ in sessions} == {0, 1}, "round robin over both"
            for session, token in sessions:
                async with connect(url(pool, query=f"resume={token}&since=1")) as again:
                    resumed = json.loads(await again.recv())
                    assert resumed["type"] == "resumed" and resumed["session"] == session
                    await again.send(tone_bursts([0.6]).tobytes())
                    await again.send(json.dumps({"type": "end"}))
                    rest = await collect(again)
                assert [f["segment"] for f in rest.of("final")] == [1]
                assert rest.close_code == 1000
            metrics = await asyncio.to_thread(_get, f"http://127.0.0.1:{pool.port}/metrics")
            assert "captiond_sessions_total 6.0" in metrics, "metrics add up the workers"

    run(scenario())


def test_a_crashed_worker_loses_only_its_sessions_and_is_restarted() -> None:
    long_pcm = tone_bursts([0.6] * 8, gap_s=1.0)

    async def scenario() -> None:
        async with running_pool(workers=2) as pool:
            conns = []
            while {owner(json.loads(r)["session"], 2) for _, r in conns} != {0, 1}:
                conn = await connect(url(pool))
                conns.append((conn, await conn.recv()))
            victim_conn, victim_ready = next(
                (c, r) for c, r in conns if owner(json.loads(r)["session"], 2) == 1
            )
            survivor, survivor_ready = next(
                (c, r) for c, r in conns if owner(json.loads(r)["session"], 2) == 0
            )
            for _ in range(100):  # each worker reports once a second
                if _served(pool) == len(conns):
                    break
                await asyncio.sleep(0.1)
            assert _served(pool) == len(conns)
            victim_pid = pool.pids[2]
            reader = asyncio.create_task(collect(survivor))
            half = len(long_pcm) // 2
            await survivor.send(long_pcm[:half].tobytes())
            await asyncio.sleep(0.5)
            os.kill(victim_pid, signal.SIGKILL)
            with pytest.raises(ConnectionClosed):
                await asyncio.wait_for(victim_conn.recv(), 10)
            await survivor.send(long_pcm[half:].tobytes())
            await survivor.send(json.dumps({"type": "end"}))
            ex = await asyncio.wait_for(reader, 30)
            ex.messages.insert(0, json.loads(survivor_ready))
            check_invariants(ex)
            assert len(ex.of("final")) == 8 and ex.close_code == 1000, "the other worker goes on"
            for _ in range(100):  # restarted with a short backoff
                if pool.restarts == 1 and len(pool.pids) == 3 and pool.healthy(5.0):
                    break
                await asyncio.sleep(0.1)
            assert pool.restarts == 1 and victim_pid not in pool.pids
            assert _served(pool) >= len(conns), "systemd's STATUS= never counts backwards"
            # The restarted worker serves new sessions (and resumes of its ids are refused
            # cleanly: its memory is gone).
            token = json.loads(victim_ready)["resume_token"]
            async with connect(url(pool, query=f"resume={token}")) as gone:
                refused = await collect(gone)
            assert refused.close_code == 4410
            exchanges = await asyncio.gather(*(stream_pcm(url(pool), BURSTS) for _ in range(4)))
            assert all(len(e.of("final")) == 5 for e in exchanges)
            for conn, _ in conns:
                await conn.close()

    run(scenario())


class WedgedEngine(FakeEngine):
    """A fake engine whose batches wait until `release` is set (a hung GPU call); `held`: the
    requests it holds."""

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()
        self.held = 0

    def transcribe_batch(self, requests: Sequence[EngineRequest]) -> list[EngineResult]:
        self.held = len(requests)
        self.release.wait()
        self.held = 0
        return super().transcribe_batch(requests)


@pytest.mark.parametrize("kind", ["one process", "two workers"])
def test_healthz_says_when_the_engine_is_wedged(kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """`/healthz` is 503 while the engine thread's heartbeat is stale (here 1.5 s, over its
    1-s idle tick; 30 s by default), and ok again once it answers. With workers the pool
    answers it: a worker sees an idle engine only through its answers."""
    monkeypatch.setattr(server, "HEALTHY_WITHIN_S", 1.5)
    monkeypatch.setattr(workers, "HEALTHY_WITHIN_S", 1.5)
    engine = WedgedEngine()

    async def health(port: int) -> int:
        try:
            await asyncio.to_thread(_get, f"http://127.0.0.1:{port}/healthz")
            return 200
        except urllib.error.HTTPError as exc:
            return exc.code

    async def scenario() -> list[int]:
        context = (
            running_daemon(engine=engine)
            if kind == "one process"
            else running_pool(workers=2, engine=engine)
        )
        async with context as daemon:
            statuses = [await health(daemon.port)]
            stream = asyncio.create_task(stream_pcm(url(daemon), BURSTS))
            await asyncio.sleep(3.0)  # a decode waits in the wedged engine
            statuses.append(await health(daemon.port))
            engine.release.set()
            await stream
            statuses.append(await health(daemon.port))
        return statuses

    try:
        assert run(scenario()) == [200, 503, 200]
    finally:
        engine.release.set()


def test_a_wedged_engine_bounds_what_waits_in_memory_and_the_rest_waits_in_the_clients() -> None:
    """Overload at its worst: the engine core answers nothing while two clients send 20 min of
    speech each as fast as they can. A stream has one decode in flight, so the link to the
    core carries no more; its worker stops reading it once `max_buffered_s` of audio waits;
    TCP then holds the clients' sends back. The workers' memory stays put (reading it all
    would take 2 x 77 MB of float32) and the engine's queue does not grow."""
    engine = WedgedEngine()
    config = make_config(server={"max_audio_speed": 1e6, "max_buffered_s": 3.0})
    flood = tone_bursts([2.0] * 400, gap_s=1.0)  # 20 min of 2-s "utterances"
    streams = 2

    conns: list[Any] = []

    async def send_all(target: str) -> None:
        async with connect(target) as conn:
            conns.append(conn)
            await conn.recv()  # ready
            for start in range(0, len(flood), 16_000):
                await conn.send(flood[start : start + 16_000].tobytes())

    async def scenario() -> tuple[list[int], int, bool]:
        async with running_pool(workers=2, engine=engine, config=config) as pool:
            workers_rss = [psutil.Process(pid) for pid in pool.pids[1:]]
            before = sum(p.memory_info().rss for p in workers_rss)
            senders = [asyncio.create_task(send_all(url(pool))) for _ in range(streams)]
            queued = []
            for _ in range(4):
                await asyncio.sleep(1.5)
                queued.append(len(pool._core.scheduler._pending) + engine.held)
            grown = sum(p.memory_info().rss for p in workers_rss) - before
            sent_all = any(task.done() and not task.exception() for task in senders)
            for conn in conns:  # no close handshake gets through a socket nobody reads
                conn.transport.abort()
            for task in senders:
                task.cancel()
            await asyncio.gather(*senders, return_exceptions=True)
            engine.release.set()
        return queued, grown, sent_all

    try:
        queued, grown, sent_all = run(scenario())
    finally:
        engine.release.set()
    assert not sent_all  # held back by TCP, not read into memory
    assert grown < 40 << 20, f"the workers grew by {grown >> 20} MB"
    # The engine's queue: per stream the decode it waits for, and one it withdrew (its
    # partial, once its utterance ended), dropped when the engine next takes a batch.
    settled = queued[1:]  # the first sample may come before every stream's first decode
    assert 1 <= settled[0] <= 2 * streams and settled == [settled[0]] * len(settled), queued


def test_a_hung_worker_is_the_pools_to_replace_not_the_watchdogs() -> None:
    """A stopped (hung) worker makes the pool no less healthy for systemd's watchdog: the
    pool replaces it after `_SILENT_S`, and only its streams are lost; a failed watchdog would
    kill every stream and reload the model."""

    async def scenario() -> bool:
        async with running_pool(workers=2) as pool:
            hung = pool.pids[1]
            os.kill(hung, signal.SIGSTOP)
            try:
                await asyncio.sleep(2.5)
                return pool.healthy(2.0)
            finally:
                os.kill(hung, signal.SIGCONT)

    assert run(scenario())


def test_a_worker_that_cannot_start_fails_the_start_at_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """What stops a worker as it starts (here a journal dir under a file) would stop every
    restart: the start fails with the worker's reason in its log, not after 60 s of them, and
    leaves no future whose error asyncio reports as lost."""
    (tmp_path / "file").write_text("")
    config = make_config(journal={"dir": str(tmp_path / "file" / "journal")})

    async def scenario() -> str:
        with pytest.raises(CaptiondError) as failed:
            async with running_pool(config, workers=2):
                pass
        return str(failed.value)

    assert "exited with 2 as it started" in run(scenario())
    gc.collect()
    assert "never retrieved" not in caplog.text


def test_workers_listen_on_an_ipv6_address() -> None:
    config = make_config(server={"host": "::1"})

    async def scenario() -> list[str]:
        async with running_pool(config, workers=2) as pool:
            ex = await stream_pcm(f"ws://[::1]:{pool.port}/v1/stream", BURSTS)
        return [f["text"] for f in ex.of("final")]

    assert len(run(scenario())) == 5


def test_viewers_reach_the_worker_that_runs_the_sources() -> None:
    config = dataclasses.replace(make_config(), sources=(SourceConfig(name="room", device="none"),))

    async def scenario() -> None:
        async with running_pool(config, workers=3) as pool:
            for _ in range(3):  # whichever worker is next in turn
                async with connect(url(pool, "/v1/captions", "source=room")) as viewer:
                    first = json.loads(await asyncio.wait_for(viewer.recv(), 10))
                # Only worker 0 runs the source (no such device here: it waits for one); any
                # other worker would have answered no_such_source.
                assert first["type"] == "source" and first["name"] == "room", first
            # systemd's STATUS= line shows the source, as with one process (worker 0 reports
            # it each second).
            async with asyncio.timeout(10):
                while "sources: room waiting_for_device (0 viewers)" not in pool.status_line():
                    await asyncio.sleep(0.1)

    run(scenario())


# -- the real `captiond serve --workers 2`: systemd notify, watchdog, SIGTERM drain ------------


@pytest.fixture
def serve_workers(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[bytes], NotifyListener, int]]:
    notify = NotifyListener(tmp_path / "notify")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {**os.environ, "NOTIFY_SOCKET": str(tmp_path / "notify"), "WATCHDOG_USEC": "2000000"}
    command = [sys.executable, "-m", "captiond.cli", "serve", "--workers", "2", "--engine", "fake"]
    with (tmp_path / "log").open("wb") as log:
        proc = subprocess.Popen([*command, "--port", str(port)], env=env, stderr=log)
        try:
            yield proc, notify, port
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
            notify.close()


def test_serve_with_workers_notifies_watchdogs_and_drains_on_sigterm(
    serve_workers: tuple[subprocess.Popen[bytes], NotifyListener, int], speech_dir: Path
) -> None:
    proc, notify, port = serve_workers
    notify.wait_for("READY=1", 60)
    notify.wait_for("WATCHDOG=1", 5)
    pcm = read_wav_int16(speech_dir / "utt" / "jfk_inaugural_1961.wav")

    async def scenario() -> dict[str, Any]:
        async with connect(f"ws://127.0.0.1:{port}/v1/stream") as conn:
            await conn.recv()
            await conn.send(pcm[: len(pcm) // 2].tobytes())  # mid-sentence: no endpoint yet
            await asyncio.sleep(1.0)
            notify.wait_for("1 streams open", 10)
            proc.send_signal(signal.SIGTERM)
            ex = await collect(conn)
        return {"finals": ex.of("final"), "errors": ex.of("error"), "code": ex.close_code}

    result = run(scenario())
    assert result["finals"], "the open utterance was finalized before the close"
    assert result["errors"][0]["code"] == "shutting_down" and result["code"] == 1001
    assert proc.wait(30) == 0
    notify.wait_for("STOPPING=1", 1)
    assert any("2/2 workers" in m for m in notify.messages), notify.messages


# -- Sans-I/O: routing, audio moved once -------------------------------------------------------


def test_routing_pins_resumes_and_viewers_and_spreads_the_rest() -> None:
    slot = WorkerSlot(2, 3)
    ids = [slot.new_session_id() for _ in range(20)]
    assert all(owner(i, 3) == 2 and len(i) == 12 for i in ids)
    assert slot.share(64) == 22 and WorkerSlot(0, 3).runs_sources
    assert request_target(b"GET /v1/stream?x=1 HTT") is None, "line not complete yet"
    assert request_target(b"GET /v1/stream?x=1 HTTP/1.1\r\nHost: a\r\n") == "/v1/stream?x=1"
    assert request_target(b"\x16\x03\x01 junk\r\n") == "", "not HTTP: any worker answers 400"
    assert worker_for(f"/v1/stream?resume={ids[0]}.secret&since=3", 3, 0) == 2
    assert worker_for("/v1/captions?source=room", 3, 1) == SOURCES_WORKER
    assert worker_for("/v1/stream?resume=bad", 3, 1) == 1, "malformed: refused anywhere"
    assert worker_for("/v1/listen?model=nova", 3, 1) == 1


def test_the_engine_process_copy_of_a_stream_matches_what_windows_need() -> None:
    rng = random.Random(7)
    stream = np.arange(4_000_000, dtype=np.float32)
    copy, mirror = AudioCopy(), AudioSpan()
    end = sent = 0
    handed_out = []  # windows are views: later puts must never write into them
    for _ in range(3_000):
        end = min(len(stream), end + rng.randint(0, 20_000))
        start = max(0, end - rng.randint(0, KEEP_SAMPLES))
        if rng.random() < 0.05:  # a window after a gap, or one reaching before what is held
            start = max(0, end - rng.randint(0, 2_000))
        send_from = mirror.send_from(start, end)
        if send_from < end:
            mirror.advance(send_from, end)
            copy.put(send_from, stream[send_from:end])
            sent += end - send_from
        assert copy.span == mirror, "the worker's mirror agrees without a reply"
        window = copy.window(start, end)
        assert np.array_equal(window, stream[start:end])
        handed_out.append((start, window))
    assert sent > end, "windows after gaps or before what is held are sent whole"
    for start, window in handed_out:
        assert np.array_equal(window, stream[start : start + len(window)])

    # A session's pattern: a partial every 0.5 s reaching 10 s back, a final every 4 s reaching
    # 30 s back: every sample crosses once.
    copy, mirror, sent = AudioCopy(), AudioSpan(), 0
    for step in range(1, 240):
        end = step * 8_000
        back = KEEP_SAMPLES if step % 8 == 0 else 10 * 16_000
        start = max(0, end - back)
        send_from = mirror.send_from(start, end)
        mirror.advance(send_from, end)
        copy.put(send_from, stream[send_from:end])
        sent += end - send_from
        assert np.array_equal(copy.window(start, end), stream[start:end])
    assert sent == end, "audio moves once"


def test_decode_and_result_messages_cross_the_link_whole() -> None:
    """Every field of a request and of a result survives the link's flat pickles; a request's
    own audio stays behind (the message's `audio` carries what the core lacks)."""
    window = np.linspace(-1, 1, 32_000, dtype=np.float32)
    request = EngineRequest(
        audio=window,
        kind=DecodeKind.FINAL,
        language="de",
        language_hint="fr",
        switch_language="it",
        switch_nats=1.5,
        candidates=("de", "fr"),
        detect_from_sample=160,
        task="translate",
        prompt="Vorher.",
        prefix="Guten",
        stream_prompt="Grafana.",
        beam_size=5,
        speech_from_sample=320,
        stream="s1",
        end_sample=64_000,
        speaker_windows=((0, 24_000), (8_000, 32_000)),
    )
    # Not one field left at its default: a field the pickles forgot would come back changed.
    defaults = EngineRequest(audio=window, kind=DecodeKind.PARTIAL)
    for field in dataclasses.fields(EngineRequest):
        if field.name != "audio":
            assert getattr(request, field.name) != getattr(defaults, field.name), field.name
    result = EngineResult(
        text="Guten Tag.",
        tokens=(1, 2, 3),
        avg_logprob=-0.3,
        no_speech_prob=0.2,
        compression_ratio=1.7,
        language="de",
        language_probability=0.9,
        switch_language="it",
        switch_nats=2.1,
        unit_probs=(0.8, 0.95),
        spaced=False,
        speaker_embeddings=((0.6, 0.8), (1.0, 0.0)),
        turn_probability=0.8,
    )
    sent: list[ipc.Message] = [
        ipc.Decode(7, "s1", len(window), 40_000, window[8_000:], request),
        ipc.Result(7, result),
        ipc.Result(8, None, "the engine failed"),
    ]

    async def cross() -> list[ipc.Message | None]:
        left, right = socket.socketpair()
        _, writer = await asyncio.open_connection(sock=left)
        reader, _ = await asyncio.open_connection(sock=right)
        for message in sent:
            ipc.write(writer, message)
        writer.close()
        return [await ipc.read(reader) for _ in range(len(sent) + 1)]

    decode, *results, end = asyncio.run(cross())
    assert end is None, "the writer closed"
    assert results == sent[1:]
    assert isinstance(decode, ipc.Decode)
    assert np.array_equal(decode.audio, window[8_000:])
    names = [field.name for field in dataclasses.fields(EngineRequest) if field.name != "audio"]
    assert [getattr(decode.request, n) for n in names] == [getattr(request, n) for n in names]
    assert decode.request.audio.size == 0
    assert (decode.call, decode.stream, decode.window_samples, decode.audio_from_sample) == (
        7,
        "s1",
        len(window),
        40_000,
    )


def _served(pool: Any) -> int:
    """Sessions served, from the pool's systemd STATUS= line."""
    served = re.search(r"(\d+) served", pool.status_line())
    assert served is not None
    return int(served[1])


async def _answer(port: int, request: bytes) -> bytes:
    """Everything the daemon sends back to a raw `request`, up to its close."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(request)
    answer = await reader.read()
    writer.close()
    return answer


def _get(address: str) -> str:
    with urllib.request.urlopen(address, timeout=10) as response:
        body: bytes = response.read()
    return body.decode()
