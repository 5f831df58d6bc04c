"""Giving freed memory back to the system once a load peak has passed (each daemon process's
event-loop thread; the trim itself runs on a helper thread).

A stream's audio lives in numpy arrays of a few MB, freed and allocated again as its buffer
moves. glibc keeps freed heap memory for reuse and does not return it while live blocks sit
above it: after a peak of 1,000 fake-engine streams on 2 workers, with every stream gone, the
engine process kept 4.1 GB and each worker 0.8-1.0 GB, for good; `malloc_trim(0)` brought
them to 0.26 and 0.08 GB. So each process trims when the streams it holds audio for fall to
half their peak since its last trim, or to none. Not on a timer: under a steady load most of
what is free is about to be used again, and trimming it would only move the cost to page
faults.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
from collections.abc import Callable

log = logging.getLogger(__name__)

_CHECK_EVERY_S = 1.0


class PeakTrimmer:
    """The rule, Sans-I/O: told now and then how many streams hold audio, it says when to trim."""

    def __init__(self) -> None:
        self._peak = 0  # the most streams held since the last trim

    def should_trim(self, streams: int) -> bool:
        self._peak = max(self._peak, streams)
        if self._peak and streams <= self._peak // 2:
            self._peak = streams
            return True
        return False


def malloc_trim() -> Callable[[], bool] | None:
    """glibc's `malloc_trim(0)` (True when it returned memory), or None where the C library
    has none (musl, macOS): there the rule has nothing to do."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return lambda: bool(trim(0))


async def trim_after_peaks(streams: Callable[[], int]) -> None:
    """Run until cancelled: trim when `PeakTrimmer` says so, on a helper thread, since giving
    back gigabytes takes a tenth of a second per GB and the streams still held go on."""
    trim = malloc_trim()
    if trim is None:
        return
    rule = PeakTrimmer()
    while True:
        await asyncio.sleep(_CHECK_EVERY_S)
        held = streams()
        if rule.should_trim(held) and await asyncio.to_thread(trim):
            log.debug("returned freed memory to the system (%d streams held)", held)
