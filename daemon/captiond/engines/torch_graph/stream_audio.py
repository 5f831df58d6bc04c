"""Each stream's newest audio on the device, kept between its decodes; windows gathered there.

Owns one tensor of rings (RING_SAMPLES each): a ring per stream the engine has decoded lately
(the least recently decoded stream gives its ring up first), and one scratch ring per batch row
for windows without a stream (warm-up, bench, offline decodes). Runs on the engine thread only.

A stream's decodes overlap: every partial reads the last 10-30 s again, half a second later.
Sent whole, a 107-row batch at 1,000 streams (an H200) copied about 100 MB of windows into the
pinned buffer on the engine thread and 200 MB of 30-s rows to the GPU. Now a window sends only
what the device lacks of its stream (`AudioSpan`, the rule worker processes follow towards the
engine process: normally the audio since the stream's previous decode), in one copy and one
scatter per batch, and `centred` gathers each window, tail-padded and reflect-padded for the
STFT as faster-whisper pads it, on the device.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch

from captiond.engines.base import EngineRequest
from captiond.engines.torch_graph.staging import Staged
from captiond.samples import AudioSpan
from captiond.whisper import WINDOW_SAMPLES

RING_SAMPLES = 1 << 19  # 32.8 s: more than a window, and a power of two (positions are masks)
_RING_MASK = RING_SAMPLES - 1
TAIL_PAD_SAMPLES = 160  # faster-whisper's `padding=160`
CENTRE_PAD_SAMPLES = 200  # n_fft // 2 on each side: STFT centring
# The longest centred signal: 30 s + tail pad + both centring pads (N_FRAMES + 2 STFT frames).
CENTRED_SAMPLES = WINDOW_SAMPLES + TAIL_PAD_SAMPLES + 2 * CENTRE_PAD_SAMPLES


@dataclass(frozen=True, slots=True)
class Clip:
    """`n_samples` of a ring's audio from stream sample `start_sample` on."""

    ring: int
    start_sample: int
    n_samples: int

    def after(self, offset: int) -> Clip:
        """The clip without its first `offset` samples."""
        return Clip(self.ring, self.start_sample + offset, self.n_samples - offset)


class StreamAudio:
    def __init__(self, n_streams: int, max_batch: int, device: torch.device) -> None:
        # A batch's streams are its most recently used: the one given up is never among them.
        if n_streams < 2 * max_batch:
            raise ValueError(f"{n_streams} stream rings for batches of {max_batch}")
        if (n_streams + max_batch) * RING_SAMPLES > torch.iinfo(torch.int32).max:
            raise ValueError(f"{n_streams} stream rings: past int32 sample indices")
        self.n_streams = n_streams
        self._rings = torch.zeros(
            (n_streams + max_batch) * RING_SAMPLES, dtype=torch.float32, device=device
        )
        self._streams: OrderedDict[str, tuple[int, AudioSpan]] = OrderedDict()
        self.samples_sent = 0  # to the device, since the start (tests, speed work)
        self._new = Staged(max_batch * WINDOW_SAMPLES, torch.float32, device)
        # Per piece sent: its ring's first element, its first stream sample, where it starts in
        # the batch's new audio, its length. Per clip gathered: ring's first element, position
        # of its first sample in the ring, its length.
        self._pieces = Staged(max_batch * 4, torch.int64, device)
        self._clips = Staged(max_batch * 3, torch.int64, device)
        self._centred_offsets = (
            torch.arange(CENTRED_SAMPLES, dtype=torch.int32, device=device) - CENTRE_PAD_SAMPLES
        )

    @property
    def n_bytes(self) -> int:
        return self._rings.numel() * self._rings.element_size()

    def put(self, requests: Sequence[EngineRequest]) -> list[Clip]:
        """Each request's window (its `audio`, ending at stream sample `end_sample`), sending
        the device only what it lacks of the request's stream. Windows are cut to 30 s."""
        return self._put([(r.stream, r.end_sample, r.audio) for r in requests])

    def put_audio(self, audios: Sequence[npt.NDArray[np.float32]]) -> list[Clip]:
        """Windows without a stream, each sent whole."""
        return self._put([(None, 0, audio) for audio in audios])

    def _put(
        self, windows: Sequence[tuple[str | None, int, npt.NDArray[np.float32]]]
    ) -> list[Clip]:
        clips: list[Clip] = []
        pieces: list[tuple[int, int, npt.NDArray[np.float32]]] = []  # ring, first sample, audio
        seen: set[str] = set()
        for row, (stream, end_sample, audio) in enumerate(windows):
            window = audio[:WINDOW_SAMPLES]
            start = end_sample - len(audio)
            if stream is None or stream in seen:
                ring, start = self.n_streams + row, 0
                pieces.append((ring, start, window))
            else:
                seen.add(stream)
                ring, span = self._ring_of(stream)
                end = start + len(window)
                send_from = span.send_from(start, end)
                if send_from < end:
                    span.advance(send_from, end)
                    pieces.append((ring, send_from, window[send_from - start :]))
            clips.append(Clip(ring, start, len(window)))
        self._send(pieces)
        return clips

    def _ring_of(self, stream: str) -> tuple[int, AudioSpan]:
        """The stream's ring and what it holds; a new stream takes a free ring, or the least
        recently decoded stream's."""
        found = self._streams.get(stream)
        if found is not None:
            self._streams.move_to_end(stream)
            return found
        if len(self._streams) < self.n_streams:
            ring = len(self._streams)
        else:
            _, (ring, _) = self._streams.popitem(last=False)
        self._streams[stream] = (ring, AudioSpan())
        return self._streams[stream]

    def _send(self, pieces: Sequence[tuple[int, int, npt.NDArray[np.float32]]]) -> None:
        """One copy of every piece to the device, then one scatter into the rings."""
        if not pieces:
            return
        total = sum(len(samples) for _, _, samples in pieces)
        self.samples_sent += total
        new = self._new.write((total,))
        table = self._pieces.write((len(pieces), 4))
        offset = 0
        for row, (ring, first_sample, samples) in enumerate(pieces):
            new[offset : offset + len(samples)] = samples
            table[row] = (ring * RING_SAMPLES, first_sample, offset, len(samples))
            offset += len(samples)
        ring_starts, first_samples, offsets, lengths = self._pieces.send(table.shape).unbind(1)
        # The piece of each new sample, without a sync: the total is known here.
        device = lengths.device
        piece = torch.repeat_interleave(
            torch.arange(len(pieces), device=device), lengths, output_size=total
        )
        index = torch.arange(total, device=device) - offsets[piece] + first_samples[piece]
        index.bitwise_and_(_RING_MASK).add_(ring_starts[piece])
        self._rings.index_copy_(0, index, self._new.send((total,)))

    def centred(self, clips: Sequence[Clip]) -> tuple[torch.Tensor, torch.Tensor]:
        """[n, CENTRED_SAMPLES] float32: each clip followed by TAIL_PAD_SAMPLES zeros, reflected
        by CENTRE_PAD_SAMPLES at both ends (np.pad's "reflect", again and again where the signal
        is shorter than the pad), then whatever (frames past the clip's own are masked); and
        [n] int64 each clip's length."""
        n = len(clips)
        table = self._clips.write((n, 3))
        for row, clip in enumerate(clips):
            table[row] = (clip.ring * RING_SAMPLES, clip.start_sample & _RING_MASK, clip.n_samples)
        on_device = self._clips.send((n, 3))
        # [n, CENTRED_SAMPLES] indices are the big temporary: int32, worked on in place.
        ring_start, first, n_samples = on_device.to(torch.int32)[:, :, None].unbind(dim=1)
        last = n_samples + TAIL_PAD_SAMPLES - 1  # the tail-padded signal's last index
        # Reflected at both ends, again and again: offset o reads last - |(o mod 2 last) - last|.
        index = torch.remainder(self._centred_offsets, 2 * last)
        index.sub_(last).abs_().neg_().add_(last)
        past_clip = index >= n_samples  # the tail pad's zeros
        index.add_(first).bitwise_and_(_RING_MASK).add_(ring_start)
        samples = self._rings.index_select(0, index.view(-1)).view(n, CENTRED_SAMPLES)
        return samples.masked_fill_(past_clip, 0.0), on_device[:, 2]
