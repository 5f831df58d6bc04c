"""StreamSession (Sans-I/O), driven synchronously with a scripted VAD and a fake engine."""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from captiond.audio import Samples
from captiond.config import Config, StreamConfig, VadConfig
from captiond.engines import (
    LANGUAGE_SWITCH_NATS,
    DecodeKind,
    EngineRequest,
    EngineResult,
    begins_with_space,
    choose_language,
    request_language,
    token_counter,
)
from captiond.engines.fake import FakeEngine
from captiond.errors import BadAudioError, BadMessageError
from captiond.protocol import (
    Control,
    Done,
    Final,
    Partial,
    ServerMessage,
    SpeechStarted,
    SpeechStopped,
    StreamParams,
    parse_language,
    parse_stream_params,
)
from captiond.session import DecodeRequest, SessionState, StreamOrigin, StreamSession
from captiond.text import units

RATE = 16_000
CHUNK_MS = 100
# Every utterance decoded alone: older finals reach the decode through the prompt only.
NO_CONTEXT = StreamConfig(context_s=0, partial_context_s=0)

Decoder = Callable[[EngineRequest], EngineResult]


class LevelVad:
    """Scripted VAD: every frame that reaches it is speech. The session's RMS floor keeps the
    silent frames from it, so a tone is speech and digital silence is not."""

    def is_speech(self, buf: bytes, sample_rate: int) -> bool:
        return True


def tone(seconds: float, *, rate: int = RATE, amplitude: float = 0.1) -> Samples:
    t = np.arange(round(seconds * rate)) / rate
    return (amplitude * np.sin(2 * np.pi * 440.0 * t)).astype(np.float32)


def silence(seconds: float, *, rate: int = RATE) -> Samples:
    return np.zeros(round(seconds * rate), dtype=np.float32)


def s16(samples: Samples) -> bytes:
    return (np.clip(samples, -1, 1) * 32767).astype("<i2").tobytes()


def fake_decoder() -> Decoder:
    engine = FakeEngine()

    def decode(request: EngineRequest) -> EngineResult:
        return engine.transcribe_batch([request])[0]

    return decode


class Driver:
    """Feeds a session chunk by chunk and answers its requests at once, recording everything."""

    def __init__(
        self,
        decoder: Decoder | None = None,
        *,
        partials: bool = True,
        early_finals: bool = True,
        params: StreamParams | None = None,
        stream: StreamConfig | None = None,
        vad: VadConfig | None = None,
        origin: StreamOrigin | None = None,
    ) -> None:
        config = Config(stream=stream or StreamConfig(), vad=vad or VadConfig())
        self.session = StreamSession(
            config=config,
            vad=LevelVad(),
            params=params or StreamParams(),
            origin=origin,
            partials=partials,
            early_finals=early_finals,
            count_tokens=token_counter(),
        )
        self.decoder = decoder or fake_decoder()
        self.requests: list[DecodeRequest] = []
        self.asked_at_ms: list[int] = []  # the stream's audio when each request was made
        self.messages: list[ServerMessage] = []

    def pump(self) -> None:
        while (request := self.session.next_request()) is not None:
            self.requests.append(request)
            self.asked_at_ms.append(self.session.audio_ms)
            # At most one request in flight: nothing more until this one is answered.
            assert self.session.next_request() is None
            self.session.on_result(request, self.decoder(request.engine_request))
        self.messages += self.session.take_messages()

    def send(self, samples: Samples, *, encode: Callable[[Samples], bytes] = s16) -> None:
        rate = (self.session_rate_hz * CHUNK_MS) // 1000
        for i in range(0, len(samples), rate):
            self.session.receive_audio(encode(samples[i : i + rate]))
            # As the connection does: the pump is woken only when the session says it has work,
            # so every test that feeds audio checks that no due decode goes unnoticed.
            if self.session.needs_pump:
                self.pump()
            else:
                assert self.session.next_request() is None, "a decode was due, the pump slept"

    @property
    def session_rate_hz(self) -> int:
        return self.session._params.sample_rate_hz

    def control(self, control: Control) -> None:
        self.session.receive_control(control)
        self.pump()

    def of(self, kind: type[Any]) -> list[Any]:
        return [m for m in self.messages if isinstance(m, kind)]


def two_utterances(driver: Driver) -> None:
    driver.send(silence(1.0))
    driver.send(tone(2.0))
    driver.send(silence(1.0))
    driver.send(tone(1.5))
    driver.send(silence(1.0))


# -- the message flow -------------------------------------------------------------------------


def test_speech_started_goes_out_before_any_decode_is_due() -> None:
    """With `language=auto` no decode is due before `language_detect_s` (3 s) of speech: the
    utterance's start goes out as it is heard all the same (a "listening" light, barge-in)."""
    driver = Driver(params=StreamParams(language="auto"))
    driver.send(silence(0.5))
    driver.send(tone(1.0))
    assert [type(m) for m in driver.messages] == [SpeechStarted] and not driver.requests


def test_full_flow_two_segments_then_done() -> None:
    driver = Driver()
    two_utterances(driver)
    assert driver.session.kept_samples > 0
    driver.control(Control.END)
    messages = driver.messages
    assert driver.session.done
    assert driver.session.state is SessionState.DONE

    starts = driver.of(SpeechStarted)
    stops = driver.of(SpeechStopped)
    finals: list[Final] = driver.of(Final)
    partials: list[Partial] = driver.of(Partial)
    assert len(starts) == len(stops) == 2
    assert [f.segment for f in finals] == [0, 1]
    assert all(f.text for f in finals)
    assert partials, "an utterance of 2 s gets partials"
    assert isinstance(messages[0], SpeechStarted)

    assert driver.session.kept_samples == 0, "a done session may be held a while: not its audio"
    assert driver.session.audio_ms == 6500

    # Exactly one done, last, with the stream's duration.
    dones = driver.of(Done)
    assert len(dones) == 1
    assert messages[-1] == Done(audio_ms=6500, segments=2)

    # Speech started precedes every partial/final of its segment; the stop precedes the final.
    for seg, (start, stop) in enumerate(zip(starts, stops, strict=True)):
        seg_msgs = [m for m in messages if isinstance(m, Partial | Final) and m.segment == seg]
        first = messages.index(seg_msgs[0])
        assert messages.index(start) < first
        final = next(f for f in finals if f.segment == seg)
        assert messages.index(stop) < messages.index(final)
        assert final.start_ms == start.start_ms
        assert final.end_ms == stop.end_ms
        assert start.start_ms < stop.end_ms
    # Utterances are where the tone is (pre-roll before, endpoint silence after).
    assert 300 <= starts[0].start_ms <= 1000 < 3000 < stops[0].end_ms <= 3600
    assert 3000 < starts[1].start_ms <= 4000 < 5500 < stops[1].end_ms <= 6100


def test_partials_revise_with_growing_rev_and_stable() -> None:
    driver = Driver()
    two_utterances(driver)
    driver.control(Control.END)
    by_segment: dict[int, list[Partial]] = {}
    for p in driver.of(Partial):
        by_segment.setdefault(p.segment, []).append(p)
    assert set(by_segment) <= {0, 1}
    assert len(by_segment[0]) >= 2
    for seg, partials in by_segment.items():
        revs = [p.rev for p in partials]
        assert revs == sorted(set(revs)), f"rev must increase in segment {seg}"
        previous: list[str] = []
        for p in partials:
            stable = p.stable.split()
            assert stable[: len(previous)] == previous, "stable never shrinks"
            previous = stable
            assert p.end_ms > p.start_ms
        # Partials of a segment come before its final, never after.
        final_at = next(
            i for i, m in enumerate(driver.messages) if isinstance(m, Final) and m.segment == seg
        )
        assert all(driver.messages.index(p) < final_at for p in partials)
    assert by_segment[0][-1].stable, "a 2 s tone stabilizes some words"


def test_finals_are_requested_before_partials() -> None:
    driver = Driver()
    session = driver.session
    # Feed without answering anything: the first utterance closes, the second is open.
    for samples in (silence(0.5), tone(1.5), silence(1.0), tone(1.5)):
        session.receive_audio(s16(samples))
    first = session.next_request()
    assert first is not None
    assert first.kind is DecodeKind.FINAL
    assert session.next_request() is None  # one in flight
    session.receive_audio(s16(tone(1.0)))
    assert session.next_request() is None  # still one in flight
    session.on_result(first, driver.decoder(first.engine_request))
    second = session.next_request()
    assert second is not None
    assert second.kind is DecodeKind.PARTIAL
    assert second.utterance != first.utterance


def test_a_final_due_supersedes_the_partial_in_flight() -> None:
    driver = Driver()
    session = driver.session
    session.receive_audio(s16(silence(0.5)))
    session.receive_audio(s16(tone(1.5)))
    partial = session.next_request()
    assert partial is not None and partial.kind is DecodeKind.PARTIAL
    assert not session.superseded(partial)
    session.receive_audio(s16(silence(1.0)))  # the utterance ends while the partial waits
    assert session.superseded(partial)
    session.abandon(partial)
    final = session.next_request()
    assert final is not None and final.kind is DecodeKind.FINAL
    assert final.utterance == partial.utterance
    session.on_result(final, driver.decoder(final.engine_request))
    finals = [m for m in session.take_messages() if isinstance(m, Final)]
    assert len(finals) == 1 and finals[0].text


# -- early finals ----------------------------------------------------------------------------
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


# -- errors -----------------------------------------------------------------------------------


def test_audio_after_end_is_a_protocol_error() -> None:
    driver = Driver()
    driver.send(silence(0.3))
    driver.control(Control.END)
    with pytest.raises(BadMessageError):
        driver.session.receive_audio(s16(silence(0.1)))
    with pytest.raises(BadMessageError):
        driver.session.receive_samples(silence(0.1))


@pytest.mark.parametrize("control", [Control.END, Control.FINALIZE])
def test_control_after_end_is_a_protocol_error(control: Control) -> None:
    driver = Driver()
    driver.control(Control.END)
    with pytest.raises(BadMessageError):
        driver.session.receive_control(control)


def test_audio_after_end_while_still_flushing_is_an_error() -> None:
    driver = Driver()
    session = driver.session
    session.receive_audio(s16(np.concatenate([silence(0.5), tone(1.5)])))
    request = session.next_request()
    assert request is not None
    session.receive_control(Control.END)
    assert session.state is SessionState.ENDING
    with pytest.raises(BadMessageError):
        session.receive_audio(s16(silence(0.1)))


def test_odd_byte_count_is_bad_audio() -> None:
    driver = Driver()
    with pytest.raises(BadAudioError):
        driver.session.receive_audio(b"\x00\x01\x02")


# -- sample rates and encodings ---------------------------------------------------------------


@pytest.mark.parametrize("rate_hz", [8_000, 48_000])
def test_finalize_of_a_resampled_stream_keeps_its_last_audio(rate_hz: int) -> None:
    """soxr holds back its filter's delay (114 ms at 8 kHz): a finalize (a push-to-talk key
    released) ends the utterance with it, and the stream's clock goes on exactly."""
    driver = Driver(params=StreamParams(sample_rate_hz=rate_hz))
    driver.send(silence(0.5, rate=rate_hz))
    driver.send(tone(2.0, rate=rate_hz))
    driver.control(Control.FINALIZE)
    (final,) = driver.of(Final)
    assert final.end_ms == 2500
    driver.send(silence(0.5, rate=rate_hz))
    driver.control(Control.END)
    assert driver.of(Done)[0].audio_ms == 3000


def test_48k_f32le_stream_is_resampled() -> None:
    params = StreamParams(sample_rate_hz=48_000, encoding="f32le")
    driver = Driver(params=params)
    driver.send(silence(1.0, rate=48_000), encode=lambda x: x.astype("<f4").tobytes())
    driver.send(tone(1.5, rate=48_000), encode=lambda x: x.astype("<f4").tobytes())
    driver.send(silence(1.0, rate=48_000), encode=lambda x: x.astype("<f4").tobytes())
    driver.control(Control.END)
    done = driver.messages[-1]
    assert isinstance(done, Done)
    assert abs(done.audio_ms - 3500) <= 5
    assert done.segments == 1
    # Decodes get 16 kHz audio: the final's request spans its 16 kHz sample count, from the
    # stream's start (the quiet before the utterance, see context.py).
    final_req = next(r for r in driver.requests if r.kind is DecodeKind.FINAL)
    audio = final_req.engine_request.audio
    assert audio.dtype == np.float32
    assert len(audio) == final_req.end_sample
    assert 1.5 * RATE < final_req.end_sample - final_req.start_sample < 2.5 * RATE
    (stop,) = driver.of(SpeechStopped)
    assert 2500 < stop.end_ms <= 3100


def test_session_passes_language_to_the_engine() -> None:
    driver = Driver(params=StreamParams(language="de"))
    two_utterances(driver)
    assert driver.requests
    assert {r.engine_request.language for r in driver.requests} == {"de"}


# -- hallucination filter ---------------------------------------------------------------------


def after_prefix(request: EngineRequest, result: EngineResult) -> EngineResult:
    """A scripted whole-utterance result as an engine returns it: the words after the prefix."""
    words, forced = result.text.split(), request.prefix.split()
    if words[: len(forced)] != forced:
        return result
    return dataclasses.replace(result, text=" ".join(words[len(forced) :]))


def scripted(results: dict[DecodeKind, EngineResult]) -> Decoder:
    def decode(request: EngineRequest) -> EngineResult:
        return after_prefix(request, results[request.kind])

    return decode


GOOD = EngineResult(text="hello there", avg_logprob=-0.2, no_speech_prob=0.05)
HALLUCINATIONS = {
    "silent_and_unsure": EngineResult(text="Thank you.", avg_logprob=-1.5, no_speech_prob=0.9),
    "only_punctuation": EngineResult(text=" ... !? ", avg_logprob=-0.1, no_speech_prob=0.0),
    "empty": EngineResult(text="", avg_logprob=-0.1, no_speech_prob=0.0),
    "repetitive": EngineResult(
        text="the the the the the", avg_logprob=-0.1, no_speech_prob=0.0, compression_ratio=3.0
    ),
}


def one_short_utterance(driver: Driver) -> None:
    driver.send(np.concatenate([silence(0.5), tone(1.2), silence(1.0)]))
    driver.control(Control.END)


@pytest.mark.parametrize("name", sorted(HALLUCINATIONS))
def test_dropped_only_decode_leaves_no_trace(name: str) -> None:
    driver = Driver(scripted({DecodeKind.FINAL: HALLUCINATIONS[name]}), partials=False)
    one_short_utterance(driver)
    assert [r.kind for r in driver.requests] == [DecodeKind.FINAL]
    assert not driver.of(Partial)
    assert not driver.of(Final)
    assert len(driver.of(SpeechStarted)) == len(driver.of(SpeechStopped)) == 1
    assert driver.messages[-1] == Done(audio_ms=2700, segments=0)


@pytest.mark.parametrize("name", sorted(HALLUCINATIONS))
def test_dropped_final_after_a_partial_keeps_only_the_stable_words(name: str) -> None:
    # A final is still sent for a segment that showed partials; what was promised as stable
    # stays, the rest of the dropped decode goes (empty text when nothing was stable).
    driver = Driver(scripted({DecodeKind.PARTIAL: GOOD, DecodeKind.FINAL: HALLUCINATIONS[name]}))
    one_short_utterance(driver)
    partials = driver.of(Partial)
    assert partials and partials[0].segment == 0
    assert partials[-1].stable == "hello"
    assert driver.of(Final) == [
        Final(
            segment=0,
            start_ms=partials[0].start_ms,
            end_ms=driver.of(Final)[0].end_ms,
            text="hello",
            language="en",
        )
    ]
    assert driver.messages[-1] == Done(audio_ms=2700, segments=1)


@pytest.mark.parametrize("name", sorted(HALLUCINATIONS))
def test_dropped_final_without_stable_words_is_an_empty_final(name: str) -> None:
    one_word = EngineResult(text="hello", avg_logprob=-0.2, no_speech_prob=0.05)
    driver = Driver(
        scripted({DecodeKind.PARTIAL: one_word, DecodeKind.FINAL: HALLUCINATIONS[name]})
    )
    one_short_utterance(driver)
    assert driver.of(Partial)[-1].stable == ""
    assert [f.text for f in driver.of(Final)] == [""]


@pytest.mark.parametrize("name", sorted(HALLUCINATIONS))
def test_dropped_partial_is_not_shown(name: str) -> None:
    driver = Driver(scripted({DecodeKind.PARTIAL: HALLUCINATIONS[name], DecodeKind.FINAL: GOOD}))
    one_short_utterance(driver)
    assert any(r.kind is DecodeKind.PARTIAL for r in driver.requests)
    assert not driver.of(Partial)
    finals = driver.of(Final)
    assert [(f.segment, f.text) for f in finals] == [(0, "hello there")]


@pytest.mark.parametrize(
    "result",
    [
        # Whisper's rule needs both: a high no-speech probability alone is not enough ...
        EngineResult(text="hello", avg_logprob=-0.5, no_speech_prob=0.9),
        # ... nor a low log-prob alone.
        EngineResult(text="hello", avg_logprob=-1.5, no_speech_prob=0.1),
        EngineResult(text="hello", avg_logprob=-0.1, compression_ratio=2.3),
    ],
)
def test_plausible_finals_are_kept(result: EngineResult) -> None:
    driver = Driver(scripted({DecodeKind.FINAL: result}), partials=False)
    one_short_utterance(driver)
    assert [f.text for f in driver.of(Final)] == ["hello"]


@pytest.mark.parametrize(
    ("speech_s", "avg_logprob", "kept"),
    [
        # 2.4 s of speech and the 0.48-s endpoint silence: under sparse_min_s (3 s). The 0.3-s
        # pre-roll before the speech does not count, or two slow words would be "sparse".
        (2.4, -1.3, True),
        (4.0, -1.3, False),  # two unsure words over 4.5 s: music or clatter
        (4.0, -0.2, True),  # ... unless Whisper is sure of them
    ],
)
def test_few_unsure_words_over_long_audio_are_dropped(
    speech_s: float, avg_logprob: float, kept: bool
) -> None:
    two_words = EngineResult(text="ألديك قلم", avg_logprob=avg_logprob, no_speech_prob=0.1)
    driver = Driver(scripted({DecodeKind.FINAL: two_words}), partials=False)
    driver.send(np.concatenate([silence(1.0), tone(speech_s), silence(1.0)]))
    driver.control(Control.END)
    assert [f.text for f in driver.of(Final)] == (["ألديك قلم"] if kept else [])


def test_final_text_is_stripped() -> None:
    driver = Driver(
        scripted({DecodeKind.FINAL: EngineResult(text="  hi there \n")}), partials=False
    )
    one_short_utterance(driver)
    assert [f.text for f in driver.of(Final)] == ["hi there"]


def test_segments_skip_dropped_utterances() -> None:
    # The second utterance decodes to punctuation after its context, and again alone.
    texts = iter(["first words", "...", "...", "third words"])

    def decode(request: EngineRequest) -> EngineResult:
        assert request.kind is DecodeKind.FINAL
        return EngineResult(text=next(texts))

    driver = Driver(decode, partials=False)
    for _ in range(3):
        driver.send(np.concatenate([silence(0.5), tone(1.0), silence(1.0)]))
    driver.control(Control.END)
    assert [(f.segment, f.text) for f in driver.of(Final)] == [
        (0, "first words"),
        (1, "third words"),
    ]
    assert driver.messages[-1] == Done(audio_ms=7500, segments=2)


# -- partials switch, prompt ------------------------------------------------------------------


def test_partials_false_never_asks_for_partials() -> None:
    driver = Driver(partials=False)
    two_utterances(driver)
    driver.send(tone(4.0))
    driver.control(Control.END)
    assert driver.requests
    assert {r.kind for r in driver.requests} == {DecodeKind.FINAL}
    assert not driver.of(Partial)
    assert [f.segment for f in driver.of(Final)] == [0, 1, 2]


@pytest.mark.parametrize("partial_beam", [1, 3])
def test_requests_use_the_configured_beams(partial_beam: int) -> None:
    """Finals alone get `final_beam_size`, finals with context `context_beam_size`."""
    driver = Driver(
        stream=StreamConfig(final_beam_size=5, context_beam_size=2, partial_beam_size=partial_beam)
    )
    two_utterances(driver)
    partials = {r.engine_request.beam_size for r in driver.requests if r.kind is DecodeKind.PARTIAL}
    finals = {
        (bool(r.engine_request.prefix), r.engine_request.beam_size)
        for r in driver.requests
        if r.kind is DecodeKind.FINAL
    }
    assert partials == {partial_beam}
    assert finals == {(False, 5), (True, 2)}


def test_prompt_carries_the_previous_finals() -> None:
    driver = Driver(stream=NO_CONTEXT)
    two_utterances(driver)
    driver.send(tone(1.5))
    driver.send(silence(1.0))
    driver.control(Control.END)
    finals = [f.text for f in driver.of(Final)]
    assert len(finals) == 3
    by_utterance: dict[int, list[DecodeRequest]] = {}
    for r in driver.requests:
        by_utterance.setdefault(r.utterance, []).append(r)
    first, second, third = (by_utterance[u] for u in sorted(by_utterance))
    assert {r.engine_request.prompt for r in first} == {""}
    assert {r.engine_request.prompt for r in second} == {finals[0]}
    assert {r.engine_request.prompt for r in third} == {f"{finals[0]} {finals[1]}"}


def test_prompt_is_the_tail_of_the_finals() -> None:
    words = [f"word{i:02d}" for i in range(40)]
    texts = iter([" ".join(words[:20]), " ".join(words[20:]), "last"])

    def decode(request: EngineRequest) -> EngineResult:
        return EngineResult(text=next(texts))

    driver = Driver(decode, partials=False, stream=StreamConfig(prompt_chars=50, context_s=0))
    for _ in range(3):
        driver.send(np.concatenate([silence(0.5), tone(1.0), silence(1.0)]))
    driver.control(Control.END)
    assert len(driver.requests) == 3
    history = " ".join(words)
    prompt = driver.requests[2].engine_request.prompt
    assert 0 < len(prompt) <= 50
    assert history.endswith(prompt)
    assert prompt.split()[-1] == "word39"
    assert all(w in words for w in prompt.split()), "the tail starts at a word boundary"


@pytest.mark.parametrize(
    ("history", "prompt_chars"),
    [
        (["the quick brown fox", "jumps over"], 12),
        (["hello", "wonderful"], 8),
    ],
)
def test_prompt_never_starts_with_a_cut_word(history: list[str], prompt_chars: int) -> None:
    texts = iter([*history, "last"])

    def decode(request: EngineRequest) -> EngineResult:
        return EngineResult(text=next(texts))

    stream = StreamConfig(prompt_chars=prompt_chars, context_s=0)
    driver = Driver(decode, partials=False, stream=stream)
    for _ in range(len(history) + 1):
        driver.send(np.concatenate([silence(0.5), tone(1.0), silence(1.0)]))
    driver.control(Control.END)
    prompt = driver.requests[-1].engine_request.prompt
    joined = " ".join(history)
    assert len(prompt) <= prompt_chars
    assert joined.endswith(prompt)
    # "A cut word would be a wrong word in the prompt" (session.py): only whole words.
    whole_words = joined.split()
    assert all(w in whole_words for w in prompt.split()), f"cut word in prompt {prompt!r}"


def test_no_prompt_when_disabled() -> None:
    driver = Driver(stream=StreamConfig(prompt_chars=0))
    two_utterances(driver)
    assert {r.engine_request.prompt for r in driver.requests} == {""}


# -- requests and the buffer ------------------------------------------------------------------


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


# -- decode context and the stable promise -----------------------------------------------------


def test_a_decode_continues_from_the_previous_finals_audio_and_text() -> None:
    driver = Driver()
    # Speech from the stream's start: the first final's audio starts there, with no quiet
    # before it, as the second one's window does.
    for samples in (tone(2.0), silence(1.0), tone(1.5), silence(1.0)):
        driver.send(samples)
    driver.control(Control.END)
    first, second = (f.text for f in driver.of(Final))
    by_utterance: dict[int, list[DecodeRequest]] = {}
    for r in driver.requests:
        by_utterance.setdefault(r.utterance, []).append(r)
    u0, u1 = (by_utterance[u] for u in sorted(by_utterance))
    final0 = u0[-1]
    for r in u1:
        # The window starts where the first utterance did; its final is the forced prefix.
        assert len(r.engine_request.audio) == r.end_sample - final0.start_sample
        assert r.engine_request.prefix.split()[: len(first.split())] == first.split()
        assert r.engine_request.prompt == ""
    # The fake engine numbers words from the window's start: the second final continues after
    # the first one's words and the silence between them.
    assert int(second.split()[0][1:]) > int(first.split()[-1][1:].rstrip(".")) + 1


def test_without_context_a_decode_hears_the_quiet_before_its_utterance() -> None:
    # 40 s of quiet, then an utterance: its decodes reach back over the quiet as far as their
    # window (partials 10 s, the final 30 s), and the buffer kept that audio for them.
    driver = Driver()
    driver.send(silence(40.0))
    driver.send(tone(2.0))
    driver.send(silence(1.0))
    driver.control(Control.END)
    (utterance,) = {r.start_sample for r in driver.requests}
    assert 39 * RATE < utterance < 40 * RATE
    for r in driver.requests:
        window_s = 30 if r.kind is DecodeKind.FINAL else 10
        assert len(r.engine_request.audio) == window_s * RATE
    assert {r.kind for r in driver.requests} == {DecodeKind.PARTIAL, DecodeKind.FINAL}


def test_buffered_audio_counts_from_the_oldest_utterance_waiting_for_its_final() -> None:
    # What backpressure (`max_buffered_s`) bounds: not the quiet and context the buffer keeps.
    session = StreamSession(
        config=Config(), vad=LevelVad(), params=StreamParams(), count_tokens=token_counter()
    )
    for samples in (silence(40.0), tone(2.0), silence(0.2)):
        session.receive_audio(s16(samples))
    assert session.buffered_samples == 0  # the utterance is open: nothing waits for a final
    session.receive_audio(s16(silence(5.0)))  # its endpoint: the final is due, not answered
    assert 7 * RATE < session.buffered_samples < 8 * RATE
    while (request := session.next_request()) is not None:
        session.on_result(request, EngineResult(text="hello"))
    assert session.buffered_samples == 0


def test_a_decode_after_a_broken_context_starts_after_what_broke_it() -> None:
    # The first utterance's final is empty (noise): the second is decoded without it, from
    # where the quiet after it began.
    finals = iter([EngineResult(text=""), EngineResult(text="hello")])

    def decode(request: EngineRequest) -> EngineResult:
        if request.kind is DecodeKind.PARTIAL:
            return EngineResult(text="")
        return next(finals)

    driver = Driver(decoder=decode)
    two_utterances(driver)
    driver.control(Control.END)
    first, second = (r for r in driver.requests if r.kind is DecodeKind.FINAL)
    (stopped, _) = driver.of(SpeechStopped)
    assert len(first.engine_request.audio) == first.end_sample  # from the stream's start
    quiet_from = stopped.end_ms * RATE // 1000
    assert quiet_from < second.start_sample
    assert len(second.engine_request.audio) == second.end_sample - quiet_from
    assert second.engine_request.prefix == ""


def test_partials_reach_back_less_far_than_finals() -> None:
    stream = StreamConfig(partial_context_s=1.0)
    driver = Driver(stream=stream)
    two_utterances(driver)
    driver.control(Control.END)
    second = [r for r in driver.requests if r.utterance == driver.requests[-1].utterance]
    partials = [r for r in second if r.kind is DecodeKind.PARTIAL]
    assert partials and all(r.engine_request.prefix == " ".join(r.forced_words) for r in partials)
    assert second[-1].engine_request.prefix != " ".join(second[-1].forced_words)


def test_stable_words_are_forced_into_later_partials_and_kept_by_the_final() -> None:
    driver = Driver(stream=NO_CONTEXT)
    driver.send(np.concatenate([silence(0.5), tone(3.0), silence(1.0)]))
    driver.control(Control.END)
    stable = ""
    for r in driver.requests:
        assert " ".join(r.stable_words).startswith(stable)
        stable = " ".join(r.stable_words)
        if r.kind is DecodeKind.PARTIAL:
            assert r.engine_request.prefix == stable
        else:
            # The final decodes freely: a forced partial-quality prefix would spread its
            # errors into every later decode that continues from this final.
            assert r.engine_request.prefix == "" and r.forced_words == ()
    assert stable, "the final request carried the stable words"
    assert driver.of(Final)[0].text.startswith(stable)


@pytest.mark.parametrize(
    ("heard", "decoded", "stable", "final"),
    [
        # Whisper's final extends a stable word ("fellow" -> "fellows") and disagrees with
        # another: the stable words stay as shown, the decode supplies what follows them.
        (
            "And so my fellow Americans",
            "And so am I fellows Americans, ask not",
            "And so my fellow",
            "And so my fellow Americans, ask not",
        ),
        # The partials wrote "thirty eight" (stable) and the final decode "38": one for one,
        # the two stable words stood for "38 apples." and "apples." was lost. The final goes
        # on where the decode has the word the newest partial showed after the stable ones.
        (
            "I have thirty eight apples",
            "I have 38 apples.",
            "I have thirty eight",
            "I have thirty eight apples.",
        ),
    ],
)
def test_a_final_that_disagrees_keeps_the_stable_words_and_takes_the_rest(
    heard: str, decoded: str, stable: str, final: str
) -> None:
    def decode(request: EngineRequest) -> EngineResult:
        if request.kind is DecodeKind.FINAL:
            assert request.prefix == ""
            return EngineResult(text=decoded)
        return after_prefix(request, EngineResult(text=heard))

    driver = Driver(decode, stream=NO_CONTEXT)
    driver.send(np.concatenate([silence(0.5), tone(2.5), silence(1.0)]))
    driver.control(Control.END)
    assert driver.of(Partial)[-1].stable == stable
    assert driver.of(Final)[0].text == final


def test_punctuation_after_the_forced_words_is_not_a_word_of_its_own() -> None:
    # Forced "Hello", Whisper goes on with the comma it would have put after it: the partial
    # must not show (and then promise) "Hello , there" with the comma as a word. The comma
    # ends "Hello" instead (stable text grows by it), so the final keeps it.
    def decode(request: EngineRequest) -> EngineResult:
        if request.kind is DecodeKind.FINAL:
            return EngineResult(text="Hello there world.")
        if request.prefix == "Hello":
            return EngineResult(text=", there world", unit_probs=(1.0, 0.9, 0.9))
        if request.prefix:
            return after_prefix(request, EngineResult(text="Hello, there world"))
        return EngineResult(text="Hello there", unit_probs=(0.9, 0.9))

    driver = Driver(decode, stream=NO_CONTEXT)
    driver.send(np.concatenate([silence(0.5), tone(3.0), silence(1.0)]))
    driver.control(Control.END)
    partials = driver.of(Partial)
    assert any(p.stable == "Hello" for p in partials)
    texts = [" ".join(filter(None, (p.stable, p.unstable))) for p in partials]
    assert texts[-1] == "Hello, there world"
    assert all("," not in t.split() for t in texts)
    assert any(p.stable.startswith("Hello,") for p in partials)
    assert driver.of(Final)[0].text == "Hello, there world."


@pytest.mark.parametrize("spaced", [False, True])
def test_digits_written_after_forced_chinese_characters_stay_glued_to_them(
    spaced: bool,
) -> None:
    # Stable "加进", and Whisper goes on with "38年…" right after it (no space before "38"):
    # the stable text, and so the final that starts with it, is "加进38…", not "加进 38…".
    # A continuation that began with a space keeps it.
    sentence = "加进38年登进士"

    def decode(request: EngineRequest) -> EngineResult:
        if request.kind is DecodeKind.FINAL:
            return EngineResult(text=sentence)
        if request.prefix == "加进":
            return EngineResult(text="38年登进士", unit_probs=(0.9,) * 6, spaced=spaced)
        if request.prefix:
            return EngineResult(text="", unit_probs=())
        return EngineResult(text="加进38", unit_probs=(0.9, 0.9, 0.9))

    driver = Driver(decode, stream=NO_CONTEXT)
    driver.send(np.concatenate([silence(0.5), tone(3.0), silence(1.0)]))
    driver.control(Control.END)
    stables = {p.stable for p in driver.of(Partial)}
    assert "加进" in stables
    glued = [s for s in stables if "38" in s]
    assert glued, stables
    if spaced:
        assert all(s.startswith("加进 38") for s in glued)
        assert driver.of(Final)[0].text.startswith("加进 38")
    else:
        assert all(s.startswith("加进38") for s in glued)
        assert driver.of(Final)[0].text == sentence


def test_words_the_partials_were_unsure_of_are_not_stable() -> None:
    # Every partial says "my", but at p = 0.6, under the default floor (0.7): the final may
    # hear "am I", so neither "my" nor anything after it is promised; the words before it are.
    def decode(request: EngineRequest) -> EngineResult:
        if request.kind is DecodeKind.FINAL:
            return EngineResult(text="And so am I fellow Americans, ask not")
        words = ["And", "so", "my", "fellow", "Americans"]
        probs = dict(zip(words, (0.9, 0.8, 0.6, 0.9, 0.9), strict=True))
        new = words[len(request.prefix.split()) :]
        return EngineResult(text=" ".join(new), unit_probs=tuple(probs[w] for w in new))

    driver = Driver(decode, stream=NO_CONTEXT)
    driver.send(np.concatenate([silence(0.5), tone(2.5), silence(1.0)]))
    driver.control(Control.END)
    assert {p.stable for p in driver.of(Partial)[1:]} == {"And so"}
    assert driver.of(Final)[0].text == "And so am I fellow Americans, ask not"
    # With the floor at 0, agreement alone decides, as for an engine that does not tell.
    driver = Driver(decode, stream=dataclasses.replace(NO_CONTEXT, stable_min_probability=0))
    driver.send(np.concatenate([silence(0.5), tone(2.5), silence(1.0)]))
    driver.control(Control.END)
    assert driver.of(Partial)[-1].stable == "And so my fellow"


def test_later_decodes_continue_from_the_decoded_final_not_the_stable_words() -> None:
    finals = iter(["Hello there, friend.", "Second."])

    def decode(request: EngineRequest) -> EngineResult:
        if request.kind is DecodeKind.FINAL:
            return EngineResult(text=next(finals))
        return after_prefix(request, EngineResult(text="hello hello there friend"))

    driver = Driver(decode)
    two_utterances(driver)
    driver.control(Control.END)
    second = [r for r in driver.requests if r.utterance == driver.requests[-1].utterance]
    assert driver.of(Final)[0].text.startswith(driver.of(Partial)[0].stable)
    assert second[-1].engine_request.prefix == "Hello there, friend."


def ends_at_once_after_context(*alone: str, ended: str = "。") -> Decoder:
    """Partials hear "so we meet"; a final forced to continue earlier finals (or prompted with
    them) ends at once, as Whisper did on a Japanese turn (writing `ended`: "。"); those
    without them hear the texts of `alone`, one after the other."""
    texts = iter(alone)

    def decode(request: EngineRequest) -> EngineResult:
        if request.kind is DecodeKind.PARTIAL:
            return after_prefix(request, EngineResult(text="so we meet"))
        if request.prefix or request.prompt:
            return EngineResult(text=ended, avg_logprob=-0.1, no_speech_prob=0.0)
        return EngineResult(text=next(texts), avg_logprob=-0.2, no_speech_prob=0.05)

    return decode


def finals_of_last_utterance(driver: Driver) -> list[EngineRequest]:
    last = driver.requests[-1].utterance
    return [
        r.engine_request
        for r in driver.requests
        if r.utterance == last and r.kind is DecodeKind.FINAL
    ]


@pytest.mark.parametrize("early_finals", [True, False])
@pytest.mark.parametrize("stream", [StreamConfig(), NO_CONTEXT], ids=["prefix", "prompt"])
def test_a_final_that_ends_at_once_after_its_context_is_decoded_again_alone(
    early_finals: bool, stream: StreamConfig
) -> None:
    driver = Driver(
        ends_at_once_after_context("so we meet again", "so we met again"),
        stream=stream,
        early_finals=early_finals,
    )
    two_utterances(driver)
    driver.control(Control.END)
    assert [f.text for f in driver.of(Final)] == ["so we meet again", "so we met again"]
    with_context, alone = finals_of_last_utterance(driver)
    assert with_context.prefix if stream.context_s else with_context.prompt
    assert (alone.prefix, alone.prompt) == ("", "")
    assert alone.end_sample == with_context.end_sample
    # Alone, its window starts as a stream's first utterance's does: at the quiet before it.
    if with_context.prefix:
        assert len(alone.audio) < len(with_context.audio)
    else:
        assert len(alone.audio) == len(with_context.audio)


def test_a_final_that_ends_at_once_again_alone_keeps_its_stable_words() -> None:
    driver = Driver(ends_at_once_after_context("so we meet again", ""))
    two_utterances(driver)
    driver.control(Control.END)
    assert len(finals_of_last_utterance(driver)) == 2  # decoded alone once, not again
    assert driver.of(Partial)[-1].stable == "so we"
    assert [f.text for f in driver.of(Final)] == ["so we meet again", "so we"]


def test_an_utterance_that_showed_no_words_and_decoded_to_nothing_is_not_decoded_again() -> None:
    # Without partials, nothing was shown: a final with context that decodes to nothing at all
    # may be noise, which Whisper alone could caption.
    driver = Driver(ends_at_once_after_context("Thank you.", ended=""), partials=False)
    two_utterances(driver)
    driver.control(Control.END)
    assert [f.text for f in driver.of(Final)] == ["Thank you."]
    assert [r.utterance for r in driver.requests].count(driver.requests[-1].utterance) == 1


def test_a_final_that_only_closed_its_contexts_sentence_is_decoded_again_alone() -> None:
    # Whisper forced to continue the earlier finals wrote their sentence's "。" and ended: it
    # heard the utterance as the end of the last one (two turns of a fast Chinese session were
    # lost so, their partials ending at once too). Without any partial shown, it is decoded
    # again alone.
    driver = Driver(
        ends_at_once_after_context("so we meet again", "so we met again"), partials=False
    )
    two_utterances(driver)
    driver.control(Control.END)
    assert [f.text for f in driver.of(Final)] == ["so we meet again", "so we met again"]
    with_context, alone = finals_of_last_utterance(driver)
    assert with_context.prefix and (alone.prefix, alone.prompt) == ("", "")


def repeats_after_context(*alone: str) -> Decoder:
    """A final forced to continue earlier finals writes their last sentence again (and again,
    the more copies the prefix holds), as Whisper did in a fast Japanese session; those without
    context hear the texts of `alone`, one after the other."""
    texts = iter(alone)

    def decode(request: EngineRequest) -> EngineResult:
        if request.kind is DecodeKind.FINAL and request.prefix:
            return EngineResult(text="We met.", avg_logprob=-0.2, no_speech_prob=0.0)
        if request.kind is DecodeKind.FINAL:
            return EngineResult(text=next(texts), avg_logprob=-0.2, no_speech_prob=0.05)
        return EngineResult(text="")

    return decode


def test_a_final_that_repeats_its_contexts_last_words_is_decoded_again_alone() -> None:
    driver = Driver(repeats_after_context("We met.", "She saw him."), partials=False)
    two_utterances(driver)
    driver.control(Control.END)
    assert [f.text for f in driver.of(Final)] == ["We met.", "She saw him."]
    with_context, alone = finals_of_last_utterance(driver)
    assert with_context.prefix == "We met." and (alone.prefix, alone.prompt) == ("", "")


def test_a_speaker_who_said_the_same_again_gets_it_from_the_decode_alone() -> None:
    driver = Driver(repeats_after_context("We met.", "We met."), partials=False)
    two_utterances(driver)
    driver.control(Control.END)
    assert [f.text for f in driver.of(Final)] == ["We met.", "We met."]
    assert len(finals_of_last_utterance(driver)) == 2  # decoded alone once, not again


def runs_out_of_tokens_after_a_prefix(decode_alone: str) -> Decoder:
    """A final after a prefix stops at its token budget ("so we", truncated), as a long
    Japanese utterance after a few hundred characters of context did; alone, it hears
    `decode_alone` (the first utterance's final too)."""

    def decode(request: EngineRequest) -> EngineResult:
        if request.kind is DecodeKind.PARTIAL:
            return after_prefix(request, EngineResult(text="so we meet"))
        if request.prefix:
            return EngineResult(text="so we", avg_logprob=-0.1, truncated=True)
        return EngineResult(text=decode_alone, avg_logprob=-0.2, no_speech_prob=0.05)

    return decode


@pytest.mark.parametrize("early_finals", [True, False])
def test_a_final_that_runs_out_of_tokens_after_its_prefix_is_decoded_again_alone(
    early_finals: bool,
) -> None:
    driver = Driver(
        runs_out_of_tokens_after_a_prefix("so we meet again"), early_finals=early_finals
    )
    two_utterances(driver)
    driver.control(Control.END)
    assert [f.text for f in driver.of(Final)] == ["so we meet again", "so we meet again"]
    with_prefix, alone = finals_of_last_utterance(driver)
    assert with_prefix.prefix == "so we meet again" and alone.prefix == alone.prompt == ""
    assert alone.end_sample == with_prefix.end_sample


def test_a_loop_the_engine_stopped_is_dropped_as_a_repetitive_one() -> None:
    """torch_graph stops a loop early (`EngineResult.looped`), before its text is repetitive
    enough for the compression-ratio rule: it is dropped all the same, not sent as a final
    (with context, the final is then decoded again alone, as one the rule dropped)."""
    finals: list[EngineRequest] = []

    def decode(request: EngineRequest) -> EngineResult:
        finals.append(request)
        if len(finals) == 1:
            return EngineResult(text="Thank you.", avg_logprob=-0.2, no_speech_prob=0.05)
        loop = "so we we we we"
        return EngineResult(text=loop, compression_ratio=1.3, truncated=True, looped=True)

    driver = Driver(decode, stream=NO_CONTEXT, partials=False)
    two_utterances(driver)
    driver.control(Control.END)
    assert len(finals) == 2
    assert [f.text for f in driver.of(Final)] == ["Thank you."]


def test_a_truncated_final_without_a_prefix_is_not_decoded_again() -> None:
    # The prompt does not count in the decode's budget (fit_prompt keeps it under 224 tokens):
    # alone, the final would have no more room.
    def decode(request: EngineRequest) -> EngineResult:
        if request.kind is DecodeKind.PARTIAL:
            return after_prefix(request, EngineResult(text="so we meet"))
        return EngineResult(text="so we meet", avg_logprob=-0.1, truncated=bool(request.prompt))

    driver = Driver(decode, stream=NO_CONTEXT)
    two_utterances(driver)
    driver.control(Control.END)
    assert len(finals_of_last_utterance(driver)) == 1
    assert finals_of_last_utterance(driver)[0].prompt


def test_a_loop_that_ran_out_of_tokens_is_not_decoded_again_when_nothing_was_shown() -> None:
    # The filters drop a repetition loop (compression ratio), and nothing was shown: noise,
    # which Whisper alone could caption too.
    def decode(request: EngineRequest) -> EngineResult:
        if request.prefix:
            loop = " ".join(["la"] * 40)
            return EngineResult(text=loop, compression_ratio=9.0, truncated=True)
        return EngineResult(text="Thank you.", avg_logprob=-0.2, no_speech_prob=0.05)

    driver = Driver(decode, partials=False)
    two_utterances(driver)
    driver.control(Control.END)
    assert len(finals_of_last_utterance(driver)) == 1
    assert [f.text for f in driver.of(Final)] == ["Thank you."]


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_no_final_contradicts_its_stable_words(data: st.DataObject) -> None:
    """Whatever an engine answers, every final starts with its segment's last stable words."""
    vocabulary = ["yes", "no", "the", "cat", "sat", "Thank", "you.", "okay"]

    def decode(request: EngineRequest) -> EngineResult:
        words = data.draw(st.lists(st.sampled_from(vocabulary), max_size=6))
        score = data.draw(st.sampled_from([-0.2, -2.0]))
        sure = st.floats(min_value=0.01, max_value=1.0)
        probs = data.draw(st.lists(sure, min_size=len(words), max_size=len(words)))
        return EngineResult(
            text=" ".join(words), avg_logprob=score, no_speech_prob=0.1, unit_probs=tuple(probs)
        )

    driver = Driver(decode)
    for seconds in data.draw(st.lists(st.sampled_from([0.8, 1.7, 3.1]), min_size=1, max_size=3)):
        driver.send(np.concatenate([tone(seconds), silence(1.0)]))
    driver.control(Control.END)
    finals = {f.segment: f.text.split() for f in driver.of(Final)}
    for partial in driver.of(Partial):
        stable = partial.stable.split()
        assert finals[partial.segment][: len(stable)] == stable


def test_context_audio_is_kept_and_then_released() -> None:
    driver = Driver()
    for _ in range(20):
        driver.send(np.concatenate([tone(1.5), silence(1.5)]))
    assert driver.session._buffer.end_sample - driver.session._buffer._offset <= 33 * RATE
    driver.control(Control.END)
    assert len(driver.of(Final)) == 20
    for r in driver.requests:
        assert len(r.engine_request.audio) <= 30 * RATE


def test_finals_keep_their_context_when_decodes_lag_behind_the_audio() -> None:
    # All the audio arrives before any decode runs (an engine far behind, or audio sent faster
    # than real time): each final still reaches back to the finals before it, as it does when
    # every decode runs at once, although the stream's end is more than a window past them.
    audio = np.concatenate([silence(0.5), *[np.concatenate([tone(8.0), silence(1.5)])] * 4])
    live = Driver(partials=False)
    live.send(audio)
    live.control(Control.END)
    lagging = Driver(partials=False)
    for i in range(0, len(audio), RATE * CHUNK_MS // 1000):
        lagging.session.receive_audio(s16(audio[i : i + RATE * CHUNK_MS // 1000]))
    lagging.control(Control.END)
    assert lagging.session._buffer.end_sample - 8 * RATE > 30 * RATE

    def contexts(driver: Driver) -> list[tuple[int, str]]:
        return [(len(r.engine_request.audio), r.engine_request.prefix) for r in driver.requests]

    assert len(lagging.of(Final)) == 4
    assert sum(1 for _, prefix in contexts(lagging) if prefix) >= 3
    assert contexts(lagging) == contexts(live)


def test_no_partial_reaches_into_where_a_capped_utterance_may_be_cut() -> None:
    stream = StreamConfig(max_utterance_s=4.0, cut_search_s=1.5)
    driver = Driver(stream=stream)
    driver.send(np.concatenate([silence(0.5), tone(12.0), silence(1.0)]))
    driver.control(Control.END)
    starts = {r.utterance: r.start_sample for r in driver.requests}
    partials = [r for r in driver.requests if r.kind is DecodeKind.PARTIAL]
    assert partials
    for r in partials:
        assert r.end_sample - starts[r.utterance] <= 2.5 * RATE
    finals = {f.segment: f.text.split() for f in driver.of(Final)}
    for p in driver.of(Partial):
        assert finals[p.segment][: len(p.stable.split())] == p.stable.split()


# -- languages ---------------------------------------------------------------------------------


def detecting_decoder(spoken: list[str]) -> tuple[Decoder, list[EngineRequest]]:
    """A multilingual engine's behaviour: the n-th utterance is in `spoken[n]` (told apart by
    the utterance start each request is detected from); the hint wins as choose_language says
    when the detection is unsure (here: never, the script is certain)."""
    seen: list[EngineRequest] = []
    starts: list[int] = []

    def decode(request: EngineRequest) -> EngineResult:
        seen.append(request)
        result = fake_decoder()(request)
        language = request.language
        if language is None:
            start = len(request.audio) - request.detect_from_sample
            starts.append(start)
            language = spoken[min(len(set(starts)) - 1, len(spoken) - 1)]
        return dataclasses.replace(result, language=language, language_probability=0.99)

    return decode, seen


def test_auto_language_is_decided_once_per_utterance_and_shown() -> None:
    decoder, seen = detecting_decoder(["de"])
    driver = Driver(decoder, params=StreamParams(language="auto"), stream=NO_CONTEXT)
    driver.send(silence(0.3))
    driver.send(tone(3.0))
    driver.send(silence(1.0))
    driver.control(Control.END)
    detecting = [r for r in seen if r.language is None]
    assert len(detecting) == 1, "detected once, then decoded in that language"
    assert len(detecting[0].audio) >= RATE  # not before `language_detect_s` of audio
    assert {r.language for r in seen if r.language is not None} == {"de"}
    shown = driver.of(Partial) + driver.of(Final)
    assert shown and {m.language for m in shown} == {"de"}


def test_punctuation_the_model_adds_to_the_context_is_not_part_of_the_next_final() -> None:
    # The first final is committed without its full stop; the second one's decode, forced
    # with it as context, begins by writing it ("。顔に…"): the full stop is not the next
    # final's first unit, and the prefix has no space between the two Japanese sentences.
    def decode(request: EngineRequest) -> EngineResult:
        if request.kind is DecodeKind.PARTIAL:
            return EngineResult(text="")
        if request.prefix == "出席できなかった":
            return EngineResult(text="。顔に車を止めた。")
        return EngineResult(text="出席できなかった")

    driver = Driver(decode, params=StreamParams(language="ja"))
    driver.send(np.concatenate([silence(0.3), tone(2.0), silence(1.0), tone(2.0), silence(1.0)]))
    driver.control(Control.END)
    assert [f.text for f in driver.of(Final)] == ["出席できなかった", "顔に車を止めた。"]


@pytest.mark.parametrize("stream", [StreamConfig(), NO_CONTEXT], ids=["context", "no context"])
def test_a_language_change_starts_a_new_context(stream: StreamConfig) -> None:
    """The second utterance is detected with the first one's language as the hint, and its
    decodes do not continue the first one's (German) text, as their prefix or as their
    prompt: with `context_s = 0` the prompt alone made Japanese after English come out in
    English."""
    decoder, seen = detecting_decoder(["de", "fr"])
    driver = Driver(decoder, params=StreamParams(language="auto"), stream=stream)
    driver.send(silence(0.3))
    driver.send(tone(2.0))
    driver.send(silence(1.0))
    driver.send(tone(3.5))  # `language_detect_s` or more: enough to switch on
    driver.send(silence(1.0))
    driver.control(Control.END)
    finals = driver.of(Final)
    assert [f.language for f in finals] == ["de", "fr"]
    second = [r for r in seen if r.language == "fr" or r.language_hint == "de"]
    assert second and all(r.language_hint == "de" for r in second)
    french = [r for r in driver.requests if r.engine_request.language == "fr"]
    assert french and all(r.engine_request.prefix == " ".join(r.forced_words) for r in french), (
        "only the utterance's own stable words are forced, no German context"
    )
    assert all(r.engine_request.prompt == "" for r in french), "no German prompt either"


def test_a_decode_that_finds_a_new_language_after_the_old_ones_text_is_done_again() -> None:
    """Without partials (`captiond transcribe`) an utterance's final is its first decode: it
    detects the language with the text so far as its prompt. When that text is in another
    language the result is thrown away and the final decoded again without it."""
    decoder, _ = detecting_decoder(["de", "fr"])
    driver = Driver(
        decoder, partials=False, early_finals=False, params=StreamParams(language="auto")
    )
    driver.send(np.concatenate([silence(0.3), tone(2.0), silence(1.0), tone(3.5), silence(1.0)]))
    driver.control(Control.END)
    assert [f.language for f in driver.of(Final)] == ["de", "fr"]
    second = [r.engine_request for r in driver.requests if r.utterance == 1]
    assert [r.language for r in second] == [None, "fr"]
    assert second[0].prefix or second[0].prompt, "the detecting decode had the German text"
    assert (second[1].prefix, second[1].prompt) == ("", "")


def test_an_utterance_the_first_second_does_not_tell_is_detected_on_more_audio() -> None:
    """After a Spanish utterance, one second of English kept Spanish (short of the switch's
    probability) but without being sure of it: nothing is shown in Spanish, and the decision
    waits for `language_detect_s` of the utterance, which tells English."""

    def decode(request: EngineRequest) -> EngineResult:
        result = fake_decoder()(request)
        heard_s = (len(request.audio) - request.detect_from_sample) / RATE
        if request.language is not None:
            language, probability = request.language, 1.0
        elif request.language_hint is None:
            language, probability = "es", 0.95
        else:
            language, probability = ("es", 0.3) if heard_s < 2.0 else ("en", 0.9)
        return dataclasses.replace(result, language=language, language_probability=probability)

    driver = Driver(decode, params=StreamParams(language="auto"))
    driver.send(np.concatenate([silence(0.3), tone(3.5), silence(1.0), tone(5.0), silence(1.0)]))
    driver.control(Control.END)
    assert [f.language for f in driver.of(Final)] == ["es", "en"]
    second = [p for p in driver.of(Partial) if p.segment == 1]
    assert second and {p.language for p in second} == {"en"}, "no partial in Spanish"
    detecting = [
        r for r in driver.requests if r.utterance == 1 and r.engine_request.language is None
    ]
    assert [r.kind for r in detecting] == [DecodeKind.PARTIAL, DecodeKind.PARTIAL]
    heard_s = [(r.end_sample - r.start_sample) / RATE for r in detecting]
    assert heard_s[0] < 2.0 <= 3.0 <= heard_s[1]


def heard_as(first_s: float, short: str, long: str) -> Decoder:
    """An engine after a German first utterance: later utterances are heard as `short` (sure,
    0.91) on less than `first_s` of audio and as `long` on more."""

    def decode(request: EngineRequest) -> EngineResult:
        result = fake_decoder()(request)
        heard_s = (len(request.audio) - request.detect_from_sample) / RATE
        if request.language is not None:
            language = request.language
        elif request.language_hint is None:
            language = "de"
        else:
            language = short if heard_s < first_s else long
        return dataclasses.replace(result, language=language, language_probability=0.91)

    return decode


def test_a_second_heard_as_another_language_does_not_switch_the_session() -> None:
    """base heard the first second of a German sentence as English at 0.91 and the sentence
    was decoded in English (translated). Another language on less than `language_detect_s`
    of audio waits for that much, which tells German: nothing is shown in English."""
    driver = Driver(heard_as(2.0, "en", "de"), params=StreamParams(language="auto"))
    driver.send(np.concatenate([silence(0.3), tone(3.5), silence(1.0), tone(5.0), silence(1.0)]))
    driver.control(Control.END)
    assert [f.language for f in driver.of(Final)] == ["de", "de"]
    shown = [m for m in driver.of(Partial) + driver.of(Final) if m.segment == 1]
    assert shown and {m.language for m in shown} == {"de"}, "nothing shown in English"
    detecting = [
        r for r in driver.requests if r.utterance == 1 and r.engine_request.language is None
    ]
    heard_s = [(r.end_sample - r.start_sample) / RATE for r in detecting]
    assert len(heard_s) == 2 and heard_s[0] < 2.0 <= 3.0 <= heard_s[1]


def test_an_utterance_too_short_to_tell_is_decoded_in_the_session_language() -> None:
    """Under `language_detect_s` of audio is too little to switch on, however sure the
    detection: a short utterance after German, heard as Korean at 0.91, has its final decoded
    in German."""
    driver = Driver(heard_as(30.0, "ko", "ko"), params=StreamParams(language="auto"))
    driver.send(np.concatenate([silence(0.3), tone(3.5), silence(1.0), tone(2.0), silence(1.0)]))
    driver.control(Control.END)
    assert [f.language for f in driver.of(Final)] == ["de", "de"]
    second = [r.engine_request for r in driver.requests if r.utterance == 1]
    finals = [r for r in second if r.kind is DecodeKind.FINAL]
    assert finals and all(r.language == "de" for r in finals)
    assert all(p.language == "de" for p in driver.of(Partial) if p.segment == 1)


def test_the_languages_to_detect_among_reach_the_engine() -> None:
    """`?language=en,de`: each detection is among them (Whisper hears Chinese here, a Chinese
    accent's English); a session update to others drops a session language outside them."""
    heard = {"zh": 0.6, "en": 0.3, "de": 0.1}
    seen: list[EngineRequest] = []

    def decode(request: EngineRequest) -> EngineResult:
        seen.append(request)
        result = fake_decoder()(request)
        if request.language is not None:
            return dataclasses.replace(result, language=request.language)
        choice = request_language(request, heard)
        return dataclasses.replace(
            result, language=choice.language, language_probability=choice.probability
        )

    params = parse_stream_params({"language": "en,de"}, "en")
    driver = Driver(decode, params=params, stream=NO_CONTEXT)
    driver.send(tone(4.0))
    driver.send(silence(1.0))
    assert [f.language for f in driver.of(Final)] == ["en"]
    assert {r.candidates for r in seen} == {("en", "de")}
    driver.session.set_language(parse_language("de,fr"))
    seen.clear()
    driver.send(tone(4.0))
    driver.send(silence(1.0))
    driver.control(Control.END)
    assert [f.language for f in driver.of(Final)] == ["en", "de"]
    detecting = [r for r in seen if r.language is None]
    assert detecting and all(r.language_hint is None for r in detecting), "en is not a candidate"
    assert {r.candidates for r in seen} == {("de", "fr")}


def test_fixed_language_and_translate_reach_the_engine() -> None:
    decoder, seen = detecting_decoder(["es"])
    driver = Driver(decoder, params=StreamParams(language="es", task="translate"))
    driver.send(tone(2.0))
    driver.send(silence(1.0))
    driver.control(Control.END)
    assert seen and all(r.language == "es" and r.task == "translate" for r in seen)
    assert {f.language for f in driver.of(Final)} == {"es"}


def test_an_utterance_without_speech_does_not_change_the_session_language() -> None:
    """The speech gate answers a noise utterance (here: the quieter tone) without a language:
    the session's language stays."""
    decoder, seen = detecting_decoder(["de"])

    def gated(request: EngineRequest) -> EngineResult:
        if float(np.abs(request.audio).max()) < 0.07:
            return EngineResult(text="")  # what the speech gate answers for no speech
        return decoder(request)

    driver = Driver(gated, params=StreamParams(language="auto"), stream=NO_CONTEXT)
    for amplitude in (0.1, 0.05, 0.1):
        driver.send(tone(2.0, amplitude=amplitude))
        driver.send(silence(1.0))
    driver.control(Control.END)
    hints = [r.language_hint for r in seen if r.language is None]
    assert hints[-1] == "de", "the third utterance still leans on German"
    assert [f.language for f in driver.of(Final) if f.text] == ["de", "de"]


def test_an_utterance_that_decoded_to_nothing_does_not_set_the_session_language() -> None:
    """Noise that Whisper hears as Welsh (35 %) and decodes to nothing shows no caption: the next
    utterance, English at 65 % and Welsh at 5 %, is decoded in English, not held to Welsh."""
    noise = {"cy": 0.35, "en": 0.30, "de": 0.25}
    speech = {"en": 0.65, "de": 0.2, "cy": 0.05}
    hints: list[str | None] = []

    def decode(request: EngineRequest) -> EngineResult:
        loud = float(np.abs(request.audio[request.detect_from_sample :]).max()) > 0.07
        language, probability = request.language, 1.0
        if language is None:
            hints.append(request.language_hint)
            choice = choose_language(speech if loud else noise, hints[-1])
            language, probability = choice.language, choice.probability
        result = fake_decoder()(dataclasses.replace(request, language=language))
        text = result.text if loud else ""
        return dataclasses.replace(
            result, text=text, language=language, language_probability=probability
        )

    driver = Driver(decode, params=StreamParams(language="auto"), stream=NO_CONTEXT)
    driver.send(tone(1.5, amplitude=0.05))
    driver.send(silence(1.5))
    driver.send(tone(4.0, amplitude=0.3))
    driver.send(silence(1.0))
    driver.control(Control.END)
    assert None in hints and "cy" not in hints
    assert [(f.language, bool(f.text)) for f in driver.of(Final)] == [("en", True)]


UNSURE_PT = {"pt": 0.72, "es": 0.14, "it": 0.04}  # base on the end of a Spanish sentence


@pytest.mark.parametrize(
    ("probabilities", "hint", "evidence", "chosen", "left"),
    [
        ({"en": 0.65, "cy": 0.05}, None, (None, 0.0), "en", None),  # no session language yet
        ({"en": 0.6, "de": 0.3}, "de", (None, 0.0), "de", "en"),  # English words, German meeting
        ({"en": 0.95, "de": 0.04}, "de", (None, 0.0), "en", None),  # 24 times as likely: switch
        (UNSURE_PT, "es", (None, 0.0), "es", "pt"),  # 5 times: kept, evidence left for pt
        (UNSURE_PT, "es", ("pt", math.log(0.72 / 0.14)), "pt", None),  # twice in a row: switch
        (UNSURE_PT, "es", ("it", 2.5), "es", "pt"),  # the evidence was for another language
        ({"en": 0.65, "cy": 0.0}, "cy", (None, 0.0), "en", None),  # underflowed: no evidence
    ],
)
def test_choose_language_switches_on_the_odds_of_consecutive_utterances(
    probabilities: dict[str, float],
    hint: str | None,
    evidence: tuple[str | None, float],
    chosen: str,
    left: str | None,
) -> None:
    choice = choose_language(probabilities, hint, *evidence)
    assert (choice.language, choice.probability) == (chosen, probabilities[chosen])
    assert choice.switch_language == left
    if left is not None:
        carried = evidence[1] if evidence[0] == left else 0.0
        odds = probabilities[left] / probabilities[chosen]
        assert choice.switch_nats == pytest.approx(carried + math.log(odds))
        assert choice.switch_nats < LANGUAGE_SWITCH_NATS


def test_choose_language_among_candidates() -> None:
    """Candidates renormalize Whisper's probabilities over their own tokens: the odds between
    two stay, so the switch rule reads the same evidence; a hint outside them is no hint."""
    heard = {"zh": 0.6, "en": 0.3, "de": 0.1}
    choice = choose_language(heard, None, candidates=("de", "en"))
    assert (choice.language, choice.probability) == ("en", pytest.approx(0.75))
    assert choose_language(heard, "zh", candidates=("de", "en")).language == "en"
    kept = choose_language(heard, "de", candidates=("de", "en"))
    assert (kept.language, kept.switch_language) == ("de", "en")
    assert kept.switch_nats == pytest.approx(math.log(3))
    assert choose_language(heard, "de", candidates=("de", "fr")).language == "de"
    assert choose_language(heard, "de", candidates=("fr",)).language == "de", "none it knows"
    # All of them underflowed: equally likely among themselves.
    none = choose_language({"zh": 1.0, "en": 0.0, "de": 0.0}, None, candidates=("en", "de"))
    assert (none.language, none.probability) == ("en", 0.5)


def test_the_evidence_for_a_switch_adds_up_over_consecutive_utterances_only() -> None:
    """A Spanish session: an utterance heard as Portuguese at 0.72 (Spanish 0.14) is decoded in
    Spanish; one heard as Spanish clears the evidence, so the next unsure one is Spanish again;
    two unsure ones in a row switch the session to Portuguese. A short utterance between them,
    too short to be detected, is no evidence either way."""
    # The fifth is the short one: its first second, heard as unsure, decides nothing.
    heard = [{"es": 0.9, "pt": 0.05}, UNSURE_PT, {"es": 0.8, "pt": 0.1}] + [UNSURE_PT] * 3
    # Each utterance's detections (an unsure one is detected again on more audio), by its start.
    detections: dict[int, list[EngineRequest]] = {}

    def decode(request: EngineRequest) -> EngineResult:
        result = fake_decoder()(request)
        if request.language is not None:
            return dataclasses.replace(result, language=request.language)
        start = request.end_sample - (len(request.audio) - request.detect_from_sample)
        detections.setdefault(start, []).append(request)
        choice = request_language(request, heard[len(detections) - 1])
        return dataclasses.replace(
            result,
            language=choice.language,
            language_probability=choice.probability,
            switch_language=choice.switch_language,
            switch_nats=choice.switch_nats,
        )

    driver = Driver(decode, params=StreamParams(language="auto"), stream=NO_CONTEXT)
    for i in range(len(heard) - 1):
        driver.send(tone(4.0))
        driver.send(silence(1.0))
        if i == 3:
            driver.send(tone(0.8))  # decoded in the session's language, not detected
            driver.send(silence(1.0))
    driver.control(Control.END)
    languages = [f.language for f in driver.of(Final) if f.text]
    assert languages == ["es", "es", "es", "es", "es", "pt"]
    carried = [{r.switch_language for r in requests} for requests in detections.values()]
    # The first unsure one's evidence is cleared by the Spanish one after it; the second's
    # reaches the short one (whose 1-s detection decides nothing) and, past it, the last.
    assert carried == [{None}, {None}, {"pt"}, {None}, {"pt"}, {"pt"}]


def test_a_session_taken_back_after_a_restart_goes_on_in_its_language() -> None:
    """With ?language=auto, the journal's last caption's language is the next utterance's hint
    (the server passes it as the origin's language), as it would have been without the restart."""
    decoder, seen = detecting_decoder(["de"])
    origin = StreamOrigin(start_sample=0, first_segment=3, earlier_text="Guten Tag.", language="de")
    driver = Driver(decoder, params=StreamParams(language="auto"), origin=origin)
    driver.send(tone(2.0))
    driver.send(silence(1.0))
    driver.control(Control.END)
    assert {r.language_hint for r in seen if r.language is None} == {"de"}


def saying(partials: list[str], whole: str) -> Decoder:
    """A decoder that says `partials` in turn, then `whole`, as an engine answers: the text
    after the request's forced prefix, and whether it began with a space."""

    def decode(request: EngineRequest) -> EngineResult:
        said = partials.pop(0) if partials and request.kind is DecodeKind.PARTIAL else whole
        assert said.startswith(request.prefix), (request.prefix, said)
        new = said[len(request.prefix) :]
        text = new.strip()
        probs = (0.9,) * len(units(text))
        return EngineResult(text=text, unit_probs=probs, spaced=begins_with_space(new))

    return decode


def test_the_rest_of_a_hyphenated_word_joins_the_last_stable_word() -> None:
    """Stable "Yes, time", and the next decode, forced with it, goes on with "-wise," (no space
    before it): the partials and the final write "time-wise,", not "time -wise,", and the
    words after it still become stable."""
    whole = "Yes, time-wise, it should be after two."
    partials = [
        "Yes, time is",
        "Yes, time is up",
        "Yes, time-wise, it",
        "Yes, time-wise, it should",
    ]
    driver = Driver(saying(partials, whole), stream=NO_CONTEXT)
    driver.send(np.concatenate([silence(0.5), tone(3.0), silence(1.0)]))
    driver.control(Control.END)
    shown = [p.stable + p.separator + p.unstable for p in driver.of(Partial)]
    assert shown[2:4] == ["Yes, time-wise, it", "Yes, time-wise, it should"]
    assert driver.of(Partial)[3].stable == "Yes, time-wise,"
    assert driver.of(Partial)[-1].stable.startswith("Yes, time-wise, it should")
    assert driver.of(Final)[0].text == whole


def test_a_thai_tone_mark_stays_with_its_character_through_stable_text() -> None:
    """Whisper's tokens split "ค่ะ" into "ค", "่", "ะ": a partial may end at "ค่" and the next
    decode, forced with it, go on with "ะ". Units are whole characters with their marks, so
    the stable text never ends between "ค" and "่", and a decode that goes on with a mark is
    text, not punctuation to leave out: the final keeps "ค่ะ" (polite), not "คะ" (a question)."""
    whole = "สวัสดีค่ะ ยินดีที่ได้รู้จัก"
    decode = saying(["สวัสดีค่", "สวัสดีค่ะ ยิน"], whole)
    driver = Driver(decode, params=StreamParams(language="th"), stream=NO_CONTEXT)
    driver.send(np.concatenate([silence(0.5), tone(3.0), silence(1.0)]))
    driver.control(Control.END)
    assert not any(p.stable.endswith("ค") for p in driver.of(Partial))
    assert driver.of(Final)[0].text == whole


@pytest.mark.parametrize(
    ("language", "partials", "whole", "stable", "between"),
    [
        # Latin written onto Chinese: no space, though Latin words have them.
        ("zh", ["我用Python", "我用Python写代"], "我用Python写代码。", "我用", ""),
        # A Thai phrase after another: the space that parts them.
        ("th", ["สวัสดีครับ ผ", "สวัสดีครับ ผมชื่อ"], "สวัสดีครับ ผมชื่อสมชาย", "สวัสดีครับ", " "),
    ],
)
def test_a_partials_separator_is_the_texts_own(
    language: str, partials: list[str], whole: str, stable: str, between: str
) -> None:
    """What a partial's `separator` puts between `stable` and `unstable` is what the decode had
    there, so the two read as the final will: "我用" "" "Python写代", "สวัสดีครับ" " " "ผมชื่อ"."""
    said = [*partials, whole]
    driver = Driver(saying(partials, whole), params=StreamParams(language=language))
    driver.send(np.concatenate([silence(0.5), tone(3.0), silence(1.0)]))
    driver.control(Control.END)
    shown = driver.of(Partial)
    assert all(p.stable + p.separator + p.unstable in said for p in shown if p.unstable)
    assert any(p.stable == stable and p.separator == between for p in shown)
    assert driver.of(Final)[0].text == whole
