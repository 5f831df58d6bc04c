"""Test harness: a real captiond daemon on a free loopback port, a tiny protocol client, and the
service manager's end of $NOTIFY_SOCKET."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import socket
import subprocess
import threading
import time
import wave
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed

from captiond.config import Config
from captiond.decoding.scheduler import InferenceScheduler
from captiond.engines.base import Embedder, Engine, EngineRequest, EngineResult, TurnModel
from captiond.engines.fake import FakeEngine
from captiond.lang.text import units
from captiond.server.daemon import Daemon
from captiond.sources.daemon import AudioInput, microphone
from captiond.streaming.events import Ready, Word
from captiond.streaming.vad import Vad, levels_dbfs
from captiond.workers.pool import WorkerPool

RATE = 16_000


class LoudnessVad:
    """A scripted stand-in for webrtcvad: a frame is speech when it is louder than -40 dBFS."""

    def is_speech(self, buf: bytes, sample_rate: int) -> bool:
        return levels_dbfs(np.frombuffer(buf, dtype="<i2"))[0] > -40.0


class RecordingEngine(FakeEngine):
    """The fake engine, noting the language, task and stream prompt of every request it
    decodes; multilingual unless told otherwise (streams of an English-only model are refused
    other languages)."""

    def __init__(self, *, multilingual: bool = True) -> None:
        super().__init__()
        self._multilingual = multilingual
        self.languages: list[str | None] = []
        self.tasks: list[str] = []
        self.prompts: list[str] = []

    @property
    def multilingual(self) -> bool:
        return self._multilingual

    def transcribe_batch(self, requests: Sequence[EngineRequest]) -> list[EngineResult]:
        self.languages += [r.language for r in requests]
        self.tasks += [r.task for r in requests]
        self.prompts += [r.stream_prompt for r in requests]
        return super().transcribe_batch(requests)


def tone_bursts(
    bursts_s: list[float], gap_s: float = 1.0, tones_hz: Sequence[float] = ()
) -> np.ndarray:
    """Loud bursts separated by silence, as int16 samples (speech for LoudnessVad): 220 Hz, or
    each burst at its own frequency of `tones_hz` (two "voices" for ToneEmbedder); a gap of 0
    runs one voice into the next, as a turn with no pause."""
    parts: list[np.ndarray] = [np.zeros(int(0.5 * RATE))]
    for i, dur in enumerate(bursts_s):
        t = np.arange(int(dur * RATE)) / RATE
        tone_hz = tones_hz[i] if tones_hz else 220.0
        parts += [0.3 * np.sin(2 * np.pi * tone_hz * t), np.zeros(int(gap_s * RATE))]
    return (np.concatenate(parts) * 32767).astype("<i2")


class ToneEmbedder:
    """A scripted speaker-embedding model: a window's "voice" is its loudest frequency, in
    100-Hz bins, so each tone of `tone_bursts` is a speaker of its own (orthogonal vectors)."""

    dims = 64
    # Beside the decodes, on the scheduler's speaker thread, as the real model on the CPU.
    concurrent = True

    def embed(self, windows: Sequence[np.ndarray]) -> np.ndarray:
        out = np.zeros((len(windows), self.dims), dtype=np.float32)
        for row, window in enumerate(windows):
            spectrum = np.abs(np.fft.rfft(window))
            peak_hz = float(np.argmax(spectrum)) * RATE / max(1, len(window))
            out[row, min(self.dims - 1, round(peak_hz / 100))] = 1.0
        return out


class SureTurns:
    """A scripted end-of-turn model: every turn it is asked about is over (the daemon's
    plumbing; the real model's verdicts are tested in tests/engines/test_turn.py)."""

    def complete(self, turns: Sequence[np.ndarray]) -> list[float]:
        return [0.9] * len(turns)


def timed_words(text: str, start_ms: int) -> tuple[Word, ...]:
    """A final's words as the session gives them, for the dialects' own tests: each unit of
    `text` 300 ms after the last and 200 ms long, confidence 0.8, except the second, which the
    decode did not write (zero length, confidence None: streaming/words.py)."""
    words = []
    for i, unit in enumerate(units(text)):
        start = start_ms + 300 * i
        missing = i == 1
        end = start if missing else start + 200
        words.append(
            Word(word=unit, start_ms=start, end_ms=end, confidence=None if missing else 0.8)
        )
    return tuple(words)


def ready(**fields: Any) -> Ready:
    """A `ready` message as the daemon's defaults make it, for the dialects' own tests."""
    defaults: dict[str, Any] = {
        "session": "s1",
        "sample_rate": RATE,
        "model": "tiny.en",
        "engine": "fake",
        "max_audio_speed": 10.0,
        "audio_burst_s": 60.0,
    }
    return Ready(**(defaults | fields))


def make_config(**sections: dict[str, Any]) -> Config:
    base = Config()
    server = dataclasses.replace(base.server, **{"port": 0, **sections.pop("server", {})})
    config = dataclasses.replace(base, server=server)
    for name, values in sections.items():
        config = dataclasses.replace(
            config, **{name: dataclasses.replace(getattr(config, name), **values)}
        )
    return config


@contextlib.asynccontextmanager
async def running_daemon(
    config: Config | None = None,
    engine: Engine | None = None,
    vad_factory: Callable[[], Vad] | None = LoudnessVad,
    audio_input: AudioInput = microphone,
    embedder: Callable[[], Embedder] | None = ToneEmbedder,
    turn_model: Callable[[], TurnModel] | None = SureTurns,
) -> AsyncIterator[Daemon]:
    config = config or make_config()
    scheduler = InferenceScheduler(
        engine or FakeEngine(), config.scheduler, embedder=embedder, turn_model=turn_model
    )
    scheduler.start()
    daemon = Daemon(config, scheduler, vad_factory=vad_factory, audio_input=audio_input)
    await daemon.start()
    try:
        yield daemon
    finally:
        await daemon.shutdown()
        scheduler.stop()


@contextlib.asynccontextmanager
async def running_pool(
    config: Config | None = None, workers: int = 2, engine: Engine | None = None
) -> AsyncIterator[WorkerPool]:
    """The multi-process daemon: the engine core in this process, `workers` worker processes
    (with LoudnessVad, as `running_daemon`)."""
    config = config or make_config()
    config = dataclasses.replace(config, server=dataclasses.replace(config.server, workers=workers))
    scheduler = InferenceScheduler(engine or FakeEngine(), config.scheduler)
    scheduler.start()
    tests = str(Path(__file__).parent)
    pool = WorkerPool(
        config,
        scheduler,
        worker_args=("--vad", "daemon_harness:LoudnessVad"),
        worker_env={
            "PYTHONPATH": os.pathsep.join(filter(None, (tests, os.environ.get("PYTHONPATH"))))
        },
    )
    try:
        await pool.start()
    except BaseException:  # start shut the pool down
        scheduler.stop()
        raise
    try:
        yield pool
    finally:
        await pool.shutdown()
        scheduler.stop()


def url(daemon: Daemon | WorkerPool, path: str = "/v1/stream", query: str = "") -> str:
    return f"ws://127.0.0.1:{daemon.port}{path}{'?' + query if query else ''}"


@dataclasses.dataclass
class Exchange:
    messages: list[dict[str, Any]]
    close_code: int | None

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [m for m in self.messages if m["type"] == kind]


async def recv_until(conn: ClientConnection, kind: str, count: int = 1) -> list[dict[str, Any]]:
    """Messages up to and including the `count`-th of type `kind`."""
    seen: list[dict[str, Any]] = []
    while sum(m["type"] == kind for m in seen) < count:
        seen.append(json.loads(await asyncio.wait_for(conn.recv(), 10)))
    return seen


def drop(conn: ClientConnection) -> None:
    """The network went away: no close frame, no `end`."""
    assert conn.transport is not None
    conn.transport.abort()


def resume_url(base: str, token: str, since: int | None = None) -> str:
    return f"{base}?resume={token}" + ("" if since is None else f"&since={since}")


async def collect(conn: ClientConnection) -> Exchange:
    """Read messages until the server closes the connection."""
    messages: list[dict[str, Any]] = []
    with contextlib.suppress(ConnectionClosed):
        async for raw in conn:
            assert isinstance(raw, str)
            messages.append(json.loads(raw))
    return Exchange(messages, conn.close_code)


async def refused(target: str) -> tuple[dict[str, Any], int | None]:
    """Connect to `target` and send nothing: the error the daemon answers and its close code
    (a stream the query already refuses)."""
    async with connect(target) as conn:
        ex = await asyncio.wait_for(collect(conn), 10)
    (error,) = ex.of("error")
    return error, ex.close_code


async def stream_pcm(
    target: str, pcm: np.ndarray, chunk_samples: int = 1600, pause_s: float = 0.0
) -> Exchange:
    """Send audio in chunks (pausing between them), then `end`; return what the server said."""
    # A hang guard, not a timing assertion: the real model on a slow 2-core CPU may still be
    # decoding a clip sent all at once for about as long as the clip lasts.
    limit_s = 30 + 2 * len(pcm) / RATE
    async with connect(target) as conn:
        reader = asyncio.create_task(collect(conn))
        with contextlib.suppress(ConnectionClosed):  # the daemon may refuse the rest
            for start in range(0, len(pcm), chunk_samples):
                await conn.send(pcm[start : start + chunk_samples].tobytes())
                await asyncio.sleep(pause_s)
            await conn.send(json.dumps({"type": "end"}))
        return await asyncio.wait_for(reader, limit_s)


def check_invariants(ex: Exchange) -> None:
    """docs/reference/protocol-v1.md's invariants for one session's messages."""
    assert ex.messages[0]["type"] == "ready"
    finals: dict[int, dict[str, Any]] = {}
    last_partial: dict[int, dict[str, Any]] = {}
    for m in ex.messages[1:]:
        if m["type"] == "partial":
            seg = m["segment"]
            assert seg not in finals, "partial after the segment's final"
            prev = last_partial.get(seg)
            if prev is not None:
                assert m["rev"] > prev["rev"]
                assert m["stable"].startswith(prev["stable"]), "stable text shrank"
            last_partial[seg] = m
        elif m["type"] == "final":
            assert m["segment"] not in finals, "two finals for one segment"
            finals[m["segment"]] = m
            assert m["start_ms"] <= m["end_ms"]
    assert sorted(finals) == list(range(len(finals))), "segments not numbered 0, 1, 2, …"
    assert set(last_partial) <= set(finals), "a segment with partials never got its final"
    if ex.of("done"):
        assert ex.messages[-1]["type"] == "done"
        assert ex.messages[-1]["segments"] == len(finals)


class NotifyListener:
    """The service manager's side of $NOTIFY_SOCKET: every datagram, in order."""

    def __init__(self, path: Path) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.settimeout(0.2)
        self.messages: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            with contextlib.suppress(TimeoutError):
                self.messages.extend(self.sock.recv(4096).decode().splitlines())

    def wait_for(self, text: str, limit_s: float, proc: subprocess.Popen[Any] | None = None) -> int:
        """The index of the first line containing `text`, waiting up to `limit_s` for it."""
        deadline = time.monotonic() + limit_s
        while (found := next((i for i, m in enumerate(self.messages) if text in m), None)) is None:
            assert proc is None or proc.poll() is None, "the daemon exited"
            assert time.monotonic() < deadline, self.messages
            time.sleep(0.05)
        return found

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.sock.close()


def silent_wav(tmp_path: Path) -> Path:
    """A tenth of a second of 16 kHz silence."""
    wav = tmp_path / "x.wav"
    with wave.open(str(wav), "wb") as wf:
        wf.setnchannels(1)
        wf.setsampwidth(2)
        wf.setframerate(16000)
        wf.writeframes(b"\x00\x00" * 1600)
    return wav
