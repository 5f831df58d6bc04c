"""The hostile-client suite: a real daemon (fake engine) against what attackers and careless
clients send. Every connection is bounded, every error answered, no caption lost."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pytest
from daemon_harness import (
    Exchange,
    RecordingEngine,
    check_invariants,
    collect,
    make_config,
    running_daemon,
    stream_pcm,
    tone_bursts,
    url,
)
from testkit import read_wav_int16
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from captiond.config import Config, StreamConfig
from captiond.dialects import Received
from captiond.dialects.native import NativeDialect
from captiond.engines.base import EngineInfo
from captiond.engines.fake import FakeEngine
from captiond.journal.reader import list_sessions
from captiond.lang.languages import LanguageSetting, parse_language
from captiond.ops.logs import configure_logging

TOKEN = "s3cret"


def run(coro: Any) -> Any:
    return asyncio.run(coro)


async def refused_status(target: str, **kwargs: Any) -> int | None:
    """The HTTP status of a refused handshake; None when the websocket opened."""
    try:
        async with connect(target, **kwargs):
            return None
    except InvalidStatus as exc:
        return exc.response.status_code


# -- before the upgrade: Origin and token -----------------------------------------------------


@pytest.mark.parametrize(
    ("origin", "allowed", "status"),
    [
        (None, (), None),  # CLI clients and apps send no Origin
        ("SAME", (), None),  # the page the daemon serves
        ("http://evil.example.com", (), 403),
        ("null", (), 403),
        ("http://127.0.0.1:1", (), 403),  # same host, another port: another origin
        ("https://app.example.com", ("https://app.example.com",), None),
        ("https://other.example.com", ("https://app.example.com",), 403),
        ("http://evil.example.com", ("*",), None),
    ],
)
def test_cross_site_pages_are_refused(
    origin: str | None, allowed: tuple[str, ...], status: int | None
) -> None:
    async def scenario() -> None:
        config = make_config(server={"allowed_origins": allowed})
        async with running_daemon(config) as daemon:
            given = f"http://127.0.0.1:{daemon.port}" if origin == "SAME" else origin
            for path in ("/v1/stream", "/v1/captions"):
                assert await refused_status(url(daemon, path), origin=given) == status, path

    run(scenario())


@pytest.mark.parametrize(
    ("host", "allowed", "status"),
    [
        ("evil.example", (), b"403"),  # DNS rebinding: its name now resolves to 127.0.0.1
        ("evil.example", ("http://evil.example",), b"101"),  # listed: a reverse proxy's name
        ("localhost", (), b"101"),
        ("captions.localhost", (), b"101"),
        ("[::1]", (), b"101"),
        ("MACHINE", (), b"101"),  # the machine's host name
        ("MACHINE.local", (), b"101"),
    ],
)
def test_the_daemons_own_origin_names_this_machine(
    host: str, allowed: tuple[str, ...], status: bytes
) -> None:
    """A page is the daemon's own only if its host, the one the request was sent to, names
    this machine: a site rebound to 127.0.0.1 sends matching Host and Origin headers too.
    (Host without a port, as from a reverse proxy on port 80: the names must match.)"""
    host = host.replace("MACHINE", socket.gethostname().split(".")[0].lower())

    async def scenario() -> bytes:
        async with running_daemon(make_config(server={"allowed_origins": allowed})) as daemon:
            request = (
                f"GET /v1/stream HTTP/1.1\r\nHost: {host}\r\nOrigin: http://{host}\r\n"
                "Upgrade: websocket\r\nConnection: Upgrade\r\n"
                "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n"
            )
            reader, writer = await asyncio.open_connection("127.0.0.1", daemon.port)
            writer.write(request.encode())
            answer = await asyncio.wait_for(reader.readline(), 15)
            writer.close()
            return answer

    answer = run(scenario())
    assert answer.startswith(b"HTTP/1.1 " + status), answer


@pytest.mark.parametrize(
    ("query", "headers", "status"),
    [
        ("", {}, 401),
        (f"token={TOKEN}", {}, None),
        ("", {"Authorization": f"Bearer {TOKEN}"}, None),
        ("", {"Authorization": f"bearer {TOKEN}"}, None),  # the scheme is case-insensitive
        ("", {"Authorization": TOKEN}, 401),  # no scheme
        ("", {"Authorization": f"Basic {TOKEN}"}, 401),
        ("token=wrong", {"Authorization": f"Bearer {TOKEN}"}, 401),  # no outvoting
        (f"token=wrong&token={TOKEN}", {}, 401),  # nor by a later ?token=
        (f"token={TOKEN}", {"Authorization": "Bearer wrong"}, 401),
        ("token=", {}, 401),
    ],
)
def test_token_rule_is_checked_before_the_upgrade(
    query: str, headers: dict[str, str], status: int | None
) -> None:
    async def scenario() -> None:
        async with running_daemon(make_config(auth={"token": TOKEN})) as daemon:
            got = await refused_status(url(daemon, query=query), additional_headers=headers)
            assert got == status

    run(scenario())


async def _raw_request(port: int, request: bytes) -> bytes:
    """What the daemon answers to `request` before it closes the connection."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(request)
    answer = await asyncio.wait_for(reader.read(), 15)
    writer.close()
    return answer


@pytest.mark.parametrize(
    ("headers", "status"),
    [
        (b"Origin: http://a.example\r\nOrigin: http://b.example\r\n", b"400"),
        (b"Host: x\r\n", b"400"),  # a second Host
        (b"Origin: http://[::1\r\n", b"403"),
        (b"Authorization: Bearer s3cr\xc3\xa9\r\n", b"401"),
        (b"Authorization: Bearer \xff\xfe\r\n", b"401"),
        (b"Authorization: Bearer a\r\nAuthorization: Bearer " + TOKEN.encode() + b"\r\n", b"400"),
    ],
)
def test_odd_headers_are_refused_with_a_status(
    headers: bytes, status: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    async def scenario() -> bytes:
        async with running_daemon(make_config(auth={"token": TOKEN})) as daemon:
            request = b"GET /v1/stream HTTP/1.1\r\nHost: 127.0.0.1\r\n" + headers + b"\r\n"
            return await _raw_request(daemon.port, request)

    answer = run(scenario())
    assert answer.startswith(b"HTTP/1.1 " + status), answer[:80]
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


@pytest.mark.parametrize(
    "request_bytes",
    [
        b"POST /v1/stream HTTP/1.1\r\nHost: h\r\nContent-Length: 0\r\n\r\n",
        b"HEAD / HTTP/1.1\r\nHost: h\r\n\r\n",
        b"GET / HTTP/1.0\r\n\r\n",
        b"\x16\x03\x01 not http\r\n\r\n",
        b"GET / HTTP/1.1\r\nX-Big: " + b"a" * 9_000 + b"\r\n\r\n",
    ],
    ids=["POST", "HEAD", "HTTP/1.0", "not HTTP", "9-kB header"],
)
def test_malformed_requests_leave_no_traceback(
    request_bytes: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    """websockets closes them unanswered (it serves GET only); the daemon logs no ERROR, which
    anyone could otherwise fill its log with, and goes on serving."""

    async def scenario() -> Exchange:
        async with running_daemon() as daemon:
            await _raw_request(daemon.port, request_bytes)
            return await stream_pcm(url(daemon), tone_bursts([1.0]))

    honest = run(scenario())
    assert honest.of("done")
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


# -- holding slots ------------------------------------------------------------------------------


def test_idle_sessions_are_closed_and_cannot_lock_the_daemon_out() -> None:
    async def scenario() -> None:
        config = make_config(server={"max_sessions": 2, "idle_timeout_s": 0.5})
        async with running_daemon(config) as daemon:
            squatters = [await connect(url(daemon)) for _ in range(2)]
            for conn in squatters:
                assert json.loads(await conn.recv())["type"] == "ready"

            async def keepalive_only(conn: ClientConnection) -> Exchange:
                reader = asyncio.create_task(collect(conn))
                # The daemon's close may land between a check and the next keepalive.
                with contextlib.suppress(ConnectionClosed):
                    while not reader.done():
                        await conn.send(json.dumps({"type": "keepalive"}))
                        await asyncio.sleep(0.1)
                return await reader

            exchanges = await asyncio.gather(collect(squatters[0]), keepalive_only(squatters[1]))
            for ex in exchanges:
                assert [e["code"] for e in ex.of("error")] == ["idle_timeout"]
                assert ex.close_code == 4408
            ok = await stream_pcm(url(daemon), tone_bursts([1.0]))
            assert ok.close_code == 1000 and ok.of("done")

    run(scenario())


def test_idle_time_counts_from_the_last_audio() -> None:
    """Audio for longer than the idle timeout holds the session; once the client stops
    sending, it is closed after the timeout, with the finals of what it sent."""

    async def scenario() -> tuple[Exchange, float]:
        config = make_config(server={"idle_timeout_s": 0.5})
        async with running_daemon(config) as daemon, connect(url(daemon)) as conn:
            reader = asyncio.create_task(collect(conn))
            pcm = tone_bursts([1.0, 1.0], gap_s=0.6)  # 3.1 s, sent at 2x real time
            for start in range(0, len(pcm), 1600):
                await asyncio.sleep(0.05)
                await conn.send(pcm[start : start + 1600].tobytes())
            last_audio_s = asyncio.get_running_loop().time()
            ex = await asyncio.wait_for(reader, 10)
            return ex, asyncio.get_running_loop().time() - last_audio_s

    ex, closed_after_s = run(scenario())
    assert [e["code"] for e in ex.of("error")] == ["idle_timeout"]
    assert ex.close_code == 4408
    assert 0.5 <= closed_after_s < 2.0
    assert len(ex.of("final")) == 2  # the utterances heard before the client went quiet


def test_connections_per_ip_are_limited() -> None:
    async def scenario() -> None:
        config = make_config(server={"max_sessions_per_ip": 2})
        async with running_daemon(config) as daemon:
            first = [await connect(url(daemon)) for _ in range(2)]
            async with connect(url(daemon, "/v1/captions", "source=x")) as third:
                ex = await collect(third)
            assert ex.of("error")[0]["code"] == "overloaded" and ex.close_code == 1013
            for conn in first:
                await conn.close()
            ok = await stream_pcm(url(daemon), tone_bursts([1.0]))
            assert ok.close_code == 1000

    run(scenario())


# -- floods -------------------------------------------------------------------------------------


def test_audio_faster_than_allowed_is_refused_after_its_finals() -> None:
    async def scenario() -> Exchange:
        config = make_config(server={"max_audio_speed": 4.0, "audio_burst_s": 6.0})
        async with running_daemon(config) as daemon:
            # 3 bursts (6 s of audio) fit the burst; the next 20 s at once do not.
            ex = await stream_pcm(url(daemon), np.concatenate([tone_bursts([1.0] * 3)] * 5))
        return ex

    ex = run(scenario())
    check_invariants(ex)
    assert ex.of("error")[0]["code"] == "rate_limited" and ex.close_code == 4029
    assert len(ex.of("final")) >= 3, "the finals of the audio before the refusal were delivered"
    assert not ex.of("done")


async def _flood(target: str, seconds_of_audio: int) -> Exchange:
    """Send audio as fast as the socket takes it (100 ms frames of a loud tone)."""
    frame = tone_bursts([0.1], gap_s=0.0).tobytes()
    async with connect(target) as conn:
        reader = asyncio.create_task(collect(conn))
        with contextlib.suppress(ConnectionClosed):
            for _ in range(seconds_of_audio * 10):
                await conn.send(frame)
            await conn.send(json.dumps({"type": "end"}))
        return await asyncio.wait_for(reader, 120)


def test_memory_under_an_audio_flood_is_bounded() -> None:
    """The issue's probe sent 4,067 s of audio in 10 s (RSS +401 MB). Refused by the speed
    limit; and with the limit lifted, the buffered-audio cap and backpressure bound it."""
    process = psutil.Process()

    async def scenario(config: Config, seconds: int) -> tuple[Exchange, int]:
        async with running_daemon(config, engine=FakeEngine(delay_s=0.05)) as daemon:
            before = process.memory_info().rss
            ex = await _flood(url(daemon), seconds)
            return ex, process.memory_info().rss - before

    limited, limited_growth = run(scenario(make_config(), 4_000))
    assert limited.close_code == 4029
    # No speed limit: the reader stops reading while 10 s of audio wait for decodes.
    unlimited = make_config(server={"max_audio_speed": 1e6, "max_buffered_s": 10.0})
    slow, slow_growth = run(scenario(unlimited, 300))
    assert slow.close_code == 1000 and slow.of("done")
    print(
        f"RSS growth: rate-limited {limited_growth >> 20} MB, backpressure {slow_growth >> 20} MB"
    )
    assert limited_growth < 100 << 20 and slow_growth < 100 << 20


def test_a_stream_of_tiny_frames_keeps_little_per_frame() -> None:
    """What a stream keeps per frame it reads (arrival times, for the final-latency metric) is
    kept per 30 ms of audio: 2-byte frames (one sample each) grew it by 16,000 a second."""

    async def scenario() -> int:
        async with running_daemon() as daemon, connect(url(daemon)) as conn:
            await conn.recv()
            for _ in range(3_200):  # 0.2 s of audio
                await conn.send(b"\x00\x00")
            await conn.send(json.dumps({"type": "end"}))
            (live,) = daemon._live.values()
            assert (await collect(conn)).of("done")[0]["audio_ms"] == 200  # every frame read
            return len(live.arrivals)  # silence: no final took any

    assert run(scenario()) <= 200 // 30 + 2


# -- malformed input ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "frame",
    [
        "[" * 100_000,
        "[" * 3_000,  # small, but nested beyond the JSON parser's depth
        '{"type": "end", "n": ' + "9" * 5_000 + "}",
        "x" * 10_000,
    ],
)
def test_huge_or_deep_json_is_a_bad_message(frame: str) -> None:
    async def scenario() -> Exchange:
        async with running_daemon() as daemon, connect(url(daemon)) as conn:
            await conn.send(frame)
            return await collect(conn)

    ex = run(scenario())
    assert ex.of("error")[0]["code"] == "bad_message" and ex.close_code == 1008


async def _raw_frame(target: str, frame: bytes) -> Exchange:
    """Send bytes no websocket library would send, after a normal handshake."""
    async with connect(target) as conn:
        assert json.loads(await conn.recv())["type"] == "ready"
        assert conn.transport is not None
        conn.transport.write(frame)
        return await collect(conn)


_MASK = b"\x00\x00\x00\x00"  # a zero mask leaves the payload as it is


@pytest.mark.parametrize(
    ("frame", "code", "close"),
    [
        # a binary frame of 2 MB: over websockets' hard limit, refused before it is read
        (b"\x82\xff" + (2_000_000).to_bytes(8, "big") + _MASK, "too_large", 1009),
        (b"\x81\x82" + _MASK + b"\xff\xfe", "bad_message", 1007),  # text, invalid UTF-8
        (b"\x83\x80" + _MASK, "bad_message", 1002),  # reserved opcode 3
    ],
)
def test_transport_refusals_are_answered_with_our_error(
    frame: bytes, code: str, close: int, caplog: pytest.LogCaptureFixture
) -> None:
    """The session is then held as a dropped one (its finals replayed on a resume); once it
    expires, the log says the close code the client got, not 1006."""
    config = make_config(server={"resume_s": 0.3, "drop_grace_s": 0.1})

    def session_lines() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.getMessage().startswith("session ")]

    async def scenario() -> Exchange:
        async with running_daemon(config) as daemon:
            ex = await _raw_frame(url(daemon), frame)
            for _ in range(300):  # until the session expires and is logged
                if session_lines():
                    break
                await asyncio.sleep(0.1)
            return ex

    with caplog.at_level(logging.INFO, logger="captiond.server.daemon"):
        ex = run(scenario())
    assert [e["code"] for e in ex.of("error")] == [code] and ex.close_code == close
    (line,) = session_lines()
    assert line.endswith(f"close={close}")


def test_frames_after_end_get_their_error_after_every_final() -> None:
    async def scenario() -> Exchange:
        async with (
            running_daemon(engine=FakeEngine(delay_s=0.2)) as daemon,
            connect(url(daemon)) as conn,
        ):
            reader = asyncio.create_task(collect(conn))
            for _ in range(2):
                await conn.send(tone_bursts([1.0] * 2).tobytes())
            await conn.send(json.dumps({"type": "end"}))
            await conn.send(b"\x00\x00" * 160)
            await conn.send(json.dumps({"type": "finalize"}))
            return await asyncio.wait_for(reader, 30)

    ex = run(scenario())
    check_invariants(ex)
    assert len(ex.of("final")) == 4
    assert ex.messages[-1]["type"] == "error" and ex.messages[-1]["code"] == "bad_message"
    assert ex.close_code == 1008


def test_a_bug_reading_one_stream_ends_it_cleanly_and_frees_its_slot(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An exception no rule expects (a bug in a dialect) is the stream's `internal` error, after
    its finals, and close 1011; its session ends and gives its slot back. It once escaped the
    handler and held the slot until a restart."""
    receive = NativeDialect.receive

    def buggy_receive(self: NativeDialect, frame: str | bytes) -> Received:
        if frame == '{"type": "boom"}':
            raise RuntimeError("a bug")
        return receive(self, frame)

    monkeypatch.setattr(NativeDialect, "receive", buggy_receive)

    async def scenario() -> tuple[Exchange, Exchange]:
        config = make_config(server={"max_sessions": 1})
        async with running_daemon(config, engine=FakeEngine(delay_s=0.2)) as daemon:
            async with connect(url(daemon)) as conn:
                reader = asyncio.create_task(collect(conn))
                await conn.send(tone_bursts([1.0] * 2).tobytes())
                await conn.send(json.dumps({"type": "boom"}))
                broken = await asyncio.wait_for(reader, 30)
            return broken, await stream_pcm(url(daemon), tone_bursts([1.0]))

    broken, honest = run(scenario())
    check_invariants(broken)
    assert len(broken.of("final")) == 2, "the finals of the audio before the bug were delivered"
    assert [e["code"] for e in broken.of("error")] == ["internal"]
    assert broken.close_code == 1011
    check_invariants(honest)
    assert honest.of("done") and honest.close_code == 1000, "the slot was given back"


def test_a_language_the_model_cannot_caption_is_refused_when_the_stream_opens() -> None:
    """The fake engine is English-only, as tiny.en: Spanish, even as one of the languages to
    detect among, would decode to nothing, silently; a code Whisper does not know once failed
    the stream at its first decode (engine_failed)."""

    async def scenario() -> tuple[Exchange, Exchange, int | None, Exchange, Exchange]:
        async with running_daemon() as daemon:
            spanish = await stream_pcm(url(daemon, query="language=en,es"), tone_bursts([1.0]))
            unknown = await stream_pcm(url(daemon, query="language=xx"), tone_bursts([1.0]))
            deepgram = await refused_status(
                f"ws://127.0.0.1:{daemon.port}/v1/listen?encoding=linear16&sample_rate=16000"
                "&language=es"
            )
            auto = await stream_pcm(url(daemon, query="language=auto"), tone_bursts([1.0]))
            # Translation too: an English-only model has no translate task.
            translate = await stream_pcm(url(daemon, query="task=translate"), tone_bursts([1.0]))
        return spanish, unknown, deepgram, auto, translate

    spanish, unknown, deepgram, auto, translate = run(scenario())
    refusals = (
        (spanish, "English-only"),
        (unknown, "not one Whisper knows"),
        (translate, "task 'translate' needs a multilingual model"),
    )
    for refused, words in refusals:
        assert [e["code"] for e in refused.of("error")] == ["bad_message"]
        assert words in refused.of("error")[0]["message"] and refused.close_code == 1008
    assert deepgram == 400
    assert auto.of("final") and auto.of("done"), "auto on an English-only model is English"


def test_auto_on_an_english_only_model_is_english_from_the_first_partial() -> None:
    """There is nothing to detect: no utterance waits `language_detect_s` (3 s) of its audio
    for a first partial, and no decode asks the engine to detect."""
    engine = RecordingEngine(multilingual=False)

    async def scenario() -> Exchange:
        async with running_daemon(engine=engine) as daemon:
            pcm = tone_bursts([4.0])
            return await stream_pcm(url(daemon, query="language=auto"), pcm, pause_s=0.01)

    auto = run(scenario())
    (started,) = auto.of("speech_started")
    # Positions in the stream's audio, not times: how much of the utterance the first
    # partial covers, against the audio a detection would have waited for.
    first_partial_audio_ms = auto.of("partial")[0]["end_ms"] - started["start_ms"]
    detection_audio_ms = StreamConfig().language_detect_s * 1000  # 3000
    assert first_partial_audio_ms < detection_audio_ms, "held back for a language detection"
    assert {m["language"] for m in auto.of("partial") + auto.of("final")} == {"en"}
    assert None not in engine.languages


def test_a_session_update_to_auto_on_an_english_only_model_is_english() -> None:
    """A vendor's session update (`stream_setting`) is decoded as the query string is."""
    english_only = EngineInfo("fake", "tiny.en", False, 8)
    assert english_only.stream_setting(parse_language("auto")) == LanguageSetting("en")
    assert english_only.stream_setting(parse_language("en-US")) == parse_language("en-US")
    multilingual = EngineInfo("fake", "base", True, 8)
    for setting in (parse_language("auto"), parse_language("de,fr"), parse_language("zh-TW")):
        assert multilingual.stream_setting(setting) == setting


# -- fuzzing beside an honest stream ------------------------------------------------------------


def _fuzz_frame(rng: random.Random) -> bytes | str:
    """Mostly what a client may send (so connections live a while), sometimes not."""
    kind = rng.random()
    if kind < 0.75:  # plausible audio
        return rng.randbytes(2 * rng.randint(1, 4000))
    if kind < 0.83:
        return json.dumps({"type": rng.choice(["keepalive", "finalize", "end", "dance", 3])})
    if kind < 0.87:  # odd byte counts
        return rng.randbytes(2 * rng.randint(0, 400) + 1)
    if kind < 0.92:  # JSON-ish garbage
        alphabet = '{}[]":,0123456789.e-truefalsnl type'
        return "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 200)))
    if kind < 0.98:
        return rng.randbytes(rng.randint(0, 300)).decode("latin-1")
    return rng.randbytes(rng.randint(256_001, 300_000))  # over the frame limit


def test_fuzzed_frames_never_change_an_honest_stream() -> None:
    frames_total = 10_000
    rng = random.Random(20261123)
    pcm = tone_bursts([1.5, 0.7, 2.2, 1.1])

    async def fuzz_connection(target: str, budget: int, closes: Counter[int]) -> int:
        sent = 0
        query = rng.choice(["", "encoding=f32le", "sample_rate=48000", "sample_rate=9"])
        async with connect(target + ("?" + query if query else ""), max_size=None) as conn:
            reader = asyncio.create_task(collect(conn))
            while sent < budget and not reader.done():
                try:
                    await conn.send(_fuzz_frame(rng))
                except ConnectionClosed:
                    break
                sent += 1
            if not reader.done():
                await conn.close()
            ex = await asyncio.wait_for(reader, 60)
        closes[ex.close_code or 0] += 1
        if ex.of("ready"):
            check_invariants(ex)
        else:  # refused at once: one error, nothing else
            assert [m["type"] for m in ex.messages] == ["error"]
        return sent

    async def scenario() -> tuple[Exchange, Exchange, Counter[int], int]:
        config = make_config(server={"max_sessions_per_ip": 1_000, "max_sessions": 1_000})
        async with running_daemon(config) as daemon:
            alone = await stream_pcm(url(daemon), pcm, pause_s=0.01)
            closes: Counter[int] = Counter()
            honest = asyncio.create_task(stream_pcm(url(daemon), pcm, pause_s=0.01))
            sent = 0
            while sent < frames_total:
                batch = [fuzz_connection(url(daemon), 200, closes) for _ in range(8)]
                sent += sum(await asyncio.gather(*batch))
            return alone, await honest, closes, sent

    alone, honest, closes, sent = run(scenario())
    print(f"fuzzed frames: {sent}; close codes: {dict(sorted(closes.items()))}")
    assert sent >= frames_total
    assert set(closes) <= {1000, 1002, 1007, 1008, 1009}, closes
    check_invariants(honest)
    assert honest.of("final") == alone.of("final") and honest.close_code == 1000


# -- logs ---------------------------------------------------------------------------------------


def test_info_logs_one_line_per_session(caplog: pytest.LogCaptureFixture) -> None:
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    configure_logging("info")  # as `captiond serve` does
    root.addHandler(caplog.handler)

    async def scenario() -> None:
        async with running_daemon() as daemon:
            for _ in range(3):
                await stream_pcm(url(daemon), tone_bursts([0.5]))

    try:
        run(scenario())
    finally:
        root.handlers[:], root.level = saved
    sessions = [r for r in caplog.records if r.getMessage().startswith("session ")]
    assert len(sessions) == 3
    assert not [r for r in caplog.records if r.name.startswith("websockets")]


# -- the journal survives kill -9 ---------------------------------------------------------------


def test_every_final_a_client_received_is_in_the_journal_after_kill_9(
    tmp_path: Path, speech_dir: Path, speech_manifest: list[dict[str, Any]]
) -> None:
    """A real `captiond serve` process (fake engine, real VAD on real speech) killed with
    SIGKILL mid-stream: every final the client had received is in the journal."""
    journal_dir = tmp_path / "journal"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = tmp_path / "captiond.toml"
    config.write_text(f'[server]\nport = {port}\n[journal]\ndir = "{journal_dir}"\n')
    proc = subprocess.Popen(
        [sys.executable, "-m", "captiond.cli", "serve", "--config", str(config), "--engine=fake"],
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stderr is not None
    lines = [proc.stderr.readline()]
    while "ready: ws://" not in lines[-1] and lines[-1]:
        lines.append(proc.stderr.readline())
    assert "ready: ws://" in lines[-1], "".join(lines)
    long = next(m for m in speech_manifest if m["kind"] == "long")
    pcm = read_wav_int16(speech_dir / long["file"])

    async def stream_until_killed() -> list[dict[str, Any]]:
        finals: list[dict[str, Any]] = []
        async with connect(f"ws://127.0.0.1:{port}/v1/stream") as conn:

            async def read() -> None:
                with contextlib.suppress(ConnectionClosed):
                    async for raw in conn:
                        message = json.loads(raw)
                        if message["type"] == "final":
                            finals.append(message)
                            if len(finals) == 5:
                                proc.kill()

            reader = asyncio.create_task(read())
            with contextlib.suppress(ConnectionClosed):
                for start in range(0, len(pcm), 3200):  # 5x real time
                    await conn.send(pcm[start : start + 3200].tobytes())
                    await asyncio.sleep(0.04)
                    if reader.done():
                        break
            await asyncio.wait_for(reader, 30)
        return finals

    try:
        received = run(stream_until_killed())
    finally:
        proc.kill()
        proc.wait()
    assert len(received) >= 5, "the daemon was killed mid-stream"
    (session,) = list_sessions(journal_dir)
    assert not session.ended, "no end record: the daemon died"
    journaled = {(f.segment, f.start_ms, f.end_ms, f.text) for f in session.finals}
    for final in received:
        assert (final["segment"], final["start_ms"], final["end_ms"], final["text"]) in journaled


def test_a_hung_client_holds_shutdown_no_longer_than_the_drain_timeout() -> None:
    """A client that completes the handshake, sends audio, then never reads again (so never
    answers the close): shutdown ends after `drain_timeout_s`, not after the 10 s it used to."""

    async def scenario() -> float:
        config = make_config(server={"drain_timeout_s": 0.5})
        async with running_daemon(config, engine=FakeEngine(delay_s=0.1)) as daemon:
            reader, writer = await asyncio.open_connection("127.0.0.1", daemon.port)
            writer.write(
                b"GET /v1/stream HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\n"
                b"Connection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
                b"Sec-WebSocket-Version: 13\r\n\r\n"
            )
            assert b"101" in await reader.readline()
            audio = tone_bursts([1.0], gap_s=0.0)[:16000].tobytes()
            writer.write(b"\x82\xff" + len(audio).to_bytes(8, "big") + _MASK + audio)
            await writer.drain()
            await asyncio.sleep(0.3)
            started = asyncio.get_running_loop().time()
            await daemon.shutdown()
            elapsed_s = asyncio.get_running_loop().time() - started
            writer.close()
            return elapsed_s

    elapsed_s = run(scenario())
    assert elapsed_s < 3.0, f"shutdown took {elapsed_s:.1f} s"


# -- metrics ------------------------------------------------------------------------------------


def test_metrics_are_scraped_by_the_prometheus_parser() -> None:
    from prometheus_client.parser import text_string_to_metric_families

    async def scenario() -> tuple[Exchange, str, int]:
        async with running_daemon(make_config(auth={"token": TOKEN})) as daemon:
            ex = await stream_pcm(url(daemon, query=f"token={TOKEN}"), tone_bursts([1.0, 2.0]))
            assert await refused_status(url(daemon)) == 401
            base = f"http://127.0.0.1:{daemon.port}/metrics"
            text = await asyncio.to_thread(_get, base, {"Authorization": f"Bearer {TOKEN}"})
            try:
                await asyncio.to_thread(_get, base, {})
                status = 200
            except urllib.error.HTTPError as exc:
                status = exc.code
            return ex, text, status

    ex, text, unauthenticated = run(scenario())
    assert unauthenticated == 401, "/metrics needs the token like the streams"
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    assert samples[("captiond_sessions_total", ())] == 1
    assert samples[("captiond_sessions_open", ())] == 0
    audio_s = len(tone_bursts([1.0, 2.0])) / 16_000
    assert samples[("captiond_audio_seconds_total", ())] == pytest.approx(audio_s)
    assert samples[("captiond_refused_total", (("reason", "Unauthorized"),))] == 1
    assert samples[("captiond_closes_total", (("code", "1000"),))] == 1
    finals = len(ex.of("final"))
    assert samples[("captiond_decode_requests_total", (("kind", "final"),))] == finals
    assert samples[("captiond_final_latency_seconds_count", ())] == finals
    assert samples[("captiond_partial_lag_seconds_count", ())] == len(ex.of("partial"))
    assert samples[("captiond_batch_size_count", ())] >= 1
    assert samples[("captiond_engine_seconds_count", ())] >= 1
    # The engine's phases (the fake engine's time is all "decode").
    assert samples[("captiond_engine_phase_seconds_total", (("phase", "decode"),))] > 0


@pytest.mark.parametrize(
    ("host", "config", "status"),
    [
        ("evil.example", {}, b"403"),  # DNS rebinding: a page's GET of its own origin
        ("evil.example", {"server": {"allowed_origins": ("http://evil.example",)}}, b"200"),
        ("evil.example", {"server": {"allowed_origins": ("*",)}}, b"200"),
        ("evil.example", {"auth": {"token": TOKEN}}, b"200"),  # the token guards it
        ("localhost:PORT", {}, b"200"),
        ("127.0.0.1:PORT", {}, b"200"),
        ("[::1]:PORT", {}, b"200"),
        ("MACHINE.local", {}, b"200"),
        ("", {}, b"200"),  # no Host header: no browser
    ],
)
def test_metrics_without_a_token_answer_only_this_machines_names(
    host: str, config: dict[str, Any], status: bytes
) -> None:
    """A site whose DNS name is rebound to 127.0.0.1 makes its page's GET /metrics a same-origin
    request: no Origin header, only its own name as Host."""
    machine = socket.gethostname().split(".")[0].lower()

    async def scenario() -> bytes:
        async with running_daemon(make_config(**config)) as daemon:
            given = host.replace("PORT", str(daemon.port)).replace("MACHINE", machine)
            headers = f"Host: {given}\r\n" if given else ""
            if "auth" in config:
                headers += f"Authorization: Bearer {TOKEN}\r\n"
            request = f"GET /metrics HTTP/1.1\r\n{headers}\r\n"
            return await _raw_request(daemon.port, request.encode())

    answer = run(scenario())
    assert answer.startswith(b"HTTP/1.1 " + status), answer[:200]
    if status == b"403":
        assert b"does not name this machine" in answer


def _get(target: str, headers: dict[str, str]) -> str:
    """The body of a GET of Prometheus' exposition text, checking its one Content-Type."""
    from prometheus_client import CONTENT_TYPE_LATEST

    request = urllib.request.Request(target, headers=headers)
    with urllib.request.urlopen(request, timeout=10) as response:
        assert response.headers.get_all("Content-Type") == [CONTENT_TYPE_LATEST]
        body: bytes = response.read()
        return body.decode()
