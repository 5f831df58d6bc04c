"""captiond's own protocol v1 (docs/reference/protocol-v1.md): binary frames are audio, text
frames are small JSON control messages, every server message is its JSON. Also v1's query
parsing (`parse_stream_params`, resume and `since`), which the vendor dialects build on.
Sans-I/O, event-loop thread."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TypeVar
from urllib.parse import parse_qsl

from captiond.config import MAX_SPEAKERS
from captiond.dialects import LanguageCheck, Received, any_language
from captiond.errors import BadAudioError, BadMessageError, SessionError, close_code_for
from captiond.lang.languages import TASKS, check_prompt, parse_language
from captiond.streaming.events import (
    ENCODINGS,
    MAX_SAMPLE_RATE_HZ,
    MIN_SAMPLE_RATE_HZ,
    Ack,
    Control,
    ServerMessage,
    StreamParams,
    TurnParams,
)

_N = TypeVar("_N", int, float)

# Control messages are a few dozen bytes; a text frame this long is not one.
MAX_CONTROL_BYTES = 4_096


class NativeDialect:
    max_text_bytes = MAX_CONTROL_BYTES

    def __init__(self, query: Mapping[str, str]) -> None:
        self._query = query

    def stream_params(
        self, default_language: str, can_caption: LanguageCheck = any_language
    ) -> StreamParams:
        return parse_stream_params(self._query, default_language)

    def receive(self, frame: str | bytes) -> Received:
        if isinstance(frame, bytes):
            return Received(audio=frame)
        return Received(control=parse_control(frame))

    def render(self, message: ServerMessage) -> list[str]:
        return [message.to_json()]

    def close_frame(self, error: SessionError) -> tuple[int, str]:
        return close_code_for(error), error.code


def parse_stream_params(query: Mapping[str, str], default_language: str) -> StreamParams:
    """Validate the query string of `/v1/stream`; unknown parameters are ignored."""
    encoding = query.get("encoding", "pcm_s16le")
    if encoding not in ENCODINGS:
        raise BadAudioError(
            f"unsupported encoding {encoding!r}: use one of {', '.join(sorted(ENCODINGS))}"
        )
    rate_text = query.get("sample_rate", "16000")
    try:
        rate_hz = int(rate_text)
    except ValueError:
        raise BadAudioError(f"sample_rate must be an integer, got {rate_text!r}") from None
    if not MIN_SAMPLE_RATE_HZ <= rate_hz <= MAX_SAMPLE_RATE_HZ:
        raise BadAudioError(
            f"unsupported sample_rate {rate_hz}: use {MIN_SAMPLE_RATE_HZ}..{MAX_SAMPLE_RATE_HZ} Hz"
        )
    language = parse_language(query.get("language", default_language))
    task = query.get("task", "transcribe")
    if task not in TASKS:
        raise BadMessageError(f"task must be one of {', '.join(TASKS)}, got {task[:20]!r}")
    prompt = query.get("prompt")
    return StreamParams(
        diarize=parse_flag(query, "diarize"),
        max_speakers=parse_max_speakers(query.get("max_speakers")),
        sample_rate_hz=rate_hz,
        encoding=encoding,
        language=language.code,
        candidates=language.candidates,
        chinese_variant=language.chinese_variant,
        task=task,
        prompt=None if prompt is None else check_prompt(prompt),
        turn=TurnParams(
            end_of_turn=query.get("end_of_turn"),
            end_of_turn_threshold=parse_number(query, "end_of_turn_threshold", float),
            max_turn_silence_ms=parse_number(query, "max_turn_silence_ms", int),
        ),
    )


def parse_number(query: Mapping[str, str], key: str, kind: type[_N]) -> _N | None:
    """A number query parameter (None: not given); its range is the caller's to check."""
    text = query.get(key)
    if text is None:
        return None
    try:
        return kind(text)
    except ValueError:
        raise BadMessageError(f"{key} must be a number, got {text[:20]!r}") from None


def parse_flag(query: Mapping[str, str], key: str) -> bool | None:
    """A true/false query parameter (None: not given)."""
    text = query.get(key)
    if text is None:
        return None
    if text.lower() not in ("true", "false"):
        raise BadMessageError(f"{key} must be true or false, got {text[:20]!r}")
    return text.lower() == "true"


def parse_max_speakers(text: str | None) -> int | None:
    """`max_speakers`: 1..MAX_SPEAKERS (None: not given)."""
    if text is None:
        return None
    try:
        value = int(text)
    except ValueError:
        value = 0
    if not 1 <= value <= MAX_SPEAKERS:
        raise BadMessageError(
            f"max_speakers must be an integer from 1 to {MAX_SPEAKERS}, got {text[:20]!r}"
        )
    return value


class Query(dict[str, str]):
    """A query string: each parameter's last value (a dict), and every value of one that is
    repeated (`every`: Deepgram's `keyterm=a&keyterm=b`)."""

    def __init__(self, text: str = "") -> None:
        self._pairs = parse_qsl(text)
        super().__init__(self._pairs)

    def every(self, name: str) -> list[str]:
        return [value for key, value in self._pairs if key == name]


@dataclass(frozen=True, slots=True, kw_only=True)
class ResumeRequest:
    """`/v1/stream?resume=TOKEN&since=N`: take a dropped session back; replay its finals from
    segment `since` (None: every final not acknowledged)."""

    token: str
    since: int | None


def parse_resume(query: Mapping[str, str]) -> ResumeRequest | None:
    """The resume asked for in a `/v1/stream` or `/v1/captions` query string, if any."""
    token = query.get("resume")
    since = parse_since(query)
    return None if token is None else ResumeRequest(token=token, since=since)


def parse_since(query: Mapping[str, str]) -> int | None:
    text = query.get("since")
    if text is None:
        return None
    if not (text.isascii() and text.isdigit() and len(text) <= 9):
        raise BadMessageError(f"since must be a segment number, got {text[:20]!r}")
    return int(text)


def parse_control(text: str) -> Control | Ack:
    """Decode one client text frame; unknown fields are ignored, unknown types are errors."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise BadMessageError(f"malformed JSON: {exc.msg} at position {exc.pos}") from exc
    except (RecursionError, ValueError) as exc:  # nested too deep; a number too long
        raise BadMessageError(f"not a control message: {exc}") from exc
    if not isinstance(data, dict):
        raise BadMessageError("a control message must be a JSON object with a 'type'")
    kind = data.get("type")
    if not isinstance(kind, str):
        raise BadMessageError("a control message needs a string 'type'")
    if kind == "ack":
        segment = data.get("segment")
        if type(segment) is not int or segment < 0:
            raise BadMessageError("'ack' needs a 'segment' number")
        return Ack(segment=segment)
    try:
        return Control(kind)
    except ValueError:
        known = ", ".join([*(c.value for c in Control), "ack"])
        raise BadMessageError(f"unknown message type {kind!r} (known: {known})") from None
