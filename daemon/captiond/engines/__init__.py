"""The engine seam: request/result values, the Engine protocol and `load_engine`.

Everything here is called on the engine thread only (see scheduler.py), except `load_engine`,
which the CLI calls once at start-up before the engine thread takes ownership of the engine, and
`EngineInfo` and `token_counter`, which the processes that serve streams use on their own
threads (the event loop's) to describe the model and to measure a session's context.
Engine modules are imported lazily so that `import captiond` never imports torch or ctranslate2.
"""

from __future__ import annotations

import contextlib
import enum
import functools
import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from captiond import SAMPLE_RATE_HZ
from captiond.errors import BadMessageError
from captiond.protocol import AUTO_LANGUAGE, LanguageSetting, check_model_language
from captiond.text import has_word, units

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

    from captiond.config import EngineConfig

ENGINE_NAMES = ("auto", "faster-whisper", "torch_graph", "fake")

# Whisper's text budget before the first generated token: faster-whisper keeps at most
# max_length // 2 - 1 = 223 tokens of previous text, so that half the 448-token context is left
# for the decode. The stream's prompt, previous text and prefix share it here (see `fit_prompt`).
PROMPT_BUDGET_TOKENS = 223
# Whisper's text context, prompt and generated tokens together (faster-whisper's max_length).
MAX_LENGTH = 448
# A stream's own prompt (names, terms) takes at most half of that budget, so that previous text
# still conditions the decode; faster-whisper cuts its `hotwords` the same way, keeping the start.
STREAM_PROMPT_MAX_TOKENS = PROMPT_BUDGET_TOKENS // 2


class DecodeKind(enum.Enum):
    """Why a decode was asked for: partials are revisable, finals are committed."""

    PARTIAL = "partial"
    FINAL = "final"


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineRequest:
    """One Whisper window to decode: 16 kHz mono float32 audio, at most 30 s.

    `prompt` is earlier text the model is conditioned on (Whisper's previous text); `prefix` is
    text the decode is forced to start with (Whisper's prefix): the committed transcript of the
    window's first part. The result holds only what the model generated after the prefix.
    `stream_prompt` is the stream's own prompt (names, terms, style: the client's or
    `[stream] prompt`), put before the previous text in every decode (see `fit_prompt`).
    `speech_from_sample`, when set, asks the speech gate (speech_gate.py) to confirm speech in
    the audio from that sample on before the model runs; the gate answers before the engine
    sees the request, and engines ignore it.

    `language` None asks the engine to detect it (Whisper's language-token probabilities on
    the first 30 s of `audio[detect_from_sample:]`, the utterance without its context) and to
    decode in the language `choose_language` picks given `language_hint`, the session's
    language so far, and `switch_language`/`switch_nats`, the evidence for another language
    its earlier utterances left, among `candidates` (empty: any language the model knows). An
    English-only model always decodes English. `task` is "transcribe" or "translate" (to
    English).

    `stream` names the stream the window is from, and `end_sample` is where it ends on that
    stream's sample clock: an engine may keep a stream's audio between its decodes (torch_graph
    keeps it on the GPU) and take from `audio` only what it lacks. A stream's audio at a given
    sample never changes. None: a one-off window, taken whole.
    """

    audio: npt.NDArray[np.float32]
    kind: DecodeKind
    language: str | None = "en"
    language_hint: str | None = None
    switch_language: str | None = None
    switch_nats: float = 0.0
    candidates: tuple[str, ...] = ()
    detect_from_sample: int = 0
    task: str = "transcribe"
    prompt: str = ""
    prefix: str = ""
    stream_prompt: str = ""
    beam_size: int = 1
    speech_from_sample: int | None = None
    stream: str | None = None
    end_sample: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineResult:
    """The decode of one request after its prefix; scores follow Whisper's definitions."""

    text: str
    tokens: tuple[int, ...] = ()
    avg_logprob: float = 0.0
    no_speech_prob: float = 0.0
    compression_ratio: float = 1.0
    # The language decoded in, and its detected probability (1.0 when it was given).
    language: str | None = None
    language_probability: float = 1.0
    # The evidence for a switch the detection leaves (`LanguageChoice`); None when the
    # language was given, or detected without a session language to switch from.
    switch_language: str | None = None
    switch_nats: float = 0.0
    # p of each text unit of `text` (text.units): its least likely token's probability, for
    # greedy partials (stable words need it; a beam's choice is not one token's probability,
    # and finals do not need it); empty otherwise.
    unit_probs: tuple[float, ...] = ()
    # Whether the decoded text began with a space, as Whisper writes one before a new word.
    # After a forced prefix, text without one was written right after it ("加进" + "38年").
    spaced: bool = True
    # The decode stopped at its token budget (`new_token_budget`; a partial's cap,
    # `partial_token_cap`) or as a loop (`looped`), not at <|endoftext|>: the words after
    # `text` were not written.
    truncated: bool = False
    # torch_graph stopped it because its last tokens repeat with a short period
    # (torch_graph/decode.py, `LOOP_RUN_TOKENS`): `text` is the start of a loop, which the
    # session drops as Whisper's compression-ratio rule would drop the whole one.
    looped: bool = False


def begins_with_space(written: str) -> bool:
    """`EngineResult.spaced` of a decode whose text, before stripping, is `written`."""
    return not written[:1] or written[:1].isspace()


class PhaseTimes:
    """Wall time an engine spends in each phase of its batches (phases named by the engine).
    The engine thread adds to it while decoding and the scheduler, on the same thread, drains
    it after every batch into `captiond_engine_phase_seconds`."""

    def __init__(self) -> None:
        self._seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:
            elapsed_s = time.perf_counter() - started
            self._seconds[name] = self._seconds.get(name, 0.0) + elapsed_s

    def drain(self) -> dict[str, float]:
        """Seconds per phase since the last drain."""
        seconds, self._seconds = self._seconds, {}
        return seconds


class Engine(Protocol):
    """A loaded model that decodes batches of requests, synchronously, on the engine thread."""

    @property
    def phases(self) -> PhaseTimes:
        """Where the time of its batches goes (`PhaseTimes`)."""
        ...

    @property
    def name(self) -> str: ...

    @property
    def model_name(self) -> str: ...

    @property
    def max_batch(self) -> int:
        """The most requests worth decoding in one call (the scheduler's default limit)."""
        ...

    @property
    def multilingual(self) -> bool:
        """The model knows languages other than English (and can detect and translate)."""
        ...

    @property
    def known_languages(self) -> frozenset[str]:
        """The language codes the model has a token for (Cantonese, `yue`, came with
        large-v3: the models before it know 99)."""
        ...

    @property
    def tokenizer_path(self) -> str:
        """The model's tokenizer.json, by which sessions measure their context (`token_counter`)."""
        ...

    def warmup(self) -> None:
        """Run one throw-away batch so the first real request is not slow (graph capture etc.)."""

    def transcribe_batch(self, requests: Sequence[EngineRequest]) -> list[EngineResult]:
        """Decode every request; the result list has the same order and length."""
        ...

    def close(self) -> None:
        """Release the model (device memory, threads)."""


@dataclass(frozen=True, slots=True)
class EngineInfo:
    """What the daemon says about its engine (`ready`, journal, metrics), in any process."""

    name: str
    model_name: str
    multilingual: bool
    max_batch: int
    known_languages: frozenset[str] = frozenset()
    tokenizer_path: str = ""  # see `token_counter` ("": the bundled model's)

    @property
    def english_only(self) -> str:
        """The model's name when it captions English only; "" when it knows every language."""
        return "" if self.multilingual else self.model_name

    def stream_language(self, tag: str) -> str:
        """The language a stream asking for `tag` is decoded in: `auto` on an English-only model
        is English at once (there is nothing to detect, and detecting would hold back every
        utterance's first partial)."""
        return "en" if self.english_only and tag.lower() == AUTO_LANGUAGE else tag

    def stream_setting(self, setting: LanguageSetting) -> LanguageSetting:
        """`stream_language` of a parsed setting."""
        code = self.stream_language(setting.code)
        return setting if code == setting.code else LanguageSetting(code)

    def check_can(
        self, language: str, task: str = "transcribe", candidates: Sequence[str] = ()
    ) -> None:
        """Refuse (BadMessageError) a language code, a candidate of `auto`, or a task this
        model cannot do: it would decode as nothing, silently, or (torch_graph, a code it has
        no token for) fail its batch. English-only models take `en` and `auto`, and do not
        translate; a multilingual one takes the codes it has tokens for (Cantonese, `yue`, came
        with large-v3)."""
        for code in (language, *candidates):
            check_model_language(code, self.english_only)
            if self.known_languages and code not in (AUTO_LANGUAGE, *self.known_languages):
                later = ": large-v3 and later do" if code == "yue" else ""
                raise BadMessageError(
                    f"the model {self.model_name} does not know language {code!r}{later}"
                )
        if self.english_only and task == "translate":
            raise BadMessageError(
                f"the model {self.model_name} is English-only: task 'translate' needs a "
                "multilingual model (captiond serve --model base)"
            )

    @classmethod
    def of(cls, engine: Engine) -> EngineInfo:
        return cls(
            engine.name,
            engine.model_name,
            engine.multilingual,
            engine.max_batch,
            engine.known_languages,
            engine.tokenizer_path,
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

    from captiond.models import bundled_model_path

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


N_FRAMES = 3000  # one 30 s Whisper window of 10 ms mel frames
HOP_SAMPLES = 160  # 10 ms at 16 kHz: one mel frame
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
    `unit_probabilities` is theirs together. Words agree up to case (stabilize.py), and where
    Whisper cannot tell whether an utterance starts a sentence it splits a word between its
    cases: tiny.en gave " printing" 0.51 to 0.63 and " Printing" 0.23 to 0.36, so an
    utterance's first word was below `stable_min_probability` and no word of it became stable.
    A lowercase token counts only itself: a stable word is shown, and kept in the final, as the
    partial wrote it, and counting its capitals too made more finals start lowercase where
    their decode had a capital (19 to 28 of 100 single-utterance finals; README, Accuracy). A
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
    punctuation does not count: words agree up to their punctuation (stabilize.py), and Whisper
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


def cuda_available() -> bool:
    """True when torch is installed and sees a CUDA device (False without torch)."""
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def resolve_engine_config(config: EngineConfig) -> EngineConfig:
    """Replace every `auto` with a concrete choice.

    Engine `auto` picks torch_graph on CUDA when torch sees a GPU, else faster-whisper on the
    CPU; device `auto` is cuda when torch sees a GPU; compute type `auto` is float16 on cuda,
    int8 for faster-whisper on the CPU and float32 for torch_graph on the CPU.
    """
    import dataclasses

    device = config.device
    if device == "auto":
        device = "cuda" if cuda_available() else "cpu"
    name = config.name
    if name == "auto":
        name = "torch_graph" if device == "cuda" else "faster-whisper"
    compute_type = config.compute_type
    if compute_type == "auto":
        if device == "cuda":
            compute_type = "float16"
        else:
            compute_type = "int8" if name == "faster-whisper" else "float32"
    return dataclasses.replace(config, name=name, device=device, compute_type=compute_type)


def load_engine(config: EngineConfig) -> Engine:
    """Build the engine the config names (imports its backend only now)."""
    from captiond.errors import ConfigError
    from captiond.models import resolve_model

    config = resolve_engine_config(config)
    name = config.name
    if name == "fake":
        from captiond.engines.fake import FakeEngine

        return FakeEngine()
    model_path = resolve_model(config.model, allow_download=config.allow_download)
    engine: Engine
    if name == "faster-whisper":
        from captiond.engines.faster_whisper import FasterWhisperEngine

        engine = FasterWhisperEngine(model_path, config)
    elif name == "torch_graph":
        from captiond.engines.torch_graph import TorchGraphEngine

        engine = TorchGraphEngine(model_path, config)
    else:
        raise ConfigError(f"unknown engine {name!r}; choose one of {', '.join(ENGINE_NAMES)}")
    return engine
