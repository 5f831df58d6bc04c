"""bench/words.py: scoring word times against a reference alignment."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from captiond.bench.words import TimedWord, matched_start_errors_ms, reference_words, score


def words(*entries: tuple[str, float]) -> list[TimedWord]:
    return [TimedWord(w, s, s + 100.0, 0.9) for w, s in entries]


def test_only_words_matched_along_the_alignment_are_scored() -> None:
    reference = words(("uh", 0), ("so", 500), ("this", 800), ("is", 1_000))
    hypothesis = words(("so", 300), ("this", 850), ("was", 1_000))  # "uh" dropped, "is" wrong
    assert matched_start_errors_ms(reference, hypothesis) == [-200.0, 50.0]


def test_score_gives_the_median_p95_and_share_within_200_ms() -> None:
    reference = words(*((f"w{i}", i * 1_000.0) for i in range(10)))
    hypothesis = words(*((f"w{i}", i * 1_000.0 + (300 if i == 9 else 20)) for i in range(10)))
    result = score(reference, hypothesis)
    assert result["matched"] == 10
    assert result["median_abs_start_error_ms"] == 20
    assert result["within_200_ms"] == 0.9
    assert result["median_start_error_ms"] == 20
    assert result["mean_confidence"] == pytest.approx(0.9)
    assert score(reference, []) == {"reference_words": 10, "matched": 0}


def test_reference_words_are_plain_and_in_milliseconds(tmp_path: Path) -> None:
    path = tmp_path / "clip.words.json"
    path.write_text(
        json.dumps(
            [{"word": "Hello,", "start": 0.5, "end": 0.9}, {"word": "", "start": 1, "end": 1}]
        )
    )
    assert reference_words(path) == [TimedWord("hello", 500.0, 900.0)]
