"""Audio files through PyAV (captiond_client.audiofile): any container and codec FFmpeg reads,
to 16 kHz mono float32, exactly as the WAV reader before it for 16-bit PCM."""

from __future__ import annotations

import wave
from pathlib import Path

import av
import numpy as np
import pytest
from conftest import missing_tool

from captiond_client.audiofile import AudioFileError, read_audio_16k_mono


def encode(path: Path, samples: np.ndarray, rate_hz: int, codec: str, channels: int) -> Path:
    """`samples` (float32, mono) written with `codec` at `rate_hz`, the same on every channel."""
    layout = "stereo" if channels == 2 else "mono"
    with av.open(str(path), "w") as container:
        stream = container.add_stream(codec, rate=rate_hz, layout=layout)
        planar = np.repeat(samples[None, :], channels, axis=0).astype(np.float32)
        frame = av.AudioFrame.from_ndarray(planar, format="fltp", layout=layout)
        frame.rate = rate_hz
        resampler = av.AudioResampler(format=stream.format.name, layout=layout, rate=rate_hz)
        for piece in resampler.resample(frame) + resampler.resample(None):
            for packet in stream.encode(piece):
                container.mux(packet)
        for packet in stream.encode(None):
            container.mux(packet)
    return path


def tone(seconds: float, rate_hz: int) -> np.ndarray:
    t = np.arange(round(seconds * rate_hz)) / rate_hz
    return (0.3 * np.sin(2 * np.pi * 440.0 * t)).astype(np.float32)


def test_16_bit_wav_and_flac_read_exactly_as_their_pcm(tmp_path: Path) -> None:
    pcm = (tone(1.0, 16_000) * 32767).astype("<i2")
    wav = tmp_path / "a.wav"
    with wave.open(str(wav), "wb") as wf:
        wf.setnchannels(1)
        wf.setsampwidth(2)
        wf.setframerate(16_000)
        wf.writeframes(pcm.tobytes())
    flac = encode(tmp_path / "a.flac", pcm.astype(np.float32) / 32768, 16_000, "flac", 1)
    for path in (wav, flac):
        samples = read_audio_16k_mono(path)
        assert samples.dtype == np.float32
        np.testing.assert_array_equal(samples, pcm.astype(np.float32) / 32768)


@pytest.mark.parametrize(("suffix", "codec"), [(".mp3", "libmp3lame"), (".ogg", "libopus")])
def test_compressed_stereo_at_48k_becomes_16k_mono(tmp_path: Path, suffix: str, codec: str) -> None:
    if codec not in av.codecs_available:  # PyPI's PyAV wheels have both
        missing_tool(f"this PyAV's FFmpeg has no {codec} encoder")
    path = encode(tmp_path / f"a{suffix}", tone(2.0, 48_000), 48_000, codec, 2)
    samples = read_audio_16k_mono(path)
    assert abs(len(samples) - 32_000) < 2_000  # encoders pad a little
    window = samples[4_000:20_000]  # one second, away from the encoder's edges
    peak_hz = np.argmax(np.abs(np.fft.rfft(window))) * 16_000 / len(window)
    assert peak_hz == pytest.approx(440, abs=2)
    assert 0.25 < np.abs(window).max() < 0.35  # channels averaged, not summed


def test_not_audio_and_missing_files_are_explained(tmp_path: Path) -> None:
    text = tmp_path / "notes.wav"
    text.write_text("not audio")
    with pytest.raises(AudioFileError, match="not an audio file FFmpeg can read"):
        read_audio_16k_mono(text)
    with pytest.raises(FileNotFoundError):
        read_audio_16k_mono(tmp_path / "nope.wav")
