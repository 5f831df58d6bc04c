"""The session's language decision (streaming/language.py): detection, hysteresis, switches."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
from session_harness import NO_CONTEXT, RATE, Decoder, Driver, fake_decoder, silence, tone

from captiond.config import StreamConfig
from captiond.dialects.native import parse_stream_params
from captiond.engines.base import DecodeKind, EngineRequest, EngineResult, begins_with_space
from captiond.engines.rules import LANGUAGE_SWITCH_NATS, choose_language, request_language
from captiond.lang.languages import parse_language
from captiond.lang.text import units
from captiond.streaming.events import Control, Final, Partial, StreamParams
from captiond.streaming.utterance import StreamOrigin


def detecting_decoder(spoken: list[str]) -> tuple[Decoder, list[EngineRequest]]:
    """A multilingual engine's behaviour: the n-th utterance is in `spoken[n]` (told apart by
    the utterance start each request is detected from); the hint wins as choose_language says
    when the detection is unsure (here: never, the script is certain)."""
    seen: list[EngineRequest] = []
    starts: list[int] = []

    def decode(request: EngineRequest) -> EngineResult:
        seen.append(request)
        result = fake_decoder()(request)
        language = request.language
        if language is None:
            start = len(request.audio) - request.detect_from_sample
            starts.append(start)
            language = spoken[min(len(set(starts)) - 1, len(spoken) - 1)]
        return dataclasses.replace(result, language=language, language_probability=0.99)

    return decode, seen


def test_auto_language_is_decided_once_per_utterance_and_shown() -> None:
    decoder, seen = detecting_decoder(["de"])
    driver = Driver(decoder, params=StreamParams(language="auto"), stream=NO_CONTEXT)
    driver.send(silence(0.3))
    driver.send(tone(3.0))
    driver.send(silence(1.0))
    driver.control(Control.END)
    detecting = [r for r in seen if r.language is None]
    assert len(detecting) == 1, "detected once, then decoded in that language"
    assert len(detecting[0].audio) >= RATE  # not before `language_detect_s` of audio
    assert {r.language for r in seen if r.language is not None} == {"de"}
    shown = driver.of(Partial) + driver.of(Final)
    assert shown and {m.language for m in shown} == {"de"}


def test_punctuation_the_model_adds_to_the_context_is_not_part_of_the_next_final() -> None:
    # The first final is committed without its full stop; the second one's decode, forced
    # with it as context, begins by writing it ("。顔に…"): the full stop is not the next
    # final's first unit, and the prefix has no space between the two Japanese sentences.
    def decode(request: EngineRequest) -> EngineResult:
        if request.kind is DecodeKind.PARTIAL:
            return EngineResult(text="")
        if request.prefix == "出席できなかった":
            return EngineResult(text="。顔に車を止めた。")
        return EngineResult(text="出席できなかった")

    driver = Driver(decode, params=StreamParams(language="ja"))
    driver.send(np.concatenate([silence(0.3), tone(2.0), silence(1.0), tone(2.0), silence(1.0)]))
    driver.control(Control.END)
    assert [f.text for f in driver.of(Final)] == ["出席できなかった", "顔に車を止めた。"]


@pytest.mark.parametrize("stream", [StreamConfig(), NO_CONTEXT], ids=["context", "no context"])
def test_a_language_change_starts_a_new_context(stream: StreamConfig) -> None:
    """The second utterance is detected with the first one's language as the hint, and its
    decodes do not continue the first one's (German) text, as their prefix or as their
    prompt: with `context_s = 0` the prompt alone made Japanese after English come out in
    English."""
    decoder, seen = detecting_decoder(["de", "fr"])
    driver = Driver(decoder, params=StreamParams(language="auto"), stream=stream)
    driver.send(silence(0.3))
    driver.send(tone(2.0))
    driver.send(silence(1.0))
    driver.send(tone(3.5))  # `language_detect_s` or more: enough to switch on
    driver.send(silence(1.0))
    driver.control(Control.END)
    finals = driver.of(Final)
    assert [f.language for f in finals] == ["de", "fr"]
    second = [r for r in seen if r.language == "fr" or r.language_hint == "de"]
    assert second and all(r.language_hint == "de" for r in second)
    french = [r for r in driver.requests if r.engine_request.language == "fr"]
    assert french and all(r.engine_request.prefix == " ".join(r.forced_words) for r in french), (
        "only the utterance's own stable words are forced, no German context"
    )
    assert all(r.engine_request.prompt == "" for r in french), "no German prompt either"


def test_a_decode_that_finds_a_new_language_after_the_old_ones_text_is_done_again() -> None:
    """Without partials (`captiond transcribe`) an utterance's final is its first decode: it
    detects the language with the text so far as its prompt. When that text is in another
    language the result is thrown away and the final decoded again without it."""
    decoder, _ = detecting_decoder(["de", "fr"])
    driver = Driver(
        decoder, partials=False, early_finals=False, params=StreamParams(language="auto")
    )
    driver.send(np.concatenate([silence(0.3), tone(2.0), silence(1.0), tone(3.5), silence(1.0)]))
    driver.control(Control.END)
    assert [f.language for f in driver.of(Final)] == ["de", "fr"]
    second = [r.engine_request for r in driver.requests if r.utterance == 1]
    assert [r.language for r in second] == [None, "fr"]
    assert second[0].prefix or second[0].prompt, "the detecting decode had the German text"
    assert (second[1].prefix, second[1].prompt) == ("", "")


def test_an_utterance_the_first_second_does_not_tell_is_detected_on_more_audio() -> None:
    """After a Spanish utterance, one second of English kept Spanish (short of the switch's
    probability) but without being sure of it: nothing is shown in Spanish, and the decision
    waits for `language_detect_s` of the utterance, which tells English."""

    def decode(request: EngineRequest) -> EngineResult:
        result = fake_decoder()(request)
        heard_s = (len(request.audio) - request.detect_from_sample) / RATE
        if request.language is not None:
            language, probability = request.language, 1.0
        elif request.language_hint is None:
            language, probability = "es", 0.95
        else:
            language, probability = ("es", 0.3) if heard_s < 2.0 else ("en", 0.9)
        return dataclasses.replace(result, language=language, language_probability=probability)

    driver = Driver(decode, params=StreamParams(language="auto"))
    driver.send(np.concatenate([silence(0.3), tone(3.5), silence(1.0), tone(5.0), silence(1.0)]))
    driver.control(Control.END)
    assert [f.language for f in driver.of(Final)] == ["es", "en"]
    second = [p for p in driver.of(Partial) if p.segment == 1]
    assert second and {p.language for p in second} == {"en"}, "no partial in Spanish"
    detecting = [
        r for r in driver.requests if r.utterance == 1 and r.engine_request.language is None
    ]
    assert [r.kind for r in detecting] == [DecodeKind.PARTIAL, DecodeKind.PARTIAL]
    heard_s = [(r.end_sample - r.start_sample) / RATE for r in detecting]
    assert heard_s[0] < 2.0 <= 3.0 <= heard_s[1]


def heard_as(first_s: float, short: str, long: str) -> Decoder:
    """An engine after a German first utterance: later utterances are heard as `short` (sure,
    0.91) on less than `first_s` of audio and as `long` on more."""

    def decode(request: EngineRequest) -> EngineResult:
        result = fake_decoder()(request)
        heard_s = (len(request.audio) - request.detect_from_sample) / RATE
        if request.language is not None:
            language = request.language
        elif request.language_hint is None:
            language = "de"
        else:
            language = short if heard_s < first_s else long
        return dataclasses.replace(result, language=language, language_probability=0.91)

    return decode


def test_a_second_heard_as_another_language_does_not_switch_the_session() -> None:
    """base heard the first second of a German sentence as English at 0.91 and the sentence
    was decoded in English (translated). Another language on less than `language_detect_s`
    of audio waits for that much, which tells German: nothing is shown in English."""
    driver = Driver(heard_as(2.0, "en", "de"), params=StreamParams(language="auto"))
    driver.send(np.concatenate([silence(0.3), tone(3.5), silence(1.0), tone(5.0), silence(1.0)]))
    driver.control(Control.END)
    assert [f.language for f in driver.of(Final)] == ["de", "de"]
    shown = [m for m in driver.of(Partial) + driver.of(Final) if m.segment == 1]
    assert shown and {m.language for m in shown} == {"de"}, "nothing shown in English"
    detecting = [
        r for r in driver.requests if r.utterance == 1 and r.engine_request.language is None
    ]
    heard_s = [(r.end_sample - r.start_sample) / RATE for r in detecting]
    assert len(heard_s) == 2 and heard_s[0] < 2.0 <= 3.0 <= heard_s[1]


def test_an_utterance_too_short_to_tell_is_decoded_in_the_session_language() -> None:
    """Under `language_detect_s` of audio is too little to switch on, however sure the
    detection: a short utterance after German, heard as Korean at 0.91, has its final decoded
    in German."""
    driver = Driver(heard_as(30.0, "ko", "ko"), params=StreamParams(language="auto"))
    driver.send(np.concatenate([silence(0.3), tone(3.5), silence(1.0), tone(2.0), silence(1.0)]))
    driver.control(Control.END)
    assert [f.language for f in driver.of(Final)] == ["de", "de"]
    second = [r.engine_request for r in driver.requests if r.utterance == 1]
    finals = [r for r in second if r.kind is DecodeKind.FINAL]
    assert finals and all(r.language == "de" for r in finals)
    assert all(p.language == "de" for p in driver.of(Partial) if p.segment == 1)


def test_the_languages_to_detect_among_reach_the_engine() -> None:
    """`?language=en,de`: each detection is among them (Whisper hears Chinese here, a Chinese
    accent's English); a session update to others drops a session language outside them."""
    heard = {"zh": 0.6, "en": 0.3, "de": 0.1}
    seen: list[EngineRequest] = []

    def decode(request: EngineRequest) -> EngineResult:
        seen.append(request)
        result = fake_decoder()(request)
        if request.language is not None:
            return dataclasses.replace(result, language=request.language)
        choice = request_language(request, heard)
        return dataclasses.replace(
            result, language=choice.language, language_probability=choice.probability
        )

    params = parse_stream_params({"language": "en,de"}, "en")
    driver = Driver(decode, params=params, stream=NO_CONTEXT)
    driver.send(tone(4.0))
    driver.send(silence(1.0))
    assert [f.language for f in driver.of(Final)] == ["en"]
    assert {r.candidates for r in seen} == {("en", "de")}
    driver.session.set_language(parse_language("de,fr"))
    seen.clear()
    driver.send(tone(4.0))
    driver.send(silence(1.0))
    driver.control(Control.END)
    assert [f.language for f in driver.of(Final)] == ["en", "de"]
    detecting = [r for r in seen if r.language is None]
    assert detecting and all(r.language_hint is None for r in detecting), "en is not a candidate"
    assert {r.candidates for r in seen} == {("de", "fr")}


def test_fixed_language_and_translate_reach_the_engine() -> None:
    decoder, seen = detecting_decoder(["es"])
    driver = Driver(decoder, params=StreamParams(language="es", task="translate"))
    driver.send(tone(2.0))
    driver.send(silence(1.0))
    driver.control(Control.END)
    assert seen and all(r.language == "es" and r.task == "translate" for r in seen)
    assert {f.language for f in driver.of(Final)} == {"es"}


def test_an_utterance_without_speech_does_not_change_the_session_language() -> None:
    """The speech gate answers a noise utterance (here: the quieter tone) without a language:
    the session's language stays."""
    decoder, seen = detecting_decoder(["de"])

    def gated(request: EngineRequest) -> EngineResult:
        if float(np.abs(request.audio).max()) < 0.07:
            return EngineResult(text="")  # what the speech gate answers for no speech
        return decoder(request)

    driver = Driver(gated, params=StreamParams(language="auto"), stream=NO_CONTEXT)
    for amplitude in (0.1, 0.05, 0.1):
        driver.send(tone(2.0, amplitude=amplitude))
        driver.send(silence(1.0))
    driver.control(Control.END)
    hints = [r.language_hint for r in seen if r.language is None]
    assert hints[-1] == "de", "the third utterance still leans on German"
    assert [f.language for f in driver.of(Final) if f.text] == ["de", "de"]


def test_an_utterance_that_decoded_to_nothing_does_not_set_the_session_language() -> None:
    """Noise that Whisper hears as Welsh (35 %) and decodes to nothing shows no caption: the next
    utterance, English at 65 % and Welsh at 5 %, is decoded in English, not held to Welsh."""
    noise = {"cy": 0.35, "en": 0.30, "de": 0.25}
    speech = {"en": 0.65, "de": 0.2, "cy": 0.05}
    hints: list[str | None] = []

    def decode(request: EngineRequest) -> EngineResult:
        loud = float(np.abs(request.audio[request.detect_from_sample :]).max()) > 0.07
        language, probability = request.language, 1.0
        if language is None:
            hints.append(request.language_hint)
            choice = choose_language(speech if loud else noise, hints[-1])
            language, probability = choice.language, choice.probability
        result = fake_decoder()(dataclasses.replace(request, language=language))
        text = result.text if loud else ""
        return dataclasses.replace(
            result, text=text, language=language, language_probability=probability
        )

    driver = Driver(decode, params=StreamParams(language="auto"), stream=NO_CONTEXT)
    driver.send(tone(1.5, amplitude=0.05))
    driver.send(silence(1.5))
    driver.send(tone(4.0, amplitude=0.3))
    driver.send(silence(1.0))
    driver.control(Control.END)
    assert None in hints and "cy" not in hints
    assert [(f.language, bool(f.text)) for f in driver.of(Final)] == [("en", True)]


UNSURE_PT = {"pt": 0.72, "es": 0.14, "it": 0.04}  # base on the end of a Spanish sentence


@pytest.mark.parametrize(
    ("probabilities", "hint", "evidence", "chosen", "left"),
    [
        ({"en": 0.65, "cy": 0.05}, None, (None, 0.0), "en", None),  # no session language yet
        ({"en": 0.6, "de": 0.3}, "de", (None, 0.0), "de", "en"),  # English words, German meeting
        ({"en": 0.95, "de": 0.04}, "de", (None, 0.0), "en", None),  # 24 times as likely: switch
        (UNSURE_PT, "es", (None, 0.0), "es", "pt"),  # 5 times: kept, evidence left for pt
        (UNSURE_PT, "es", ("pt", math.log(0.72 / 0.14)), "pt", None),  # twice in a row: switch
        (UNSURE_PT, "es", ("it", 2.5), "es", "pt"),  # the evidence was for another language
        ({"en": 0.65, "cy": 0.0}, "cy", (None, 0.0), "en", None),  # underflowed: no evidence
    ],
)
def test_choose_language_switches_on_the_odds_of_consecutive_utterances(
    probabilities: dict[str, float],
    hint: str | None,
    evidence: tuple[str | None, float],
    chosen: str,
    left: str | None,
) -> None:
    choice = choose_language(probabilities, hint, *evidence)
    assert (choice.language, choice.probability) == (chosen, probabilities[chosen])
    assert choice.switch_language == left
    if left is not None:
        carried = evidence[1] if evidence[0] == left else 0.0
        odds = probabilities[left] / probabilities[chosen]
        assert choice.switch_nats == pytest.approx(carried + math.log(odds))
        assert choice.switch_nats < LANGUAGE_SWITCH_NATS


def test_choose_language_among_candidates() -> None:
    """Candidates renormalize Whisper's probabilities over their own tokens: the odds between
    two stay, so the switch rule reads the same evidence; a hint outside them is no hint."""
    heard = {"zh": 0.6, "en": 0.3, "de": 0.1}
    choice = choose_language(heard, None, candidates=("de", "en"))
    assert (choice.language, choice.probability) == ("en", pytest.approx(0.75))
    assert choose_language(heard, "zh", candidates=("de", "en")).language == "en"
    kept = choose_language(heard, "de", candidates=("de", "en"))
    assert (kept.language, kept.switch_language) == ("de", "en")
    assert kept.switch_nats == pytest.approx(math.log(3))
    assert choose_language(heard, "de", candidates=("de", "fr")).language == "de"
    assert choose_language(heard, "de", candidates=("fr",)).language == "de", "none it knows"
    # All of them underflowed: equally likely among themselves.
    none = choose_language({"zh": 1.0, "en": 0.0, "de": 0.0}, None, candidates=("en", "de"))
    assert (none.language, none.probability) == ("en", 0.5)


def test_the_evidence_for_a_switch_adds_up_over_consecutive_utterances_only() -> None:
    """A Spanish session: an utterance heard as Portuguese at 0.72 (Spanish 0.14) is decoded in
    Spanish; one heard as Spanish clears the evidence, so the next unsure one is Spanish again;
    two unsure ones in a row switch the session to Portuguese. A short utterance between them,
    too short to be detected, is no evidence either way."""
    # The fifth is the short one: its first second, heard as unsure, decides nothing.
    heard = [{"es": 0.9, "pt": 0.05}, UNSURE_PT, {"es": 0.8, "pt": 0.1}] + [UNSURE_PT] * 3
    # Each utterance's detections (an unsure one is detected again on more audio), by its start.
    detections: dict[int, list[EngineRequest]] = {}

    def decode(request: EngineRequest) -> EngineResult:
        result = fake_decoder()(request)
        if request.language is not None:
            return dataclasses.replace(result, language=request.language)
        start = request.end_sample - (len(request.audio) - request.detect_from_sample)
        detections.setdefault(start, []).append(request)
        choice = request_language(request, heard[len(detections) - 1])
        return dataclasses.replace(
            result,
            language=choice.language,
            language_probability=choice.probability,
            switch_language=choice.switch_language,
            switch_nats=choice.switch_nats,
        )

    driver = Driver(decode, params=StreamParams(language="auto"), stream=NO_CONTEXT)
    for i in range(len(heard) - 1):
        driver.send(tone(4.0))
        driver.send(silence(1.0))
        if i == 3:
            driver.send(tone(0.8))  # decoded in the session's language, not detected
            driver.send(silence(1.0))
    driver.control(Control.END)
    languages = [f.language for f in driver.of(Final) if f.text]
    assert languages == ["es", "es", "es", "es", "es", "pt"]
    carried = [{r.switch_language for r in requests} for requests in detections.values()]
    # The first unsure one's evidence is cleared by the Spanish one after it; the second's
    # reaches the short one (whose 1-s detection decides nothing) and, past it, the last.
    assert carried == [{None}, {None}, {"pt"}, {None}, {"pt"}, {"pt"}]


def test_a_session_taken_back_after_a_restart_goes_on_in_its_language() -> None:
    """With ?language=auto, the journal's last caption's language is the next utterance's hint
    (the server passes it as the origin's language), as it would have been without the restart."""
    decoder, seen = detecting_decoder(["de"])
    origin = StreamOrigin(start_sample=0, first_segment=3, earlier_text="Guten Tag.", language="de")
    driver = Driver(decoder, params=StreamParams(language="auto"), origin=origin)
    driver.send(tone(2.0))
    driver.send(silence(1.0))
    driver.control(Control.END)
    assert {r.language_hint for r in seen if r.language is None} == {"de"}


def saying(partials: list[str], whole: str) -> Decoder:
    """A decoder that says `partials` in turn, then `whole`, as an engine answers: the text
    after the request's forced prefix, and whether it began with a space."""

    def decode(request: EngineRequest) -> EngineResult:
        said = partials.pop(0) if partials and request.kind is DecodeKind.PARTIAL else whole
        assert said.startswith(request.prefix), (request.prefix, said)
        new = said[len(request.prefix) :]
        text = new.strip()
        probs = (0.9,) * len(units(text))
        return EngineResult(text=text, unit_probs=probs, spaced=begins_with_space(new))

    return decode


def test_the_rest_of_a_hyphenated_word_joins_the_last_stable_word() -> None:
    """Stable "Yes, time", and the next decode, forced with it, goes on with "-wise," (no space
    before it): the partials and the final write "time-wise,", not "time -wise,", and the
    words after it still become stable."""
    whole = "Yes, time-wise, it should be after two."
    partials = [
        "Yes, time is",
        "Yes, time is up",
        "Yes, time-wise, it",
        "Yes, time-wise, it should",
    ]
    driver = Driver(saying(partials, whole), stream=NO_CONTEXT)
    driver.send(np.concatenate([silence(0.5), tone(3.0), silence(1.0)]))
    driver.control(Control.END)
    shown = [p.stable + p.separator + p.unstable for p in driver.of(Partial)]
    assert shown[2:4] == ["Yes, time-wise, it", "Yes, time-wise, it should"]
    assert driver.of(Partial)[3].stable == "Yes, time-wise,"
    assert driver.of(Partial)[-1].stable.startswith("Yes, time-wise, it should")
    assert driver.of(Final)[0].text == whole


def test_a_thai_tone_mark_stays_with_its_character_through_stable_text() -> None:
    """Whisper's tokens split "ค่ะ" into "ค", "่", "ะ": a partial may end at "ค่" and the next
    decode, forced with it, go on with "ะ". Units are whole characters with their marks, so
    the stable text never ends between "ค" and "่", and a decode that goes on with a mark is
    text, not punctuation to leave out: the final keeps "ค่ะ" (polite), not "คะ" (a question)."""
    whole = "สวัสดีค่ะ ยินดีที่ได้รู้จัก"
    decode = saying(["สวัสดีค่", "สวัสดีค่ะ ยิน"], whole)
    driver = Driver(decode, params=StreamParams(language="th"), stream=NO_CONTEXT)
    driver.send(np.concatenate([silence(0.5), tone(3.0), silence(1.0)]))
    driver.control(Control.END)
    assert not any(p.stable.endswith("ค") for p in driver.of(Partial))
    assert driver.of(Final)[0].text == whole


@pytest.mark.parametrize(
    ("language", "partials", "whole", "stable", "between"),
    [
        # Latin written onto Chinese: no space, though Latin words have them.
        ("zh", ["我用Python", "我用Python写代"], "我用Python写代码。", "我用", ""),
        # A Thai phrase after another: the space that parts them.
        ("th", ["สวัสดีครับ ผ", "สวัสดีครับ ผมชื่อ"], "สวัสดีครับ ผมชื่อสมชาย", "สวัสดีครับ", " "),
    ],
)
def test_a_partials_separator_is_the_texts_own(
    language: str, partials: list[str], whole: str, stable: str, between: str
) -> None:
    """What a partial's `separator` puts between `stable` and `unstable` is what the decode had
    there, so the two read as the final will: "我用" "" "Python写代", "สวัสดีครับ" " " "ผมชื่อ"."""
    said = [*partials, whole]
    driver = Driver(saying(partials, whole), params=StreamParams(language=language))
    driver.send(np.concatenate([silence(0.5), tone(3.0), silence(1.0)]))
    driver.control(Control.END)
    shown = driver.of(Partial)
    assert all(p.stable + p.separator + p.unstable in said for p in shown if p.unstable)
    assert any(p.stable == stable and p.separator == between for p in shown)
    assert driver.of(Final)[0].text == whole
