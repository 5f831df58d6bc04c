"""Utterance segmentation: webrtcvad per 30 ms frame, with hysteresis, an RMS floor and a cap.

Sans-I/O, owned by one StreamSession on the event-loop thread. Input: consecutive 30 ms frames
of 16-bit PCM, one or a chunk's worth at a time.
Output: `UtteranceStart` / `UtteranceEnd` events in absolute 16 kHz samples.
"""

from __future__ import annotations

import dataclasses
import math
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from captiond.config import StreamConfig, VadConfig
from captiond.samples import Pcm16, Samples, ms_to_samples
from captiond.streaming.audio import FRAME_SAMPLES, Framer, to_pcm16
from captiond.whisper import SAMPLE_RATE_HZ

FRAME_MS = FRAME_SAMPLES * 1000 // SAMPLE_RATE_HZ
# How far before the start window an onset is looked for (see VadSegmenter).
_ONSET_LOOKBACK_MS = 1_000
# Voiced stretches a diarized session keeps (`VadSegmenter.voiced`): pauses shorter than this
# are inside a stretch (as in the speech references' RTTM), and the newest _VOICED_KEPT are
# kept, more than any utterance (at most `max_utterance_s`) holds.
VOICED_GAP_MS = 300
_VOICED_KEPT = 256


class Vad(Protocol):
    """The part of `webrtcvad.Vad` the segmenter uses (tests script it)."""

    def is_speech(self, buf: bytes, sample_rate: int) -> bool: ...


def webrtc_vad(aggressiveness: int) -> Vad:
    import webrtcvad

    vad: Vad = webrtcvad.Vad(aggressiveness)
    return vad


@dataclass(frozen=True, slots=True, kw_only=True)
class UtteranceStart:
    start_sample: int  # with the pre-roll
    speech_start_sample: int  # the first voiced frame (at or after start_sample)
    # Where the quiet before it began: the previous utterance's end, or the stream's start.
    lead_sample: int
    continues: bool = False  # the speech goes on from an utterance cut at the cap: no onset


@dataclass(frozen=True, slots=True, kw_only=True)
class UtteranceEnd:
    end_sample: int  # with the trailing silence that ended it
    decode_end_sample: int  # where its final's decode ends (see VadSegmenter)
    # Cut where the speaker did not stop: at `max_utterance_s`, or at a speaker change (`cut`).
    cut: bool = False


VadEvent = UtteranceStart | UtteranceEnd


def levels_dbfs(frames: Pcm16) -> list[float]:
    """The RMS level of each 30 ms frame of `frames` (whole frames); -200 for digital silence.
    A chunk holds a few frames, for which Python's log10 beats numpy's per-call overhead."""
    wide = frames.reshape(-1, FRAME_SAMPLES).astype(np.float64)
    powers = (np.einsum("ij,ij->i", wide, wide) / (FRAME_SAMPLES * 32768.0**2)).tolist()
    return [10.0 * math.log10(p) if p > 0.0 else -200.0 for p in powers]


class VadSegmenter:
    """Turns frames into utterances.

    Start: at least `start_voiced_ratio` of the last `start_window_ms` voiced. The speech began
    at the first voiced frame since the window last held none (at most 1 s earlier): a quiet
    speaker's first word has frames under the RMS floor and fills the window late ("Türkiye"
    was lost). The utterance begins `preroll_ms` before that frame or the window's start,
    whichever is earlier (never before the previous utterance's end).
    End: `endpoint_silence_ms` of unvoiced frames, or `long_endpoint_silence_ms` once the
    utterance is `long_utterance_s` long (continuous speech is better ended at a short pause
    than cut at the cap). With `waits_for_verdicts` (its session asks for early finals), a
    pause that has not ended the turn ends the utterance only at
    `unfinished_endpoint_silence_ms`: the session says with `turn_ended` when the early final
    decoded up to the pause ends it (its words end a sentence), and until then the pause has
    not. Its final decodes `final_tail_ms` of that silence at most, which Whisper decodes better
    than a hard cut; `pause_sample` tells when that much has come, so the final's decode can
    start before the endpoint. With `end_of_turn = "model"` (`set_endpoints`), the pause is
    judged at `end_of_turn_pause_ms`, by the end-of-turn model before the early final (the
    session's answer), and a pause it does not end lasts up to `max_turn_silence_ms`. Cap: at
    `max_utterance_s` the utterance is cut at the quietest frame of the last `cut_search_s`,
    so no word is split and every decode fits one 30 s Whisper window.
    Push to talk: while `ends_at_pauses` is False, no pause ends an utterance (and no early
    final is due); the client's finalize does (`flush`), or the cap. A finalize also ends
    speech the start window has not confirmed: a "yes" shorter than the window, said before
    the key is let go.
    """

    def __init__(
        self,
        vad: Vad,
        vad_config: VadConfig,
        stream_config: StreamConfig,
        start_sample: int = 0,
    ) -> None:
        self._vad = vad
        self._floor_dbfs = vad_config.rms_floor_dbfs
        self._window_frames = max(1, vad_config.start_window_ms // FRAME_MS)
        self._start_voiced = int(np.ceil(vad_config.start_voiced_ratio * self._window_frames))
        self._preroll_samples = ms_to_samples(vad_config.preroll_ms)
        self.set_endpoints(vad_config)
        self._max_samples = ms_to_samples(stream_config.max_utterance_s * 1000)
        self._cut_search_frames = max(1, int(stream_config.cut_search_s * 1000) // FRAME_MS)
        self._window: deque[bool] = deque(maxlen=self._window_frames)
        self._next_frame_sample = start_sample
        self._last_end_sample = start_sample
        self._start_sample: int | None = None
        # The first voiced frame since the start window last held none (no utterance open).
        self._onset_sample: int | None = None
        # The first voiced frame since the last utterance ended (none open), for a finalize.
        self._first_voiced_sample: int | None = None
        self._lookback_samples = ms_to_samples(_ONSET_LOOKBACK_MS)
        self._voiced_gap_samples = ms_to_samples(VOICED_GAP_MS)
        self._silent_frames = 0
        # The end of the open utterance's last voiced frame (where it opened, before any).
        self._voiced_end_sample = start_sample
        # (frame start sample, dBFS) of the open utterance's recent frames, for the cap's cut.
        self._recent: deque[tuple[int, float]] = deque(maxlen=self._cut_search_frames)
        # ... and of all its frames when `keeps_levels`, for a speaker change's cut (`cut`).
        self.keeps_levels = False
        self._levels: list[tuple[int, float]] = []
        # Voiced stretches (start, end samples), gaps under VOICED_GAP_MS bridged, when
        # `keeps_voiced`: where a diarized final's speaker windows go (streaming/speakers.py).
        self.keeps_voiced = False
        self._voiced: deque[list[int]] = deque(maxlen=_VOICED_KEPT)
        self.ends_at_pauses = True
        self.waits_for_verdicts = False
        # The decode end (`pause_sample`) of the pause the session said ends the turn: a
        # voiced frame moves the pause on, and the word said then is unjudged again.
        self._turn_end_sample: int | None = None

    def set_endpoints(self, vad_config: VadConfig) -> None:
        """Take the settings that end utterances (at the start, and when a vendor's session
        update changes them). With `end_of_turn = "model"`, the pause's early final comes at
        `end_of_turn_pause_ms`, a verdict that the turn is over ends the utterance right
        there, and without one it ends at `max_turn_silence_ms`."""
        self.by_model = vad_config.end_of_turn == "model"
        if self.by_model:
            self._tail_frames = max(1, vad_config.end_of_turn_pause_ms // FRAME_MS)
            self._endpoint_frames = self._tail_frames
            unfinished_ms = vad_config.max_turn_silence_ms
        else:
            self._tail_frames = max(1, vad_config.final_tail_ms // FRAME_MS)
            self._endpoint_frames = max(1, vad_config.endpoint_silence_ms // FRAME_MS)
            unfinished_ms = vad_config.unfinished_endpoint_silence_ms
        self._unfinished_endpoint_frames = max(self._endpoint_frames, unfinished_ms // FRAME_MS)
        self._long_samples = ms_to_samples(vad_config.long_utterance_s * 1000)
        self._long_endpoint_frames = max(1, vad_config.long_endpoint_silence_ms // FRAME_MS)

    @property
    def in_utterance(self) -> bool:
        return self._start_sample is not None

    @property
    def utterance_start_sample(self) -> int | None:
        return self._start_sample

    @property
    def lead_sample(self) -> int:
        """The `UtteranceStart.lead_sample` of the next utterance to open."""
        return self._last_end_sample

    @property
    def silent_samples(self) -> int:
        """Unvoiced audio at the end of the open utterance (0 while none is open)."""
        return 0 if self._start_sample is None else self._silent_frames * FRAME_SAMPLES

    @property
    def pause_sample(self) -> int | None:
        """Where the open utterance's final decode ends if no speech comes before its endpoint,
        once it has been silent that long (`final_tail_ms`); None while it is not."""
        if (
            self._start_sample is None
            or not self.ends_at_pauses
            or self._silent_frames < self._tail_frames
        ):
            return None
        return self._decode_end_sample()

    def voiced(self, start_sample: int, end_sample: int) -> list[tuple[int, int]]:
        """The voiced stretches between two samples (`keeps_voiced`), clipped to them."""
        return [
            (max(a, start_sample), min(b, end_sample))
            for a, b in self._voiced
            if b > start_sample and a < end_sample
        ]

    def push(self, frames: Pcm16) -> Iterator[VadEvent]:
        """Feed the next 30 ms frames: one, or every whole frame of a chunk. Levels are
        computed for the chunk at once (per frame, numpy's call overhead was a tenth of a
        worker's CPU at 600 streams)."""
        if len(frames) % FRAME_SAMPLES:
            raise ValueError(f"{len(frames)} samples are not whole {FRAME_SAMPLES}-sample frames")
        pcm = frames.astype("<i2", copy=False).tobytes()
        frame_bytes = 2 * FRAME_SAMPLES
        for i, level_dbfs in enumerate(levels_dbfs(frames)):
            yield from self._push_frame(level_dbfs, pcm[i * frame_bytes : (i + 1) * frame_bytes])

    def _push_frame(self, level_dbfs: float, pcm: bytes) -> Iterator[VadEvent]:
        frame_start = self._next_frame_sample
        frame_end = frame_start + FRAME_SAMPLES
        self._next_frame_sample = frame_end
        # webrtcvad adapts its noise model to every frame it sees, so it sees the quiet ones too:
        # fed only frames above the floor, it learns speech as the noise and misses the first
        # words after a silent lead-in (0.36 s of speech on a quiet Common Voice clip).
        webrtc_voiced = self._vad.is_speech(pcm, SAMPLE_RATE_HZ)
        voiced = webrtc_voiced and level_dbfs >= self._floor_dbfs
        if voiced and self.keeps_voiced:
            if self._voiced and frame_start - self._voiced[-1][1] < self._voiced_gap_samples:
                self._voiced[-1][1] = frame_end
            else:
                self._voiced.append([frame_start, frame_end])
        if self._start_sample is None:
            if voiced and self._first_voiced_sample is None:
                self._first_voiced_sample = frame_start
            self._window.append(voiced)
            if not any(self._window):
                self._onset_sample = None
            elif voiced and self._onset_sample is None:
                self._onset_sample = frame_start
            if sum(self._window) >= self._start_voiced:
                window_start = frame_end - len(self._window) * FRAME_SAMPLES
                assert self._onset_sample is not None  # the window holds a voiced frame
                speech = max(
                    self._onset_sample,
                    window_start - self._lookback_samples,
                    self._last_end_sample,
                )
                start = max(
                    min(speech, window_start) - self._preroll_samples, self._last_end_sample
                )
                self._open(start)
                yield UtteranceStart(
                    start_sample=start,
                    speech_start_sample=speech,
                    lead_sample=self._last_end_sample,
                )
            return
        self._recent.append((frame_start, level_dbfs))
        if self.keeps_levels:
            self._levels.append((frame_start, level_dbfs))
        if voiced:
            self._silent_frames = 0
            self._voiced_end_sample = frame_end
        else:
            self._silent_frames += 1
        length_samples = frame_end - self._start_sample
        if self._pause_ends_it(length_samples):
            yield self._close(frame_end)
        elif length_samples >= self._max_samples:
            cut = self._quietest_cut()
            yield dataclasses.replace(self._close(cut), cut=True)
            self._open(cut)
            yield UtteranceStart(
                start_sample=cut, speech_start_sample=cut, lead_sample=cut, continues=True
            )

    def turn_ended(self, pause_sample: int) -> Iterator[VadEvent]:
        """The turn ended at the pause whose final decode ends at `pause_sample` (its early
        final's words end a sentence, or the end-of-turn model says so): the pause ends the
        utterance at the endpoint, now if it is that long already. Nothing if the speaker went
        on since."""
        if self._start_sample is None or pause_sample != self._decode_end_sample():
            return
        self._turn_end_sample = pause_sample
        length_samples = self._next_frame_sample - self._start_sample
        if self._pause_ends_it(length_samples):
            # Where the endpoint would have closed it had the verdict come in time.
            endpoint_samples = self._endpoint_frames_at(length_samples) * FRAME_SAMPLES
            yield self._close(self._voiced_end_sample + endpoint_samples)

    def cut(self, from_sample: int, to_sample: int) -> Iterator[VadEvent]:
        """The speaker changed between two samples of the open utterance (the session's
        embeddings say so: streaming/speakers.py): end it at the quietest frame between them
        (a word's edge, seldom inside one) and open the next there, the speech going on, so
        that the first speaker's final is decoded now. Nothing if no utterance is open or none
        of its frames lies between them (`keeps_levels` keeps their levels)."""
        if self._start_sample is None:
            return
        start = self._start_sample
        between = [
            (frame_start, level)
            for frame_start, level in self._levels
            if frame_start > start and from_sample <= frame_start <= to_sample - FRAME_SAMPLES
        ]
        if not between:
            return
        frame_start, _ = min(between, key=lambda item: item[1])
        at = frame_start + FRAME_SAMPLES // 2
        # The pause (if any) at the stream's end goes on in the next utterance.
        silent_frames, voiced_end = self._silent_frames, self._voiced_end_sample
        levels = [item for item in self._levels if item[0] >= frame_start]
        yield dataclasses.replace(self._close(at), cut=True)
        self._open(at)
        self._silent_frames, self._voiced_end_sample, self._levels = (
            silent_frames,
            voiced_end,
            levels,
        )
        yield UtteranceStart(
            start_sample=at, speech_start_sample=at, lead_sample=at, continues=True
        )

    def flush(self, end_sample: int, *, begun: bool = False) -> Iterator[VadEvent]:
        """Close the open utterance at `end_sample` (finalize, or end of stream). With `begun`
        (a finalize: the client says its speech ends here), voiced audio since the last
        utterance that never filled the start window is one too, from its first voiced frame
        (at most `max_utterance_s` back)."""
        if self._start_sample is None and begun and self._first_voiced_sample is not None:
            speech = max(self._first_voiced_sample, end_sample - self._max_samples)
            start = max(speech - self._preroll_samples, self._last_end_sample)
            lead = self._last_end_sample
            self._open(start)
            yield UtteranceStart(start_sample=start, speech_start_sample=speech, lead_sample=lead)
        if self._start_sample is not None:
            yield self._close(max(end_sample, self._start_sample))

    def _open(self, start_sample: int) -> None:
        self._start_sample = start_sample
        self._first_voiced_sample = None
        self._silent_frames = 0
        self._voiced_end_sample = self._next_frame_sample
        self._turn_end_sample = None
        self._recent.clear()
        self._levels = []

    def _pause_ends_it(self, length_samples: int) -> bool:
        """Whether the silence so far ends the open utterance, `length_samples` long."""
        endpoint_frames = self._endpoint_frames_at(length_samples)
        return self.ends_at_pauses and self._silent_frames >= endpoint_frames

    def _endpoint_frames_at(self, length_samples: int) -> int:
        """The silence that ends the open utterance, `length_samples` long, now."""
        if length_samples >= self._long_samples:
            return self._long_endpoint_frames
        if self.waits_for_verdicts and self._turn_end_sample != self._decode_end_sample():
            return self._unfinished_endpoint_frames
        return self._endpoint_frames

    def _decode_end_sample(self) -> int:
        return self._voiced_end_sample + self._tail_frames * FRAME_SAMPLES

    def _close(self, end_sample: int) -> UtteranceEnd:
        decode_end = min(end_sample, self._decode_end_sample())
        self._start_sample = None
        self._last_end_sample = end_sample
        self._window.clear()
        self._onset_sample = None
        return UtteranceEnd(end_sample=end_sample, decode_end_sample=decode_end)

    def _quietest_cut(self) -> int:
        frame_start, _ = min(self._recent, key=lambda item: item[1])
        return frame_start + FRAME_SAMPLES // 2


def utterance_spans(
    samples: Samples, vad: Vad, vad_config: VadConfig, stream_config: StreamConfig
) -> list[tuple[int, int]]:
    """[start, end) of every utterance a stream of `samples` would be segmented into (a whole
    recording at once: tests and offline analyses). `vad` should be new, as a stream's is:
    webrtcvad adapts to the audio it has seen."""
    segmenter = VadSegmenter(vad, vad_config, stream_config)
    events = list(segmenter.push(Framer().push(to_pcm16(samples))))
    events.extend(segmenter.flush(len(samples)))
    starts = [e.start_sample for e in events if isinstance(e, UtteranceStart)]
    ends = [e.end_sample for e in events if isinstance(e, UtteranceEnd)]
    return list(zip(starts, ends, strict=True))
