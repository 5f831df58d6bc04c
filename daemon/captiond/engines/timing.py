"""Word timings from Whisper's alignment heads, the same rules for both engines.

Each engine runs the alignment itself: faster-whisper through CTranslate2's `align` (the
cross-attention of the model's alignment heads, median-filtered, then dynamic time warping),
torch_graph through its own pass over the same heads, on its device (torch_graph/align.py).
Both give, for every token of the decode, the 20-ms encoder frame at which it starts and its
probability under the decode's own text. This module turns that into words: split where
Whisper's tokenizer splits words (`split_words`; the DTW path's token starts: `path_starts`),
punctuation joined to its word as faster-whisper joins it, a word's confidence the mean
probability of its tokens (faster-whisper's `word.probability`), a word longer than twice the
median word (at most 1.4 s) cut where it borders silence, and every time moved earlier by
`START_LEAD_S`, the constant by which the alignment is late (measured, below).

Pure functions, called on the engine thread.
"""

from __future__ import annotations

import string
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from captiond.engines.base import WordTiming

# The encoder's frames: 1,500 for 30 s of audio.
TOKENS_PER_S = 50
# Whisper's alignment puts a word's start late by a near constant: tiny.en's DTW starts against
# the Montreal Forced Aligner's reference alignments of its two test recordings (91 words) were
# 80 ms late at the median (docs/measurements/word-timings.md). Every time is moved earlier by
# this much, never before the window's start.
START_LEAD_S = 0.08
# faster-whisper's find_alignment: the alignment heads' weights are median-filtered over this
# many frames.
MEDIAN_FILTER_WIDTH = 7
# Written without spaces between words: a word is every run of tokens that decodes to whole
# characters (faster-whisper's split_to_word_tokens).
UNSPACED_LANGUAGES = frozenset({"zh", "ja", "th", "lo", "my", "yue"})
# faster-whisper's defaults (transcribe's prepend_punctuations and append_punctuations).
PREPEND_PUNCTUATION = "\"'“¿([{-"
APPEND_PUNCTUATION = "\"'.。,，!！?？:：”)]}、"  # noqa: RUF001
# A word may last at most this many times the median word of its decode, and the median is
# taken as at most MAX_MEDIAN_S (faster-whisper's rule for words that absorb a pause).
_LONG_WORD_FACTOR = 2.0
_MAX_MEDIAN_S = 0.7
_SENTENCE_END = ".。!！?？"  # noqa: RUF001


@dataclass(slots=True)
class _Word:
    text: str
    start_s: float
    end_s: float
    probs: list[float]


def words_of(
    tokens: Sequence[int],
    token_start_frames: Sequence[int],
    end_frame: int,
    token_probs: Sequence[float],
    split: Callable[[list[int]], tuple[list[str], list[list[int]]]],
    *,
    first_token: int = 0,
    window_s: float,
) -> tuple[WordTiming, ...]:
    """The words of `tokens[first_token:]` (the decode's own text after a forced prefix), with
    times in seconds from the window's start.

    `token_start_frames[i]`: the encoder frame at which token i starts (the alignment's jump),
    `end_frame`: where the last token ends (its <|endoftext|>'s jump), `token_probs[i]`: token
    i's probability. `split` is the tokenizer's `split_to_word_tokens` (without <|endoftext|>).
    `window_s`: the window's audio, which no time passes."""
    own = list(tokens[first_token:])
    if not own:
        return ()
    starts = [*token_start_frames[first_token : len(tokens)], end_frame]
    probs = [float(p) for p in token_probs[first_token : len(tokens)]]
    texts, groups = split(own)
    words: list[_Word] = []
    at = 0
    for text, group in zip(texts, groups, strict=True):
        n = len(group)
        if n:
            start_s, end_s = starts[at] / TOKENS_PER_S, starts[at + n] / TOKENS_PER_S
            words.append(_Word(text, start_s, end_s, probs[at : at + n]))
            at += n
    words = _merge_punctuation(words)
    _cut_long_words(words)
    return tuple(
        WordTiming(
            word=w.text,
            start_s=_led(w.start_s, window_s),
            end_s=_led(w.end_s, window_s),
            probability=float(np.mean(w.probs)) if w.probs else 0.0,
        )
        for w in words
        if w.text.strip()
    )


def _led(time_s: float, window_s: float) -> float:
    return min(max(0.0, time_s - START_LEAD_S), window_s)


def _merge_punctuation(words: list[_Word]) -> list[_Word]:
    """Opening punctuation joins the word after it, closing punctuation the word before it
    (faster-whisper's merge_punctuations): "Hello" "," is one word, "Hello,", which ends where
    the comma ends, and whose confidence counts both tokens."""
    out: list[_Word] = []
    pending: _Word | None = None
    for word in words:
        if pending is not None:
            word = _Word(
                pending.text + word.text, pending.start_s, word.end_s, [*pending.probs, *word.probs]
            )
            pending = None
        stripped = word.text.strip()
        if out and stripped and all(c in APPEND_PUNCTUATION for c in stripped):
            before = out[-1]
            before.text += word.text
            before.end_s = word.end_s
            before.probs += word.probs
        elif stripped and all(c in PREPEND_PUNCTUATION for c in stripped):
            pending = word
        else:
            out.append(word)
    if pending is not None:
        out.append(pending)
    return out


def _cut_long_words(words: list[_Word]) -> None:
    """A word much longer than its decode's median absorbed a pause beside it: after a
    sentence's end (or as the first word, after the silence before the speech) its start is
    cut, at a sentence's end its end (faster-whisper's rule)."""
    durations = np.array([w.end_s - w.start_s for w in words])
    durations = durations[durations > 0]
    if not len(durations):
        return
    longest_s = min(_MAX_MEDIAN_S, float(np.median(durations))) * _LONG_WORD_FACTOR
    for i, word in enumerate(words):
        if word.end_s - word.start_s <= longest_s:
            continue
        if i == 0 or words[i - 1].text.strip()[-1:] in _SENTENCE_END:
            word.start_s = word.end_s - longest_s
        elif word.text.strip()[-1:] in _SENTENCE_END:
            word.end_s = word.start_s + longest_s


def split_words(
    decode: Callable[[list[int]], str], tokens: Sequence[int], language: str
) -> tuple[list[str], list[list[int]]]:
    """Text tokens split into words, as Whisper's tokenizer splits them (faster-whisper's
    `split_to_word_tokens`, which the faster-whisper engine uses): runs of tokens that decode
    to whole characters, then, but in `UNSPACED_LANGUAGES`, a run that neither starts with a
    space nor is punctuation joins the word before it. `decode`: text tokens to text."""
    whole = decode(list(tokens))
    texts: list[str] = []
    groups: list[list[int]] = []
    run: list[int] = []
    offset = 0
    for token in tokens:
        run.append(token)
        text = decode(run)
        broken = text.find("\ufffd")
        # A replacement character the whole text has too is the text's own, not a cut.
        if broken < 0 or (offset + broken < len(whole) and whole[offset + broken] == "\ufffd"):
            texts.append(text)
            groups.append(run)
            run = []
            offset += len(text)
    if language in UNSPACED_LANGUAGES:
        return texts, groups
    words: list[str] = []
    word_groups: list[list[int]] = []
    for text, group in zip(texts, groups, strict=True):
        # `in string.punctuation` as faster-whisper tests it: a substring ("" included).
        if not words or text.startswith(" ") or text.strip() in string.punctuation:
            words.append(text)
            word_groups.append(group)
        else:
            words[-1] += text
            word_groups[-1].extend(group)
    return words, word_groups


def path_starts(trace: npt.NDArray[np.int8], rows: int, frames: int) -> list[int] | None:
    """Where the dynamic-time-warping path over a [rows, frames] cost matrix first reaches
    each row (a token's start frame), walked back from (rows, frames) through `trace`
    ([rows + 1, frames + 1]: 0 diagonal, 1 up, 2 left, as CTranslate2's negative_dtw), or None
    when the path runs out of frames before it reaches every row."""
    starts = [-1] * rows
    i, j = rows, frames
    while i > 0 and j > 0:
        starts[i - 1] = j - 1
        step = trace[i, j]
        if step == 0:
            i, j = i - 1, j - 1
        elif step == 1:
            i -= 1
        else:
            j -= 1
    return None if i > 0 else starts
