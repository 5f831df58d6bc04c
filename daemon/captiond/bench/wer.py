"""Word error rate with Whisper's English normaliser, and for other languages Whisper's basic
normaliser, by characters for scripts without spaces (pure functions, any thread)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from typing import Any

# Scored by characters: their words are not separated by spaces.
CHARACTER_LANGUAGES = frozenset({"zh", "ja", "ko", "th", "lo", "my", "km"})


@cache
def _basic_normalizer() -> Any:
    from whisper_normalizer.basic import BasicTextNormalizer

    return BasicTextNormalizer()


@cache
def _normalizer() -> Any:
    from whisper_normalizer.english import EnglishTextNormalizer

    return EnglishTextNormalizer()


def normalize(text: str) -> list[str]:
    """Whisper's English normalisation, split into words."""
    words: list[str] = _normalizer()(text).split()
    return words


@dataclass(frozen=True, slots=True, kw_only=True)
class WerCounts:
    substitutions: int
    deletions: int
    insertions: int
    reference_words: int

    @property
    def errors(self) -> int:
        return self.substitutions + self.deletions + self.insertions

    @property
    def wer(self) -> float:
        if self.reference_words == 0:
            return 0.0 if self.errors == 0 else float("inf")
        return self.errors / self.reference_words

    def __add__(self, other: WerCounts) -> WerCounts:
        return WerCounts(
            substitutions=self.substitutions + other.substitutions,
            deletions=self.deletions + other.deletions,
            insertions=self.insertions + other.insertions,
            reference_words=self.reference_words + other.reference_words,
        )


NO_ERRORS = WerCounts(substitutions=0, deletions=0, insertions=0, reference_words=0)


def align(reference: list[str], hypothesis: list[str]) -> WerCounts:
    """Levenshtein alignment over words; ties prefer substitutions (as jiwer/sclite do)."""
    # Each cell: (cost, substitutions, deletions, insertions) of the best path so far.
    prev = [(j, 0, 0, j) for j in range(len(hypothesis) + 1)]
    for i, ref_word in enumerate(reference, start=1):
        row = [(i, 0, i, 0)]
        for j, hyp_word in enumerate(hypothesis, start=1):
            c, s, d, n = prev[j - 1]
            diag = (c, s, d, n) if ref_word == hyp_word else (c + 1, s + 1, d, n)
            c, s, d, n = prev[j]
            up = (c + 1, s, d + 1, n)
            c, s, d, n = row[j - 1]
            left = (c + 1, s, d, n + 1)
            row.append(min(diag, up, left, key=lambda cell: cell[0]))
        prev = row
    _, s, d, n = prev[-1]
    return WerCounts(substitutions=s, deletions=d, insertions=n, reference_words=len(reference))


def word_errors(reference: str, hypothesis: str) -> WerCounts:
    """Align normalised texts."""
    return align(normalize(reference), normalize(hypothesis))


def language_errors(reference: str, hypothesis: str, language: str) -> WerCounts:
    """WER for `language` (English: Whisper's English normaliser; others: its basic one), or
    CER for languages written without spaces (Korean too: Whisper's own evaluations do)."""
    if language == "en":
        return word_errors(reference, hypothesis)
    ref, hyp = _basic_normalizer()(reference), _basic_normalizer()(hypothesis)
    if language in CHARACTER_LANGUAGES:
        return align(list("".join(ref.split())), list("".join(hyp.split())))
    return align(ref.split(), hyp.split())


def gap_interval_points(
    pairs: list[tuple[WerCounts, WerCounts]], *, resamples: int = 10_000, seed: int = 0
) -> tuple[float, float]:
    """A 95 % paired-bootstrap interval of the pooled error-rate gap (first minus second, in
    points) over clips: clips drawn with replacement, each with both its counts. A group of a
    few short clips moves by whole words, and the interval says how much of a gap the clips
    drawn could make alone. Seeded, so a run reports the same interval for the same counts."""
    import numpy as np

    if not pairs:
        return 0.0, 0.0
    errors = np.array([[a.errors, b.errors, a.reference_words] for a, b in pairs], dtype=float)
    draws = np.random.default_rng(seed).integers(0, len(pairs), size=(resamples, len(pairs)))
    sums = errors[draws].sum(axis=1)  # (resamples, 3)
    gaps = 100 * (sums[:, 0] - sums[:, 1]) / np.maximum(sums[:, 2], 1)
    low, high = np.percentile(gaps, [2.5, 97.5])
    return round(float(low), 2), round(float(high), 2)
