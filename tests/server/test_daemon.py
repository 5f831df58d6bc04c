"""A real daemon on a free port with the fake engine: message order, invariants, bad input."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import urllib.error
import urllib.request
from collections.abc import Sequence

import numpy as np
import pytest
from daemon_harness import (
    Exchange,
    check_invariants,
    collect,
    make_config,
    running_daemon,
    stream_pcm,
    tone_bursts,
    url,
)
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from captiond.engines.base import EngineRequest, EngineResult
from captiond.engines.fake import FakeEngine


def run(coro: object) -> None:
    asyncio.run(coro)  # type: ignore[arg-type]


def test_stream_messages_follow_the_protocol() -> None:
    async def scenario() -> None:
        async with running_daemon() as daemon:
            # 10x real time, so that partials are due while utterances are open.
            ex = await stream_pcm(url(daemon), tone_bursts([2.0, 1.5, 3.0]), pause_s=0.01)
            check_invariants(ex)
            assert ex.close_code == 1000
            ready = ex.messages[0]
            assert ready["protocol"] == "captiond.v1" and ready["sample_rate"] == 16000
            assert ready["engine"] == "fake"
            finals = ex.of("final")
            assert len(finals) == 3
            # The fake engine gives one word per loud 250 ms window of its audio: 8, 6 and 12
            # windows of tone. The first final's audio starts at the stream's start (the quiet
            # before the burst), on the bursts' grid; the later ones continue from the first
            # utterance's pre-roll, off that grid, where each burst spans one window more (9, 7
            # and 13). The first final's 8 words stand for the first 8 of those 9 (the forced
            # prefix), so the ninth comes out as a word of the second final.
            assert [len(f["text"].split()) for f in finals] == [8, 8, 13]
            assert len(ex.of("speech_started")) == 3 == len(ex.of("speech_stopped"))
            assert ex.of("partial"), "no partials for 6.5 s of speech"
            assert ex.of("done")[0]["audio_ms"] == pytest.approx(
                len(tone_bursts([2.0, 1.5, 3.0])) / 16, abs=1
            )

    run(scenario())


def test_f32le_and_resampled_streams() -> None:
    pcm = tone_bursts([2.0])

    async def scenario() -> None:
        async with running_daemon() as daemon:
            f32 = (pcm.astype(np.float32) / 32768).astype("<f4")
            ex = await stream_pcm(url(daemon, query="encoding=f32le"), f32)
            check_invariants(ex)
            # 8 windows of tone: the final's audio starts at the stream's start, on their grid.
            assert [len(f["text"].split()) for f in ex.of("final")] == [8]
            up = np.repeat(pcm, 3)  # 48 kHz, crude but loud enough
            ex48 = await stream_pcm(url(daemon, query="sample_rate=48000"), up, chunk_samples=4800)
            check_invariants(ex48)
            assert ex48.of("done")[0]["audio_ms"] == pytest.approx(len(pcm) / 16, abs=20)
            assert len(ex48.of("final")) == 1

    run(scenario())


def test_finalize_forces_an_endpoint() -> None:
    async def scenario() -> None:
        async with running_daemon() as daemon, connect(url(daemon)) as conn:
            reader = asyncio.create_task(collect(conn))
            t = np.arange(16000) / 16000
            loud = (0.3 * np.sin(2 * np.pi * 220 * t) * 32767).astype("<i2")
            await conn.send(loud.tobytes())
            await conn.send(json.dumps({"type": "finalize"}))
            await conn.send(loud.tobytes())
            await conn.send(json.dumps({"type": "keepalive"}))
            await conn.send(json.dumps({"type": "end"}))
            ex = await asyncio.wait_for(reader, 30)
            check_invariants(ex)
            assert len(ex.of("final")) == 2

    run(scenario())


@pytest.mark.parametrize(
    ("query", "frames", "code", "close"),
    [
        ("", [b"\x00\x01\x02"], "bad_audio", 1007),
        ("encoding=f32le", [b"\x00" * 6], "bad_audio", 1007),
        ("encoding=f32le", [np.array([np.nan], "<f4").tobytes()], "bad_audio", 1007),
        ("", ["{not json"], "bad_message", 1008),
        ("", ['["type"]'], "bad_message", 1008),
        ("", ['{"type": "dance"}'], "bad_message", 1008),
        ("", [b"\x00" * 300_000], "too_large", 1009),
        ("encoding=mp3", [], "bad_audio", 1007),
        ("sample_rate=1000", [], "bad_audio", 1007),
        ("sample_rate=abc", [], "bad_audio", 1007),
        ("prompt=" + "x" * 1001, [], "bad_message", 1008),
    ],
)
def test_bad_input_gets_error_and_close_code(
    query: str, frames: Sequence[bytes | str], code: str, close: int
) -> None:
    async def scenario() -> None:
        async with running_daemon() as daemon:
            async with connect(url(daemon, query=query), max_size=None) as conn:
                reader = asyncio.create_task(collect(conn))
                for frame in frames:
                    await conn.send(frame)
                ex = await asyncio.wait_for(reader, 10)
            errors = ex.of("error")
            assert len(errors) == 1 and errors[0]["code"] == code, ex.messages
            assert errors[0]["message"]
            assert ex.close_code == close
            # The daemon keeps serving.
            ok = await stream_pcm(url(daemon), tone_bursts([1.0]))
            assert ok.close_code == 1000 and ok.of("done")

    run(scenario())


def test_audio_after_end_is_a_protocol_violation() -> None:
    async def scenario() -> None:
        async with running_daemon(engine=FakeEngine(delay_s=0.5)) as daemon:
            async with connect(url(daemon)) as conn:
                reader = asyncio.create_task(collect(conn))
                await conn.send(tone_bursts([1.0], gap_s=0.0).tobytes())
                await conn.send(json.dumps({"type": "end"}))
                await conn.send(b"\x00\x00" * 160)
                ex = await asyncio.wait_for(reader, 10)
            assert ex.of("error")[0]["code"] == "bad_message"
            assert ex.close_code == 1008

    run(scenario())


def test_done_and_an_error_never_both() -> None:
    """Audio right after `end` on a stream with nothing left to decode: either the daemon
    reads it before the stream is over (the error, no `done`, 1008) or after (`done`, 1000);
    never `done` followed by an error."""

    async def scenario() -> list[Exchange]:
        async with running_daemon() as daemon:
            exchanges = []
            for _ in range(10):
                async with connect(url(daemon)) as conn:
                    reader = asyncio.create_task(collect(conn))
                    await conn.send(json.dumps({"type": "end"}))
                    with contextlib.suppress(ConnectionClosed):
                        await conn.send(b"\x00\x00" * 160)
                    exchanges.append(await asyncio.wait_for(reader, 10))
            return exchanges

    for ex in asyncio.run(scenario()):
        if ex.of("done"):
            assert not ex.of("error") and ex.close_code == 1000, ex.messages
        else:
            assert ex.of("error")[0]["code"] == "bad_message" and ex.close_code == 1008


def test_one_bad_session_does_not_disturb_another() -> None:
    async def scenario() -> None:
        async with running_daemon() as daemon:
            good = asyncio.create_task(stream_pcm(url(daemon), tone_bursts([2.0, 2.0])))
            async with connect(url(daemon)) as bad:
                await bad.send(b"\x01")
                bad_ex = await collect(bad)
            good_ex = await good
            assert bad_ex.close_code == 1007
            check_invariants(good_ex)
            assert len(good_ex.of("final")) == 2 and good_ex.close_code == 1000

    run(scenario())


def test_session_limit_answers_1013() -> None:
    async def scenario() -> None:
        config = make_config(server={"max_sessions": 1})
        async with running_daemon(config) as daemon, connect(url(daemon)) as first:
            assert json.loads(await first.recv())["type"] == "ready"
            async with connect(url(daemon)) as second:
                ex = await collect(second)
            assert ex.of("error")[0]["code"] == "overloaded" and ex.close_code == 1013
            # The first session is unaffected.
            await first.send(tone_bursts([1.0]).tobytes())
            await first.send(json.dumps({"type": "end"}))
            rest = await collect(first)
            assert rest.of("done") and rest.close_code == 1000

    run(scenario())


@pytest.mark.parametrize("resume_s", [0.0, 0.5])
def test_client_disconnect_mid_utterance(resume_s: float) -> None:
    """A dropped stream's session ends at once without resume, after `resume_s` with it."""

    async def scenario() -> None:
        config = make_config(server={"resume_s": resume_s})
        async with running_daemon(config, engine=FakeEngine(delay_s=0.2)) as daemon:
            async with connect(url(daemon)) as conn:
                await conn.recv()
                await conn.send(tone_bursts([3.0], gap_s=0.0)[:32000].tobytes())
                await asyncio.sleep(0.3)
            for _ in range(100):
                if daemon.sessions_open == 0:
                    break
                await asyncio.sleep(0.05)
            assert daemon.sessions_open == 0
            ex = await stream_pcm(url(daemon), tone_bursts([1.0]))
            assert ex.close_code == 1000 and len(ex.of("final")) == 1

    run(scenario())


class FailingEngine(FakeEngine):
    """Raises on audio louder than 0.5 full scale, works otherwise."""

    def transcribe_batch(self, requests: Sequence[EngineRequest]) -> list[EngineResult]:
        if any(float(np.abs(r.audio).max(initial=0)) > 0.5 for r in requests):
            raise RuntimeError("simulated engine fault")
        return super().transcribe_batch(requests)


def test_engine_failure_closes_1011_and_daemon_recovers() -> None:
    async def scenario() -> None:
        async with running_daemon(engine=FailingEngine()) as daemon:
            very_loud = (tone_bursts([1.0]).astype(np.int32) * 3).clip(-32768, 32767)
            ex = await stream_pcm(url(daemon), very_loud.astype("<i2"))
            assert ex.of("error")[0]["code"] == "engine_failed" and ex.close_code == 1011
            ok = await stream_pcm(url(daemon), tone_bursts([1.0]))
            assert ok.close_code == 1000 and len(ok.of("final")) == 1

    run(scenario())


def test_shutdown_flushes_finals_then_closes_1001() -> None:
    async def scenario() -> None:
        async with running_daemon() as daemon:
            async with connect(url(daemon)) as conn:
                reader = asyncio.create_task(collect(conn))
                await conn.send(tone_bursts([2.0], gap_s=0.0)[: 16000 * 2].tobytes())
                await asyncio.sleep(0.3)  # let the daemon read the audio
                await daemon.shutdown()
                ex = await asyncio.wait_for(reader, 10)
            finals = ex.of("final")
            assert len(finals) == 1 and finals[0]["text"]
            # Not `done`: the session did not end, the daemon did (a client reconnects).
            assert [m["type"] for m in ex.messages[-1:]] == ["error"] and not ex.of("done")
            assert ex.of("error")[0]["code"] == "shutting_down"
            assert ex.close_code == 1001

    run(scenario())


def test_http_routes() -> None:
    async def scenario() -> None:
        async with running_daemon() as daemon:
            base = f"http://127.0.0.1:{daemon.port}"
            result: dict[str, object] = {}

            def fetch() -> None:
                with urllib.request.urlopen(base + "/healthz") as resp:
                    result["health"] = resp.status
                try:
                    urllib.request.urlopen(base + "/nope")
                except urllib.error.HTTPError as exc:
                    result["missing"] = exc.code

            thread = threading.Thread(target=fetch)
            thread.start()
            while thread.is_alive():
                await asyncio.sleep(0.02)
            assert result == {"health": 200, "missing": 404}
            async with connect(url(daemon, "/v1/captions", "source=room")) as conn:
                ex = await collect(conn)
            assert ex.of("error")[0]["code"] == "no_such_source" and ex.close_code == 1008

    run(scenario())
