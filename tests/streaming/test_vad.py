"""VadSegmenter: hysteresis, pre-roll, endpointing, flush, the utterance cap and the RMS floor.

The first part scripts the per-frame VAD decision; the second runs the real webrtcvad on real
speech from the shared corpus.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from testkit import read_wav_int16, vad_spans

from captiond.config import StreamConfig, VadConfig
from captiond.samples import Pcm16, Samples
from captiond.streaming.audio import FRAME_SAMPLES, to_pcm16
from captiond.streaming.vad import (
    FRAME_MS,
    UtteranceEnd,
    UtteranceStart,
    VadEvent,
    VadSegmenter,
    levels_dbfs,
)

PREROLL = 300 * 16  # samples
WINDOW = 10  # frames in the 300 ms start window
ENDPOINT = 16  # 500 ms // 30 ms
TAIL = VadConfig().final_tail_ms // FRAME_MS  # frames of trailing silence a final decodes
FS = FRAME_SAMPLES


class ScriptedVad:
    """Answers `is_speech` from a script, one entry per call; False once the script runs out."""

    def __init__(self, script: Iterable[bool]) -> None:
        self._script = list(script)
        self.calls = 0

    def is_speech(self, buf: bytes, sample_rate: int) -> bool:
        assert sample_rate == 16_000
        assert len(buf) == 2 * FRAME_SAMPLES
        self.calls += 1
        return self._script.pop(0) if self._script else False


class AlwaysVoiced:
    """A VAD that calls everything speech: only the RMS floor stands in the way."""

    def __init__(self) -> None:
        self.calls = 0

    def is_speech(self, buf: bytes, sample_rate: int) -> bool:
        self.calls += 1
        return True


def level(frame: Samples) -> float:
    """One float frame's RMS level, as the segmenter sees it (16-bit PCM)."""
    (value,) = levels_dbfs(to_pcm16(frame))
    return value


def tone_frame(amplitude: float = 0.1) -> Pcm16:
    """A 500 Hz tone: exactly 15 periods per frame, so every frame has the same level."""
    t = np.arange(FRAME_SAMPLES) / 16_000
    return to_pcm16((amplitude * np.sin(2 * np.pi * 500.0 * t)).astype(np.float32))


def silent_frame() -> Pcm16:
    return np.zeros(FRAME_SAMPLES, dtype=np.int16)


def segmenter(vad: Any, vad_config: VadConfig | None = None, **stream: Any) -> VadSegmenter:
    return VadSegmenter(vad, vad_config or VadConfig(), StreamConfig(**stream))


def feed(seg: VadSegmenter, frames: Sequence[Pcm16]) -> list[tuple[int, VadEvent]]:
    """Push frames; return (frame index, event) pairs."""
    out: list[tuple[int, VadEvent]] = []
    for i, frame in enumerate(frames):
        out.extend((i, event) for event in seg.push(frame))
    return out


def test_tone_is_above_the_floor_and_silence_below() -> None:
    assert levels_dbfs(tone_frame())[0] > VadConfig().rms_floor_dbfs + 20
    assert levels_dbfs(silent_frame())[0] < VadConfig().rms_floor_dbfs


# -- start ------------------------------------------------------------------------------------


def test_start_needs_nine_of_ten_voiced_frames_and_includes_preroll() -> None:
    script = [False] * 20 + [True] * 12
    seg = segmenter(ScriptedVad(script))
    events = feed(seg, [tone_frame()] * len(script))
    # Frames 20..28 are the first nine voiced ones: the start fires at frame 28, whose window
    # began at frame 19; the utterance starts 300 ms before that.
    assert events == [
        (
            28,
            UtteranceStart(
                start_sample=19 * FRAME_SAMPLES - PREROLL,
                speech_start_sample=20 * FRAME_SAMPLES,
                lead_sample=0,
            ),
        )
    ]
    assert seg.in_utterance
    assert seg.utterance_start_sample == 19 * FRAME_SAMPLES - PREROLL


def test_a_halting_onset_starts_at_its_first_voiced_frame() -> None:
    # A quiet first word: voiced frames with gaps (frames 20..31) fill the window only at frame
    # 38 (window from frame 29). The window never emptied since frame 20, so the speech began
    # there, and the pre-roll is counted from there.
    halting = [True, True, True, False, False, True, True, False, False, True, False, True]
    script = [False] * 20 + halting + [True] * 12
    seg = segmenter(ScriptedVad(script))
    events = feed(seg, [tone_frame()] * len(script))
    assert events == [
        (
            38,
            UtteranceStart(
                start_sample=20 * FRAME_SAMPLES - PREROLL,
                speech_start_sample=20 * FRAME_SAMPLES,
                lead_sample=0,
            ),
        )
    ]


def test_an_onset_is_looked_for_at_most_a_second_before_the_window() -> None:
    # Voiced frames every third frame keep the window from emptying for 3 s; only the last
    # second before the window (33 frames) counts as the utterance's speech.
    script = [True, False, False] * 34 + [True] * 9
    seg = segmenter(ScriptedVad(script))
    events = feed(seg, [tone_frame()] * len(script))
    window_start = (len(script) - WINDOW) * FRAME_SAMPLES
    speech = window_start - 16_000
    assert events == [
        (
            len(script) - 1,
            UtteranceStart(
                start_sample=speech - PREROLL, speech_start_sample=speech, lead_sample=0
            ),
        )
    ]


def test_eight_of_ten_voiced_never_starts() -> None:
    script = ([True] * 8 + [False] * 2) * 10
    seg = segmenter(ScriptedVad(script))
    assert feed(seg, [tone_frame()] * len(script)) == []
    assert not seg.in_utterance


def test_start_at_stream_begin_is_clamped_to_zero() -> None:
    seg = segmenter(ScriptedVad([True] * 9))
    events = feed(seg, [tone_frame()] * 9)
    assert events == [(8, UtteranceStart(start_sample=0, speech_start_sample=0, lead_sample=0))]


def test_start_never_before_the_previous_end() -> None:
    script = [True] * 9 + [False] * ENDPOINT + [True] * 9
    seg = segmenter(ScriptedVad(script))
    events = feed(seg, [tone_frame()] * len(script))
    first_end = (9 + ENDPOINT) * FRAME_SAMPLES
    assert events == [
        (8, UtteranceStart(start_sample=0, speech_start_sample=0, lead_sample=0)),
        (8 + ENDPOINT, UtteranceEnd(end_sample=first_end, decode_end_sample=(9 + TAIL) * FS)),
        # The window + pre-roll would reach back before the first utterance's end.
        (
            8 + ENDPOINT + 9,
            UtteranceStart(
                start_sample=first_end, speech_start_sample=first_end, lead_sample=first_end
            ),
        ),
    ]


def test_the_lead_is_the_quiet_since_the_previous_end() -> None:
    # 2 s of quiet after the first endpoint: the second utterance starts with its pre-roll,
    # and its lead (where its decodes may start without context) at the first one's end.
    quiet = 67
    script = [True] * 9 + [False] * (ENDPOINT + quiet) + [True] * 9
    seg = segmenter(ScriptedVad(script))
    events = feed(seg, [tone_frame()] * len(script))
    first_end = (9 + ENDPOINT) * FRAME_SAMPLES
    speech = (9 + ENDPOINT + quiet) * FRAME_SAMPLES
    assert seg.lead_sample == first_end
    assert events[-1] == (
        len(script) - 1,
        # The start window began one frame before the speech (9 of 10 voiced).
        UtteranceStart(
            start_sample=speech - FRAME_SAMPLES - PREROLL,
            speech_start_sample=speech,
            lead_sample=first_end,
        ),
    )


# -- end --------------------------------------------------------------------------------------


def test_end_after_endpoint_silence() -> None:
    script = [True] * 30 + [False] * (ENDPOINT - 1) + [True] * 5 + [False] * ENDPOINT
    seg = segmenter(ScriptedVad(script))
    events = feed(seg, [tone_frame()] * len(script))
    # The first run of 15 unvoiced frames is one short of the endpoint; the second ends it.
    assert events == [
        (8, UtteranceStart(start_sample=0, speech_start_sample=0, lead_sample=0)),
        (
            len(script) - 1,
            UtteranceEnd(end_sample=len(script) * FS, decode_end_sample=(50 + TAIL) * FS),
        ),
    ]
    assert not seg.in_utterance


def test_a_long_utterance_ends_at_a_shorter_pause() -> None:
    # long_utterance_s 1.5 s (50 frames), long endpoint 240 ms (8 frames). The same 8-frame
    # pause does not end the utterance after 0.9 s (frames 30..37) and does after 1.8 s (frames
    # 60..67).
    pause = [False] * 8
    script = [True] * 30 + pause + [True] * 22 + pause + [True] * 5
    config = VadConfig(long_utterance_s=1.5, long_endpoint_silence_ms=240)
    seg = segmenter(ScriptedVad(script), config)
    events = feed(seg, [tone_frame()] * len(script))
    assert events == [
        (8, UtteranceStart(start_sample=0, speech_start_sample=0, lead_sample=0)),
        # The 240-ms endpoint is shorter than the tail: the final decodes all of it.
        (67, UtteranceEnd(end_sample=68 * FS, decode_end_sample=68 * FS)),
    ]


UNFINISHED = VadConfig().unfinished_endpoint_silence_ms // FRAME_MS  # 26 frames


def test_a_pause_waits_for_the_longer_endpoint_until_the_words_are_said_to_end_a_sentence() -> None:
    """With `waits_for_verdicts`, a pause ends the utterance at the endpoint only once the
    session said the words before it end a sentence (at the endpoint, or later: the utterance
    then ends where the endpoint fell); without a word from it, at the longer endpoint."""
    script = [True] * 20 + [False] * 40 + [True] * 20 + [False] * 40
    seg = segmenter(ScriptedVad(script))
    seg.waits_for_verdicts = True
    feed(seg, [tone_frame()] * (20 + TAIL))
    pause = seg.pause_sample
    assert pause == (20 + TAIL) * FS
    assert list(seg.turn_ended(pause + FS)) == []  # not this pause: nothing
    assert feed(seg, [tone_frame()] * (ENDPOINT + 2 - TAIL)) == []  # past the endpoint: held
    (end,) = seg.turn_ended(pause)  # the verdict comes: ended where the endpoint fell
    assert end == UtteranceEnd(end_sample=(20 + ENDPOINT) * FS, decode_end_sample=pause)
    feed(seg, [tone_frame()] * (40 - ENDPOINT - 2))
    # The second utterance: no verdict, so only the longer endpoint ends it.
    events = feed(seg, [tone_frame()] * 60)
    (_, start), (at, second_end) = events
    assert isinstance(start, UtteranceStart)
    assert at == 20 + UNFINISHED - 1
    assert second_end.end_sample == (80 + UNFINISHED) * FS


def test_a_verdict_before_the_endpoint_is_kept_until_the_speaker_goes_on() -> None:
    script = [True] * 20 + [False] * TAIL + [True] * 5 + [False] * 40
    seg = segmenter(ScriptedVad(script))
    seg.waits_for_verdicts = True
    feed(seg, [tone_frame()] * (20 + TAIL))
    assert list(seg.turn_ended((20 + TAIL) * FS)) == []  # before the endpoint: kept
    # The speaker goes on: the verdict was for the words before, and the next pause waits.
    events = feed(seg, [tone_frame()] * (5 + ENDPOINT))
    assert events == []
    (event,) = feed(seg, [tone_frame()] * (UNFINISHED - ENDPOINT))
    assert event[1].end_sample == (20 + TAIL + 5 + UNFINISHED) * FS
    seg = segmenter(ScriptedVad([True] * 20))  # the same, with no speech after the tail
    seg.waits_for_verdicts = True
    feed(seg, [tone_frame()] * (20 + TAIL))
    assert list(seg.turn_ended((20 + TAIL) * FS)) == []
    (event,) = feed(seg, [tone_frame()] * (ENDPOINT - TAIL))  # no speech: the endpoint ends it
    assert event[1].end_sample == (20 + ENDPOINT) * FS


def test_end_by_digital_silence() -> None:
    seg = segmenter(AlwaysVoiced())
    frames = [tone_frame()] * 20 + [silent_frame()] * ENDPOINT
    events = feed(seg, frames)
    assert events == [
        (8, UtteranceStart(start_sample=0, speech_start_sample=0, lead_sample=0)),
        (35, UtteranceEnd(end_sample=36 * FS, decode_end_sample=(20 + TAIL) * FS)),
    ]


def test_pause_sample_marks_the_final_tail_until_speech_resumes_or_the_endpoint() -> None:
    """The final's decode may start once the tail of silence is in: `pause_sample` is where it
    ends, the same sample the endpoint then reports; speech before the endpoint clears it."""
    seg = segmenter(ScriptedVad([True] * 20 + [False] * TAIL + [True] * 5 + [False] * ENDPOINT))
    feed(seg, [tone_frame()] * (20 + TAIL - 1))
    assert seg.pause_sample is None  # one frame short of the tail
    assert seg.silent_samples == (TAIL - 1) * FS
    feed(seg, [tone_frame()])
    assert seg.pause_sample == (20 + TAIL) * FS
    feed(seg, [tone_frame()])
    assert seg.pause_sample is None and seg.silent_samples == 0  # the speaker went on
    events = feed(seg, [tone_frame()] * (4 + ENDPOINT - 1))
    assert events == []
    pause = (20 + TAIL + 5 + TAIL) * FS
    assert seg.pause_sample == pause
    events = feed(seg, [tone_frame()])
    end = (20 + TAIL + 5 + ENDPOINT) * FS
    assert events == [(0, UtteranceEnd(end_sample=end, decode_end_sample=pause))]
    assert not seg.in_utterance and seg.pause_sample is None and seg.silent_samples == 0


def test_a_tail_as_long_as_the_endpoint_never_pauses() -> None:
    config = VadConfig(final_tail_ms=500)
    seg = segmenter(ScriptedVad([True] * 20 + [False] * ENDPOINT), config)
    for _ in range(20 + ENDPOINT - 1):
        feed(seg, [tone_frame()])
        assert seg.pause_sample is None
    events = feed(seg, [tone_frame()])
    assert events == [
        (0, UtteranceEnd(end_sample=(20 + ENDPOINT) * FS, decode_end_sample=(20 + ENDPOINT) * FS))
    ]


def test_flush_closes_an_open_utterance() -> None:
    seg = segmenter(ScriptedVad([True] * 20))
    feed(seg, [tone_frame()] * 20)
    assert seg.in_utterance
    end = 20 * FRAME_SAMPLES + 100
    assert list(seg.flush(end)) == [UtteranceEnd(end_sample=end, decode_end_sample=end)]
    assert not seg.in_utterance
    assert list(seg.flush(end + 1000)) == []


def test_push_to_talk_ends_an_utterance_only_at_flush() -> None:
    """With `ends_at_pauses` off no pause ends the utterance and no early final is due; the
    flush decodes up to the tail after its last voiced frame, not the silence after that."""
    talk = [True] * 20 + [False] * 3 * ENDPOINT + [True] * 10 + [False] * 2 * ENDPOINT
    seg = segmenter(ScriptedVad([*talk, *[True] * 20, *[False] * ENDPOINT]))
    seg.ends_at_pauses = False
    events = feed(seg, [tone_frame()] * len(talk))
    assert [type(event) for _, event in events] == [UtteranceStart]
    assert seg.in_utterance and seg.pause_sample is None
    end = (30 + 5 * ENDPOINT) * FS
    voiced_end = (30 + 3 * ENDPOINT) * FS
    assert list(seg.flush(end)) == [
        UtteranceEnd(end_sample=end, decode_end_sample=voiced_end + TAIL * FS)
    ]
    seg.ends_at_pauses = True  # back to pauses: the next utterance ends at one
    events = feed(seg, [tone_frame()] * (20 + ENDPOINT))
    assert [type(event) for _, event in events] == [UtteranceStart, UtteranceEnd]
    assert not seg.in_utterance


def test_flush_without_utterance_does_nothing() -> None:
    seg = segmenter(ScriptedVad([]))
    feed(seg, [tone_frame()] * 5)
    assert list(seg.flush(5 * FRAME_SAMPLES)) == []


def test_after_flush_a_new_start_needs_a_full_window_again() -> None:
    seg = segmenter(AlwaysVoiced())
    feed(seg, [tone_frame()] * 12)
    flush_end = 12 * FRAME_SAMPLES
    assert list(seg.flush(flush_end)) == [
        UtteranceEnd(end_sample=flush_end, decode_end_sample=flush_end)
    ]
    events = [e for frame in [tone_frame()] * 9 for e in seg.push(frame)]
    assert events == [
        UtteranceStart(start_sample=flush_end, speech_start_sample=flush_end, lead_sample=flush_end)
    ]


# -- cap --------------------------------------------------------------------------------------


def test_cap_cuts_at_the_quietest_recent_frame_and_reopens() -> None:
    # Cap 3 s (100 frames), cut search 1 s (33 frames). Speech from frame 0, so the utterance
    # starts at 0 and reaches the cap at frame 99; the search covers frames 67..99.
    n = 200
    frames = [tone_frame()] * n
    frames[30] = tone_frame(0.005)  # quietest overall, but outside the search window
    frames[80] = tone_frame(0.02)  # quietest inside it
    seg = segmenter(AlwaysVoiced(), max_utterance_s=3.0, cut_search_s=1.0)
    events = feed(seg, frames[:100])
    cut = 80 * FRAME_SAMPLES + FRAME_SAMPLES // 2
    assert events == [
        (8, UtteranceStart(start_sample=0, speech_start_sample=0, lead_sample=0)),
        # Marked as a cut, not a pause: the speech goes on.
        (99, UtteranceEnd(end_sample=cut, decode_end_sample=cut, cut=True)),
        (
            99,
            UtteranceStart(
                start_sample=cut, speech_start_sample=cut, lead_sample=cut, continues=True
            ),
        ),
    ]
    assert seg.utterance_start_sample == cut
    # The reopened utterance is capped again 3 s after the cut, at a frame after the cut.
    more = feed(seg, frames[100:])
    assert len(more) == 2
    (i, end), (j, start) = more
    assert i == j
    assert isinstance(end, UtteranceEnd) and isinstance(start, UtteranceStart)
    assert end.end_sample == start.start_sample
    assert cut < end.end_sample <= (100 + i + 1) * FRAME_SAMPLES
    assert (100 + i + 1) * FRAME_SAMPLES - cut >= 3 * 16_000


def test_a_speaker_change_cuts_at_the_quietest_frame_between_two_samples() -> None:
    frames = [tone_frame()] * 100
    frames[40] = tone_frame(0.01)  # quietest, but before the span the change is in
    frames[60] = tone_frame(0.02)  # quietest inside it
    frames[97:] = [silent_frame()] * 3  # a pause at the end, still going on
    seg = segmenter(AlwaysVoiced())
    seg.keeps_voiced = seg.keeps_levels = True
    feed(seg, frames)
    assert list(seg.cut(10 * FRAME_SAMPLES + 1, 12 * FRAME_SAMPLES - 1)) == []  # no whole frame
    at = 60 * FRAME_SAMPLES + FRAME_SAMPLES // 2
    assert list(seg.cut(50 * FRAME_SAMPLES, 70 * FRAME_SAMPLES)) == [
        UtteranceEnd(end_sample=at, decode_end_sample=at, cut=True),
        UtteranceStart(start_sample=at, speech_start_sample=at, lead_sample=at, continues=True),
    ]
    # The pause at the end goes on in the new utterance: it ends as the old one would have.
    assert seg.silent_samples == 3 * FRAME_SAMPLES
    ends = [e for _, e in feed(seg, [silent_frame()] * 30) if isinstance(e, UtteranceEnd)]
    (end,) = ends
    assert end.decode_end_sample == 97 * FRAME_SAMPLES + seg._tail_frames * FRAME_SAMPLES


def test_no_cut_without_an_open_utterance() -> None:
    seg = segmenter(AlwaysVoiced())
    seg.keeps_voiced = seg.keeps_levels = True
    assert list(seg.cut(0, 10 * FRAME_SAMPLES)) == []


def test_every_capped_utterance_fits_the_cap() -> None:
    seg = segmenter(AlwaysVoiced(), max_utterance_s=2.0, cut_search_s=0.5)
    rng = np.random.default_rng(0)
    frames = [tone_frame(float(a)) for a in rng.uniform(0.02, 0.2, size=400)]
    events = [e for _, e in feed(seg, frames)]
    events += list(seg.flush(400 * FRAME_SAMPLES))
    starts = [e.start_sample for e in events if isinstance(e, UtteranceStart)]
    ends = [e.end_sample for e in events if isinstance(e, UtteranceEnd)]
    assert len(starts) == len(ends) > 3
    for s, e in zip(starts, ends, strict=True):
        assert 0 < e - s <= 2 * 16_000
    # Consecutive: each cut reopens exactly where the previous one ended.
    assert starts[1:] == ends[:-1]


# -- RMS floor --------------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(
    runs=st.lists(st.tuples(st.booleans(), st.integers(min_value=1, max_value=40)), max_size=15),
    cuts=st.lists(st.integers(min_value=0, max_value=600), max_size=20),
)
def test_a_chunk_of_frames_segments_as_its_frames_one_by_one(
    runs: list[tuple[bool, int]], cuts: list[int]
) -> None:
    """The session pushes each chunk's whole frames at once: the same events as pushing them
    one at a time. Runs of voiced and unvoiced frames, so that utterances open, end and hit
    the cap; every eleventh frame is under the RMS floor."""
    script = [voiced for voiced, length in runs for _ in range(length)]
    frames = [
        tone_frame(0.0005 if i % 11 == 0 else 0.02 if i % 3 == 0 else 0.1)
        for i in range(len(script))
    ]
    one_by_one = segmenter(ScriptedVad(script), max_utterance_s=2.0, cut_search_s=0.5)
    expected = [event for _, event in feed(one_by_one, frames)]
    chunked = segmenter(ScriptedVad(script), max_utterance_s=2.0, cut_search_s=0.5)
    bounds = [0, *sorted(c for c in cuts if c <= len(frames)), len(frames)]
    events: list[VadEvent] = []
    for lo, hi in itertools.pairwise(bounds):
        block = np.concatenate(frames[lo:hi]) if hi > lo else np.zeros(0, np.int16)
        events.extend(chunked.push(block))
    assert events == expected


def test_a_push_of_part_of_a_frame_is_refused() -> None:
    with pytest.raises(ValueError, match="whole"):
        list(segmenter(AlwaysVoiced()).push(tone_frame()[:100]))


def test_digital_silence_never_starts_even_if_the_vad_says_voiced() -> None:
    vad = AlwaysVoiced()
    seg = segmenter(vad)
    assert feed(seg, [silent_frame()] * 100) == []
    assert list(seg.flush(100 * FRAME_SAMPLES)) == []
    # webrtcvad still sees every frame: its noise model adapts to the quiet ones too.
    assert vad.calls == 100


def test_hiss_below_the_floor_never_starts() -> None:
    rng = np.random.default_rng(1)
    quiet = [
        to_pcm16((1e-4 * rng.standard_normal(FRAME_SAMPLES)).astype(np.float32)) for _ in range(50)
    ]
    assert all(levels_dbfs(f)[0] < VadConfig().rms_floor_dbfs for f in quiet)
    assert feed(segmenter(AlwaysVoiced()), quiet) == []


def test_levels_dbfs_values() -> None:
    assert levels_dbfs(silent_frame()) == [-200.0]
    full = np.full(FRAME_SAMPLES, -32768, dtype=np.int16)
    assert levels_dbfs(full) == [0.0]
    assert level(np.full(FRAME_SAMPLES, 0.1, dtype=np.float32)) == pytest.approx(-20.0, abs=1e-3)
    two = np.concatenate([full, silent_frame()])
    assert levels_dbfs(two) == [0.0, -200.0]
    # One least significant bit is far below the floor, and not digital silence.
    assert levels_dbfs(np.ones(FRAME_SAMPLES, dtype=np.int16)) == pytest.approx([-90.3], abs=0.1)


# -- real webrtcvad on real speech -------------------------------------------------------------


def _clip(speech_dir: Path, manifest: list[dict[str, Any]], clip_id: str) -> Samples:
    entry = next((e for e in manifest if e["id"] == clip_id), None)
    if entry is None:
        pytest.skip(f"clip {clip_id!r} not in the speech manifest")
    samples: Samples = read_wav_int16(speech_dir / entry["file"]).astype(np.float32) / 32768.0
    return samples


def test_webrtcvad_finds_the_speech_of_an_utterance(
    speech_dir: Path, speech_manifest: list[dict[str, Any]]
) -> None:
    speech = _clip(speech_dir, speech_manifest, "ljspeech_LJ001-0001")
    lead, tail = 16_000, 24_000
    samples = np.concatenate([np.zeros(lead, np.float32), speech, np.zeros(tail, np.float32)])
    spans = vad_spans(samples)
    assert len(spans) >= 1
    covered = np.zeros(len(samples), dtype=bool)
    for s, e in spans:
        assert 0 <= s < e <= len(samples)
        covered[s:e] = True
    # Frames with real sound in them (well above the floor) are mostly inside utterances.
    loud = [
        i
        for i in range(0, len(samples) - FRAME_SAMPLES + 1, FRAME_SAMPLES)
        if level(samples[i : i + FRAME_SAMPLES]) > -40.0
    ]
    assert len(loud) > 100
    inside = sum(covered[i : i + FRAME_SAMPLES].all() for i in loud)
    assert inside >= 0.9 * len(loud)
    # Leading and trailing digital silence are mostly left out (pre-roll and endpoint aside).
    assert spans[0][0] >= lead - 2 * PREROLL
    assert spans[-1][1] <= len(samples) - tail // 2


def test_webrtcvad_ignores_digital_silence(
    speech_dir: Path, speech_manifest: list[dict[str, Any]]
) -> None:
    samples = _clip(speech_dir, speech_manifest, "silence_digital_30s")
    assert len(samples) >= 16_000
    assert vad_spans(samples) == []


def test_webrtcvad_keeps_the_first_words_after_a_quiet_lead_in(
    speech_multi_dir: Path, speech_multi_manifest: list[dict[str, Any]]
) -> None:
    """A Common Voice clip: 1.2 s of near-silence (below the floor), then Turkish speech.

    When webrtcvad was asked only about frames above the floor, it adapted to the first speech
    as its noise and the utterance began 0.36 s after the speech did.
    """
    samples = _clip(speech_multi_dir, speech_multi_manifest, "tr_cv_18756242")
    first_speech = next(
        i
        for i in range(0, len(samples) - FRAME_SAMPLES + 1, FRAME_SAMPLES)
        if level(samples[i : i + FRAME_SAMPLES]) > -45.0
    )
    assert 1.0 * 16_000 < first_speech < 1.3 * 16_000
    spans = vad_spans(samples)
    assert len(spans) == 1
    assert spans[0][0] <= first_speech - PREROLL // 2


def test_a_quiet_first_word_is_kept(
    speech_multi_dir: Path, speech_multi_manifest: list[dict[str, Any]]
) -> None:
    """A Common Voice clip whose first word ("Türkiye", from 0.69 s) is voiced with gaps and
    frames under the floor: the start window fills only at 1.38 s. The utterance began at
    0.78 s, after the word's start, and the decode lost it; it now starts a pre-roll before
    the word's first voiced frame.
    """
    samples = _clip(speech_multi_dir, speech_multi_manifest, "tr_cv_18756243")
    spans = vad_spans(samples)
    assert len(spans) == 1
    first_word_sample = round(0.69 * 16_000)
    assert spans[0][0] <= first_word_sample - PREROLL // 2
