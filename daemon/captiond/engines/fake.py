"""A deterministic engine for tests: text is a function of the audio, no model at all.

Runs on the engine thread like any engine. Each 250 ms of audio louder than -50 dBFS becomes one
word `wN` (N counts from the start of the request's audio), so longer decodes of the same
utterance extend the previous text, as Whisper's would. As Whisper's prefix does, a request's
prefix stands for the first words of its audio: the result holds only the words after it. A
decode whose audio ends in 250 ms of quiet ends a sentence there, as Whisper's mostly do where a
speaker stopped: its last word gets a full stop (the session's endpoint reads it: streaming/vad.py).
A final's words carry their times, which are exact by construction, and confidence 1.0.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np

from captiond.engines.base import DecodeKind, EngineRequest, EngineResult, PhaseTimes, WordTiming
from captiond.whisper import SAMPLE_RATE_HZ, WHISPER_LANGUAGES

WORD_SAMPLES = 4_000
WORD_S = WORD_SAMPLES / SAMPLE_RATE_HZ
_LOUD_POWER = 10 ** (-50 / 10)  # mean square of -50 dBFS


class FakeEngine:
    def __init__(self, *, delay_s: float = 0.0) -> None:
        self._delay_s = delay_s
        self._phases = PhaseTimes()  # all of a fake's time is `decode`

    @property
    def phases(self) -> PhaseTimes:
        return self._phases

    @property
    def name(self) -> str:
        return "fake"

    @property
    def model_name(self) -> str:
        return "fake"

    @property
    def max_batch(self) -> int:
        return 8

    @property
    def multilingual(self) -> bool:
        return False

    @property
    def known_languages(self) -> frozenset[str]:
        return WHISPER_LANGUAGES if self.multilingual else frozenset({"en"})

    @property
    def tokenizer_path(self) -> str:
        return ""  # the bundled model's (`token_counter`): its text is words of English

    def warmup(self) -> None:
        """Nothing to warm."""

    def close(self) -> None:
        """Nothing to release."""

    def transcribe_batch(self, requests: Sequence[EngineRequest]) -> list[EngineResult]:
        with self._phases.phase("decode"):
            if self._delay_s:
                time.sleep(self._delay_s)
            return [self._one(r) for r in requests]

    @staticmethod
    def _one(request: EngineRequest) -> EngineResult:
        n_words = len(request.audio) // WORD_SAMPLES
        chunks = request.audio[: n_words * WORD_SAMPLES].reshape(n_words, WORD_SAMPLES)
        # One pass with no temporary array (einsum: half the time of mean(square)): capacity
        # benches measure the daemon, not this engine. Mean square against -50 dBFS squared.
        loud = np.einsum("ij,ij->i", chunks, chunks) / WORD_SAMPLES > _LOUD_POWER
        at = np.flatnonzero(loud)[len(request.prefix.split()) :]
        new = [f"w{i}" for i in at]
        tail = request.audio[-WORD_SAMPLES:]  # the last 250 ms: quiet where a speaker stopped
        quiet = float(np.dot(tail, tail)) / WORD_SAMPLES <= _LOUD_POWER
        stopped = len(tail) == WORD_SAMPLES and quiet
        text = " ".join(new) + ("." if new and stopped else "")
        # A final's words are where they are by construction: word N is the N-th 250 ms.
        timings = (
            tuple(
                WordTiming(
                    word=f" {word}",
                    start_s=i * WORD_S,
                    end_s=(i + 1) * WORD_S,
                    probability=1.0,
                )
                for word, i in zip(text.split(), at, strict=True)
            )
            if request.kind is DecodeKind.FINAL
            else ()
        )
        return EngineResult(
            text=text,
            avg_logprob=-0.1,
            no_speech_prob=0.01,
            language=request.language or "en",  # English-only, as tiny.en
            words=timings,
        )
