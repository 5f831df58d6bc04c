"""`/v3/ws`: AssemblyAI's own Python SDK (assemblyai==1.8.2, unmodified) against a real daemon.

The SDK is synchronous (a read and a write thread): each scenario runs in a worker thread
while the daemon runs in the test's event loop. The fake engine ("w0 w1 …") and tone bursts
stand in for speech except in the one real-model test.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import threading
import time
from collections.abc import Callable, Iterator
from itertools import pairwise
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import soxr
from assemblyai.streaming.v3 import (
    BeginEvent,
    Encoding,
    StreamingClient,
    StreamingClientOptions,
    StreamingError,
    StreamingEvents,
    StreamingParameters,
    StreamingSessionParameters,
    TerminationEvent,
    TurnEvent,
)
from daemon_harness import (
    RecordingEngine,
    make_config,
    ready,
    running_daemon,
    stream_pcm,
    timed_words,
    tone_bursts,
    url,
)
from testkit import read_wav_int16
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from captiond.dialects.assemblyai import AssemblyAIDialect
from captiond.engines.base import Engine, EngineInfo
from captiond.errors import (
    BadMessageError,
    EngineFailedError,
    FrameTooLargeError,
    OverloadedError,
    RateLimitedError,
)
from captiond.lang.languages import LanguageSetting
from captiond.streaming.events import Control, Error, Final, Partial, TurnParams

FAST = make_config(server={"max_audio_speed": 1e6})
RATE = 16_000


class Recorder:
    """Every event the SDK dispatches, in order, and a way to wait for one."""

    def __init__(self) -> None:
        self.events: list[Any] = []
        self._changed = threading.Condition()

    def attach(self, client: StreamingClient) -> None:
        for kind in StreamingEvents:
            client.on(kind, self._add)

    def _add(self, _client: StreamingClient, event: Any) -> None:
        with self._changed:
            self.events.append(event)
            self._changed.notify_all()

    def wait_for(self, test: Callable[[Any], bool], timeout_s: float = 20.0) -> Any:
        with self._changed:
            assert self._changed.wait_for(lambda: any(map(test, self.events)), timeout_s)
            return next(e for e in self.events if test(e))

    def of(self, kind: type) -> list[Any]:
        return [e for e in self.events if isinstance(e, kind)]


def sdk(port: int, key: str = "k") -> tuple[StreamingClient, Recorder]:
    # Generous timeouts: the machine may be busy, and the finals of a whole clip come before
    # Termination (the SDK gives up waiting for it after `terminate_timeout`, 5 s by default).
    options = StreamingClientOptions(
        api_key=key, api_host=f"ws://127.0.0.1:{port}", connect_timeout=10, terminate_timeout=60
    )
    client = StreamingClient(options)
    recorder = Recorder()
    recorder.attach(client)
    return client, recorder


def params(**values: Any) -> StreamingParameters:
    """The SDK's connection parameters (its pydantic `Field(None, ...)` defaults look required
    to mypy without pydantic's plugin)."""
    return StreamingParameters(**values)


def chunks(pcm: np.ndarray, samples: int = 1600, pause_s: float = 0.0) -> Iterator[bytes]:
    for start in range(0, len(pcm), samples):
        yield pcm[start : start + samples].tobytes()
        time.sleep(pause_s)


def check_turns(turns: list[TurnEvent], format_turns: bool) -> None:
    """AssemblyAI's Turn semantics: turn_order counts up from 0, one turn at a time; within a
    turn the transcript only grows, a final word never changes (its text; nor its interpolated
    times until the end of the turn, which gives the measured ones), and the turn ends once
    (plus its formatted copy when asked); nothing of a turn comes after that."""
    orders = [t.turn_order for t in turns]
    assert orders == sorted(orders) and sorted(set(orders)) == list(range(len(set(orders))))
    for order in set(orders):
        of_turn = [t for t in turns if t.turn_order == order]
        interims = [t for t in of_turn if not t.end_of_turn]
        ends = of_turn[len(interims) :]
        assert all(t.end_of_turn for t in ends), "an interim Turn after the end of its turn"
        assert [t.turn_is_formatted for t in ends] == ([False, True] if format_turns else [False])
        assert not any(t.turn_is_formatted for t in interims)
        unformatted = [*interims, ends[0]]
        for t in unformatted:
            assert t.transcript == " ".join(w.text for w in t.words if w.word_is_final)
            assert t.transcript == t.transcript.lower(), "unformatted text is lower case"
        for before, after in pairwise(interims):
            final = [w for w in before.words if w.word_is_final]
            assert after.words[: len(final)] == final, "a final word changed"
        if interims and ends[0].words:
            final = [w.text for w in interims[-1].words if w.word_is_final]
            assert [w.text for w in ends[0].words[: len(final)]] == final, "a final word changed"
        assert all(w.word_is_final for end in ends for w in end.words)
        for t in of_turn:
            assert all(a.end <= b.start for a, b in pairwise(t.words))
            assert all(w.start <= w.end for w in t.words)


# -- semantics, with the fake engine -----------------------------------------------------------


@pytest.mark.parametrize("format_turns", [True, False])
def test_interim_turns_grow_and_each_turn_ends_once(format_turns: bool) -> None:
    pcm = tone_bursts([2.5, 1.5])

    def scenario(port: int) -> Recorder:
        client, recorder = sdk(port)
        client.connect(params(sample_rate=RATE, format_turns=format_turns))
        client.stream(chunks(pcm, pause_s=0.01))
        client.disconnect(terminate=True)
        return recorder

    async def main() -> Recorder:
        async with running_daemon(FAST) as d:
            return await asyncio.wait_for(asyncio.to_thread(scenario, d.port), 60)

    recorder = asyncio.run(main())
    assert isinstance(recorder.events[0], BeginEvent)
    assert isinstance(recorder.events[-1], TerminationEvent)
    assert not recorder.of(StreamingError)
    turns = recorder.of(TurnEvent)
    check_turns(turns, format_turns)
    assert {t.turn_order for t in turns} == {0, 1}
    interims = [t for t in turns if not t.end_of_turn]
    assert any(t.transcript for t in interims), "no interim with final words: test too weak"
    assert any(not w.word_is_final for t in interims for w in t.words)


def test_force_endpoint_keepalive_update_configuration_and_terminate() -> None:
    """ForceEndpoint ends the open turn without more audio; KeepAlive changes nothing;
    UpdateConfiguration(format_turns) applies to later turns; Terminate flushes, then
    Termination and a clean close (the SDK reports any other close as an error)."""
    speech = tone_bursts([1.5], gap_s=0.0)
    rest = tone_bursts([1.0])

    def scenario(port: int) -> Recorder:
        client, recorder = sdk(port)
        client.connect(params(sample_rate=RATE))
        client.stream(chunks(speech, pause_s=0.01))
        recorder.wait_for(lambda e: isinstance(e, TurnEvent) and bool(e.words))
        client.keep_alive()  # type: ignore[no-untyped-call]  # the SDK leaves it untyped
        client.force_endpoint()  # type: ignore[no-untyped-call]
        recorder.wait_for(lambda e: isinstance(e, TurnEvent) and e.end_of_turn)
        client.set_params(StreamingSessionParameters(format_turns=True, min_turn_silence=160))
        client.stream(chunks(rest))
        client.disconnect(terminate=True)
        return recorder

    async def main() -> Recorder:
        async with running_daemon(FAST) as d:
            return await asyncio.wait_for(asyncio.to_thread(scenario, d.port), 60)

    recorder = asyncio.run(main())
    assert not recorder.of(StreamingError)
    turns = recorder.of(TurnEvent)
    first = [t for t in turns if t.turn_order == 0]
    later = [t for t in turns if t.turn_order > 0]
    check_turns(first, format_turns=False)
    check_turns([t.model_copy(update={"turn_order": t.turn_order - 1}) for t in later], True)
    assert later, "the audio after the forced endpoint is a new turn"
    termination = recorder.events[-1]
    assert isinstance(termination, TerminationEvent)
    audio_s = (len(speech) + len(rest)) / RATE
    assert termination.audio_duration_seconds == round(audio_s)
    assert termination.session_duration_seconds is not None
    assert termination.session_duration_seconds >= 0


def test_keyterms_prompt_every_decode_and_an_update_replaces_them() -> None:
    engine = RecordingEngine()
    burst = tone_bursts([1.0])

    def scenario(port: int) -> Recorder:
        client, recorder = sdk(port)
        client.connect(params(sample_rate=RATE, keyterms_prompt=["Grafana", "customer service"]))
        client.stream(chunks(burst))
        recorder.wait_for(lambda e: isinstance(e, TurnEvent) and e.end_of_turn)
        client.set_params(StreamingSessionParameters(keyterms_prompt=["Kubernetes"]))
        client.stream(chunks(burst))
        client.disconnect(terminate=True)
        return recorder

    async def main() -> Recorder:
        async with running_daemon(FAST, engine=engine) as d:
            return await asyncio.wait_for(asyncio.to_thread(scenario, d.port), 60)

    recorder = asyncio.run(main())
    assert not recorder.of(StreamingError)
    assert len([t for t in recorder.of(TurnEvent) if t.end_of_turn]) == 2
    first = engine.prompts.index("Kubernetes.")
    assert set(engine.prompts[:first]) == {"Grafana, customer service."}
    assert set(engine.prompts[first:]) == {"Kubernetes."}


# -- auth and errors -----------------------------------------------------------------------------


def test_the_sdks_bare_key_is_accepted_and_a_wrong_key_refused() -> None:
    def scenario(port: int, key: str) -> Recorder:
        client, recorder = sdk(port, key)
        client.connect(params(sample_rate=RATE))
        client.disconnect(terminate=True)
        return recorder

    async def main() -> tuple[Recorder, Recorder, int | None]:
        async with running_daemon(make_config(auth={"token": "k"})) as d:
            good = await asyncio.to_thread(scenario, d.port, "k")
            bad = await asyncio.to_thread(scenario, d.port, "nope")
            # Bearer also works (generic clients); AssemblyAI keys never contain a space.
            headers = {"Authorization": "Bearer k"}
            async with connect(url(d, "/v3/ws"), additional_headers=headers) as conn:
                begin = json.loads(await conn.recv())
                await conn.send(json.dumps({"type": "Terminate"}))
                with pytest.raises(ConnectionClosed):
                    while True:
                        await conn.recv()
                assert begin["type"] == "Begin"
            return good, bad, conn.close_code

    good, bad, bearer_close = asyncio.run(main())
    assert [type(e) for e in good.events] == [BeginEvent, TerminationEvent]
    [error] = bad.events
    assert isinstance(error, StreamingError) and error.code == 401
    assert bearer_close == 1000


def test_bad_messages_and_audio_get_assemblyai_errors_and_close_codes() -> None:
    def malformed(port: int) -> Recorder:
        client, recorder = sdk(port)
        client.connect(params(sample_rate=RATE))
        recorder.wait_for(lambda e: isinstance(e, BeginEvent))
        # The SDK only writes valid messages: one malformed frame through its own socket.
        assert client._websocket is not None
        client._websocket.send('{"type": "Terminate"')
        recorder.wait_for(lambda e: isinstance(e, StreamingError))
        client.disconnect()
        return recorder

    def mulaw(port: int) -> Recorder:
        client, recorder = sdk(port)
        client.connect(params(sample_rate=8000, encoding=Encoding.pcm_mulaw))
        recorder.wait_for(lambda e: isinstance(e, StreamingError))
        client.disconnect()
        return recorder

    async def raw(port: int, frame: str) -> tuple[dict[str, Any], int | None]:
        async with connect(f"ws://127.0.0.1:{port}/v3/ws?sample_rate=16000") as conn:
            assert json.loads(await conn.recv())["type"] == "Begin"
            await conn.send(frame)
            error = json.loads(await conn.recv())
            with pytest.raises(ConnectionClosed):
                await conn.recv()
            return error, conn.close_code

    async def main() -> tuple[Recorder, Recorder, list[tuple[dict[str, Any], int | None]]]:
        async with running_daemon(FAST) as d:
            frames = [
                '{"type": "Bogus"}',
                "[]",
                '{"type": "UpdateConfiguration", "format_turns": 1}',
            ]
            answers = [await raw(d.port, frame) for frame in frames]
            return (
                await asyncio.to_thread(malformed, d.port),
                await asyncio.to_thread(mulaw, d.port),
                answers,
            )

    bad_json, bad_encoding, answers = asyncio.run(main())
    [error] = bad_json.of(StreamingError)
    assert error.code == 3006 and str(error).startswith("Invalid JSON: ")
    [error] = bad_encoding.of(StreamingError)
    assert error.code == 3006 and "pcm_mulaw" in str(error)
    assert not bad_encoding.of(BeginEvent)
    messages = [m["error"] for m, _ in answers]
    assert messages[0] == "Invalid Message Type: Bogus"
    assert messages[1].startswith("Invalid Message: ")
    assert "format_turns" in messages[2]
    for message, close_code in answers:
        assert message["type"] == "Error" and message["error_code"] == close_code == 3006


# -- the Sans-I/O dialect alone ------------------------------------------------------------------


def test_whisper_text_becomes_unformatted_turns_and_one_formatted_final() -> None:
    dialect = AssemblyAIDialect({"format_turns": "True"}, now_s=lambda: 1000.0)
    dialect.stream_params("en")
    [begin] = dialect.render(ready(model="m", engine="e"))
    assert json.loads(begin) == {"type": "Begin", "id": "s1", "expires_at": 1000 + 3 * 3600}
    partial = Partial(
        segment=0,
        rev=2,
        start_ms=0,
        end_ms=900,
        stable="Hello,",
        separator=" ",
        unstable="World! It's",
    )
    [interim] = map(json.loads, dialect.render(partial))
    assert interim["transcript"] == "hello"
    assert [(w["text"], w["word_is_final"]) for w in interim["words"]] == [
        ("hello", True),
        ("world", False),
        ("it's", False),
    ]
    assert [(w["start"], w["end"]) for w in interim["words"]] == [(0, 300), (300, 600), (600, 900)]
    text = "Hello, world! It's 1961 — now."
    final = Final(segment=0, start_ms=0, end_ms=1500, text=text, words=timed_words(text, 0))
    end, formatted = map(json.loads, dialect.render(final))
    assert end["transcript"] == end["utterance"] == "hello world it's 1961 now"
    # The end of the turn gives each word its measured times and confidence: the interim's
    # were interpolated (confidence 0.0); a word the decode did not write gets 0.0.
    assert [(w["text"], w["start"], w["end"], w["confidence"]) for w in end["words"]][:3] == [
        ("hello", 0, 200, 0.8),
        ("world", 300, 300, 0.0),
        ("it's", 600, 800, 0.8),
    ]
    assert all(w["confidence"] == 0.0 for w in interim["words"])
    assert (end["turn_is_formatted"], formatted["turn_is_formatted"]) == (False, True)
    assert formatted["transcript"] == final.text
    assert [w["text"] for w in formatted["words"]][-2:] == ["—", "now."]
    assert end["end_of_turn_confidence"] == formatted["end_of_turn_confidence"] == 1.0


def test_the_words_of_a_chinese_turn_are_its_characters() -> None:
    dialect = AssemblyAIDialect({"format_turns": "true"}, now_s=lambda: 1000.0)
    dialect.stream_params("zh")
    dialect.render(ready(model="m", engine="e"))
    partial = Partial(
        segment=0,
        rev=1,
        start_ms=0,
        end_ms=600,
        stable="我用Python",
        separator="",
        unstable="写代码",
    )
    [interim] = map(json.loads, dialect.render(partial))
    assert interim["transcript"] == "我用python"
    assert [(w["text"], w["word_is_final"]) for w in interim["words"]] == [
        *(("我", True), ("用", True), ("python", True)),
        *(("写", False), ("代", False), ("码", False)),
    ]
    text = "我用Python写代码。"
    final = Final(segment=0, start_ms=0, end_ms=900, text=text, words=timed_words(text, 0))
    end, formatted = map(json.loads, dialect.render(final))
    assert end["transcript"] == end["utterance"] == "我用python写代码"
    assert [w["text"] for w in end["words"]] == ["我", "用", "python", "写", "代", "码"]
    assert formatted["transcript"] == final.text
    assert [w["text"] for w in formatted["words"]][-1] == "码。"


def test_an_update_to_a_language_the_model_cannot_caption_is_refused() -> None:
    dialect = AssemblyAIDialect({"sample_rate": "16000"})
    dialect.stream_params("en", EngineInfo("fake", "tiny.en", False, 8).check_can)
    update = {"type": "UpdateConfiguration", "language_codes": ["es"]}
    with pytest.raises(BadMessageError, match=r"tiny\.en is English-only"):
        dialect.receive(json.dumps(update))
    with pytest.raises(BadMessageError, match=r"tiny\.en is English-only"):
        dialect.receive(json.dumps({**update, "language_codes": ["en", "es"]}))
    english = dialect.receive(json.dumps({**update, "language_codes": ["en"]}))
    assert english.language == LanguageSetting("en")
    # Cantonese on a model before large-v3, as base.
    base = EngineInfo("fake", "base", True, 8, frozenset({"en", "zh"}))
    dialect.stream_params("en", base.check_can)
    with pytest.raises(BadMessageError, match="does not know language 'yue'"):
        dialect.receive(json.dumps({**update, "language_codes": ["yue"]}))
    with pytest.raises(BadMessageError, match="does not know language 'yue'"):
        dialect.receive(json.dumps({**update, "language_codes": ["zh", "yue"]}))
    several = dialect.receive(json.dumps({**update, "language_codes": ["en", "zh_TW"]}))
    assert several.language == LanguageSetting("auto", ("en", "zh"), "zh-TW")


@pytest.mark.parametrize(
    ("query", "language", "variant"),
    [
        ({"language_code": "zh-TW"}, "zh", "zh-TW"),  # the script of Chinese stays
        ({"language_codes": '["zh_TW"]'}, "zh", "zh-TW"),
        ({"language_code": "en_us"}, "en", None),
        # Every AssemblyAI model but the English one detects the language when none is named.
        ({"speech_model": "universal-streaming-multilingual"}, "auto", None),
        ({"speech_model": "whisper-rt"}, "auto", None),
        ({"speech_model": "u3-rt-pro"}, "auto", None),
        ({"speech_model": "universal-streaming-english"}, "en", None),
        ({"speech_model": "whisper-rt", "language_code": "de"}, "de", None),
    ],
)
def test_the_stream_language_from_assemblyais_parameters(
    query: dict[str, str], language: str, variant: str | None
) -> None:
    params = AssemblyAIDialect({"sample_rate": "16000", **query}).stream_params("fr")
    assert (params.language, params.chinese_variant) == (language, variant)


def test_an_update_to_traditional_chinese_keeps_its_script() -> None:
    dialect = AssemblyAIDialect({"sample_rate": "16000"})
    dialect.stream_params("en")
    update = {"type": "UpdateConfiguration", "language_codes": ["zh-TW"]}
    assert dialect.receive(json.dumps(update)).language == LanguageSetting("zh", (), "zh-TW")


def test_update_configuration_and_query_parameters() -> None:
    dialect = AssemblyAIDialect({"sample_rate": "48000", "language_codes": '["de"]'})
    params = dialect.stream_params("en")
    assert (params.sample_rate_hz, params.encoding, params.language) == (48000, "pcm_s16le", "de")
    # Several: every expected language, each utterance's detected among them.
    several = AssemblyAIDialect({"language_codes": '["en", "es"]'}).stream_params("en")
    assert (several.language, several.candidates) == ("auto", ("en", "es"))
    # The multilingual model with detection and no language named detects it.
    detect = {"speech_model": "universal-streaming-multilingual", "language_detection": "true"}
    assert AssemblyAIDialect(detect).stream_params("en").language == "auto"
    assert AssemblyAIDialect({}).stream_params("en").language == "en"
    assert params.prompt is None
    terms = AssemblyAIDialect({"keyterms_prompt": '["Grafana", " Dr. Okafor "]'})
    assert terms.stream_params("en").prompt == "Grafana, Dr. Okafor."
    update = {"type": "UpdateConfiguration", "format_turns": True, "language_codes": ["fr"]}
    with pytest.raises(BadMessageError, match="keyterms_prompt"):  # refused whole
        dialect.receive(json.dumps({**update, "keyterms_prompt": "Grafana"}))
    [unformatted] = dialect.render(Final(segment=0, start_ms=0, end_ms=10, text="No."))
    assert json.loads(unformatted)["transcript"] == "no", "format_turns changed"
    received = dialect.receive(json.dumps({**update, "max_turn_silence": 900, "novel": 1}))
    assert received.language == LanguageSetting("fr")
    assert received.control is None and received.prompt is None
    assert dialect.receive('{"type": "UpdateConfiguration", "keyterms_prompt": []}').prompt == ""
    assert dialect.receive('{"type": "ForceEndpoint"}').control is Control.FINALIZE
    assert dialect.receive('{"type": "Terminate"}').control is Control.END
    assert dialect.receive('{"type": "KeepAlive"}').control is Control.KEEPALIVE
    assert dialect.receive(b"\x00\x01").audio == b"\x00\x01"
    [_, formatted] = dialect.render(Final(segment=0, start_ms=0, end_ms=10, text="Yes."))
    assert json.loads(formatted)["transcript"] == "Yes."
    codes = {
        BadMessageError("x"): 3006,
        FrameTooLargeError("x"): 3007,
        RateLimitedError("x"): 3007,
        OverloadedError("x"): 3009,
        EngineFailedError("x"): 3005,
    }
    for error, code in codes.items():
        assert dialect.close_frame(error) == (code, error.code)
        [frame] = dialect.render(Error(code=error.code, message="m"))
        assert json.loads(frame) == {"type": "Error", "error_code": code, "error": "m"}


# -- the real model ------------------------------------------------------------------------------


@pytest.mark.model
def test_sdk_transcript_equals_v1_stream_finals_at_48_khz(
    speech_dir: Path, speech_manifest: list[dict[str, Any]], tiny_en: Engine
) -> None:
    """Same samples (the clip resampled to 48 kHz) through the SDK and through /v1/stream:
    the formatted turns are the v1 finals, the unformatted ones their lower-cased words."""
    clip = next(m for m in speech_manifest if m["id"] == "jfk_inaugural_1961")
    pcm16 = read_wav_int16(speech_dir / clip["file"]).astype(np.float32) / 32768
    pcm = (np.clip(soxr.resample(pcm16, RATE, 48_000), -1, 1) * 32767).astype("<i2")

    def scenario(port: int) -> Recorder:
        client, recorder = sdk(port)
        client.connect(params(sample_rate=48_000, format_turns=True))
        client.stream(chunks(pcm, samples=4800))
        client.disconnect(terminate=True)
        return recorder

    async def main() -> tuple[list[str], Recorder]:
        async with running_daemon(FAST, engine=tiny_en, vad_factory=None) as d:
            v1 = await stream_pcm(url(d, query="sample_rate=48000"), pcm, chunk_samples=4800)
            recorder = await asyncio.wait_for(asyncio.to_thread(scenario, d.port), 120)
            return [m["text"] for m in v1.of("final") if m["text"]], recorder

    finals, recorder = asyncio.run(main())
    assert not recorder.of(StreamingError)
    turns = recorder.of(TurnEvent)
    check_turns(turns, format_turns=True)
    formatted = [t.transcript for t in turns if t.turn_is_formatted and t.transcript]
    assert formatted == finals
    assert "ask what you can do for your country" in " ".join(finals).lower()
    unformatted = [t.transcript for t in turns if t.end_of_turn and not t.turn_is_formatted]
    assert " ".join(unformatted).split() == [
        w.strip(",.!?").lower() for w in " ".join(finals).split()
    ]
    termination = recorder.events[-1]
    assert isinstance(termination, TerminationEvent)
    assert termination.audio_duration_seconds == round(clip["duration_s"])


@pytest.mark.model
def test_keyterms_prompt_is_the_v1_streams_prompt(speech_dir: Path, tiny_en: Engine) -> None:
    """A name the bundled model mishears alone, in `keyterms_prompt`: the formatted turns have
    it, and are the v1 finals with `?prompt=` that name."""
    pcm = read_wav_int16(speech_dir / "utt" / "cmu_arctic_aew_a0001.wav")
    pcm = np.concatenate([pcm, np.zeros(RATE, "<i2")])
    name = "Philip Steels"

    def scenario(port: int) -> Recorder:
        client, recorder = sdk(port)
        client.connect(params(sample_rate=RATE, format_turns=True, keyterms_prompt=[name]))
        client.stream(chunks(pcm))
        client.disconnect(terminate=True)
        return recorder

    async def main() -> tuple[list[str], Recorder]:
        async with running_daemon(FAST, engine=tiny_en, vad_factory=None) as d:
            v1 = await stream_pcm(url(d, query=f"prompt={name.replace(' ', '+')}"), pcm)
            recorder = await asyncio.wait_for(asyncio.to_thread(scenario, d.port), 120)
            return [m["text"] for m in v1.of("final") if m["text"]], recorder

    finals, recorder = asyncio.run(main())
    assert not recorder.of(StreamingError)
    formatted = [t.transcript for t in recorder.of(TurnEvent) if t.turn_is_formatted]
    assert name in " ".join(finals)
    assert [t for t in formatted if t] == finals


def test_speaker_labels_name_each_ended_turn_and_its_words() -> None:
    """`speaker_labels` through the SDK: two voices (ToneEmbedder's tones) are A and B on
    every ended Turn and each of its words; interim Turns say no speaker; `max_speakers` caps
    them."""
    pcm = tone_bursts([1.5, 1.5, 1.5], gap_s=1.2, tones_hz=[300.0, 1_200.0, 300.0])

    def scenario(port: int, **values: Any) -> list[TurnEvent]:
        client, recorder = sdk(port)
        client.connect(params(sample_rate=RATE, speaker_labels=True, **values))
        client.stream(chunks(pcm, pause_s=0.01))
        client.disconnect(terminate=True)
        assert not recorder.of(StreamingError)
        turns: list[TurnEvent] = recorder.of(TurnEvent)
        return turns

    async def main() -> tuple[list[TurnEvent], list[TurnEvent]]:
        async with running_daemon(FAST) as d:
            labelled = await asyncio.wait_for(asyncio.to_thread(scenario, d.port), 60)
            capped = await asyncio.wait_for(asyncio.to_thread(scenario, d.port, max_speakers=1), 60)
            return labelled, capped

    labelled, capped = asyncio.run(main())
    ended = [t for t in labelled if t.end_of_turn and t.transcript]
    assert [t.speaker_label for t in ended] == ["A", "B", "A"]
    assert all(w.speaker == t.speaker_label for t in ended for w in t.words)
    assert all(t.speaker_label is None for t in labelled if not t.end_of_turn)
    assert {t.speaker_label for t in capped if t.end_of_turn and t.transcript} == {"A"}


def test_end_of_turn_confidence_is_the_models_probability_where_it_judged() -> None:
    """With the turn keys the model ends the stream's turns, and `end_of_turn_confidence` is
    its probability (the harness's model says 0.9 at every pause); without them (silence
    ends turns, no model) it is 1.0 on the Turn that ends a turn and 0.0 before."""
    pcm = tone_bursts([1.5, 1.5], gap_s=1.2)

    def scenario(port: int, **values: Any) -> list[TurnEvent]:
        client, recorder = sdk(port)
        client.connect(params(sample_rate=RATE, **values))
        client.stream(chunks(pcm, pause_s=0.01))
        client.disconnect(terminate=True)
        assert not recorder.of(StreamingError)
        turns: list[TurnEvent] = recorder.of(TurnEvent)
        return turns

    async def main() -> tuple[list[TurnEvent], list[TurnEvent]]:
        async with running_daemon(FAST) as d:
            judged = await asyncio.wait_for(
                asyncio.to_thread(scenario, d.port, end_of_turn_confidence_threshold=0.5), 60
            )
            silent = await asyncio.wait_for(asyncio.to_thread(scenario, d.port), 60)
            return judged, silent

    judged, silent = asyncio.run(main())
    ended = [t for t in judged if t.end_of_turn]
    assert len(ended) == 2 and all(t.end_of_turn_confidence == 0.9 for t in ended)
    assert {t.end_of_turn_confidence for t in silent if t.end_of_turn} == {1.0}
    assert {t.end_of_turn_confidence for t in silent if not t.end_of_turn} == {0.0}


def test_a_rendered_turn_says_the_models_latest_probability() -> None:
    dialect = AssemblyAIDialect({"end_of_turn_confidence_threshold": "0.6"})
    dialect.stream_params("en")
    partial = Partial(
        segment=0, rev=1, start_ms=0, end_ms=900, stable="", separator="", unstable="Hello"
    )
    [before] = map(json.loads, dialect.render(partial))
    [after] = map(json.loads, dialect.render(dataclasses.replace(partial, end_of_turn=0.31234)))
    final = Final(segment=0, start_ms=0, end_ms=1500, text="Hello.", end_of_turn=0.31234)
    [end] = map(json.loads, dialect.render(final))
    assert (before["end_of_turn_confidence"], after["end_of_turn_confidence"]) == (0.0, 0.3123)
    assert end["end_of_turn"] and end["end_of_turn_confidence"] == 0.3123


def test_turn_detection_keys_end_the_streams_turns_by_the_model() -> None:
    assert AssemblyAIDialect({}).stream_params("en").turn == TurnParams()
    query = {"end_of_turn_confidence_threshold": "0.6", "max_turn_silence": "900"}
    dialect = AssemblyAIDialect(query)
    assert dialect.stream_params("en").turn == TurnParams(
        end_of_turn="model", end_of_turn_threshold=0.6, max_turn_silence_ms=900
    )
    # An update keeps what it does not name; one that names nothing new changes nothing.
    update = {"type": "UpdateConfiguration", "min_end_of_turn_silence_when_confident": 240}
    assert dialect.receive(json.dumps(update)).turn == TurnParams(
        end_of_turn="model",
        end_of_turn_threshold=0.6,
        end_of_turn_pause_ms=240,
        max_turn_silence_ms=900,
    )
    assert dialect.receive(json.dumps(update)).turn is None
    newer = {"type": "UpdateConfiguration", "min_turn_silence": 300}
    turn = dialect.receive(json.dumps(newer)).turn
    assert turn is not None and turn.end_of_turn_pause_ms == 300
    for bad in ({"max_turn_silence": "long"}, {"end_of_turn_confidence_threshold": 2}):
        with pytest.raises(BadMessageError, match="Input validation error"):
            dialect.receive(json.dumps({"type": "UpdateConfiguration", **bad}))
