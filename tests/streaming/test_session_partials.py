"""The partials switch and the stream's prompt."""

from __future__ import annotations

import numpy as np
import pytest
from session_harness import NO_CONTEXT, Driver, silence, tone, two_utterances

from captiond.config import StreamConfig
from captiond.engines.base import DecodeKind, EngineRequest, EngineResult
from captiond.streaming.events import Control, Final, Partial
from captiond.streaming.utterance import DecodeRequest


def test_partials_false_never_asks_for_partials() -> None:
    driver = Driver(partials=False)
    two_utterances(driver)
    driver.send(tone(4.0))
    driver.control(Control.END)
    assert driver.requests
    assert {r.kind for r in driver.requests} == {DecodeKind.FINAL}
    assert not driver.of(Partial)
    assert [f.segment for f in driver.of(Final)] == [0, 1, 2]


@pytest.mark.parametrize("partial_beam", [1, 3])
def test_requests_use_the_configured_beams(partial_beam: int) -> None:
    """Finals alone get `final_beam_size`, finals with context `context_beam_size`."""
    driver = Driver(
        stream=StreamConfig(final_beam_size=5, context_beam_size=2, partial_beam_size=partial_beam)
    )
    two_utterances(driver)
    partials = {r.engine_request.beam_size for r in driver.requests if r.kind is DecodeKind.PARTIAL}
    finals = {
        (bool(r.engine_request.prefix), r.engine_request.beam_size)
        for r in driver.requests
        if r.kind is DecodeKind.FINAL
    }
    assert partials == {partial_beam}
    assert finals == {(False, 5), (True, 2)}


def test_prompt_carries_the_previous_finals() -> None:
    driver = Driver(stream=NO_CONTEXT)
    two_utterances(driver)
    driver.send(tone(1.5))
    driver.send(silence(1.0))
    driver.control(Control.END)
    finals = [f.text for f in driver.of(Final)]
    assert len(finals) == 3
    by_utterance: dict[int, list[DecodeRequest]] = {}
    for r in driver.requests:
        by_utterance.setdefault(r.utterance, []).append(r)
    first, second, third = (by_utterance[u] for u in sorted(by_utterance))
    assert {r.engine_request.prompt for r in first} == {""}
    assert {r.engine_request.prompt for r in second} == {finals[0]}
    assert {r.engine_request.prompt for r in third} == {f"{finals[0]} {finals[1]}"}


def test_prompt_is_the_tail_of_the_finals() -> None:
    words = [f"word{i:02d}" for i in range(40)]
    texts = iter([" ".join(words[:20]), " ".join(words[20:]), "last"])

    def decode(request: EngineRequest) -> EngineResult:
        return EngineResult(text=next(texts))

    driver = Driver(decode, partials=False, stream=StreamConfig(prompt_chars=50, context_s=0))
    for _ in range(3):
        driver.send(np.concatenate([silence(0.5), tone(1.0), silence(1.0)]))
    driver.control(Control.END)
    assert len(driver.requests) == 3
    history = " ".join(words)
    prompt = driver.requests[2].engine_request.prompt
    assert 0 < len(prompt) <= 50
    assert history.endswith(prompt)
    assert prompt.split()[-1] == "word39"
    assert all(w in words for w in prompt.split()), "the tail starts at a word boundary"


@pytest.mark.parametrize(
    ("history", "prompt_chars"),
    [
        (["the quick brown fox", "jumps over"], 12),
        (["hello", "wonderful"], 8),
    ],
)
def test_prompt_never_starts_with_a_cut_word(history: list[str], prompt_chars: int) -> None:
    texts = iter([*history, "last"])

    def decode(request: EngineRequest) -> EngineResult:
        return EngineResult(text=next(texts))

    stream = StreamConfig(prompt_chars=prompt_chars, context_s=0)
    driver = Driver(decode, partials=False, stream=stream)
    for _ in range(len(history) + 1):
        driver.send(np.concatenate([silence(0.5), tone(1.0), silence(1.0)]))
    driver.control(Control.END)
    prompt = driver.requests[-1].engine_request.prompt
    joined = " ".join(history)
    assert len(prompt) <= prompt_chars
    assert joined.endswith(prompt)
    # "A cut word would be a wrong word in the prompt" (streaming/session.py): only whole words.
    whole_words = joined.split()
    assert all(w in whole_words for w in prompt.split()), f"cut word in prompt {prompt!r}"


def test_no_prompt_when_disabled() -> None:
    driver = Driver(stream=StreamConfig(prompt_chars=0))
    two_utterances(driver)
    assert {r.engine_request.prompt for r in driver.requests} == {""}
