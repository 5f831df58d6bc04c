"""Audio plumbing: PCM decoding, 30 ms framing, the sample-indexed buffer, resampling."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from captiond import samples
from captiond.errors import BadAudioError
from captiond.samples import AudioBuffer, Pcm16, Samples, ms_to_samples, samples_to_ms
from captiond.streaming.audio import FRAME_SAMPLES, Framer, Resampler, decode_pcm, to_pcm16


def _ramp(n: int, start: int = 0) -> Samples:
    """Distinct, exactly representable sample values: identity is easy to check."""
    return np.arange(start, start + n, dtype=np.float32)


def _pcm_ramp(n: int, start: int = 0) -> Pcm16:
    """The same as 16-bit PCM, what the Framer cuts."""
    return np.arange(start, start + n, dtype=np.int16)


# -- decode_pcm -------------------------------------------------------------------------------


def test_frame_is_30_ms() -> None:
    assert FRAME_SAMPLES == 480
    assert samples_to_ms(FRAME_SAMPLES) == 30
    assert ms_to_samples(30) == FRAME_SAMPLES
    assert samples_to_ms(16_000) == 1000


def test_decode_s16le_values() -> None:
    data = np.array([0, 16384, -32768, 32767, -1], dtype="<i2").tobytes()
    out = decode_pcm(data, "pcm_s16le")
    assert out.dtype == np.float32
    np.testing.assert_allclose(out, [0.0, 0.5, -1.0, 32767 / 32768, -1 / 32768])


def test_decode_f32le_values_and_clipping() -> None:
    data = np.array([0.0, 0.25, -0.5, 1.0, 1.5, -3.0], dtype="<f4").tobytes()
    out = decode_pcm(data, "f32le")
    assert out.dtype == np.float32
    np.testing.assert_allclose(out, [0.0, 0.25, -0.5, 1.0, 1.0, -1.0])


@pytest.mark.parametrize("encoding", ["pcm_s16le", "f32le"])
def test_decode_empty(encoding: str) -> None:
    assert decode_pcm(b"", encoding).size == 0


@pytest.mark.parametrize(
    ("encoding", "size"),
    [("pcm_s16le", 1), ("pcm_s16le", 3), ("pcm_s16le", 961), ("f32le", 2), ("f32le", 7)],
)
def test_decode_partial_sample_is_bad_audio(encoding: str, size: int) -> None:
    with pytest.raises(BadAudioError) as info:
        decode_pcm(b"\x00" * size, encoding)
    assert str(size) in str(info.value)
    assert info.value.code == "bad_audio"


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_decode_f32le_non_finite_is_bad_audio(bad: float) -> None:
    data = np.array([0.1, bad, 0.2], dtype="<f4").tobytes()
    with pytest.raises(BadAudioError):
        decode_pcm(data, "f32le")


def test_int16_round_trip() -> None:
    samples = np.array([0.0, 0.5, -0.5, 0.999, -1.0], dtype=np.float32)
    back = decode_pcm(to_pcm16(samples).tobytes(), "pcm_s16le")
    np.testing.assert_allclose(back, samples, atol=1 / 16_000)


# -- Framer -----------------------------------------------------------------------------------


@settings(max_examples=150, deadline=None)
@given(
    total=st.integers(min_value=0, max_value=5_000),
    cuts=st.lists(st.integers(min_value=0, max_value=5_000), max_size=25),
)
def test_framer_any_split_gives_the_frames_of_the_concatenation(
    total: int, cuts: list[int]
) -> None:
    data = _pcm_ramp(total)
    bounds = [0, *sorted(c for c in cuts if c <= total), total]
    framer = Framer()
    frames: list[Pcm16] = []
    for lo, hi in itertools.pairwise(bounds):
        out = framer.push(data[lo:hi])
        assert len(out) % FRAME_SAMPLES == 0
        frames.extend(out.reshape(-1, FRAME_SAMPLES).copy())
    whole = total // FRAME_SAMPLES
    assert len(frames) == whole
    for i, frame in enumerate(frames):
        assert frame.shape == (FRAME_SAMPLES,)
        np.testing.assert_array_equal(frame, data[i * FRAME_SAMPLES : (i + 1) * FRAME_SAMPLES])
    assert framer.pending_samples == total % FRAME_SAMPLES
    # The remainder is kept: completing it yields exactly the next frame.
    rest = FRAME_SAMPLES - framer.pending_samples
    nxt = framer.push(_pcm_ramp(rest, start=total))
    np.testing.assert_array_equal(nxt, _pcm_ramp(FRAME_SAMPLES, start=whole * FRAME_SAMPLES))
    assert framer.pending_samples == 0


def test_framer_keeps_remainder_independent_of_caller_buffer() -> None:
    framer = Framer()
    chunk = _pcm_ramp(500)
    assert len(framer.push(chunk)) == FRAME_SAMPLES
    chunk[:] = -1  # the caller reuses its buffer
    frame = framer.push(_pcm_ramp(460, start=500))
    np.testing.assert_array_equal(frame, _pcm_ramp(FRAME_SAMPLES, start=480))


# -- AudioBuffer ------------------------------------------------------------------------------

_op = st.tuples(
    st.sampled_from(["append", "discard", "slice"]),
    st.integers(min_value=-100, max_value=4_000),
    st.integers(min_value=0, max_value=700),
)


@settings(max_examples=200, deadline=None)
@given(ops=st.lists(_op, max_size=40))
def test_audio_buffer_matches_a_model(ops: list[tuple[str, int, int]]) -> None:
    with pytest.MonkeyPatch.context() as patch:
        # A small first array: the run grows it and moves the kept audio to new ones.
        patch.setattr(samples, "_MIN_BUFFER_SAMPLES", 64)
        _check_audio_buffer(ops)


def _check_audio_buffer(ops: list[tuple[str, int, int]]) -> None:
    buffer = AudioBuffer()
    end = 0
    kept_start = 0
    for kind, a, b in ops:
        if kind == "append":
            buffer.append(_ramp(b, start=end))
            end += b
        elif kind == "discard":
            buffer.discard_before(a)
            kept_start = min(max(kept_start, a), end)
        elif a < kept_start or a + b > end:
            with pytest.raises(ValueError):
                buffer.view(a, a + b)
        else:
            np.testing.assert_array_equal(buffer.view(a, a + b), _ramp(b, a))
        assert buffer.end_sample == end
        assert buffer.start_sample == kept_start
    tail = buffer.view(kept_start, end)
    np.testing.assert_array_equal(tail, _ramp(end - kept_start, kept_start))


def test_audio_buffer_discard_keeps_later_views() -> None:
    buffer = AudioBuffer()
    for k in range(5):
        buffer.append(_ramp(1000, start=k * 1000))
    buffer.discard_before(2500)
    assert buffer.start_sample == 2500
    np.testing.assert_array_equal(buffer.view(2500, 4100), _ramp(1600, 2500))
    with pytest.raises(ValueError):
        buffer.view(2499, 3000)
    with pytest.raises(ValueError):
        buffer.view(4000, 5001)
    with pytest.raises(ValueError):
        buffer.view(3000, 2999)
    buffer.append(_ramp(10, start=5000))
    np.testing.assert_array_equal(buffer.view(4990, 5010), _ramp(20, 4990))
    # Discarding never moves backwards.
    buffer.discard_before(100)
    assert buffer.start_sample == 2500


def test_audio_buffer_memory_follows_what_is_kept() -> None:
    """A long stream that keeps its last 30 s holds an array of about twice that, however long
    it runs (appending never copies what is kept more than once per array)."""
    buffer = AudioBuffer()
    chunk, keep = 8_000, 30 * 16_000
    for k in range(2_000):  # 1,000 s of audio in 0.5-s chunks
        buffer.append(_ramp(chunk, start=k * chunk))
        buffer.discard_before(buffer.end_sample - keep)
    assert buffer.start_sample == buffer.end_sample - keep
    np.testing.assert_array_equal(
        buffer.view(buffer.start_sample, buffer.end_sample), _ramp(keep, buffer.start_sample)
    )
    assert buffer._data.size <= 2 * (keep + chunk)


def test_audio_buffer_takes_pcm16_as_decode_pcm_would() -> None:
    """The client's 16-bit PCM appended directly (scaled in place) is bit for bit what
    decoding it first gives, across the buffer's growth."""
    rng = np.random.default_rng(7)
    pcm = rng.integers(-32768, 32768, size=400_000).astype(np.int16)  # 25 s: it grows twice
    direct, decoded = AudioBuffer(), AudioBuffer()
    for start in range(0, len(pcm), 1_600):
        chunk = pcm[start : start + 1_600]
        direct.append_pcm16(chunk)
        decoded.append(decode_pcm(chunk.astype("<i2").tobytes(), "pcm_s16le"))
    assert direct.end_sample == decoded.end_sample == len(pcm)
    np.testing.assert_array_equal(direct.view(0, len(pcm)), decoded.view(0, len(pcm)))


def test_audio_buffer_view_is_read_only_and_outlives_appends_and_discards() -> None:
    """A decode window is a view that the engine thread reads while the event loop keeps
    appending and discarding: it must keep its samples, and nobody may write through it."""
    buffer = AudioBuffer()
    buffer.append(_ramp(1_000))
    window = buffer.view(200, 1_000)
    with pytest.raises(ValueError):
        window[0] = -1.0
    for k in range(1, 200):  # grows the array many times and moves the kept audio
        buffer.append(_ramp(1_000, start=k * 1_000))
        buffer.discard_before(k * 1_000 - 500)
    np.testing.assert_array_equal(window, _ramp(800, 200))


# -- Resampler --------------------------------------------------------------------------------


@pytest.mark.parametrize("chunk", [480, 1000, 4097])
def test_resampler_48k_sine_to_16k(chunk: int) -> None:
    rate_in = 48_000
    freq_hz = 1_000.0
    n_in = rate_in * 2
    t = np.arange(n_in) / rate_in
    signal = (0.5 * np.sin(2 * np.pi * freq_hz * t)).astype(np.float32)
    resampler = Resampler(rate_in)
    parts = [resampler.process(signal[i : i + chunk]) for i in range(0, n_in, chunk)]
    parts.append(resampler.process(np.zeros(0, dtype=np.float32), last=True))
    out = np.concatenate(parts)
    assert out.dtype == np.float32
    assert abs(len(out) - n_in // 3) <= 16
    # Frequency preserved: the spectrum peaks at 1 kHz (away from the start-up transient).
    steady = out[1600 : 1600 + 16_000]
    spectrum = np.abs(np.fft.rfft(steady * np.hanning(len(steady))))
    freqs = np.fft.rfftfreq(len(steady), d=1 / 16_000)
    assert abs(freqs[int(np.argmax(spectrum))] - freq_hz) <= 2.0
    # Amplitude kept too.
    assert np.max(np.abs(steady)) == pytest.approx(0.5, abs=0.02)
