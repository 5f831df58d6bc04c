"""Non-speech sounds made here, beside the shared corpus's music and noise: whale-like song,
bird chirps, barking, synthetic music, pink noise. 16 kHz float32, seeded, about 20-60 s each.

Voiced-looking sounds (harmonic, pitched, modulated at syllable rate) are the ones webrtcvad
lets through and Whisper then "transcribes"; each sound here is built to be one of those.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

RATE = 16_000
Audio = npt.NDArray[np.float32]


def _norm(x: npt.NDArray[np.float64], peak: float = 0.5) -> Audio:
    return (peak * x / max(1e-9, float(np.abs(x).max()))).astype(np.float32)


def _envelope(n: int, attack: int, release: int) -> npt.NDArray[np.float64]:
    env = np.ones(n)
    env[:attack] = np.linspace(0, 1, attack)
    env[n - release :] = np.linspace(1, 0, release)
    return env


def whale_song(seconds: float = 60.0, seed: int = 1) -> Audio:
    """Slow moans: 1-4 s glides between 150 and 900 Hz with harmonics, gaps between them."""
    rng = np.random.default_rng(seed)
    out = np.zeros(int(seconds * RATE))
    at = 0
    while at < len(out) - RATE:
        dur = int(rng.uniform(1.0, 4.0) * RATE)
        dur = min(dur, len(out) - at)
        f0, f1 = rng.uniform(150, 900, size=2)
        vibrato = 1 + 0.03 * np.sin(2 * np.pi * 5 * np.arange(dur) / RATE)
        freq = np.geomspace(f0, f1, dur) * vibrato
        phase = 2 * np.pi * np.cumsum(freq) / RATE
        tone = sum(np.sin(k * phase) / k for k in range(1, 5))
        out[at : at + dur] += tone * _envelope(dur, RATE // 5, RATE // 3)
        at += dur + int(rng.uniform(0.3, 2.0) * RATE)
    return _norm(out + 0.01 * rng.standard_normal(len(out)))


def bird_chirps(seconds: float = 30.0, seed: int = 2) -> Audio:
    """Trills of fast 2-6 kHz sweeps, 40-120 ms each, in phrases."""
    rng = np.random.default_rng(seed)
    out = np.zeros(int(seconds * RATE))
    at = 0
    while at < len(out) - RATE:
        for _ in range(int(rng.integers(3, 10))):
            dur = int(rng.uniform(0.04, 0.12) * RATE)
            f = np.linspace(rng.uniform(2000, 6000), rng.uniform(2000, 6000), dur)
            chirp = np.sin(2 * np.pi * np.cumsum(f) / RATE) * np.hanning(dur)
            if at + dur >= len(out):
                break
            out[at : at + dur] += chirp
            at += dur + int(rng.uniform(0.02, 0.08) * RATE)
        at += int(rng.uniform(0.5, 2.0) * RATE)
    return _norm(out)


def barking(seconds: float = 30.0, seed: int = 3) -> Audio:
    """Barks: 150-300 ms harmonic bursts at 400-700 Hz with noise, in groups of 1-4."""
    rng = np.random.default_rng(seed)
    out = np.zeros(int(seconds * RATE))
    at = int(0.5 * RATE)
    while at < len(out) - RATE:
        for _ in range(int(rng.integers(1, 5))):
            dur = int(rng.uniform(0.15, 0.3) * RATE)
            t = np.arange(dur) / RATE
            f0 = rng.uniform(400, 700) * np.linspace(1.2, 0.8, dur)
            phase = 2 * np.pi * np.cumsum(f0) / RATE
            bark = sum(np.sin(k * phase) * 0.7**k for k in range(1, 8))
            bark = (bark + 0.5 * rng.standard_normal(dur)) * np.exp(-t * 12)
            if at + dur >= len(out):
                break
            out[at : at + dur] += bark
            at += dur + int(rng.uniform(0.1, 0.3) * RATE)
        at += int(rng.uniform(1.0, 3.0) * RATE)
    return _norm(out)


def synth_music(seconds: float = 40.0, seed: int = 4) -> Audio:
    """Chords of harmonic tones changing every half bar, a kick drum on the beat, a melody."""
    rng = np.random.default_rng(seed)
    n = int(seconds * RATE)
    t = np.arange(n) / RATE
    out = np.zeros(n)
    beat = RATE // 2
    roots = [220.0, 174.6, 196.0, 261.6]
    for i, start in enumerate(range(0, n, 4 * beat)):
        end = min(n, start + 4 * beat)
        seg = t[start:end]
        root = roots[i % len(roots)]
        for ratio in (1.0, 1.26, 1.5):
            out[start:end] += sum(np.sin(2 * np.pi * k * root * ratio * seg) / k for k in (1, 2, 3))
    for start in range(0, n - beat, beat):
        kt = np.arange(beat // 2) / RATE
        out[start : start + beat // 2] += 3 * np.sin(2 * np.pi * 60 * kt) * np.exp(-kt * 20)
        note = rng.choice([440.0, 494.0, 523.0, 587.0, 659.0])
        out[start : start + beat] += 1.5 * np.sin(2 * np.pi * note * t[:beat]) * np.hanning(beat)
    return _norm(out)


def pink_noise(seconds: float = 20.0, seed: int = 5) -> Audio:
    rng = np.random.default_rng(seed)
    n = int(seconds * RATE)
    spectrum = np.fft.rfft(rng.standard_normal(n))
    spectrum /= np.sqrt(np.maximum(1, np.arange(len(spectrum))))
    return _norm(np.fft.irfft(spectrum, n), peak=0.3)


SOUNDS = {
    "whale_song": whale_song,
    "bird_chirps": bird_chirps,
    "barking": barking,
    "synth_music": synth_music,
    "pink_noise": pink_noise,
}
