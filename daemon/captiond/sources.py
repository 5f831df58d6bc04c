"""Daemon-captured sources: each `[[sources]]` microphone feeds a StreamSession the daemon owns,
whose captions go to every viewer of /v1/captions?source=NAME (broadcast.py).

Event-loop thread only. The capture (captiond_client.mic) runs PortAudio's callback on its audio
thread, and that callback only hands blocks to this loop; the session is touched here alone. The
decodes go through the shared InferenceScheduler like any client stream's. A missing or vanished
device is a logged state (`waiting_for_device`, visible to viewers) and a retry with backoff.
With a journal, each source's finals are journaled before viewers get them, one journal session
per source and daemon run.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import AsyncIterator, Callable

from captiond import SAMPLE_RATE_HZ
from captiond.audio import Resampler, Samples
from captiond.broadcast import Broadcast
from captiond.config import Config, SourceConfig
from captiond.engines import EngineResult
from captiond.errors import EngineFailedError
from captiond.journal import Journal, JournalError, SessionJournal
from captiond.protocol import Control, Done, Final, SourceStatus, StreamParams
from captiond.scheduler import Decoder, drive_session
from captiond.session import DecodeRequest, SessionState, StreamSession
from captiond.vad import Vad

log = logging.getLogger(__name__)

# Blocks of (sample rate in Hz, mono float32 samples); OSError when the device fails.
AudioInput = Callable[[SourceConfig], AsyncIterator[tuple[int, Samples]]]
CAPTURING, WAITING, STOPPED = "capturing", "waiting_for_device", "stopped"
# What a failed decode counts as: nothing was said (the session's filter drops it).
_NOTHING = EngineResult(text="", no_speech_prob=1.0, avg_logprob=-10.0)


async def microphone(source: SourceConfig) -> AsyncIterator[tuple[int, Samples]]:
    """The production AudioInput: the configured device at its own rate, via sounddevice."""
    from captiond_client.mic import capture, find_device

    device = find_device(source.device)
    rate_hz = device.default_rate_hz
    log.info("source %s: device %d %r at %d Hz", source.name, device.index, device.name, rate_hz)
    async for block in capture(device, channel=source.channel):
        yield rate_hz, block


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
        self.broadcast = Broadcast(backlog_finals=source.backlog_finals)
        self.state = STOPPED
        self._source = source
        self._decoder = decoder
        self._audio_input = audio_input
        self._retry_s = retry_s
        self._session = StreamSession(
            config=config, vad=vad, params=StreamParams(language=config.stream.language)
        )
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._journal: SessionJournal | None = None

    def start(self, journal: Journal | None = None) -> None:
        if journal is not None:
            engine = self._decoder.engine_info
            self._journal = journal.open_session(
                session=uuid.uuid4().hex[:12],
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
        capture.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await capture
        try:
            if self._session.state is SessionState.STREAMING:
                self._session.receive_control(Control.END)
                await self._deliver()
                self._wake.set()
            await pump
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

    # -- internals ---------------------------------------------------------------------------

    def _set_state(self, state: str, message: str) -> None:
        self.state = state
        self.broadcast.publish(SourceStatus(name=self.name, state=state, message=message))

    async def _deliver(self) -> None:
        for message in self._session.take_messages():
            if isinstance(message, Final) and self._journal is not None:
                try:
                    await self._journal.append_final(message)
                except JournalError as exc:
                    log.error("source %s: journal failed, no longer journaled: %s", self.name, exc)
                    self._journal = None
            if not isinstance(message, Done):  # viewers learn of the end from the state
                self.broadcast.publish(message)

    async def _capture(self) -> None:
        delay_s = self._retry_s[0]
        while True:
            rate_hz = 0
            resampler: Resampler | None = None
            try:
                async for block_rate_hz, block in self._audio_input(self._source):
                    if block_rate_hz != rate_hz:
                        rate_hz = block_rate_hz
                        resampler = Resampler(rate_hz) if rate_hz != SAMPLE_RATE_HZ else None
                        self._set_state(CAPTURING, f"capturing at {rate_hz} Hz")
                        delay_s = self._retry_s[0]
                    self._session.receive_samples(
                        resampler.process(block) if resampler is not None else block
                    )
                    await self._deliver()
                    if self._session.needs_pump:
                        self._wake.set()
                raise OSError("the audio input ended")
            except OSError as exc:
                log.warning("source %s: %s; retrying in %.0f s", self.name, exc, delay_s)
                # The utterance in progress ends here: decode it rather than wait for the device.
                self._session.receive_control(Control.FINALIZE)
                await self._deliver()
                self._wake.set()
                self._set_state(WAITING, f"{exc}; retrying in {delay_s:.0f} s")
            await asyncio.sleep(delay_s)
            delay_s = min(2 * delay_s, self._retry_s[1])

    async def _pump(self) -> None:
        """Run the session's decodes one at a time until it is done (after `stop`)."""

        decode = self._decoder.stream(f"source-{self.name}")

        async def submit(request: DecodeRequest) -> EngineResult:
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
