"""Turns ended by the end-of-turn model ([vad] end_of_turn = "model"): when it is asked, what its
verdict does to the endpoint, and what a stream's own turn settings change."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from session_harness import RATE, Decoder, Driver, fake_decoder, silence, tone

from captiond.config import StreamConfig, VadConfig
from captiond.engines.base import TURN_WINDOW_SAMPLES, DecodeKind, EngineRequest, EngineResult
from captiond.errors import BadMessageError
from captiond.streaming.events import Final, Partial, SpeechStopped, StreamParams, TurnParams

MODEL = VadConfig(end_of_turn="model")
# A 1.5-s tone from 0.5 s: its last voiced frame ends at 2.01 s, the model's pause of 180 ms
# (six frames) at 2.19 s.
PAUSE_MS = 2190


def judging(probability: float | None, *, sentence: bool = False) -> Decoder:
    """The fake engine's decodes (words that end no sentence; with `sentence`, one that
    does), and the end-of-turn model's verdict `probability` on every turn request (as the
    scheduler answers them)."""
    decode = fake_decoder()

    def answer(request: EngineRequest) -> EngineResult:
        if request.kind is DecodeKind.TURN:
            return EngineResult(text="", turn_probability=probability)
        result = decode(request)
        if sentence:
            result = dataclasses.replace(result, text=result.text + ".", words=())
        return result

    return answer


def speak(driver: Driver, *, then_silence_s: float) -> None:
    driver.send(silence(0.5))
    driver.send(tone(1.5))
    driver.send(silence(then_silence_s))


def turns_asked(driver: Driver) -> list[EngineRequest]:
    return [r.engine_request for r in driver.requests if r.kind is DecodeKind.TURN]


def test_the_model_is_asked_at_the_first_short_pause_before_the_early_final() -> None:
    driver = Driver(judging(0.2), vad=MODEL)
    speak(driver, then_silence_s=0.3)
    (asked,) = turns_asked(driver)
    assert asked.end_sample == PAUSE_MS * RATE // 1000
    # It judges the utterance's audio, from its pre-roll, up to the pause.
    assert 0 < len(asked.audio) <= TURN_WINDOW_SAMPLES
    assert np.abs(asked.audio[: RATE // 10]).max() == 0  # the quiet before the tone
    assert np.abs(asked.audio[RATE // 2 : RATE]).max() > 0
    # Not over: the pause's early final is decoded next, up to the same pause.
    turn_at = next(i for i, r in enumerate(driver.requests) if r.kind is DecodeKind.TURN)
    early = driver.requests[turn_at + 1]
    assert early.kind is DecodeKind.FINAL and early.end_sample == asked.end_sample


def test_a_complete_turn_ends_at_the_pause_not_at_the_silence_endpoint() -> None:
    driver = Driver(judging(0.9), vad=MODEL)
    speak(driver, then_silence_s=0.3)
    (stop,) = driver.of(SpeechStopped)
    (final,) = driver.of(Final)
    assert stop.end_ms == final.end_ms == PAUSE_MS  # 300 ms sooner than the 500-ms endpoint
    assert final.end_of_turn == 0.9
    finals = [r for r in driver.requests if r.kind is DecodeKind.FINAL]
    assert len(finals) == 1  # the early final is the final: no second decode


def test_an_incomplete_turn_waits_for_max_turn_silence() -> None:
    driver = Driver(judging(0.2), vad=MODEL)
    speak(driver, then_silence_s=1.2)
    assert not driver.of(Final)  # past the silence mode's 500 and 800 ms: still open
    driver.send(silence(0.5))
    (stop,) = driver.of(SpeechStopped)
    assert len(driver.of(Final)) == 1
    assert stop.end_ms == 2010 + 1500
    assert len([r for r in driver.requests if r.kind is DecodeKind.FINAL]) == 1


def test_a_speaker_who_goes_on_after_an_incomplete_verdict_stays_in_one_utterance() -> None:
    driver = Driver(judging(0.2), vad=MODEL)
    speak(driver, then_silence_s=1.0)
    driver.send(tone(1.0))
    driver.send(silence(0.3))
    assert not driver.of(Final)
    assert len(turns_asked(driver)) == 2  # once per pause
    driver.send(silence(1.5))
    (final,) = driver.of(Final)
    assert final.start_ms < 500 and final.end_ms > 3500


def test_partials_and_the_final_say_the_models_latest_verdict() -> None:
    """`end_of_turn`: the probability of the model's latest check of the segment, on the
    partials after it and on the final; absent before the first check and without the model."""
    driver = Driver(judging(0.2), vad=MODEL)
    speak(driver, then_silence_s=1.0)
    driver.send(tone(1.0))  # goes on after the unfinished verdict
    driver.send(silence(1.6))
    partials = driver.of(Partial)
    first_asked_ms = PAUSE_MS
    before = [p for p in partials if p.end_ms <= first_asked_ms]
    after = [p for p in partials if p.end_ms > first_asked_ms + 300]
    assert before and all(p.end_of_turn is None for p in before)
    assert "end_of_turn" not in before[0].to_dict()
    assert after and all(p.end_of_turn == 0.2 for p in after)
    (final,) = driver.of(Final)
    assert final.end_of_turn == 0.2 and final.to_dict()["end_of_turn"] == 0.2
    silent = Driver(judging(0.9))
    speak(silent, then_silence_s=1.0)
    assert all("end_of_turn" not in m.to_dict() for m in (*silent.of(Partial), *silent.of(Final)))


def test_the_threshold_decides() -> None:
    vad = dataclasses.replace(MODEL, end_of_turn_threshold=0.95)
    driver = Driver(judging(0.9), vad=vad)
    speak(driver, then_silence_s=0.6)
    assert not driver.of(Final)


@pytest.mark.parametrize("sentence_ends_turn", [True, False])
def test_words_that_end_a_sentence_end_the_turn_too_unless_turned_off(
    sentence_ends_turn: bool,
) -> None:
    vad = dataclasses.replace(MODEL, sentence_ends_turn=sentence_ends_turn)
    driver = Driver(judging(0.1, sentence=True), vad=vad)
    speak(driver, then_silence_s=1.0)
    assert len(driver.of(Final)) == (1 if sentence_ends_turn else 0)
    if sentence_ends_turn:
        (stop,) = driver.of(SpeechStopped)
        assert stop.end_ms == PAUSE_MS


def test_no_verdict_is_not_a_complete_turn() -> None:
    """A model that failed (the scheduler logs it) leaves the result without a verdict: the
    turn waits for `max_turn_silence_ms`, as an incomplete one does."""
    driver = Driver(judging(None), vad=MODEL)
    speak(driver, then_silence_s=1.0)
    assert not driver.of(Final)
    driver.send(silence(0.6))
    assert len(driver.of(Final)) == 1


def test_silence_mode_never_asks_the_model() -> None:
    driver = Driver(judging(0.9))
    speak(driver, then_silence_s=1.0)
    assert not turns_asked(driver)
    (final,) = driver.of(Final)
    assert final.end_ms == 2010 + 480  # the 500-ms endpoint, in whole 30-ms frames


def test_without_early_finals_turns_end_at_silence() -> None:
    """`captiond transcribe` decodes no early final, so there is nothing to ask the model
    with: its turns end at the silence endpoints."""
    driver = Driver(judging(0.9), vad=MODEL, early_finals=False)
    speak(driver, then_silence_s=1.0)
    assert not turns_asked(driver)
    (stop,) = driver.of(SpeechStopped)
    assert stop.end_ms == 2010 + 480


def test_a_stream_turns_the_model_on_for_itself_and_a_session_update_off() -> None:
    params = StreamParams(turn=TurnParams(end_of_turn="model", max_turn_silence_ms=900))
    driver = Driver(judging(0.1), params=params)
    speak(driver, then_silence_s=1.0)
    (stop,) = driver.of(SpeechStopped)
    assert stop.end_ms == 2010 + 900
    driver.session.set_turn(TurnParams(end_of_turn="silence", endpoint_silence_ms=300))
    driver.send(tone(1.0))
    driver.send(silence(1.0))
    assert len(turns_asked(driver)) == 1  # the second pause was not judged
    assert len(driver.of(Final)) == 2


def test_turn_params_are_checked_and_applied() -> None:
    with pytest.raises(BadMessageError, match="end_of_turn must be one of silence, model"):
        TurnParams(end_of_turn="semantic")
    with pytest.raises(BadMessageError, match="end_of_turn_threshold must be from 0 to 1"):
        TurnParams(end_of_turn_threshold=2.0)
    with pytest.raises(BadMessageError, match="max_turn_silence_ms must be from 30 to 10000"):
        TurnParams(max_turn_silence_ms=60_000)
    vad = TurnParams(end_of_turn="model", max_turn_silence_ms=100).applied_to(VadConfig())
    assert (vad.end_of_turn, vad.max_turn_silence_ms, vad.end_of_turn_pause_ms) == (
        "model",
        100,
        100,  # asked no later than the longest wait
    )
    assert TurnParams().applied_to(MODEL) == MODEL
    assert TurnParams(end_of_turn_threshold=0.7).journal() == {"end_of_turn_threshold": 0.7}


@pytest.mark.parametrize("across", [True, False])
def test_a_turn_the_model_ended_is_the_next_decodes_prompt_unless_context_goes_across(
    across: bool,
) -> None:
    stream = dataclasses.replace(StreamConfig(), context_across_turns=across)
    driver = Driver(judging(0.9), vad=MODEL, stream=stream)
    speak(driver, then_silence_s=0.5)
    driver.send(tone(1.0))
    driver.send(silence(0.5))
    first, _ = driver.of(Final)
    finals = [r.engine_request for r in driver.requests if r.kind is DecodeKind.FINAL]
    assert finals[-1].prefix == (first.text if across else "")
    assert finals[-1].prompt == ("" if across else first.text)
    # Its audio starts at the first turn's (its context), or in the quiet after it.
    starts_ms = finals[-1].end_sample // (RATE // 1000) - len(finals[-1].audio) // (RATE // 1000)
    assert (starts_ms < first.end_ms) is across
