"""Turns ended by the end-of-turn model through a real daemon (`?end_of_turn=model`): the fake
engine's words and SureTurns' verdicts (every turn over), so that the plumbing from the query to
the engine thread and back is seen end to end, quickly. The real model on real speech is
tests/engines/test_turn.py."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from daemon_harness import collect, make_config, running_daemon, stream_pcm, tone_bursts, url
from websockets.asyncio.client import connect

from captiond.config import override


def run(coro: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coro, 60))


def speech_stops(query: str = "", **vad: Any) -> list[tuple[int, int]]:
    """(end of the burst, `speech_stopped.end_ms`) of two 1-s bursts 1.2 s apart."""
    pcm = tone_bursts([1.0, 1.0], gap_s=1.2)
    config = override(make_config(), "vad", **vad) if vad else make_config()

    async def scenario() -> list[tuple[int, int]]:
        async with running_daemon(config) as daemon:
            # At twice real time: the verdict, which comes with a decode, must find the pause
            # still going (audio sent all at once would have the speaker go on before it).
            ex = await stream_pcm(url(daemon, query=query), pcm, pause_s=0.05)
        stops = [m["end_ms"] for m in ex.of("speech_stopped")]
        assert len(ex.of("final")) == 2
        return list(zip([1500, 3700], stops, strict=True))

    result: list[tuple[int, int]] = run(scenario())
    return result


def test_a_stream_that_asks_for_the_model_has_its_turns_end_at_the_first_short_pause() -> None:
    for burst_end_ms, stopped_ms in speech_stops("end_of_turn=model"):
        assert stopped_ms - burst_end_ms <= 240  # the model's 180-ms pause, in whole frames
    for burst_end_ms, stopped_ms in speech_stops():
        assert stopped_ms - burst_end_ms >= 480  # the daemon's default: silence


def test_the_daemon_setting_ends_every_streams_turns_by_the_model() -> None:
    for burst_end_ms, stopped_ms in speech_stops(end_of_turn="model"):
        assert stopped_ms - burst_end_ms <= 240
    # A stream may still ask for silence (Deepgram's endpointing does).
    for burst_end_ms, stopped_ms in speech_stops("end_of_turn=silence", end_of_turn="model"):
        assert stopped_ms - burst_end_ms >= 480


@pytest.mark.parametrize(
    ("query", "key"),
    [
        ("end_of_turn=smart", "end_of_turn"),
        ("end_of_turn_threshold=high", "end_of_turn_threshold"),
        ("end_of_turn_threshold=1.5", "end_of_turn_threshold"),
        ("max_turn_silence_ms=20", "max_turn_silence_ms"),
    ],
)
def test_a_bad_turn_setting_is_a_bad_message_naming_its_key(query: str, key: str) -> None:
    async def scenario() -> None:
        async with running_daemon() as daemon:
            async with connect(url(daemon, query=query)) as conn:
                ex = await asyncio.wait_for(collect(conn), 10)
            (error,) = ex.of("error")
            assert error["code"] == "bad_message" and key in error["message"]
            assert ex.close_code == 1008
            ok = await stream_pcm(url(daemon), tone_bursts([1.0]))  # the daemon goes on
            assert ok.of("done")

    run(scenario())


def test_a_daemon_without_the_turn_model_says_what_to_install() -> None:
    async def scenario() -> None:
        async with (
            running_daemon(turn_model=None) as daemon,
            connect(url(daemon, query="end_of_turn=model")) as conn,
        ):
            ex = await asyncio.wait_for(collect(conn), 10)
        (error,) = ex.of("error")
        assert error["code"] == "bad_message" and "pipecat-ai" in error["message"]

    run(scenario())
