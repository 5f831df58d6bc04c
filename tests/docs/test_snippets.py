"""The vendor SDK snippets of docs/guides/existing-app.md, run as written (only the port and the
WAV differ) against a real daemon with the fake engine: what a new user copies works."""

from __future__ import annotations

import asyncio
import re
import sys
import wave
from pathlib import Path

import numpy as np
import pytest
import soxr
from daemon_harness import RATE, running_daemon, tone_bursts
from testkit import REPO_ROOT

PAGE = REPO_ROOT / "docs" / "guides" / "existing-app.md"
# Each snippet: the bold heading it follows on the page, and the WAV it reads (rate).
SNIPPETS = {
    "**OpenAI Realtime transcription**": ("speech_24k_mono.wav", 24_000),
    "**Deepgram live**": ("talk.wav", RATE),
    "**AssemblyAI Universal-Streaming v3**": ("talk.wav", RATE),
}


def snippet(heading: str) -> str:
    page = PAGE.read_text(encoding="utf-8")
    assert page.count(heading) == 1, f"{heading} must head exactly one snippet in {PAGE.name}"
    after = page[page.index(heading) :]
    found = re.search(r"```python\n(.*?)```", after, re.DOTALL)
    assert found is not None, f"no python block after {heading}"
    return found[1]


def write_wav(path: Path, rate_hz: int) -> None:
    """Two 1-s 'words' (the fake engine's speech), at `rate_hz`, 16-bit mono."""
    pcm = tone_bursts([1.0, 1.0]).astype(np.float32) / 32768
    if rate_hz != RATE:
        pcm = soxr.resample(pcm, RATE, rate_hz)
    with wave.open(str(path), "wb") as wav:
        wav.setnchannels(1)
        wav.setsampwidth(2)
        wav.setframerate(rate_hz)
        wav.writeframes(np.clip(np.round(pcm * 32768), -32768, 32767).astype("<i2").tobytes())


@pytest.mark.parametrize("heading", list(SNIPPETS))
def test_a_vendor_snippet_runs_as_written(heading: str, tmp_path: Path) -> None:
    wav_name, rate_hz = SNIPPETS[heading]
    write_wav(tmp_path / wav_name, rate_hz)

    async def scenario() -> tuple[int, str, str]:
        async with running_daemon() as daemon:
            code = snippet(heading).replace("127.0.0.1:8765", f"127.0.0.1:{daemon.port}")
            process = await asyncio.create_subprocess_exec(
                sys.executable,
                "-c",
                code,
                cwd=tmp_path,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
            )
            out, err = await asyncio.wait_for(process.communicate(), 60)
            assert process.returncode is not None
            return process.returncode, out.decode(), err.decode()

    code, out, err = asyncio.run(scenario())
    assert code == 0, err[-2_000:]
    lines = [line for line in out.splitlines() if line.strip()]
    assert len(lines) == 2, out  # one transcript per word
