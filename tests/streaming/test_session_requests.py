"""The session's decode requests and the audio buffer it keeps."""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
from session_harness import NO_CONTEXT, Driver, LevelVad, silence, tone, two_utterances

from captiond.config import Config, StreamConfig
from captiond.engines.base import DecodeKind
from captiond.streaming.events import (
    Control,
    Done,
    Final,
    SpeechStarted,
    SpeechStopped,
    StreamParams,
)
from captiond.streaming.session import StreamSession
from captiond.streaming.utterance import DecodeRequest


def test_requests_cover_their_utterance_from_its_start() -> None:
    driver = Driver(stream=NO_CONTEXT)
    two_utterances(driver)
    driver.control(Control.END)
    for r in driver.requests:
        assert len(r.engine_request.audio) == r.end_sample - r.start_sample
        assert r.engine_request.audio.dtype == np.float32
    by_utterance: dict[int, list[DecodeRequest]] = {}
    for r in driver.requests:
        by_utterance.setdefault(r.utterance, []).append(r)
    for reqs in by_utterance.values():
        assert len({r.start_sample for r in reqs}) == 1
        ends = [r.end_sample for r in reqs]
        assert ends == sorted(ends)
        assert reqs[-1].kind is DecodeKind.FINAL
        assert [r.kind for r in reqs].count(DecodeKind.FINAL) == 1
    # Every request is its own object: results are matched to requests by identity.
    assert len({id(r) for r in driver.requests}) == len(driver.requests)


def test_long_speech_is_cut_into_capped_segments() -> None:
    stream = StreamConfig(max_utterance_s=3.0, cut_search_s=1.0)
    driver = Driver(stream=stream)
    driver.send(np.concatenate([silence(0.5), tone(8.0), silence(1.0)]))
    driver.control(Control.END)
    finals = driver.of(Final)
    assert len(finals) >= 3
    assert [f.segment for f in finals] == list(range(len(finals)))
    for f in finals:
        assert f.end_ms - f.start_ms <= 3000
    for a, b in itertools.pairwise(finals):
        assert b.start_ms >= a.end_ms - 1
    # A cut is no pause: the speech started once and stopped once, at its real end.
    assert [m.start_ms for m in driver.of(SpeechStarted)] == [finals[0].start_ms]
    assert [m.end_ms for m in driver.of(SpeechStopped)] == [finals[-1].end_ms]


def test_receive_samples_takes_16k_floats() -> None:
    driver = Driver()
    driver.session.receive_samples(np.concatenate([silence(0.5), tone(1.5), silence(1.0)]))
    driver.pump()
    driver.control(Control.END)
    assert len(driver.of(Final)) == 1
    assert driver.messages[-1] == Done(audio_ms=3000, segments=1)


def test_config_is_not_mutated() -> None:
    config = Config()
    StreamSession(config=config, vad=LevelVad(), params=StreamParams(), count_tokens=len)
    assert dataclasses.asdict(config) == dataclasses.asdict(Config())
