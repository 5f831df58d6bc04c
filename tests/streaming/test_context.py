"""Decode context (streaming/context.py), the prompt budget (engines.rules.fit_prompt), prompt
tokens (engines.rules.text_tokens) and unit probabilities (engines.rules.unit_probabilities, with a
token's other cases: engines.rules.case_variants, added up by both engines), without a model."""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import partial

import pytest
from hypothesis import given
from hypothesis import strategies as st

from captiond.engines.faster_whisper import token_probabilities
from captiond.engines.rules import (
    TEXT_TOKENS_CACHED,
    case_variants,
    fit_prompt,
    text_tokens,
    token_counter,
    unit_probabilities,
)
from captiond.lang.text import join_texts, units
from captiond.streaming.context import CommittedFinal, TranscriptContext, tail_words
from captiond.whisper import PROMPT_BUDGET_TOKENS, STREAM_PROMPT_MAX_TOKENS

RATE = 16_000
WINDOW = 30 * RATE


def final(start_s: float, end_s: float, text: str) -> CommittedFinal:
    return CommittedFinal(
        start_sample=round(start_s * RATE), end_sample=round(end_s * RATE), text=text
    )


def context(
    *finals: CommittedFinal, tokens: int = 300, prompt_chars: int = 200
) -> TranscriptContext:
    # A character a token: these tests are about which finals are kept, not the tokenizer.
    ctx = TranscriptContext(context_tokens=tokens, prompt_chars=prompt_chars, count_tokens=len)
    for f in finals:
        ctx.commit(f)
    return ctx


def test_first_utterance_has_no_context() -> None:
    got = context().for_decode(
        utterance_start=100, lead_sample=100, end_sample=900, window_samples=WINDOW
    )
    assert (got.start_sample, got.prefix, got.prompt) == (100, "", "")


def test_without_context_the_audio_starts_where_the_quiet_before_began() -> None:
    # After an empty final (noise) the context is broken: the utterance at 10 s is heard
    # together with the quiet since that final's end (8 s), not across the noise.
    ctx = context(final(0, 4, "Hello."), final(5, 8, ""))
    got = ctx.for_decode(
        utterance_start=10 * RATE, lead_sample=8 * RATE, end_sample=12 * RATE, window_samples=WINDOW
    )
    assert (got.start_sample, got.prefix, got.prompt) == (8 * RATE, "", "Hello.")
    # As far back as the window reaches, and never after the utterance's own start.
    for window_s, start_s in ((3, 9), (1, 10), (0, 10)):
        got = ctx.for_decode(
            utterance_start=10 * RATE,
            lead_sample=8 * RATE,
            end_sample=12 * RATE,
            window_samples=window_s * RATE,
        )
        assert got.start_sample == start_s * RATE


def test_window_starts_at_the_oldest_final_that_fits() -> None:
    ctx = context(final(0, 4, "Hello."), final(5, 7, "Hi, how are you?"), final(8, 9, "Fine."))
    # With finals as context, the quiet before the utterance (from 9 s) is inside the window.
    got = ctx.for_decode(
        utterance_start=10 * RATE,
        lead_sample=9 * RATE,
        end_sample=12 * RATE,
        window_samples=WINDOW,
    )
    assert got.start_sample == 0
    assert got.prefix == "Hello. Hi, how are you? Fine."
    assert got.prompt == ""


def test_alone_an_utterance_gets_neither_finals_nor_prompt() -> None:
    # A final that decoded to nothing after its context is decoded again as if it began the
    # stream: heard from the quiet before it (26 s), with no earlier text.
    ctx = context(final(0, 4, "Long ago."), final(20, 25, "Recent."))
    decode = partial(
        ctx.for_decode,
        utterance_start=30 * RATE,
        lead_sample=26 * RATE,
        end_sample=33 * RATE,
        window_samples=WINDOW,
    )
    for got, expected in (
        (decode(), (20 * RATE, "Recent.", "Long ago.")),
        (decode(alone=True), (26 * RATE, "", "")),
    ):
        assert (got.start_sample, got.prefix, got.prompt) == expected


def test_finals_beyond_the_window_move_to_the_prompt() -> None:
    ctx = context(final(0, 4, "Long ago."), final(20, 25, "Recent."))
    # The window [start, 33 s) may be 30 s long: the final at 0 s does not fit, 20 s does.
    got = ctx.for_decode(
        utterance_start=30 * RATE,
        lead_sample=30 * RATE,
        end_sample=33 * RATE,
        window_samples=WINDOW,
    )
    assert got.start_sample == 20 * RATE
    assert (got.prefix, got.prompt) == ("Recent.", "Long ago.")


def test_chinese_and_japanese_finals_are_joined_as_written() -> None:
    # No space between two sentences of a script without spaces: the forced prefix reads as
    # Whisper writes a Japanese conversation. A prompt cut inside such text keeps its tail.
    ctx = context(final(0, 2, "空は広いです。"), final(3, 5, "彼女は彼を見た。"), prompt_chars=5)
    got = ctx.for_decode(
        utterance_start=6 * RATE, lead_sample=6 * RATE, end_sample=8 * RATE, window_samples=WINDOW
    )
    assert got.prefix == "空は広いです。彼女は彼を見た。"
    got = ctx.for_decode(
        utterance_start=6 * RATE, lead_sample=6 * RATE, end_sample=8 * RATE, window_samples=0
    )
    assert got.prompt == "彼を見た。"
    assert tail_words("Tokyo 東京は大きい", 6) == "東京は大きい"


def test_context_is_limited_by_tokens_newest_first() -> None:
    ctx = context(final(0, 2, "a" * 10), final(2, 4, "b" * 10), final(4, 6, "c" * 10), tokens=23)
    got = ctx.for_decode(
        utterance_start=6 * RATE, lead_sample=6 * RATE, end_sample=8 * RATE, window_samples=WINDOW
    )
    assert got.prefix == f"{'b' * 10} {'c' * 10}"
    assert got.start_sample == 2 * RATE
    assert got.prompt == "a" * 10


def test_an_empty_final_breaks_the_context() -> None:
    ctx = context(final(0, 2, "Before."), final(2, 4, ""), final(4, 6, "After."))
    got = ctx.for_decode(
        utterance_start=6 * RATE, lead_sample=6 * RATE, end_sample=8 * RATE, window_samples=WINDOW
    )
    assert (got.start_sample, got.prefix, got.prompt) == (4 * RATE, "After.", "Before.")


def test_a_zero_window_decodes_alone_with_everything_in_the_prompt() -> None:
    ctx = context(final(0, 2, "One."), final(2, 4, "Two."))
    got = ctx.for_decode(
        utterance_start=4 * RATE, lead_sample=4 * RATE, end_sample=6 * RATE, window_samples=0
    )
    assert (got.start_sample, got.prefix, got.prompt) == (4 * RATE, "", "One. Two.")


def test_an_utterance_longer_than_the_window_gets_no_context() -> None:
    ctx = context(final(0, 2, "Before."))
    got = ctx.for_decode(
        utterance_start=3 * RATE, lead_sample=3 * RATE, end_sample=40 * RATE, window_samples=WINDOW
    )
    assert (got.start_sample, got.prefix, got.prompt) == (3 * RATE, "", "Before.")


def test_keep_from_forgets_finals_out_of_reach() -> None:
    ctx = context(final(0, 2, "Old."), final(25, 27, "New."))
    assert ctx.keep_from(28 * RATE, WINDOW) == 0
    assert ctx.keep_from(31 * RATE, WINDOW) == 25 * RATE
    got = ctx.for_decode(
        utterance_start=31 * RATE,
        lead_sample=31 * RATE,
        end_sample=32 * RATE,
        window_samples=WINDOW,
    )
    assert (got.prefix, got.prompt) == ("New.", "Old.")
    assert context().keep_from(5 * RATE, WINDOW) == 5 * RATE


def test_the_prompt_stays_bounded_over_a_long_session() -> None:
    ctx = TranscriptContext(context_tokens=300, prompt_chars=50, count_tokens=len)
    for i in range(500):
        ctx.commit(final(i * 2, i * 2 + 1, f"utterance{i}"))
        ctx.keep_from((i * 2 + 1) * RATE, WINDOW)
    got = ctx.for_decode(
        utterance_start=1001 * RATE,
        lead_sample=1001 * RATE,
        end_sample=1002 * RATE,
        window_samples=WINDOW,
    )
    assert got.prefix.split()[-1] == "utterance499"
    assert len(got.prompt) <= 50
    assert got.prompt.split()[-1] == f"utterance{499 - len(got.prefix.split())}"


@given(st.lists(st.text(alphabet="ab ", max_size=12), max_size=8), st.integers(0, 40))
def test_tail_words_is_a_whole_word_suffix(texts: list[str], limit: int) -> None:
    text = " ".join(texts)
    tail = tail_words(text, limit)
    assert len(tail) <= limit
    assert text.endswith(tail)
    if tail and len(tail) < len(text):
        assert text[len(text) - len(tail) - 1] == " "


# -- the prompt budget shared by the stream prompt, previous text and prefix ------------------


def test_a_prompt_that_would_overflow_keeps_its_newest_tokens() -> None:
    previous = list(range(1000, 1300))  # 300 tokens: more than the 223 Whisper keeps
    prefix = list(range(50))
    kept_previous, kept_prefix = fit_prompt([], previous, prefix)
    assert kept_prefix == prefix
    assert len(kept_previous) + len(kept_prefix) == PROMPT_BUDGET_TOKENS
    assert kept_previous == previous[-(PROMPT_BUDGET_TOKENS - 50) :]


def test_small_prompts_are_kept_whole() -> None:
    assert fit_prompt([], [1, 2, 3], [4, 5]) == ([1, 2, 3], [4, 5])
    assert fit_prompt([9], [1, 2, 3], [4, 5]) == ([9, 1, 2, 3], [4, 5])
    assert fit_prompt([], [], []) == ([], [])


def test_the_stream_prompt_keeps_its_start_within_half_the_budget_before_previous_text() -> None:
    stream = list(range(2000, 2300))  # 300 tokens of names: only the first half-budget stays
    previous = list(range(1000, 1300))
    prefix = list(range(50))
    kept, kept_prefix = fit_prompt(stream, previous, prefix)
    assert kept_prefix == prefix
    assert kept[:STREAM_PROMPT_MAX_TOKENS] == stream[:STREAM_PROMPT_MAX_TOKENS]
    rest = PROMPT_BUDGET_TOKENS - 50 - STREAM_PROMPT_MAX_TOKENS
    assert kept[STREAM_PROMPT_MAX_TOKENS:] == previous[-rest:]  # previous text: its newest part
    # The prefix comes first: it leaves the stream's prompt only what is left of the budget.
    kept, kept_prefix = fit_prompt(stream, previous, list(range(200)))
    assert kept == stream[: PROMPT_BUDGET_TOKENS - 200] and len(kept_prefix) == 200


def test_prompt_texts_are_tokenized_with_a_leading_space_once_while_they_repeat() -> None:
    encoded: list[str] = []

    def encode(text: str) -> list[int]:
        encoded.append(text)
        return [ord(c) for c in text]

    tokens = text_tokens(encode)
    assert tokens("  hi there ") == tuple(ord(c) for c in " hi there")
    assert tokens(" \n") == () and tokens("") == ()  # blank text has no tokens
    for _ in range(3):  # a stream's partials repeat their previous text
        assert tokens("  hi there ") == tuple(ord(c) for c in " hi there")
    assert encoded == [" hi there"]
    for k in range(TEXT_TOKENS_CACHED):  # older texts make way for newer ones
        tokens(f"text {k}")
    tokens("  hi there ")
    assert encoded[-1] == " hi there" and len(encoded) == TEXT_TOKENS_CACHED + 2


def test_a_prefix_over_the_budget_keeps_its_end_and_leaves_no_previous_text() -> None:
    prefix = list(range(400))
    kept_previous, kept_prefix = fit_prompt([5, 6], [7, 8], prefix)
    assert kept_previous == []
    assert kept_prefix == prefix[-PROMPT_BUDGET_TOKENS:]


def test_forced_words_take_their_share_of_the_prefix_budget() -> None:
    ctx = context(final(0, 2, "a" * 10), final(2, 4, "b" * 10), tokens=30)
    free = ctx.for_decode(
        utterance_start=4 * RATE, lead_sample=4 * RATE, end_sample=6 * RATE, window_samples=WINDOW
    )
    assert free.prefix == f"{'a' * 10} {'b' * 10}"
    squeezed = ctx.for_decode(
        utterance_start=4 * RATE,
        lead_sample=4 * RATE,
        end_sample=6 * RATE,
        window_samples=WINDOW,
        forced="x" * 15,
    )
    assert (squeezed.prefix, squeezed.prompt) == ("b" * 10, "a" * 10)


def test_unit_probabilities() -> None:
    """A word is as sure as its least likely token; punctuation does not count; in Japanese
    every character is a unit, and a token of two characters counts for both."""
    vocab = {1: " Hel", 2: "lo", 3: ",", 4: " world", 5: ".", 6: "日本", 7: "語"}

    def decode(tokens: Sequence[int]) -> str:
        return "".join(vocab[t] for t in tokens)

    assert unit_probabilities(decode, [1, 2, 3, 4, 5], [0.9, 0.5, 0.1, 0.8, 0.2]) == (0.5, 0.8)
    assert unit_probabilities(decode, [6, 7], [0.4, 0.9]) == (0.4, 0.4, 0.9)
    assert unit_probabilities(decode, [], []) == ()


# A vocabulary with the same text in several cases, and two tokens that are bytes of a
# character (each decodes alone to U+FFFD, but they are not the same text).
_CASED = [" printing", " Printing", "ing", " PRINTING", "\ufffd", "\ufffd", " Ελλάδα", " ελλάδα"]


def test_a_capitalized_tokens_variants_are_its_text_in_other_cases() -> None:
    """A lowercase token counts only itself: a stable word is shown as the partial chose it,
    and its lowercase first word would start the final lowercase."""
    assert case_variants(_CASED) == (
        (0,),
        (1, 0, 3),
        (2,),
        (3, 0, 1),
        (4,),
        (5,),
        (6, 7),
        (7,),
    )


def _logits_of(probs: Sequence[float]) -> list[float]:
    """Logits whose softmax is `probs` (which sum to 1)."""
    return [math.log(p) for p in probs]


def test_faster_whisper_counts_a_tokens_other_cases_in_its_probability() -> None:
    """Whisper unsure whether a word starts a sentence: " Printing" 0.5, " printing" 0.3."""
    probs = [0.3, 0.5, 0.05, 0.05, 0.04, 0.02, 0.02, 0.02]
    steps = [_logits_of(probs)] * 4
    got = token_probabilities(steps, [1, 0, 2, 4], case_variants(_CASED))
    assert got == pytest.approx([0.85, 0.3, 0.05, 0.04])
    # A special token (past the text tokens) is only itself.
    special = [_logits_of([*probs[:-1], 0.01, 0.01])]
    assert token_probabilities(special, [8], case_variants(_CASED)) == pytest.approx([0.01])


def test_torch_graph_adds_up_the_same_cases_on_the_device() -> None:
    """The decoder's choice keeps the token's own log-probability (avg_logprob, as
    faster-whisper's) and gives its text's up to case, as faster-whisper's engine does."""
    torch = pytest.importorskip("torch")
    from captiond.engines.torch_graph.decode import CaseVariants, _select

    probs = [0.3, 0.5, 0.05, 0.05, 0.04, 0.02, 0.02, 0.01, 0.01]
    logits = torch.tensor([_logits_of(probs)])
    variants = CaseVariants.build(case_variants(_CASED), len(probs), torch.device("cpu"))
    token, logprob, text_logprob = _select(logits, torch.zeros(len(probs)), variants)
    assert token.tolist() == [1]
    assert logprob.exp().tolist() == pytest.approx([0.5])
    assert text_logprob.exp().tolist() == pytest.approx([0.85])
    # Masked (suppressed) variants do not count; the chosen token's own mass always does.
    mask = torch.zeros(len(probs))
    mask[0] = float("-inf")
    _, logprob, text_logprob = _select(logits, mask, variants)
    assert logprob.exp().tolist() == pytest.approx([0.5 / 0.7])
    assert text_logprob.exp().tolist() == pytest.approx([0.55 / 0.7])
    # A lowercase choice is only itself.
    mask[1] = float("-inf")
    token, logprob, text_logprob = _select(logits, mask, variants)
    assert token.tolist() == [2] and text_logprob.tolist() == pytest.approx(logprob.tolist())


_PIECES = [" Hel", "lo", ",", " world", ".", "日本", "語", "。", " ", " 。", " 1", "2", "\ufffd"]


@given(
    st.lists(
        st.tuples(st.integers(min_value=0, max_value=len(_PIECES) - 1), st.floats(0.0, 1.0)),
        max_size=30,
    )
)
def test_unit_probabilities_equal_those_of_every_prefix(pairs: list[tuple[int, float]]) -> None:
    """Counting units word by word gives what counting the units of every prefix gives."""
    tokens, token_probs = [t for t, _ in pairs], [p for _, p in pairs]

    def decode(ids: Sequence[int]) -> str:
        return "".join(_PIECES[t] for t in ids)

    expected: list[float] = []
    for end, p in enumerate(token_probs, start=1):
        sure = p if any(ch.isalnum() for ch in decode(tokens[end - 1 : end])) else 1.0
        n = len(units(decode(tokens[:end]).strip()))
        if n > len(expected):
            expected.extend([sure] * (n - len(expected)))
        elif expected:
            expected[-1] = min(expected[-1], sure)
    assert unit_probabilities(decode, tokens, token_probs) == tuple(expected)


def test_context_is_measured_in_the_models_tokens_not_its_characters() -> None:
    """The prefix counts inside the decode's token budget, and a character of Japanese is one
    token or more where one of English is a quarter: the same characters of context that fit
    in English would leave a Japanese utterance no budget."""
    count = token_counter()  # the bundled tiny.en's tokenizer
    english = ["We met on Tuesday to plan the launch.", "Then the team reviewed the budget."]
    japanese = ["私たちは火曜日に発売の計画を立てました。", "それからチームは予算を見直しました。"]
    assert sum(map(len, japanese)) < sum(map(len, english))
    for texts, kept in ((english, 2), (japanese, 1)):
        ctx = TranscriptContext(context_tokens=40, prompt_chars=200, count_tokens=count)
        ctx.commit(final(0, 3, texts[0]))
        ctx.commit(final(3, 6, texts[1]))
        got = ctx.for_decode(
            utterance_start=6 * RATE,
            lead_sample=6 * RATE,
            end_sample=8 * RATE,
            window_samples=WINDOW,
        )
        assert got.prefix == join_texts(texts[2 - kept :])
        assert count(got.prefix) <= 40
