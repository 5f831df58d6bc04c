"""Where the audio a benchmark streams has speech: a final's latency counts from where the
speaker stopped, a first text's from where they began (metrics). The bench's main thread, once
per clip, before streaming.

A 30-ms frame is speech when it is no quieter than -55 dBFS and webrtcvad (aggressiveness 3,
fed those frames only) calls it voiced: close to the daemon's rule for a voiced frame at its
defaults, without its hysteresis, applied to the audio alone, so one reference serves captiond
and the peer whatever either's settings. Measured from where the daemon ended an utterance
instead (a final's `end_ms`), a latency would leave out the silence its endpointing waits for
(500 ms by default).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from captiond.samples import samples_to_ms
from captiond.sources.audiofile import to_pcm_s16le
from captiond.streaming.audio import FRAME_SAMPLES
from captiond.streaming.vad import levels_dbfs, webrtc_vad
from captiond.whisper import SAMPLE_RATE_HZ

_AGGRESSIVENESS = 3
_FLOOR_DBFS = -55.0


@dataclass(frozen=True, slots=True)
class SpeechRuns:
    """Runs of speech frames, in stream ms: each starts at `starts_ms[i]`, ends at `ends_ms[i]`."""

    starts_ms: tuple[int, ...] = ()
    ends_ms: tuple[int, ...] = ()

    def stopped_by(self, ms: int) -> int:
        """Where speech last stopped at or before `ms`: the end of the last run that began
        before it (`ms` itself when that run goes on past it: a cut in speech), or `ms`."""
        i = bisect.bisect_left(self.starts_ms, ms)
        return ms if i == 0 else min(self.ends_ms[i - 1], ms)

    def started_from(self, ms: int) -> int:
        """Where speech next began at or after `ms`: the start of the first run that ends after
        it (`ms` itself inside a run), or `ms`."""
        i = bisect.bisect_right(self.ends_ms, ms)
        return ms if i == len(self.starts_ms) else max(self.starts_ms[i], ms)


def speech_runs(samples: npt.NDArray[np.float32]) -> SpeechRuns:
    """The runs of speech frames in 16 kHz mono `samples`, as the daemon receives them."""
    n_frames = len(samples) // FRAME_SAMPLES
    data = to_pcm_s16le(samples[: n_frames * FRAME_SAMPLES])
    vad = webrtc_vad(_AGGRESSIVENESS)
    frame_bytes = 2 * FRAME_SAMPLES
    starts: list[int] = []
    ends: list[int] = []
    was_voiced = False
    for i, level_dbfs in enumerate(levels_dbfs(np.frombuffer(data, "<i2"))):
        frame = data[i * frame_bytes : (i + 1) * frame_bytes]
        voiced = level_dbfs >= _FLOOR_DBFS and vad.is_speech(frame, SAMPLE_RATE_HZ)
        if voiced and not was_voiced:
            starts.append(samples_to_ms(i * FRAME_SAMPLES))
            ends.append(0)
        if voiced:
            ends[-1] = samples_to_ms((i + 1) * FRAME_SAMPLES)
        was_voiced = voiced
    return SpeechRuns(tuple(starts), tuple(ends))
