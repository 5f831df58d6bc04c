"""Daemon-captured sources: each `[[sources]]` microphone feeds a StreamSession the daemon owns,
whose captions go to every viewer of /v1/captions?source=NAME (sources/broadcast.py).

Event-loop thread only. Each device is captured by a child process (sources/capture.py), started
anew for each try, so a microphone plugged in after start-up is found whatever the other
sources have open, and a stopped PulseAudio, which blocks PortAudio's calls, stops only its
sources: nothing here waits on PortAudio. The session is touched here alone. The decodes go
through the shared InferenceScheduler like any client stream's. A missing, vanished or
failing device (any error of the audio input) is a logged state
(`waiting_for_device`, visible to viewers) and a retry with backoff. While the decodes are more
than `[server] max_buffered_s` behind, incoming audio is dropped (a microphone cannot be made to
wait the way a client's socket is). With a journal, each source's finals are journaled before
viewers get them, one journal session per source and daemon run, named by the run's id.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import AsyncGenerator, Callable

import numpy as np

from captiond.config import Config, SourceConfig
from captiond.decoding.scheduler import Decoder
from captiond.engines.base import EngineRequest, EngineResult
from captiond.engines.rules import token_counter
from captiond.errors import EngineFailedError
from captiond.journal.writer import Journal, SessionJournal
from captiond.samples import Samples
from captiond.sources.broadcast import Broadcast
from captiond.sources.capture import microphone
from captiond.streaming.audio import Resampler
from captiond.streaming.events import Control, Done, Final, SourceStatus, daemon_stream_params
from captiond.streaming.pump import drive_session
from captiond.streaming.session import SessionState, StreamSession
from captiond.streaming.vad import Vad
from captiond.whisper import SAMPLE_RATE_HZ

log = logging.getLogger(__name__)

# Blocks of (sample rate in Hz, mono float32 samples); an exception (OSError, or whatever the
# audio library raises) when the device fails. Closed (aclose) when the source is done with it.
AudioInput = Callable[[SourceConfig], AsyncGenerator[tuple[int, Samples], None]]
CAPTURING, WAITING, STOPPED = "capturing", "waiting_for_device", "stopped"
# What a failed decode counts as: nothing was said (the session's filter drops it).
_NOTHING = EngineResult(text="", no_speech_prob=1.0, avg_logprob=-10.0)


class DaemonSource:
    """One source: capture → resample → its StreamSession → decoder → broadcast."""

    def __init__(
        self,
        *,
        source: SourceConfig,
        config: Config,
        decoder: Decoder,
        vad: Vad,
        audio_input: AudioInput = microphone,
        retry_s: tuple[float, float] = (1.0, 30.0),
    ) -> None:
        self.name = source.name
        # This run of the source: its segments count from 0, and a viewer's `since` from an
        # earlier run (before a restart) means nothing in it.
        self.run = uuid.uuid4().hex[:12]
        self.broadcast = Broadcast(backlog_finals=source.backlog_finals)
        self.state = STOPPED
        self._source = source
        self._decoder = decoder
        self._audio_input = audio_input
        self._retry_s = retry_s
        engine = decoder.engine_info
        self._session = StreamSession(
            config=config,
            vad=vad,
            params=daemon_stream_params(engine.stream_language(config.stream.language)),
            count_tokens=token_counter(engine.tokenizer_path),
        )
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._journal: SessionJournal | None = None
        self._max_buffered_samples = round(config.server.max_buffered_s * SAMPLE_RATE_HZ)
        self._dropped_samples: int | None = None  # since decodes fell behind; None: they are not
        # The device's rate and its converter to 16 kHz (None at 16 kHz), for the open device.
        self._rate_hz = 0
        self._resampler: Resampler | None = None
        self._stopping = False

    def start(self, journal: Journal | None = None) -> None:
        if journal is not None:
            engine = self._decoder.engine_info
            self._journal = journal.open_session(
                session=self.run,
                peer="daemon",
                source=self.name,
                language=self._session.params.language,
                model=engine.model_name,
                engine=engine.name,
            )
        self._tasks = [
            asyncio.create_task(self._capture(), name=f"source-{self.name}-capture"),
            asyncio.create_task(self._pump(), name=f"source-{self.name}-pump"),
        ]

    async def stop(self) -> None:
        """Stop capturing, decode and send the last utterance, then end every viewer's feed."""
        if not self._tasks:
            return
        capture, pump = self._tasks
        # Stopped, it touches the session no more: cancelled at its await, or, should an audio
        # input swallow the cancellation, at its next block. It is waited for last: its
        # device's close may hang with the audio server, and the last final must not.
        self._stopping = True
        capture.cancel()
        try:
            if self._session.state is SessionState.STREAMING:
                self._end_utterance(Control.END)
                await self._deliver()
                self._wake.set()
            await pump
        except Exception:  # shutdown goes on: the journal's end, the viewers' close
            log.exception("source %s: its decodes failed", self.name)
        finally:
            pump.cancel()
            self._tasks = []
            self._set_state(STOPPED, "the daemon is shutting down")
            self.broadcast.close()
            if self._journal is not None:
                await self._journal.close(
                    audio_ms=self._session.audio_ms,
                    segments=self._session.segments,
                    close_code=1001,
                )
            # Not `await capture`: that would swallow a cancellation of stop itself (the
            # shutdown's drain timeout) along with the capture's own.
            await asyncio.wait({capture})
            if not capture.cancelled() and (error := capture.exception()) is not None:
                log.error("source %s: its capture failed: %r", self.name, error)

    # -- internals ---------------------------------------------------------------------------

    def _set_state(self, state: str, message: str) -> None:
        self.state = state
        status = SourceStatus(name=self.name, run=self.run, state=state, message=message)
        self.broadcast.publish(status)

    async def _deliver(self) -> None:
        for message in self._session.take_messages():
            if isinstance(message, Final) and self._journal is not None:
                await self._journal.record_final(message)
            if not isinstance(message, Done):  # viewers learn of the end from the state
                self.broadcast.publish(message)

    def _flush_resampler(self) -> None:
        """Into the session, the samples the resampler still holds: soxr keeps its filter's
        delay back (21-66 ms by the rate), which the utterance that ends now must get."""
        if self._resampler is not None:
            self._session.receive_samples(
                self._resampler.process(np.zeros(0, np.float32), last=True)
            )
            self._resampler = Resampler(self._rate_hz)  # a flushed stream takes no more

    def _end_utterance(self, control: Control) -> None:
        """FINALIZE or END the session, with all the audio the device gave."""
        self._flush_resampler()
        self._session.receive_control(control)

    def _receive(self, block_rate_hz: int, block: Samples) -> None:
        if block_rate_hz != self._rate_hz:
            self._flush_resampler()
            self._rate_hz = block_rate_hz
            self._resampler = Resampler(block_rate_hz) if block_rate_hz != SAMPLE_RATE_HZ else None
            self._set_state(CAPTURING, f"capturing at {block_rate_hz} Hz")
        if self._session.buffered_samples > self._max_buffered_samples:
            # Decodes are behind (a wedged or overloaded engine). A client stream is no longer
            # read (server/connection.py) and waits; a microphone cannot, so its audio is dropped:
            # memory stays bounded, and a recovering engine captions what is said now, not
            # what was said an hour ago.
            if self._dropped_samples is None:
                log.warning(
                    "source %s: decodes are over %.0f s behind ([server] max_buffered_s): "
                    "dropping its audio until they catch up",
                    self.name,
                    self._max_buffered_samples / SAMPLE_RATE_HZ,
                )
                self._dropped_samples = 0
                # The utterance in progress ends where its audio stops: what comes after the
                # gap is not the same speech.
                self._end_utterance(Control.FINALIZE)
            self._dropped_samples += round(len(block) * SAMPLE_RATE_HZ / block_rate_hz)
            return
        if self._dropped_samples is not None:
            log.warning(
                "source %s: decodes caught up; %.1f s of its audio was dropped",
                self.name,
                self._dropped_samples / SAMPLE_RATE_HZ,
            )
            self._dropped_samples = None
        self._session.receive_samples(
            self._resampler.process(block) if self._resampler is not None else block
        )

    async def _capture(self) -> None:
        delay_s = self._retry_s[0]
        while not self._stopping:
            self._rate_hz, self._resampler = 0, None
            try:
                async with contextlib.aclosing(self._audio_input(self._source)) as blocks:
                    async for block_rate_hz, block in blocks:
                        if self._stopping:
                            return
                        self._receive(block_rate_hz, block)
                        delay_s = self._retry_s[0]
                        await self._deliver()
                        if self._session.needs_pump:
                            self._wake.set()
                raise OSError("the audio input ended")
            except Exception as exc:  # any device error: PortAudio's, for one, is no OSError
                if self._stopping:
                    return
                log.warning(
                    "source %s: %s; retrying in %.0f s",
                    self.name,
                    exc if isinstance(exc, OSError) else f"{type(exc).__name__}: {exc}",
                    delay_s,
                )
                # The utterance in progress ends here: decode it rather than wait for the device.
                self._end_utterance(Control.FINALIZE)
                await self._deliver()
                self._wake.set()
                self._set_state(WAITING, f"{exc}; retrying in {delay_s:.0f} s")
            await asyncio.sleep(delay_s)
            delay_s = min(2 * delay_s, self._retry_s[1])

    async def _pump(self) -> None:
        """Run the session's decodes one at a time until it is done (after `stop`)."""

        decode = self._decoder.stream(f"source-{self.name}")

        async def submit(request: EngineRequest) -> EngineResult:
            try:
                return await decode(request)
            except EngineFailedError as exc:
                log.error("source %s: decode failed, dropped: %s", self.name, exc)
                return _NOTHING

        await drive_session(self._session, submit, self._wake, self._deliver)


def daemon_sources(
    config: Config,
    decoder: Decoder,
    vad_factory: Callable[[], Vad],
    audio_input: AudioInput = microphone,
) -> dict[str, DaemonSource]:
    return {
        source.name: DaemonSource(
            source=source,
            config=config,
            decoder=decoder,
            vad=vad_factory(),
            audio_input=audio_input,
        )
        for source in config.sources
    }
