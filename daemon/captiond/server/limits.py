"""How fast a stream may send audio: a token bucket of audio seconds against the wall clock.

Sans-I/O (the caller passes the time), one per stream connection, on the event-loop thread.
"""

from __future__ import annotations

from captiond.errors import RateLimitedError


class AudioSpeedLimit:
    """At most `burst_s` of audio ahead of `max_speed` times the time since the stream began:
    a real-time client never comes near it, a client replaying a file at a few times real
    time neither, and a flood is refused after its first `burst_s`."""

    def __init__(self, *, max_speed: float, burst_s: float, now_s: float) -> None:
        self._max_speed = max_speed
        self._burst_s = burst_s
        self._start_s = now_s
        self.audio_s = 0.0

    def add(self, audio_s: float, now_s: float) -> None:
        self.audio_s += audio_s
        allowed_s = self._burst_s + self._max_speed * (now_s - self._start_s)
        if self.audio_s > allowed_s:
            raise RateLimitedError(
                f"{self.audio_s:.1f} s of audio in {now_s - self._start_s:.1f} s: faster than "
                f"{self._max_speed:g}x real time (after a first {self._burst_s:g} s)"
            )
