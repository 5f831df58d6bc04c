"""A diarized session's speakers while the utterance is still going on (streaming/session.py,
streaming/speakers.py): with `[stream] cut_at_speaker_change` partials embed each whole window
once, a change of voice cuts the utterance there so that the first speaker's final comes before
the second stops, and the final reuses the partials' embeddings; without it, the final embeds
them all."""

from __future__ import annotations

import dataclasses
from collections import Counter

import numpy as np
import pytest
from session_harness import RATE, Decoder, Driver, fake_decoder, silence, tone

from captiond.config import StreamConfig, VadConfig
from captiond.engines.base import DecodeKind, EngineRequest, EngineResult
from captiond.streaming.events import Final, Partial, SpeechStopped, StreamParams
from captiond.streaming.speakers import WINDOW_MS

DIARIZED = StreamParams(diarize=True)
CUTS = StreamConfig(cut_at_speaker_change=True)
A = np.eye(8, dtype=np.float32)[0]
B = np.eye(8, dtype=np.float32)[1]
# A voice like A's (similarity 0.5): unlike enough for `_split`, too like A to be someone else.
A_WOBBLE = np.array([0.5, 0.0, 0.866, 0, 0, 0, 0, 0], dtype=np.float32)


def voices(change_s: float, after: np.ndarray = B) -> Decoder:
    """The fake engine's decodes, with each speaker window embedded as voice A when its middle
    is before `change_s` on the stream clock, else as `after`."""
    decode = fake_decoder()

    def answer(request: EngineRequest) -> EngineResult:
        result = decode(request)
        audio_start = request.end_sample - len(request.audio)
        vectors = [
            A if (audio_start + (start + end) / 2) / RATE < change_s else after
            for start, end in request.speaker_windows
        ]
        return dataclasses.replace(
            result, speaker_embeddings=tuple(tuple(float(x) for x in v) for v in vectors)
        )

    return answer


def embedded_spans(driver: Driver) -> list[tuple[int, int]]:
    return [span for request in driver.requests for span in request.embed_spans]


def test_a_change_of_voice_ends_the_first_speakers_final_before_the_second_stops() -> None:
    driver = Driver(voices(change_s=3.0), params=DIARIZED, stream=CUTS)
    driver.send(silence(0.5))
    driver.send(tone(5.0))  # A from 0.5 s to 3 s, B from 3 s on, without a pause
    (first,) = driver.of(Final)
    assert first.speaker == 0
    # Cut at the change, to within the hop of the windows that told it.
    assert abs(first.end_ms - 3_000) <= 750
    assert not driver.of(SpeechStopped)  # the speech did not stop there
    driver.send(tone(1.0))
    driver.send(silence(1.0))
    first_again, second = driver.of(Final)
    assert first_again is first
    assert second.speaker == 1 and second.segment == first.segment + 1
    assert second.start_ms == first.end_ms
    # Every window was embedded once: the finals reused what the partials embedded.
    spans = embedded_spans(driver)
    assert len(spans) == len(set(spans))
    partial_spans = [
        s for r in driver.requests if r.kind is DecodeKind.PARTIAL for s in r.embed_spans
    ]
    assert partial_spans, "the partials embed the windows as they fill"
    assert all(end - start == WINDOW_MS * RATE // 1000 for start, end in partial_spans)


def test_the_cut_utterances_final_is_decoded_afresh() -> None:
    """Its partials' stable words may be the second speaker's first: its final is not built on
    them (no stable words kept, no partial's words forced); the next utterance decodes them."""
    driver = Driver(voices(change_s=3.0), params=DIARIZED, stream=CUTS)
    driver.send(silence(0.5))
    driver.send(tone(5.0))
    assert any(p.stable for p in driver.of(Partial))
    (cut_final,) = [r for r in driver.requests if r.kind is DecodeKind.FINAL and r.utterance == 0]
    assert cut_final.stable_words == ()
    assert not cut_final.engine_request.prefix


def test_a_wobble_within_one_voice_does_not_cut() -> None:
    """Windows unlike the utterance's first ones, but like the same known speaker: one final."""
    driver = Driver(voices(change_s=5.5, after=A_WOBBLE), params=DIARIZED, stream=CUTS)
    driver.send(silence(0.5))
    driver.send(tone(2.0))
    driver.send(silence(1.0))  # A founded as a speaker
    driver.send(tone(5.0))  # A, then A's wobble from 5.5 s on
    driver.send(silence(1.0))
    assert [f.speaker for f in driver.of(Final)] == [0, 0]
    assert len(driver.of(SpeechStopped)) == 2


def test_without_partials_the_final_still_splits_at_the_change() -> None:
    driver = Driver(voices(change_s=3.0), params=DIARIZED, stream=CUTS, partials=False)
    driver.send(silence(0.5))
    driver.send(tone(5.0))
    assert not driver.of(Final)  # nothing embedded before the final: no cut
    driver.send(silence(1.0))
    assert [f.speaker for f in driver.of(Final)] == [0, 1]
    assert Counter(r.kind for r in driver.requests)[DecodeKind.FINAL] == 1


def test_without_the_cut_the_utterance_is_split_when_it_ends() -> None:
    """`[stream] cut_at_speaker_change = false` (the default): the partials embed the windows
    as they fill, the final embeds only the rest, each window once, and the first speaker's
    final waits for the utterance's end."""
    driver = Driver(voices(change_s=3.0), params=DIARIZED)
    driver.send(silence(0.5))
    driver.send(tone(5.0))
    assert not driver.of(Final)
    driver.send(silence(1.0))
    assert [f.speaker for f in driver.of(Final)] == [0, 1]
    spans = embedded_spans(driver)
    assert len(spans) == len(set(spans))
    partials = [r for r in driver.requests if r.kind is DecodeKind.PARTIAL]
    by_partials = [span for r in partials for span in r.embed_spans]
    (final,) = [r for r in driver.requests if r.kind is DecodeKind.FINAL]
    assert by_partials and len(final.embed_spans) < len(by_partials)


def test_a_stream_not_diarized_embeds_nothing() -> None:
    driver = Driver(voices(change_s=3.0))
    driver.send(silence(0.5))
    driver.send(tone(5.0))
    driver.send(silence(1.0))
    assert not embedded_spans(driver)
    assert [f.speaker for f in driver.of(Final)] == [None]
    (final,) = driver.of(Final)
    assert final.speech == () and "speech" not in final.to_dict()


def test_a_diarized_final_says_where_its_speaker_was_heard() -> None:
    """`speech`: the voiced stretches of each part's span, pauses left out; the parts of a
    final split at a change tile its span, so the speech is cut where they meet."""
    driver = Driver(voices(change_s=4.0), params=DIARIZED)
    driver.send(silence(0.5))
    driver.send(tone(1.5))
    driver.send(silence(0.45))  # a pause inside the utterance, longer than VOICED_GAP_MS
    driver.send(tone(4.0))  # A, then B from the window whose middle is past 4 s, no pause
    driver.send(silence(1.0))
    first, second = driver.of(Final)
    assert (first.speaker, second.speaker) == (0, 1)
    assert first.end_ms == second.start_ms
    for f in (first, second):
        assert f.speech and all(f.start_ms <= s.start_ms < s.end_ms <= f.end_ms for s in f.speech)
    (pause_start, pause_end), (change_a, change_b) = (
        (first.speech[0].end_ms, first.speech[1].start_ms),
        (first.speech[-1].end_ms, second.speech[0].start_ms),
    )
    # Heard from the first voiced frame (not the first word) to the last, to within a frame.
    assert abs(first.speech[0].start_ms - 500) <= 30 and abs(second.speech[-1].end_ms - 6_450) <= 30
    assert abs(pause_start - 2_000) <= 30 and abs(pause_end - 2_450) <= 30
    assert change_a == change_b == first.end_ms  # one stretch, cut where the parts meet
    assert first.to_dict()["speech"] == [
        {"start_ms": s.start_ms, "end_ms": s.end_ms} for s in first.speech
    ]


@pytest.mark.parametrize("end_of_turn", ["silence", "model"])
def test_a_speaker_change_is_a_turn_end(end_of_turn: str) -> None:
    """With turns ended by the model, the next speaker's decodes start without the first's
    text forced (its prompt instead), as after any turn the model ended."""
    driver = Driver(
        voices(change_s=3.0), params=DIARIZED, stream=CUTS, vad=VadConfig(end_of_turn=end_of_turn)
    )
    driver.send(silence(0.5))
    driver.send(tone(6.0))
    (first,) = driver.of(Final)
    after = [r.engine_request for r in driver.requests if r.utterance == 1]
    assert after
    if end_of_turn == "model":
        assert not any(first.text in r.prefix for r in after)
        assert all(first.text in r.prompt for r in after)
    else:
        assert all(r.prefix.startswith(first.text) for r in after)
