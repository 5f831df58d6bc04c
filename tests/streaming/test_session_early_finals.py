"""Early finals: the decode that starts before the endpoint, and when it is kept or withdrawn."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from session_harness import RATE, Driver, fake_decoder, s16, silence, tone, two_utterances

from captiond.config import VadConfig
from captiond.engines.base import DecodeKind, EngineRequest, EngineResult
from captiond.streaming.events import Control, Done, Final, SpeechStopped
from captiond.streaming.session import SessionState, StreamSession
from captiond.streaming.utterance import DecodeRequest

# A 1.5-s tone from 0.5 s: its last voiced frame ends at 2.01 s, a final's tail of 360 ms at
# 2.37 s (set here: the default's would come in the same 100-ms chunk as the endpoint), the
# 500-ms endpoint at 2.49 s.
EARLY = VadConfig(final_tail_ms=360)
PAUSE_MS = 2370


def finals_asked(driver: Driver) -> list[DecodeRequest]:
    return [r for r in driver.requests if r.kind is DecodeKind.FINAL]


def ask_early_final(session: StreamSession) -> DecodeRequest:
    """Feed the tone and the tail without a pump, and take the early final the session asks."""
    for samples in (silence(0.5), tone(1.5), silence(0.4)):
        session.receive_audio(s16(samples))
    early = session.next_request()
    assert early is not None and early.kind is DecodeKind.FINAL
    session.take_messages()  # sent, as the pump sends them (speech_started)
    return early


def test_an_early_final_is_the_final_when_the_endpoint_follows() -> None:
    """The final's decode starts at the tail, before the endpoint, and is not repeated."""
    driver = Driver(vad=EARLY)
    driver.send(silence(0.5))
    driver.send(tone(1.5))
    driver.send(silence(1.0))
    (final_request,) = finals_asked(driver)
    asked_at_ms = driver.asked_at_ms[driver.requests.index(final_request)]
    (stop,) = driver.of(SpeechStopped)
    (final,) = driver.of(Final)
    assert final_request.end_sample == PAUSE_MS * RATE // 1000
    assert asked_at_ms < stop.end_ms == 2490
    assert final.end_ms == stop.end_ms  # the segment keeps its trailing silence
    assert final.text == driver.decoder(final_request.engine_request).text
    # No partial once 150 ms of the pause are in (2.16 s, seen at the next 100-ms chunk): the
    # early final comes soon, and a partial still decoding would hold it up.
    partial_ends = [r.end_sample for r in driver.requests if r.kind is DecodeKind.PARTIAL]
    assert max(partial_ends) <= 2_200 * RATE // 1000


def test_speech_after_an_early_final_drops_it() -> None:
    driver = Driver(vad=EARLY)
    driver.send(silence(0.5))
    driver.send(tone(1.5))
    driver.send(silence(0.4))  # the tail: an early final is asked for and answered
    assert len(finals_asked(driver)) == 1 and not driver.of(Final)
    driver.send(tone(1.0))  # the speaker goes on
    driver.send(silence(1.0))
    early, final_request = finals_asked(driver)
    assert early.utterance == final_request.utterance
    assert early.end_sample < final_request.end_sample
    (final,) = driver.of(Final)  # exactly one final per segment: the second decode's
    assert final.text == driver.decoder(final_request.engine_request).text
    assert final.text != driver.decoder(early.engine_request).text


def test_an_early_final_in_flight_is_superseded_when_speech_resumes() -> None:
    driver = Driver(vad=EARLY)
    session = driver.session
    early = ask_early_final(session)
    assert not session.superseded(early)
    session.receive_audio(s16(silence(0.03)))  # more silence: still the same pause
    assert not session.superseded(early) and not session.needs_pump
    session.receive_audio(s16(tone(0.2)))
    assert session.superseded(early) and session.needs_pump
    session.abandon(early)
    after = session.next_request()
    assert after is not None and after.kind is DecodeKind.PARTIAL


def test_the_endpoint_while_an_early_final_is_in_flight_waits_for_it() -> None:
    driver = Driver(vad=EARLY)
    session = driver.session
    early = ask_early_final(session)
    session.receive_audio(s16(silence(0.2)))  # past the endpoint (2.49 s), not the longer one
    assert not session.superseded(early)
    assert session.next_request() is None  # the early final is the final: no second decode
    assert not session.take_messages()  # held: whether the words end a sentence is not known
    session.on_result(early, driver.decoder(early.engine_request))
    messages = session.take_messages()
    finals = [m for m in messages if isinstance(m, Final)]
    assert finals[0].text.endswith(".")  # they do: the utterance ends where the endpoint fell
    assert len(finals) == 1 and finals[0].end_ms == 2490
    assert [m.end_ms for m in messages if isinstance(m, SpeechStopped)] == [2490]
    assert session.next_request() is None


def unfinished(request: EngineRequest) -> EngineResult:
    """The fake engine's words with no full stop: a sentence that goes on."""
    result = fake_decoder()(request)
    return dataclasses.replace(result, text=result.text.rstrip("."))


@pytest.mark.parametrize(("pause_s", "finals"), [(0.6, 1), (0.9, 2)])
def test_a_pause_after_words_that_end_no_sentence_waits_for_the_longer_endpoint(
    pause_s: float, finals: int
) -> None:
    """The early final at the pause writes no full stop: a pause shorter than
    `unfinished_endpoint_silence_ms` (800 ms) leaves the utterance open, and the speech after
    it is decoded with the words before it; a longer one ends it there."""
    driver = Driver(unfinished, vad=EARLY)
    for samples in (silence(0.5), tone(1.5), silence(pause_s), tone(1.0), silence(1.0)):
        driver.send(samples)
    driver.control(Control.END)
    assert len(driver.of(Final)) == finals == len(driver.of(SpeechStopped))
    if finals == 2:
        assert driver.of(SpeechStopped)[0].end_ms == 1990 + 800  # the last voiced frame + 800


def test_a_pause_after_a_sentence_ends_the_utterance_at_the_endpoint() -> None:
    driver = Driver(vad=EARLY)  # the fake engine ends its words with a full stop at a pause
    for samples in (silence(0.5), tone(1.5), silence(0.6), tone(1.0), silence(1.0)):
        driver.send(samples)
    driver.control(Control.END)
    first, _ = driver.of(Final)
    assert first.text.endswith(".") and first.end_ms == 2490


def test_without_early_finals_the_endpoint_waits_for_no_sentence() -> None:
    # Nothing would say whether the words end a sentence (`captiond transcribe`).
    driver = Driver(unfinished, vad=EARLY, partials=False, early_finals=False)
    for samples in (silence(0.5), tone(1.5), silence(0.6), tone(1.0), silence(1.0)):
        driver.send(samples)
    driver.control(Control.END)
    assert len(driver.of(Final)) == 2


def test_end_during_the_pause_sends_the_early_final() -> None:
    driver = Driver(vad=EARLY)
    driver.send(silence(0.5))
    driver.send(tone(1.5))
    driver.send(silence(0.4))
    driver.control(Control.END)
    assert len(finals_asked(driver)) == 1
    assert [type(m) for m in driver.messages][-2:] == [Final, Done]
    assert driver.of(Final)[0].end_ms == 2400  # flushed at the stream's end


def test_no_early_final_offline_and_the_same_text() -> None:
    streamed, offline = Driver(vad=EARLY), Driver(partials=False, early_finals=False, vad=EARLY)
    for driver in (streamed, offline):
        two_utterances(driver)
        driver.control(Control.END)
    assert [f.text for f in streamed.of(Final)] == [f.text for f in offline.of(Final)]
    assert [r.end_sample for r in finals_asked(offline)] == [
        r.end_sample for r in finals_asked(streamed)
    ]
    # Offline never asks for a final before its utterance ended.
    assert all(
        at_ms >= stop.end_ms
        for at_ms, stop in zip(offline.asked_at_ms, offline.of(SpeechStopped), strict=True)
    )


def test_audio_wakes_the_pump_only_when_a_decode_is_due() -> None:
    """Chunks of 100 ms with partials every 500 ms: the pump is needed for one chunk in five
    (and for the one that starts the utterance: its speech_started goes at once), not for
    every chunk; with a partial in flight, only for the final that supersedes it."""
    driver = Driver()
    session = driver.session
    woken = []
    for _ in range(30):
        session.receive_audio(s16(tone(0.1)))
        woken.append(session.needs_pump)
        driver.pump()
    assert 5 <= sum(woken) <= 7  # 3 s of speech: the first partial once 1 s is heard
    session.receive_audio(s16(tone(0.5)))
    partial = session.next_request()
    assert partial is not None and partial.kind is DecodeKind.PARTIAL
    session.receive_audio(s16(tone(0.5)))
    assert not session.needs_pump  # a partial is due, but one is in flight
    session.receive_audio(s16(silence(1.0)))
    assert session.needs_pump and session.superseded(partial)


def test_end_with_a_request_in_flight_waits_for_it() -> None:
    driver = Driver()
    session = driver.session
    session.receive_audio(s16(np.concatenate([silence(0.5), tone(1.5)])))
    partial = session.next_request()
    assert partial is not None and partial.kind is DecodeKind.PARTIAL
    session.receive_control(Control.END)
    assert session.state is SessionState.ENDING
    assert not any(isinstance(m, Done) for m in session.take_messages())
    session.on_result(partial, driver.decoder(partial.engine_request))
    final = session.next_request()
    assert final is not None and final.kind is DecodeKind.FINAL
    assert session.next_request() is None
    session.on_result(final, driver.decoder(final.engine_request))
    messages = session.take_messages()
    assert [type(m) for m in messages][-2:] == [Final, Done]
    assert session.done
    assert session.next_request() is None


def test_end_without_speech_is_just_done() -> None:
    driver = Driver()
    driver.send(silence(2.0))
    driver.control(Control.END)
    assert driver.messages == [Done(audio_ms=2000, segments=0)]
    assert driver.requests == []


def test_end_flushes_an_open_utterance() -> None:
    driver = Driver()
    driver.send(np.concatenate([silence(0.5), tone(1.2)]))
    assert driver.session.has_open_utterance
    driver.control(Control.END)
    finals = driver.of(Final)
    assert len(finals) == 1
    assert finals[0].end_ms == 1700
    assert driver.messages[-1] == Done(audio_ms=1700, segments=1)


def test_finalize_forces_an_endpoint() -> None:
    driver = Driver()
    driver.send(np.concatenate([silence(0.5), tone(1.5)]))
    assert not driver.of(Final)
    driver.control(Control.FINALIZE)
    stops = driver.of(SpeechStopped)
    finals = driver.of(Final)
    assert len(stops) == 1 and stops[0].end_ms == 2000
    assert len(finals) == 1 and finals[0].segment == 0 and finals[0].end_ms == 2000
    assert driver.session.state is SessionState.STREAMING
    # Speech that goes on becomes the next segment.
    driver.send(tone(1.5))
    driver.send(silence(1.0))
    driver.control(Control.END)
    assert [f.segment for f in driver.of(Final)] == [0, 1]
    assert driver.of(Final)[1].start_ms >= 2000


def test_finalize_ends_speech_too_short_to_have_started_an_utterance() -> None:
    """A "yes" (150 ms) never fills the 300-ms start window; a push-to-talk key let go half a
    second later still ends it as an utterance, from its first voiced frame, pre-roll and
    all, and its final follows."""
    driver = Driver()
    driver.send(np.concatenate([silence(1.0), tone(0.15), silence(0.45)]))
    assert not driver.session.has_open_utterance
    assert driver.session.receive_control(Control.FINALIZE)
    driver.pump()
    (final,) = driver.of(Final)
    # The 30-ms frame from 990 ms holds the tone's start; 300 ms of pre-roll before it.
    assert final.start_ms == 690 and final.end_ms == 1600 and final.text


def test_a_finalized_utterance_gets_its_final_even_with_no_words() -> None:
    """The client waits for an answer to its finalize (OpenAI's commit): an utterance it ends
    gets its final even when the engine hears no words in it (a cough). One the VAD ends does
    not (nothing to clear, nobody waiting)."""

    def no_words(request: EngineRequest) -> EngineResult:
        return EngineResult(text="", avg_logprob=-0.1, no_speech_prob=0.01, language="en")

    driver = Driver(no_words)
    driver.send(np.concatenate([silence(0.5), tone(1.0), silence(1.0)]))
    assert driver.of(SpeechStopped) and not driver.of(Final)
    driver.send(tone(1.0))
    driver.control(Control.FINALIZE)
    (final,) = driver.of(Final)
    assert final.text == "" and final.segment == 0 and final.end_ms == 3500


def test_finalize_with_no_speech_since_the_last_utterance_ends_nothing() -> None:
    driver = Driver()
    driver.send(np.concatenate([silence(0.5), tone(1.0), silence(1.0)]))
    assert len(driver.of(Final)) == 1
    driver.send(silence(1.0))
    assert not driver.session.receive_control(Control.FINALIZE)
    driver.pump()
    assert len(driver.of(Final)) == 1


def test_keepalive_changes_nothing() -> None:
    driver = Driver()
    driver.send(np.concatenate([silence(0.5), tone(1.0)]))
    before = len(driver.messages)
    driver.control(Control.KEEPALIVE)
    assert len(driver.messages) == before
    assert driver.session.has_open_utterance
