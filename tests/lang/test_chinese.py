"""Chinese in the reader's script (lang/chinese.py): the variant a language tag names, OpenCC's
conversion, and a session that writes every partial, stable word and final in one script
whichever script Whisper wrote each decode in."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from session_harness import NO_CONTEXT, Driver, silence, tone

from captiond.cli import build_parser
from captiond.cli.options import config_from
from captiond.config import StreamConfig, config_from_mapping
from captiond.dialects.native import parse_stream_params
from captiond.dialects.openai_realtime import OpenAIRealtimeDialect
from captiond.engines.base import DecodeKind, EngineRequest, EngineResult
from captiond.errors import ConfigError
from captiond.lang.chinese import written
from captiond.lang.languages import parse_language
from captiond.streaming import session as session_module
from captiond.streaming.events import Control, Final, Partial, StreamParams

TRADITIONAL = "對於更高階的導數"
SIMPLIFIED = "对于更高阶的导数"


@pytest.mark.parametrize(
    ("tag", "language", "variant"),
    [
        ("zh", "zh", None),
        ("zh-CN", "zh", "zh-Hans"),
        ("zh-Hans", "zh", "zh-Hans"),
        ("zh-SG", "zh", "zh-Hans"),
        ("zh-Hant", "zh", "zh-Hant"),
        ("zh-TW", "zh", "zh-TW"),
        ("zh-Hant-TW", "zh", "zh-TW"),
        ("ZH-hk", "zh", "zh-HK"),
        ("zh-MO", "zh", "zh-HK"),
        ("zh-Hant-CN", "zh", "zh-Hant"),
        ("zh-Hans-TW", "zh", "zh-Hans"),
        ("zh-US", "zh", None),
        ("en-US", "en", None),
        ("pt-BR", "pt", None),
        ("auto", "auto", None),
    ],
)
def test_a_language_tag_names_the_language_and_the_script_of_chinese(
    tag: str, language: str, variant: str | None
) -> None:
    params = parse_stream_params({"language": tag}, "en")
    assert (params.language, params.chinese_variant) == (language, variant)


@pytest.mark.parametrize(
    ("variant", "expected"),
    [
        ("zh-Hans", "对于更高阶的导数。为了里面。为 里 为 里"),
        ("zh-Hant", "對於更高階的導數。爲了裏面。爲 裏 爲 裏"),
        ("zh-TW", "對於更高階的導數。為了裡面。為 裡 為 裡"),
        ("zh-HK", "對於更高階的導數。為了裏面。為 裏 為 裏"),
        ("", "對於更高階的導数。为了里面。為 裡 爲 裏"),
    ],
)
def test_text_is_written_in_the_variant_from_either_script(variant: str, expected: str) -> None:
    # Whisper's text mixes both scripts at times, and traditional characters in Taiwan's forms
    # (為, 裡) or others (爲, 裏): each variant writes all of it one way.
    assert written("對於更高階的導数。为了里面。為 裡 爲 裏", "zh", variant) == expected


def test_only_chinese_is_converted() -> None:
    # Japanese kanji are not traditional Chinese, and a translation is English.
    assert written("漢字の練習", "ja", "zh-Hans") == "漢字の練習"
    assert written("For higher derivatives", "zh", "zh-Hans") == "For higher derivatives"


def test_phrases_are_converted_as_phrases() -> None:
    # 乾 is 干 ("dry") alone and stays 乾 in 乾隆 (an emperor's era name).
    assert written("口乾。乾隆", "zh", "zh-Hans") == "口干。乾隆"


def chinese_decoder(partial_texts: list[str], final_text: str) -> object:
    """Partials decode `partial_texts` in turn (each a whole utterance so far, whichever
    script), the final `final_text`; each after the forced prefix, as an engine returns it."""
    seen: list[EngineRequest] = []

    def decode(request: EngineRequest) -> EngineResult:
        seen.append(request)
        whole = final_text if request.kind is DecodeKind.FINAL else partial_texts.pop(0)
        # The prefix is in the reader's script: the engine's text after it, in its own.
        done = len(request.prefix)
        new = whole[done:] if len(whole) > done else ""
        return EngineResult(text=new, unit_probs=(0.9,) * len(new))

    decode.seen = seen  # type: ignore[attr-defined]
    return decode


def stream_one_utterance(decoder: object, params: StreamParams) -> Driver:
    driver = Driver(decoder, params=params, stream=NO_CONTEXT)  # type: ignore[arg-type]
    driver.send(np.concatenate([silence(0.5), tone(3.0), silence(1.0)]))
    driver.control(Control.END)
    return driver


def test_a_stream_is_written_in_one_script_when_whisper_switches() -> None:
    # Whisper writes the first partials in traditional characters, then simplified, the final
    # in traditional again: every caption is simplified, and what was stable stays.
    decoder = chinese_decoder(
        [TRADITIONAL[:4], TRADITIONAL[:6], SIMPLIFIED[:7], *[TRADITIONAL] * 8], TRADITIONAL
    )
    driver = stream_one_utterance(decoder, StreamParams(language="zh"))
    partials = driver.of(Partial)
    assert len(partials) >= 3
    for partial in partials:
        text = partial.stable + partial.unstable
        assert text == SIMPLIFIED[: len(text)], text
    assert any(p.stable for p in partials)
    assert driver.of(Final)[0].text == SIMPLIFIED
    # What later decodes are forced to start with is the reader's text, too.
    prefixes = [r.prefix for r in decoder.seen if r.prefix]  # type: ignore[attr-defined]
    assert prefixes and all(p == SIMPLIFIED[: len(p)] for p in prefixes)


def test_a_tag_naming_traditional_writes_traditional() -> None:
    decoder = chinese_decoder([SIMPLIFIED[:4], *[SIMPLIFIED] * 10], SIMPLIFIED)
    params = parse_stream_params({"language": "zh-TW"}, "en")
    driver = stream_one_utterance(decoder, params)
    assert driver.of(Final)[0].text == TRADITIONAL


def test_no_variant_keeps_what_whisper_wrote() -> None:
    decoder = chinese_decoder([SIMPLIFIED[:4], *[TRADITIONAL] * 10], TRADITIONAL)
    driver = stream_one_utterance(decoder, StreamParams(language="zh", chinese_variant=""))
    assert driver.of(Partial)[0].unstable == SIMPLIFIED[:4]
    assert driver.of(Final)[0].text == TRADITIONAL


def test_set_language_with_a_tag_switches_the_script_from_the_next_utterance() -> None:
    # A vendor's session update names "zh-TW" while an utterance is open: that utterance stays
    # in the script it began in (as its language does), the next one is traditional.
    def decode(request: EngineRequest) -> EngineResult:
        new = TRADITIONAL[len(request.prefix) :] if len(request.prefix) < 8 else ""
        return EngineResult(text=new, unit_probs=(0.9,) * len(new))

    driver = Driver(decode, params=StreamParams(language="zh"), stream=NO_CONTEXT)
    driver.send(np.concatenate([silence(0.5), tone(1.5)]))
    driver.session.set_language(parse_language("zh-TW"))
    assert driver.session.params.chinese_variant == "zh-TW"
    driver.send(np.concatenate([tone(1.5), silence(1.0), tone(3.0), silence(1.0)]))
    driver.control(Control.END)
    assert [f.text for f in driver.of(Final)] == [SIMPLIFIED, TRADITIONAL]
    driver.session.set_language(parse_language("zh"))  # no variant named: the daemon's
    assert driver.session.params.chinese_variant == "zh-Hans"


def test_openai_session_update_may_name_the_script() -> None:
    dialect = OpenAIRealtimeDialect({"intent": "transcription"})
    dialect.stream_params("en")
    transcription = {"language": "zh-TW"}
    session = {"type": "transcription", "audio": {"input": {"transcription": transcription}}}
    received = dialect.receive(json.dumps({"type": "session.update", "session": session}))
    assert received.language == parse_language("zh-TW")
    (reply,) = received.replies
    assert json.loads(reply)["session"]["audio"]["input"]["transcription"]["language"] == "zh-TW"


def test_a_conversion_that_changes_the_length_leaves_stability_to_agreement(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Were a phrase converted to one of another length, the units' probabilities would no
    # longer line up with the units: the partial then tells nothing of its units' certainty.
    monkeypatch.setattr(session_module, "written", lambda text, *_: text + "们" if text else text)
    sure: list[int | None] = []
    original = session_module.StreamSession._sure_units

    def spy(self: object, request: object, probs: tuple[float, ...], units: object) -> object:
        sure.append(len(probs))
        return original(self, request, probs, units)  # type: ignore[arg-type]

    monkeypatch.setattr(session_module.StreamSession, "_sure_units", spy)
    stream_one_utterance(
        chinese_decoder([SIMPLIFIED[:4], *[SIMPLIFIED] * 10], SIMPLIFIED),
        StreamParams(language="zh"),
    )
    assert sure and set(sure) == {0}


def test_the_daemon_default_is_simplified_and_checked() -> None:
    assert StreamConfig().chinese_variant == "zh-Hans"
    config = config_from_mapping({"stream": {"chinese_variant": "zh-TW"}})
    assert config.stream.chinese_variant == "zh-TW"
    with pytest.raises(ConfigError, match="chinese_variant"):
        config_from_mapping({"stream": {"chinese_variant": "big5"}})
    with pytest.raises(ConfigError, match='write "zh" and chinese_variant = "zh-TW"'):
        config_from_mapping({"stream": {"language": "zh-TW"}})
    with pytest.raises(ConfigError, match='write "en"'):
        config_from_mapping({"stream": {"language": "EN"}})
    with pytest.raises(ConfigError, match="language"):
        config_from_mapping({"stream": {"language": "chinese"}})


def test_the_command_line_language_may_name_the_variant(tmp_path: Path) -> None:
    args = build_parser().parse_args(["transcribe", str(tmp_path / "a.wav"), "--language", "zh-TW"])
    config = config_from(args)
    assert (config.stream.language, config.stream.chinese_variant) == ("zh", "zh-TW")
    args = build_parser().parse_args(["transcribe", str(tmp_path / "a.wav"), "--language", "de"])
    assert config_from(args).stream.chinese_variant == "zh-Hans"
