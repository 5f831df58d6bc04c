"""Audio files through PyAV (captiond_client.audiofile): any container and codec FFmpeg reads,
to 16 kHz mono float32, exactly as the WAV reader before it for 16-bit PCM."""

from __future__ import annotations

import logging
import tracemalloc
import wave
from pathlib import Path

import av
import numpy as np
import pytest
from encoded_audio import encode, encode_planar
from testkit import missing_tool

from captiond.sources.audiofile import AudioFileError, read_audio_16k_mono


def tone(seconds: float, rate_hz: int) -> np.ndarray:
    t = np.arange(round(seconds * rate_hz)) / rate_hz
    return (0.3 * np.sin(2 * np.pi * 440.0 * t)).astype(np.float32)


def peak_hz(samples: np.ndarray) -> float:
    """The strongest frequency in 16 kHz `samples`."""
    return float(np.argmax(np.abs(np.fft.rfft(samples))) * 16_000 / len(samples))


def need_encoder(codec: str) -> None:
    if codec not in av.codecs_available:  # PyPI's PyAV wheels have them all
        missing_tool(f"this PyAV's FFmpeg has no {codec} encoder")


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
    need_encoder(codec)
    path = encode(tmp_path / f"a{suffix}", tone(2.0, 48_000), 48_000, codec, 2)
    samples = read_audio_16k_mono(path)
    assert abs(len(samples) - 32_000) < 2_000  # encoders pad a little
    window = samples[4_000:20_000]  # one second, away from the encoder's edges
    assert peak_hz(window) == pytest.approx(440, abs=2)
    assert 0.25 < np.abs(window).max() < 0.35  # channels averaged, not summed


def test_not_audio_and_missing_files_are_explained(tmp_path: Path) -> None:
    text = tmp_path / "notes.wav"
    text.write_text("not audio")
    with pytest.raises(AudioFileError, match="not an audio file FFmpeg can read"):
        read_audio_16k_mono(text)
    with pytest.raises(FileNotFoundError):
        read_audio_16k_mono(tmp_path / "nope.wav")


def test_a_second_header_mid_file_costs_one_packet_not_the_file(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """`cat a.mp3 b.mp3`: b's header frame, mid-stream, is a packet the decoder refuses."""
    need_encoder("libmp3lame")
    one = encode(tmp_path / "one.mp3", tone(3.0, 44_100), 44_100, "libmp3lame", 1)
    joined = tmp_path / "joined.mp3"
    joined.write_bytes(one.read_bytes() * 2)
    with caplog.at_level(logging.WARNING, logger="captiond_client.audiofile"):
        samples = read_audio_16k_mono(joined)
    assert len(samples) == pytest.approx(2 * 48_000, abs=1_600)  # each file's encoder padding
    assert f"{joined}: skipped 1 packet(s) the decoder could not read" in caplog.text


@pytest.mark.parametrize(("suffix", "codec"), [(".mp3", "libmp3lame"), (".m4a", "aac")])
def test_a_damaged_stretch_costs_its_own_audio(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, suffix: str, codec: str
) -> None:
    """20 kB of garbage in the middle of a 10 s file (about 2.5 s of it)."""
    need_encoder(codec)
    path = encode(tmp_path / f"a{suffix}", tone(10.0, 44_100), 44_100, codec, 1)
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 20_000] = np.random.default_rng(0).bytes(20_000)
    path.write_bytes(data)
    with caplog.at_level(logging.WARNING, logger="captiond_client.audiofile"):
        samples = read_audio_16k_mono(path)
    assert 6 * 16_000 < len(samples) < 10.5 * 16_000
    assert peak_hz(samples[-32_000:-16_000]) == pytest.approx(440, abs=2)  # after the damage
    assert "could not read (about" in caplog.text


def test_a_file_where_no_packet_decodes_is_not_audio(tmp_path: Path) -> None:
    need_encoder("aac")
    path = encode(tmp_path / "a.m4a", tone(3.0, 44_100), 44_100, "aac", 1)
    data = bytearray(path.read_bytes())
    at = data.index(b"mdat")  # the box of the coded audio: its size, then b"mdat", then it
    size = int.from_bytes(data[at - 4 : at], "big")
    data[at + 4 : at - 4 + size] = np.random.default_rng(0).bytes(size - 8)
    path.write_bytes(data)
    with pytest.raises(AudioFileError, match="not an audio file FFmpeg can read"):
        read_audio_16k_mono(path)


def test_a_rate_that_changes_mid_file_keeps_its_time_and_pitch(tmp_path: Path) -> None:
    """`cat a44.aac b22.aac` (ADTS): the second half at 22.05 kHz, read as 22.05 kHz."""
    need_encoder("aac")
    first = encode(tmp_path / "a.aac", tone(2.0, 44_100), 44_100, "aac", 1)
    second = encode(tmp_path / "b.aac", tone(2.0, 22_050), 22_050, "aac", 1)
    joined = tmp_path / "joined.aac"
    joined.write_bytes(first.read_bytes() + second.read_bytes())
    samples = read_audio_16k_mono(joined)
    assert len(samples) == pytest.approx(64_000, abs=4_000)  # each file's encoder padding
    assert peak_hz(samples[-24_000:-8_000]) == pytest.approx(440, abs=2)


def test_five_one_keeps_the_centre_channel_where_dialogue_is(tmp_path: Path) -> None:
    """FFmpeg's downmix (`ffmpeg -ac 1`) weighs the centre 0.29, the front pair 0.21 each, the
    surrounds 0.15 and the LFE 0; the mean of six channels gave the centre 1/6."""
    planar = np.zeros((6, 48_000), np.float32)
    planar[2] = tone(1.0, 48_000)  # FL FR FC LFE BL BR
    samples = read_audio_16k_mono(encode_planar(tmp_path / "a.flac", planar, 48_000, "flac", "5.1"))
    assert np.abs(samples[4_000:12_000]).max() / 0.3 == pytest.approx(0.29, abs=0.02)


def test_peak_memory_is_about_the_16k_result_not_the_decoded_source(tmp_path: Path) -> None:
    """A minute of 48 kHz stereo: decoded as it is, it would take six times the result."""
    path = tmp_path / "long.wav"
    pcm = np.tile((tone(1.0, 48_000) * 32767).astype("<i2"), 2 * 60)
    with wave.open(str(path), "wb") as wf:
        wf.setnchannels(2)
        wf.setsampwidth(2)
        wf.setframerate(48_000)
        wf.writeframes(pcm.tobytes())
    del pcm
    tracemalloc.start()  # numpy's arrays and Python's objects; FFmpeg's buffers are not seen
    try:
        samples = read_audio_16k_mono(path)
        peak_bytes = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert len(samples) == 60 * 16_000
    assert peak_bytes < 1.5 * samples.nbytes
