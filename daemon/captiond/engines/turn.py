"""End of turn: Smart Turn v3.2 (Daily, BSD-2-Clause), an ONNX audio classifier, with onnxruntime.

The model is `smart-turn-v3.2-cpu.onnx`, which the `pipecat-ai` 1.14.0 wheel carries under
`pipecat/audio/turn/smart_turn/data/` (installed `--no-deps`; pipecat itself is never
imported). It reads the last 8 s of a turn's 16 kHz audio (shorter audio is zero-padded in
front, as pipecat does) as an 80-bin Whisper log-mel spectrogram of the waveform normalised to
zero mean and unit variance (faster-whisper's `FeatureExtractor`, which computes the same
features as transformers' `WhisperFeatureExtractor(chunk_length=8)` that the model was trained
on), and answers the probability that the speaker has finished their turn.

`SmartTurn` judges a batch of windows in one call. It runs on the engine thread, before the
batch's decodes (decoding/scheduler.py), on the CPU, the build the wheel ships: on the 2-core
VM about 55 ms a window for the model, 90 ms with its features. Nothing here downloads
anything.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt
import onnxruntime as ort
from faster_whisper.feature_extractor import FeatureExtractor

from captiond.engines.base import TURN_WINDOW_S, TURN_WINDOW_SAMPLES
from captiond.engines.models import TURN_MODEL_HINT, turn_model_path
from captiond.errors import ConfigError

# transformers' WhisperFeatureExtractor adds this to the variance before dividing by it.
_NORM_EPS = 1e-7


class SmartTurn:
    """Smart Turn v3.2 on onnxruntime's CPU provider, `threads` intra-op threads (0: one per
    core, onnxruntime's default)."""

    def __init__(self, threads: int = 0) -> None:
        path = turn_model_path()
        if path is None:
            raise ConfigError(TURN_MODEL_HINT)
        options = ort.SessionOptions()
        options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        options.inter_op_num_threads = 1
        options.intra_op_num_threads = threads
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        self._session = ort.InferenceSession(
            str(path), sess_options=options, providers=["CPUExecutionProvider"]
        )
        self._input = self._session.get_inputs()[0].name
        self._features = FeatureExtractor(feature_size=80, chunk_length=TURN_WINDOW_S)
        self._frames = TURN_WINDOW_SAMPLES // self._features.hop_length

    def features(self, audio: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
        """The model's input for one turn: its last 8 s, zero-padded in front, normalised,
        as (80, 800) log-mel frames."""
        window = np.asarray(audio[-TURN_WINDOW_SAMPLES:], dtype=np.float32)
        if len(window) < TURN_WINDOW_SAMPLES:
            window = np.pad(window, (TURN_WINDOW_SAMPLES - len(window), 0))
        window = (window - window.mean()) / np.sqrt(window.var() + _NORM_EPS)
        mel: npt.NDArray[np.float32] = self._features(window, padding=0)
        return mel[:, : self._frames].astype(np.float32)

    def complete(self, turns: Sequence[npt.NDArray[np.float32]]) -> list[float]:
        """For each turn's audio, the probability that its speaker is done."""
        if not turns:
            return []
        batch = np.stack([self.features(audio) for audio in turns])
        (probabilities,) = self._session.run(None, {self._input: batch})
        return [float(p) for p in np.asarray(probabilities).reshape(-1)]
