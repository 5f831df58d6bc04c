"""The OpenAI Realtime transcription endpoint (`/v1/realtime?intent=transcription`), driven by
OpenAI's own SDK (`openai[realtime]`, synchronous, run in a thread) against a real daemon."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import json
import math
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Final, cast

import numpy as np
import pytest
import soxr
from daemon_harness import (
    Exchange,
    RecordingEngine,
    collect,
    make_config,
    running_daemon,
    stream_pcm,
    tone_bursts,
    url,
)
from openai import OpenAI
from openai.resources.realtime.realtime import RealtimeConnection
from openai.types.realtime import (
    RealtimeTranscriptionSessionCreateRequestParam as TranscriptionSession,
)
from openai.types.realtime import SessionCreatedEvent
from testkit import read_wav_int16
from websockets.asyncio.client import connect
from websockets.exceptions import InvalidStatus

from captiond.config import Config
from captiond.dialects.openai_realtime import OpenAIRealtimeDialect
from captiond.engines.base import Engine, EngineRequest, EngineResult
from captiond.engines.fake import FakeEngine
from captiond.streaming import events as protocol

RATE_HZ: Final = 24_000
COMPLETED = "conversation.item.input_audio_transcription.completed"
DELTA = "conversation.item.input_audio_transcription.delta"
SESSION: TranscriptionSession = {
    "type": "transcription",
    "audio": {
        "input": {
            "format": {"type": "audio/pcm", "rate": RATE_HZ},
            "transcription": {"model": "gpt-4o-transcribe", "language": "en"},
            "turn_detection": {"type": "server_vad"},
        }
    },
}
# Audio goes in faster than real time.
FAST = {"max_audio_speed": 1e6}


def sdk_client(port: int, key: str = "k") -> OpenAI:
    return OpenAI(
        api_key=key,
        base_url=f"http://127.0.0.1:{port}/v1",
        websocket_base_url=f"ws://127.0.0.1:{port}/v1",
    )


@contextlib.contextmanager
def transcription(
    port: int, session: TranscriptionSession = SESSION
) -> Iterator[RealtimeConnection]:
    """An SDK connection to a transcription session, `session` set (its events read)."""
    with sdk_client(port).realtime.connect(extra_query={"intent": "transcription"}) as conn:
        created = conn.recv()
        assert isinstance(created, SessionCreatedEvent)
        assert created.session.type == "transcription"
        conn.session.update(session=session)
        assert conn.recv().type == "session.updated"
        yield conn


def to_24k(pcm_16k: np.ndarray) -> np.ndarray:
    up: np.ndarray = soxr.resample(pcm_16k.astype(np.float32) / 32768, 16_000, RATE_HZ)
    return np.clip(np.round(up * 32768), -32768, 32767).astype("<i2")


def append(conn: RealtimeConnection, pcm: np.ndarray, chunk: int = 4_800) -> None:
    for start in range(0, len(pcm), chunk):
        audio = base64.b64encode(pcm[start : start + chunk].tobytes()).decode()
        conn.input_audio_buffer.append(audio=audio)


def read_until(conn: RealtimeConnection, done: Callable[[list[Any]], bool]) -> list[Any]:
    events: list[Any] = []
    while not done(events):
        events.append(conn.recv())
    return events


def completions(n: int) -> Callable[[list[Any]], bool]:
    return lambda events: sum(e.type == COMPLETED for e in events) >= n


def check_items(events: Sequence[Any], speech_events: bool = True, cuts: bool = False) -> None:
    """Per item: deltas only append, and together they are the final's transcript; items are
    committed in order, each naming the one before, before they complete; each was announced
    by speech_started (only in server_vad mode, and not one that goes on from a cut at
    `max_utterance_s`: `cuts`)."""
    sent: dict[str, str] = {}
    committed: list[str] = []
    completed: set[str] = set()
    for e in events:
        if e.type == DELTA:
            assert e.item_id not in completed, "a delta after the item's final"
            sent[e.item_id] = sent.get(e.item_id, "") + e.delta
        elif e.type == "input_audio_buffer.committed":
            assert e.previous_item_id == (committed[-1] if committed else None)
            committed.append(e.item_id)
        elif e.type == COMPLETED:
            assert committed[-1] == e.item_id
            assert sent.get(e.item_id, "") == e.transcript
            completed.add(e.item_id)
    started = [e.item_id for e in events if e.type == "input_audio_buffer.speech_started"]
    stopped = [e.item_id for e in events if e.type == "input_audio_buffer.speech_stopped"]
    if not speech_events:
        assert not started and not stopped
    elif not cuts:
        assert set(committed) <= set(started) and started[: len(stopped)] == stopped


def live_deltas(events: Sequence[Any]) -> int:
    """Deltas that came before their item's final."""
    committed: set[str] = set()
    live = 0
    for e in events:
        if e.type == "input_audio_buffer.committed":
            committed.add(e.item_id)
        live += e.type == DELTA and e.item_id not in committed
    return live


def session_with(**audio_input: Any) -> TranscriptionSession:
    """SESSION with some of its `audio.input` fields replaced."""
    fields = {**SESSION["audio"]["input"], **audio_input}
    return cast(TranscriptionSession, {**SESSION, "audio": {"input": fields}})


def run(scenario: Callable[[int], Any], config: Config | None = None, **daemon: Any) -> Any:
    """`scenario(port)` in a thread while a daemon (the fake engine by default) runs."""

    async def main() -> Any:
        async with running_daemon(config or make_config(server=FAST), **daemon) as d:
            return await asyncio.wait_for(asyncio.to_thread(scenario, d.port), 60)

    return asyncio.run(main())


# -- the real model on real speech -------------------------------------------------------------


@pytest.fixture(scope="module")
def jfk_24k(speech_dir: Path) -> np.ndarray:
    # Trailing silence ends the last utterance by the VAD, on either path.
    pcm = read_wav_int16(speech_dir / "utt" / "jfk_inaugural_1961.wav")
    return to_24k(np.concatenate([pcm, np.zeros(24_000, "<i2")]))


def native_and_sdk_finals(
    engine: Engine, pcm_24k: np.ndarray, query: str, session: TranscriptionSession = SESSION
) -> tuple[list[str], list[str]]:
    """The finals of `pcm_24k` over /v1/stream (`query` added) and the SDK's completed
    transcripts of the same audio in `session`, without partials: then the finals depend on
    the audio only, not on when partials ran."""
    config = make_config(server=FAST, stream={"partial_interval_ms": 3_600_000})

    async def main() -> tuple[list[str], list[str]]:
        async with running_daemon(config, engine=engine, vad_factory=None) as daemon:
            target = url(daemon, query=f"sample_rate=24000&{query}")
            native = await stream_pcm(target, pcm_24k, 4_800)
            finals = [m["text"] for m in native.of("final")]

            def sdk() -> list[str]:
                with transcription(daemon.port, session) as conn:
                    append(conn, pcm_24k)
                    conn.input_audio_buffer.commit()
                    events = read_until(conn, completions(len(finals)))
                return [e.transcript for e in events if e.type == COMPLETED]

            return finals, await asyncio.wait_for(asyncio.to_thread(sdk), 120)

    return asyncio.run(main())


@pytest.mark.model
def test_sdk_transcript_equals_the_native_stream(tiny_en: Engine, jfk_24k: np.ndarray) -> None:
    finals, transcripts = native_and_sdk_finals(tiny_en, jfk_24k, "")
    assert "what you can do for your country" in " ".join(finals).lower()
    assert transcripts == finals


@pytest.mark.model
def test_deltas_add_up_to_each_final(tiny_en: Engine, jfk_24k: np.ndarray) -> None:
    async def main() -> list[Any]:
        async with running_daemon(make_config(server=FAST), engine=tiny_en, vad_factory=None) as d:
            native = await stream_pcm(url(d, query="sample_rate=24000"), jfk_24k, 4_800)

            def sdk() -> list[Any]:
                with transcription(d.port) as conn:
                    for start in range(0, len(jfk_24k), 4_800):  # 5x real time: partials run
                        append(conn, jfk_24k[start : start + 4_800])
                        time.sleep(0.04)
                    conn.input_audio_buffer.commit()
                    return read_until(conn, completions(len(native.of("final"))))

            return await asyncio.wait_for(asyncio.to_thread(sdk), 120)

    events = asyncio.run(main())
    check_items(events)


@pytest.mark.model
def test_the_prompt_is_the_native_streams_prompt(tiny_en: Engine, speech_dir: Path) -> None:
    """`transcription.prompt` (OpenAI's keywords for whisper-1) primes a name the bundled
    model mishears alone, exactly as `?prompt=` does on /v1/stream."""
    pcm = read_wav_int16(speech_dir / "utt" / "cmu_arctic_aew_a0001.wav")
    pcm_24k = to_24k(np.concatenate([pcm, np.zeros(16_000, "<i2")]))
    name = "Philip Steels"
    session = session_with(transcription={"language": "en", "prompt": name})
    query = f"prompt={name.replace(' ', '+')}"
    finals, transcripts = native_and_sdk_finals(tiny_en, pcm_24k, query, session)
    assert name in " ".join(finals)
    assert transcripts == finals


@pytest.mark.model
def test_include_logprobs_gives_each_word_its_confidence(
    tiny_en: Engine, jfk_24k: np.ndarray
) -> None:
    """`include` logprobs: each completed transcript's `logprobs` (parsed by the SDK's own
    LogProbProperties) are its words, joining back to the transcript, each the log of the
    native final's word confidence; without `include` there are none."""
    config = make_config(server=FAST, stream={"partial_interval_ms": 3_600_000})
    with_logprobs = cast(
        TranscriptionSession, {**SESSION, "include": ["item.input_audio_transcription.logprobs"]}
    )

    async def main() -> tuple[list[dict[str, Any]], list[Any], list[Any]]:
        async with running_daemon(config, engine=tiny_en, vad_factory=None) as daemon:
            native = await stream_pcm(url(daemon, query="sample_rate=24000"), jfk_24k, 4_800)
            finals = native.of("final")

            def sdk(session: TranscriptionSession) -> list[Any]:
                with transcription(daemon.port, session) as conn:
                    append(conn, jfk_24k)
                    conn.input_audio_buffer.commit()
                    events = read_until(conn, completions(len(finals)))
                return [e for e in events if e.type == COMPLETED]

            asked = await asyncio.wait_for(asyncio.to_thread(sdk, with_logprobs), 120)
            plain = await asyncio.wait_for(asyncio.to_thread(sdk, SESSION), 120)
            return finals, asked, plain

    finals, asked, plain = asyncio.run(main())
    assert [e.transcript for e in asked] == [f["text"] for f in finals]
    assert all(e.logprobs is None for e in plain)
    for event, final in zip(asked, finals, strict=True):
        assert "".join(p.token for p in event.logprobs) == event.transcript
        words = [w for w in final["words"] if w["confidence"] is not None]
        assert [p.token.strip() for p in event.logprobs] == [w["word"] for w in words]
        for entry, word in zip(event.logprobs, words, strict=True):
            assert bytes(entry.bytes).decode() == entry.token
            assert entry.logprob == pytest.approx(math.log(word["confidence"]), abs=1e-3)
    assert any(p.logprob < -0.1 for e in asked for p in e.logprobs), "real, not placeholders"


def test_include_names_only_logprobs() -> None:
    def scenario(port: int) -> list[Any]:
        replies = []
        with transcription(port) as conn:
            for include in (["item.input_audio_transcription.logprobs"], ["usage"], "all"):
                update = {**SESSION, "include": include}
                conn.send_raw(json.dumps({"type": "session.update", "session": update}))
                replies.append(conn.recv())
        return replies

    updated, unknown, not_a_list = run(scenario)
    assert updated.type == "session.updated"
    assert updated.session.include == ["item.input_audio_transcription.logprobs"]
    assert unknown.type == "error" and unknown.error.code == "invalid_value"
    assert unknown.error.param == "session.include"
    assert not_a_list.type == "error" and not_a_list.error.code == "invalid_type"


def test_deltas_add_up_to_the_final_in_a_script_without_spaces() -> None:
    """Japanese stable text grows by characters, with no space to split words on: each delta
    is what the stable text added, and together they are the final."""
    dialect = OpenAIRealtimeDialect({"intent": "transcription"})
    dialect.stream_params("ja")
    rendered: list[str] = []
    for rev, stable in enumerate(["", "病気のた", "病気のため彼", "病気のため彼はその"], 1):
        partial = protocol.Partial(
            segment=0,
            rev=rev,
            start_ms=0,
            end_ms=rev * 500,
            stable=stable,
            separator="",
            unstable="会合に",
        )
        rendered += dialect.render(partial)
    text = "病気のため彼はその会合に出席できなかった。"
    rendered += dialect.render(protocol.Final(segment=0, start_ms=0, end_ms=3_000, text=text))
    events = [SimpleNamespace(**json.loads(r)) for r in rendered]
    check_items(events, speech_events=False)
    deltas = [e.delta for e in events if e.type == DELTA]
    assert deltas == ["病気のた", "め彼", "はその", "会合に出席できなかった。"]


# -- the fake engine: protocol behaviour --------------------------------------------------------

BURST = to_24k(tone_bursts([2.0], gap_s=0.0))  # speech still open when the audio stops


def test_stable_words_go_out_as_deltas_while_speech_goes_on() -> None:
    pcm = to_24k(tone_bursts([3.0, 2.0]))

    def scenario(port: int) -> list[Any]:
        with transcription(port) as conn:
            for start in range(0, len(pcm), 2_400):  # 100 ms every 20 ms: partials run
                append(conn, pcm[start : start + 2_400])
                time.sleep(0.02)
            return read_until(conn, completions(2))

    events = run(scenario)
    check_items(events)
    assert live_deltas(events) >= 2


def test_commit_ends_the_utterance_and_a_close_ends_the_session() -> None:
    """turn_detection null: no speech events; `.commit` ends the item now, with no silence
    after it. The SDK's close ends the session."""

    def scenario(port: int) -> list[Any]:
        with transcription(port, session_with(turn_detection=None)) as conn:
            events = []
            for _ in range(2):
                append(conn, BURST)
                conn.input_audio_buffer.commit()
                events += read_until(conn, completions(1))
            return events

    async def main() -> tuple[list[Any], int]:
        async with running_daemon(make_config(server=FAST)) as daemon:
            events = await asyncio.wait_for(asyncio.to_thread(scenario, daemon.port), 60)
            for _ in range(100):
                if daemon.sessions_open == 0:
                    break
                await asyncio.sleep(0.05)
            return events, daemon.sessions_open

    events, sessions_open = asyncio.run(main())
    check_items(events, speech_events=False)
    completed = [e for e in events if e.type == COMPLETED]
    assert len(completed) == 2 and all(e.transcript for e in completed)
    assert completed[0].usage.seconds == pytest.approx(2.0, abs=0.5)
    assert sessions_open == 0


def test_push_to_talk_makes_one_item_per_commit_whatever_the_pauses() -> None:
    """turn_detection null: a 1-s pause inside what the client commits does not end its item
    (it would with server_vad: two items); the item spans both bursts."""
    pcm = to_24k(tone_bursts([1.5, 1.5], gap_s=1.0))

    def scenario(port: int, session: TranscriptionSession, items: int) -> list[Any]:
        with transcription(port, session) as conn:
            for start in range(0, len(pcm), 2_400):  # 100 ms every 20 ms: partials run
                append(conn, pcm[start : start + 2_400])
                time.sleep(0.02)
            conn.input_audio_buffer.commit()
            return read_until(conn, completions(items))

    push_to_talk = run(lambda port: scenario(port, session_with(turn_detection=None), 1))
    check_items(push_to_talk, speech_events=False)
    (completed,) = [e for e in push_to_talk if e.type == COMPLETED]
    # From the pre-roll before the first burst (0.5 s in) to the commit, 1 s after the
    # second: 5.5 - 0.5 + 0.3 s.
    assert completed.usage.seconds == pytest.approx(5.3, abs=0.2)
    server_vad = run(lambda port: scenario(port, SESSION, 2))
    check_items(server_vad)
    assert sum(e.type == "input_audio_buffer.committed" for e in server_vad) == 2


class NoWordsEngine(FakeEngine):
    """Hears no words in anything (every utterance is a cough)."""

    def transcribe_batch(self, requests: Sequence[EngineRequest]) -> list[EngineResult]:
        return [dataclasses.replace(r, text="") for r in super().transcribe_batch(requests)]


def test_every_push_to_talk_commit_is_answered() -> None:
    """turn_detection null, where an app waits for each commit's answer: a commit of silence
    gets OpenAI's commit_empty error; a "yes" (150 ms) too short to have started an utterance,
    committed half a second later, is transcribed; and so is an item with no words (the
    engine hears none), with an empty transcript."""
    yes = to_24k(tone_bursts([0.15], gap_s=0.5))

    def scenario(port: int) -> list[Any]:
        with transcription(port, session_with(turn_detection=None)) as conn:
            append(conn, to_24k(np.zeros(16_000, "<i2")))
            conn.send_raw(json.dumps({"type": "input_audio_buffer.commit", "event_id": "c1"}))
            events = read_until(conn, lambda events: len(events) == 1)
            append(conn, yes)
            conn.input_audio_buffer.commit()
            return events + read_until(conn, completions(1))

    empty, *events = run(scenario)
    assert empty.type == "error" and empty.error.code == "input_audio_buffer_commit_empty"
    assert empty.error.event_id == "c1"
    check_items(events, speech_events=False)
    # One word: the fake engine's word for the one loud 250 ms of the decoded audio.
    assert [len(e.transcript.split()) for e in events if e.type == COMPLETED] == [1]

    def cough(port: int) -> list[Any]:
        with transcription(port, session_with(turn_detection=None)) as conn:
            append(conn, BURST)
            conn.input_audio_buffer.commit()
            return read_until(conn, completions(1))

    events = run(cough, engine=NoWordsEngine())
    check_items(events, speech_events=False)
    assert [e.transcript for e in events if e.type == COMPLETED] == [""]


def test_speech_cut_at_the_cap_has_no_speech_events_at_the_cut() -> None:
    """Speech past `max_utterance_s` (here 4 s) becomes several items, but speech started
    once and stopped once: a cut is not the speaker stopping."""
    pcm = to_24k(tone_bursts([10.0]))
    config = make_config(server=FAST, stream={"max_utterance_s": 4.0, "cut_search_s": 1.0})

    def scenario(port: int) -> list[Any]:
        with transcription(port) as conn:
            for start in range(0, len(pcm), 2_400):  # 100 ms every 20 ms: decodes keep up
                append(conn, pcm[start : start + 2_400])
                time.sleep(0.02)
            return read_until(conn, stopped_item_completed)

    def stopped_item_completed(events: list[Any]) -> bool:
        stops = [e.item_id for e in events if e.type == "input_audio_buffer.speech_stopped"]
        return any(e.type == COMPLETED and e.item_id in stops for e in events)

    events = run(scenario, config)
    check_items(events, cuts=True)
    started = [e for e in events if e.type == "input_audio_buffer.speech_started"]
    stopped = [e for e in events if e.type == "input_audio_buffer.speech_stopped"]
    completed = [e for e in events if e.type == COMPLETED]
    assert len(started) == 1 and len(stopped) == 1 and len(completed) >= 3
    assert stopped[0].item_id == completed[-1].item_id != started[0].item_id


def test_clear_is_acknowledged_and_ends_the_utterance() -> None:
    def scenario(port: int) -> list[Any]:
        with transcription(port) as conn:
            append(conn, BURST)
            conn.input_audio_buffer.clear()
            return read_until(conn, completions(1))

    events = run(scenario)
    check_items(events)
    kinds = [e.type for e in events]
    assert "input_audio_buffer.cleared" in kinds
    assert kinds.index("input_audio_buffer.speech_stopped") < kinds.index(COMPLETED)
    assert events[-1].transcript, "the words before the clear were already transcribed"


def test_session_update_switches_the_language() -> None:
    engine = RecordingEngine()

    def scenario(port: int) -> tuple[Any, Any]:
        with transcription(port) as conn:
            conn.session.update(session=session_with(transcription={"language": "de"}))
            updated = conn.recv()
            conn.session.update(session=session_with(transcription={"language": "german"}))
            refused = conn.recv()
            append(conn, BURST)
            conn.input_audio_buffer.commit()
            read_until(conn, completions(1))
            return updated, refused

    updated, refused = run(scenario, engine=engine)
    assert updated.type == "session.updated"
    assert updated.session.audio.input.transcription.language == "de"
    assert refused.type == "error" and refused.error.code == "invalid_value"
    assert refused.error.param == "session.audio.input.transcription.language"
    assert engine.languages and set(engine.languages) == {"de"}, "a refused update changed it"


class BaseLikeEngine(RecordingEngine):
    """A multilingual fake that, as Whisper base, has no Cantonese token."""

    @property
    def known_languages(self) -> frozenset[str]:
        return super().known_languages - {"yue"}


@pytest.mark.parametrize(
    ("engine", "language", "why"),
    [
        # The fake engine is English-only, as tiny.en: German would decode to nothing.
        (lambda: RecordingEngine(multilingual=False), "de", "English-only"),
        # A language the model has no token for would fail or silence every decode.
        (BaseLikeEngine, "yue", "does not know language 'yue'"),
    ],
    ids=["english-only", "no-token"],
)
def test_a_session_update_to_a_language_the_model_cannot_caption_is_refused(
    engine: Callable[[], RecordingEngine], language: str, why: str
) -> None:
    """The update gets OpenAI's error, as a bad value does, before any `session.updated`, and
    the session goes on in its language."""
    recording = engine()

    def scenario(port: int) -> Any:
        with transcription(port) as conn:
            conn.session.update(session=session_with(transcription={"language": language}))
            refused = conn.recv()
            append(conn, BURST)
            conn.input_audio_buffer.commit()
            read_until(conn, completions(1))
            return refused

    refused = run(scenario, engine=recording)
    assert refused.type == "error" and refused.error.code == "invalid_value"
    assert why in refused.error.message
    assert recording.languages and set(recording.languages) == {"en"}


def test_session_update_sets_the_prompt_and_a_refused_one_changes_nothing() -> None:
    engine = RecordingEngine()
    terms = "Kubernetes, Grafana"

    def scenario(port: int) -> list[Any]:
        replies = []
        with transcription(port) as conn:
            for prompt in (terms, "x" * 1_001, 42):
                update = session_with(transcription={"language": "en", "prompt": prompt})
                conn.send_raw(json.dumps({"type": "session.update", "session": update}))
                replies.append(conn.recv())
            append(conn, BURST)
            conn.input_audio_buffer.commit()
            read_until(conn, completions(1))
        return replies

    updated, too_long, not_text = run(scenario, engine=engine)
    assert updated.type == "session.updated"
    assert updated.session.audio.input.transcription.prompt == terms
    assert too_long.type == "error" and too_long.error.code == "string_above_max_length"
    assert not_text.type == "error" and not_text.error.code == "invalid_type"
    assert not_text.error.param == "session.audio.input.transcription.prompt"
    assert engine.prompts and set(engine.prompts) == {terms}, "a refused update changed it"


def test_openai_key_is_checked_before_the_upgrade() -> None:
    def scenario(port: int) -> int:
        with transcription(port) as conn:
            conn.close()
        with pytest.raises(InvalidStatus) as refused:
            sdk_client(port, key="wrong").realtime.connect(
                extra_query={"intent": "transcription"}
            ).enter()
        return refused.value.response.status_code

    assert run(scenario, make_config(auth={"token": "k"})) == 401


def test_bad_events_get_openai_errors_and_the_session_stays_open() -> None:
    long_burst = to_24k(tone_bursts([10.0], gap_s=0.0))  # one ~670 kB append

    def scenario(port: int) -> tuple[list[Any], list[Any]]:
        with transcription(port) as conn:
            conn.send_raw("{not json")
            conn.send_raw(json.dumps({"type": "response.create"}))
            bad_audio = {"type": "input_audio_buffer.append", "audio": "**", "event_id": "e1"}
            conn.send_raw(json.dumps(bad_audio))
            # Not ASCII: base64 raises ValueError here, not binascii.Error (once a 1011 that
            # held the session's slot for good).
            conn.send_raw(json.dumps({"type": "input_audio_buffer.append", "audio": "AAAA\u00e9"}))
            conn.session.update(session=session_with(format={"type": "audio/pcmu"}))
            conn.send_raw(b"\x00\x01")
            errors = read_until(conn, lambda events: len(events) == 6)
            append(conn, long_burst, chunk=len(long_burst))
            conn.input_audio_buffer.commit()
            return errors, read_until(conn, completions(1))

    errors, events = run(scenario)
    assert {e.type for e in errors} == {"error"}
    assert {e.error.type for e in errors} == {"invalid_request_error"}
    assert [(e.error.code, e.error.param) for e in errors] == [
        ("invalid_json", None),
        ("invalid_value", "type"),
        ("invalid_value", "audio"),
        ("invalid_value", "audio"),
        ("invalid_value", "session.audio.input.format"),
        ("invalid_request", None),
    ]
    assert errors[2].error.event_id == "e1"
    assert len(events[-1].transcript.split()) > 30, "the session did not go on"


def test_connecting_without_intent_transcription_is_refused() -> None:
    async def main() -> Exchange:
        async with (
            running_daemon(make_config()) as daemon,
            connect(url(daemon, "/v1/realtime", "model=gpt-realtime")) as conn,
        ):
            return await asyncio.wait_for(collect(conn), 10)

    exchange = asyncio.run(main())
    assert [m["type"] for m in exchange.messages] == ["error"]
    assert exchange.messages[0]["error"]["type"] == "invalid_request_error"
    assert exchange.close_code == 1008


def test_turn_detection_semantic_vad_eagerness_and_server_vad_silence() -> None:
    def scenario(port: int) -> list[Any]:
        replies = []
        with transcription(port) as conn:
            for detection in (
                {"type": "semantic_vad", "eagerness": "high"},
                {"type": "semantic_vad"},
                {"type": "server_vad", "silence_duration_ms": 700},
                {"type": "semantic_vad", "eagerness": "eager"},
                {"type": "server_vad", "silence_duration_ms": 5},
            ):
                session = json.loads(json.dumps(SESSION))
                session["audio"]["input"]["turn_detection"] = detection
                conn.send_raw(json.dumps({"type": "session.update", "session": session}))
                replies.append(conn.recv())
        return replies

    high, auto, silence, eager, short = run(scenario)
    assert high.type == auto.type == silence.type == "session.updated"
    detection = high.session.audio.input.turn_detection
    assert (detection.type, detection.eagerness) == ("semantic_vad", "high")
    assert auto.session.audio.input.turn_detection.eagerness == "auto"
    assert silence.session.audio.input.turn_detection.silence_duration_ms == 700
    for refused, param in ((eager, "eagerness"), (short, "silence_duration_ms")):
        assert refused.type == "error" and refused.error.code == "invalid_value"
        assert refused.error.param.endswith(param)


def test_eagerness_maps_to_the_models_threshold_and_longest_pause() -> None:
    dialect = OpenAIRealtimeDialect({"intent": "transcription"})
    dialect.stream_params("en")
    turns = {}
    for eagerness in ("low", "medium", "high", "auto"):
        session = json.loads(json.dumps(SESSION))
        session["audio"]["input"]["turn_detection"] = {
            "type": "semantic_vad",
            "eagerness": eagerness,
        }
        received = dialect.receive(json.dumps({"type": "session.update", "session": session}))
        assert received.turn is not None and received.turn.end_of_turn == "model"
        turns[eagerness] = received.turn
    assert turns["auto"] == turns["medium"]
    low, medium, high = (turns[e] for e in ("low", "medium", "high"))
    assert low.end_of_turn_threshold > medium.end_of_turn_threshold > high.end_of_turn_threshold
    assert low.max_turn_silence_ms > medium.max_turn_silence_ms > high.max_turn_silence_ms
