"""Deepgram's live API, `/v1/listen` (dialects/deepgram.py), through Deepgram's own SDK.

Every stream here is `deepgram-sdk` (pinned in the test extra), unmodified, against a real daemon
on a free port; the SDK is synchronous, so it runs in a thread while the daemon runs in the
event loop. Every message the SDK gets is validated strictly against the SDK's pydantic model
(the SDK itself builds them without validation), so a field the model requires cannot be missing.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import re
import threading
import time
import tracemalloc
from collections.abc import Callable
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import numpy as np
import pytest
import websockets.sync.client
from daemon_harness import (
    RATE,
    RecordingEngine,
    make_config,
    ready,
    running_daemon,
    stream_pcm,
    timed_words,
    tone_bursts,
    url,
)
from deepgram import DeepgramClient
from deepgram.core.api_error import ApiError
from deepgram.environment import DeepgramClientEnvironment
from deepgram.listen.v1.socket_client import V1SocketClient
from deepgram.listen.v1.types import (
    ListenV1Configure,
    ListenV1ConfigureFailure,
    ListenV1ConfigureSuccess,
    ListenV1Error,
    ListenV1KeepAlive,
    ListenV1Metadata,
    ListenV1Results,
    ListenV1SpeechStarted,
    ListenV1UtteranceEnd,
)
from deepgram.types.error_response_legacy_error import ErrorResponseLegacyError
from pydantic import BaseModel
from testkit import read_wav_int16
from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.http11 import Response

from captiond.config import Config
from captiond.dialects.deepgram import DeepgramDialect
from captiond.dialects.native import Query
from captiond.engines.base import Engine, EngineInfo
from captiond.errors import BadAudioError, BadMessageError
from captiond.streaming.events import Control, Final, Partial, SpeechStopped, TurnParams

FAST = make_config(server={"max_audio_speed": 1e6})
LINEAR16: dict[str, Any] = {"encoding": "linear16", "sample_rate": RATE}


class Inbox:
    """What the SDK receives, read on a thread of its own (as an application would), so that
    sending never waits on unread replies."""

    def __init__(self, socket: V1SocketClient) -> None:
        self.messages: list[Any] = []
        self.close_code: int | None = None
        self.close_reason = ""
        self._changed = threading.Condition()
        self._thread = threading.Thread(target=self._read, args=(socket,), daemon=True)
        self._thread.start()

    def _read(self, socket: V1SocketClient) -> None:
        while True:
            try:
                message = socket.recv()
            except ConnectionClosed as exc:
                self.close_code = exc.rcvd.code if exc.rcvd else 1006
                self.close_reason = exc.rcvd.reason if exc.rcvd else ""
                break
            # Strict: every field the SDK's model requires is there, with its type.
            assert isinstance(message, BaseModel), f"a message the SDK does not know: {message}"
            type(message).model_validate(message.model_dump(exclude_unset=True))
            with self._changed:
                self.messages.append(message)
                self._changed.notify_all()
        with self._changed:
            self._changed.notify_all()

    def wait_for(self, found: Callable[[Any], bool], timeout_s: float = 20.0) -> Any:
        with self._changed:
            assert self._changed.wait_for(
                lambda: any(map(found, self.messages)) or self.close_code is not None, timeout_s
            )
        return next(m for m in self.messages if found(m))

    def join(self) -> None:
        self._thread.join(30)
        assert not self._thread.is_alive()


@dataclass
class Run:
    messages: list[Any]
    close_code: int | None
    close_reason: str = ""

    def of(self, kind: type[BaseModel]) -> list[Any]:
        return [m for m in self.messages if isinstance(m, kind)]

    @property
    def finals(self) -> list[ListenV1Results]:
        return [m for m in self.of(ListenV1Results) if m.is_final]

    @property
    def transcript(self) -> str:
        texts = (m.channel.alternatives[0].transcript for m in self.finals)
        return " ".join(t for t in texts if t)


@dataclass
class Script:
    """Audio sent as `send_media` chunks (optionally paced), then CloseStream."""

    audio: bytes
    chunk_bytes: int = 3200
    pause_s: float = 0.0

    def __call__(self, socket: V1SocketClient, inbox: Inbox) -> None:
        for start in range(0, len(self.audio), self.chunk_bytes):
            socket.send_media(self.audio[start : start + self.chunk_bytes])
            time.sleep(self.pause_s)
        socket.send_close_stream()


def client(port: int, **auth: str) -> DeepgramClient:
    host = f"127.0.0.1:{port}"
    environment = DeepgramClientEnvironment(
        base=f"http://{host}", production=f"ws://{host}", agent=f"ws://{host}", agent_rest=""
    )
    return DeepgramClient(environment=environment, **(auth or {"api_key": "any"}))


def listen(
    port: int,
    script: Callable[[V1SocketClient, Inbox], None],
    options: dict[str, Any],
    auth: dict[str, str] | None = None,
) -> Run:
    """One SDK stream (on the calling thread): `script` sends, the inbox reads until close."""
    with client(port, **(auth or {})).listen.v1.connect(model="nova-3", **options) as socket:
        inbox = Inbox(socket)
        script(socket, inbox)
        inbox.join()
    return Run(inbox.messages, inbox.close_code, inbox.close_reason)


def run_with_daemon(
    config: Config, work: Callable[[int], Any], engine: Engine | None = None
) -> Any:
    async def scenario() -> Any:
        async with running_daemon(config, engine=engine) as daemon:
            return await asyncio.to_thread(work, daemon.port)

    return asyncio.run(scenario())


def resample(pcm: np.ndarray, rate_hz: int) -> np.ndarray:
    import soxr

    out = soxr.resample(pcm.astype(np.float32) / 32768, RATE, rate_hz)
    resampled: np.ndarray = np.clip(np.round(out * 32768), -32768, 32767).astype("<i2")
    return resampled


def stereo(pcm: np.ndarray) -> bytes:
    return np.repeat(pcm, 2).astype("<i2").tobytes()  # the same samples on both channels


# -- the real model ----------------------------------------------------------------------------


@pytest.mark.model
def test_sdk_transcript_equals_native_finals(speech_dir: Path, tiny_en: Engine) -> None:
    """A real clip at 44.1 kHz in stereo (the SDK's chunks split sample frames): the SDK's
    committed text is captiond's own finals of the same samples, mono, over /v1/stream."""
    rate_hz = 44_100
    pcm = resample(read_wav_int16(speech_dir / "utt" / "jfk_inaugural_1961.wav"), rate_hz)
    options = {"encoding": "linear16", "sample_rate": rate_hz, "channels": 2, "punctuate": True}

    async def scenario() -> tuple[Run, str]:
        async with running_daemon(FAST, engine=tiny_en, vad_factory=None) as daemon:
            native = await stream_pcm(url(daemon, query=f"sample_rate={rate_hz}"), pcm, 4410)
            script = Script(stereo(pcm), chunk_bytes=7001)
            run = await asyncio.to_thread(listen, daemon.port, script, options)
        finals = " ".join(m["text"] for m in native.of("final") if m["text"])
        return run, finals

    run, native_text = asyncio.run(scenario())
    assert run.close_code == 1000
    words = " ".join(re.sub(r"[^\w\s']", "", run.transcript.lower()).split())
    assert "ask not what your country can do for you" in words
    assert run.transcript == native_text
    assert all(m.speech_final and not m.from_finalize for m in run.finals)
    metadata = run.of(ListenV1Metadata)
    assert metadata == [run.messages[-1]]
    assert metadata[0].channels == 2
    assert metadata[0].sha256 == hashlib.sha256(stereo(pcm)).hexdigest()


@pytest.mark.model
def test_keyterm_is_the_native_streams_prompt(speech_dir: Path, tiny_en: Engine) -> None:
    """A name the bundled model mishears alone, given as a `keyterm`: the SDK's transcript
    has it, and is captiond's own finals with `?prompt=` that name."""
    pcm = read_wav_int16(speech_dir / "utt" / "cmu_arctic_aew_a0001.wav")
    pcm = np.concatenate([pcm, np.zeros(RATE, "<i2")])
    name = "Philip Steels"
    options = {**LINEAR16, "punctuate": True, "keyterm": [name]}

    async def scenario() -> tuple[Run, str]:
        async with running_daemon(FAST, engine=tiny_en, vad_factory=None) as daemon:
            query = f"prompt={name.replace(' ', '+')}"
            native = await stream_pcm(url(daemon, query=query), pcm)
            run = await asyncio.to_thread(listen, daemon.port, Script(pcm.tobytes()), options)
        return run, " ".join(m["text"] for m in native.of("final") if m["text"])

    run, native_text = asyncio.run(scenario())
    assert name in run.transcript
    assert run.transcript == native_text


# -- the fake engine ---------------------------------------------------------------------------


def test_interim_results_vad_events_and_utterance_end() -> None:
    """Paced audio with every event asked for: interim Results (is_final false) before each
    segment's one final (is_final and speech_final: a VAD endpoint), SpeechStarted before them,
    UtteranceEnd after, Metadata last; a final's words carry the engine's times (the fake's
    words are 250 ms each, by construction), interim results none."""
    pcm = tone_bursts([2.0, 1.5])
    options = {**LINEAR16, "interim_results": True, "vad_events": True, "utterance_end_ms": 1000}
    script = Script(pcm.tobytes(), chunk_bytes=3200, pause_s=0.02)
    run: Run = run_with_daemon(FAST, lambda port: listen(port, script, options))
    assert run.close_code == 1000
    kinds = [type(m).__name__.removeprefix("ListenV1") for m in run.messages]
    assert kinds[-1] == "Metadata" and kinds.count("Metadata") == 1
    finals = run.finals
    assert len(finals) == 2 and run.transcript
    interims = [m for m in run.of(ListenV1Results) if not m.is_final]
    assert interims, "paced audio gives partials"
    assert all(not m.speech_final and not m.from_finalize for m in interims)
    for final in finals:
        assert final.is_final and final.speech_final and not final.from_finalize
        at = run.messages.index(final)
        before = run.messages[:at]
        # This segment's interims (same start) all came before its final, none after.
        assert not [m for m in run.messages[at + 1 :] if m in interims and m.start == final.start]
        started = [m for m in before if isinstance(m, ListenV1SpeechStarted)]
        assert started and started[-1].timestamp == final.start
        end = run.messages[at + 1]
        assert isinstance(end, ListenV1UtteranceEnd)
        words = final.channel.alternatives[0].words
        assert " ".join(w.word for w in words) == final.channel.alternatives[0].transcript
        assert words[-1].end == end.last_word_end <= round(final.start + final.duration, 3)
        assert final.start <= words[0].start
        assert all(a.end <= b.start for a, b in pairwise(words))
        # Measured, not spread: the fake's words are 250 ms with confidence 1.0. A stable word
        # the final's decode did not write (the fake drops one after its context) has no time
        # of its own (zero length, confidence 0.0), and a word past the segment's end is cut
        # at it (zero length).
        spans = {(round(w.end - w.start, 3), w.confidence) for w in words}
        assert (0.25, 1.0) in spans and spans <= {(0.25, 1.0), (0.0, 0.0), (0.0, 1.0)}
    assert all(not m.channel.alternatives[0].words for m in interims)  # partials: not aligned
    metadata = run.messages[-1]
    assert metadata.duration == pytest.approx(len(pcm) / RATE)
    assert metadata.channels == 1 and metadata.sha256 == hashlib.sha256(pcm.tobytes()).hexdigest()
    assert metadata.request_id == finals[0].metadata.request_id


def test_speech_cut_at_the_cap_is_not_an_endpoint() -> None:
    """Speech that runs past `max_utterance_s` (here 4 s) is cut into finals, but the speaker
    did not stop: `speech_final` false and no UtteranceEnd or SpeechStarted at a cut (a voice
    agent would answer a monologue mid-sentence); only its real end is an endpoint."""
    config = make_config(
        server={"max_audio_speed": 1e6}, stream={"max_utterance_s": 4.0, "cut_search_s": 1.0}
    )
    options = {**LINEAR16, "vad_events": True, "utterance_end_ms": 1000}
    run: Run = run_with_daemon(
        config, lambda port: listen(port, Script(tone_bursts([10.0]).tobytes()), options)
    )
    finals = run.finals
    assert len(finals) >= 3
    assert [f.speech_final for f in finals] == [False] * (len(finals) - 1) + [True]
    assert len(run.of(ListenV1SpeechStarted)) == 1
    (end,) = run.of(ListenV1UtteranceEnd)
    assert run.messages.index(end) == run.messages.index(finals[-1]) + 1


def test_only_finals_by_default() -> None:
    """Without interim_results, vad_events and utterance_end_ms: finals and Metadata only."""
    script = Script(tone_bursts([1.5, 1.0]).tobytes(), pause_s=0.02)
    run: Run = run_with_daemon(FAST, lambda port: listen(port, script, LINEAR16))
    assert [type(m) for m in run.messages] == [ListenV1Results, ListenV1Results, ListenV1Metadata]
    assert all(m.is_final and m.speech_final for m in run.finals)


@pytest.mark.parametrize("rate_hz", [16_000, 48_000])
def test_keepalive_finalize_and_close_stream(rate_hz: int) -> None:
    """KeepAlive says nothing; Finalize commits the open utterance where the stream stands
    (from_finalize, not speech_final) and the stream goes on; CloseStream flushes the last one,
    sends Metadata and closes 1000."""
    speech = resample(tone_bursts([2.0], gap_s=0.0), rate_hz).tobytes()
    more = resample(tone_bursts([1.0], gap_s=0.0), rate_hz).tobytes()

    def script(socket: V1SocketClient, inbox: Inbox) -> None:
        socket.send_media(speech)
        socket.send_keep_alive()
        socket.send_finalize()
        forced = inbox.wait_for(lambda m: isinstance(m, ListenV1Results))
        assert forced.from_finalize and forced.is_final and not forced.speech_final
        assert forced.start + forced.duration == pytest.approx(2.5, abs=0.1)
        socket.send_keep_alive()
        socket.send_media(more)  # speech that is open when the stream is closed
        socket.send_close_stream()

    options = {**LINEAR16, "sample_rate": rate_hz}
    run: Run = run_with_daemon(FAST, lambda port: listen(port, script, options))
    assert run.close_code == 1000
    assert [type(m) for m in run.messages] == [ListenV1Results, ListenV1Results, ListenV1Metadata]
    forced, last = run.finals
    assert forced.from_finalize and not last.from_finalize and last.speech_final
    assert forced.channel.alternatives[0].transcript and last.channel.alternatives[0].transcript
    assert last.start >= forced.start + forced.duration
    assert run.messages[-1].duration == pytest.approx(4.0, abs=0.05)


def test_an_empty_binary_message_closes_the_stream() -> None:
    """Deepgram's legacy close: an empty binary message is CloseStream."""

    def script(socket: V1SocketClient, inbox: Inbox) -> None:
        socket.send_media(tone_bursts([1.0]).tobytes())
        socket.send_media(b"")

    run: Run = run_with_daemon(FAST, lambda port: listen(port, script, LINEAR16))
    assert [type(m) for m in run.messages] == [ListenV1Results, ListenV1Metadata]
    assert run.close_code == 1000


def test_stereo_and_resampled_audio_match_mono() -> None:
    """channels=2 at 48 kHz, sent in chunks that split sample frames: the same finals, at the
    same times, as the mono samples over /v1/stream."""
    pcm = resample(tone_bursts([1.0, 2.0, 0.5]), 48_000)
    # Punctuated, as the native finals are (the fake engine ends a sentence at a pause).
    options = {"encoding": "linear16", "sample_rate": 48_000, "channels": 2, "punctuate": True}

    # Audio pushed faster than real time: whether a pause's early final says the sentence
    # ended before 800 ms of the pause have arrived is a race (streaming/vad.py holds a pause at
    # most that long), which moved one stream's end_ms and not the other's. This test is about the
    # channels and the rate: the plain endpoint for both.
    config = dataclasses.replace(
        FAST, vad=dataclasses.replace(FAST.vad, unfinished_endpoint_silence_ms=500)
    )

    async def scenario() -> tuple[Run, list[dict[str, Any]]]:
        async with running_daemon(config) as daemon:
            native = await stream_pcm(url(daemon, query="sample_rate=48000"), pcm, 4800)
            script = Script(stereo(pcm), chunk_bytes=3001)
            run = await asyncio.to_thread(listen, daemon.port, script, options)
        return run, native.of("final")

    run, native = asyncio.run(scenario())
    assert len(native) == 3
    got = [(m.channel.alternatives[0].transcript, m.start, m.duration) for m in run.finals]
    want = [(m["text"], m["start_ms"] / 1000, (m["end_ms"] - m["start_ms"]) / 1000) for m in native]
    assert got == want


# -- authorization and errors ------------------------------------------------------------------


def test_api_key_and_access_token_are_accepted_and_a_wrong_key_is_refused() -> None:
    """`Token KEY` (api_key) and `Bearer KEY` (access_token) are let in; a wrong key gets
    HTTP 401 before the upgrade, as from Deepgram. The SDK means to raise ApiError(401) then;
    with websockets >= 14 its check catches the legacy exception class, so the handshake's
    own InvalidStatus comes through instead: either carries the 401."""
    config = make_config(auth={"token": "k"}, server={"max_audio_speed": 1e6})
    audio = tone_bursts([1.0]).tobytes()

    def work(port: int) -> tuple[Run, Run, int]:
        by_key = listen(port, Script(audio), LINEAR16, {"api_key": "k"})
        by_token = listen(port, Script(audio), LINEAR16, {"access_token": "k"})
        try:
            listen(port, Script(audio), LINEAR16, {"api_key": "wrong"})
        except ApiError as exc:
            return by_key, by_token, exc.status_code or 0
        except InvalidStatus as exc:
            return by_key, by_token, exc.response.status_code
        raise AssertionError("a wrong key was let in")

    by_key, by_token, status = run_with_daemon(config, work)
    assert by_key.transcript and by_key.transcript == by_token.transcript
    assert status == 401


def test_a_malformed_message_gets_a_schema_error_and_the_stream_goes_on() -> None:
    """An unknown message type is answered with Deepgram's Error shape; it does not end the
    stream."""

    def script(socket: V1SocketClient, inbox: Inbox) -> None:
        socket.send_keep_alive(ListenV1KeepAlive(type="KeepDead"))
        inbox.wait_for(lambda m: isinstance(m, ListenV1Error))
        Script(tone_bursts([1.0]).tobytes())(socket, inbox)

    run: Run = run_with_daemon(FAST, lambda port: listen(port, script, LINEAR16))
    (schema,) = run.of(ListenV1Error)
    assert schema.variant == "SchemaError" and "KeepDead" in (schema.message or "")
    assert run.transcript and isinstance(run.messages[-1], ListenV1Metadata)
    assert run.close_code == 1000


def test_a_timeout_is_named_in_the_close_reason_as_deepgram_names_it() -> None:
    """Deepgram's close frame carries its error's name as the reason ("NET-0001": no audio in
    time), which clients read to tell a timeout, worth a reconnect, from other closes. It was
    captiond's own error code, `idle_timeout`."""

    def script(socket: V1SocketClient, inbox: Inbox) -> None:
        inbox.wait_for(lambda m: isinstance(m, ListenV1Error), timeout_s=10)

    config = make_config(server={"idle_timeout_s": 0.5})
    run: Run = run_with_daemon(config, lambda port: listen(port, script, LINEAR16))
    (error,) = run.of(ListenV1Error)
    assert error.variant == "NET-0001"
    assert (run.close_code, run.close_reason) == (1011, "NET-0001")


def test_keyterms_prompt_every_decode_and_configure_replaces_them() -> None:
    """`keyterm` (repeated) is the stream's prompt; a Configure with `keyterms` replaces it from
    then on, one that changes formatting is refused whole; the stream goes on."""
    engine = RecordingEngine()
    burst = tone_bursts([1.0]).tobytes()

    def script(socket: V1SocketClient, inbox: Inbox) -> None:
        socket.send_media(burst)
        inbox.wait_for(lambda m: isinstance(m, ListenV1Results) and m.is_final)
        socket.send_configure(ListenV1Configure(keyterms=["Kubernetes"], features={"a": True}))
        inbox.wait_for(lambda m: isinstance(m, ListenV1ConfigureFailure))
        socket.send_configure(ListenV1Configure(keyterms=["Kubernetes"]))
        inbox.wait_for(lambda m: isinstance(m, ListenV1ConfigureSuccess))
        Script(burst)(socket, inbox)

    options = {**LINEAR16, "keyterm": ["Grafana", "customer service"]}
    run: Run = run_with_daemon(FAST, lambda port: listen(port, script, options), engine)
    (failure,) = run.of(ListenV1ConfigureFailure)
    assert failure.code == "CONFIGURE_INTERNAL_ERROR" and failure.request_id
    (success,) = run.of(ListenV1ConfigureSuccess)
    assert success.keyterms == ["Kubernetes"]
    assert len(run.finals) == 2 and run.close_code == 1000
    first = engine.prompts.index("Kubernetes.")
    assert set(engine.prompts[:first]) == {"Grafana, customer service."}
    assert set(engine.prompts[first:]) == {"Kubernetes."}


@pytest.mark.parametrize(
    "options",
    [
        {"encoding": "mulaw", "sample_rate": 8000},
        {"encoding": "linear16"},  # no sample_rate
        {**LINEAR16, "multichannel": True},
    ],
)
def test_a_stream_that_cannot_be_served_is_refused_before_the_upgrade(
    options: dict[str, Any],
) -> None:
    """As Deepgram does: HTTP 400 with the reason, no websocket (the SDK raises; see the
    401 test for why either exception may carry the status)."""

    def work(port: int) -> int:
        try:
            listen(port, lambda *_: None, options)
        except ApiError as exc:
            return exc.status_code or 0
        except InvalidStatus as exc:
            return exc.response.status_code
        raise AssertionError("the stream was opened")

    assert run_with_daemon(FAST, work) == 400


@pytest.mark.parametrize(
    ("auth", "query", "status", "err_code"),
    [
        ({}, {"encoding": "linear16"}, 400, "Bad Request"),  # no sample_rate
        ({"token": "k"}, LINEAR16, 401, "INVALID_AUTH"),
    ],
)
def test_a_refused_handshake_carries_deepgrams_error_body_and_headers(
    auth: dict[str, str], query: dict[str, Any], status: int, err_code: str
) -> None:
    """Deepgram's JSON error (the SDK's own model of it), repeated in `dg-error`, with the
    request's id in `dg-request-id`: what a client that does not use the SDK reads."""
    config = make_config(auth=auth, server={"max_audio_speed": 1e6})

    def work(port: int) -> Response:
        target = f"ws://127.0.0.1:{port}/v1/listen?{urlencode(query)}"
        with pytest.raises(InvalidStatus) as refused:
            websockets.sync.client.connect(target, additional_headers={"Authorization": "Token x"})
        return refused.value.response

    response = run_with_daemon(config, work)
    assert response.status_code == status
    assert response.headers.get_all("Content-Type") == ["application/json"]
    body = response.body.decode()
    error = ErrorResponseLegacyError.model_validate_json(body)
    assert error.err_code == err_code and error.err_msg
    assert error.request_id == response.headers["dg-request-id"]
    assert response.headers["dg-error"] == body


# -- the dialect alone -------------------------------------------------------------------------


def render_final(query: dict[str, str], text: str) -> dict[str, Any]:
    dialect = DeepgramDialect(
        Query(urlencode({**query, "encoding": "linear16", "sample_rate": 16000}))
    )
    dialect.render(ready())
    final = Final(segment=0, start_ms=1000, end_ms=3000, text=text, words=timed_words(text, 1000))
    (frame,) = dialect.render(final)
    result: dict[str, Any] = ListenV1Results.model_validate_json(frame).model_dump()
    return result


@pytest.mark.parametrize(
    ("language", "detected_among"), [("multi", ()), ("en,de", ("en", "de")), ("de", None)]
)
def test_language_multi_names_the_language_detected(
    language: str, detected_among: tuple[str, ...] | None
) -> None:
    """A list (not Deepgram's) detects among its languages: results name the one detected."""
    dialect = DeepgramDialect(Query(urlencode({**LINEAR16, "language": language})))
    params = dialect.stream_params("en")
    (frame,) = dialect.render(
        Final(
            segment=0,
            start_ms=0,
            end_ms=900,
            text="Guten Tag.",
            language="de",
            words=timed_words("Guten Tag.", 0),
        )
    )
    alternative = ListenV1Results.model_validate_json(frame).channel.alternatives[0]
    if detected_among is not None:
        assert params.auto_language and params.candidates == detected_among
        assert alternative.languages == ["de"]
        assert [w.language for w in alternative.words] == ["de", "de"]
    else:  # as Deepgram: only when the language is detected
        assert alternative.languages is None
        assert {w.language for w in alternative.words} == {None}


def test_words_without_punctuate_are_plain_and_carry_the_finals_times() -> None:
    plain = render_final({}, " Hello, world! Don't.")["channel"]["alternatives"][0]
    assert plain["transcript"] == "hello world don't"
    assert [(w["word"], w["start"], w["end"], w["confidence"]) for w in plain["words"]] == [
        ("hello", 1.0, 1.2, 0.8),
        ("world", 1.3, 1.3, 0.0),  # a word the decode did not write: no confidence to give
        ("don't", 1.6, 1.8, 0.8),
    ]
    assert plain["confidence"] == 0.8  # the mean of the words that have one
    assert all(w["punctuated_word"] is None for w in plain["words"])
    written = render_final({"punctuate": "true"}, " Hello, world! Don't.")
    alternative = written["channel"]["alternatives"][0]
    assert alternative["transcript"] == "Hello, world! Don't."
    assert [w["punctuated_word"] for w in alternative["words"]] == ["Hello,", "world!", "Don't."]
    assert render_final({"endpointing": "false"}, "a")["speech_final"] is False
    empty = render_final({}, "")["channel"]["alternatives"][0]
    assert empty == {**empty, "transcript": "", "confidence": 0.0, "words": []}


def test_the_words_of_a_chinese_sentence_are_its_characters() -> None:
    # A sentence without spaces is not one word: each character is one, as in stable text
    # (lang/text.py), and the transcript is written without spaces, as the final was.
    text = "加进38年\uff0c登进士。"  # a full-width comma after 年
    plain = render_final({}, text)["channel"]["alternatives"][0]
    assert plain["transcript"] == "加进38年登进士"
    assert [w["word"] for w in plain["words"]] == ["加", "进", "38", "年", "登", "进", "士"]
    written = render_final({"punctuate": "true"}, text)["channel"]["alternatives"][0]
    assert written["transcript"] == text
    assert [w["punctuated_word"] for w in written["words"]] == [
        *("加", "进", "38", "年\uff0c", "登", "进", "士。")
    ]


@pytest.mark.parametrize(
    ("stable", "between", "unstable", "transcript"),
    [
        ("我用", "", "Python写代码。", "我用Python写代码。"),
        ("สวัสดีครับ", " ", "ผมชื่อ", "สวัสดีครับ ผมชื่อ"),
        ("And so", " ", "my fellow", "And so my fellow"),
    ],
)
def test_an_interim_transcript_joins_the_partial_with_its_separator(
    stable: str, between: str, unstable: str, transcript: str
) -> None:
    query = {**LINEAR16, "interim_results": "true", "punctuate": "true"}
    dialect = DeepgramDialect(Query(urlencode(query)))
    dialect.render(ready())
    partial = Partial(
        segment=0,
        rev=1,
        start_ms=0,
        end_ms=900,
        stable=stable,
        separator=between,
        unstable=unstable,
    )
    (frame,) = dialect.render(partial)
    alternative = ListenV1Results.model_validate_json(frame).channel.alternatives[0]
    assert alternative.transcript == transcript


def test_a_finalize_is_recognised_where_the_stream_stood() -> None:
    """At 48 kHz too, an utterance closed by a Finalize ends where the client stood (the
    session drains the resampler's held-back audio into it); one closed by the VAD earlier is
    not from_finalize, nor is one closed after more audio."""
    dialect = DeepgramDialect(Query("encoding=linear16&sample_rate=48000"))
    dialect.stream_params("en")
    dialect.receive(np.zeros(48_000 * 2, "<i2").tobytes())  # 2 s
    assert dialect.receive('{"type": "Finalize"}').control is Control.FINALIZE

    def forced(end_ms: int) -> bool:
        dialect.render(SpeechStopped(end_ms=end_ms))
        (frame,) = dialect.render(Final(segment=0, start_ms=0, end_ms=end_ms, text="a"))
        return ListenV1Results.model_validate_json(frame).from_finalize is True

    assert not forced(1500)  # the VAD's, before the Finalize
    assert forced(2000)  # the flush
    assert not forced(2990)  # later audio's


def test_utterances_that_decoded_to_nothing_leave_nothing_behind() -> None:
    """Noise ends utterances (speech_stopped) that get no final: their ends go with the next
    final, not for as long as the stream lives."""
    dialect = DeepgramDialect(Query(urlencode(LINEAR16)))
    dialect.stream_params("en")
    for i in range(1_000):
        dialect.render(SpeechStopped(end_ms=10 * i))
    (frame,) = dialect.render(Final(segment=0, start_ms=0, end_ms=9_990, text="a"))
    assert ListenV1Results.model_validate_json(frame).speech_final
    assert not dialect._stopped_end_ms


def test_a_finalize_flood_holds_no_memory() -> None:
    """Finalize after Finalize with no speech (no final ever takes one back) once grew the
    dialect by 80 bytes a message for as long as the stream lived."""
    dialect = DeepgramDialect(Query("encoding=linear16&sample_rate=16000"))
    dialect.stream_params("en")
    sample = np.zeros(1, "<i2").tobytes()
    tracemalloc.start()
    try:
        before_bytes = tracemalloc.get_traced_memory()[0]
        for _ in range(20_000):
            dialect.receive(sample)
            dialect.receive('{"type": "Finalize"}')
            dialect.receive('{"type": "Finalize"}')
        grown_bytes = tracemalloc.get_traced_memory()[0] - before_bytes
    finally:
        tracemalloc.stop()
    assert grown_bytes < 100_000
    dialect.render(SpeechStopped(end_ms=1250))
    (frame,) = dialect.render(Final(segment=0, start_ms=0, end_ms=1250, text="a"))
    assert ListenV1Results.model_validate_json(frame).from_finalize is True, "the last one counts"


@pytest.mark.parametrize("channels", ["0", "9", "two", "²", "9" * 5000])
def test_a_bad_channel_count_is_refused_not_raised_on_connect(channels: str) -> None:
    dialect = DeepgramDialect(Query(urlencode({**LINEAR16, "channels": channels})))
    with pytest.raises(BadAudioError, match=r"channels must be 1\.\.8"):
        dialect.stream_params("en")


@pytest.mark.parametrize(
    ("language", "decoded", "variant"),
    [("zh-TW", "zh", "zh-TW"), ("zh-CN", "zh", "zh-Hans"), ("en-GB", "en", None)],
)
def test_deepgrams_language_tags_name_the_script_of_chinese(
    language: str, decoded: str, variant: str | None
) -> None:
    dialect = DeepgramDialect(Query(urlencode({**LINEAR16, "language": language})))
    params = dialect.stream_params("en")
    assert (params.language, params.chinese_variant) == (decoded, variant)


@pytest.mark.parametrize(
    ("known", "decoded", "variant"),
    [
        (frozenset({"zh", "yue"}), "yue", None),  # large-v3 on
        (frozenset({"zh"}), "zh", "zh-HK"),  # base: Cantonese as Chinese, in Hong Kong script
    ],
)
def test_zh_hk_is_cantonese_where_the_model_has_it(
    known: frozenset[str], decoded: str, variant: str | None
) -> None:
    """Deepgram's zh-HK is Cantonese (traditional characters), not Mandarin."""
    model = EngineInfo("fake", "large-v3" if "yue" in known else "base", True, 8, known)
    dialect = DeepgramDialect(Query(urlencode({**LINEAR16, "language": "zh-HK"})))
    params = dialect.stream_params("en", model.check_can)
    assert (params.language, params.chinese_variant) == (decoded, variant)


def test_diarize_gives_every_final_word_its_speaker() -> None:
    """`diarize=true` through the SDK: two voices (ToneEmbedder's tones) are speakers 0 and 1 on
    every word of their finals; without it, words have no speaker."""
    pcm = tone_bursts([1.5, 1.5, 1.5], gap_s=1.2, tones_hz=[300.0, 1_200.0, 300.0])
    options = {**LINEAR16, "punctuate": True}

    def work(port: int) -> tuple[Run, Run]:
        on = listen(port, Script(pcm.tobytes()), {**options, "diarize": True})
        off = listen(port, Script(pcm.tobytes()), options)
        return on, off

    on, off = run_with_daemon(FAST, work)
    said = [m for m in on.finals if m.channel.alternatives[0].words]
    assert [{w.speaker for w in m.channel.alternatives[0].words} for m in said] == [
        {0},
        {1},
        {0},
    ]
    assert all(w.speaker is None for m in off.finals for w in m.channel.alternatives[0].words or ())


def test_endpointing_in_milliseconds_ends_turns_at_that_silence() -> None:
    def turn(value: str | None) -> TurnParams:
        query = {**LINEAR16} | ({} if value is None else {"endpointing": value})
        return DeepgramDialect(Query(urlencode(query))).stream_params("en").turn

    assert turn(None) == turn("false") == turn("true") == TurnParams()
    assert turn("300") == TurnParams(
        end_of_turn="silence", endpoint_silence_ms=300, unfinished_endpoint_silence_ms=300
    )
    assert turn("10").endpoint_silence_ms == 30  # one VAD frame is the least there is
    with pytest.raises(BadMessageError, match="endpointing"):
        turn("soon")
