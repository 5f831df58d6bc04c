"""Audio files encoded with PyAV, for the file-reading tests (sources/, cli/)."""

from __future__ import annotations

from pathlib import Path

import av
import numpy as np


def encode(path: Path, samples: np.ndarray, rate_hz: int, codec: str, channels: int) -> Path:
    """`samples` (float32, mono) written with `codec` at `rate_hz`, the same on every channel."""
    layout = "stereo" if channels == 2 else "mono"
    planar = np.repeat(samples[None, :], channels, axis=0)
    return encode_planar(path, planar, rate_hz, codec, layout)


def encode_planar(path: Path, planar: np.ndarray, rate_hz: int, codec: str, layout: str) -> Path:
    """`planar` (float32, one row per channel of `layout`) written with `codec` at `rate_hz`;
    the container follows the suffix (.aac: ADTS, which can be joined end to end)."""
    with av.open(str(path), "w") as container:
        stream = container.add_stream(codec, rate=rate_hz, layout=layout)
        frame = av.AudioFrame.from_ndarray(planar.astype(np.float32), format="fltp", layout=layout)
        frame.rate = rate_hz
        resampler = av.AudioResampler(format=stream.format.name, layout=layout, rate=rate_hz)
        for piece in resampler.resample(frame) + resampler.resample(None):
            for packet in stream.encode(piece):
                container.mux(packet)
        for packet in stream.encode(None):
            container.mux(packet)
    return path
