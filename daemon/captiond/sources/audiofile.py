"""Audio files for the client and for offline transcription: any container and codec FFmpeg
reads (WAV, FLAC, MP3, Ogg/Opus, M4A, a video's sound track), decoded with PyAV packet by
packet and converted frame by frame to 16 kHz mono float32: FFmpeg's downmix (5.1 keeps the
centre's dialogue), then soxr. Pure functions, any thread."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import av
import numpy as np
import numpy.typing as npt
import soxr
from av.audio.frame import AudioFrame
from av.audio.stream import AudioStream
from av.container import InputContainer

from captiond.whisper import SAMPLE_RATE_HZ

log = logging.getLogger(__name__)

# Without it FFmpeg's float downmix is not normalised: stereo would be (L + R) / sqrt(2), over
# full scale for loud material. With it stereo is the mean of its two channels (as before), and
# 5.1 is FFmpeg's standard downmix (`ffmpeg -ac 1`), in which the centre weighs most.
_DOWNMIX_OPTIONS = {"rematrix_maxval": "1.0"}


class AudioFileError(ValueError):
    """The file holds no audio this reader can decode."""


@dataclass
class _Skipped:
    """Packets the decoder refused: a second MP3 header mid-file, a damaged stretch."""

    packets: int = 0
    seconds: float = 0.0
    first_error: av.error.FFmpegError | None = None


class _To16kMono:
    """Decoded frames of any format, layout and rate in; 16 kHz mono float32 out, kept in a
    bytearray: it grows in place (realloc), so the peak memory is about the result's size, not
    the source's decoded size nor twice the result. A new downmix and resampler start
    whenever the frames' format changes (a rate that changes mid-file: ADTS or MP3 files
    joined end to end); soxr, as the reader always used, keeps the samples of every file
    whose format does not change as they were."""

    def __init__(self) -> None:
        self.pcm = bytearray()
        self._source: tuple[str, str, int] | None = None
        self._downmix: av.AudioResampler | None = None
        self._resample: soxr.ResampleStream | None = None  # None: already 16 kHz

    def push(self, frame: AudioFrame) -> None:
        source = (frame.format.name, frame.layout.name, frame.sample_rate)
        if source != self._source:
            self.finish()
            self._start(frame.sample_rate)
            self._source = source
        assert self._downmix is not None
        for mono in self._downmix.resample(frame):
            self._append(mono.to_ndarray()[0])  # packed float32, mono: shape (1, samples)

    def finish(self) -> None:
        """The samples still inside the downmix and the resampler's filter."""
        if self._downmix is not None:
            for mono in self._downmix.resample(None):
                self._append(mono.to_ndarray()[0])
        if self._resample is not None:
            self.pcm += self._resample.resample_chunk(np.zeros(0, np.float32), last=True).data
        self._downmix = self._resample = None

    def _start(self, rate_hz: int) -> None:
        self._downmix = av.AudioResampler(format="flt", layout="mono", options=_DOWNMIX_OPTIONS)
        if rate_hz != SAMPLE_RATE_HZ:
            self._resample = soxr.ResampleStream(rate_hz, SAMPLE_RATE_HZ, 1, dtype="float32")

    def _append(self, mono: npt.NDArray[np.float32]) -> None:
        if self._resample is not None:
            mono = self._resample.resample_chunk(mono)
        self.pcm += mono.data


def read_audio_16k_mono(path: Path) -> npt.NDArray[np.float32]:
    """Samples in [-1, 1] at 16 kHz, downmixed to mono (the first audio stream). Packets the
    decoder refuses are skipped with a warning. A file that cannot be opened raises OSError
    (FileNotFoundError, …); one where nothing decodes raises AudioFileError."""
    try:
        with av.open(str(path)) as container:
            if not container.streams.audio:
                raise AudioFileError(f"{path}: no audio in it")
            pcm, skipped = _decode(container, container.streams.audio[0])
    except OSError:  # missing, a folder, no permission: PyAV's errors are OSError's too
        raise
    except av.error.FFmpegError as exc:
        raise AudioFileError(f"{path}: not an audio file FFmpeg can read ({exc})") from None
    if not pcm:
        if skipped.first_error is not None:
            reason = skipped.first_error
            raise AudioFileError(f"{path}: not an audio file FFmpeg can read ({reason})")
        raise AudioFileError(f"{path}: no audio in it")
    if skipped.packets:
        log.warning(
            "%s: skipped %d packet(s) the decoder could not read (about %.1f s of audio)",
            path,
            skipped.packets,
            skipped.seconds,
        )
    return np.frombuffer(pcm, dtype=np.float32)


def _decode(container: InputContainer, stream: AudioStream) -> tuple[bytearray, _Skipped]:
    """Packet by packet, so that a bad packet costs its own audio, not the file's."""
    converter = _To16kMono()
    skipped = _Skipped()
    for packet in container.demux(stream):
        try:
            frames = packet.decode()
        except av.error.FFmpegError as exc:
            skipped.packets += 1
            if packet.duration and packet.time_base:
                skipped.seconds += float(packet.duration * packet.time_base)
            skipped.first_error = skipped.first_error or exc
            continue
        for frame in frames:
            converter.push(frame)
    converter.finish()
    return converter.pcm, skipped


def to_pcm_s16le(samples: npt.NDArray[np.floating[Any]]) -> bytes:
    """The inverse of the daemon's decoding (x / 32768), so 16-bit audio arrives bit-exact."""
    return np.clip(np.round(samples * 32768.0), -32768, 32767).astype("<i2").tobytes()
