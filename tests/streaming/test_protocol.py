"""Protocol v1 codec: stream parameters, control messages, server messages
(docs/reference/protocol-v1.md)."""

from __future__ import annotations

import json

import pytest

from captiond import PROTOCOL
from captiond.dialects.native import (
    ResumeRequest,
    parse_control,
    parse_resume,
    parse_since,
    parse_stream_params,
)
from captiond.errors import BadAudioError, BadMessageError
from captiond.streaming.events import (
    Ack,
    Control,
    Done,
    Error,
    Final,
    Partial,
    Ready,
    Resumed,
    ServerMessage,
    SpeechStarted,
    SpeechStopped,
    StreamParams,
)

# -- stream parameters ------------------------------------------------------------------------


def test_stream_params_defaults() -> None:
    params = parse_stream_params({}, "en")
    assert params == StreamParams(sample_rate_hz=16_000, encoding="pcm_s16le", language="en")
    assert params.bytes_per_sample == 2


def test_stream_params_default_language_is_used() -> None:
    assert parse_stream_params({}, "de").language == "de"


def test_stream_params_f32le_and_rate() -> None:
    params = parse_stream_params(
        {"encoding": "f32le", "sample_rate": "48000", "language": "FR", "extra": "x"}, "en"
    )
    assert params == StreamParams(sample_rate_hz=48_000, encoding="f32le", language="fr")
    assert params.bytes_per_sample == 4


@pytest.mark.parametrize("encoding", ["pcm_s24le", "mp3", "", "PCM_S16LE", "f32be"])
def test_stream_params_bad_encoding(encoding: str) -> None:
    with pytest.raises(BadAudioError, match="encoding"):
        parse_stream_params({"encoding": encoding}, "en")


@pytest.mark.parametrize("rate", ["abc", "", "16000.0", "16k", "1e4"])
def test_stream_params_non_integer_rate(rate: str) -> None:
    with pytest.raises(BadAudioError, match="sample_rate"):
        parse_stream_params({"sample_rate": rate}, "en")


@pytest.mark.parametrize("rate", ["0", "-16000", "7999", "192001", "1000000"])
def test_stream_params_out_of_range_rate(rate: str) -> None:
    with pytest.raises(BadAudioError, match="sample_rate"):
        parse_stream_params({"sample_rate": rate}, "en")


@pytest.mark.parametrize("rate", ["8000", "192000", "44100"])
def test_stream_params_rate_bounds_accepted(rate: str) -> None:
    assert parse_stream_params({"sample_rate": rate}, "en").sample_rate_hz == int(rate)


@pytest.mark.parametrize(
    "language", ["e", "english", "e1", "", "en_US", "en-", "zh-台湾", "../", "xx", "EO", "yue-x-"]
)
def test_stream_params_bad_language(language: str) -> None:
    with pytest.raises(BadMessageError, match="language"):
        parse_stream_params({"language": language}, "en")


@pytest.mark.parametrize(
    ("tag", "code"),
    [("haw", "haw"), ("yue-HK", "yue"), ("jv", "jw"), ("nb-NO", "no"), ("iw", "he")],
)
def test_language_tags_become_whisper_codes(tag: str, code: str) -> None:
    assert parse_stream_params({"language": tag}, "en").language == code


def test_a_list_of_languages_is_detected_among_them() -> None:
    """`?language=en,de` is "auto" among those languages, in the order given, once each; a tag
    naming a Chinese script keeps it."""
    params = parse_stream_params({"language": "en, DE,zh-TW,de"}, "en")
    assert (params.language, params.candidates) == ("auto", ("en", "de", "zh"))
    assert (params.chinese_variant, params.language_setting) == ("zh-TW", "en,de,zh")
    assert parse_stream_params({}, "es,pt").candidates == ("es", "pt")
    assert parse_stream_params({"language": "auto"}, "en").language_setting == "auto"
    assert parse_stream_params({"language": "de"}, "en").candidates == ()


@pytest.mark.parametrize("language", ["en,auto", "en,", ",", "en,xx", "en;de"])
def test_a_bad_list_of_languages_is_refused(language: str) -> None:
    with pytest.raises(BadMessageError, match="language"):
        parse_stream_params({"language": language}, "en")


def test_bad_params_errors_carry_protocol_codes() -> None:
    with pytest.raises(BadAudioError) as audio:
        parse_stream_params({"encoding": "x"}, "en")
    assert audio.value.code == "bad_audio"
    with pytest.raises(BadMessageError) as message:
        parse_stream_params({"language": "x"}, "en")
    assert message.value.code == "bad_message"


# -- control messages -------------------------------------------------------------------------


@pytest.mark.parametrize("control", list(Control))
def test_parse_each_control(control: Control) -> None:
    assert parse_control(json.dumps({"type": control.value})) is control


def test_parse_control_values() -> None:
    assert {c.value for c in Control} == {"finalize", "end", "keepalive"}


def test_parse_control_ignores_unknown_fields() -> None:
    text = json.dumps({"type": "end", "reason": "bye", "nested": {"a": [1, 2]}, "n": None})
    assert parse_control(text) is Control.END


@pytest.mark.parametrize(
    "text",
    [
        "",
        "{",
        "not json",
        '{"type": "end"',
        "[]",
        '["end"]',
        '"end"',
        "42",
        "null",
        "{}",
        '{"kind": "end"}',
        '{"type": 1}',
        '{"type": null}',
        '{"type": ["end"]}',
        '{"type": "stop"}',
        '{"type": "END"}',
        '{"type": ""}',
        '{"type": "ack"}',
        '{"type": "ack", "segment": -1}',
        '{"type": "ack", "segment": "3"}',
        '{"type": "ack", "segment": 1.5}',
        '{"type": "ack", "segment": true}',
    ],
)
def test_parse_control_rejects(text: str) -> None:
    with pytest.raises(BadMessageError):
        parse_control(text)


def test_parse_ack() -> None:
    assert parse_control('{"type": "ack", "segment": 7, "x": 1}') == Ack(segment=7)


@pytest.mark.parametrize(
    ("query", "expected"),
    [
        ({}, None),
        ({"since": "3"}, None),
        ({"resume": "abc.x"}, ResumeRequest(token="abc.x", since=None)),
        ({"resume": "abc.x", "since": "0"}, ResumeRequest(token="abc.x", since=0)),
    ],
)
def test_parse_resume(query: dict[str, str], expected: ResumeRequest | None) -> None:
    assert parse_resume(query) == expected


@pytest.mark.parametrize("since", ["-1", "x", "1.5", "", "9" * 12, "\u0663"])
def test_parse_since_rejects(since: str) -> None:
    with pytest.raises(BadMessageError):
        parse_since({"since": since})


def test_parse_control_unknown_type_is_named() -> None:
    with pytest.raises(BadMessageError, match="pause"):
        parse_control('{"type": "pause"}')


# -- server messages --------------------------------------------------------------------------

_EXPECTED: list[tuple[ServerMessage, str, list[str]]] = [
    (
        Ready(
            session="abc",
            sample_rate=16_000,
            model="tiny.en",
            engine="fake",
            max_audio_speed=10.0,
            audio_burst_s=60.0,
        ),
        "ready",
        [
            *("protocol", "session", "sample_rate", "model", "engine", "resume_token", "resume_s"),
            *("max_audio_speed", "audio_burst_s"),
        ],
    ),
    (
        Resumed(
            session="abc",
            sample_rate=16_000,
            model="tiny.en",
            engine="fake",
            resume_token="abc.x",
            resume_s=60.0,
            max_audio_speed=10.0,
            audio_burst_s=60.0,
            audio_ms=1000,
            received_bytes=32_000,
            ended=False,
            gap_ms=20_000,
            replayed=2,
        ),
        "resumed",
        [
            *("protocol", "session", "sample_rate", "model", "engine", "resume_token", "resume_s"),
            *("max_audio_speed", "audio_burst_s"),
            *("audio_ms", "received_bytes", "ended", "gap_ms", "replayed"),
        ],
    ),
    (
        Partial(
            segment=0, rev=1, start_ms=0, end_ms=500, stable="hello", separator=" ", unstable="wor"
        ),
        "partial",
        ["segment", "rev", "start_ms", "end_ms", "stable", "separator", "unstable", "language"],
    ),
    (
        Final(segment=3, start_ms=10, end_ms=2000, text="hello world"),
        "final",
        ["segment", "start_ms", "end_ms", "text", "language", "words", "speaker"],
    ),
    (SpeechStarted(start_ms=120), "speech_started", ["start_ms"]),
    (SpeechStopped(end_ms=900), "speech_stopped", ["end_ms"]),
    (Done(audio_ms=5000, segments=2), "done", ["audio_ms", "segments"]),
    (Error(code="bad_audio", message="odd bytes"), "error", ["code", "message"]),
]


@pytest.mark.parametrize(("message", "kind", "fields"), _EXPECTED)
def test_server_message_dict_has_type_first(
    message: ServerMessage, kind: str, fields: list[str]
) -> None:
    data = message.to_dict()
    assert next(iter(data)) == "type"
    assert data["type"] == kind
    assert set(data) == {"type", *fields}


@pytest.mark.parametrize(("message", "kind", "fields"), _EXPECTED)
def test_server_message_json(message: ServerMessage, kind: str, fields: list[str]) -> None:
    text = message.to_json()
    assert text.startswith('{"type":"' + kind + '"')
    data = json.loads(text)
    assert list(data) == list(message.to_dict())
    assert data == message.to_dict()


def test_ready_carries_protocol_version() -> None:
    ready = _EXPECTED[0][0]
    assert isinstance(ready, Ready)
    data = ready.to_dict()
    assert data["protocol"] == PROTOCOL == "captiond.v1"
    assert data["sample_rate"] == 16_000


def test_json_keeps_non_ascii_text() -> None:
    text = Final(segment=0, start_ms=0, end_ms=1, text="größe café").to_json()
    assert "größe café" in text
    assert json.loads(text)["text"] == "größe café"


def test_message_values() -> None:
    partial = Partial(
        segment=2,
        rev=5,
        start_ms=30,
        end_ms=990,
        stable="a b",
        separator=" ",
        unstable="c",
        language="de",
    )
    assert partial.to_dict() == {
        "type": "partial",
        "segment": 2,
        "rev": 5,
        "start_ms": 30,
        "end_ms": 990,
        "stable": "a b",
        "separator": " ",
        "unstable": "c",
        "language": "de",
    }
