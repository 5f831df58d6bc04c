"""Log-mel features on the device, bit-for-bit faster-whisper's recipe up to float rounding.

Owns the Slaney mel filterbank and the periodic Hann window; the audio comes from the device's
copy of each stream (stream_audio.py). Runs on the engine thread only.

Recipe (faster_whisper/feature_extractor.py): append 160 zero samples, reflect-pad 200 samples on
each side (STFT centring), frames of 400 every 160 samples, drop the last frame, power spectrum,
Slaney mel, log10 clamped at 1e-10, floor at max-8, (x+4)/4; then, as its `transcribe` does, the
last frame is dropped too and the *normalised* log-mel is zero-padded to 3000 frames (30 s).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt
import torch

from captiond.engines.torch_graph.stream_audio import (
    CENTRE_PAD_SAMPLES,
    TAIL_PAD_SAMPLES,
    Clip,
    StreamAudio,
)
from captiond.whisper import HOP_SAMPLES, N_FRAMES, SAMPLE_RATE_HZ

N_FFT = 2 * CENTRE_PAD_SAMPLES


def slaney_mel_filters(n_mels: int) -> npt.NDArray[np.float32]:
    """The [n_mels, 201] Slaney-scaled filterbank faster-whisper uses (no librosa)."""
    fft_freqs_hz = np.fft.rfftfreq(n=N_FFT, d=1.0 / SAMPLE_RATE_HZ)
    mels = np.linspace(0.0, 45.245640471924965, n_mels + 2)
    hz_per_mel = 200.0 / 3
    freqs_hz = hz_per_mel * mels
    # Above 1 kHz the Slaney scale is logarithmic.
    min_log_hz = 1000.0
    min_log_mel = min_log_hz / hz_per_mel
    log_step = np.log(6.4) / 27.0
    is_log = mels >= min_log_mel
    freqs_hz[is_log] = min_log_hz * np.exp(log_step * (mels[is_log] - min_log_mel))
    freq_diff_hz = np.diff(freqs_hz)
    ramps = freqs_hz.reshape(-1, 1) - fft_freqs_hz.reshape(1, -1)
    lower = -ramps[:-2] / freq_diff_hz[:-1, None]
    upper = ramps[2:] / freq_diff_hz[1:, None]
    weights = np.maximum(0.0, np.minimum(lower, upper))
    # Slaney normalisation: roughly constant energy per channel.
    weights *= (2.0 / (freqs_hz[2 : n_mels + 2] - freqs_hz[:n_mels]))[:, None]
    return weights.astype(np.float32)


class MelFrontend:
    """Turns clips of the device's audio into [B, n_mels, 3000] normalised log-mel."""

    def __init__(self, n_mels: int, audio: StreamAudio, device: torch.device) -> None:
        self.audio = audio
        self.filters = torch.from_numpy(slaney_mel_filters(n_mels)).to(device)
        self.window = torch.hann_window(N_FFT, periodic=True, dtype=torch.float32, device=device)
        self.frame_index = torch.arange(N_FRAMES + 2, device=device)

    def __call__(self, audios: Sequence[npt.NDArray[np.float32]]) -> torch.Tensor:
        """The log-mel of one-off clips (no stream); longer than 30 s, their first 30 s."""
        return self.log_mel(self.audio.put_audio(audios))

    def log_mel(self, clips: Sequence[Clip]) -> torch.Tensor:
        centred, n_samples = self.audio.centred(clips)
        spectrum = torch.stft(
            centred, N_FFT, HOP_SAMPLES, window=self.window, center=False, return_complex=True
        )
        power = spectrum.abs() ** 2  # [B, 201, N_FRAMES + 2]
        log_spec = torch.clamp(self.filters @ power, min=1e-10).log10()
        # The max-8 floor sees only the clip's own frames (faster-whisper never sees padding).
        n_valid = (n_samples + TAIL_PAD_SAMPLES) // HOP_SAMPLES
        valid = self.frame_index[None, :] < n_valid[:, None]  # [B, frames]
        masked = log_spec.masked_fill(~valid[:, None, :], float("-inf"))
        peak = masked.amax(dim=(1, 2), keepdim=True)
        log_spec = (torch.maximum(log_spec, peak - 8.0) + 4.0) / 4.0
        # faster-whisper's `transcribe` decodes one frame fewer than it computed (its
        # content_frames), as captiond's faster-whisper engine does; the floor saw that frame.
        content = self.frame_index[None, :] < (n_valid - 1)[:, None]
        log_spec = log_spec.masked_fill(~content[:, None, :], 0.0)
        return log_spec[:, :, :N_FRAMES].contiguous()
