"""WAV reading for the client and for offline transcription: any rate, any channel count, to
16 kHz mono float32 (soxr). Pure functions, any thread."""

from __future__ import annotations

import wave
from pathlib import Path

import numpy as np
import numpy.typing as npt

TARGET_RATE_HZ = 16_000
_DTYPES = {1: "u1", 2: "<i2", 4: "<i4"}


class WavError(ValueError):
    """The file is not a PCM WAV file this reader understands."""


def read_wav_16k_mono(path: Path) -> npt.NDArray[np.float32]:
    """Samples in [-1, 1] at 16 kHz, channels averaged."""
    try:
        with wave.open(str(path), "rb") as wf:
            width, channels, rate_hz = wf.getsampwidth(), wf.getnchannels(), wf.getframerate()
            raw = wf.readframes(wf.getnframes())
    except (wave.Error, EOFError) as exc:
        raise WavError(f"{path}: not a PCM WAV file ({exc})") from exc
    if width == 3:  # 24-bit: widen to 32-bit by putting each sample in the high bytes
        bytes3 = np.frombuffer(raw, dtype="u1").reshape(-1, 3)
        raw = np.pad(bytes3, ((0, 0), (1, 0))).tobytes()
        width = 4
    if width not in _DTYPES:
        raise WavError(f"{path}: unsupported sample width of {width} bytes")
    ints = np.frombuffer(raw, dtype=_DTYPES[width]).astype(np.float64)
    if width == 1:
        ints -= 128.0
    scale = float(2 ** (8 * width - 1))
    mono: npt.NDArray[np.float32] = (ints.reshape(-1, channels).mean(axis=1) / scale).astype(
        np.float32
    )
    if rate_hz != TARGET_RATE_HZ:
        import soxr

        resampled: npt.NDArray[np.float32] = soxr.resample(mono, rate_hz, TARGET_RATE_HZ)
        mono = resampled.astype(np.float32, copy=False)
    return mono


def to_pcm_s16le(samples: npt.NDArray[np.float32]) -> bytes:
    """The inverse of the daemon's decoding (x / 32768), so 16-bit audio arrives bit-exact."""
    return np.clip(np.round(samples * 32768.0), -32768, 32767).astype("<i2").tobytes()
