"""OpenAI's Realtime transcription API (`/v1/realtime?intent=transcription`) as a dialect, so that
the `openai` SDK's `client.realtime.connect(...)` transcribes with a local daemon.

Sans-I/O, one instance per connection, on the event-loop thread. It owns the mapping between
OpenAI's JSON events and the session's messages; audio, segmentation and decoding are the
session's.

Client events: `session.update` (a session of type `transcription`), `input_audio_buffer.append`
(base64 pcm16 at 24 kHz in text frames; the daemon resamples), `.commit` and `.clear`. Server
events: `session.created` (on connect) and `session.updated` (the effective configuration),
`input_audio_buffer.speech_started` / `.speech_stopped`, `.committed` (with `previous_item_id`)
and `.cleared`, `conversation.item.input_audio_transcription.delta` and `.completed`, `error`.

What differs from OpenAI, and why:
- Items: one per utterance the daemon's VAD finds, named by where its audio starts
  (`item_{session}_{start_ms}`), so that speech events, deltas and the final name the same item
  without a lookup. An utterance the VAD ends in which the engine finds no words is never
  committed: its `speech_started` names an item that does not follow (OpenAI commits an empty
  one); one that a `.commit` ends always is. Speech
  that runs past `[stream] max_utterance_s` is cut into items with no speech events at the
  cut (the speaker did not stop). No `conversation.item.added`/`.done`: a transcription
  client needs only the events above.
- Deltas are append-only, so only stable words are sent as deltas, live while the speaker
  talks: each partial's newly stable words, then at the final the words after them (the final
  always starts with the stable words). `.completed` carries the final's full text and comes
  after the item's `committed`. Deltas may come before `committed`: the daemon transcribes as
  the audio arrives instead of after the commit.
- `server_vad` is the daemon's VAD ([vad] config), its turns ended by `silence_duration_ms` of
  silence when that is given (its other parameters are not applied). `semantic_vad` ends turns
  by the end-of-turn model (`[vad] end_of_turn = "model"`, streaming/vad.py), its `eagerness`
  setting the model's threshold and the longest pause an unfinished turn waits for
  (`EAGERNESS`); a daemon without the model refuses it. With `turn_detection: null` (push to
  talk) no speech events are sent and only `.commit` ends an item (Control.FINALIZE), however
  long the speaker pauses: one item per commit. The VAD still finds where speech begins (the
  silence before it is not decoded, and a commit of silence alone makes no item), and an item
  is cut at `[stream] max_utterance_s` (one Whisper window, 20 s by default), the rest going
  on as the next item.
- Every `.commit` is answered: the item it ends is committed and completed, even with no words
  (a cough), or, when there is no speech to end (only silence since the last commit, or the
  VAD ended the utterance already), OpenAI's `input_audio_buffer_commit_empty` error, which
  OpenAI sends for a buffer under 100 ms: the daemon keeps no silence to make an item of.
  Speech too short for the VAD to have started an utterance (a "yes" before the key is let
  go) is ended as one.
- `.clear` cannot take back audio: its words may already have gone out as deltas, which cannot
  be retracted. It is acknowledged with `cleared` and ends the open utterance, so that the
  audio before the clear never joins what comes after; its item is still completed.
- `transcription.language` switches the decode language (null or absent: unchanged; the
  stream starts in the daemon's [stream] language; a tag such as "zh-TW" also names the script
  of Chinese captions). `transcription.prompt` becomes the
  stream's prompt (names and terms before every decode's previous text, as whisper-1 reads
  its prompt; "" or null: none; absent: unchanged; until one is set, the daemon's
  `[stream] prompt`, which `session.created` does not show). `model` and `noise_reduction`
  are accepted and have no effect (`session.updated` shows the daemon's model). G.711
  (`audio/pcmu`, `audio/pcma`) and other rates are refused with an `error` event: the
  stream's format is fixed at connect.
- `include: ["item.input_audio_transcription.logprobs"]` gives each `.completed` a `logprobs`
  list with one entry per word of the final, not per model token: `token` the word as the
  transcript writes it (the space before it included, so the tokens join to the transcript),
  `bytes` its UTF-8, `logprob` the natural log of the word's confidence (the mean probability
  of its tokens, protocol v1's `confidence`). A word with no confidence (a stable word the
  final's decode left out, streaming/words.py) has no entry. Deltas carry none: they are
  partials' stable words, which have no measured confidence yet.
- Client mistakes are answered with OpenAI's `error` event and the session stays open, as
  OpenAI's does (a frame over the limit below ends it). A daemon error is an `error` event with
  the daemon's code, then protocol v1's close code (the SDK retries 1001/1011/1013 only). One is
  the idle timeout: a client that stops appending audio for `[server] idle_timeout_s` is closed
  (OpenAI's sessions wait; a paused client appends silence).
- An append is at most `MAX_APPEND_CHARS` of base64 (~15 s of audio; OpenAI allows 15 MiB):
  the daemon's websocket frame limit is 4 x `[server] max_frame_bytes`.
"""

from __future__ import annotations

import base64
import json
import math
from collections.abc import Mapping
from itertools import count
from typing import Any

from captiond.dialects import LanguageCheck, Received, any_language
from captiond.errors import BadMessageError, CaptiondError, SessionError, close_code_for
from captiond.lang.languages import LanguageSetting, check_prompt, parse_language_tag
from captiond.streaming.events import (
    MAX_TURN_SILENCE_MS,
    Control,
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

SAMPLE_RATE_HZ = 24_000  # the only rate OpenAI's pcm format has
MAX_APPEND_CHARS = 1_000_000  # under the default hard frame limit of 1,024,000 bytes
_DELTA = "conversation.item.input_audio_transcription.delta"
_LOGPROBS = "item.input_audio_transcription.logprobs"
_LOWEST_CONFIDENCE = 0.00005
# The daemon's fault, not the request's (OpenAI's error types).
_SERVER_ERRORS = {"internal", "engine_failed", "overloaded", "shutting_down"}


class _Refused(CaptiondError):
    """A client event OpenAI answers with an `error` event, leaving the session open."""

    def __init__(self, code: str, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.param = param


class OpenAIRealtimeDialect:
    max_text_bytes = MAX_APPEND_CHARS

    def __init__(self, query: Mapping[str, str]) -> None:
        self._intent = query.get("intent")  # `model` (if the SDK sends one) is ignored
        self._session = ""  # from Ready
        self._model = ""
        self._language = ""
        self._can_caption: LanguageCheck = any_language
        self._prompt = ""
        # As the session echoes it; None: push to talk (no speech events).
        self._turn_detection: dict[str, Any] | None = {"type": "server_vad"}
        self._event_ids = count()
        self._odd_byte = b""  # half a sample: appends need not split audio on samples
        self._open_start_ms = 0  # the utterance speech_stopped ends
        self._last_item: str | None = None  # the item committed last
        self._sent: dict[int, str] = {}  # per open segment: its text sent as deltas so far
        self._logprobs = False  # `include` asked for them

    def stream_params(
        self, default_language: str, can_caption: LanguageCheck = any_language
    ) -> StreamParams:
        self._can_caption = can_caption
        if self._intent != "transcription":
            raise BadMessageError(
                "only transcription sessions are served: use ?intent=transcription"
            )
        self._language = default_language
        return StreamParams(
            sample_rate_hz=SAMPLE_RATE_HZ, encoding="pcm_s16le", language=default_language
        )

    # -- client events -----------------------------------------------------------------------

    def receive(self, frame: str | bytes) -> Received:
        event_id = None
        try:
            if isinstance(frame, bytes):
                raise _Refused("invalid_request", "audio goes in input_audio_buffer.append events")
            event = _parse(frame)
            event_id = event.get("event_id") if isinstance(event.get("event_id"), str) else None
            kind = event.get("type")
            if kind == "input_audio_buffer.append":
                return Received(audio=self._append(event.get("audio")))
            if kind == "input_audio_buffer.commit":
                empty = self._error(
                    "input_audio_buffer_commit_empty",
                    "Error committing input audio buffer: no speech since the last commit "
                    "(the daemon keeps no audio its VAD found silent).",
                    None,
                    event_id,
                )
                return Received(control=Control.FINALIZE, if_nothing_ends=(empty,))
            if kind == "input_audio_buffer.clear":
                cleared = self._event("input_audio_buffer.cleared")
                return Received(control=Control.FINALIZE, replies=(cleared,))
            if kind == "session.update":
                return self._update(event.get("session"))
            raise _Refused(
                "invalid_value",
                f"Invalid value: {str(kind)[:60]!r}. A transcription session takes "
                "'session.update' and 'input_audio_buffer.append', '.commit', '.clear'.",
                "type",
            )
        except _Refused as refused:
            error = self._error(refused.code, str(refused), refused.param, event_id)
            return Received(replies=(error,))

    def _append(self, audio: object) -> bytes:
        if not isinstance(audio, str):
            raise _Refused("missing_required_parameter", "Missing required parameter: 'audio'.")
        try:
            data = self._odd_byte + base64.b64decode(audio, validate=True)
        except ValueError:  # binascii.Error, or a string with characters outside ASCII
            raise _Refused("invalid_value", "Invalid 'audio': not base64.", "audio") from None
        whole = len(data) - len(data) % 2
        self._odd_byte = data[whole:]
        return data[:whole]

    def _update(self, session: object) -> Received:
        """Validate the whole update before taking any of it: a refused one changes nothing."""
        session = _field(session, "session", required=True)
        if session.get("type", "transcription") != "transcription":
            raise _Refused("invalid_value", "only transcription sessions", "session.type")
        param = "session.audio.input"
        audio_input = _field(_field(session.get("audio"), "session.audio").get("input"), param)
        if "format" in audio_input:
            _check_format(_field(audio_input["format"], f"{param}.format"))
        server_vad = turn = None
        if "turn_detection" in audio_input:
            detection, turn = _turn_detection(audio_input["turn_detection"])
            server_vad = detection is not None
        transcription = _field(audio_input.get("transcription"), f"{param}.transcription")
        language = _language(transcription, self._can_caption)
        prompt = _prompt(transcription)
        logprobs = _include(session["include"]) if "include" in session else self._logprobs
        self._logprobs = logprobs
        if turn is not None:
            self._turn_detection = detection
        if language is not None:
            self._language = str(transcription["language"])  # echoed as the client wrote it
        self._prompt = self._prompt if prompt is None else prompt
        updated = self._event("session.updated", session=self._session_object())
        return Received(
            language=language,
            prompt=prompt,
            ends_at_pauses=server_vad,
            turn=turn,
            replies=(updated,),
        )

    # -- session messages --------------------------------------------------------------------

    def render(self, message: ServerMessage) -> list[str]:
        if isinstance(message, Ready):
            self._session, self._model = message.session, message.model
            return [self._event("session.created", session=self._session_object())]
        if isinstance(message, SpeechStarted):
            self._open_start_ms = message.start_ms
            return self._speech(
                "input_audio_buffer.speech_started", audio_start_ms=message.start_ms
            )
        if isinstance(message, SpeechStopped):
            return self._speech("input_audio_buffer.speech_stopped", audio_end_ms=message.end_ms)
        # Speech that goes on past a cut at the cap starts an utterance with no
        # speech_started, where the cut item ended: its partials, or that final, name the item
        # speech_stopped will close (utterances follow each other, so the newest wins).
        if isinstance(message, Partial):
            self._open_start_ms = max(self._open_start_ms, message.start_ms)
            return self._deltas(message.segment, message.start_ms, message.stable)
        if isinstance(message, Final):
            self._open_start_ms = max(self._open_start_ms, message.end_ms)
            return self._final(message)
        if isinstance(message, Error):
            return [self._error(message.code, message.message)]
        return []  # done: never comes, this protocol has no end of input

    def _speech(self, kind: str, **at_ms: int) -> list[str]:
        if self._turn_detection is None:
            return []  # OpenAI sends speech events in server_vad mode only
        return [self._event(kind, **at_ms, item_id=self._item(self._open_start_ms))]

    def _deltas(self, segment: int, start_ms: int, text: str) -> list[str]:
        """What `text` adds to the text sent for `segment`, as one delta (none if it does not
        extend it: a delta cannot be taken back). Stable text only grows and the final starts
        with it, so the deltas add up to the final in every script (Japanese stable text grows
        by characters, with no space to split words on)."""
        sent = self._sent.get(segment, "")
        if len(text) <= len(sent) or not text.startswith(sent):
            return []
        delta = text[len(sent) :]
        self._sent[segment] = text
        item = self._item(start_ms)
        return [self._event(_DELTA, item_id=item, content_index=0, delta=delta)]

    def _final(self, final: Final) -> list[str]:
        item = self._item(final.start_ms)
        committed = self._event(
            "input_audio_buffer.committed", item_id=item, previous_item_id=self._last_item
        )
        self._last_item = item
        deltas = self._deltas(final.segment, final.start_ms, final.text)
        self._sent.pop(final.segment, None)
        logprobs = {"logprobs": _word_logprobs(final)} if self._logprobs else {}
        completed = self._event(
            "conversation.item.input_audio_transcription.completed",
            item_id=item,
            content_index=0,
            transcript=final.text,
            usage={"type": "duration", "seconds": (final.end_ms - final.start_ms) / 1000},
            **logprobs,
        )
        return [committed, *deltas, completed]

    def close_frame(self, error: SessionError) -> tuple[int, str]:
        return close_code_for(error), error.code

    # -- helpers -----------------------------------------------------------------------------

    def _item(self, start_ms: int) -> str:
        return f"item_{self._session}_{start_ms}"

    def _session_object(self) -> dict[str, Any]:
        transcription = {"model": self._model, "language": self._language, "prompt": self._prompt}
        return {
            "type": "transcription",
            "id": f"sess_{self._session}",
            "object": "realtime.transcription_session",
            "audio": {
                "input": {
                    "format": {"type": "audio/pcm", "rate": SAMPLE_RATE_HZ},
                    "transcription": transcription,
                    "turn_detection": self._turn_detection,
                    "noise_reduction": None,
                }
            },
            "include": [_LOGPROBS] if self._logprobs else [],
        }

    def _event(self, kind: str, **fields: Any) -> str:
        event = {"type": kind, "event_id": f"event_{next(self._event_ids)}", **fields}
        return json.dumps(event, ensure_ascii=False, separators=(",", ":"))

    def _error(
        self, code: str, message: str, param: str | None = None, event_id: str | None = None
    ) -> str:
        error = {
            "type": "server_error" if code in _SERVER_ERRORS else "invalid_request_error",
            "code": code,
            "message": message,
            "param": param,
            "event_id": event_id,
        }
        return self._event("error", error=error)


def _parse(frame: str) -> dict[str, Any]:
    try:
        event = json.loads(frame)
    except (ValueError, RecursionError):  # malformed, nested too deep, a number too long
        raise _Refused("invalid_json", "The event is not valid JSON.") from None
    if not isinstance(event, dict):
        raise _Refused("invalid_json", "An event must be a JSON object with a 'type'.")
    return event


def _field(value: object, param: str, *, required: bool = False) -> dict[str, Any]:
    """An object-valued field; absent or null is an empty object unless `required`."""
    if value is None and not required:
        return {}
    if not isinstance(value, dict):
        raise _Refused("invalid_type", f"'{param}' must be an object.", param)
    return value


def _include(include: object) -> bool:
    """Whether `session.include` asks for logprobs (the only field OpenAI defines)."""
    if not isinstance(include, list) or not all(isinstance(f, str) for f in include):
        raise _Refused("invalid_type", "include must be a list of strings", "session.include")
    unknown = sorted(set(include) - {_LOGPROBS})
    if unknown:
        raise _Refused(
            "invalid_value", f"cannot include {unknown[0]!r}: only {_LOGPROBS}", "session.include"
        )
    return _LOGPROBS in include


def _word_logprobs(final: Final) -> list[dict[str, Any]]:
    """One entry per word with a confidence (see the module docstring). A word's token is the
    transcript from the end of the word before it to its own end: the space before it, as
    the transcript writes it (none between Chinese characters)."""
    entries = []
    written_to = 0
    for word in final.words:
        at = final.text.find(word.word, written_to)
        end = written_to if at < 0 else at + len(word.word)
        token = final.text[written_to:end] or word.word
        written_to = end
        if word.confidence is None:
            continue
        entries.append(
            {
                "token": token,
                "bytes": list(token.encode()),
                # A confidence (4 decimals) rounds to 0 only below 0.00005: no lower log.
                "logprob": round(math.log(max(word.confidence, _LOWEST_CONFIDENCE)), 4),
            }
        )
    return entries


def _check_format(audio_format: dict[str, Any]) -> None:
    """The stream's format is fixed at connect: pcm16 at 24 kHz."""
    if (
        audio_format.get("type", "audio/pcm") != "audio/pcm"
        or audio_format.get("rate", SAMPLE_RATE_HZ) != SAMPLE_RATE_HZ
    ):
        raise _Refused(
            "invalid_value",
            "only audio/pcm at 24000 Hz is supported (not G.711 audio/pcmu, audio/pcma)",
            "session.audio.input.format",
        )


# semantic_vad's eagerness: the end-of-turn model's threshold and the longest pause a turn it
# calls unfinished waits for. "medium" (and "auto", OpenAI's default, which is medium) is the
# daemon's default; "low" lets the speaker take their time, "high" ends turns soonest.
EAGERNESS = {
    "low": TurnParams(end_of_turn="model", end_of_turn_threshold=0.7, max_turn_silence_ms=3_000),
    "medium": TurnParams(end_of_turn="model", end_of_turn_threshold=0.5, max_turn_silence_ms=1_500),
    "auto": TurnParams(end_of_turn="model", end_of_turn_threshold=0.5, max_turn_silence_ms=1_500),
    "high": TurnParams(end_of_turn="model", end_of_turn_threshold=0.3, max_turn_silence_ms=800),
}


def _turn_detection(turn_detection: object) -> tuple[dict[str, Any] | None, TurnParams]:
    """The turn detection as the session echoes it, and how the stream's turns end: null
    turns speech events off (push to talk); `server_vad` ends turns at `silence_duration_ms`
    of silence when given (else the daemon's [vad]); `semantic_vad` by the end-of-turn model
    at its `eagerness` (EAGERNESS)."""
    if turn_detection is None:
        return None, TurnParams()
    param = "session.audio.input.turn_detection"
    fields = _field(turn_detection, param)
    kind = fields.get("type")
    if kind == "semantic_vad":
        eagerness = fields.get("eagerness", "auto")
        if eagerness not in EAGERNESS:
            raise _Refused(
                "invalid_value",
                "eagerness must be low, medium, high or auto",
                f"{param}.eagerness",
            )
        return {"type": kind, "eagerness": eagerness}, EAGERNESS[eagerness]
    if kind == "server_vad":
        silence_ms = fields.get("silence_duration_ms")
        if silence_ms is None:
            return {"type": kind}, TurnParams()
        if not isinstance(silence_ms, int) or not 30 <= silence_ms <= MAX_TURN_SILENCE_MS:
            raise _Refused(
                "invalid_value",
                f"silence_duration_ms must be an integer from 30 to {MAX_TURN_SILENCE_MS}",
                f"{param}.silence_duration_ms",
            )
        turn = TurnParams(
            end_of_turn="silence",
            endpoint_silence_ms=silence_ms,
            unfinished_endpoint_silence_ms=silence_ms,
        )
        return {"type": kind, "silence_duration_ms": silence_ms}, turn
    raise _Refused(
        "invalid_value", "turn_detection must be server_vad, semantic_vad or null", param
    )


def _prompt(transcription: dict[str, Any]) -> str | None:
    """The stream's prompt from now on (absent: unchanged; null: none)."""
    if "prompt" not in transcription:
        return None
    prompt = transcription["prompt"]
    param = "session.audio.input.transcription.prompt"
    if not isinstance(prompt, str | None):
        raise _Refused("invalid_type", "Invalid type for 'prompt': expected a string.", param)
    try:
        return check_prompt(prompt or "", "'prompt'")
    except SessionError as exc:
        raise _Refused("string_above_max_length", str(exc), param) from None


def _language(transcription: dict[str, Any], can_caption: LanguageCheck) -> LanguageSetting | None:
    """The language to decode in from now on (null, "" or absent: unchanged): a tag such as
    "zh-TW" also names the script of Chinese (session.set_language). One the model cannot
    caption is refused before the update is confirmed."""
    if not transcription.get("language"):
        return None
    try:
        setting = parse_language_tag(str(transcription["language"]))
        can_caption(setting.code)
        return setting
    except SessionError as exc:
        param = "session.audio.input.transcription.language"
        raise _Refused("invalid_value", str(exc), param) from None
