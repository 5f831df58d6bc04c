"""engines/timing.py: words from token start frames and probabilities."""

from __future__ import annotations

import pytest

from captiond.engines.timing import START_LEAD_S, TOKENS_PER_S, words_of

# A toy tokenizer: token ids index this vocabulary; a token with a leading space starts a word.
_VOCAB = [" Hello", ",", " wor", "ld", ".", " So", ' "', "yes", '"', " um"]


def split(tokens: list[int]) -> tuple[list[str], list[list[int]]]:
    texts: list[str] = []
    groups: list[list[int]] = []
    for token in tokens:
        piece = _VOCAB[token]
        if piece.startswith(" ") or not groups or piece in {",", ".", '"'}:
            texts.append(piece)
            groups.append([token])
        else:
            texts[-1] += piece
            groups[-1].append(token)
    return texts, groups


def frames(*seconds: float) -> list[int]:
    return [round(s * TOKENS_PER_S) for s in seconds]


def test_words_join_tokens_and_punctuation_and_lead_every_time() -> None:
    # " Hello" "," " wor" "ld" ".": Hello at 1.0, the comma at 1.3, world at 1.4-1.8, the stop.
    words = words_of(
        [0, 1, 2, 3, 4],
        frames(1.0, 1.3, 1.4, 1.6, 1.8),
        frames(1.9)[0],
        [0.9, 0.8, 0.6, 0.4, 1.0],
        split,
        window_s=30.0,
    )
    assert [w.word for w in words] == [" Hello,", " world."]
    assert words[0].start_s == pytest.approx(1.0 - START_LEAD_S)
    assert words[0].end_s == pytest.approx(1.4 - START_LEAD_S)  # the comma's end
    assert words[1].end_s == pytest.approx(1.9 - START_LEAD_S)
    # A word's confidence: the mean probability of its tokens, punctuation included.
    assert words[0].probability == pytest.approx(0.85)
    assert words[1].probability == pytest.approx((0.6 + 0.4 + 1.0) / 3)


def test_a_forced_prefix_is_aligned_but_not_returned() -> None:
    words = words_of(
        [5, 0, 1], frames(0.5, 1.0, 1.2), frames(1.5)[0], [0.5, 0.9, 0.9], split,
        first_token=1, window_s=30.0,
    )  # fmt: skip
    assert [w.word for w in words] == [" Hello,"]


def test_opening_punctuation_joins_the_next_word() -> None:
    words = words_of(
        [6, 7, 8], frames(2.0, 2.1, 2.4), frames(2.5)[0], [1.0, 1.0, 1.0], split, window_s=30.0
    )
    assert [w.word for w in words] == [' "yes"']
    assert words[0].start_s == pytest.approx(2.0 - START_LEAD_S)


def test_a_first_word_that_absorbed_the_silence_before_it_is_cut() -> None:
    """ " So" aligned from 0.0 to 2.0 s (it took the pause before the speech): its start is cut
    to twice the median word before its end."""
    words = words_of(
        [5, 0, 2, 3, 9],
        frames(0.0, 2.0, 2.3, 2.5, 2.6),
        frames(2.9)[0],
        [1.0] * 5,
        split,
        window_s=30.0,
    )
    so = words[0]
    assert so.word == " So"
    assert so.end_s == pytest.approx(2.0 - START_LEAD_S)
    assert so.end_s - so.start_s == pytest.approx(0.6)  # 2 x the median of 0.3 s


def test_times_stay_inside_the_window() -> None:
    words = words_of([0], frames(0.02), frames(0.5)[0], [1.0], split, window_s=0.3)
    assert words[0].start_s == 0.0  # not led before the window's start
    assert words[0].end_s == 0.3  # nor past its end


def test_no_tokens_no_words() -> None:
    assert words_of([5], frames(0.5), 30, [1.0], split, first_token=1, window_s=30.0) == ()
