"""StreamSession: one audio stream's state machine, from PCM bytes to caption messages.

Sans-I/O: no sockets, no clock, no engine. The connection handler (server.py, event-loop thread)
feeds it audio and control messages, asks it for the next decode request, hands back the result,
and sends whatever messages it produced. At most one request is in flight per session; finals go
before partials, and a partial is only asked for once `partial_interval_ms` of new audio arrived,
so under load partials simply come less often.

Every decode continues the session's transcript (context.py): its window reaches back over
earlier finals' audio and their decoded text is forced as Whisper's prefix, so only new words
come back. Partials also force the utterance's stable words. Finals do not (partial-quality
words would spread into every later decode); the final sent keeps the stable words verbatim and
takes the rest from the decode (stabilize.keep_stable), so it never contradicts them. A final
that decodes to nothing after its context (though partials showed words, or writing only
punctuation), that only repeats its context's last words, or that ran out of tokens after its
context's prefix, is decoded again without it (`_ask_again_alone`).

A final's decode covers its utterance up to `final_tail_ms` of silence (vad.py), so it can
start before the endpoint confirms the utterance over: an early final. If the endpoint comes
with no speech in between, its result is the final; if the speaker goes on, it is dropped. Its
text also sets the endpoint: a pause after words that end no sentence ends the utterance only at
`unfinished_endpoint_silence_ms`, so a sentence a speaker pauses in is decoded whole.
"""

from __future__ import annotations

import dataclasses
import enum
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from itertools import count

import numpy as np

from captiond import SAMPLE_RATE_HZ
from captiond.audio import (
    AudioBuffer,
    Framer,
    Pcm16,
    Resampler,
    Samples,
    decode_pcm,
    ms_to_samples,
    read_pcm16,
    samples_to_ms,
    to_pcm16,
)
from captiond.chinese import written
from captiond.config import Config
from captiond.context import CommittedFinal, TranscriptContext
from captiond.engines import DecodeKind, EngineRequest, EngineResult
from captiond.errors import BadMessageError
from captiond.protocol import (
    Control,
    Done,
    Final,
    LanguageSetting,
    Partial,
    ServerMessage,
    SpeechStarted,
    SpeechStopped,
    StreamParams,
)
from captiond.stabilize import LocalAgreement, keep_stable
from captiond.text import (
    continues_with_hyphen,
    ends_sentence,
    has_word,
    join_texts,
    join_units,
    only_punctuation,
    repeats_the_end_of,
    separator,
    units,
    with_marks,
    written_after,
)
from captiond.vad import UtteranceEnd, UtteranceStart, Vad, VadEvent, VadSegmenter

# Audio kept behind the stream's end while no utterance is open: the segmenter may open one
# up to pre-roll + start window before the current frame.
_KEEP_BEHIND_MS = 2_000
# What a partial asks the speech gate to look at: its newest audio, not the whole utterance
# again (the final of an utterance that never showed speech looks at all of it).
_PARTIAL_GATE_MS = 3_000
# Silence after which an open utterance gets no more partials: it adds no word, and a partial
# asked later in the pause would still be decoding when the early final falls due, and hold it
# up (on the CPU a partial takes 100-300 ms and partials come every 500 ms of audio, so a
# pause often met one).
_PAUSE_MS = 150
# Audio an utterance's language is detected on once the session has a language to fall back
# on (`language_detect_s` before that).
_HINTED_DETECT_MS = 1_000
# Below this probability of the session's language, 1 s of an utterance does not decide it:
# the detection waits for `language_detect_s` of audio. One second of English after Spanish
# was heard as Spanish (English short of the odds a switch needs), and the whole eight-second
# sentence was then decoded as Spanish: translated.
_SURE_SAME_LANGUAGE = 0.5
# Nor does a detection of another language on less than `language_detect_s` of audio switch
# the session's: base heard one second of German as English at 0.91, 1.6 s of Spanish as
# Portuguese at 0.89, and decoded the sentences in those languages (the German one translated
# to English). On the first 3 s of 109 utterances of the two corpora (14 languages) no other
# language reached 0.7. A partial waits for `language_detect_s`; an utterance shorter than
# that is decoded in the session's language (`_too_short_to_switch`).


@dataclass(frozen=True, slots=True, kw_only=True)
class StreamOrigin:
    """Where a session taken back after a daemon restart goes on (from its journal): its stream
    clock, its next segment number, its earlier text (the prompt; that audio is gone) and the
    language it was in (with ?language=auto: the hint its next utterance is detected with)."""

    start_sample: int
    first_segment: int
    earlier_text: str
    language: str | None = None


class SessionState(enum.Enum):
    STREAMING = "streaming"
    ENDING = "ending"  # `end` received: flushing the last finals
    DONE = "done"


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

    @property
    def kind(self) -> DecodeKind:
        return self.engine_request.kind

    @property
    def end_sample(self) -> int:
        """Where the decode's audio ends (the engine request's window ends there too)."""
        return self.engine_request.end_sample


@dataclass(slots=True, kw_only=True)
class _Utterance:
    index: int  # internal, per session; segment numbers are given when first shown
    start_sample: int
    speech_start_sample: int
    # Where its decodes' audio may start without context (context.py): the quiet before it,
    # no more than the longest decode window before its start.
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
    # An early final's answer, kept until the endpoint: its request and the text decoded.
    early: tuple[DecodeRequest, str] | None = None
    # Its final is decoded without the conversation's context: with it, it decoded to nothing,
    # repeated the context, or ran out of tokens (`_ask_again_alone`).
    alone: bool = False
    language: str | None = None  # decided once per utterance (with ?language=auto: detected)
    detect_longer: bool = False  # 1 s did not tell its language: detected on more audio
    # The evidence for a switch its detection left (engines.LanguageChoice); None: not detected.
    switch: tuple[str | None, float] | None = None
    chinese_variant: str = ""  # the stream's when the utterance began ("": as Whisper writes)
    agreement: LocalAgreement = field(default_factory=LocalAgreement)


class StreamSession:
    def __init__(
        self,
        *,
        config: Config,
        vad: Vad,
        params: StreamParams,
        partials: bool = True,
        early_finals: bool = True,
        origin: StreamOrigin | None = None,
        count_tokens: Callable[[str], int],
    ) -> None:
        origin = origin or StreamOrigin(start_sample=0, first_segment=0, earlier_text="")
        self._stream = config.stream
        self._partials = partials
        self._early_finals = early_finals
        # The stream's prompt and Chinese variant resolved: the client's, else the daemon's.
        self._params = dataclasses.replace(
            params,
            prompt=config.stream.prompt if params.prompt is None else params.prompt,
            chinese_variant=(
                config.stream.chinese_variant
                if params.chinese_variant is None
                else params.chinese_variant
            ),
        )
        self._resampler = (
            Resampler(params.sample_rate_hz) if params.sample_rate_hz != 16_000 else None
        )
        self._buffer = AudioBuffer(origin.start_sample)
        self._framer = Framer()
        self._segmenter = VadSegmenter(vad, config.vad, config.stream, origin.start_sample)
        # An early final says whether a pause ended a sentence (_take_final).
        self._segmenter.waits_for_sentences = early_finals
        self._partial_interval_samples = ms_to_samples(config.stream.partial_interval_ms)
        self._pause_samples = ms_to_samples(min(_PAUSE_MS, config.vad.final_tail_ms))
        # Partials stop where a capped utterance may be cut (vad.py: the quietest frame of the
        # last `cut_search_s`): a word stabilised beyond the cut would belong to the next
        # segment, and its final would either contradict it or repeat it.
        self._partial_limit_samples = ms_to_samples(
            round((config.stream.max_utterance_s - config.stream.cut_search_s) * 1000)
        )
        self._utterances = count()
        self._open: _Utterance | None = None
        self._closed: deque[_Utterance] = deque()
        self._in_flight: DecodeRequest | None = None
        self._outbox: list[ServerMessage] = []
        self._context = TranscriptContext(
            context_tokens=config.stream.context_tokens,
            prompt_chars=config.stream.prompt_chars,
            count_tokens=count_tokens,
        )
        self._context.remember(origin.earlier_text)
        self._final_window_samples = ms_to_samples(round(config.stream.context_s * 1000))
        self._partial_window_samples = ms_to_samples(round(config.stream.partial_context_s * 1000))
        self._lead_samples = max(self._final_window_samples, self._partial_window_samples)
        self._segments = origin.first_segment
        # The session's language so far: what an utterance in ?language=auto is decoded in
        # unless the evidence for another one is strong enough (engines.choose_language).
        self._language = origin.language if params.auto_language else params.language
        # The evidence for another language its utterances so far left (choose_language adds
        # it up over consecutive ones): the language and ln of its odds against the session's.
        self._switch: tuple[str | None, float] = (None, 0.0)
        self._detect_samples = ms_to_samples(round(config.stream.language_detect_s * 1000))
        self._detect_hinted_samples = min(self._detect_samples, ms_to_samples(_HINTED_DETECT_MS))
        self.state = SessionState.STREAMING

    # -- input -------------------------------------------------------------------------------

    def receive_audio(self, data: bytes) -> None:
        if self.state is not SessionState.STREAMING:
            raise BadMessageError("audio after 'end': the stream is closed")
        if self._resampler is None and self._params.encoding == "pcm_s16le":
            # The client's own 16-bit PCM: the VAD reads it as it is, the buffer scales it.
            pcm = read_pcm16(data)
            self._buffer.append_pcm16(pcm)
            self._segment(pcm)
            return
        samples = decode_pcm(data, self._params.encoding)
        if self._resampler is not None:
            samples = self._resampler.process(samples)
        self._push_samples(samples)

    def receive_samples(self, samples: Samples) -> None:
        """Take float32 samples already at 16 kHz (offline files, daemon-side capture)."""
        if self.state is not SessionState.STREAMING:
            raise BadMessageError("audio after 'end': the stream is closed")
        self._push_samples(samples)

    def set_language(self, setting: LanguageSetting) -> None:
        """Decode the utterances from the next one on as `setting` (`parse_language` of a tag
        such as "de" or "zh-TW", of "auto", or of the languages to detect among: "en,de"), a
        session update of a vendor API."""
        self._params = dataclasses.replace(
            self._params,
            language=setting.code,
            candidates=setting.candidates,
            chinese_variant=setting.chinese_variant or self._stream.chinese_variant,
        )
        if not self._params.auto_language:
            self._language = self._params.language
        elif setting.candidates and self._language not in setting.candidates:
            self._language = None  # the conversation so far is in none of them
        self._switch = (None, 0.0)  # the client said what is spoken: no evidence against it

    def set_prompt(self, prompt: str) -> None:
        """Prompt the decodes from the next one on with `prompt` (names, terms; "" for none),
        a session update of a vendor API."""
        self._params = dataclasses.replace(self._params, prompt=prompt)

    def set_ends_at_pauses(self, ends_at_pauses: bool) -> None:
        """Whether a pause ends an utterance from now on; when not, only `finalize` (or the
        `max_utterance_s` cap) does: push to talk, a session update of a vendor API."""
        self._segmenter.ends_at_pauses = ends_at_pauses

    def receive_control(self, control: Control) -> bool:
        """Apply `end`, `finalize` or `keepalive`; True when it ended an utterance (whose final
        follows: always, after a finalize)."""
        if control is Control.KEEPALIVE:
            return False
        if self.state is not SessionState.STREAMING:
            raise BadMessageError(f"{control.value!r} after 'end'")
        if self._resampler is not None and control in (Control.END, Control.FINALIZE):
            # soxr holds back its filter's delay (23 ms at 48 kHz, 114 at 8 kHz): the utterance
            # a finalize ends gets it too (a push-to-talk's last word); what follows goes
            # through a new stream.
            self._push_samples(self._resampler.process(np.zeros(0, np.float32), last=True))
            if control is Control.FINALIZE:
                self._resampler = Resampler(self._params.sample_rate_hz)
        closed = len(self._closed)
        finalize = control is Control.FINALIZE
        self._handle_vad(self._segmenter.flush(self._buffer.end_sample, begun=finalize))
        ended = len(self._closed) > closed
        if ended and finalize:
            self._closed[-1].finalized = True
        if control is Control.END:
            self.state = SessionState.ENDING
            self._maybe_done()
        return ended

    # -- decoding ----------------------------------------------------------------------------

    def next_request(self) -> DecodeRequest | None:
        """The decode to run now, or None (one already in flight, or nothing is due). Finals
        that an early final already answered are sent first (take_messages)."""
        if self._in_flight is not None:
            return None
        self._finish_answered()
        if self._closed:
            utt = self._closed[0]
            assert utt.decode_end_sample is not None
            req = self._request(utt, DecodeKind.FINAL, utt.decode_end_sample)
        elif (pause_sample := self._early_final_due()) is not None:
            assert self._open is not None
            self._open.early_end_sample = pause_sample
            req = self._request(self._open, DecodeKind.FINAL, pause_sample)
        elif self._partial_due():
            assert self._open is not None
            self._open.partial_end_sample = self._buffer.end_sample
            req = self._request(self._open, DecodeKind.PARTIAL, self._open.partial_end_sample)
        else:
            return None
        self._in_flight = req
        return req

    def on_result(self, request: DecodeRequest, result: EngineResult) -> None:
        """Take the engine's result for the request returned by `next_request`."""
        assert request is self._in_flight, "results must answer the request in flight"
        self._in_flight = None
        utt = self._closed[0] if self._closed else self._open
        if utt is not None and utt.index != request.utterance:
            utt = None  # a partial of an utterance whose final was sent meanwhile
        if utt is not None:
            if result.text.strip():
                utt.speech_confirmed = True
            # A result without a language (the speech gate found no speech) decides nothing.
            if (
                utt.language is None
                and result.language is not None
                and not self._take_language(utt, request, result)
            ):
                self._maybe_done()  # this decode's text is not used
                return
        new = "" if self._is_hallucination(request, result) else result.text.strip()
        unit_probs = result.unit_probs
        # In the reader's script before anything is shown, made stable or kept as context
        # (without an utterance, the text is not used).
        converted = new if utt is None else written(new, utt.language, utt.chinese_variant)
        if converted != new:
            # A phrase converted to one of another length would shift the units' probabilities.
            if len(units(converted)) != len(units(new)):
                unit_probs = ()
            new = converted
        # The forced words stay as they were even if Whisper would have extended the last one
        # (a word split across the commit point): stable words are a promise. Punctuation that
        # Whisper puts right after them ("In September" + ", for the first time") belongs to
        # the last forced word, not shown (and made stable) as a unit of its own, and so does
        # the rest of a word it joins to it with a hyphen ("time" + "-wise,"; the string only
        # grows); punctuation after an earlier final forced as context (", say", "。顔…") is
        # left out.
        new_units = units(new)
        forced = bool(request.engine_request.prefix)
        forced_words = request.forced_words
        skipped = 0
        while forced and skipped < len(new_units) and only_punctuation(new_units[skipped]):
            skipped += 1
        if forced_words and not skipped and not result.spaced and new_units:
            skipped = int(continues_with_hyphen(new_units[0]))
        rest = new_units[skipped:]
        if skipped and forced_words:
            # It ends the last stable word ("so" + ","), which LocalAgreement may then extend.
            marks = "".join(new_units[:skipped])
            forced_words = (*forced_words[:-1], with_marks(forced_words[-1], marks))
        elif rest and forced_words and not result.spaced:
            rest[0] = written_after(forced_words[-1], rest[0])
        text = join_units((*forced_words, *rest))
        if request.kind is DecodeKind.FINAL:
            self._take_final(utt, request, text, result)
        elif self._open is not None and self._open.index == request.utterance and text:
            sure = self._sure_units(request, unit_probs[skipped:], new_units[skipped:])
            self._show_partial(self._open, request, text, sure)
        self._maybe_done()

    def abandon(self, request: DecodeRequest) -> None:
        """Forget the decode in flight, `superseded`: its result will never come."""
        assert request is self._in_flight
        self._in_flight = None

    def superseded(self, request: DecodeRequest) -> bool:
        """Whether a decode in flight is no longer wanted: a partial once a final is due, an
        early final once the speaker went on."""
        if request.kind is DecodeKind.PARTIAL:
            return bool(self._closed)
        utt = self._open
        return (
            utt is not None
            and utt.index == request.utterance
            and self._segmenter.pause_sample != request.end_sample
        )

    @property
    def needs_pump(self) -> bool:
        """Whether the decode pump (scheduler.drive_session) has something to act on: a
        message to send, a final is due (also while a partial is in flight: the final
        supersedes it), the decode in flight is superseded, an early final or a partial is due,
        or the stream is done. Audio wakes the pump only then: woken for every 100 ms chunk, it
        ran ten times a second per stream to find nothing to do."""
        if self._outbox or self._closed or self.done:
            return True  # a message waits (speech_started: it must not wait for a decode)
        if self._in_flight is not None:
            return self.superseded(self._in_flight)
        return self._early_final_due() is not None or self._partial_due()

    def take_messages(self) -> list[ServerMessage]:
        out, self._outbox = self._outbox, []
        return out

    @property
    def done(self) -> bool:
        return self.state is SessionState.DONE

    @property
    def audio_ms(self) -> int:
        return samples_to_ms(self._buffer.end_sample)

    @property
    def kept_samples(self) -> int:
        """The audio the session keeps (its memory): none once it is done."""
        return self._buffer.end_sample - self._buffer.start_sample

    @property
    def params(self) -> StreamParams:
        return self._params

    @property
    def buffered_samples(self) -> int:
        """Audio since the start of the oldest utterance still waiting for its final: what a
        stream's memory grows with when decodes fall behind. The rest of what the buffer keeps
        (the open utterance, the quiet before it, the context) is bounded by the utterance cap
        and the decode windows."""
        if not self._closed:
            return 0
        return self._buffer.end_sample - self._closed[0].start_sample

    @property
    def segments(self) -> int:
        return self._segments

    @property
    def has_open_utterance(self) -> bool:
        return self._open is not None or bool(self._closed)

    # -- internals ---------------------------------------------------------------------------

    def _push_samples(self, samples: Samples) -> None:
        self._buffer.append(samples)
        self._segment(to_pcm16(samples))

    def _segment(self, pcm: Pcm16) -> None:
        """Run the VAD over the audio just buffered (as 16-bit PCM, what webrtcvad reads)."""
        self._handle_vad(self._segmenter.push(self._framer.push(pcm)))
        self._trim_buffer()

    def _trim_buffer(self) -> None:
        """Forget audio that no decode can need: not in an open or closed utterance or the
        quiet before it, not in a later decode's context, not in the segmenter's reach behind
        the stream's end."""
        end = self._buffer.end_sample
        # The next final ends where the oldest utterance still waiting for one ends, which can
        # be far behind the stream's end when decodes lag (a busy engine, audio sent faster
        # than real time): measured from the stream's end, the finals that one reaches back
        # to would leave the context too early, and it would decode without them.
        next_final_end = min(
            [end] + [u.decode_end_sample for u in self._closed if u.decode_end_sample is not None]
        )
        behind = end - ms_to_samples(_KEEP_BEHIND_MS)
        # The next utterance to open starts at `behind` or later, its lead at most
        # `_lead_samples` before that.
        next_lead = max(self._segmenter.lead_sample, behind - self._lead_samples)
        keep_from = min(
            [u.lead_sample for u in self._closed]
            + ([self._open.lead_sample] if self._open else [])
            + [next_lead, behind]
            + [self._context.keep_from(next_final_end, self._final_window_samples)]
        )
        self._buffer.discard_before(keep_from)

    def _handle_vad(self, events: Iterable[VadEvent]) -> None:
        for event in events:
            if isinstance(event, UtteranceStart):
                auto = self._params.auto_language
                self._open = _Utterance(
                    index=next(self._utterances),
                    start_sample=event.start_sample,
                    speech_start_sample=event.speech_start_sample,
                    lead_sample=max(event.lead_sample, event.start_sample - self._lead_samples),
                    agreement=LocalAgreement(self._stream.stable_hold_back_words),
                    language=None if auto else self._params.language,
                    chinese_variant=self._params.chinese_variant or "",
                )
                # A cut at the cap is no pause: the speech neither stopped nor started there
                # (a voice agent takes speech_stopped for "the user is done").
                if not event.continues:
                    start_ms = samples_to_ms(event.start_sample)
                    self._outbox.append(SpeechStarted(start_ms=start_ms))
            elif isinstance(event, UtteranceEnd) and self._open is not None:
                self._open.end_sample = event.end_sample
                self._open.decode_end_sample = event.decode_end_sample
                self._closed.append(self._open)
                self._open = None
                if not event.capped:
                    self._outbox.append(SpeechStopped(end_ms=samples_to_ms(event.end_sample)))

    def _detect_samples_of(self, utt: _Utterance) -> int:
        """Audio an utterance needs before its language is decided (see StreamConfig)."""
        hinted = self._language is not None and not utt.detect_longer
        return self._detect_hinted_samples if hinted else self._detect_samples

    def _early_final_due(self) -> int | None:
        """The audio end of the early final to ask for now: the open utterance has been silent
        for `final_tail_ms` and none was asked for this pause yet (see the module docstring)."""
        utt = self._open
        if utt is None or not self._early_finals or self._closed:
            return None
        pause_sample = self._segmenter.pause_sample
        if pause_sample is None or pause_sample == utt.early_end_sample:
            return None
        return pause_sample

    def _partial_due(self) -> bool:
        """The open utterance (if any) is due for a partial."""
        utt = self._open
        if utt is None or not self._partials:
            return False
        if self._segmenter.silent_samples >= self._pause_samples:
            return False  # the speaker paused: the early final is near (see _PAUSE_MS)
        end = self._buffer.end_sample
        if end - utt.start_sample > self._partial_limit_samples:
            return False
        if utt.language is None and end - utt.start_sample < self._detect_samples_of(utt):
            return False  # too little audio to tell its language: no partial yet
        since = end - max(utt.partial_end_sample, utt.start_sample)
        return since >= self._partial_interval_samples

    def _request(self, utt: _Utterance, kind: DecodeKind, end: int) -> DecodeRequest:
        """A decode of the utterance so far, in a window that starts at earlier committed audio
        (see context.py), forced to begin with the context's text and the stable words. A final
        with context gets `context_beam_size`: CTranslate2 runs every forced token as a full
        beam step, and conditioned on the conversation a narrower beam was as accurate."""
        window = (
            self._final_window_samples if kind is DecodeKind.FINAL else self._partial_window_samples
        )
        stable = utt.agreement.committed
        forced = stable if kind is DecodeKind.PARTIAL else ()
        context = self._context.for_decode(
            utterance_start=utt.start_sample,
            lead_sample=utt.lead_sample,
            end_sample=end,
            window_samples=window,
            forced=join_units(forced),
            alone=kind is DecodeKind.FINAL and utt.alone,
        )
        if kind is DecodeKind.PARTIAL:
            beam = self._stream.partial_beam_size
        elif context.prefix:
            beam = self._stream.context_beam_size
        else:
            beam = self._stream.final_beam_size
        language = utt.language
        if language is None and kind is DecodeKind.FINAL and self._too_short_to_switch(utt, end):
            language = self._language
        gate_from: int | None = None
        if not utt.speech_confirmed:
            gate_from = utt.start_sample
            if kind is DecodeKind.PARTIAL:
                gate_from = max(gate_from, end - ms_to_samples(_PARTIAL_GATE_MS))
            gate_from -= context.start_sample
        return DecodeRequest(
            utterance=utt.index,
            start_sample=utt.start_sample,
            speech_start_sample=utt.speech_start_sample,
            stable_words=stable,
            forced_words=forced,
            # Only a final's text is assembled from them (keep_stable).
            following_words=utt.agreement.following if kind is DecodeKind.FINAL else (),
            engine_request=EngineRequest(
                audio=self._buffer.view(context.start_sample, end),
                kind=kind,
                language=language,
                language_hint=self._language,
                switch_language=self._switch[0],
                switch_nats=self._switch[1],
                candidates=self._params.candidates,
                detect_from_sample=utt.start_sample - context.start_sample,
                task=self._params.task,
                prompt=context.prompt,
                prefix=join_texts((context.prefix, join_units(forced))),
                stream_prompt=self._params.prompt or "",
                beam_size=beam,
                speech_from_sample=gate_from,
                end_sample=end,
            ),
        )

    def _is_hallucination(self, request: DecodeRequest, result: EngineResult) -> bool:
        """Whisper's rules (silent-looking and unsure, or too repetitive: a loop the engine
        stopped is too), plus sparse-and-unsure text over long audio, and text without a single
        letter or digit."""
        cfg = self._stream
        if not has_word(result.text):
            return True
        words = len(request.forced_words) + len(units(result.text))
        silent = (
            result.no_speech_prob > cfg.no_speech_threshold
            and result.avg_logprob < cfg.logprob_threshold
        )
        # From the first voiced frame: the pre-roll would make a short, slow phrase (two Arabic
        # words in 2.2 s) look like long sparse noise.
        duration_s = (request.end_sample - request.speech_start_sample) / SAMPLE_RATE_HZ
        # Partials are judged without the minimum duration: a wrong partial only delays text,
        # while a ghost partial over music would show captions where there are none.
        long_enough = request.kind is DecodeKind.PARTIAL or duration_s >= cfg.sparse_min_s
        sparse = (
            long_enough
            and words < cfg.sparse_words_per_s * duration_s
            and result.avg_logprob < cfg.sparse_logprob_threshold
        )
        repetitive = result.looped or result.compression_ratio > cfg.compression_ratio_threshold
        return silent or sparse or repetitive

    def _take_language(self, utt: _Utterance, request: DecodeRequest, result: EngineResult) -> bool:
        """Decide the utterance's language from the decode that detected it; False when that
        decode's text is not to be used:
        - a partial's detection on the first second found another language, or kept the
          session's without being sure of it: the utterance is detected again on
          `language_detect_s` of audio (`_SURE_SAME_LANGUAGE`; a final decides in any case);
        - the language changed and the decode had the old language's text as context, which
          Whisper goes on writing in (Japanese speech came out as English): the next decode,
          in the language now decided, has no such context."""
        assert result.language is not None
        if (
            request.kind is DecodeKind.PARTIAL
            and not utt.detect_longer
            and (
                result.language != self._language
                or result.language_probability < _SURE_SAME_LANGUAGE
            )
            and self._too_short_to_switch(utt, request.end_sample)
        ):
            utt.detect_longer = True
            return False
        if request.engine_request.language is None:  # detected: else no evidence either way
            utt.switch = (result.switch_language, result.switch_nats)
        changed = self._decide_language(utt, result.language)
        return not (changed and (request.engine_request.prefix or request.engine_request.prompt))

    def _too_short_to_switch(self, utt: _Utterance, end_sample: int) -> bool:
        """Whether the utterance's audio up to `end_sample` is too little to leave the session's
        language on (the comment after `_SURE_SAME_LANGUAGE`); False while there is none."""
        return self._language is not None and end_sample - utt.start_sample < self._detect_samples

    def _decide_language(self, utt: _Utterance, language: str) -> bool:
        """An utterance's language is decided by its first decode and never changes (no
        flapping within an utterance). One in another language than the conversation so far
        does not continue its context: neither prefix nor prompt, both in the wrong language.
        True when the language changed."""
        utt.language = language
        if self._language is not None and language != self._language:
            self._context.start_over()
            return True
        return False

    def _segment_of(self, utt: _Utterance) -> int:
        if utt.segment is None:
            utt.segment = self._segments
            self._segments += 1
        return utt.segment

    def _sure_units(
        self, request: DecodeRequest, probs: Sequence[float], new_units: Sequence[str]
    ) -> int | None:
        """How many leading units of a partial the decoder was sure of: the forced ones, then
        the decoded ones before the first below `stable_min_probability` (None: not known)."""
        floor = self._stream.stable_min_probability
        if floor <= 0 or not new_units or not probs:
            return None
        sure = next((i for i, p in enumerate(probs) if p < floor), len(probs))
        return len(request.forced_words) + sure

    def _show_partial(
        self, utt: _Utterance, request: DecodeRequest, text: str, sure: int | None
    ) -> None:
        split = utt.agreement.update(text, sure)
        utt.rev += 1
        stable = join_units(split.stable)
        self._outbox.append(
            Partial(
                segment=self._segment_of(utt),
                rev=utt.rev,
                start_ms=samples_to_ms(request.start_sample),
                end_ms=samples_to_ms(request.end_sample),
                stable=stable,
                separator=separator(stable, split.unstable[0] if split.unstable else ""),
                unstable=join_units(split.unstable),
                language=utt.language,
            )
        )

    def _take_final(
        self, utt: _Utterance | None, request: DecodeRequest, text: str, result: EngineResult
    ) -> None:
        """A final decode's text: the final of its ended utterance when it decoded that
        utterance's audio; an early final's, kept while the speaker is still silent; else
        (the speaker went on after an early final) nothing. Either may be asked for again
        alone instead (`_ask_again_alone`)."""
        if utt is None:
            return
        early = utt is self._open
        wanted_end = self._segmenter.pause_sample if early else utt.decode_end_sample
        if request.end_sample != wanted_end or self._ask_again_alone(utt, request, text, result):
            return
        if early:
            utt.early = (request, text)
            # Words that end a sentence (or no words: nothing to go on with) let the pause end
            # the utterance at the endpoint; others wait for the longer one (VadConfig).
            if ends_sentence(text) or not has_word(text):
                self._handle_vad(self._segmenter.sentence_ended(request.end_sample))
                self._finish_answered()  # ended by this: its final is this decode's
        else:
            self._finish(self._closed.popleft(), request, decoded=text)

    def _ask_again_alone(
        self, utt: _Utterance, request: DecodeRequest, text: str, result: EngineResult
    ) -> bool:
        """Ask for the utterance's final again without context, and say so, when this one was
        decoded after earlier finals (or prompted with them) and

        - decoded to nothing though the utterance's partials had shown words, or wrote only
          punctuation after a forced prefix. Conditioned on the conversation, Whisper can end
          at once (a Japanese turn decoded to "。" after the turn before it, closing the
          context's sentence), and the words the reader saw would go with the final. An
          utterance that showed no words and whose decode wrote nothing at all is not asked
          again: it may be noise, which Whisper alone may caption;
        - or wrote the context's last words again, once or more, and nothing else: Whisper
          conditioned on a sentence can hear the next one as that sentence (in a Japanese
          session spoken fast, every turn after the second came out as the second), and each
          such final, forced into the next decode, makes the next one likelier. A speaker who
          did say the same again gets it from the decode alone;
        - or wrote words but ran out of tokens after a forced prefix (`EngineResult.truncated`;
          the filters drop a loop that ran out, which the first rule then covers): the prefix
          counts in the decode's budget (`engines.new_token_budget`), and in a script of about
          a token per character (Chinese, Japanese) the context's characters leave a long
          utterance too few; its last words would be lost. Alone it has the whole budget."""
        engine_request = request.engine_request
        if utt.alone or not (engine_request.prefix or engine_request.prompt):
            return False
        wrote = result.text.strip()
        closed_only = bool(wrote) and only_punctuation(wrote) and bool(engine_request.prefix)
        lost = not text and (utt.segment is not None or closed_only)
        # A truncated decode the filters dropped (text "") was a loop, not a long utterance.
        cut_short = bool(text) and result.truncated and bool(engine_request.prefix)
        if not (lost or cut_short or repeats_the_end_of(text, engine_request.prefix)):
            return False
        utt.alone = True
        utt.early_end_sample = 0  # an early final: due again while the speaker stays silent
        return True

    def _finish_answered(self) -> None:
        """Send the final of each ended utterance whose early final decoded its audio."""
        while self._closed and (early := self._closed[0].early) is not None:
            request, text = early
            if request.end_sample != self._closed[0].decode_end_sample:
                break
            self._finish(self._closed.popleft(), request, decoded=text)
        self._maybe_done()

    def _finish(self, utt: _Utterance, request: DecodeRequest, decoded: str) -> None:
        """Send the utterance's final: its stable words, then the decode's words after them;
        the decode's own text is what later decodes continue from."""
        assert utt.end_sample is not None
        text = keep_stable(request.stable_words, decoded, request.following_words)
        # An utterance that showed nothing and decoded to nothing leaves no trace; one that
        # showed partials always gets its one final, possibly empty, so clients clear it, and
        # so does one a finalize ended, so the client has its answer.
        if text or utt.segment is not None or utt.finalized:
            self._outbox.append(
                Final(
                    segment=self._segment_of(utt),
                    start_ms=samples_to_ms(request.start_sample),
                    end_ms=samples_to_ms(utt.end_sample),
                    text=text,
                    language=utt.language,
                )
            )
        self._context.commit(
            CommittedFinal(
                start_sample=request.start_sample, end_sample=request.end_sample, text=decoded
            )
        )
        # Only a caption says what the conversation is in: an utterance of noise that Whisper
        # heard as Welsh and decoded to nothing must not hold the next one to Welsh.
        if text:
            self._language = utt.language or self._language
            if utt.switch is not None:
                self._switch = utt.switch
        self._trim_buffer()

    def _maybe_done(self) -> None:
        if self.state is SessionState.ENDING and self._in_flight is None and not self._closed:
            self.state = SessionState.DONE
            self._outbox.append(Done(audio_ms=self.audio_ms, segments=self._segments))
            # No decode reads the audio again, and a done session may be held for minutes (a
            # resume replays its finals): its buffer goes now, not when it is let go.
            self._buffer = AudioBuffer(self._buffer.end_sample)
