"""Audio files for the client and for offline transcription: any container and codec FFmpeg
reads (WAV, FLAC, MP3, Ogg/Opus, M4A, a video's sound track), decoded with PyAV, channels
averaged and resampled with soxr to 16 kHz mono float32. Pure functions, any thread."""

from __future__ import annotations

from pathlib import Path

import av
import numpy as np
import numpy.typing as npt

TARGET_RATE_HZ = 16_000


class AudioFileError(ValueError):
    """The file holds no audio this reader can decode."""


def read_audio_16k_mono(path: Path) -> npt.NDArray[np.float32]:
    """Samples in [-1, 1] at 16 kHz, channels averaged (the first audio stream). A file that
    cannot be opened raises OSError (FileNotFoundError, PermissionError, …)."""
    try:
        with av.open(str(path)) as container:
            if not container.streams.audio:
                raise AudioFileError(f"{path}: no audio in it")
            stream = container.streams.audio[0]
            # Planar float at the file's own rate and channels: integer PCM scales exactly
            # (16-bit x / 32768), and the averaging and resampling stay ours.
            planar = av.AudioResampler(format="fltp")
            blocks = [
                out.to_ndarray()
                for frame in container.decode(stream)
                for out in planar.resample(frame)
            ]
            blocks += [out.to_ndarray() for out in planar.resample(None)]
            rate_hz = stream.rate
    except OSError:  # missing, a folder, no permission: PyAV's errors are OSError's too
        raise
    except av.error.FFmpegError as exc:
        raise AudioFileError(f"{path}: not an audio file FFmpeg can read ({exc})") from None
    if not blocks:
        raise AudioFileError(f"{path}: no audio in it")
    mono: npt.NDArray[np.float32] = np.concatenate(blocks, axis=1).mean(axis=0, dtype=np.float32)
    if rate_hz != TARGET_RATE_HZ:
        import soxr

        resampled: npt.NDArray[np.float32] = soxr.resample(mono, rate_hz, TARGET_RATE_HZ)
        mono = resampled.astype(np.float32, copy=False)
    return mono


def to_pcm_s16le(samples: npt.NDArray[np.float32]) -> bytes:
    """The inverse of the daemon's decoding (x / 32768), so 16-bit audio arrives bit-exact."""
    return np.clip(np.round(samples * 32768.0), -32768, 32767).astype("<i2").tobytes()
