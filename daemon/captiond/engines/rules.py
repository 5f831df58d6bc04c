"""Whisper's decoding rules that both engines share: token budgets and prompt fitting, partials'
token caps and windows, case variants, per-unit probabilities, the language choice among
candidates, and the compression ratio (faster-whisper's).

Pure functions, called on the engine thread, except `token_counter`, which the processes that
serve streams use on their event-loop thread to measure a session's context.
"""

from __future__ import annotations

import functools
import math
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from captiond.engines.base import DecodeKind, EngineRequest
from captiond.lang.text import has_word, units
from captiond.whisper import (
    HOP_SAMPLES,
    MAX_LENGTH,
    N_FRAMES,
    PROMPT_BUDGET_TOKENS,
    SAMPLE_RATE_HZ,
    STREAM_PROMPT_MAX_TOKENS,
)

# Prompt and prefix texts whose tokens are kept: two or three per live stream.
TEXT_TOKENS_CACHED = 4096


def text_tokens(encode: Callable[[str], Sequence[int]]) -> Callable[[str], tuple[int, ...]]:
    """The tokens of a previous text or a prefix, `encode(" " + text.strip())` (none for blank
    text), remembered for the last TEXT_TOKENS_CACHED texts, the same in every engine. A
    stream's partials repeat its previous text and often its prefix: 64 % of the texts in a
    replay of a dialogue and a reading were repeats, and the prompts of a 128-row batch took
    12 ms of the engine thread to tokenize, 2.8 ms with this cache (CPU)."""

    @functools.lru_cache(maxsize=TEXT_TOKENS_CACHED)
    def tokens(text: str) -> tuple[int, ...]:
        stripped = text.strip()
        return tuple(encode(" " + stripped)) if stripped else ()

    return tokens


@functools.cache
def token_counter(tokenizer_path: str = "") -> Callable[[str], int]:
    """How many of the model's tokens a text takes as a prefix (`text_tokens`' encoding), from
    the model's tokenizer.json ("": the bundled model's, which the fake engine stands for). For
    sessions, which run where the engine may not (worker processes): a decode's forced context
    counts inside its token budget, and one character is a quarter of a token in English but
    one or two in Chinese, Japanese or Khmer. Loaded once per process and path."""
    import tokenizers

    from captiond.engines.models import bundled_model_path

    path = tokenizer_path or str(bundled_model_path() / "tokenizer.json")
    tokenizer = tokenizers.Tokenizer.from_file(path)
    tokens = text_tokens(lambda text: tokenizer.encode(text, add_special_tokens=False).ids)
    return lambda text: len(tokens(text))


# A partial's decode writes at most this many tokens per started second of its utterance's
# audio, plus a floor: 1.6 times the fastest speech of both corpora in base's tokens (7.5 per
# second, a LibriSpeech reader; Chinese 6.4), so only a decode caught in a loop reaches it. A
# greedy partial that loops ("engraved in relief, engraved in relief, …") otherwise runs to the
# whole budget, ~200 tokens, and on a GPU holds every row of its batch that long. Finals, which
# are committed and compared with faster-whisper's, keep the whole budget.
PARTIAL_TOKENS_PER_S = 12


PARTIAL_TOKENS_FLOOR = 24


def partial_token_cap(request: EngineRequest) -> int | None:
    """The most tokens a partial's decode may write after its prefix (None for a final): see
    `PARTIAL_TOKENS_PER_S`. The utterance is the audio from `detect_from_sample` on."""
    if request.kind is not DecodeKind.PARTIAL:
        return None
    utterance_samples = max(0, len(request.audio) - request.detect_from_sample)
    seconds = -(-utterance_samples // SAMPLE_RATE_HZ)  # started seconds
    return PARTIAL_TOKENS_FLOOR + PARTIAL_TOKENS_PER_S * seconds


def new_token_budget(prompt_tokens: int, prefix_tokens: int, max_length: int = MAX_LENGTH) -> int:
    """How many tokens a decode may write after its forced prefix, in both engines (CTranslate2's
    rule, measured): the prefix counts inside the decode length, min(max_length // 2,
    max_length - (prompt_tokens - 1)), where `prompt_tokens` is the prompt before the prefix
    (up to <|notimestamps|>). So a long prefix leaves a long utterance too few tokens
    (`EngineResult.truncated`)."""
    return min(max_length // 2, max_length - (prompt_tokens - 1)) - prefix_tokens


def fit_prompt(
    stream_prompt: Sequence[int], previous: Sequence[int], prefix: Sequence[int]
) -> tuple[list[int], list[int]]:
    """The tokens of Whisper's previous-text section (the stream's prompt, then previous text)
    and of the prefix, cut to Whisper's prompt budget, the same in every engine.

    The prefix is what the window's audio begins with, so it comes first and keeps its end (the
    part next to the new audio): cutting it would leave audio without its text, which the model
    would then transcribe again. The stream's prompt gets what the prefix leaves, at most
    `STREAM_PROMPT_MAX_TOKENS`, keeping its start (terms are listed most important first);
    previous text gets the rest, keeping its end. Sessions keep prefixes well under the budget,
    so in practice only previous text is ever cut.
    """
    kept_prefix = list(prefix[max(0, len(prefix) - PROMPT_BUDGET_TOKENS) :])
    room = PROMPT_BUDGET_TOKENS - len(kept_prefix)
    kept_stream = list(stream_prompt[: min(room, STREAM_PROMPT_MAX_TOKENS)])
    room -= len(kept_stream)
    kept_previous = list(previous[max(0, len(previous) - room) :]) if room > 0 else []
    return kept_stream + kept_previous, kept_prefix


# A session's language gives way to another one only on evidence (Bayes): the detection's odds
# for the other language against the session's, p(other) / p(session), times the prior odds
# of a switch at any one utterance, must exceed 1. Meetings change language rarely; at a prior
# of 1 in 20 utterances, the other language must be 19 times as likely as the session's. The
# log odds add up over consecutive utterances that favour the same other language (Page's
# CUSUM): one very sure utterance switches at once, an unsure one is decoded in the session's
# language and a second one like it switches. A bar on p(other) alone (0.7 before) switched
# on one unsure detection: base heard a Spanish sentence as Portuguese at 0.78 (Spanish 0.14),
# and it and the next two sentences of the session came out in Portuguese.
LANGUAGE_SWITCH_NATS = math.log(19.0)


@dataclass(frozen=True, slots=True)
class LanguageChoice:
    """The language to decode in and its detected probability, and the evidence for a switch
    it leaves: `switch_nats` (ln of the odds) for `switch_language` against the session's
    language, carried to the session's next utterance (None: no evidence for another)."""

    language: str
    probability: float
    switch_language: str | None = None
    switch_nats: float = 0.0


def choose_language(
    probabilities: dict[str, float],
    hint: str | None,
    switch_language: str | None = None,
    switch_nats: float = 0.0,
    candidates: Sequence[str] = (),
) -> LanguageChoice:
    """The language to decode in, from Whisper's language probabilities, the session's language
    so far (`hint`) and the evidence its earlier utterances left for another
    (`switch_language`, `switch_nats`): see `LANGUAGE_SWITCH_NATS`. The same rule in every
    engine. With `candidates`, only they are detected: their probabilities are renormalized,
    as if Whisper's softmax were over their tokens alone (odds between two are unchanged)."""
    among = {c: probabilities[c] for c in candidates if c in probabilities}
    if among:
        total = sum(among.values())
        # All of them underflowed to 0: equally unlikely, so equally likely among themselves.
        probabilities = {c: p / total if total else 1 / len(among) for c, p in among.items()}
    detected = max(probabilities, key=probabilities.__getitem__)
    if hint is None or hint not in probabilities or detected == hint:
        return LanguageChoice(detected, probabilities[detected])
    # A probability that underflowed to 0 is no evidence for the hint at all.
    nats = math.log(probabilities[detected]) - math.log(max(probabilities[hint], 1e-30))
    if detected == switch_language:
        nats += switch_nats
    if nats >= LANGUAGE_SWITCH_NATS:
        return LanguageChoice(detected, probabilities[detected])
    return LanguageChoice(hint, probabilities[hint], detected, nats)


def request_language(request: EngineRequest, probabilities: dict[str, float]) -> LanguageChoice:
    """`choose_language` for a request whose language was detected as `probabilities`."""
    return choose_language(
        probabilities,
        request.language_hint,
        request.switch_language,
        request.switch_nats,
        request.candidates,
    )


_PARTIAL_MARGIN_FRAMES = 200


_PARTIAL_STEP_FRAMES = 500


def window_frames(request: EngineRequest, partial_min_frames: int) -> int:
    """Mel frames to encode: a full 30 s window, or a shorter one for partials (both engines).

    The encoder's cost grows with its input and Whisper's encoder accepts fewer than 3000
    frames (the first positional embeddings), so partials encode their audio plus
    `_PARTIAL_MARGIN_FRAMES`, in steps of `_PARTIAL_STEP_FRAMES` (so that partials of similar
    length share an encoder call), never less than `partial_min_frames`
    (`partial_window_min_s`): much shorter windows make Whisper loop. 0 turns this off. Finals
    always use the full window, as offline transcription does.
    """
    if request.kind is not DecodeKind.PARTIAL or partial_min_frames <= 0:
        return N_FRAMES
    needed = len(request.audio) // HOP_SAMPLES + _PARTIAL_MARGIN_FRAMES
    stepped = -(-needed // _PARTIAL_STEP_FRAMES) * _PARTIAL_STEP_FRAMES
    return min(N_FRAMES, max(partial_min_frames, stepped))


def case_variants(texts: Sequence[str]) -> tuple[tuple[int, ...], ...]:
    """For each text token (`texts[i]` is token i's text), itself first, then, if it has a
    capital letter, the tokens whose text is the same in other cases: a token's probability in
    `unit_probabilities` is theirs together. Words agree up to case (streaming/stabilize.py), and
    where Whisper cannot tell whether an utterance starts a sentence it splits a word between its
    cases: tiny.en gave " printing" 0.51 to 0.63 and " Printing" 0.23 to 0.36, so an
    utterance's first word was below `stable_min_probability` and no word of it became stable.
    A lowercase token counts only itself: a stable word is shown, and kept in the final, as the
    partial wrote it, and counting its capitals too made more finals start lowercase where
    their decode had a capital (19 to 28 of 100 single-utterance finals;
    docs/measurements/accuracy.md#decoding-in-context-rule-by-rule). A
    token that is only part of a character (its text holds U+FFFD) has only itself. The same
    rule in every engine."""
    same: dict[str, list[int]] = {}
    for token, text in enumerate(texts):
        if "\ufffd" not in text:
            same.setdefault(text.lower(), []).append(token)
    variants = []
    for token, text in enumerate(texts):
        others = [] if "\ufffd" in text or text.lower() == text else same[text.lower()]
        variants.append((token, *(t for t in others if t != token)))
    return tuple(variants)


def unit_probabilities(
    decode: Callable[[Sequence[int]], str], tokens: Sequence[int], token_probs: Sequence[float]
) -> tuple[float, ...]:
    """p of each text unit of `decode(tokens).strip()`: the least likely of the tokens it is
    made of (a token that only ends a word, or a byte of a character, counts for it), where
    punctuation does not count: words agree up to their punctuation (streaming/stabilize.py), and
    Whisper
    is often unsure between a comma and a full stop. A capitalized token's probability counts
    its other cases (`case_variants`). The same rule in every engine.

    Runs on the engine thread for every partial, so it decodes each word's tokens, not every
    prefix of the text: a token that starts with a space and a letter or digit starts a unit,
    and the units before it are counted once."""
    probs: list[float] = []
    word_start = 0  # the first token of the current word
    units_before = 0  # units of tokens[:word_start]
    for end, p in enumerate(token_probs, start=1):
        piece = decode(tokens[end - 1 : end])
        if not has_word(piece):
            p = 1.0
        if piece[:1].isspace() and piece.strip()[:1].isalnum() and end - 1 > word_start:
            units_before += len(units(decode(tokens[word_start : end - 1])))
            word_start = end - 1
        n = units_before + len(units(decode(tokens[word_start:end])))
        if n > len(probs):
            probs.extend([p] * (n - len(probs)))
        elif probs:
            probs[-1] = min(probs[-1], p)
    return tuple(probs)


def compression_ratio(text: str) -> float:
    """faster_whisper's get_compression_ratio: bytes over zlib-compressed bytes."""
    raw = text.encode("utf-8")
    return len(raw) / len(zlib.compress(raw))
