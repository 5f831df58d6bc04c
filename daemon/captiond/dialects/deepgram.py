"""Deepgram's live transcription API, `/v1/listen`, so that Deepgram's own SDKs (and clients
written to its docs) stream to captiond unchanged. Sans-I/O, one instance per connection, used
on the event-loop thread (server/connection.py calls `receive` and `render`).

Query string: `encoding=linear16` with `sample_rate` (resampled by the daemon) and `channels`
(interleaved; averaged to mono here), `interim_results` (partials become `Results` with
`is_final: false`, which may revise), `punctuate`/`smart_format` (Whisper's text as written;
without them words are lower case without punctuation, as Deepgram's are), `endpointing=false`
(no `speech_final`), `vad_events` (`SpeechStarted`), `utterance_end_ms` (an `UtteranceEnd` after
each final with words, except one forced by `Finalize`), `language` (its primary subtag, and for
Chinese the script: `zh-TW`, `zh-CN`; `multi` asks for detection; `en,de`, which Deepgram does
not take, detection among those), `keyterm` (repeated: the terms, comma-separated, become the
stream's prompt, which Whisper reads before every decode's previous text). `model` and the rest
are accepted and ignored: the daemon's model decodes. Client messages: binary audio (any
chunking), `KeepAlive`, `Finalize`, `CloseStream` (also an empty binary message, Deepgram's
legacy close). On the stream's end, `Metadata`, then close 1000.

Each captiond final is one `Results` with `is_final: true`. Finals come at the daemon's VAD
endpoints, so `speech_final` is true too (and `UtteranceEnd` follows), except for a final
forced by `Finalize` (`from_finalize: true`): one whose utterance ended where the stream stood
at the `Finalize`; and for one cut at `[stream] max_utterance_s` while the speaker went on (no
`speech_stopped` came): `speech_final: false`, no `UtteranceEnd`, no new `SpeechStarted`.
Times are seconds of stream audio.

Words: a final's carry their measured `start`, `end` and `confidence` (Whisper's alignment heads
and token probabilities, streaming/words.py); the alternative's `confidence` is the mean of its
words'; `UtteranceEnd.last_word_end` is the last word's end. Interim results carry no words
(partials are not aligned) and `confidence` 0.0; so does a final word the decode did not write
(kept from its partials). `endpointing=N` (milliseconds) ends the stream's turns at N ms of
silence (`[vad] end_of_turn = "silence"` with `endpoint_silence_ms` N, as Deepgram's endpointing
is a silence length); without it the daemon's `[vad]` decides. `utterance_end_ms` sends an
`UtteranceEnd` after each final a pause ended (at the turn's endpoint, whatever its value). The
idle timeout counts audio only: a stream that sends only `KeepAlive` for `[server]
idle_timeout_s` is closed (1011, `NET-0001`) where Deepgram would keep it.
`diarize=true` diarizes the stream (streaming/speakers.py): each final word has its `speaker`
(an integer from 0, as Deepgram's); a final is one speaker's, so a turn with a speaker change
is two `Results`; interim results have no words, so no speakers.
`Configure` with `keyterms` replaces the key terms from the next decode on (`[]` clears them) and
is answered `ConfigureSuccess`; one with `features` is refused whole with `ConfigureFailure`
(`CONFIGURE_INTERNAL_ERROR`: formatting is fixed at connect), and the stream goes on.
Unsupported: other encodings and containers (no decoder: `DATA-0000`), `multichannel=true` (one
transcript per connection), redaction, `keywords` (Nova-2's boosts, negative ones
included, have no Whisper equivalent; ignored). A query that cannot be served is refused before
the upgrade, with HTTP 400, as Deepgram does; a refused handshake (400, or 401/403 from the
daemon's token and Origin checks) carries Deepgram's error body (`err_code`, `err_msg`,
`request_id`), also in its `dg-error` header, and a `dg-request-id` header (`refusal`).
"""

from __future__ import annotations

import hashlib
import json
import uuid
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from http import HTTPStatus
from typing import Any

import numpy as np

from captiond import __version__
from captiond.dialects import LanguageCheck, Received, any_language
from captiond.dialects.native import Query, parse_stream_params
from captiond.errors import (
    CLOSE_CODES,
    BadAudioError,
    BadMessageError,
    FrameTooLargeError,
    IdleTimeoutError,
    RateLimitedError,
    SessionError,
    close_code_for,
)
from captiond.lang.languages import prompt_of_terms
from captiond.lang.text import join_units, plain_unit, units
from captiond.streaming.events import (
    MAX_TURN_SILENCE_MS,
    Control,
    Done,
    Error,
    Final,
    Partial,
    Ready,
    ServerMessage,
    SpeechStarted,
    SpeechStopped,
    StreamParams,
    TurnParams,
)
from captiond.whisper import SAMPLE_RATE_HZ

# Deepgram's `err_code` for a refused handshake (its error reference); others: the status phrase.
_ERR_CODES = {400: "Bad Request", 401: "INVALID_AUTH"}


def refusal(status: int, message: str) -> tuple[str, dict[str, str]]:
    """Deepgram's answer to a handshake it refuses: the JSON error body and the headers its
    streaming API adds (`dg-error` repeats the body, for websocket libraries that hand an app
    a refused handshake's headers but not its body; `dg-request-id` names the request)."""
    request_id = str(uuid.uuid4())
    code = _ERR_CODES.get(status) or HTTPStatus(status).phrase
    body = json.dumps({"err_code": code, "err_msg": message, "request_id": request_id})
    return body, {
        "Content-Type": "application/json",
        "dg-error": body,
        "dg-request-id": request_id,
    }


# Control messages are a few dozen bytes; a `Configure` with its 500-token keyterms a few KB.
MAX_TEXT_BYTES = 16_384
MAX_CHANNELS = 8
# Deepgram's close codes (its streaming error table) over protocol v1's (standard ones).
_CLOSE_CODES: dict[type[SessionError], int] = {
    **CLOSE_CODES,
    BadAudioError: 1008,
    BadMessageError: 1008,
    RateLimitedError: 1008,
    FrameTooLargeError: 1009,
    IdleTimeoutError: 1011,
}
# Deepgram's names for what it closes a stream for, where it has one.
_VARIANTS = {BadAudioError.code: "DATA-0000", IdleTimeoutError.code: "NET-0001"}
_CONTROLS = {
    "KeepAlive": Control.KEEPALIVE,
    "Finalize": Control.FINALIZE,
    "CloseStream": Control.END,
}


def _flag(query: Mapping[str, str], name: str) -> bool:
    return query.get(name, "").strip().lower() == "true"


def _seconds(ms: int | float) -> float:
    return round(ms / 1000, 3)


def _json(data: dict[str, Any]) -> str:
    return json.dumps(data, ensure_ascii=False, separators=(",", ":"))


@dataclass(frozen=True, slots=True, kw_only=True)
class ListenOptions:
    """What the query string asks of the replies (read leniently: a dialect never raises
    when made; stream_params refuses what cannot be served)."""

    interim_results: bool
    vad_events: bool
    utterance_end: bool
    endpointing: bool
    punctuate: bool
    channels: int  # 0: not a channel count

    @classmethod
    def of(cls, query: Mapping[str, str]) -> ListenOptions:
        channels = query.get("channels", "1")
        return cls(
            interim_results=_flag(query, "interim_results"),
            vad_events=_flag(query, "vad_events"),
            utterance_end="utterance_end_ms" in query,
            endpointing=query.get("endpointing", "").strip().lower() != "false",
            punctuate=_flag(query, "punctuate") or _flag(query, "smart_format"),
            channels=int(channels) if channels.isdecimal() and len(channels) <= 2 else 0,
        )


_MAX_FLUSHES = 64


def _endpointing(value: str | None) -> TurnParams:
    """`endpointing=N`: turns end at N ms of silence (at least one 30-ms VAD frame, at most
    MAX_TURN_SILENCE_MS), as Deepgram's do; `false`, or none, leaves it to the daemon."""
    if value is None or value.strip().lower() in ("false", "true"):
        return TurnParams()
    try:
        silence_ms = int(value)
    except ValueError:
        raise BadMessageError(
            f"endpointing must be false or milliseconds, got {value[:20]!r}"
        ) from None
    silence_ms = min(max(silence_ms, 30), MAX_TURN_SILENCE_MS)
    return TurnParams(
        end_of_turn="silence",
        endpoint_silence_ms=silence_ms,
        unfinished_endpoint_silence_ms=silence_ms,
    )


@dataclass(frozen=True, slots=True)
class _Flush:
    """A Finalize (or CloseStream) the client sent when `at_ms` of audio had arrived."""

    at_ms: int
    finalize: bool


class DeepgramDialect:
    max_text_bytes = MAX_TEXT_BYTES

    def __init__(self, query: Query) -> None:
        self._query = query
        self._options = ListenOptions.of(query)
        self._created = datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")
        self._request_id = ""  # the daemon's session id, from `ready`
        self._model: dict[str, str] = {"name": "", "version": __version__, "arch": ""}
        self._model_uuid = ""
        self._rate_hz = SAMPLE_RATE_HZ
        self._audio_sha256 = hashlib.sha256()
        self._partial_frame = b""  # bytes of a sample frame split across messages
        self._received_frames = 0
        # Bounded: a client flooding Finalize with no speech (no final pops one) would grow it
        # for as long as the stream lives. Losing the oldest loses only a `from_finalize` flag.
        self._flushes: deque[_Flush] = deque(maxlen=_MAX_FLUSHES)
        self._finalized_end_ms: set[int] = set()  # utterance ends forced by a Finalize
        self._stopped_end_ms: set[int] = set()  # utterance ends where speech stopped
        self._multi = False  # language detected (multi, a list): results name it
        self._diarize = False  # diarize=true: words name their speaker

    def stream_params(
        self, default_language: str, can_caption: LanguageCheck = any_language
    ) -> StreamParams:
        query = self._query
        encoding = query.get("encoding")
        if encoding != "linear16":
            raise BadAudioError(
                f"unsupported encoding {encoding!r}: captiond decodes raw audio only, "
                "encoding=linear16 with sample_rate"
            )
        if "sample_rate" not in query:
            raise BadAudioError("sample_rate is required with encoding=linear16")
        if not 1 <= self._options.channels <= MAX_CHANNELS:
            channels = query.get("channels", "")[:20]
            raise BadAudioError(f"channels must be 1..{MAX_CHANNELS}, got {channels!r}")
        if _flag(query, "multichannel"):
            raise BadMessageError("multichannel=true is not supported: channels are mixed to one")
        language = query.get("language", default_language)
        language = "auto" if language == "multi" else language  # zh-TW: traditional Chinese
        if language.lower() == "zh-hk":
            language = _cantonese(can_caption)
        params = parse_stream_params(
            {"encoding": "pcm_s16le", "sample_rate": query["sample_rate"], "language": language},
            default_language,
        )
        self._rate_hz = params.sample_rate_hz
        self._multi = params.auto_language
        terms = query.every("keyterm")
        self._diarize = _flag(query, "diarize")
        return replace(
            params,
            prompt=prompt_of_terms(terms, "keyterm") if terms else None,
            diarize=self._diarize if "diarize" in query else None,
            turn=_endpointing(query.get("endpointing")),
        )

    # -- client → daemon ---------------------------------------------------------------------

    def receive(self, frame: str | bytes) -> Received:
        if isinstance(frame, bytes):
            if not frame:  # Deepgram's legacy close message
                return self._control(Control.END)
            self._audio_sha256.update(frame)
            return Received(audio=self._mono(frame))
        try:
            data = json.loads(frame)
        except (ValueError, RecursionError) as exc:
            return self._schema_error(frame, f"Could not deserialize last text message: {exc}")
        kind = data.get("type") if isinstance(data, dict) else None
        if isinstance(kind, str) and kind in _CONTROLS:
            return self._control(_CONTROLS[kind])
        if kind == "Configure":
            return self._configure(data)
        known = ", ".join(f"`{name}`" for name in [*_CONTROLS, "Configure"])
        return self._schema_error(
            frame, f"Could not deserialize last text message: unknown type, expected {known}"
        )

    def _configure(self, data: dict[str, Any]) -> Received:
        """A Configure's key terms as the stream's prompt from now on, or its refusal."""
        keyterms, features = data.get("keyterms"), data.get("features")
        reply: dict[str, Any] = {"type": "ConfigureSuccess", "request_id": self._request_id}
        if keyterms is None and not features:
            return Received(replies=(_json(reply),))
        reply["type"], reply["code"] = "ConfigureFailure", "CONFIGURE_INTERNAL_ERROR"
        if features:
            reply["description"] = "captiond cannot change formatting during a stream"
            return Received(replies=(_json(reply),))
        if not (isinstance(keyterms, list) and all(isinstance(t, str) for t in keyterms)):
            reply["description"] = "keyterms must be a list of strings"
            return Received(replies=(_json(reply),))
        try:
            prompt = prompt_of_terms(keyterms, "keyterms")
        except SessionError as exc:
            reply |= {"code": "CONFIGURE_KEYTERM_LIMIT_EXCEEDED", "description": str(exc)}
            return Received(replies=(_json(reply),))
        success = {"type": "ConfigureSuccess", "request_id": self._request_id, "keyterms": keyterms}
        return Received(prompt=prompt, replies=(_json(success),))

    def _control(self, control: Control) -> Received:
        if control is not Control.KEEPALIVE:
            at_ms = self._received_frames * 1000 // self._rate_hz
            finalize = control is Control.FINALIZE
            if self._flushes and self._flushes[-1].at_ms == at_ms:
                # No audio since the last one: it flushes nothing more, one entry serves both.
                last = self._flushes.pop()
                finalize = finalize or last.finalize
            self._flushes.append(_Flush(at_ms=at_ms, finalize=finalize))
        return Received(control=control)

    def _schema_error(self, frame: str, description: str) -> Received:
        """Deepgram answers a text message it cannot parse and keeps the stream open."""
        error = {"type": "Error", "variant": "SchemaError", "description": description}
        return Received(replies=(_json({**error, "message": frame[:1000]}),))

    def _mono(self, frame: bytes) -> bytes:
        """Whole interleaved int16 sample frames, averaged to mono; a split frame waits."""
        data = self._partial_frame + frame if self._partial_frame else frame
        frame_bytes = 2 * self._options.channels
        whole = len(data) - len(data) % frame_bytes
        self._partial_frame = data[whole:]
        self._received_frames += whole // frame_bytes
        if self._options.channels == 1:
            return data[:whole]
        samples = np.frombuffer(data, "<i2", count=whole // 2).reshape(-1, self._options.channels)
        mono: bytes = samples.mean(axis=1).round().astype("<i2").tobytes()
        return mono

    # -- daemon → client ---------------------------------------------------------------------

    def render(self, message: ServerMessage) -> list[str]:
        opts = self._options
        if isinstance(message, Ready):
            self._request_id = message.session
            self._model.update(name=message.model, arch=message.engine)
            key = f"captiond/{message.engine}/{message.model}"
            self._model_uuid = str(uuid.uuid5(uuid.NAMESPACE_URL, key))
        elif isinstance(message, Partial) and opts.interim_results:
            text = message.stable + message.separator + message.unstable
            return [self._results(message, text, final=False)]
        elif isinstance(message, SpeechStarted) and opts.vad_events:
            started = {
                "type": "SpeechStarted",
                "channel": [0],
                "timestamp": _seconds(message.start_ms),
            }
            return [_json(started)]
        elif isinstance(message, SpeechStopped):
            self._note_utterance_end(message.end_ms)
        elif isinstance(message, Final):
            forced = message.end_ms in self._finalized_end_ms
            self._finalized_end_ms.discard(message.end_ms)
            paused = message.end_ms in self._stopped_end_ms  # not cut at the cap
            # Finals come in order: the ends up to this one's are done with (an utterance
            # that decoded to nothing has no final to take its end back).
            self._stopped_end_ms = {e for e in self._stopped_end_ms if e > message.end_ms}
            frames = [
                self._results(message, message.text, final=True, forced=forced, paused=paused)
            ]
            if opts.utterance_end and message.text.strip() and paused and not forced:
                end = {"type": "UtteranceEnd", "channel": [0, 1]}
                last_ms = message.words[-1].end_ms if message.words else message.end_ms
                frames.append(_json({**end, "last_word_end": _seconds(last_ms)}))
            return frames
        elif isinstance(message, Done):
            return [self._metadata(message)]
        elif isinstance(message, Error):
            variant = _VARIANTS.get(message.code, message.code)
            return [_json({"type": "Error", "variant": variant, "description": message.message})]
        return []

    def close_frame(self, error: SessionError) -> tuple[int, str]:
        # Deepgram's close reason is its error's name where it has one (its streaming error
        # table: "NET-0001" after no audio), which clients read to tell a timeout, worth a
        # reconnect, from other closes.
        return close_code_for(error, _CLOSE_CODES), _VARIANTS.get(error.code, error.code)

    def _note_utterance_end(self, end_ms: int) -> None:
        """Note the end of an utterance the speaker stopped, and whether a Finalize closed it:
        its end is where the stream stood then (a flush ends it at the audio received, to the
        millisecond); an end past that means the flush found nothing open."""
        self._stopped_end_ms.add(end_ms)
        while self._flushes and self._flushes[0].at_ms + 1 < end_ms:
            self._flushes.popleft()
        if self._flushes and end_ms >= self._flushes[0].at_ms - 1:
            flush = self._flushes.popleft()
            if flush.finalize:
                self._finalized_end_ms.add(end_ms)

    def _results(
        self,
        message: Partial | Final,
        text: str,
        *,
        final: bool,
        forced: bool = False,
        paused: bool = True,
    ) -> str:
        start_ms, end_ms = message.start_ms, message.end_ms
        punctuate = self._options.punctuate
        # Deepgram names the detected language with language=multi only: every word's, and
        # the alternative's (by word count; here one per segment). Here, whenever it is
        # detected: with multi, a list, or the daemon's [stream] language = "auto".
        language = {"language": message.language} if self._multi and message.language else {}
        # Units, not space-separated words: a Chinese or Japanese sentence has no spaces, and
        # each of its characters is a word here (lang/text.py).
        tokens = units(text)
        plain_words = [plain for token in tokens if (plain := plain_unit(token))]
        # A final's words carry their measured times and confidences (streaming/words.py); an
        # interim result has none (partials are not aligned), so its `words` is empty.
        final_words = message.words if isinstance(message, Final) else ()
        timed = [(plain, w) for w in final_words if (plain := plain_unit(w.word))]
        word_items = [
            {
                "word": plain,
                "start": _seconds(w.start_ms),
                "end": _seconds(w.end_ms),
                # None: a word the final kept from its partials that its decode did not write.
                "confidence": 0.0 if w.confidence is None else w.confidence,
                **({"punctuated_word": w.word} if punctuate else {}),
                # Deepgram's diarize=true: each word's speaker, numbered from 0.
                **({"speaker": w.speaker} if self._diarize and w.speaker is not None else {}),
                **language,
            }
            for plain, w in timed
        ]
        transcript = join_units(tokens) if punctuate else join_units(plain_words)
        known = [w.confidence for _, w in timed if w.confidence is not None]
        alternative: dict[str, object] = {
            "transcript": transcript,
            # The mean of its words' (Deepgram's is the transcript's); 0.0 without words.
            "confidence": round(sum(known) / len(known), 4) if known else 0.0,
        }
        if language:
            alternative["languages"] = [message.language] if plain_words else []
        return _json(
            {
                "type": "Results",
                "channel_index": [0, 1],
                "duration": _seconds(end_ms - start_ms),
                "start": _seconds(start_ms),
                "is_final": final,
                "speech_final": final and self._options.endpointing and paused and not forced,
                "from_finalize": forced,
                "channel": {"alternatives": [{**alternative, "words": word_items}]},
                "metadata": {
                    "request_id": self._request_id,
                    "model_info": self._model,
                    "model_uuid": self._model_uuid,
                },
            }
        )

    def _metadata(self, done: Done) -> str:
        return _json(
            {
                "type": "Metadata",
                "transaction_key": "deprecated",
                "request_id": self._request_id,
                "sha256": self._audio_sha256.hexdigest(),
                "created": self._created,
                "duration": _seconds(done.audio_ms),
                "channels": self._options.channels,
                "models": [self._model_uuid],
                "model_info": {self._model_uuid: self._model},
            }
        )


def _cantonese(can_caption: LanguageCheck) -> str:
    """Deepgram's `zh-HK`, Cantonese in traditional characters: Whisper's `yue` where the model
    has it (large-v3 on), else Chinese in Hong Kong characters, as earlier models write
    Cantonese."""
    try:
        can_caption("yue")
    except SessionError:
        return "zh-HK"
    return "yue"
