"""A session's values: where a session resumed from the journal goes on (`StreamOrigin`), a
decode it wants (`DecodeRequest`), and one utterance's state (`Utterance`), from its start to its
final. Owned by StreamSession, on the thread that feeds it (the event loop's)."""

from __future__ import annotations

from dataclasses import dataclass, field

from captiond.engines.base import DecodeKind, EngineRequest, EngineResult
from captiond.streaming.stabilize import LocalAgreement


@dataclass(frozen=True, slots=True, kw_only=True)
class StreamOrigin:
    """Where a session taken back after a daemon restart goes on (from its journal): its stream
    clock, its next segment number, its earlier text (the prompt; that audio is gone) and the
    language it was in (with ?language=auto: the hint its next utterance is detected with)."""

    start_sample: int
    first_segment: int
    earlier_text: str
    language: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class DecodeRequest:
    """A decode the session wants: the utterance's span of stream audio (the engine request's
    audio may start earlier, for context), its stable words when asked and the newest
    partial's words after them, and which of the stable words the decode was forced to start
    with (a partial's; none for a final)."""

    utterance: int
    start_sample: int
    speech_start_sample: int  # the utterance's first voiced frame, after its pre-roll
    stable_words: tuple[str, ...]
    forced_words: tuple[str, ...]
    engine_request: EngineRequest
    following_words: tuple[str, ...] = ()
    # A diarized final's speaker windows on the stream's sample clock: the windows its words'
    # speakers come from (streaming/speakers.py).
    speaker_spans: tuple[tuple[int, int], ...] = ()
    # The windows whose embeddings this decode asks for, on the stream's clock (the engine
    # request's `speaker_windows` count from its audio's first sample): a final's not embedded
    # yet (an early final's), a partial's new whole windows with `cut_at_speaker_change`
    # (`Utterance.embedded`).
    embed_spans: tuple[tuple[int, int], ...] = ()

    @property
    def kind(self) -> DecodeKind:
        return self.engine_request.kind

    @property
    def end_sample(self) -> int:
        """Where the decode's audio ends (the engine request's window ends there too)."""
        return self.engine_request.end_sample


@dataclass(slots=True, kw_only=True)
class Utterance:
    index: int  # internal, per session; segment numbers are given when first shown
    start_sample: int
    speech_start_sample: int
    # Where its decodes' audio may start without context (streaming/context.py): the quiet before
    # it, no more than the longest decode window before its start.
    lead_sample: int
    end_sample: int | None = None
    decode_end_sample: int | None = None  # where its final's decode ends (vad.UtteranceEnd)
    segment: int | None = None
    # A finalize ended it: its final is sent even if empty (the client waits for one answer
    # to its finalize: OpenAI's commit, Deepgram's from_finalize).
    finalized: bool = False
    rev: int = 0
    partial_end_sample: int = 0  # audio end covered by the latest partial request
    speech_confirmed: bool = False  # a decode of it produced text: the speech gate let it by
    early_end_sample: int = 0  # audio end of the latest early final asked for
    turn_asked_sample: int = 0  # the pause the end-of-turn model was last asked about
    turn_over: bool = False  # the end-of-turn model ended it
    # The end-of-turn model's probability that the speaker was done, at its latest check of
    # this utterance (a pause); None: not asked.
    turn_probability: float | None = None
    # An early final's answer, kept until the endpoint: its request, the text decoded and the
    # decode's result (its word timings and speaker embeddings).
    early: tuple[DecodeRequest, str, EngineResult] | None = None
    # Its final is decoded without the conversation's context: with it, it decoded to nothing,
    # repeated the context, or ran out of tokens (filters.ask_again_alone).
    alone: bool = False
    language: str | None = None  # decided once per utterance (with ?language=auto: detected)
    detect_longer: bool = False  # 1 s did not tell its language: detected on more audio
    # The evidence for a switch its detection left (engines.rules.LanguageChoice); None: not
    # detected.
    switch: tuple[str | None, float] | None = None
    chinese_variant: str = ""  # the stream's when the utterance began ("": as Whisper writes)
    agreement: LocalAgreement = field(default_factory=LocalAgreement)
    # A diarized utterance's speaker embeddings so far, by window (stream samples): its
    # partials' (each whole window once) and an early final's; the final reuses them
    # (streaming/speakers.py).
    embedded: dict[tuple[int, int], tuple[float, ...]] = field(default_factory=dict)
