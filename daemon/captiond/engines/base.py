"""The engine seam: request and result values, the Engine protocol, `EngineInfo`, and `Submit`
(one stream's way to the engine).

Engines run on the engine thread only (decoding/scheduler.py). `EngineInfo` is read by the
processes that serve streams on their event-loop thread, to describe the model.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt
from captiond.errors import BadMessageError
from captiond.lang.languages import AUTO_LANGUAGE, LanguageSetting, check_model_language
from captiond.whisper import SAMPLE_RATE_HZ

# What the end-of-turn model reads of a turn: its last 8 s (engines/turn.py).
TURN_WINDOW_S = 8
TURN_WINDOW_SAMPLES = TURN_WINDOW_S * SAMPLE_RATE_HZ


class DecodeKind(enum.Enum):
    """Why a decode was asked for: partials are revisable, finals are committed. A turn
    request is no decode: the end-of-turn model judges its audio, a turn up to a pause, and
    the scheduler answers it before the batch's decodes (`judge_turns`); engines never see
    one."""

    PARTIAL = "partial"
    FINAL = "final"
    TURN = "turn"


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
    # Spans of `audio` (start, end samples) whose speaker embeddings the result carries: a
    # diarized stream's final asks for its utterance's windows (streaming/speakers.py).
    speaker_windows: tuple[tuple[int, int], ...] = ()


@dataclass(frozen=True, slots=True)
class WordTiming:
    """One word of a decode: as Whisper wrote it (its leading space included), where it starts
    and ends in seconds from the start of the request's audio, and its confidence: the mean
    probability of its tokens (engines/timing.py)."""

    word: str
    start_s: float
    end_s: float
    probability: float


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
    # The words of `text` with their times and confidences, from the alignment heads
    # (engines/timing.py): every final's (a committed caption carries them); none for partials,
    # which are revisable and most of the decodes, and would pay an alignment pass each.
    words: tuple[WordTiming, ...] = ()
    # One unit-length speaker embedding per `EngineRequest.speaker_windows` span, embedded
    # after the batch's decodes (`embed_speakers`); empty when none was asked for.
    speaker_embeddings: tuple[tuple[float, ...], ...] = ()
    # A turn request's answer: the probability that the speaker's turn is over at the end of
    # its audio (`judge_turns`); None for decodes, and when the model could not answer.
    turn_probability: float | None = None


class Embedder(Protocol):
    """A speaker-embedding model (engines/speakers.py). `concurrent`: it runs on the
    scheduler's speaker thread, beside the engine's decodes (a model on the CPU, where a decode
    leaves cores idle); otherwise on the engine thread after them (a model on the engine's GPU,
    whose work would only queue behind the decodes', and whose CUDA graphs another thread's
    kernels must not disturb while they are captured)."""

    concurrent: bool

    def embed(self, windows: Sequence[npt.NDArray[np.float32]]) -> npt.NDArray[np.float32]:
        """One unit-length embedding per window, as rows."""
        ...


Embeddings = tuple[tuple[float, ...], ...]


def speaker_vectors(embedder: Embedder, requests: Sequence[EngineRequest]) -> list[Embeddings]:
    """The speaker embeddings each request asked for (`speaker_windows`), every request's
    windows embedded in one call: the batch's streams share the model's batches."""
    windows = [
        request.audio[start:end] for request in requests for start, end in request.speaker_windows
    ]
    if not windows:
        # Most of a stream's decodes fill no window; numpy stays out of this module's imports.
        return [() for _ in requests]
    vectors = embedder.embed(windows)
    out: list[Embeddings] = []
    row = 0
    for request in requests:
        taken = len(request.speaker_windows)
        out.append(tuple(tuple(float(x) for x in v) for v in vectors[row : row + taken]))
        row += taken
    return out


def with_speakers(
    results: Sequence[EngineResult], embeddings: Sequence[Embeddings]
) -> list[EngineResult]:
    """`results` with their requests' speaker embeddings (`speaker_vectors`)."""
    return [
        dataclasses.replace(result, speaker_embeddings=vectors) if vectors else result
        for result, vectors in zip(results, embeddings, strict=True)
    ]


def embed_speakers(
    embedder: Embedder, requests: Sequence[EngineRequest], results: Sequence[EngineResult]
) -> list[EngineResult]:
    """`results` with the speaker embeddings their requests asked for, in one call."""
    return with_speakers(results, speaker_vectors(embedder, requests))


class TurnModel(Protocol):
    """An end-of-turn model (engines/turn.py), run on the engine thread."""

    def complete(self, turns: Sequence[npt.NDArray[np.float32]]) -> list[float]:
        """For each turn's audio, the probability that its speaker is done."""
        ...


def judge_turns(model: TurnModel, requests: Sequence[EngineRequest]) -> list[EngineResult]:
    """The answers to turn requests (`DecodeKind.TURN`), every turn judged in one call
    (engine thread)."""
    probabilities = model.complete([request.audio for request in requests])
    return [EngineResult(text="", turn_probability=p) for p in probabilities]


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
    # A speaker-embedding model comes with the engine: streams may be diarized.
    diarizes: bool = False
    # An end-of-turn model comes with the engine: turns may end by it ([vad] end_of_turn).
    judges_turns: bool = False

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


# One stream's way to the engine: its decode requests in, their results out.
Submit = Callable[[EngineRequest], Awaitable[EngineResult]]
