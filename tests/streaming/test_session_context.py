"""Decode context (prompt, prefix) and the stable promise of partials."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from session_harness import (
    CHUNK_MS,
    NO_CONTEXT,
    RATE,
    Decoder,
    Driver,
    LevelVad,
    after_prefix,
    s16,
    silence,
    tone,
    two_utterances,
)

from captiond.config import Config, StreamConfig
from captiond.engines.base import DecodeKind, EngineRequest, EngineResult
from captiond.engines.rules import token_counter
from captiond.streaming.events import Control, Final, Partial, SpeechStopped, StreamParams
from captiond.streaming.session import StreamSession
from captiond.streaming.utterance import DecodeRequest


def test_a_decode_continues_from_the_previous_finals_audio_and_text() -> None:
    driver = Driver()
    # Speech from the stream's start: the first final's audio starts there, with no quiet
    # before it, as the second one's window does.
    for samples in (tone(2.0), silence(1.0), tone(1.5), silence(1.0)):
        driver.send(samples)
    driver.control(Control.END)
    first, second = (f.text for f in driver.of(Final))
    by_utterance: dict[int, list[DecodeRequest]] = {}
    for r in driver.requests:
        by_utterance.setdefault(r.utterance, []).append(r)
    u0, u1 = (by_utterance[u] for u in sorted(by_utterance))
    final0 = u0[-1]
    for r in u1:
        # The window starts where the first utterance did; its final is the forced prefix.
        assert len(r.engine_request.audio) == r.end_sample - final0.start_sample
        assert r.engine_request.prefix.split()[: len(first.split())] == first.split()
        assert r.engine_request.prompt == ""
    # The fake engine numbers words from the window's start: the second final continues after
    # the first one's words and the silence between them.
    assert int(second.split()[0][1:]) > int(first.split()[-1][1:].rstrip(".")) + 1


def test_without_context_a_decode_hears_the_quiet_before_its_utterance() -> None:
    # 40 s of quiet, then an utterance: its decodes reach back over the quiet as far as their
    # window (partials 10 s, the final 30 s), and the buffer kept that audio for them.
    driver = Driver()
    driver.send(silence(40.0))
    driver.send(tone(2.0))
    driver.send(silence(1.0))
    driver.control(Control.END)
    (utterance,) = {r.start_sample for r in driver.requests}
    assert 39 * RATE < utterance < 40 * RATE
    for r in driver.requests:
        window_s = 30 if r.kind is DecodeKind.FINAL else 10
        assert len(r.engine_request.audio) == window_s * RATE
    assert {r.kind for r in driver.requests} == {DecodeKind.PARTIAL, DecodeKind.FINAL}


def test_buffered_audio_counts_from_the_oldest_utterance_waiting_for_its_final() -> None:
    # What backpressure (`max_buffered_s`) bounds: not the quiet and context the buffer keeps.
    session = StreamSession(
        config=Config(), vad=LevelVad(), params=StreamParams(), count_tokens=token_counter()
    )
    for samples in (silence(40.0), tone(2.0), silence(0.2)):
        session.receive_audio(s16(samples))
    assert session.buffered_samples == 0  # the utterance is open: nothing waits for a final
    session.receive_audio(s16(silence(5.0)))  # its endpoint: the final is due, not answered
    assert 7 * RATE < session.buffered_samples < 8 * RATE
    while (request := session.next_request()) is not None:
        session.on_result(request, EngineResult(text="hello"))
    assert session.buffered_samples == 0


def test_a_decode_after_a_broken_context_starts_after_what_broke_it() -> None:
    # The first utterance's final is empty (noise): the second is decoded without it, from
    # where the quiet after it began.
    finals = iter([EngineResult(text=""), EngineResult(text="hello")])

    def decode(request: EngineRequest) -> EngineResult:
        if request.kind is DecodeKind.PARTIAL:
            return EngineResult(text="")
        return next(finals)

    driver = Driver(decoder=decode)
    two_utterances(driver)
    driver.control(Control.END)
    first, second = (r for r in driver.requests if r.kind is DecodeKind.FINAL)
    (stopped, _) = driver.of(SpeechStopped)
    assert len(first.engine_request.audio) == first.end_sample  # from the stream's start
    quiet_from = stopped.end_ms * RATE // 1000
    assert quiet_from < second.start_sample
    assert len(second.engine_request.audio) == second.end_sample - quiet_from
    assert second.engine_request.prefix == ""


def test_partials_reach_back_less_far_than_finals() -> None:
    stream = StreamConfig(partial_context_s=1.0)
    driver = Driver(stream=stream)
    two_utterances(driver)
    driver.control(Control.END)
    second = [r for r in driver.requests if r.utterance == driver.requests[-1].utterance]
    partials = [r for r in second if r.kind is DecodeKind.PARTIAL]
    assert partials and all(r.engine_request.prefix == " ".join(r.forced_words) for r in partials)
    assert second[-1].engine_request.prefix != " ".join(second[-1].forced_words)


def test_stable_words_are_forced_into_later_partials_and_kept_by_the_final() -> None:
    driver = Driver(stream=NO_CONTEXT)
    driver.send(np.concatenate([silence(0.5), tone(3.0), silence(1.0)]))
    driver.control(Control.END)
    stable = ""
    for r in driver.requests:
        assert " ".join(r.stable_words).startswith(stable)
        stable = " ".join(r.stable_words)
        if r.kind is DecodeKind.PARTIAL:
            assert r.engine_request.prefix == stable
        else:
            # The final decodes freely: a forced partial-quality prefix would spread its
            # errors into every later decode that continues from this final.
            assert r.engine_request.prefix == "" and r.forced_words == ()
    assert stable, "the final request carried the stable words"
    assert driver.of(Final)[0].text.startswith(stable)


@pytest.mark.parametrize(
    ("heard", "decoded", "stable", "final"),
    [
        # Whisper's final extends a stable word ("fellow" -> "fellows") and disagrees with
        # another: the stable words stay as shown, the decode supplies what follows them.
        (
            "And so my fellow Americans",
            "And so am I fellows Americans, ask not",
            "And so my fellow",
            "And so my fellow Americans, ask not",
        ),
        # The partials wrote "thirty eight" (stable) and the final decode "38": one for one,
        # the two stable words stood for "38 apples." and "apples." was lost. The final goes
        # on where the decode has the word the newest partial showed after the stable ones.
        (
            "I have thirty eight apples",
            "I have 38 apples.",
            "I have thirty eight",
            "I have thirty eight apples.",
        ),
    ],
)
def test_a_final_that_disagrees_keeps_the_stable_words_and_takes_the_rest(
    heard: str, decoded: str, stable: str, final: str
) -> None:
    def decode(request: EngineRequest) -> EngineResult:
        if request.kind is DecodeKind.FINAL:
            assert request.prefix == ""
            return EngineResult(text=decoded)
        return after_prefix(request, EngineResult(text=heard))

    driver = Driver(decode, stream=NO_CONTEXT)
    driver.send(np.concatenate([silence(0.5), tone(2.5), silence(1.0)]))
    driver.control(Control.END)
    assert driver.of(Partial)[-1].stable == stable
    assert driver.of(Final)[0].text == final


def test_punctuation_after_the_forced_words_is_not_a_word_of_its_own() -> None:
    # Forced "Hello", Whisper goes on with the comma it would have put after it: the partial
    # must not show (and then promise) "Hello , there" with the comma as a word. The comma
    # ends "Hello" instead (stable text grows by it), so the final keeps it.
    def decode(request: EngineRequest) -> EngineResult:
        if request.kind is DecodeKind.FINAL:
            return EngineResult(text="Hello there world.")
        if request.prefix == "Hello":
            return EngineResult(text=", there world", unit_probs=(1.0, 0.9, 0.9))
        if request.prefix:
            return after_prefix(request, EngineResult(text="Hello, there world"))
        return EngineResult(text="Hello there", unit_probs=(0.9, 0.9))

    driver = Driver(decode, stream=NO_CONTEXT)
    driver.send(np.concatenate([silence(0.5), tone(3.0), silence(1.0)]))
    driver.control(Control.END)
    partials = driver.of(Partial)
    assert any(p.stable == "Hello" for p in partials)
    texts = [" ".join(filter(None, (p.stable, p.unstable))) for p in partials]
    assert texts[-1] == "Hello, there world"
    assert all("," not in t.split() for t in texts)
    assert any(p.stable.startswith("Hello,") for p in partials)
    assert driver.of(Final)[0].text == "Hello, there world."


@pytest.mark.parametrize("spaced", [False, True])
def test_digits_written_after_forced_chinese_characters_stay_glued_to_them(
    spaced: bool,
) -> None:
    # Stable "加进", and Whisper goes on with "38年…" right after it (no space before "38"):
    # the stable text, and so the final that starts with it, is "加进38…", not "加进 38…".
    # A continuation that began with a space keeps it.
    sentence = "加进38年登进士"

    def decode(request: EngineRequest) -> EngineResult:
        if request.kind is DecodeKind.FINAL:
            return EngineResult(text=sentence)
        if request.prefix == "加进":
            return EngineResult(text="38年登进士", unit_probs=(0.9,) * 6, spaced=spaced)
        if request.prefix:
            return EngineResult(text="", unit_probs=())
        return EngineResult(text="加进38", unit_probs=(0.9, 0.9, 0.9))

    driver = Driver(decode, stream=NO_CONTEXT)
    driver.send(np.concatenate([silence(0.5), tone(3.0), silence(1.0)]))
    driver.control(Control.END)
    stables = {p.stable for p in driver.of(Partial)}
    assert "加进" in stables
    glued = [s for s in stables if "38" in s]
    assert glued, stables
    if spaced:
        assert all(s.startswith("加进 38") for s in glued)
        assert driver.of(Final)[0].text.startswith("加进 38")
    else:
        assert all(s.startswith("加进38") for s in glued)
        assert driver.of(Final)[0].text == sentence


def test_words_the_partials_were_unsure_of_are_not_stable() -> None:
    # Every partial says "my", but at p = 0.6, under the default floor (0.7): the final may
    # hear "am I", so neither "my" nor anything after it is promised; the words before it are.
    def decode(request: EngineRequest) -> EngineResult:
        if request.kind is DecodeKind.FINAL:
            return EngineResult(text="And so am I fellow Americans, ask not")
        words = ["And", "so", "my", "fellow", "Americans"]
        probs = dict(zip(words, (0.9, 0.8, 0.6, 0.9, 0.9), strict=True))
        new = words[len(request.prefix.split()) :]
        return EngineResult(text=" ".join(new), unit_probs=tuple(probs[w] for w in new))

    driver = Driver(decode, stream=NO_CONTEXT)
    driver.send(np.concatenate([silence(0.5), tone(2.5), silence(1.0)]))
    driver.control(Control.END)
    assert {p.stable for p in driver.of(Partial)[1:]} == {"And so"}
    assert driver.of(Final)[0].text == "And so am I fellow Americans, ask not"
    # With the floor at 0, agreement alone decides, as for an engine that does not tell.
    driver = Driver(decode, stream=dataclasses.replace(NO_CONTEXT, stable_min_probability=0))
    driver.send(np.concatenate([silence(0.5), tone(2.5), silence(1.0)]))
    driver.control(Control.END)
    assert driver.of(Partial)[-1].stable == "And so my fellow"


def test_later_decodes_continue_from_the_decoded_final_not_the_stable_words() -> None:
    finals = iter(["Hello there, friend.", "Second."])

    def decode(request: EngineRequest) -> EngineResult:
        if request.kind is DecodeKind.FINAL:
            return EngineResult(text=next(finals))
        return after_prefix(request, EngineResult(text="hello hello there friend"))

    driver = Driver(decode)
    two_utterances(driver)
    driver.control(Control.END)
    second = [r for r in driver.requests if r.utterance == driver.requests[-1].utterance]
    assert driver.of(Final)[0].text.startswith(driver.of(Partial)[0].stable)
    assert second[-1].engine_request.prefix == "Hello there, friend."


def ends_at_once_after_context(*alone: str, ended: str = "。") -> Decoder:
    """Partials hear "so we meet"; a final forced to continue earlier finals (or prompted with
    them) ends at once, as Whisper did on a Japanese turn (writing `ended`: "。"); those
    without them hear the texts of `alone`, one after the other."""
    texts = iter(alone)

    def decode(request: EngineRequest) -> EngineResult:
        if request.kind is DecodeKind.PARTIAL:
            return after_prefix(request, EngineResult(text="so we meet"))
        if request.prefix or request.prompt:
            return EngineResult(text=ended, avg_logprob=-0.1, no_speech_prob=0.0)
        return EngineResult(text=next(texts), avg_logprob=-0.2, no_speech_prob=0.05)

    return decode


def finals_of_last_utterance(driver: Driver) -> list[EngineRequest]:
    last = driver.requests[-1].utterance
    return [
        r.engine_request
        for r in driver.requests
        if r.utterance == last and r.kind is DecodeKind.FINAL
    ]


@pytest.mark.parametrize("early_finals", [True, False])
@pytest.mark.parametrize("stream", [StreamConfig(), NO_CONTEXT], ids=["prefix", "prompt"])
def test_a_final_that_ends_at_once_after_its_context_is_decoded_again_alone(
    early_finals: bool, stream: StreamConfig
) -> None:
    driver = Driver(
        ends_at_once_after_context("so we meet again", "so we met again"),
        stream=stream,
        early_finals=early_finals,
    )
    two_utterances(driver)
    driver.control(Control.END)
    assert [f.text for f in driver.of(Final)] == ["so we meet again", "so we met again"]
    with_context, alone = finals_of_last_utterance(driver)
    assert with_context.prefix if stream.context_s else with_context.prompt
    assert (alone.prefix, alone.prompt) == ("", "")
    assert alone.end_sample == with_context.end_sample
    # Alone, its window starts as a stream's first utterance's does: at the quiet before it.
    if with_context.prefix:
        assert len(alone.audio) < len(with_context.audio)
    else:
        assert len(alone.audio) == len(with_context.audio)


def test_a_final_that_ends_at_once_again_alone_keeps_its_stable_words() -> None:
    driver = Driver(ends_at_once_after_context("so we meet again", ""))
    two_utterances(driver)
    driver.control(Control.END)
    assert len(finals_of_last_utterance(driver)) == 2  # decoded alone once, not again
    assert driver.of(Partial)[-1].stable == "so we"
    assert [f.text for f in driver.of(Final)] == ["so we meet again", "so we"]


def test_an_utterance_that_showed_no_words_and_decoded_to_nothing_is_not_decoded_again() -> None:
    # Without partials, nothing was shown: a final with context that decodes to nothing at all
    # may be noise, which Whisper alone could caption.
    driver = Driver(ends_at_once_after_context("Thank you.", ended=""), partials=False)
    two_utterances(driver)
    driver.control(Control.END)
    assert [f.text for f in driver.of(Final)] == ["Thank you."]
    assert [r.utterance for r in driver.requests].count(driver.requests[-1].utterance) == 1


def test_a_final_that_only_closed_its_contexts_sentence_is_decoded_again_alone() -> None:
    # Whisper forced to continue the earlier finals wrote their sentence's "。" and ended: it
    # heard the utterance as the end of the last one (two turns of a fast Chinese session were
    # lost so, their partials ending at once too). Without any partial shown, it is decoded
    # again alone.
    driver = Driver(
        ends_at_once_after_context("so we meet again", "so we met again"), partials=False
    )
    two_utterances(driver)
    driver.control(Control.END)
    assert [f.text for f in driver.of(Final)] == ["so we meet again", "so we met again"]
    with_context, alone = finals_of_last_utterance(driver)
    assert with_context.prefix and (alone.prefix, alone.prompt) == ("", "")


def repeats_after_context(*alone: str) -> Decoder:
    """A final forced to continue earlier finals writes their last sentence again (and again,
    the more copies the prefix holds), as Whisper did in a fast Japanese session; those without
    context hear the texts of `alone`, one after the other."""
    texts = iter(alone)

    def decode(request: EngineRequest) -> EngineResult:
        if request.kind is DecodeKind.FINAL and request.prefix:
            return EngineResult(text="We met.", avg_logprob=-0.2, no_speech_prob=0.0)
        if request.kind is DecodeKind.FINAL:
            return EngineResult(text=next(texts), avg_logprob=-0.2, no_speech_prob=0.05)
        return EngineResult(text="")

    return decode


def test_a_final_that_repeats_its_contexts_last_words_is_decoded_again_alone() -> None:
    driver = Driver(repeats_after_context("We met.", "She saw him."), partials=False)
    two_utterances(driver)
    driver.control(Control.END)
    assert [f.text for f in driver.of(Final)] == ["We met.", "She saw him."]
    with_context, alone = finals_of_last_utterance(driver)
    assert with_context.prefix == "We met." and (alone.prefix, alone.prompt) == ("", "")


def test_a_speaker_who_said_the_same_again_gets_it_from_the_decode_alone() -> None:
    driver = Driver(repeats_after_context("We met.", "We met."), partials=False)
    two_utterances(driver)
    driver.control(Control.END)
    assert [f.text for f in driver.of(Final)] == ["We met.", "We met."]
    assert len(finals_of_last_utterance(driver)) == 2  # decoded alone once, not again


def runs_out_of_tokens_after_a_prefix(decode_alone: str) -> Decoder:
    """A final after a prefix stops at its token budget ("so we", truncated), as a long
    Japanese utterance after a few hundred characters of context did; alone, it hears
    `decode_alone` (the first utterance's final too)."""

    def decode(request: EngineRequest) -> EngineResult:
        if request.kind is DecodeKind.PARTIAL:
            return after_prefix(request, EngineResult(text="so we meet"))
        if request.prefix:
            return EngineResult(text="so we", avg_logprob=-0.1, truncated=True)
        return EngineResult(text=decode_alone, avg_logprob=-0.2, no_speech_prob=0.05)

    return decode


@pytest.mark.parametrize("early_finals", [True, False])
def test_a_final_that_runs_out_of_tokens_after_its_prefix_is_decoded_again_alone(
    early_finals: bool,
) -> None:
    driver = Driver(
        runs_out_of_tokens_after_a_prefix("so we meet again"), early_finals=early_finals
    )
    two_utterances(driver)
    driver.control(Control.END)
    assert [f.text for f in driver.of(Final)] == ["so we meet again", "so we meet again"]
    with_prefix, alone = finals_of_last_utterance(driver)
    assert with_prefix.prefix == "so we meet again" and alone.prefix == alone.prompt == ""
    assert alone.end_sample == with_prefix.end_sample


def test_a_loop_the_engine_stopped_is_dropped_as_a_repetitive_one() -> None:
    """torch_graph stops a loop early (`EngineResult.looped`), before its text is repetitive
    enough for the compression-ratio rule: it is dropped all the same, not sent as a final
    (with context, the final is then decoded again alone, as one the rule dropped)."""
    finals: list[EngineRequest] = []

    def decode(request: EngineRequest) -> EngineResult:
        finals.append(request)
        if len(finals) == 1:
            return EngineResult(text="Thank you.", avg_logprob=-0.2, no_speech_prob=0.05)
        loop = "so we we we we"
        return EngineResult(text=loop, compression_ratio=1.3, truncated=True, looped=True)

    driver = Driver(decode, stream=NO_CONTEXT, partials=False)
    two_utterances(driver)
    driver.control(Control.END)
    assert len(finals) == 2
    assert [f.text for f in driver.of(Final)] == ["Thank you."]


def test_a_truncated_final_without_a_prefix_is_not_decoded_again() -> None:
    # The prompt does not count in the decode's budget (fit_prompt keeps it under 224 tokens):
    # alone, the final would have no more room.
    def decode(request: EngineRequest) -> EngineResult:
        if request.kind is DecodeKind.PARTIAL:
            return after_prefix(request, EngineResult(text="so we meet"))
        return EngineResult(text="so we meet", avg_logprob=-0.1, truncated=bool(request.prompt))

    driver = Driver(decode, stream=NO_CONTEXT)
    two_utterances(driver)
    driver.control(Control.END)
    assert len(finals_of_last_utterance(driver)) == 1
    assert finals_of_last_utterance(driver)[0].prompt


def test_a_loop_that_ran_out_of_tokens_is_not_decoded_again_when_nothing_was_shown() -> None:
    # The filters drop a repetition loop (compression ratio), and nothing was shown: noise,
    # which Whisper alone could caption too.
    def decode(request: EngineRequest) -> EngineResult:
        if request.prefix:
            loop = " ".join(["la"] * 40)
            return EngineResult(text=loop, compression_ratio=9.0, truncated=True)
        return EngineResult(text="Thank you.", avg_logprob=-0.2, no_speech_prob=0.05)

    driver = Driver(decode, partials=False)
    two_utterances(driver)
    driver.control(Control.END)
    assert len(finals_of_last_utterance(driver)) == 1
    assert [f.text for f in driver.of(Final)] == ["Thank you."]


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_no_final_contradicts_its_stable_words(data: st.DataObject) -> None:
    """Whatever an engine answers, every final starts with its segment's last stable words."""
    vocabulary = ["yes", "no", "the", "cat", "sat", "Thank", "you.", "okay"]

    def decode(request: EngineRequest) -> EngineResult:
        words = data.draw(st.lists(st.sampled_from(vocabulary), max_size=6))
        score = data.draw(st.sampled_from([-0.2, -2.0]))
        sure = st.floats(min_value=0.01, max_value=1.0)
        probs = data.draw(st.lists(sure, min_size=len(words), max_size=len(words)))
        return EngineResult(
            text=" ".join(words), avg_logprob=score, no_speech_prob=0.1, unit_probs=tuple(probs)
        )

    driver = Driver(decode)
    for seconds in data.draw(st.lists(st.sampled_from([0.8, 1.7, 3.1]), min_size=1, max_size=3)):
        driver.send(np.concatenate([tone(seconds), silence(1.0)]))
    driver.control(Control.END)
    finals = {f.segment: f.text.split() for f in driver.of(Final)}
    for partial in driver.of(Partial):
        stable = partial.stable.split()
        assert finals[partial.segment][: len(stable)] == stable


def test_context_audio_is_kept_and_then_released() -> None:
    driver = Driver()
    for _ in range(20):
        driver.send(np.concatenate([tone(1.5), silence(1.5)]))
    assert driver.session._buffer.end_sample - driver.session._buffer._offset <= 33 * RATE
    driver.control(Control.END)
    assert len(driver.of(Final)) == 20
    for r in driver.requests:
        assert len(r.engine_request.audio) <= 30 * RATE


def test_finals_keep_their_context_when_decodes_lag_behind_the_audio() -> None:
    # All the audio arrives before any decode runs (an engine far behind, or audio sent faster
    # than real time): each final still reaches back to the finals before it, as it does when
    # every decode runs at once, although the stream's end is more than a window past them.
    audio = np.concatenate([silence(0.5), *[np.concatenate([tone(8.0), silence(1.5)])] * 4])
    live = Driver(partials=False)
    live.send(audio)
    live.control(Control.END)
    lagging = Driver(partials=False)
    for i in range(0, len(audio), RATE * CHUNK_MS // 1000):
        lagging.session.receive_audio(s16(audio[i : i + RATE * CHUNK_MS // 1000]))
    lagging.control(Control.END)
    assert lagging.session._buffer.end_sample - 8 * RATE > 30 * RATE

    def contexts(driver: Driver) -> list[tuple[int, str]]:
        return [(len(r.engine_request.audio), r.engine_request.prefix) for r in driver.requests]

    assert len(lagging.of(Final)) == 4
    assert sum(1 for _, prefix in contexts(lagging) if prefix) >= 3
    assert contexts(lagging) == contexts(live)


def test_no_partial_reaches_into_where_a_capped_utterance_may_be_cut() -> None:
    stream = StreamConfig(max_utterance_s=4.0, cut_search_s=1.5)
    driver = Driver(stream=stream)
    driver.send(np.concatenate([silence(0.5), tone(12.0), silence(1.0)]))
    driver.control(Control.END)
    starts = {r.utterance: r.start_sample for r in driver.requests}
    partials = [r for r in driver.requests if r.kind is DecodeKind.PARTIAL]
    assert partials
    for r in partials:
        assert r.end_sample - starts[r.utterance] <= 2.5 * RATE
    finals = {f.segment: f.text.split() for f in driver.of(Final)}
    for p in driver.of(Partial):
        assert finals[p.segment][: len(p.stable.split())] == p.stable.split()
