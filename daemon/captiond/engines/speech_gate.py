"""The speech gate: a neural second opinion before Whisper decodes audio webrtcvad called speech.

webrtcvad passes anything voiced-looking (whale song, music, barking), and Whisper, asked to
transcribe it, writes words ("Whoa! Whoa!"), which then become context for the next decode.
Silero VAD (v6, the ONNX model bundled with faster-whisper; ~3 ms per second of audio on one
core) tells these apart. A request whose `speech_from_sample` is set is decoded only if Silero
finds enough speech in its audio from there on (`gate`); otherwise it is answered as no speech
without reaching the engine. The daemon checks before it queues a decode (decoding/gate.py: on a
thread
pool of the process that serves the stream, never on the engine thread); offline decodes check
on their own thread. Any thread: ONNX Runtime's session runs calls side by side.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from captiond.engines.base import EngineRequest, EngineResult

if TYPE_CHECKING:
    from captiond.config import EngineConfig

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
# Checks run side by side on this many threads of a process (decoding/gate.py): ONNX Runtime lets
# go of the GIL while Silero runs (one thread per call, faster-whisper's session options). One after
# another on the engine thread they were 10 % of its time per batch at 1,000 streams on an
# H200 (23 of 226 ms), ahead of the GPU work they held up.
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


def applies(config: EngineConfig, engine_name: str) -> bool:
    """Whether decodes for this engine pass the gate: `[engine] speech_gate`, and a model to
    decode (the fake engine's test audio, tones, is no speech)."""
    return config.speech_gate and engine_name != "fake"


def gate(request: EngineRequest) -> EngineResult | None:
    """NO_SPEECH for a request the gate stops, None for one the engine should decode (not
    asked, or speech found)."""
    if request.speech_from_sample is None:
        return None
    return None if has_speech(request.audio[request.speech_from_sample :]) else NO_SPEECH
