"""The speech gate: a neural second opinion before Whisper decodes audio webrtcvad called speech.

webrtcvad passes anything voiced-looking (whale song, music, barking), and Whisper, asked to
transcribe it, writes words ("Whoa! Whoa!"), which then become context for the next decode.
Silero VAD (v6, the ONNX model bundled with faster-whisper; ~3 ms per second of audio on one
core) tells these apart. `GatedEngine` wraps any engine: a request whose `speech_from_sample` is
set is decoded only if Silero finds enough speech in its audio from there on (`has_speech`);
otherwise it is answered as no speech without running the model. Called on the engine thread,
which spreads a batch's checks over a few threads of its own.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import numpy.typing as npt

from captiond.engines import Engine, EngineRequest, EngineResult, PhaseTimes

# Speech is enough 32-ms Silero frames at or above a probability, making up a share of the audio
# checked; either rule will do. Measured per webrtcvad utterance (tests/synth_sounds.py and the
# shared corpus): dialogue turns have 10+ frames at p >= 0.5 making up >= 23 %; a moan's onset
# fires up to 7, and a 20-s stretch of music with a vocal sample 15 at 2 %. A short, quiet
# phrase stays between 0.3 and 0.5 (JFK's "ask not": 6 frames at >= 0.5 but 20 of 61 at
# >= 0.3; a short dialogue turn: 13 of 37), where noise stays far below on both counts (whale
# song: at most 6 frames at >= 0.3; the music: 39 at 6 %).
SPEECH_RULES = (
    # (probability, frames, share of the audio)
    (0.5, 8, 0.05),
    (0.3, 12, 0.2),
)
FRAME_SAMPLES = 512
# ONNX Runtime lets go of the GIL while Silero runs (one thread per call, faster-whisper's
# session options), so a batch's checks run side by side on this many threads. One after
# another they were 10 % of the engine thread's time per batch at 1,000 streams on an H200
# (23 of 226 ms), ahead of the GPU work they hold up.
GATE_THREADS = min(4, os.cpu_count() or 1)
NO_SPEECH = EngineResult(text="", avg_logprob=0.0, no_speech_prob=1.0, compression_ratio=0.0)


def has_speech(audio: npt.NDArray[np.float32]) -> bool:
    """Silero VAD finds enough speech frames in 16 kHz audio (one of SPEECH_RULES holds)."""
    from faster_whisper.vad import get_vad_model

    padded = np.pad(audio, (0, -len(audio) % FRAME_SAMPLES))
    if not len(padded):
        return False
    probs = np.asarray(get_vad_model()(padded, num_samples=FRAME_SAMPLES)).ravel()
    for threshold, min_frames, min_share in SPEECH_RULES:
        frames = int((probs >= threshold).sum())
        if frames >= min_frames and frames >= min_share * len(probs):
            return True
    return False


class GatedEngine:
    """An engine whose unconfirmed requests pass the speech gate first."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self._pool = ThreadPoolExecutor(GATE_THREADS, thread_name_prefix="captiond-gate")
        self.gated = 0  # requests answered as no speech, for tests and stats

    @property
    def phases(self) -> PhaseTimes:
        """The inner engine's, with the gate's own time as `speech_gate`."""
        return self._engine.phases

    @property
    def name(self) -> str:
        return self._engine.name

    @property
    def model_name(self) -> str:
        return self._engine.model_name

    @property
    def multilingual(self) -> bool:
        return self._engine.multilingual

    @property
    def max_batch(self) -> int:
        return self._engine.max_batch

    def warmup(self) -> None:
        has_speech(np.zeros(16_000, dtype=np.float32))  # loads the ONNX session
        self._engine.warmup()

    def close(self) -> None:
        self._pool.shutdown()
        self._engine.close()

    def transcribe_batch(self, requests: Sequence[EngineRequest]) -> list[EngineResult]:
        with self.phases.phase("speech_gate"):
            asked = [i for i, r in enumerate(requests) if r.speech_from_sample is not None]
            heard = self._pool.map(
                lambda i: has_speech(requests[i].audio[requests[i].speech_from_sample :]), asked
            )
            silent = {i for i, speech in zip(asked, heard, strict=True) if not speech}
            passed = [i for i in range(len(requests)) if i not in silent]
        self.gated += len(requests) - len(passed)
        decoded = self._engine.transcribe_batch([requests[i] for i in passed]) if passed else []
        results = [NO_SPEECH] * len(requests)
        for i, result in zip(passed, decoded, strict=True):
            results[i] = result
        return results
