"""Freed memory goes back to the system once a load peak has passed (ops/memory.py): the rule, the
real glibc call, and the daemon and the engine core of several workers trimming when their
streams are gone."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
from collections.abc import Callable

import pytest
from daemon_harness import running_daemon, running_pool, stream_pcm, tone_bursts, url

from captiond.ops import memory
from captiond.ops.memory import PeakTrimmer

PCM = tone_bursts([0.6, 0.6], gap_s=0.6)


def test_the_rule_trims_when_the_streams_held_halve_or_end() -> None:
    rule = PeakTrimmer()
    held = [0, 3, 10, 8, 6, 5, 5, 4, 3, 2, 2, 1, 0, 0, 4, 4, 0]
    trims = [n for n in held if rule.should_trim(n)]
    # 10 -> 5 (half), then 5 -> 2 (half of the peak since that trim), 2 -> 1, 1 -> 0; a new
    # peak of 4 -> 0. Idle (0, 0) and a steady or slowly falling load do not trim.
    assert trims == [5, 2, 1, 0, 0]


@pytest.mark.skipif(memory.malloc_trim() is None, reason="no glibc malloc_trim here")
def test_trimming_gives_back_what_glibc_kept_after_a_peak() -> None:
    # In a fresh interpreter: arrays of a stream buffer's size, most of them freed while
    # others still sit above them in the heap.
    script = textwrap.dedent(
        """
        import random
        import numpy as np
        from captiond.ops.memory import malloc_trim

        def rss_mib():
            return int(open("/proc/self/statm").read().split()[1]) * 4096 / 2**20

        rng = random.Random(1)
        arrays = []
        for _ in range(1200):
            arrays.append(np.ones(rng.randint(100_000, 1_000_000), dtype=np.float32))
            if len(arrays) > 300:
                arrays.pop(rng.randrange(len(arrays)))
        del arrays[100:]
        live_mib = sum(a.nbytes for a in arrays) / 2**20
        before = rss_mib()
        assert malloc_trim()()
        print(live_mib, before, rss_mib())
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=120
    )
    live_mib, before_mib, after_mib = map(float, out.stdout.split())
    assert after_mib < before_mib - live_mib, (live_mib, before_mib, after_mib)
    assert after_mib < live_mib + 150, "what is left is what is live (and the interpreter)"


class _Trims:
    def __init__(self) -> None:
        self.count = 0

    def __call__(self) -> bool:
        self.count += 1
        return True


async def _wait_for(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not condition():
            await asyncio.sleep(0.05)


def test_a_daemon_trims_once_its_streams_are_gone(monkeypatch: pytest.MonkeyPatch) -> None:
    trims = _Trims()
    monkeypatch.setattr(memory, "malloc_trim", lambda: trims)
    monkeypatch.setattr(memory, "_CHECK_EVERY_S", 0.05)

    async def scenario() -> None:
        async with running_daemon() as daemon:
            await stream_pcm(url(daemon), PCM, pause_s=0.02)  # seen open
            # Held for a resume for 60 s, the done stream has let its audio go already.
            await _wait_for(lambda: trims.count == 1)

    asyncio.run(scenario())


def test_the_engine_core_of_workers_trims_once_their_streams_are_gone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    trims = _Trims()
    monkeypatch.setattr(memory, "malloc_trim", lambda: trims)
    monkeypatch.setattr(memory, "_CHECK_EVERY_S", 0.05)

    async def scenario() -> None:
        async with running_pool() as pool:
            await asyncio.gather(*(stream_pcm(url(pool), PCM, pause_s=0.02) for _ in range(2)))
            # Only the engine core's copies of the streams' audio count here (the workers
            # are other processes): the trim shows they were held, then let go when the
            # streams were done, not when their 60 s held for a resume are over.
            await _wait_for(lambda: trims.count == 1)

    asyncio.run(scenario())
