"""Turns ended by the end-of-turn model through a real daemon (`?end_of_turn=model`): the fake
engine's words and SureTurns' verdicts (every turn over), so that the plumbing from the query to
the engine thread and back is seen end to end, quickly; then the real Smart Turn on real speech
(JFK's sentence) through the daemon. The model on the corpus's turns:
tests/engines/test_turn.py."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest
from daemon_harness import (
    RATE,
    make_config,
    refused,
    running_daemon,
    stream_pcm,
    tone_bursts,
    url,
)
from testkit import missing_tool

from captiond.config import override
from captiond.engines.models import turn_model_path
from captiond.engines.turn import SmartTurn


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
            error, close_code = await refused(url(daemon, query=query))
            assert error["code"] == "bad_message" and key in error["message"]
            assert close_code == 1008
            ok = await stream_pcm(url(daemon), tone_bursts([1.0]))  # the daemon goes on
            assert ok.of("done")

    run(scenario())


def test_a_daemon_without_the_turn_model_says_what_to_install() -> None:
    async def scenario() -> None:
        async with running_daemon(turn_model=None) as daemon:
            error, _ = await refused(url(daemon, query="end_of_turn=model"))
        assert error["code"] == "bad_message" and "pipecat-ai" in error["message"]

    run(scenario())


# JFK's sentence (conftest's `jfk`) pauses after "Americans," (4.50 s) and after "for you,"
# (7.65 s), about 0.55 s each, and ends at 10.98 s: Smart Turn gives those pauses 0.01 and
# 0.02 at 180 ms in, and the end 0.91 (as the daemon asks: the utterance after the second
# pause, which `long_utterance_s` ends, 8 s into the first).
JFK_END_S = 10.98
FIRST_PAUSE_S = 4.75
SECOND_PAUSE_S = 7.9


def real_model_finals(samples: np.ndarray, end_of_turn: str) -> tuple[list[Any], list[Any]]:
    """The finals and speech_stopped of `samples` streamed at twice real time to a daemon
    with webrtcvad, the fake engine's words (which end no sentence) and the real Smart Turn."""
    if turn_model_path() is None:
        missing_tool("Smart Turn v3.2 not installed (pip install --no-deps pipecat-ai==1.14.0)")
    pcm = (np.concatenate([samples, np.zeros(2 * RATE, np.float32)]) * 32767).astype("<i2")
    config = override(make_config(), "vad", end_of_turn=end_of_turn)

    async def scenario() -> tuple[list[Any], list[Any]]:
        async with running_daemon(config, vad_factory=None, turn_model=SmartTurn) as daemon:
            ex = await stream_pcm(url(daemon), pcm, pause_s=0.05)
        return ex.of("final"), ex.of("speech_stopped")

    result: tuple[list[Any], list[Any]] = run(scenario())
    return result


def test_the_real_model_ends_a_finished_sentence_sooner_than_silence(jfk: np.ndarray) -> None:
    """On the stream clock: the sentence's last `speech_stopped` (its final's end) comes
    180 ms after the speech with the model, at an endpoint of 500 ms or more with silence."""
    waits_ms = {}
    for mode in ("model", "silence"):
        finals, stops = real_model_finals(jfk, mode)
        assert len(finals) == len(stops) == 2, mode  # cut at 8 s, at the second pause
        waits_ms[mode] = stops[-1]["end_ms"] - JFK_END_S * 1000
    assert 150 <= waits_ms["model"] <= 300
    assert waits_ms["silence"] >= 450


def test_the_real_model_keeps_a_mid_thought_pause_inside_one_final(jfk: np.ndarray) -> None:
    """JFK's "And so my fellow Americans, [1.25 s] ask not what your country can do for you": past
    silence's 800-ms endpoint for words that end no sentence (two finals), within the 1.5 s
    the model gives a turn it calls unfinished (one)."""
    cut = int(FIRST_PAUSE_S * RATE)
    paused = np.concatenate(
        [jfk[:cut], np.zeros(RATE, np.float32), jfk[cut : int(SECOND_PAUSE_S * RATE)]]
    )
    assert len(real_model_finals(paused, "silence")[0]) == 2
    assert len(real_model_finals(paused, "model")[0]) == 1
