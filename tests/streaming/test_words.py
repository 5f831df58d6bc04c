"""streaming/words.py: a final's words from its decode's word timings."""

from __future__ import annotations

from itertools import pairwise

from hypothesis import given, settings
from hypothesis import strategies as st

from captiond.engines.base import WordTiming
from captiond.lang.text import join_units
from captiond.streaming.words import final_words
from captiond.whisper import SAMPLE_RATE_HZ

_VOCAB = ("the", "cat", "sat", "on", "a", "mat", "today.", "Hello,", "码", "字。")


def timed(words: list[str], starts_s: list[float], length_s: float = 0.2) -> list[WordTiming]:
    return [
        WordTiming(word=f" {w}", start_s=s, end_s=s + length_s, probability=0.5 + 0.01 * i)
        for i, (w, s) in enumerate(zip(words, starts_s, strict=True))
    ]


def test_words_take_the_decode_s_times_in_stream_milliseconds() -> None:
    decoded = timed(["the", "cat", "sat."], [0.5, 0.8, 1.1])
    start_ms, words = final_words(
        "the cat sat.",
        decoded,
        window_start_sample=SAMPLE_RATE_HZ * 10,  # the window began 10 s into the stream
        floor_ms=0,
        start_ms=10_400,
        end_ms=12_000,
    )
    assert start_ms == 10_400
    assert [(w.word, w.start_ms, w.end_ms) for w in words] == [
        ("the", 10_500, 10_700),
        ("cat", 10_800, 11_000),
        ("sat.", 11_100, 11_300),
    ]
    assert [w.confidence for w in words] == [0.5, 0.51, 0.52]  # rounded to 4 decimals


def test_a_stable_word_the_decode_left_out_gets_no_length_and_no_confidence() -> None:
    _, words = final_words(
        "the black cat",
        timed(["the", "cat"], [0.5, 0.9]),
        window_start_sample=0,
        floor_ms=0,
        start_ms=400,
        end_ms=2_000,
    )
    assert [(w.word, w.start_ms, w.end_ms, w.confidence) for w in words] == [
        ("the", 500, 700, 0.5),
        ("black", 700, 700, None),
        ("cat", 900, 1_100, 0.51),
    ]


def test_a_replaced_run_shares_its_span_and_mean_confidence() -> None:
    """The stable words won over a different decode: "ice cream" for the decode's "I scream"
    of three units ("I", "scream", "now") → two units over the run's span."""
    _, words = final_words(
        "ice cream",
        timed(["I", "scream", "now"], [0.0, 0.3, 0.6]),
        window_start_sample=0,
        floor_ms=0,
        start_ms=0,
        end_ms=1_000,
    )
    assert [(w.start_ms, w.end_ms) for w in words] == [(0, 800), (0, 800)]
    assert all(abs((w.confidence or 0) - 0.51) < 1e-9 for w in words)


def test_speech_before_the_vad_start_moves_the_final_s_start_back() -> None:
    """Words heard in the window's audio before the utterance (speech the VAD left out) keep
    their times, and the final starts with them; not before the previous final's end."""
    decoded = timed(["the", "recording"], [10.55, 10.9])
    start_ms, words = final_words(
        "the recording",
        decoded,
        window_start_sample=0,
        floor_ms=9_090,
        start_ms=13_200,
        end_ms=17_000,
    )
    assert start_ms == 10_550 and words[0].start_ms == 10_550
    # The same words measured before the previous final's end are its audio heard again: the
    # final starts at the VAD's start and its words are clamped there.
    start_ms, words = final_words(
        "the recording",
        decoded,
        window_start_sample=0,
        floor_ms=12_000,
        start_ms=13_200,
        end_ms=17_000,
    )
    assert start_ms == 13_200
    assert [(w.start_ms, w.end_ms) for w in words] == [(13_200, 13_200), (13_200, 13_200)]


def test_no_timings_no_words() -> None:
    assert final_words(
        "the cat", (), window_start_sample=0, floor_ms=0, start_ms=100, end_ms=900
    ) == (100, ())


@settings(max_examples=200, deadline=None)
@given(
    final=st.lists(st.sampled_from(_VOCAB), min_size=1, max_size=12),
    decoded=st.lists(
        st.tuples(
            st.sampled_from(_VOCAB),
            st.floats(0.0, 30.0, allow_nan=False),
            st.floats(0.0, 2.0, allow_nan=False),
            st.floats(0.0, 1.0, allow_nan=False),
        ),
        min_size=1,
        max_size=12,
    ),
    window_start_ms=st.integers(0, 60_000),
    offsets_ms=st.tuples(st.integers(0, 5_000), st.integers(0, 5_000), st.integers(1, 30_000)),
)
def test_words_are_in_order_inside_the_span_and_join_to_the_text(
    final: list[str],
    decoded: list[tuple[str, float, float, float]],
    window_start_ms: int,
    offsets_ms: tuple[int, int, int],
) -> None:
    """Whatever the decode's times (out of order, overlapping, outside the utterance), a final's
    words are monotonic, inside its span, no earlier than the previous final's end, and their
    units join back to its text."""
    text = join_units(final)
    floor_ms = window_start_ms + offsets_ms[0]
    start_ms = floor_ms + offsets_ms[1]
    end_ms = start_ms + offsets_ms[2]
    timings = sorted(
        (WordTiming(f" {w}", s, s + d, p) for w, s, d, p in decoded), key=lambda t: t.start_s
    )
    span_start_ms, words = final_words(
        text,
        timings,
        window_start_sample=window_start_ms * SAMPLE_RATE_HZ // 1000,
        floor_ms=floor_ms,
        start_ms=start_ms,
        end_ms=end_ms,
    )
    assert floor_ms <= span_start_ms <= start_ms
    assert join_units([w.word for w in words]) == text
    assert all(span_start_ms <= w.start_ms <= w.end_ms <= end_ms for w in words)
    assert all(a.start_ms <= b.start_ms for a, b in pairwise(words))
    assert all(w.confidence is None or 0.0 <= w.confidence <= 1.0 for w in words)
