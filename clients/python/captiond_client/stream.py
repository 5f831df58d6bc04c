"""Streaming audio to a daemon over protocol v1, across dropped connections (asyncio, the
caller's event loop).

`Stream.run` takes PCM chunks from a live source (a paced file, the microphone) and keeps
them flowing to one daemon session: when the connection drops or the daemon restarts, it
reconnects with backoff and resumes the session with its token; the daemon says how much audio
it has and the rest is sent again from the kept audio (the newest `keep_audio_s`), finals are
acknowledged as they arrive, and replayed ones are not reported twice. Audio never goes out
faster than the daemon's default limits take it (`SendBudget`), so a file sent at full speed
or the backlog of a long drop is paced, not refused. `stream_samples` streams a file this way.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import numpy as np
import numpy.typing as npt
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import (
    ConnectionClosed,
    InvalidHandshake,
    InvalidMessage,
    InvalidStatus,
    InvalidURI,
)

from captiond.sources.audiofile import to_pcm_s16le
from captiond.streaming.audio import CHUNK_MS
from captiond.whisper import SAMPLE_RATE_HZ

log = logging.getLogger(__name__)

Message = dict[str, Any]
BYTES_PER_SAMPLE = 2
# Errors after which the same session is worth resuming: the daemon is stopping (it keeps the
# session in its journal), or it is full for now.
_RESUMABLE_ERRORS = {"shutting_down", "overloaded"}
# Audio sent to a new session that replaces one the daemon no longer held: at most this much,
# under the daemon's default `audio_burst_s` (60 s), so that the burst is not refused
# (`rate_limited`). What the client was away for beyond it is lost, and said so. It is also
# how far ahead of `MAX_SEND_SPEED` the client ever sends (SendBudget).
FRESH_RESEND_S = 50.0
# Times real time the client sends at most, beyond that burst: under the daemon's default
# `max_audio_speed` (10).
MAX_SEND_SPEED = 8.0
# The share of a daemon's announced speed limit (`ready`) the client uses: its clock starts
# later than the daemon's, and a network stall can deliver a second's audio at once.
_LIMIT_SHARE = 0.8
_FIRST_RETRY_S, _LAST_RETRY_S = 0.5, 8.0


class StreamError(RuntimeError):
    """The daemon refused or ended the stream with an error."""


class _Dropped(Exception):
    """The connection went away without `done`: reconnect. `answered`: the daemon (or a
    proxy before it) answered, so the URL is right even if no session began yet."""

    def __init__(self, why: str, *, answered: bool = True) -> None:
        super().__init__(why)
        self.answered = answered


class SendBudget:
    """How much audio may go out now: at most `burst_bytes` ahead of `bytes_per_s`, counted
    both from the session's start and from the connection's. The daemon's limit (`[server]
    audio_burst_s` ahead of `max_audio_speed`, which its `ready` announces) counts from the
    session's start, and anew for a session it took back from its journal after a restart;
    this keeps under both. A real-time source never comes near it."""

    def __init__(self, *, burst_bytes: int, bytes_per_s: float) -> None:
        self._most = (burst_bytes, bytes_per_s)  # what the client allows itself
        self._burst_bytes = burst_bytes
        self._bytes_per_s = bytes_per_s
        self._session: tuple[float, int] = (time.monotonic(), 0)  # (start, bytes sent since)
        self._connection = self._session

    def fit(self, burst_bytes: float, bytes_per_s: float) -> None:
        """Under a daemon's announced limit too (this daemon's: it may have restarted with
        another)."""
        self._burst_bytes = int(min(self._most[0], burst_bytes))
        self._bytes_per_s = min(self._most[1], bytes_per_s)

    def new_session(self) -> None:
        self._session = self._connection = (time.monotonic(), 0)

    def new_connection(self) -> None:
        self._connection = (time.monotonic(), 0)

    def wait_s(self, size: int) -> float:
        """Seconds until `size` bytes may go out (0: now)."""
        now = time.monotonic()
        short = max(
            sent + size - self._burst_bytes - (now - start) * self._bytes_per_s
            for start, sent in (self._session, self._connection)
        )
        return max(0.0, short / self._bytes_per_s)

    def spend(self, size: int) -> None:
        self._session = (self._session[0], self._session[1] + size)
        self._connection = (self._connection[0], self._connection[1] + size)


def stream_url(url: str, sample_rate_hz: int = SAMPLE_RATE_HZ) -> str:
    sep = "&" if "?" in url else "?"
    return f"{url}{sep}sample_rate={sample_rate_hz}&encoding=pcm_s16le"


class Stream:
    """One caption session over as many connections as it takes."""

    def __init__(
        self,
        url: str,
        *,
        sample_rate_hz: int,
        on_message: Callable[[Message], None],
        retry_for_s: float = 300.0,
        keep_audio_s: float = 120.0,
        fresh_resend_s: float = FRESH_RESEND_S,
        max_send_speed: float = MAX_SEND_SPEED,
    ) -> None:
        self._url = stream_url(url, sample_rate_hz)
        self._on_message = on_message
        self._retry_for_s = retry_for_s
        self._bytes_per_s = sample_rate_hz * BYTES_PER_SAMPLE
        self._keep_bytes = round(keep_audio_s * sample_rate_hz) * BYTES_PER_SAMPLE
        self._fresh_resend_bytes = round(fresh_resend_s * sample_rate_hz) * BYTES_PER_SAMPLE
        self._budget = SendBudget(
            burst_bytes=self._fresh_resend_bytes, bytes_per_s=max_send_speed * self._bytes_per_s
        )
        self._retry_s = _FIRST_RETRY_S  # the next reconnect's delay; reset by each session
        # Audio from the source: `_audio` holds bytes [_kept_from, _kept_from + len(_audio)).
        self._audio = bytearray()
        self._kept_from = 0
        self._source_done = False
        self._more = asyncio.Event()  # new audio, or the source ended
        self._token: str | None = None
        self._next_segment = 0  # this session's finals below it were reported
        self._earlier_segments = 0  # finals of earlier sessions (that could not be resumed)
        # Source byte where the current session's audio starts, and up to which its finals
        # have transcribed it: a new session (the old one could not be resumed) starts there.
        self._session_base: int | None = None  # None: no session yet
        self._covered = 0
        # Audio a resume could not resend (the client no longer had it), in the current
        # session: (the daemon's stream ms where its audio skips, source bytes skipped there).
        self._skips: list[tuple[int, int]] = []
        self._away_since: float | None = None  # monotonic time the connection was lost
        self.reconnects = 0

    @property
    def _audio_end(self) -> int:
        return self._kept_from + len(self._audio)

    async def run(self, chunks: AsyncIterator[bytes]) -> None:
        """Send `chunks`, then `end`; report every message until `done`. Raises StreamError
        when the daemon ends the session with an error, or stays away `retry_for_s`."""
        reader = asyncio.create_task(self._take(chunks))
        try:
            await self._connections(reader)
        finally:
            reader.cancel()

    async def _take(self, chunks: AsyncIterator[bytes]) -> None:
        """Keep the source's audio (a bounded tail), whether or not a connection is up."""
        async for chunk in chunks:
            self._audio += chunk
            excess = len(self._audio) - self._keep_bytes
            if excess > 0:
                del self._audio[:excess]
                self._kept_from += excess
            self._more.set()
        self._source_done = True
        self._more.set()

    async def _connections(self, reader: asyncio.Task[None]) -> None:
        while True:
            try:
                await self._connection(reader)
                return
            except _Dropped as exc:
                now = time.monotonic()
                self._away_since = self._away_since or now
                away_s = now - self._away_since
                # A daemon that never answered at all is a wrong URL more likely than a
                # restart; one that answered "overloaded" or HTTP 503 is worth waiting for.
                never_answered = self._session_base is None and not exc.answered
                if never_answered or away_s >= self._retry_for_s:
                    raise StreamError(f"cannot reach the daemon at {self._url}: {exc}") from exc
                delay_s = self._retry_s
                log.warning("connection lost (%s); reconnecting in %.1f s", exc, delay_s)
                await asyncio.sleep(delay_s * random.uniform(0.8, 1.2))
                self._retry_s = min(delay_s * 2, _LAST_RETRY_S)
                self.reconnects += 1
                _raise_if_failed(reader)

    async def _connection(self, reader: asyncio.Task[None]) -> None:
        url = self._url
        if self._token is not None:
            url += f"&resume={self._token}&since={self._next_segment}"
        try:
            conn = await connect(url, max_size=None)
        except InvalidURI as exc:
            raise StreamError(f"not a websocket URL (ws:// or wss://): {exc}") from None
        except OSError as exc:  # refused, unreachable, timed out: the daemon may come back
            raise _Dropped(str(exc), answered=False) from exc
        except InvalidMessage as exc:  # closed before its answer: a relay whose daemon is away
            raise _Dropped(f"no answer to the upgrade: {exc}", answered=False) from exc
        except InvalidStatus as exc:  # answered with HTTP instead of the upgrade
            status = exc.response.status_code
            # The daemon's refusals are one line; whatever else answers may send a page.
            lines = exc.response.body.decode(errors="replace").strip().splitlines()
            why = lines[0][:200] if lines else exc.response.reason_phrase
            if status >= 500:  # a proxy or a daemon on its way down or up
                raise _Dropped(f"HTTP {status}: {why}") from exc
            if status < 400:  # a web server, or the daemon's page: not a stream endpoint
                raise StreamError(
                    f"{self._url} did not answer as a captiond daemon (HTTP {status})"
                ) from None
            raise StreamError(  # the token, the Origin: trying again will not help
                f"the daemon refused the connection (HTTP {status}): {why}"
            ) from None
        except InvalidHandshake as exc:  # an answer, but not a websocket server's
            raise StreamError(f"{self._url} did not answer as a captiond daemon: {exc}") from None
        async with conn:
            hello = await self._hello(conn)
            position = self._audio_end
            if hello["type"] == "resumed":
                self._budget.new_connection()
                position = int(hello["received_bytes"])
                if position < self._kept_from:
                    log.warning("%d ms of audio were not kept: not resent", self._gap_ms(position))
                    # The daemon's clock goes on from what it received: its later times are
                    # this much earlier than the source's.
                    self._skips.append((int(hello["audio_ms"]), self._kept_from - position))
                    position = self._kept_from
            elif self._session_base is None:  # the first session: all the source's audio
                self._budget.new_session()
                position = self._session_base = self._kept_from
            else:
                # A session replacing one the daemon no longer held: from the audio no final
                # of an earlier session covered, at most `fresh_resend_s` of it (catching up
                # on more would keep the captions that far behind).
                self._budget.new_session()
                uncovered = max(self._covered, self._kept_from)
                position = max(uncovered, self._audio_end - self._fresh_resend_bytes)
                if position > uncovered:
                    log.warning(
                        "away too long: %d ms of audio no final covered were not resent",
                        (position - uncovered) * 1000 // self._bytes_per_s,
                    )
                self._session_base = position
            sender = asyncio.create_task(self._send(conn, position, bool(hello.get("ended"))))
            receiver = asyncio.create_task(self._receive(conn))
            try:
                await asyncio.wait({receiver, reader}, return_when=asyncio.FIRST_COMPLETED)
                _raise_if_failed(reader)  # the source failed (a microphone gone)
                await receiver
            finally:
                sender.cancel()
                receiver.cancel()

    def _bytes_at_ms(self, ms: int) -> int:
        """The byte offset of stream time `ms`: on a sample, so audio sent from it is whole
        samples (at 22,050 Hz a millisecond is not)."""
        rate_hz = self._bytes_per_s // BYTES_PER_SAMPLE
        return int(ms) * rate_hz // 1000 * BYTES_PER_SAMPLE

    def _gap_ms(self, position: int) -> int:
        return (self._kept_from - position) * 1000 // self._bytes_per_s

    async def _hello(self, conn: ClientConnection) -> Message:
        """`ready` or `resumed`; a resume the daemon refuses starts a new session instead."""
        message = await self._next(conn)
        if message.get("code") == "resume_failed":
            log.warning("the session could not be resumed (%s): starting a new one", message)
            self._token = None
            raise _Dropped("resume refused")
        if message.get("code") in _RESUMABLE_ERRORS:
            raise _Dropped(message["code"])
        if message["type"] not in ("ready", "resumed"):
            self._fail(message)
        if message["type"] == "ready" and self._session_base is not None:
            # A new session after an earlier one (expired, refused, or a daemon that does
            # not resume): its segments count from 0 again, after the earlier ones'.
            self._earlier_segments += self._next_segment
            self._next_segment = 0
            self._skips = []
        self._token = message.get("resume_token")
        self._away_since = None
        self._retry_s = _FIRST_RETRY_S
        if "max_audio_speed" in message:  # not from a daemon before the field
            self._budget.fit(
                _LIMIT_SHARE * message["audio_burst_s"] * self._bytes_per_s,
                _LIMIT_SHARE * message["max_audio_speed"] * self._bytes_per_s,
            )
        self._on_message(message)
        return message

    async def _send(self, conn: ClientConnection, position: int, sent_end: bool) -> None:
        """The audio from byte `position` on, as it comes; `end` after the source's last. A
        drop ends it quietly: the receiver reports it."""
        with contextlib.suppress(ConnectionClosed):
            await self._send_from(conn, position, sent_end)

    async def _send_from(self, conn: ClientConnection, position: int, sent_end: bool) -> None:
        while True:
            while position < self._audio_end:
                start = max(position, self._kept_from) - self._kept_from
                chunk = bytes(self._audio[start : start + 32_000])
                if (wait_s := self._budget.wait_s(len(chunk))) > 0:
                    await asyncio.sleep(wait_s)
                    continue  # the kept audio may have moved on meanwhile
                self._budget.spend(len(chunk))
                await conn.send(chunk)
                position = max(position, self._kept_from) + len(chunk)
            if self._source_done:
                break
            self._more.clear()
            await self._more.wait()
        if not sent_end:
            await conn.send(json.dumps({"type": "end"}))

    async def _receive(self, conn: ClientConnection) -> None:
        while True:
            message = await self._next(conn)
            kind = message.get("type")
            if kind == "final":
                segment = int(message["segment"])
                if segment < self._next_segment:
                    continue  # replayed, and already reported
                self._next_segment = segment + 1
                end_ms = message["end_ms"]
                self._covered = self._clock_offset_bytes(end_ms) + self._bytes_at_ms(end_ms)
                self._on_message(self._continuous(message))
                # The daemon may already be closing (`done` follows): a lost ack only means
                # a longer replay after a resume, which `since` trims anyway.
                with contextlib.suppress(ConnectionClosed):
                    await conn.send(json.dumps({"type": "ack", "segment": segment}))
                continue
            if kind == "error":
                if message.get("code") in _RESUMABLE_ERRORS:
                    raise _Dropped(str(message["code"]))
                self._fail(message)
            self._on_message(self._continuous(message))
            if kind == "done":
                return

    def _clock_offset_bytes(self, ms: int) -> int:
        """Source bytes the current session's clock does not count up to its stream time `ms`:
        the audio before the session, and any that a resume skipped before `ms`."""
        skipped = sum(nbytes for at_ms, nbytes in self._skips if ms > at_ms)
        return (self._session_base or 0) + skipped

    def _continuous(self, message: Message) -> Message:
        """A message of a later session (an earlier one could not be resumed), or one after a
        resume that skipped audio, with segment numbers and times that go on from the earlier
        ones', on the source's clock, as one transcript."""
        if not (self._earlier_segments or self._session_base or self._skips):
            return message
        shifted = dict(message)
        for key in ("segment", "segments"):  # a final's number; `done`'s count
            if key in shifted:
                shifted[key] += self._earlier_segments
        for key in ("start_ms", "end_ms", "audio_ms"):
            if key in shifted:
                shifted[key] += self._clock_offset_bytes(shifted[key]) * 1000 // self._bytes_per_s
        return shifted

    async def _next(self, conn: ClientConnection) -> Message:
        try:
            while isinstance(raw := await conn.recv(), bytes):
                pass
        except ConnectionClosed as exc:
            raise _Dropped(f"close {exc.rcvd.code if exc.rcvd else 1006}") from exc
        message: Message = json.loads(raw)
        return message

    def _fail(self, message: Message) -> None:
        self._on_message(message)
        raise StreamError(f"{message.get('code')}: {message.get('message')}")


def _raise_if_failed(task: asyncio.Task[None]) -> None:
    if task.done() and task.exception() is not None:
        task.result()


async def paced_chunks(samples: npt.NDArray[np.float32], speed: float) -> AsyncIterator[bytes]:
    """100 ms PCM chunks, on the schedule of real time divided by `speed` (0: at once)."""
    chunk = SAMPLE_RATE_HZ * CHUNK_MS // 1000
    started = time.monotonic()
    for i, start in enumerate(range(0, len(samples), chunk)):
        if speed > 0:
            due = started + i * CHUNK_MS / 1000 / speed
            await asyncio.sleep(max(0.0, due - time.monotonic()))
        yield to_pcm_s16le(samples[start : start + chunk])


async def stream_samples(
    url: str,
    samples: npt.NDArray[np.float32],
    *,
    speed: float = 1.0,
    on_message: Callable[[Message], None],
    retry_for_s: float = 300.0,
    fresh_resend_s: float = FRESH_RESEND_S,
    max_send_speed: float = MAX_SEND_SPEED,
) -> None:
    """Stream `samples` (16 kHz mono) and report every message; raises StreamError on errors.
    The whole file is kept for resends: at `speed` 0 it is all read before the daemon has
    taken much of it."""
    stream = Stream(
        url,
        sample_rate_hz=SAMPLE_RATE_HZ,
        on_message=on_message,
        retry_for_s=retry_for_s,
        keep_audio_s=max(120.0, len(samples) / SAMPLE_RATE_HZ + 1),
        fresh_resend_s=fresh_resend_s,
        max_send_speed=max_send_speed,
    )
    await stream.run(paced_chunks(samples, speed))
