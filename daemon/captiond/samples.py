"""The stream sample clock: sample/ms conversions, the stream buffer (`AudioBuffer`) and the rule
by which a copy of a stream's audio elsewhere is kept up to date (`AudioSpan`).

Sans-I/O values, each owned by one thread: a StreamSession's buffer on the event-loop thread, an
`AudioSpan` on whichever thread sends or holds the copy. Time is an integer sample clock at
16 kHz from the first sample of the stream. Every layer that handles stream audio (the core,
the worker link, torch_graph's device rings) shares these, so they sit below all of them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from captiond.whisper import SAMPLE_RATE_HZ

Samples = npt.NDArray[np.float32]
Pcm16 = npt.NDArray[np.int16]  # 16-bit PCM, what webrtcvad reads


_MIN_BUFFER_SAMPLES = 10 * SAMPLE_RATE_HZ  # an AudioBuffer's smallest array


# What a copy of a stream's audio elsewhere (the engine process, the GPU) keeps of its newest
# samples: no decode window reaches further back.
KEEP_SAMPLES = 30 * SAMPLE_RATE_HZ


def samples_to_ms(samples: int) -> int:
    return samples * 1000 // SAMPLE_RATE_HZ


def ms_to_samples(ms: float) -> int:
    return round(ms * SAMPLE_RATE_HZ / 1000)


class AudioBuffer:
    """The stream's 16 kHz audio, addressed by absolute sample index; old audio can be dropped.

    One array, appended in place and read from `_head`: dropping old audio moves `_head`, and
    the kept audio moves to the front of a new array only when the array is full (amortised
    O(1) per sample). Concatenating the buffer on every push, as it once did, was 45 % of a
    worker's CPU at 150 streams. An array is only ever written past its fill, never
    overwritten, so a `view` stays valid while the buffer keeps taking audio.
    """

    def __init__(self, start_sample: int = 0) -> None:
        self._data: Samples = np.zeros(0, dtype=np.float32)
        self._head = 0  # self._data index of the first kept sample
        self._fill = 0  # self._data index one past the last sample
        self._offset = start_sample  # absolute index of self._data[self._head]

    @property
    def end_sample(self) -> int:
        """Absolute index one past the last sample received."""
        return self._offset + self._fill - self._head

    @property
    def start_sample(self) -> int:
        return self._offset

    def append(self, samples: Samples) -> None:
        self._next(len(samples))[:] = samples

    def append_pcm16(self, pcm: Pcm16) -> None:
        """Append 16-bit PCM as float32 (x / 32768, as `decode_pcm`), scaled in one pass."""
        np.multiply(pcm, np.float32(1 / 32768), out=self._next(len(pcm)))

    def _next(self, n: int) -> Samples:
        """The next `n` samples of the array, counted as filled (the caller writes them)."""
        if self._fill + n > len(self._data):
            kept = self._fill - self._head
            grown = np.empty(max(2 * (kept + n), _MIN_BUFFER_SAMPLES), dtype=np.float32)
            grown[:kept] = self._data[self._head : self._fill]
            self._data, self._head, self._fill = grown, 0, kept
        self._fill += n
        return self._data[self._fill - n : self._fill]

    def view(self, start: int, end: int) -> Samples:
        """Samples [start, end) in absolute indices, both inside the kept audio, as a read-only
        view (see the class docstring). Decode windows are views: copying 10-30 s of audio per
        partial was 7 % of a worker's CPU at 600 streams."""
        if start < self._offset or end > self.end_sample or start > end:
            raise ValueError(f"slice [{start}, {end}) outside [{self._offset}, {self.end_sample})")
        first = self._head + start - self._offset
        view = self._data[first : first + end - start]
        view.flags.writeable = False
        return view

    def discard_before(self, sample: int) -> None:
        """Forget audio before `sample` (no decode will need it again)."""
        drop = min(max(0, sample - self._offset), self._fill - self._head)
        self._head += drop
        self._offset += drop


@dataclass(slots=True)
class AudioSpan:
    """The stream samples [start, end) a copy of a stream's audio holds (the engine process's,
    or the GPU's). Whoever sends the audio keeps one per stream to know what to send, and the
    holder applies the same `advance` to its copy, so both agree without a reply."""

    start: int = 0
    end: int = 0

    def send_from(self, window_start: int, window_end: int) -> int:
        """The first sample of the window the copy lacks (`window_end`: none).
        A window that starts before what is held, or after a gap, is sent whole."""
        if self.start <= window_start and window_end <= self.end:
            return window_end
        if self.start <= window_start <= self.end < window_end:
            return self.end
        return window_start

    def advance(self, from_sample: int, end_sample: int) -> None:
        """Samples [from_sample, end_sample) were sent: appended when they continue what is
        held, else they replace it; only the newest KEEP_SAMPLES stay."""
        if from_sample != self.end:
            self.start = from_sample
        self.end = end_sample
        self.start = max(self.start, self.end - KEEP_SAMPLES)
