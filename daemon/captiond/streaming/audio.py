"""Audio intake: PCM decoding, resampling to 16 kHz, 30 ms framing, and the client's chunk size.

Sans-I/O values, each owned by one thread: a StreamSession's on the event-loop thread. Time is
the integer sample clock of `captiond.samples`; nothing here reads the wall clock.
"""

from __future__ import annotations

import numpy as np

from captiond.errors import BadAudioError
from captiond.samples import Pcm16, Samples
from captiond.whisper import SAMPLE_RATE_HZ

FRAME_SAMPLES = 480  # 30 ms at 16 kHz: a frame length webrtcvad accepts


def _check_whole_samples(data: bytes, encoding: str, width: int) -> None:
    if len(data) % width:
        raise BadAudioError(
            f"{encoding} frames must hold whole samples: got {len(data)} bytes, "
            f"not a multiple of {width}"
        )


def read_pcm16(data: bytes) -> Pcm16:
    """pcm_s16le bytes as 16-bit samples (a view of `data`); a partial sample is an error."""
    _check_whole_samples(data, "pcm_s16le", 2)
    return np.frombuffer(data, dtype="<i2")


def decode_pcm(data: bytes, encoding: str) -> Samples:
    """Little-endian PCM bytes to float32 in [-1, 1]; a partial sample is an error."""
    if encoding == "pcm_s16le":
        return read_pcm16(data).astype(np.float32) / 32768.0
    _check_whole_samples(data, encoding, 4)
    samples = np.frombuffer(data, dtype="<f4").astype(np.float32)
    if not np.all(np.isfinite(samples)):
        raise BadAudioError("f32le audio contains NaN or infinite samples")
    return np.clip(samples, -1.0, 1.0)


def to_pcm16(samples: Samples) -> Pcm16:
    """The inverse of `decode_pcm` for pcm_s16le (x / 32768): int16 input comes back exact."""
    scaled = samples * np.float32(32768.0)
    np.rint(scaled, out=scaled)
    np.clip(scaled, -32768, 32767, out=scaled)
    return scaled.astype(np.int16)


class Resampler:
    """Streaming conversion of one mono stream to 16 kHz (soxr, high quality)."""

    def __init__(self, rate_in_hz: int) -> None:
        import soxr

        self._stream = soxr.ResampleStream(rate_in_hz, SAMPLE_RATE_HZ, 1, dtype="float32")

    def process(self, samples: Samples, *, last: bool = False) -> Samples:
        out: Samples = self._stream.resample_chunk(samples, last=last)
        return out.astype(np.float32, copy=False)


class Framer:
    """Cuts a PCM stream into 30 ms frames, keeping the remainder for the next chunk."""

    def __init__(self) -> None:
        self._pending: Pcm16 = np.zeros(0, dtype=np.int16)

    def push(self, samples: Pcm16) -> Pcm16:
        """The whole frames this chunk completes, as one array (possibly empty)."""
        data = np.concatenate([self._pending, samples]) if self._pending.size else samples
        whole = len(data) - len(data) % FRAME_SAMPLES
        self._pending = data[whole:].copy()
        return data[:whole]

    @property
    def pending_samples(self) -> int:
        return len(self._pending)


CHUNK_MS = 100
