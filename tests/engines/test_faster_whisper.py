"""The faster-whisper engine's CPU layout: the encoder on every core, the decoder on one thread
(a second CTranslate2 copy of the model), or one model for both with `decoder_threads = 0`."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from captiond.config import Config
from captiond.engines import load_engine
from captiond.engines.base import DecodeKind, EngineInfo, EngineRequest
from captiond.engines.faster_whisper import FasterWhisperEngine
from captiond.engines.models import bundled_model_path

pytestmark = pytest.mark.model


def _engine(**engine: object) -> FasterWhisperEngine:
    config = Config()
    loaded = load_engine(
        dataclasses.replace(config.engine, name="faster-whisper", device="cpu", **engine)
    )
    assert isinstance(loaded, FasterWhisperEngine)
    return loaded


@pytest.mark.parametrize(
    ("engine", "separate"),
    [({}, True), ({"decoder_threads": 0}, False), ({"cpu_threads": 1}, False)],
)
def test_decoder_model(jfk: np.ndarray, engine: dict[str, int], separate: bool) -> None:
    """By default `generate` runs on a single-threaded copy; with one thread for both, or
    `decoder_threads = 0`, on the encoder's model. Either way it decodes."""
    loaded = _engine(**engine)
    assert loaded.separate_decoder is separate
    (result,) = loaded.transcribe_batch(
        [EngineRequest(audio=jfk, kind=DecodeKind.FINAL, beam_size=5)]
    )
    assert "ask not what your country can do for you" in result.text.lower().replace(",", "")


def test_the_engine_names_its_models_tokenizer() -> None:
    """Sessions measure their context with it (engines.rules.token_counter)."""
    info = EngineInfo.of(_engine())
    assert info.tokenizer_path == str(bundled_model_path() / "tokenizer.json")


def test_a_decode_says_whether_it_began_with_a_space(jfk: np.ndarray) -> None:
    """After a forced prefix Whisper writes a new word with a space before it, and the rest of
    a word without one: `spaced` keeps that (streaming/session.py glues such text to a prefix of
    Chinese or Japanese characters), though the text itself is stripped."""
    loaded = _engine()
    new_word, rest_of_word = loaded.transcribe_batch(
        [
            EngineRequest(audio=jfk, kind=DecodeKind.FINAL, prefix="And so"),
            EngineRequest(audio=jfk, kind=DecodeKind.FINAL, prefix="And so my fel"),
        ]
    )
    assert new_word.text.startswith("my fellow") and new_word.spaced
    assert rest_of_word.text == rest_of_word.text.strip() and not rest_of_word.spaced
