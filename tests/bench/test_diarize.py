"""The diarization bench's scoring (bench/diarize.py), on scripted finals: no models."""

from __future__ import annotations

from captiond.bench.diarize import cp_word_errors, reference_labels
from captiond.streaming.events import Final, Word


def _final(*words: tuple[str, int, int]) -> Final:
    return Final(
        segment=1,
        start_ms=words[0][1],
        end_ms=words[-1][2],
        text=" ".join(w for w, _, _ in words),
        words=tuple(Word(word=w, start_ms=a, end_ms=b, confidence=0.9) for w, a, b in words),
        speaker=0,
    )


def test_cpwer_matches_speakers_by_their_text_and_counts_a_moved_word_twice() -> None:
    reference = {"A": "hello there", "B": "good morning"}
    assert cp_word_errors(reference, {"0": "good morning", "1": "hello there"}).errors == 0
    moved = cp_word_errors(reference, {"0": "good morning there", "1": "hello"})
    assert (moved.deletions, moved.insertions, moved.substitutions) == (1, 1, 0)


def test_reference_labels_give_each_word_the_speaker_over_most_of_it() -> None:
    turns = [(0.0, 1.0, "A"), (1.0, 2.0, "B")]
    final = _final(("hello", 100, 600), ("there", 900, 1_300), ("friend", 2_600, 2_900))
    # "there" is mostly in B's turn; "friend" is in no turn and goes to the nearest, B's.
    assert reference_labels(turns, [final]) == {"A": "hello", "B": "there friend"}
