"""A final's words: each text unit of the final's text with its time and confidence, taken from
the word timings of the decode the final came from (engines/timing.py).

A final's text is its stable words as they were shown, then the decode's words after them
(stabilize.keep_stable), so its units are matched to the decode's by their plain spelling
(lang.text.plain_unit). A unit the decode wrote gets that word's times and confidence; where
the final's units replace a run of the decode's (the stable words won over a different
decode), each of them gets the run's span and the run's mean confidence; a unit with no
counterpart in the decode at all (rare: a stable word the final decode left out) gets a zero
length at its place and `confidence` None. Nothing is spread evenly and nothing is made up.
Times are stream milliseconds, in order, inside the final's span.

A final's first word may start before the utterance the VAD found: the decode's window begins
at earlier committed audio (streaming/context.py), and speech the VAD left out of every
utterance (a soft start, or an utterance whose own decode the speech gate dropped) is heard
there. Where that first word starts after the previous final's end, it keeps its measured time
and the final's span starts with it; a word measured before the previous final's end is the
previous final's audio heard again, and the final starts where the VAD says, as do the words
that are clamped to it.

Pure functions, called by StreamSession on the thread that feeds it (the event loop's).
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from dataclasses import dataclass

from captiond.engines.base import WordTiming
from captiond.lang.text import plain_unit, units
from captiond.samples import samples_to_ms
from captiond.streaming.events import Word
from captiond.whisper import SAMPLE_RATE_HZ


@dataclass(frozen=True, slots=True)
class _Timed:
    plain: str
    start_ms: int
    end_ms: int
    confidence: float


def final_words(
    text: str,
    decoded: Sequence[WordTiming],
    *,
    window_start_sample: int,
    floor_ms: int,
    start_ms: int,
    end_ms: int,
) -> tuple[int, tuple[Word, ...]]:
    """The final's start and the words of its `text`, from the decode's `decoded` words, whose
    times count from `window_start_sample` (the decode's audio's first sample). `start_ms` to
    `end_ms`: the utterance the VAD found; `floor_ms`: the previous final's end. The words are
    empty when the decode has no word timings (an engine without them, or a decode the speech
    gate answered)."""
    final_units = units(text)
    if not final_units or not decoded:
        return start_ms, ()
    timed: list[_Timed] = []
    for word in decoded:
        start = samples_to_ms(window_start_sample + round(word.start_s * SAMPLE_RATE_HZ))
        end = samples_to_ms(window_start_sample + round(word.end_s * SAMPLE_RATE_HZ))
        # A word of several units (Chinese characters Whisper wrote as one word) gives each of
        # them its own span: where within it each is, the alignment does not say.
        for unit in units(word.word):
            timed.append(_Timed(plain_unit(unit), start, end, word.probability))
    matcher = difflib.SequenceMatcher(
        None, [plain_unit(u) for u in final_units], [t.plain for t in timed], autojunk=False
    )
    spans: list[tuple[int, int, float | None]] = []
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag == "equal" or (tag == "replace" and i2 - i1 == j2 - j1):
            spans += [(t.start_ms, t.end_ms, t.confidence) for t in timed[j1:j2]]
        elif tag == "replace":
            run = timed[j1:j2]
            mean = sum(t.confidence for t in run) / len(run)
            spans += [(run[0].start_ms, run[-1].end_ms, mean)] * (i2 - i1)
        elif tag == "delete":  # final units the decode did not write
            at = spans[-1][1] if spans else timed[j1].start_ms if j1 < len(timed) else end_ms
            spans += [(at, at, None)] * (i2 - i1)
        # "insert": words the decode wrote that the final does not have.
    first_ms = spans[0][0]
    start_ms = first_ms if floor_ms <= first_ms < start_ms else start_ms
    words: list[Word] = []
    floor = start_ms
    for unit, (start, end, sure) in zip(final_units, spans, strict=True):
        start = min(max(start, floor), end_ms)
        end = min(max(end, start), end_ms)
        floor = start
        # Four decimals: the probability's precision that means anything, and a short frame.
        confidence = None if sure is None else round(sure, 4)
        words.append(Word(word=unit, start_ms=start, end_ms=end, confidence=confidence))
    return start_ms, tuple(words)
