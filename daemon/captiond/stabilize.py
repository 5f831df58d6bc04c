"""LocalAgreement-2 over words: which part of a partial hypothesis is stable.

Sans-I/O, one instance per open utterance, on the event-loop thread. Every partial decode of an
utterance starts at the utterance's first sample, so consecutive hypotheses share a prefix. A word
becomes stable once two consecutive hypotheses agree on it and on every word before it; stable
words are never retracted. The last word of the older hypothesis is held back: it was decoded at
the edge of the audio, where Whisper often completes a cut-off word.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True, kw_only=True)
class Split:
    stable: tuple[str, ...]
    unstable: tuple[str, ...]


def _norm(word: str) -> str:
    """Words agree when they match up to case and surrounding punctuation."""
    return word.strip(".,!?;:\"'()[]-").lower()


class LocalAgreement:
    def __init__(self) -> None:
        self._committed: list[str] = []
        self._previous: list[str] = []

    @property
    def committed(self) -> tuple[str, ...]:
        return tuple(self._committed)

    def update(self, hypothesis: str) -> Split:
        """Take the newest hypothesis of the whole utterance; return its stable/unstable split."""
        words = hypothesis.split()
        # Agreement of the two newest hypotheses beyond what is already committed.
        limit = min(len(self._previous) - 1, len(words))
        agreed = len(self._committed)
        while agreed < limit and _norm(self._previous[agreed]) == _norm(words[agreed]):
            agreed += 1
        if agreed > len(self._committed) and self._matches_committed(words):
            self._committed.extend(words[len(self._committed) : agreed])
        self._previous = words
        # A hypothesis that disagrees inside the committed words still shows its newer words.
        return Split(stable=tuple(self._committed), unstable=tuple(words[len(self._committed) :]))

    def _matches_committed(self, words: list[str]) -> bool:
        n = len(self._committed)
        return len(words) >= n and all(
            _norm(a) == _norm(b) for a, b in zip(self._committed, words[:n], strict=True)
        )
