"""A session's message flow: speech_started, partials, finals, done, in order."""

from __future__ import annotations

from session_harness import Driver, s16, silence, tone, two_utterances

from captiond.engines.base import DecodeKind
from captiond.streaming.events import (
    Control,
    Done,
    Final,
    Partial,
    SpeechStarted,
    SpeechStopped,
    StreamParams,
)
from captiond.streaming.session import SessionState


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
        assert all(final.start_ms <= w.start_ms <= w.end_ms <= final.end_ms for w in final.words)
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
