"""LocalAgreement-2 over words (text units: characters in Chinese and Japanese, see lang/text.py):
which part of a partial hypothesis is stable.

Sans-I/O, one instance per open utterance, on the event-loop thread. Every partial decode of an
utterance starts at the utterance's first sample, so consecutive hypotheses share a prefix. A word
becomes stable once two consecutive hypotheses agree on it and on every word before it; stable
words are never retracted. The last `hold_back` words of the older hypothesis are held back: they
were decoded at the edge of the audio, where Whisper completes a cut-off word with a guess, and
two partials half a second apart can make the same guess. Stable words are forced into every
later decode of the segment, so a wrong one would stay wrong.
"""

from __future__ import annotations

import unicodedata
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

from captiond.lang.text import continuation, join_units, units, with_marks

# How far (in words) a final decode may shift a stable word and still be matched with it.
_ANCHOR_SHIFT_WORDS = 3
# The fewest characters that, beginning a longer word, stand for it (`_same_word`).
_WORD_START_CHARS = 4


@dataclass(frozen=True, slots=True, kw_only=True)
class Split:
    stable: tuple[str, ...]
    unstable: tuple[str, ...]


def _norm(word: str) -> str:
    """Words agree when they match up to case and surrounding punctuation of any script
    (a Chinese character with a full-width comma or stop after it, "¿Qué" and "qué", "«dit"
    and "dit")."""
    start, end = 0, len(word)
    while start < end and unicodedata.category(word[start]).startswith("P"):
        start += 1
    while end > start and unicodedata.category(word[end - 1]).startswith("P"):
        end -= 1
    return word[start:end].lower()


def _stem(word: str) -> str:
    return _norm(word).removesuffix("s")


class LocalAgreement:
    def __init__(self, hold_back: int = 1) -> None:
        self._hold_back = max(1, hold_back)
        self._committed: list[str] = []
        self._previous: list[str] = []

    @property
    def committed(self) -> tuple[str, ...]:
        return tuple(self._committed)

    @property
    def following(self) -> tuple[str, ...]:
        """The newest hypothesis's words after the committed ones (shown as unstable)."""
        return tuple(self._previous[len(self._committed) :])

    def update(self, hypothesis: str, sure: int | None = None) -> Split:
        """Take the newest hypothesis of the whole utterance and how many of its leading words
        the decoder was sure of (None: all); return its stable/unstable split."""
        words = units(hypothesis)
        # Punctuation the decode writes right after the last stable word, or more of a word it
        # joins to it with a hyphen, with words after it (the decoder heard on: not a guess at
        # the audio's edge), joins that word: stable text only grows, "so" + "," keeps the
        # comma that the final would lose, and "time" + "-wise," is neither dropped from the
        # partial nor a word that no later hypothesis agrees with.
        n = len(self._committed)
        if 0 < n < len(words) and (grown := continuation(self._committed[-1], words[n - 1])):
            self._committed[-1] = with_marks(self._committed[-1], grown)
        # Agreement of the two newest hypotheses beyond what is already committed.
        limit = min(len(self._previous) - self._hold_back, len(words))
        if sure is not None:
            limit = min(limit, sure)
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


def keep_stable(stable: Sequence[str], decoded: str, following: Sequence[str] = ()) -> str:
    """The final text that keeps the promise: the stable words as they were shown, then the
    words of the final decode that come after them.

    The final is decoded without the stable words forced (forcing partial-quality words into
    the decode that later decodes continue from spreads their errors), so where the decode
    disagrees with the stable words, the stable words win and the decode supplies the rest:
    stable "And so my fellow" and decode "And so am I fellow Americans." give
    "And so my fellow Americans.". `following`: the newest partial's words after the stable
    ones, which find where the decode goes on when it rewrote the stable text's last words.
    """
    words = units(decoded)
    if not stable:
        return join_units(words)
    # The last stable word that the decode has near where it is among the stable words (a
    # common word much later in the decode is no anchor) anchors the decode; stable words
    # after it stand for as many decode words (one for one). Searched near each stable word,
    # not by a longest common block: in Chinese every character is a unit, and a block's
    # "三" far along the decode ("…第三甲") hid the "年" two units from its place.
    first, anchored, after = -1, -1, 0
    for a in range(len(stable) - 1, -1, -1):
        near = _near(words, partial(_stands_for, stable[a]), a)
        if near is not None:
            first, after = a, near + 1
            anchored = a + _spelled(stable, a, words[near]) - 1
            break
    rest = after + len(stable) - 1 - anchored
    if anchored < len(stable) - 1 and following:
        # The decode rewrote the stable text's last words, maybe in more or fewer units
        # ("三十八" as "38", "thirty eight" as "38", "てんき" as "天気"): one for one would drop
        # or repeat the decode's next words. Where the decode has the word the newest partial
        # heard after the stable text, near where one for one puts it, it goes on from there.
        heard = _stem(following[0])
        resumed = _near(words, lambda word: _same_word(_stem(word), heard), rest, start=after)
        if resumed is not None:
            rest = resumed
    # What the decode writes after the word the last stable word stands for is kept: its
    # punctuation ("you." for "you"), so the final ends its sentence, or the rest of a word it
    # joined to it ("time-wise," for "time"), which one for one would write as a word of its own
    # ("time time-wise,"). The final still starts with exactly the stable text.
    shown = "".join(stable[first:]) if anchored == len(stable) - 1 else stable[-1]
    grown = continuation(shown, words[rest - 1]) if 0 < rest <= len(words) else ""
    return join_units([*stable[:-1], with_marks(stable[-1], grown), *words[rest:]])


def _stands_for(stable_word: str, decoded: str) -> bool:
    """Whether a decode's word is the stable word, matched loosely: up to case, punctuation and
    a plural s (a final that extends it, "fellows"), or continued by a hyphen ("time-wise")."""
    return _stem(decoded) == _stem(stable_word) or bool(continuation(stable_word, decoded))


def _spelled(stable: Sequence[str], a: int, decoded: str) -> int:
    """How many stable units, from `a` on, the decode's word spells: more than one where a
    partial wrote the rest of a word as a unit of its own, after a space ("time -wise," for
    "time-wise,"); one for one would make "-wise," stand for the decode's next word."""
    n, spelled = 1, stable[a]
    while a + n < len(stable) and _norm(decoded).startswith(_norm(spelled + stable[a + n])):
        n, spelled = n + 1, spelled + stable[a + n]
    return n


def _near(
    words: Sequence[str], matches: Callable[[str], bool], place: int, start: int = 0
) -> int | None:
    """The index of the word that `matches` closest to `place` (at most `_ANCHOR_SHIFT_WORDS`
    away, not before `start`), or None."""
    low = max(start, place - _ANCHOR_SHIFT_WORDS)
    high = min(len(words), place + _ANCHOR_SHIFT_WORDS + 1)
    found = [b for b in range(low, high) if matches(words[b])]
    return min(found, key=lambda b: abs(b - place)) if found else None


def _same_word(decoded: str, heard: str) -> bool:
    """Whether a final's word is the one a greedy partial wrote at the audio's edge: equal, or
    one of at least `_WORD_START_CHARS` characters begins the other (the partial's "nacque",
    the final's "nacquero")."""
    if decoded == heard:
        return True
    shorter, longer = sorted((decoded, heard), key=len)
    return len(shorter) >= _WORD_START_CHARS and longer.startswith(shorter)
