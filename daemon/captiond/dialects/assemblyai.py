"""AssemblyAI Universal-Streaming v3 (`/v3/ws`) as a captiond dialect, so that the unmodified
`assemblyai` SDK (`StreamingClient`, `api_host="ws://HOST:PORT"`) streams to a local daemon.
Sans-I/O: one instance per connection, used on the event-loop thread.

Client → daemon: binary frames are audio (pcm_s16le, mono, at the query's `sample_rate`: the
daemon resamples to 16 kHz); text frames are `Terminate` (Control.END), `ForceEndpoint`
(Control.FINALIZE: the open turn ends now), `KeepAlive` and `UpdateConfiguration`.
Daemon → client: `Begin` (ready), `Turn` (partials and finals), `SpeechStarted`, `Termination`
(done; the daemon then closes 1000), and for an error an `Error` frame whose `error_code` is
the close code that follows (AssemblyAI's v3 codes, `CLOSE_CODES`).

Turns. A segment is a turn: `turn_order` is its segment number. A partial is a Turn with
`end_of_turn` false whose `transcript` holds only the stable words (AssemblyAI: finalized
words, so it only grows) and whose `words` add the unstable ones with `word_is_final` false.
The final is a Turn with `end_of_turn` true, never followed by another Turn of that order,
except the formatted copy when `format_turns` is on. Whisper's text is already punctuated and
cased, so `turn_is_formatted` is true exactly when the text is Whisper's as decoded (the
formatted copy); every other Turn carries an unformatted form derived from it: each word
lower-cased with its leading and trailing punctuation removed (numerals stay as Whisper wrote
them). A final Turn's words carry their measured `start`, `end` (ms) and `confidence` (Whisper's
alignment heads and token probabilities, streaming/words.py). A partial is not aligned (that would
cost every decode an alignment pass), but the SDK's Word requires times and a confidence, so an
interim Turn's word times are interpolated, not measured: spread evenly over the part of the
segment not yet taken by earlier words, and kept once the word is final (word_is_final: they do
not change in later interim Turns), with confidence 0.0. The end-of-turn Turn replaces them with
the measured ones (its text is the same). `end_of_turn_confidence` is the end-of-turn model's
probability that the speaker was done, at its latest check of the turn (a pause), where the
stream's turns end by it; before its first check, and on a stream whose turns end by silence
(no model), it is 1.0 on the Turn that ends the turn and 0.0 before: which Turn ends the turn,
not a model's score.

`keyterms_prompt` (in the query or an `UpdateConfiguration`; `[]` clears it) becomes the stream's
prompt: the terms, comma-separated, which Whisper reads before every decode's previous text.

Language: `language_code` or one of `language_codes` (a tag: "zh-TW" keeps the script of
Chinese); several codes are the languages each utterance's is detected among (AssemblyAI's
"every expected language"); `language_detection=true`, or a `speech_model` other than
`universal-streaming-english`, with no language named decode as "auto" (any language Whisper
knows); `universal-streaming-english` with none is English. The model itself is captiond's.

Unsupported: pcm_mulaw and the compressed encodings (an error: captiond takes linear PCM);
the model that `speech_model` names, `vad_threshold` (captiond's VAD finds speech),
`prompt` (an instruction to AssemblyAI's model, which Whisper would read as words said before),
`inactivity_timeout` (the daemon's `[server] idle_timeout_s` applies, and KeepAlive does not hold
it), PII redaction, `Heartbeat`: ignored, as are unknown fields.
`expires_at` is nominal (AssemblyAI's 3-hour limit): captiond ends no session for its age.

Turn detection: `end_of_turn_confidence_threshold`, `min_end_of_turn_silence_when_confident`
(or `min_turn_silence`) and `max_turn_silence`, in the query or an `UpdateConfiguration`, end
the stream's turns by the end-of-turn model (`[vad] end_of_turn = "model"`, streaming/vad.py):
its threshold, the pause it is asked at, and the longest pause a turn it calls unfinished
waits for. A daemon without the model refuses them; without them the daemon's `[vad]` decides.

`speaker_labels=true` (with `max_speakers`) diarizes the stream (streaming/speakers.py): an
ended Turn has its `speaker_label` (`A`, `B`, …) and each of its words its `speaker`; a turn in
which the speaker changes is one Turn per speaker. Interim Turns have neither: their words are
interpolated, not aligned, and the speaker is decided with the final.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from captiond.dialects import LanguageCheck, Received, any_language
from captiond.dialects.native import parse_max_speakers, parse_stream_params
from captiond.errors import BadAudioError, BadMessageError, SessionError
from captiond.lang.languages import AUTO_LANGUAGE, parse_language, prompt_of_terms
from captiond.lang.text import join_units, plain_unit, units
from captiond.streaming.events import (
    Control,
    Done,
    Error,
    Final,
    Partial,
    Ready,
    ServerMessage,
    SpeechStarted,
    StreamParams,
    TurnParams,
)

# Control messages are small; UpdateConfiguration may carry key terms and a prompt.
MAX_MESSAGE_BYTES = 16_384
SESSION_LIFETIME_S = 3 * 3600  # Begin's expires_at: AssemblyAI's limit, not enforced here
# AssemblyAI's v3 close codes (docs: "Common session errors and closures"; the SDK's
# RealTimeErrorCodes) by captiond error code; anything else is 3005, the server-error catch-all.
CLOSE_CODES: dict[str, int] = {
    "bad_message": 3006,  # Invalid JSON / Invalid Message Type / Invalid Message
    "bad_audio": 3006,  # input validation: encoding, sample rate, partial samples
    "too_large": 3007,  # input duration violation: a chunk over [server] max_frame_bytes
    "rate_limited": 3007,  # Audio Transmission Rate Exceeded
    "overloaded": 3009,  # too many concurrent sessions
    "idle_timeout": 4031,  # "Session idle for too long" in the SDK's table (v3 documents none)
    "shutting_down": 1001,  # going away: the daemon stops
}
CLOSE_SERVER_ERROR = 3005
# The one AssemblyAI speech model that takes English only (`speech_model`).
_ENGLISH = "universal-streaming-english"


@dataclass(frozen=True, slots=True)
class _Word:
    text: str  # as Whisper wrote it (formatted)
    start_ms: int
    end_ms: int
    confidence: float
    speaker: int | None = None


@dataclass(slots=True)
class _Turn:
    """A segment whose final has not come yet (mutable state of this connection)."""

    start_ms: int
    final_words: list[_Word] = field(default_factory=list)  # interpolated; kept once final


class AssemblyAIDialect:
    max_text_bytes = MAX_MESSAGE_BYTES

    def __init__(self, query: Mapping[str, str], *, now_s: Callable[[], float] = time.time) -> None:
        self._query = query
        self._now_s = now_s
        self._began_s = 0.0
        self._format_turns = False
        self._language_detection = False
        self._can_caption: LanguageCheck = any_language
        self._turns: dict[int, _Turn] = {}  # by segment: turns not ended yet
        self._turn_params = TurnParams()  # the stream's turn detection, as its keys set it

    # -- client → daemon ---------------------------------------------------------------------

    def stream_params(
        self, default_language: str, can_caption: LanguageCheck = any_language
    ) -> StreamParams:
        self._can_caption = can_caption
        query = self._query
        self._format_turns = _flag(query, "format_turns")
        self._language_detection = _flag(query, "language_detection")
        encoding = query.get("encoding", "pcm_s16le")
        if encoding != "pcm_s16le":
            raise BadAudioError(
                f"Input validation error: encoding {encoding[:20]!r} is not supported by "
                "captiond; send pcm_s16le"
            )
        language = default_language
        if "language_codes" in query:
            language = _tags_of(_json(query["language_codes"]))
        elif "language_code" in query:
            language = _tags_of([query["language_code"]])
        elif self._language_detection or query.get("speech_model", _ENGLISH) != _ENGLISH:
            language = AUTO_LANGUAGE  # AssemblyAI's other models detect it: none was named
        elif "speech_model" in query:
            language = "en"
        rate = query.get("sample_rate", "16000")
        params = parse_stream_params({"sample_rate": rate, "language": language}, default_language)
        if "keyterms_prompt" in query:
            params = replace(params, prompt=_prompt_of(_json(query["keyterms_prompt"])))
        if "speaker_labels" in query:
            params = replace(params, diarize=_flag(query, "speaker_labels"))
        if "max_speakers" in query:
            params = replace(params, max_speakers=parse_max_speakers(query["max_speakers"]))
        self._turn_params = _turn_of(query, TurnParams())
        return replace(params, turn=self._turn_params)

    def receive(self, frame: str | bytes) -> Received:
        if isinstance(frame, bytes):
            return Received(audio=frame)
        message = _json(frame)
        if not isinstance(message, dict) or not isinstance(message.get("type"), str):
            raise BadMessageError(f"Invalid Message: {frame[:100]}")
        kind = message["type"]
        if kind == "Terminate":
            return Received(control=Control.END)
        if kind == "ForceEndpoint":
            return Received(control=Control.FINALIZE)
        if kind == "KeepAlive":
            return Received(control=Control.KEEPALIVE)
        if kind == "UpdateConfiguration":
            return self._update(message)
        raise BadMessageError(f"Invalid Message Type: {kind[:50]}")

    def _update(self, message: dict[str, Any]) -> Received:
        """Take what maps (format_turns, language_codes, keyterms_prompt), all of it or, if any
        is invalid, none; ignore the rest (see the docstring)."""
        format_turns = message.get("format_turns")
        if format_turns is not None and not isinstance(format_turns, bool):
            raise BadMessageError("Invalid Message: format_turns must be true or false")
        codes, keyterms = message.get("language_codes"), message.get("keyterms_prompt")
        language = None if codes is None else parse_language(_tags_of(codes))
        if language is not None:
            for code in (language.code, *language.candidates):
                self._can_caption(code)
        prompt = None if keyterms is None else _prompt_of(keyterms)
        turn = _turn_of(message, self._turn_params)
        if format_turns is not None:
            self._format_turns = format_turns
        changed = turn != self._turn_params
        self._turn_params = turn
        return Received(language=language, prompt=prompt, turn=turn if changed else None)

    # -- daemon → client ---------------------------------------------------------------------

    def render(self, message: ServerMessage) -> list[str]:
        if isinstance(message, Ready):
            self._began_s = self._now_s()
            expires_at = int(self._began_s) + SESSION_LIFETIME_S
            return [_dumps({"type": "Begin", "id": message.session, "expires_at": expires_at})]
        if isinstance(message, Partial):
            return [self._render_partial(message)]
        if isinstance(message, Final):
            return self._render_final(message)
        if isinstance(message, SpeechStarted):
            return [_dumps({"type": "SpeechStarted", "timestamp": message.start_ms})]
        if isinstance(message, Done):
            return [
                _dumps(
                    {
                        "type": "Termination",
                        "audio_duration_seconds": round(message.audio_ms / 1000),
                        "session_duration_seconds": round(self._now_s() - self._began_s),
                    }
                )
            ]
        if isinstance(message, Error):
            code = CLOSE_CODES.get(message.code, CLOSE_SERVER_ERROR)
            return [_dumps({"type": "Error", "error_code": code, "error": message.message})]
        return []  # SpeechStopped: AssemblyAI has no such event

    def close_frame(self, error: SessionError) -> tuple[int, str]:
        return CLOSE_CODES.get(error.code, CLOSE_SERVER_ERROR), error.code

    def _render_partial(self, message: Partial) -> str:
        # Units, not space-separated words: each character of a Chinese or Japanese sentence
        # is a word here (lang/text.py). A partial is not aligned: its words' times are
        # interpolated (the module's docstring), the final's are measured.
        turn = self._turns.setdefault(message.segment, _Turn(start_ms=message.start_ms))
        stable = units(message.stable)
        words = _interpolated(turn, [*stable, *units(message.unstable)], message.end_ms)
        turn.final_words = words[: len(stable)]
        language = message.language if self._language_detection else None
        return self._turn(
            message.segment,
            words,
            len(stable),
            end=False,
            language=language,
            end_of_turn=message.end_of_turn,
        )

    def _render_final(self, message: Final) -> list[str]:
        # Measured (streaming/words.py); None: a word the final kept from its partials that its
        # decode did not write, given 0.0.
        self._turns.pop(message.segment, None)
        words = [
            _Word(
                w.word,
                w.start_ms,
                w.end_ms,
                0.0 if w.confidence is None else w.confidence,
                w.speaker,
            )
            for w in message.words
        ]
        language = message.language if self._language_detection else None
        order, n_final = message.segment, len(words)
        text = units(message.text)
        # The end of the turn, then its formatted copy when `format_turns` asks for one.
        return [
            self._turn(
                order,
                words,
                n_final,
                end=True,
                language=language,
                text=text,
                formatted=formatted,
                speaker=message.speaker,
                end_of_turn=message.end_of_turn,
            )
            for formatted in ((False, True) if self._format_turns else (False,))
        ]

    def _turn(
        self,
        order: int,
        words: list[_Word],
        n_final: int,
        *,
        end: bool,
        language: str | None,
        text: list[str] | None = None,
        formatted: bool = False,
        speaker: int | None = None,
        end_of_turn: float | None = None,
    ) -> str:
        """One Turn: the first `n_final` words are final; `language` is the detected one (only
        with `language_detection`). `text`: the final's units, its transcript (its words may be
        fewer: none from an engine without word timings); else the final words make it.
        `end_of_turn`: the end-of-turn model's latest probability (None: not asked)."""
        shown = [
            (w.text if formatted else plain_unit(w.text), w, i < n_final)
            for i, w in enumerate(words)
        ]
        shown = [item for item in shown if item[0]]  # a word of punctuation alone is dropped
        if text is None:
            transcript = join_units([shown_text for shown_text, _, final in shown if final])
        else:
            said = text if formatted else [plain_unit(unit) for unit in text]
            transcript = join_units([unit for unit in said if unit])
        return _dumps(
            {
                "type": "Turn",
                "turn_order": order,
                "turn_is_formatted": formatted,
                "end_of_turn": end,
                "transcript": transcript,
                "end_of_turn_confidence": (1.0 if end else 0.0)
                if end_of_turn is None
                else round(end_of_turn, 4),
                "words": [
                    {
                        "start": w.start_ms,
                        "end": w.end_ms,
                        "text": text,
                        "confidence": w.confidence,
                        "word_is_final": final,
                        **({} if w.speaker is None else {"speaker": speaker_letter(w.speaker)}),
                    }
                    for text, w, final in shown
                ],
                "utterance": transcript if end and not formatted else "",
                **({} if language is None else {"language_code": language}),
                **({} if speaker is None else {"speaker_label": speaker_letter(speaker)}),
            }
        )


def _interpolated(turn: _Turn, texts: list[str], end_ms: int) -> list[_Word]:
    """An interim Turn's words: the turn's final words as they were given, then the others
    spread evenly up to `end_ms`, confidence 0.0 (the stable words are a prefix of every later
    partial; a word that somehow differs is given times afresh rather than trusted)."""
    kept = 0
    while (
        kept < min(len(texts), len(turn.final_words)) and turn.final_words[kept].text == texts[kept]
    ):
        kept += 1
    start_ms = turn.final_words[kept - 1].end_ms if kept else turn.start_ms
    span_ms = max(0, end_ms - start_ms)
    rest = texts[kept:]
    return turn.final_words[:kept] + [
        _Word(
            text=text,
            start_ms=start_ms + span_ms * i // len(rest),
            end_ms=start_ms + span_ms * (i + 1) // len(rest),
            confidence=0.0,
        )
        for i, text in enumerate(rest)
    ]


def speaker_letter(speaker: int) -> str:
    """AssemblyAI's speaker label: A, B, … Z, then AA, AB, …"""
    head, last = divmod(speaker, 26)
    return (speaker_letter(head - 1) if head else "") + chr(ord("A") + last)


# AssemblyAI's turn-detection keys and the `TurnParams` field each sets; the two names of the
# shortest silence are the v3 API's older and newer spelling.
_TURN_KEYS = {
    "end_of_turn_confidence_threshold": "end_of_turn_threshold",
    "min_end_of_turn_silence_when_confident": "end_of_turn_pause_ms",
    "min_turn_silence": "end_of_turn_pause_ms",
    "max_turn_silence": "max_turn_silence_ms",
}


def _turn_of(keys: Mapping[str, Any], turn: TurnParams) -> TurnParams:
    """`turn` with the turn-detection keys among `keys` (the query's strings, or an
    UpdateConfiguration's numbers): any of them makes the end-of-turn model end the stream's
    turns, as AssemblyAI's model does, at its confidence threshold, asked after its shortest
    silence and waiting at most its longest."""
    changes: dict[str, Any] = {}
    for key, name in _TURN_KEYS.items():
        if (value := keys.get(key)) is None:
            continue
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise BadMessageError(f"Input validation error: {key} must be a number") from None
        changes[name] = number if name == "end_of_turn_threshold" else round(number)
    if not changes:
        return turn
    try:
        return replace(turn, end_of_turn="model", **changes)
    except BadMessageError as exc:
        raise BadMessageError(f"Input validation error: {exc}") from None


def _flag(query: Mapping[str, str], name: str) -> bool:
    """A boolean query parameter: the SDK writes Python's True/False, others true/false."""
    value = query.get(name, "false").lower()
    if value not in ("true", "false", "1", "0"):
        raise BadMessageError(f"Input validation error: {name} must be true or false")
    return value in ("true", "1")


def _tags_of(codes: object) -> str:
    """`language_codes` as a `language` setting for `parse_language`: one code is that language,
    as a tag ("en_us" is "en-us"; "zh-TW" keeps naming the script of Chinese); several are the
    languages to detect among ("en,es")."""
    if not (isinstance(codes, list) and codes and all(isinstance(c, str) and c for c in codes)):
        raise BadMessageError("Invalid Message: language_codes must be a list of language codes")
    return ",".join(str(code).replace("_", "-") for code in codes)


def _prompt_of(keyterms: object) -> str:
    """`keyterms_prompt` as the stream's prompt ([] clears it)."""
    if not (isinstance(keyterms, list) and all(isinstance(t, str) for t in keyterms)):
        raise BadMessageError("Invalid Message: keyterms_prompt must be a list of strings")
    return prompt_of_terms(keyterms, "keyterms_prompt")


def _json(text: str) -> Any:
    try:
        return json.loads(text)
    except (ValueError, RecursionError):  # JSONDecodeError is a ValueError; so is a long int
        raise BadMessageError(f"Invalid JSON: {text[:100]}") from None


def _dumps(message: dict[str, Any]) -> str:
    return json.dumps(message, ensure_ascii=False, separators=(",", ":"))
