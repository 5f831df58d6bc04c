"""Who said what (streaming/speakers.py): windows over voiced stretches, the online tracker, a
final split at a speaker change, and the whole-recording reference clustering."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from captiond.lang.text import join_units, units
from captiond.streaming.events import Final, Speech, Word
from captiond.streaming.speakers import (
    HOP_MS,
    LIVE_CHANGE_WINDOWS,
    MIN_WINDOW_MS,
    WINDOW_MS,
    SpeakerTracker,
    by_speaker,
    live_change,
    offline_labels,
    speaker_windows,
    speech_in,
)

MS = 16  # samples per millisecond


def _voice(seed: int, dims: int = 32) -> np.ndarray:
    vector = np.random.default_rng(seed).normal(size=dims)
    return vector / np.linalg.norm(vector)


def _windows_of(voice: np.ndarray, n: int, noise: float = 0.3, seed: int = 0) -> np.ndarray:
    """`n` window embeddings of one voice: the voice plus noise, unit length."""
    rng = np.random.default_rng(seed)
    out = voice + noise * rng.normal(size=(n, len(voice))) / np.sqrt(len(voice))
    return (out / np.linalg.norm(out, axis=1, keepdims=True)).astype(np.float32)


@given(st.lists(st.tuples(st.integers(0, 200_000), st.integers(1, 400_000)), max_size=6))
def test_windows_lie_inside_the_voiced_stretches_in_order(
    raw: list[tuple[int, int]],
) -> None:
    """Stretches as the VAD keeps them: in order, apart (gaps and lengths drawn)."""
    stretches, at = [], 0
    for gap, length in raw:
        stretches.append((at + gap, at + gap + length))
        at += gap + length + 1
    windows = speaker_windows(stretches)
    assert list(windows) == sorted(windows)
    for start, end in windows:
        assert any(a <= start < end <= b for a, b in stretches)
        assert end - start <= WINDOW_MS * MS
    long_enough = [(a, b) for a, b in stretches if b - a >= MIN_WINDOW_MS * MS]
    if long_enough:
        # Every long-enough stretch is covered to its end.
        for a, b in long_enough:
            assert any(end == b for start, end in windows if a <= start)
    elif stretches:
        assert len(windows) == 1  # the longest short stretch stands for the utterance


def test_a_long_stretch_gets_windows_every_hop() -> None:
    windows = speaker_windows([(0, 5_000 * MS)])
    starts = [start for start, _ in windows]
    assert starts[:-1] == list(range(0, starts[-2] + 1, HOP_MS * MS))
    assert windows[-1][1] == 5_000 * MS


@given(st.integers(0, 20_000), st.integers(1, 8_000))
def test_a_growing_stretchs_windows_stay_where_they_are(start_ms: int, length_ms: int) -> None:
    """While the utterance goes on, only whole windows on the stretch's grid: each stays a
    window of the final's set however much longer the stretch grows."""
    stretch = (start_ms * MS, (start_ms + length_ms) * MS)
    growing = speaker_windows([stretch], growing=True)
    assert all(end - start == WINDOW_MS * MS for start, end in growing)
    longer = (stretch[0], stretch[1] + 3_000 * MS)
    assert set(growing) <= set(speaker_windows([longer], growing=True))
    assert set(growing) <= set(speaker_windows([longer]))


def test_a_new_voice_is_found_once_enough_of_it_is_in() -> None:
    a, b = _voice(1), _voice(2)
    before = _windows_of(a, 3, seed=1)
    assert live_change(before) is None
    for n in range(1, LIVE_CHANGE_WINDOWS):
        assert live_change(np.concatenate([before, _windows_of(b, n, seed=2)])) is None
    both = np.concatenate([before, _windows_of(b, LIVE_CHANGE_WINDOWS, seed=2)])
    assert live_change(both) == 3


def test_a_change_is_cut_live_only_between_voices_the_tracker_tells_apart() -> None:
    a, b = _voice(1), _voice(2)
    tracker = SpeakerTracker()
    tracker.label(_windows_of(a, 4, seed=1))
    assert tracker.tells_apart(_windows_of(a, 2, seed=2), _windows_of(b, 2, seed=3))
    wobble = np.stack([_unit(a + 0.6 * _voice(9)) for _ in range(2)])
    assert not tracker.tells_apart(_windows_of(a, 2, seed=2), wobble)
    assert tracker.speakers == 1  # asking places nobody
    # Before anyone is known, any two runs are new voices.
    assert SpeakerTracker().tells_apart(_windows_of(a, 2, seed=2), _windows_of(a, 2, seed=4))


def test_two_voices_are_two_speakers_and_labels_never_change() -> None:
    a, b = _voice(1), _voice(2)
    tracker = SpeakerTracker()
    assert tracker.label(_windows_of(a, 4, seed=1)) == [0] * 4
    assert tracker.label(_windows_of(b, 4, seed=2)) == [1] * 4
    assert tracker.label(_windows_of(a, 3, seed=3)) == [0] * 3
    assert tracker.speakers == 2


def test_an_utterance_in_which_the_voice_changes_is_split_there() -> None:
    a, b, c = _voice(1), _voice(2), _voice(3)
    tracker = SpeakerTracker()
    tracker.label(_windows_of(a, 4, seed=1))
    both = np.concatenate([_windows_of(a, 3, seed=2), _windows_of(b, 3, seed=3)])
    assert tracker.label(both) == [0, 0, 0, 1, 1, 1]
    # Three people in one breath: two splits.
    three = np.concatenate([_windows_of(v, 3, seed=i) for i, v in enumerate((b, c, a))])
    assert tracker.label(three) == [1] * 3 + [2] * 3 + [0] * 3


def test_a_short_unlike_part_does_not_found_a_speaker_unless_unlike_everyone() -> None:
    a, b = _voice(1), _voice(2)
    tracker = SpeakerTracker()
    tracker.label(_windows_of(a, 4, seed=1))
    # One window of a voice fairly like a's (similarity ~0.35): the nearest known speaker.
    near = _unit(a + 0.9 * _voice(7))
    assert tracker.label([near]) == [0]
    assert tracker.speakers == 1
    # One window of a voice unlike any known one is a new speaker even so.
    assert tracker.label([b]) == [1]


def _unit(vector: np.ndarray) -> np.ndarray:
    return vector / np.linalg.norm(vector)


def test_a_known_voice_inside_another_speakers_part_is_its_own() -> None:
    """Two windows of A inside a run of B's: too few to move the part's mean away from B
    (`_split` does not cut), but each nearer A's centroid by more than KNOWN_VOICE_MARGIN, so
    they are A's; a single such window stays with its neighbours."""
    a, b = np.eye(8, dtype=np.float32)[:2]
    leaning_a = np.array([0.8, 0.6, 0, 0, 0, 0, 0, 0], dtype=np.float32)
    tracker = SpeakerTracker()
    assert tracker.label([a] * 3) == [0, 0, 0]
    assert tracker.label([b] * 3) == [1, 1, 1]
    assert tracker.label([b] * 4 + [leaning_a] * 2 + [b] * 2) == [1, 1, 1, 1, 0, 0, 1, 1]
    assert tracker.label([b] * 4 + [leaning_a] + [b] * 3) == [1] * 8


def test_max_speakers_bounds_the_speakers() -> None:
    tracker = SpeakerTracker(max_speakers=2)
    for seed in range(1, 5):
        tracker.label(_windows_of(_voice(seed), 4, seed=seed))
    assert tracker.speakers == 2


def _final(text: str, step_ms: int = 500) -> Final:
    words = tuple(
        Word(word=unit, start_ms=i * step_ms, end_ms=i * step_ms + 300, confidence=0.9)
        for i, unit in enumerate(units(text))
    )
    return Final(segment=4, start_ms=0, end_ms=len(words) * step_ms, text=text, words=words)


def test_a_final_with_two_speakers_becomes_two_finals_joining_back_to_its_text() -> None:
    final = _final("Are you there? Yes, I am.")
    spans = [(0, 1_500 * MS), (1_500 * MS, 3_000 * MS)]
    first, second = by_speaker(final, spans, [0, 1])
    assert (first.text, first.speaker, second.text, second.speaker) == (
        "Are you there?",
        0,
        "Yes, I am.",
        1,
    )
    assert join_units([*units(first.text), *units(second.text)]) == final.text
    assert all(w.speaker == part.speaker for part in (first, second) for w in part.words)
    assert first.start_ms == final.start_ms and second.end_ms == final.end_ms
    assert first.end_ms <= second.start_ms


def test_the_parts_meet_halfway_and_split_the_speech_there() -> None:
    """The pause between two speakers' words goes half to each, so speech there that has no
    word (an "uh") is still someone's; words whose times overlap keep their parts' spans."""
    final = dataclasses.replace(
        _final("Are you there? Yes, I am."),
        speech=(Speech(start_ms=100, end_ms=1_200), Speech(start_ms=1_300, end_ms=2_900)),
    )
    first, second = by_speaker(final, [(0, 1_500 * MS), (1_500 * MS, 3_000 * MS)], [0, 1])
    # "there?" ends at 1,300 ms and "Yes," starts at 1,500 ms.
    assert first.end_ms == second.start_ms == 1_400
    assert [(s.start_ms, s.end_ms) for s in first.speech] == [(100, 1_200), (1_300, 1_400)]
    assert [(s.start_ms, s.end_ms) for s in second.speech] == [(1_400, 2_900)]
    late = dataclasses.replace(
        final,
        words=tuple(
            dataclasses.replace(w, end_ms=1_600) if w.word.endswith("?") else w for w in final.words
        ),
    )
    first, second = by_speaker(late, [(0, 1_500 * MS), (1_500 * MS, 3_000 * MS)], [0, 1])
    assert (first.end_ms, second.start_ms) == (1_600, 1_500)


# Two windows whose middles (1,000 and 3,200 ms) put a change at 2,100 ms: between the 7th
# and 8th of words 300 ms apart.
_AT_2100_MS = [(0, 2_000 * MS), (2_400 * MS, 4_000 * MS)]


def test_a_change_moves_to_the_nearest_sentence_end() -> None:
    """The windows place a change only to within a hop; "month?" ends 600 ms before it."""
    final = _final("What is the best month? What do you think of it?", step_ms=300)
    first, second = by_speaker(final, _AT_2100_MS, [0, 1])
    assert (first.text, second.text) == ("What is the best month?", "What do you think of it?")
    assert (first.speaker, second.speaker) == (0, 1)
    # No sentence end near enough: the change stays where the windows put it.
    first, second = by_speaker(final, _AT_2100_MS, [0, 1], snap_ms=500)
    assert (first.text, second.text) == ("What is the best month? What do", "you think of it?")


def test_a_change_moves_only_to_a_sentence_end_between_its_words() -> None:
    """The utterance's end is no sentence end to move to: "to play." ends 600 ms after the
    change, but the voice there is the next speaker's, and its speech goes with it."""
    final = _final("We still have a lot of games to play.", step_ms=300)
    first, second = by_speaker(final, _AT_2100_MS, [0, 1])
    assert (first.text, second.text) == ("We still have a lot of games", "to play.")
    assert (first.speaker, second.speaker) == (0, 1)


def test_a_short_turn_between_two_others_keeps_its_words() -> None:
    """A sentence end 300 ms before the second change ("end.") is not taken: the middle
    speaker's "Yeah" would be left no word. A change stops short of the changes around it."""
    final = _final("That is the end. Yeah so we go on.", step_ms=300)
    spans = [(0, 1_800 * MS), (900 * MS, 1_800 * MS), (1_200 * MS, 2_400 * MS)]
    parts = by_speaker(final, spans, [0, 1, 2])
    assert [(p.text, p.speaker) for p in parts] == [
        ("That is the end.", 0),
        ("Yeah", 1),
        ("so we go on.", 2),
    ]


def test_speech_in_crops_the_stretches_to_the_span() -> None:
    assert speech_in([(0, 400), (500, 900), (1_000, 1_100)], 300, 1_000) == (
        Speech(start_ms=300, end_ms=400),
        Speech(start_ms=500, end_ms=900),
    )


def test_one_speaker_keeps_the_final_whole_and_no_windows_say_nobody() -> None:
    final = _final("Just me here.")
    (whole,) = by_speaker(final, [(0, 1_500 * MS)], [3])
    assert whole.text == final.text and whole.speaker == 3
    assert {w.speaker for w in whole.words} == {3}
    assert by_speaker(final, [], []) == [final]
    wordless = Final(segment=1, start_ms=0, end_ms=900, text="")
    (nobody,) = by_speaker(wordless, [(0, 900 * MS)], [2])
    assert nobody.speaker == 2


@pytest.mark.parametrize("voices", [2, 3, 4])
def test_the_offline_reference_finds_the_voices(voices: int) -> None:
    rng = np.random.default_rng(voices)
    truth = rng.integers(0, voices, size=60)
    truth[:voices] = range(voices)
    embeddings = np.concatenate(
        [_windows_of(_voice(int(v) + 10), 1, seed=i) for i, v in enumerate(truth)]
    )
    labels = offline_labels(embeddings, threshold=0.4)
    assert len(set(labels.tolist())) == voices
    assert labels.tolist() == truth.tolist()  # numbered in order of first appearance
