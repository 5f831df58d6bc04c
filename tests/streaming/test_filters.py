"""The hallucination rules (streaming/filters.py) as a session applies them."""

from __future__ import annotations

import numpy as np
import pytest
from session_harness import Decoder, Driver, after_prefix, silence, tone

from captiond.engines.base import DecodeKind, EngineRequest, EngineResult
from captiond.streaming.events import Control, Done, Final, Partial, SpeechStarted, SpeechStopped


def scripted(results: dict[DecodeKind, EngineResult]) -> Decoder:
    def decode(request: EngineRequest) -> EngineResult:
        return after_prefix(request, results[request.kind])

    return decode


GOOD = EngineResult(text="hello there", avg_logprob=-0.2, no_speech_prob=0.05)
HALLUCINATIONS = {
    "silent_and_unsure": EngineResult(text="Thank you.", avg_logprob=-1.5, no_speech_prob=0.9),
    "only_punctuation": EngineResult(text=" ... !? ", avg_logprob=-0.1, no_speech_prob=0.0),
    "empty": EngineResult(text="", avg_logprob=-0.1, no_speech_prob=0.0),
    "repetitive": EngineResult(
        text="the the the the the", avg_logprob=-0.1, no_speech_prob=0.0, compression_ratio=3.0
    ),
}


def one_short_utterance(driver: Driver) -> None:
    driver.send(np.concatenate([silence(0.5), tone(1.2), silence(1.0)]))
    driver.control(Control.END)


@pytest.mark.parametrize("name", sorted(HALLUCINATIONS))
def test_dropped_only_decode_leaves_no_trace(name: str) -> None:
    driver = Driver(scripted({DecodeKind.FINAL: HALLUCINATIONS[name]}), partials=False)
    one_short_utterance(driver)
    assert [r.kind for r in driver.requests] == [DecodeKind.FINAL]
    assert not driver.of(Partial)
    assert not driver.of(Final)
    assert len(driver.of(SpeechStarted)) == len(driver.of(SpeechStopped)) == 1
    assert driver.messages[-1] == Done(audio_ms=2700, segments=0)


@pytest.mark.parametrize("name", sorted(HALLUCINATIONS))
def test_dropped_final_after_a_partial_keeps_only_the_stable_words(name: str) -> None:
    # A final is still sent for a segment that showed partials; what was promised as stable
    # stays, the rest of the dropped decode goes (empty text when nothing was stable).
    driver = Driver(scripted({DecodeKind.PARTIAL: GOOD, DecodeKind.FINAL: HALLUCINATIONS[name]}))
    one_short_utterance(driver)
    partials = driver.of(Partial)
    assert partials and partials[0].segment == 0
    assert partials[-1].stable == "hello"
    assert driver.of(Final) == [
        Final(
            segment=0,
            start_ms=partials[0].start_ms,
            end_ms=driver.of(Final)[0].end_ms,
            text="hello",
            language="en",
        )
    ]
    assert driver.messages[-1] == Done(audio_ms=2700, segments=1)


@pytest.mark.parametrize("name", sorted(HALLUCINATIONS))
def test_dropped_final_without_stable_words_is_an_empty_final(name: str) -> None:
    one_word = EngineResult(text="hello", avg_logprob=-0.2, no_speech_prob=0.05)
    driver = Driver(
        scripted({DecodeKind.PARTIAL: one_word, DecodeKind.FINAL: HALLUCINATIONS[name]})
    )
    one_short_utterance(driver)
    assert driver.of(Partial)[-1].stable == ""
    assert [f.text for f in driver.of(Final)] == [""]


@pytest.mark.parametrize("name", sorted(HALLUCINATIONS))
def test_dropped_partial_is_not_shown(name: str) -> None:
    driver = Driver(scripted({DecodeKind.PARTIAL: HALLUCINATIONS[name], DecodeKind.FINAL: GOOD}))
    one_short_utterance(driver)
    assert any(r.kind is DecodeKind.PARTIAL for r in driver.requests)
    assert not driver.of(Partial)
    finals = driver.of(Final)
    assert [(f.segment, f.text) for f in finals] == [(0, "hello there")]


@pytest.mark.parametrize(
    "result",
    [
        # Whisper's rule needs both: a high no-speech probability alone is not enough ...
        EngineResult(text="hello", avg_logprob=-0.5, no_speech_prob=0.9),
        # ... nor a low log-prob alone.
        EngineResult(text="hello", avg_logprob=-1.5, no_speech_prob=0.1),
        EngineResult(text="hello", avg_logprob=-0.1, compression_ratio=2.3),
    ],
)
def test_plausible_finals_are_kept(result: EngineResult) -> None:
    driver = Driver(scripted({DecodeKind.FINAL: result}), partials=False)
    one_short_utterance(driver)
    assert [f.text for f in driver.of(Final)] == ["hello"]


@pytest.mark.parametrize(
    ("speech_s", "avg_logprob", "kept"),
    [
        # 2.4 s of speech and the 0.48-s endpoint silence: under sparse_min_s (3 s). The 0.3-s
        # pre-roll before the speech does not count, or two slow words would be "sparse".
        (2.4, -1.3, True),
        (4.0, -1.3, False),  # two unsure words over 4.5 s: music or clatter
        (4.0, -0.2, True),  # ... unless Whisper is sure of them
    ],
)
def test_few_unsure_words_over_long_audio_are_dropped(
    speech_s: float, avg_logprob: float, kept: bool
) -> None:
    two_words = EngineResult(text="ألديك قلم", avg_logprob=avg_logprob, no_speech_prob=0.1)
    driver = Driver(scripted({DecodeKind.FINAL: two_words}), partials=False)
    driver.send(np.concatenate([silence(1.0), tone(speech_s), silence(1.0)]))
    driver.control(Control.END)
    assert [f.text for f in driver.of(Final)] == (["ألديك قلم"] if kept else [])


def test_final_text_is_stripped() -> None:
    driver = Driver(
        scripted({DecodeKind.FINAL: EngineResult(text="  hi there \n")}), partials=False
    )
    one_short_utterance(driver)
    assert [f.text for f in driver.of(Final)] == ["hi there"]


def test_segments_skip_dropped_utterances() -> None:
    # The second utterance decodes to punctuation after its context, and again alone.
    texts = iter(["first words", "...", "...", "third words"])

    def decode(request: EngineRequest) -> EngineResult:
        assert request.kind is DecodeKind.FINAL
        return EngineResult(text=next(texts))

    driver = Driver(decode, partials=False)
    for _ in range(3):
        driver.send(np.concatenate([silence(0.5), tone(1.0), silence(1.0)]))
    driver.control(Control.END)
    assert [(f.segment, f.text) for f in driver.of(Final)] == [
        (0, "first words"),
        (1, "third words"),
    ]
    assert driver.messages[-1] == Done(audio_ms=7500, segments=2)
