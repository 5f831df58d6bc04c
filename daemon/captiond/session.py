"""StreamSession: one audio stream's state machine, from PCM bytes to caption messages.

Sans-I/O: no sockets, no clock, no engine. The connection handler (server.py, event-loop thread)
feeds it audio and control messages, asks it for the next decode request, hands back the result,
and sends whatever messages it produced. At most one request is in flight per session; finals go
before partials, and a partial is only asked for once `partial_interval_ms` of new audio arrived,
so under load partials simply come less often.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from itertools import count

import numpy as np

from captiond import SAMPLE_RATE_HZ
from captiond.audio import (
    AudioBuffer,
    Framer,
    Resampler,
    Samples,
    decode_pcm,
    ms_to_samples,
    samples_to_ms,
)
from captiond.config import Config
from captiond.engines import DecodeKind, EngineRequest, EngineResult
from captiond.errors import BadMessageError
from captiond.protocol import (
    Control,
    Done,
    Final,
    Partial,
    ServerMessage,
    SpeechStarted,
    SpeechStopped,
    StreamParams,
)
from captiond.stabilize import LocalAgreement
from captiond.vad import UtteranceEnd, UtteranceStart, Vad, VadEvent, VadSegmenter

# Audio kept behind the stream's end while no utterance is open: the segmenter may open one
# up to pre-roll + start window before the current frame.
_KEEP_BEHIND_MS = 2_000


class SessionState(enum.Enum):
    STREAMING = "streaming"
    ENDING = "ending"  # `end` received: flushing the last finals
    DONE = "done"


@dataclass(frozen=True, slots=True, kw_only=True)
class DecodeRequest:
    """A decode the session wants, with the span of stream audio it covers."""

    utterance: int
    start_sample: int
    end_sample: int
    engine_request: EngineRequest

    @property
    def kind(self) -> DecodeKind:
        return self.engine_request.kind


@dataclass(slots=True, kw_only=True)
class _Utterance:
    index: int  # internal, per session; segment numbers are given when first shown
    start_sample: int
    end_sample: int | None = None
    segment: int | None = None
    rev: int = 0
    partial_end_sample: int = 0  # audio end covered by the latest partial request
    agreement: LocalAgreement = field(default_factory=LocalAgreement)


class StreamSession:
    def __init__(
        self, *, config: Config, vad: Vad, params: StreamParams, partials: bool = True
    ) -> None:
        self._stream = config.stream
        self._partials = partials
        self._params = params
        self._resampler = (
            Resampler(params.sample_rate_hz) if params.sample_rate_hz != 16_000 else None
        )
        self._buffer = AudioBuffer()
        self._framer = Framer()
        self._segmenter = VadSegmenter(vad, config.vad, config.stream)
        self._partial_interval_samples = ms_to_samples(config.stream.partial_interval_ms)
        self._utterances = count()
        self._open: _Utterance | None = None
        self._closed: deque[_Utterance] = deque()
        self._in_flight: DecodeRequest | None = None
        self._outbox: list[ServerMessage] = []
        self._finals_text: list[str] = []
        self._segments = 0
        self.state = SessionState.STREAMING

    # -- input -------------------------------------------------------------------------------

    def receive_audio(self, data: bytes) -> None:
        if self.state is not SessionState.STREAMING:
            raise BadMessageError("audio after 'end': the stream is closed")
        samples = decode_pcm(data, self._params.encoding)
        if self._resampler is not None:
            samples = self._resampler.process(samples)
        self._push_samples(samples)

    def receive_samples(self, samples: Samples) -> None:
        """Take float32 samples already at 16 kHz (offline files, daemon-side capture)."""
        if self.state is not SessionState.STREAMING:
            raise BadMessageError("audio after 'end': the stream is closed")
        self._push_samples(samples)

    def receive_control(self, control: Control) -> None:
        if control is Control.KEEPALIVE:
            return
        if self.state is not SessionState.STREAMING:
            raise BadMessageError(f"{control.value!r} after 'end'")
        if control is Control.END and self._resampler is not None:
            self._push_samples(self._resampler.process(np.zeros(0, np.float32), last=True))
        self._handle_vad(self._segmenter.flush(self._buffer.end_sample))
        if control is Control.END:
            self.state = SessionState.ENDING
            self._maybe_done()

    # -- decoding ----------------------------------------------------------------------------

    def next_request(self) -> DecodeRequest | None:
        """The decode to run now, or None (one already in flight, or nothing is due)."""
        if self._in_flight is not None:
            return None
        if self._closed:
            utt = self._closed[0]
            assert utt.end_sample is not None
            req = self._request(utt, DecodeKind.FINAL, utt.end_sample, self._stream.final_beam_size)
        elif self._partials and self._open is not None and self._partial_due(self._open):
            utt = self._open
            utt.partial_end_sample = self._buffer.end_sample
            req = self._request(utt, DecodeKind.PARTIAL, utt.partial_end_sample, 1)
        else:
            return None
        self._in_flight = req
        return req

    def on_result(self, request: DecodeRequest, result: EngineResult) -> None:
        """Take the engine's result for the request returned by `next_request`."""
        assert request is self._in_flight, "results must answer the request in flight"
        self._in_flight = None
        text = "" if self._is_hallucination(request, result) else result.text.strip()
        if request.kind is DecodeKind.FINAL:
            self._finish(self._closed.popleft(), request, text)
        elif self._open is not None and self._open.index == request.utterance and text:
            self._show_partial(self._open, request, text)
        self._maybe_done()

    def abandon(self, request: DecodeRequest) -> None:
        """Forget the partial in flight: its result will never come (a final superseded it)."""
        assert request is self._in_flight and request.kind is DecodeKind.PARTIAL
        self._in_flight = None

    @property
    def final_due(self) -> bool:
        """An utterance has ended and waits for its final decode."""
        return bool(self._closed)

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
    def segments(self) -> int:
        return self._segments

    @property
    def has_open_utterance(self) -> bool:
        return self._open is not None or bool(self._closed)

    # -- internals ---------------------------------------------------------------------------

    def _push_samples(self, samples: Samples) -> None:
        self._buffer.append(samples)
        for frame in self._framer.push(samples):
            self._handle_vad(self._segmenter.push(frame))
        if self._open is None and not self._closed and self._in_flight is None:
            self._buffer.discard_before(self._buffer.end_sample - ms_to_samples(_KEEP_BEHIND_MS))

    def _handle_vad(self, events: Iterable[VadEvent]) -> None:
        for event in events:
            if isinstance(event, UtteranceStart):
                self._open = _Utterance(
                    index=next(self._utterances), start_sample=event.start_sample
                )
                self._outbox.append(SpeechStarted(start_ms=samples_to_ms(event.start_sample)))
            elif isinstance(event, UtteranceEnd) and self._open is not None:
                self._open.end_sample = event.end_sample
                self._closed.append(self._open)
                self._open = None
                self._outbox.append(SpeechStopped(end_ms=samples_to_ms(event.end_sample)))

    def _partial_due(self, utt: _Utterance) -> bool:
        end = self._buffer.end_sample
        since = end - max(utt.partial_end_sample, utt.start_sample)
        return since >= self._partial_interval_samples

    def _prompt(self) -> str:
        text = " ".join(self._finals_text)
        limit = self._stream.prompt_chars
        if len(text) <= limit:
            return text
        tail = text[len(text) - limit :]
        if text[len(text) - limit - 1] == " ":
            return tail
        # Start at a word boundary: a cut word would be a wrong word in the prompt.
        return tail.split(" ", 1)[1] if " " in tail else ""

    def _request(self, utt: _Utterance, kind: DecodeKind, end: int, beam: int) -> DecodeRequest:
        return DecodeRequest(
            utterance=utt.index,
            start_sample=utt.start_sample,
            end_sample=end,
            engine_request=EngineRequest(
                audio=self._buffer.slice(utt.start_sample, end),
                kind=kind,
                language=self._params.language,
                prompt=self._prompt(),
                beam_size=beam,
            ),
        )

    def _is_hallucination(self, request: DecodeRequest, result: EngineResult) -> bool:
        """Whisper's rules (silent-looking and unsure, or too repetitive), plus sparse-and-unsure
        text over long audio, and text without a single letter or digit."""
        cfg = self._stream
        if not any(ch.isalnum() for ch in result.text):
            return True
        silent = (
            result.no_speech_prob > cfg.no_speech_threshold
            and result.avg_logprob < cfg.logprob_threshold
        )
        duration_s = (request.end_sample - request.start_sample) / SAMPLE_RATE_HZ
        # Partials are judged without the minimum duration: a wrong partial only delays text,
        # while a ghost partial over music would show captions where there are none.
        long_enough = request.kind is DecodeKind.PARTIAL or duration_s >= cfg.sparse_min_s
        sparse = (
            long_enough
            and len(result.text.split()) < cfg.sparse_words_per_s * duration_s
            and result.avg_logprob < cfg.sparse_logprob_threshold
        )
        return silent or sparse or result.compression_ratio > cfg.compression_ratio_threshold

    def _segment_of(self, utt: _Utterance) -> int:
        if utt.segment is None:
            utt.segment = self._segments
            self._segments += 1
        return utt.segment

    def _show_partial(self, utt: _Utterance, request: DecodeRequest, text: str) -> None:
        split = utt.agreement.update(text)
        utt.rev += 1
        self._outbox.append(
            Partial(
                segment=self._segment_of(utt),
                rev=utt.rev,
                start_ms=samples_to_ms(request.start_sample),
                end_ms=samples_to_ms(request.end_sample),
                stable=" ".join(split.stable),
                unstable=" ".join(split.unstable),
            )
        )

    def _finish(self, utt: _Utterance, request: DecodeRequest, text: str) -> None:
        # An utterance that showed nothing and decoded to nothing leaves no trace; one that
        # showed partials always gets its one final, possibly empty, so clients clear it.
        if text or utt.segment is not None:
            self._outbox.append(
                Final(
                    segment=self._segment_of(utt),
                    start_ms=samples_to_ms(request.start_sample),
                    end_ms=samples_to_ms(request.end_sample),
                    text=text,
                )
            )
        if text:
            self._finals_text.append(text)
        keep_from = min(
            [u.start_sample for u in self._closed]
            + ([self._open.start_sample] if self._open else [])
            + [self._buffer.end_sample - ms_to_samples(_KEEP_BEHIND_MS)]
        )
        self._buffer.discard_before(keep_from)

    def _maybe_done(self) -> None:
        if self.state is SessionState.ENDING and self._in_flight is None and not self._closed:
            self.state = SessionState.DONE
            self._outbox.append(Done(audio_ms=self.audio_ms, segments=self._segments))
