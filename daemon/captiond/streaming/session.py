"""StreamSession: one audio stream's state machine, from PCM bytes to caption messages.

Sans-I/O: no sockets, no clock, no engine. The connection handler (server/daemon.py, event-loop
thread)
feeds it audio and control messages, asks it for the next decode request, hands back the result,
and sends whatever messages it produced. At most one request is in flight per session; finals go
before partials, and a partial is only asked for once `partial_interval_ms` of new audio arrived,
so under load partials simply come less often.

Every decode continues the session's transcript (streaming/context.py): its window reaches back over
earlier finals' audio and their decoded text is forced as Whisper's prefix, so only new words
come back. Partials also force the utterance's stable words. Finals do not (partial-quality
words would spread into every later decode); the final sent keeps the stable words verbatim and
takes the rest from the decode (stabilize.keep_stable), so it never contradicts them. A final
that decodes to nothing after its context (though partials showed words, or writing only
punctuation), that only repeats its context's last words, or that ran out of tokens after its
context's prefix, is decoded again without it (filters.ask_again_alone).

A final's decode covers its utterance up to `final_tail_ms` of silence (streaming/vad.py), so it can
start before the endpoint confirms the utterance over: an early final. If the endpoint comes
with no speech in between, its result is the final; if the speaker goes on, it is dropped. Its
text also sets the endpoint: a pause after words that end no sentence ends the utterance only at
`unfinished_endpoint_silence_ms`, so a sentence a speaker pauses in is decoded whole.

With `[vad] end_of_turn = "model"` (or the stream's own setting) the session asks the
end-of-turn model first, at the pause's first `end_of_turn_pause_ms`: a turn request, answered
before any decode. A turn that is over ends the utterance at the pause, and its final is the
next decode; otherwise the pause's early final follows and the pause may last
`max_turn_silence_ms`. With `[stream] context_across_turns` false, the utterance after a turn
the model ended is decoded without the earlier finals as its forced prefix.

A diarized session (`?diarize=true`, `[stream] diarize`) asks for speaker embeddings of
windows over the utterance's voiced stretches (the VAD keeps them): each partial's decode for
the windows that filled since the last, its final's for the rest, so that a final waits for
one or two windows' embedding, not the utterance's. It sends the final as one final per
speaker, each with its `speaker` (streaming/speakers.py). With `[stream]
cut_at_speaker_change` a change of voice the partials' windows hear while the utterance goes on
ends it there (`_cut_at_speaker_change`).
"""

from __future__ import annotations

import dataclasses
import enum
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from itertools import count

import numpy as np

from captiond.config import Config, VadConfig
from captiond.engines.base import TURN_WINDOW_SAMPLES, DecodeKind, EngineRequest, EngineResult
from captiond.errors import BadMessageError
from captiond.lang.chinese import written
from captiond.lang.languages import LanguageSetting
from captiond.lang.text import (
    continues_with_hyphen,
    ends_sentence,
    has_word,
    join_texts,
    join_units,
    only_punctuation,
    separator,
    units,
    with_marks,
    written_after,
)
from captiond.samples import AudioBuffer, Pcm16, Samples, ms_to_samples, samples_to_ms
from captiond.streaming.audio import Framer, Resampler, decode_pcm, read_pcm16, to_pcm16
from captiond.streaming.context import CommittedFinal, TranscriptContext
from captiond.streaming.events import (
    Control,
    Done,
    Final,
    Partial,
    ServerMessage,
    SpeechStarted,
    SpeechStopped,
    StreamParams,
    TurnParams,
)
from captiond.streaming.filters import ask_again_alone, is_hallucination
from captiond.streaming.language import SessionLanguage
from captiond.streaming.speakers import (
    SpeakerTracker,
    by_speaker,
    live_change,
    speaker_windows,
    speech_in,
)
from captiond.streaming.stabilize import LocalAgreement, keep_stable
from captiond.streaming.utterance import DecodeRequest, StreamOrigin, Utterance
from captiond.streaming.vad import UtteranceEnd, UtteranceStart, Vad, VadEvent, VadSegmenter
from captiond.streaming.words import final_words
from captiond.whisper import SAMPLE_RATE_HZ

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


class SessionState(enum.Enum):
    STREAMING = "streaming"
    ENDING = "ending"  # `end` received: flushing the last finals
    DONE = "done"


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
            Resampler(params.sample_rate_hz) if params.sample_rate_hz != SAMPLE_RATE_HZ else None
        )
        self._buffer = AudioBuffer(origin.start_sample)
        # The latest final's end: the next final's words start no earlier (streaming/words.py).
        self._final_end_ms = samples_to_ms(origin.start_sample)
        self._framer = Framer()
        self._vad_config = config.vad
        self._segmenter = VadSegmenter(
            vad, self._turn_settings(params.turn), config.stream, origin.start_sample
        )
        # An early final says whether a pause ended the turn (_take_final).
        self._segmenter.waits_for_verdicts = early_finals
        self._partial_interval_samples = ms_to_samples(config.stream.partial_interval_ms)
        self._pause_samples = ms_to_samples(min(_PAUSE_MS, config.vad.final_tail_ms))
        # Partials stop where a capped utterance may be cut (streaming/vad.py: the quietest frame
        # of the last `cut_search_s`): a word stabilised beyond the cut would belong to the next
        # segment, and its final would either contradict it or repeat it.
        self._partial_limit_samples = ms_to_samples(
            round((config.stream.max_utterance_s - config.stream.cut_search_s) * 1000)
        )
        self._utterances = count()
        self._open: Utterance | None = None
        self._closed: deque[Utterance] = deque()
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
        self._language = SessionLanguage(config.stream, params, origin.language)
        diarize = config.stream.diarize if params.diarize is None else params.diarize
        max_speakers = params.max_speakers or config.stream.max_speakers
        self._speakers = SpeakerTracker(max_speakers=max_speakers) if diarize else None
        self._segmenter.keeps_voiced = diarize
        # Only a session that cuts at a speaker change looks for the quietest frame of one.
        self._segmenter.keeps_levels = diarize and config.stream.cut_at_speaker_change
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
        self._language.set(setting, self._params)

    def set_prompt(self, prompt: str) -> None:
        """Prompt the decodes from the next one on with `prompt` (names, terms; "" for none),
        a session update of a vendor API."""
        self._params = dataclasses.replace(self._params, prompt=prompt)

    def set_turn(self, turn: TurnParams) -> None:
        """End turns as `turn` says from now on (a session update of a vendor API)."""
        self._params = dataclasses.replace(self._params, turn=turn)
        self._segmenter.set_endpoints(self._turn_settings(turn))

    def _turn_settings(self, turn: TurnParams) -> VadConfig:
        """The daemon's [vad] with the stream's own turn settings. Without early finals there
        is no decode at a pause to ask the end-of-turn model with: turns end at silence."""
        vad = turn.applied_to(self._vad_config)
        if not self._early_finals and vad.end_of_turn == "model":
            vad = dataclasses.replace(vad, end_of_turn="silence")
        self._turn_vad = vad
        return vad

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
            if self._segmenter.by_model and self._open.turn_asked_sample != pause_sample:
                # The verdict first: a turn that is over makes its final due at once.
                self._open.turn_asked_sample = pause_sample
                req = self._turn_request(self._open, pause_sample)
            else:
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
        if request.kind is DecodeKind.TURN:
            self._take_verdict(request, result)
            return
        utt = self._closed[0] if self._closed else self._open
        if utt is not None and utt.index != request.utterance:
            utt = None  # a partial of an utterance whose final was sent meanwhile
        if utt is not None and len(result.speaker_embeddings) == len(request.embed_spans):
            utt.embedded.update(zip(request.embed_spans, result.speaker_embeddings, strict=True))
            cuts = self._stream.cut_at_speaker_change
            if cuts and request.kind is DecodeKind.PARTIAL and request.embed_spans:
                self._cut_at_speaker_change(utt)
        if utt is not None:
            if result.text.strip():
                utt.speech_confirmed = True
            # A result without a language (the speech gate found no speech) decides nothing.
            if utt.language is None and result.language is not None:
                changed = self._language.take(utt, request, result)
                if changed:
                    self._context.start_over()
                engine_request = request.engine_request
                if changed is None or (
                    changed and (engine_request.prefix or engine_request.prompt)
                ):
                    self._maybe_done()  # this decode's text is not used
                    return
        new = "" if is_hallucination(request, result, self._stream) else result.text.strip()
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
                self._open = Utterance(
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
                if not event.cut:
                    self._outbox.append(SpeechStopped(end_ms=samples_to_ms(event.end_sample)))

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
        if utt.language is None and end - utt.start_sample < self._language.detect_samples_of(utt):
            return False  # too little audio to tell its language: no partial yet
        since = end - max(utt.partial_end_sample, utt.start_sample)
        return since >= self._partial_interval_samples

    def _cut_at_speaker_change(self, utt: Utterance) -> None:
        """End the open utterance where its windows so far change voice (`live_change`), so
        that the first speaker's final comes now, not when the second stops: a speaker change
        ends a turn. Its partials may have made the next speaker's first words stable before
        the change was heard (2 windows are 2.25 s of them): its final is decoded afresh, not
        from its stable words, and those words come in the next segment's final, with their
        speaker (docs/reference/protocol-v1.md)."""
        assert self._speakers is not None
        voiced = self._segmenter.voiced(utt.speech_start_sample, self._buffer.end_sample)
        windows = [span for span in speaker_windows(voiced, growing=True) if span in utt.embedded]
        vectors = [utt.embedded[span] for span in windows]
        at = live_change(vectors, self._speakers.change_similarity)
        if at is None or not self._speakers.tells_apart(vectors[:at], vectors[at:]):
            return
        (before_start, before_end), (after_start, after_end) = windows[at - 1], windows[at]
        closed = len(self._closed)
        self._handle_vad(
            self._segmenter.cut((before_start + before_end) // 2, (after_start + after_end) // 2)
        )
        if len(self._closed) > closed:
            part = self._closed[-1]
            part.agreement = LocalAgreement(self._stream.stable_hold_back_words)
            part.turn_over = self._segmenter.by_model

    def _turn_request(self, utt: Utterance, end: int) -> DecodeRequest:
        """The end-of-turn model's verdict on the utterance up to the pause at `end` (its last
        `TURN_WINDOW_SAMPLES`, the model's input), asked before the pause's early final."""
        start = max(utt.start_sample, end - TURN_WINDOW_SAMPLES)
        return DecodeRequest(
            utterance=utt.index,
            start_sample=utt.start_sample,
            speech_start_sample=utt.speech_start_sample,
            stable_words=(),
            forced_words=(),
            engine_request=EngineRequest(
                audio=self._buffer.view(start, end), kind=DecodeKind.TURN, end_sample=end
            ),
        )

    def _request(self, utt: Utterance, kind: DecodeKind, end: int) -> DecodeRequest:
        """A decode of the utterance so far, in a window that starts at earlier committed audio
        (see streaming/context.py), forced to begin with the context's text and the stable words. A
        final with context gets `context_beam_size`: CTranslate2 runs every forced token as a full
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
        language = self._language.for_decode(utt, kind, end)
        gate_from: int | None = None
        if not utt.speech_confirmed:
            gate_from = utt.start_sample
            if kind is DecodeKind.PARTIAL:
                gate_from = max(gate_from, end - ms_to_samples(_PARTIAL_GATE_MS))
            gate_from -= context.start_sample
        spans: tuple[tuple[int, int], ...] = ()
        embed: tuple[tuple[int, int], ...] = ()
        if self._speakers is not None and kind is DecodeKind.FINAL:
            spans = speaker_windows(self._segmenter.voiced(utt.speech_start_sample, end))
            embed = tuple(span for span in spans if span not in utt.embedded)
        elif self._speakers is not None:
            # The windows that filled since the last partial: embedded beside the partial's
            # decode on the CPU (decoding/scheduler.py), and heard for a change with the cut.
            voiced = self._segmenter.voiced(utt.speech_start_sample, end)
            embed = tuple(
                span for span in speaker_windows(voiced, growing=True) if span not in utt.embedded
            )
        return DecodeRequest(
            utterance=utt.index,
            start_sample=utt.start_sample,
            speech_start_sample=utt.speech_start_sample,
            stable_words=stable,
            forced_words=forced,
            # Only a final's text is assembled from them (keep_stable).
            following_words=utt.agreement.following if kind is DecodeKind.FINAL else (),
            speaker_spans=spans,
            embed_spans=embed,
            engine_request=EngineRequest(
                audio=self._buffer.view(context.start_sample, end),
                kind=kind,
                language=language,
                language_hint=self._language.language,
                switch_language=self._language.switch[0],
                switch_nats=self._language.switch[1],
                candidates=self._params.candidates,
                detect_from_sample=utt.start_sample - context.start_sample,
                task=self._params.task,
                prompt=context.prompt,
                prefix=join_texts((context.prefix, join_units(forced))),
                stream_prompt=self._params.prompt or "",
                beam_size=beam,
                speech_from_sample=gate_from,
                end_sample=end,
                speaker_windows=tuple(
                    (start - context.start_sample, stop - context.start_sample)
                    for start, stop in embed
                ),
            ),
        )

    def _segment_of_part(self) -> int:
        """The segment number of a diarized final's second part (a speaker change)."""
        self._segments += 1
        return self._segments - 1

    def _segment_of(self, utt: Utterance) -> int:
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
        self, utt: Utterance, request: DecodeRequest, text: str, sure: int | None
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
                end_of_turn=utt.turn_probability,
            )
        )

    def _take_final(
        self, utt: Utterance | None, request: DecodeRequest, text: str, result: EngineResult
    ) -> None:
        """A final decode's text: the final of its ended utterance when it decoded that
        utterance's audio; an early final's, kept while the speaker is still silent; else
        (the speaker went on after an early final) nothing. Either may be asked for again
        alone instead (filters.ask_again_alone)."""
        if utt is None:
            return
        early = utt is self._open
        wanted_end = self._segmenter.pause_sample if early else utt.decode_end_sample
        if request.end_sample != wanted_end or ask_again_alone(utt, request, text, result):
            return
        if not text:
            result = dataclasses.replace(result, words=())
        if early:
            utt.early = (request, text, result)
            if self._turn_over(text):
                self._handle_vad(self._segmenter.turn_ended(request.end_sample))
                self._finish_answered()  # ended by this: its final is this decode's
        else:
            self._finish(self._closed.popleft(), request, decoded=text, result=result)

    def _take_verdict(self, request: DecodeRequest, result: EngineResult) -> None:
        """The end-of-turn model's verdict on the open utterance's pause: at the threshold or
        above, the turn ended there, and the utterance with it (now, or at the endpoint:
        streaming/vad.py); below it (or no verdict: a model that failed) the pause's early
        final is asked next, and the pause may last `max_turn_silence_ms`."""
        probability = result.turn_probability
        if probability is not None:
            for judged in (self._open, *self._closed):
                if judged is not None and judged.index == request.utterance:
                    judged.turn_probability = probability  # clients see it (Partial, Final)
        if probability is not None and probability >= self._turn_vad.end_of_turn_threshold:
            closed = len(self._closed)
            self._handle_vad(self._segmenter.turn_ended(request.end_sample))
            if len(self._closed) > closed:
                self._closed[-1].turn_over = True
        self._maybe_done()

    def _turn_over(self, text: str) -> bool:
        """Whether an early final's words end the turn at the pause it decoded up to, so that
        the endpoint ends the utterance there; if not, it waits for the longer one
        (VadConfig): words that end a sentence, or no words (nothing to go on with). With
        [vad] end_of_turn = "model" the model judged the pause before (`_take_verdict`), and
        the words decide only with `sentence_ends_turn`."""
        if self._segmenter.by_model and not self._turn_vad.sentence_ends_turn:
            return False
        return ends_sentence(text) or not has_word(text)

    def _finish_answered(self) -> None:
        """Send the final of each ended utterance whose early final decoded its audio."""
        while self._closed and (early := self._closed[0].early) is not None:
            request, text, result = early
            if request.end_sample != self._closed[0].decode_end_sample:
                break
            self._finish(self._closed.popleft(), request, decoded=text, result=result)
        self._maybe_done()

    def _finish(
        self,
        utt: Utterance,
        request: DecodeRequest,
        decoded: str,
        result: EngineResult | None = None,
    ) -> None:
        """Send the utterance's final: its stable words, then the decode's words after them,
        each with its time and confidence from the decode's word timings (streaming/words.py)
        and, diarized, its speaker (one final per speaker's run of words); the decode's own
        text is what later decodes continue from."""
        assert utt.end_sample is not None
        text = keep_stable(request.stable_words, decoded, request.following_words)
        end_ms = samples_to_ms(utt.end_sample)
        start_ms, words = final_words(
            text,
            result.words if result is not None else (),
            window_start_sample=request.end_sample - len(request.engine_request.audio),
            floor_ms=self._final_end_ms,
            start_ms=samples_to_ms(request.start_sample),
            end_ms=end_ms,
        )
        # An utterance that showed nothing and decoded to nothing leaves no trace; one that
        # showed partials always gets its one final, possibly empty, so clients clear it, and
        # so does one a finalize ended, so the client has its answer.
        if text or utt.segment is not None or utt.finalized:
            final = Final(
                segment=self._segment_of(utt),
                start_ms=start_ms,
                end_ms=end_ms,
                text=text,
                language=utt.language,
                words=words,
                end_of_turn=utt.turn_probability,
            )
            if self._speakers is not None:
                heard = self._segmenter.voiced(utt.start_sample, utt.end_sample)
                final = dataclasses.replace(
                    final,
                    speech=speech_in(
                        ((samples_to_ms(a), samples_to_ms(b)) for a, b in heard), start_ms, end_ms
                    ),
                )
                spans = [span for span in request.speaker_spans if span in utt.embedded]
                labels = self._speakers.label([utt.embedded[span] for span in spans])
                parts = by_speaker(final, spans, labels)
                # The model judged the pause after the last part; a speaker change ends the others.
                parts[:-1] = [dataclasses.replace(part, end_of_turn=None) for part in parts[:-1]]
                first, *rest = parts
                self._outbox.append(first)
                self._outbox += [
                    dataclasses.replace(part, segment=self._segment_of_part()) for part in rest
                ]
            else:
                self._outbox.append(final)
            self._final_end_ms = end_ms
        self._context.commit(
            CommittedFinal(
                start_sample=request.start_sample, end_sample=request.end_sample, text=decoded
            )
        )
        if utt.turn_over and not self._stream.context_across_turns:
            # The next turn is decoded after this one's audio, its text the prompt, not a
            # forced prefix: a CPU forces a prefix one beam step per token.
            self._context.break_context()
        self._language.on_final(utt, text)
        self._trim_buffer()

    def _maybe_done(self) -> None:
        if self.state is SessionState.ENDING and self._in_flight is None and not self._closed:
            self.state = SessionState.DONE
            self._outbox.append(Done(audio_ms=self.audio_ms, segments=self._segments))
            # No decode reads the audio again, and a done session may be held for minutes (a
            # resume replays its finals): its buffer goes now, not when it is let go.
            self._buffer = AudioBuffer(self._buffer.end_sample)
