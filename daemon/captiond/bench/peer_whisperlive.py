"""The peer: a WhisperLive 0.10.0 server (subprocess) and a client adapter for its protocol.

The server runs from `.venv-whisperlive/` (made by `bench/setup_whisperlive.sh`) with its
faster_whisper backend pointed at the same CTranslate2 folder as captiond. The adapter (asyncio,
the bench's event loop) sends the JSON options first, then float32 frames on the same schedule as
the native client, then `END_OF_AUDIO`, and translates WhisperLive's re-sent segment lists into
the native shape `metrics` measures: each newly `completed` segment is a `final`, the trailing
incomplete segment is a `partial` whose text is all `unstable` (WhisperLive has no stable part).
WhisperLive finishes an utterance only once its output repeats, so after the audio the adapter
waits (at most `tail_s`) until no segment is pending and it has been quiet for `settle_s`; what
is still pending at the close becomes a final marked `trailing` (in the transcript, not in
latency).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from captiond.bench.metrics import Message, Trace
from captiond.bench.pacing import send_paced
from captiond.lang.languages import AUTO_LANGUAGE, check_language

VENV = Path(".venv-whisperlive")
MODES = ("default", "single", "batch")
_SERVER = """
import sys
from whisper_live.server import TranscriptionServer
port, model, mode, max_clients = int(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4])
TranscriptionServer().run(
    "127.0.0.1", port, backend="faster_whisper", faster_whisper_custom_model_path=model,
    single_model=mode != "default", batch_enabled=mode == "batch", max_clients=max_clients,
    max_connection_time=3600,
)
"""


class PeerError(RuntimeError):
    """The peer is not installed, did not start, or refused a stream."""


def peer_python(venv: Path = VENV) -> Path:
    python = venv / "bin" / "python"
    if not python.is_file():
        raise PeerError(f"{python} not found: run bench/setup_whisperlive.sh first")
    return python


def peer_version(venv: Path = VENV) -> str:
    out = subprocess.run(
        [
            str(peer_python(venv)),
            "-c",
            "import importlib.metadata as m; print(m.version('whisper-live'))",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    return out.stdout.strip()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@contextlib.contextmanager
def whisperlive_server(
    model: Path, mode: str = "default", max_clients: int = 64, venv: Path = VENV
) -> Iterator[tuple[str, int]]:
    """Run the peer server; yields its websocket URL and process id; stops it on exit."""
    port = _free_port()
    args = [str(model), mode, str(max_clients)]
    proc = subprocess.Popen(
        [str(peer_python(venv)), "-c", _SERVER, str(port), *args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 120
        while True:
            if proc.poll() is not None:
                raise PeerError(f"the WhisperLive server exited with {proc.returncode}")
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 1):
                break
            if time.monotonic() > deadline:
                raise PeerError("the WhisperLive server did not listen within 120 s")
            time.sleep(0.5)
        yield f"ws://127.0.0.1:{port}", proc.pid
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class SegmentTranslator:
    """WhisperLive segment lists in, native partial/final messages out (onto a Trace)."""

    def __init__(self, trace: Trace) -> None:
        self._trace = trace
        self._completed: set[str] = set()
        self._segment = 0
        self._rev = 0
        self.pending: Message | None = None

    def feed(self, wall_s: float, segments: list[dict[str, Any]]) -> None:
        for seg in segments:
            if seg.get("completed") and seg["start"] not in self._completed:
                self._completed.add(seg["start"])
                self._emit(wall_s, "final", seg, text=seg["text"].strip())
                self._segment += 1
                self._rev = 0
                self.pending = None
        last = segments[-1] if segments else None
        if last is not None and not last.get("completed") and last["text"].strip():
            self._rev += 1
            self.pending = self._emit(
                wall_s, "partial", last, rev=self._rev, stable="", unstable=last["text"].strip()
            )

    def close(self, wall_s: float) -> None:
        if self.pending is not None:
            final = {k: self.pending[k] for k in ("segment", "start_ms", "end_ms")}
            text = self.pending["unstable"]
            self._trace.record_message(
                wall_s, {"type": "final", **final, "text": text, "trailing": True}
            )
            self.pending = None
        self._trace.record_message(wall_s, {"type": "done"})

    def _emit(self, wall_s: float, kind: str, seg: dict[str, Any], **fields: Any) -> Message:
        message: Message = {
            "type": kind,
            "segment": self._segment,
            "start_ms": round(float(seg["start"]) * 1000),
            "end_ms": round(float(seg["end"]) * 1000),
            **fields,
        }
        self._trace.record_message(wall_s, message)
        return message


async def stream_whisperlive(
    url: str,
    samples: npt.NDArray[np.float32],
    *,
    speed: float = 1.0,
    language: str | None = "en",
    tail_s: float = 10.0,
    settle_s: float = 2.0,
    trace: Trace | None = None,
) -> Trace:
    """Stream one clip to WhisperLive as its own client does, in `language` (None: WhisperLive
    detects it); the trace in native shape (pass `trace` to keep what was recorded when the
    stream fails)."""
    trace = Trace() if trace is None else trace
    translator = SegmentTranslator(trace)
    options = {
        "uid": uuid.uuid4().hex,
        "language": language,
        "task": "transcribe",
        "model": "tiny.en",  # replaced by the server's custom model path
        "use_vad": True,
    }
    try:
        async with connect(url, max_size=None, open_timeout=60) as conn:
            trace.connect_epoch_s = time.time()
            await conn.send(json.dumps(options))
            ready = json.loads(await asyncio.wait_for(conn.recv(), 120))
            if ready.get("message") != "SERVER_READY":
                raise PeerError(f"WhisperLive refused the stream: {ready}")
            last_message_s = [time.monotonic()]

            async def receive() -> None:
                with contextlib.suppress(ConnectionClosed):
                    async for raw in conn:
                        now = time.monotonic()
                        message = json.loads(raw)
                        if "segments" in message:
                            last_message_s[0] = now
                            translator.feed(now, message["segments"])

            receiver = asyncio.create_task(receive())
            try:
                last_message_s[0] = time.monotonic()
                await send_paced(samples.tobytes(), 4, speed, conn.send, trace)
                # Let it finish: until nothing is pending and it has been quiet for `settle_s`.
                deadline = time.monotonic() + tail_s
                while time.monotonic() < deadline and (
                    translator.pending is not None
                    or time.monotonic() - last_message_s[0] < settle_s
                ):
                    await asyncio.sleep(0.05)
                await conn.send(b"END_OF_AUDIO")
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(receiver, 30)
            finally:
                receiver.cancel()
    finally:
        if trace.connect_epoch_s is not None:
            trace.close_epoch_s = time.time()
    trace.ended_s = time.monotonic()
    translator.close(trace.ended_s)
    return trace


def peer_language(tag: str) -> str | None:
    """captiond's stream language (a tag, or "auto") as WhisperLive takes it (None: detect)."""
    code = check_language(tag)
    return None if code == AUTO_LANGUAGE else code
