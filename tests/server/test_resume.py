"""Session resume against a real daemon (fake engine, scripted VAD): a dropped connection
takes its session back with its token, the finals it did not acknowledge are replayed, the
stream clock and segment numbers continue; across a daemon restart with the journal too."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from daemon_harness import (
    RATE,
    RecordingEngine,
    collect,
    drop,
    make_config,
    recv_until,
    resume_url,
    running_daemon,
    stream_pcm,
    tone_bursts,
    url,
)
from websockets.asyncio.client import ClientConnection, connect
from websockets.protocol import State

from captiond.config import Config
from captiond.engines.base import Engine
from captiond.journal.reader import find_session


def run(coro: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coro, 60))


def finals_of(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [m for m in messages if m["type"] == "final"]


FOUR_BURSTS = tone_bursts([0.6, 0.6, 0.6, 0.6], gap_s=1.0)


def test_resume_replays_exactly_the_unacknowledged_finals() -> None:
    async def scenario() -> None:
        async with running_daemon() as daemon:
            conn = await connect(url(daemon))
            ready = json.loads(await conn.recv())
            assert ready["type"] == "ready" and ready["resume_s"] == 60
            token = ready["resume_token"]
            await conn.send(FOUR_BURSTS.tobytes())
            before = finals_of(await recv_until(conn, "final", 4))
            await conn.send(json.dumps({"type": "ack", "segment": 1}))
            await asyncio.sleep(0.2)
            drop(conn)
            await asyncio.sleep(0.3)
            assert daemon.sessions_open == 1, "the session waits for its client"

            async with connect(resume_url(url(daemon), token)) as again:
                resumed = json.loads(await again.recv())
                assert resumed["type"] == "resumed" and resumed["session"] == ready["session"]
                assert resumed["replayed"] == 2
                replayed = [json.loads(await again.recv()) for _ in range(2)]
                assert replayed == before[2:], "exactly the unacknowledged finals, unchanged"
                assert resumed["received_bytes"] == FOUR_BURSTS.nbytes
                assert resumed["audio_ms"] == len(FOUR_BURSTS) * 1000 // RATE
                assert 300 <= resumed["gap_ms"] < 5_000
                # The stream goes on: its clock and its segment numbers continue.
                await again.send(tone_bursts([0.6]).tobytes())
                await again.send(json.dumps({"type": "end"}))
                rest = await collect(again)
            (after,) = rest.of("final")
            assert after["segment"] == 4 and after["start_ms"] >= resumed["audio_ms"]
            assert rest.of("done")[0]["segments"] == 5 and rest.close_code == 1000

    run(scenario())


@pytest.mark.parametrize("away_longer_than_the_grace", [True, False])
def test_the_utterance_open_at_a_drop(away_longer_than_the_grace: bool) -> None:
    """Audio mid-utterance when the network goes. A client away longer than `drop_grace_s`
    gets the utterance's final, decoded while it was away, first; `since` limits the replay.
    One back sooner continues the utterance with the audio it resends: one final for the whole
    burst, not two halves with the word at the drop cut in two."""
    grace_s = 0.05 if away_longer_than_the_grace else 10.0

    async def scenario() -> None:
        async with running_daemon(make_config(server={"drop_grace_s": grace_s})) as daemon:
            conn = await connect(url(daemon))
            token = json.loads(await conn.recv())["resume_token"]
            pcm = tone_bursts([0.6, 0.6, 2.0], gap_s=1.0)
            cut = len(pcm) - 2 * RATE  # in the middle of the 2-s burst (1 s of silence ends it)
            await conn.send(pcm[:cut].tobytes())
            shown = finals_of(await recv_until(conn, "final", 2))
            await asyncio.sleep(0.3)
            drop(conn)
            await asyncio.sleep(0.5)
            async with connect(resume_url(url(daemon), token, since=2)) as again:
                resumed = json.loads(await again.recv())
                replayed = [json.loads(await again.recv()) for _ in range(resumed["replayed"])]
                # The client kept its audio: it resends from what the daemon has.
                await again.send(pcm.tobytes()[resumed["received_bytes"] :])
                await again.send(json.dumps({"type": "end"}))
                rest = await collect(again)
            assert [f["segment"] for f in shown] == [0, 1]
            assert rest.close_code == 1000
            if away_longer_than_the_grace:
                (open_final,) = replayed
                assert open_final["type"] == "final" and open_final["segment"] == 2
                assert open_final["text"] and open_final["end_ms"] == resumed["audio_ms"]
                assert [f["segment"] for f in rest.of("final")] == [3]
            else:
                assert not replayed, "nothing was finalised while the client was away"
                (whole,) = rest.of("final")
                assert whole["segment"] == 2
                assert whole["start_ms"] < resumed["audio_ms"] < whole["end_ms"]

    run(scenario())


@pytest.mark.parametrize("case", ["wrong secret", "unknown session", "malformed", "expired"])
def test_a_wrong_or_expired_token_is_refused_with_4410(case: str) -> None:
    async def scenario() -> None:
        config = make_config(server={"resume_s": 0.3})
        async with running_daemon(config) as daemon:
            conn = await connect(url(daemon))
            ready = json.loads(await conn.recv())
            session, _, secret = ready["resume_token"].partition(".")
            await conn.send(tone_bursts([0.6]).tobytes())
            await recv_until(conn, "final")
            drop(conn)
            token = {
                "wrong secret": f"{session}.{secret[::-1]}",
                "unknown session": f"0123456789ab.{secret}",
                "malformed": "nodot",
                "expired": ready["resume_token"],
            }[case]
            if case == "expired":
                await asyncio.sleep(0.8)
                assert daemon.sessions_open == 0
            async with connect(resume_url(url(daemon), token)) as again:
                ex = await collect(again)
            assert [m["type"] for m in ex.messages] == ["error"]
            assert ex.messages[0]["code"] == "resume_failed" and ex.close_code == 4410

    run(scenario())


def test_a_new_connection_takes_over_a_half_open_one() -> None:
    """After a cable pull the daemon may not see the old connection die for a while: the
    client that presents the token gets the session, the stale connection is cut."""

    async def scenario() -> None:
        async with running_daemon() as daemon:
            old = await connect(url(daemon))
            token = json.loads(await old.recv())["resume_token"]
            await old.send(tone_bursts([0.6]).tobytes())
            (final,) = finals_of(await recv_until(old, "final"))
            async with connect(resume_url(url(daemon), token, since=0)) as new:
                resumed = json.loads(await new.recv())
                assert resumed["gap_ms"] == 0 and resumed["replayed"] == 1
                assert json.loads(await new.recv()) == final
                await new.send(json.dumps({"type": "end"}))
                rest = await collect(new)
            assert rest.of("done") and rest.close_code == 1000
            await asyncio.wait_for(old.wait_closed(), 5)

    run(scenario())


def test_streams_held_for_a_resume_count_against_their_address() -> None:
    """Connecting and dropping leaves a stream held (and a session slot taken) for `resume_s`.
    An address's held streams count with its open ones: at its limit, its new stream ends
    its oldest held one, so one address cannot fill the daemon without sending audio."""

    async def scenario() -> None:
        config = make_config(server={"max_sessions": 8, "max_sessions_per_ip": 2})
        async with running_daemon(config) as daemon:
            tokens = []
            for _ in range(3):
                conn = await connect(url(daemon))
                tokens.append(json.loads(await conn.recv())["resume_token"])
                drop(conn)
                for _ in range(100):  # the stream let go finishes its (no) finals
                    if daemon.sessions_open <= 2:
                        break
                    await asyncio.sleep(0.05)
                assert daemon.sessions_open <= 2
            async with connect(resume_url(url(daemon), tokens[0])) as oldest:
                assert (await collect(oldest)).close_code == 4410, "let go for the third"
            for token in tokens[1:]:
                async with connect(resume_url(url(daemon), token)) as again:
                    assert json.loads(await again.recv())["type"] == "resumed"
                    await again.send(json.dumps({"type": "end"}))
                    assert (await collect(again)).of("done")

    run(scenario())


def test_resume_off_gives_no_token() -> None:
    async def scenario() -> None:
        async with running_daemon(make_config(server={"resume_s": 0})) as daemon:
            async with connect(url(daemon)) as conn:
                ready = json.loads(await conn.recv())
            assert ready["resume_token"] is None and ready["resume_s"] == 0

    run(scenario())


def _journaled(tmp_path: Path, **server: Any) -> Config:
    return make_config(server=server, journal={"dir": str(tmp_path / "journal")})


@pytest.mark.parametrize("journal", [True, False])
def test_resume_across_a_daemon_restart(tmp_path: Path, journal: bool) -> None:
    """With the journal on, a session the daemon stopped is taken back by the restarted
    daemon: finals from `since` replayed, segments and stream times continue, and the journal
    holds the whole session as one; the session keeps its language, task and prompt. Without it the
    resume is refused and the client starts over."""
    engine = RecordingEngine()

    async def scenario() -> None:
        config = _journaled(tmp_path) if journal else make_config()
        async with running_daemon(config, engine=engine) as daemon:
            port = daemon.port
            query = "language=zh-TW&task=translate&prompt=Grafana"
            conn = await connect(url(daemon, query=query))
            ready = json.loads(await conn.recv())
            sent = FOUR_BURSTS[: len(FOUR_BURSTS) - RATE // 2]
            await conn.send(sent.tobytes())
            shown = finals_of(await recv_until(conn, "final", 3))
            await asyncio.sleep(0.3)
            stopping = asyncio.create_task(collect(conn))
            await daemon.shutdown()
            ex = await stopping
        assert ex.close_code == 1001 and ex.of("error")[0]["code"] == "shutting_down"
        before = shown + ex.of("final")
        assert [f["segment"] for f in before] == [0, 1, 2, 3]

        again_config = (
            _journaled(tmp_path, port=port) if journal else make_config(server={"port": port})
        )
        async with running_daemon(again_config, engine=engine) as daemon:
            target = resume_url(url(daemon), ready["resume_token"], since=3)
            async with connect(target) as again:
                first = json.loads(await again.recv())
                if not journal:
                    assert first["code"] == "resume_failed"
                    assert (await collect(again)).close_code == 4410
                    return
                assert first["type"] == "resumed" and first["session"] == ready["session"]
                assert first["replayed"] == 1 and first["received_bytes"] == sent.nbytes
                assert first["audio_ms"] == len(sent) * 1000 // RATE
                assert json.loads(await again.recv()) == {
                    k: v for k, v in before[3].items() if k != "at"
                }
                await again.send(tone_bursts([0.6]).tobytes())
                await again.send(json.dumps({"type": "end"}))
                rest = await collect(again)
        (after,) = rest.of("final")
        assert after["segment"] == 4 and after["start_ms"] >= before[-1]["end_ms"]
        assert rest.of("done")[0]["segments"] == 5
        journaled = find_session(tmp_path / "journal", ready["session"])
        assert [f.segment for f in journaled.finals] == [0, 1, 2, 3, 4]
        assert journaled.ended and journaled.close_code == 1000
        assert set(engine.prompts) == {"Grafana"} and set(engine.tasks) == {"translate"}
        assert set(engine.languages) == {"zh"}
        # The part after the restart was opened from the journal's header, and wrote its own.
        assert journaled.header["chinese_variant"] == "zh-TW"

    run(scenario())


async def _stopped_for_a_restart(
    tmp_path: Path, query: str = "", engine: Engine | None = None
) -> tuple[int, dict[str, Any]]:
    """A journaled daemon's stream of four bursts, four finals received, then the daemon
    stopped: its port and the stream's `ready`."""
    async with running_daemon(_journaled(tmp_path), engine=engine) as daemon:
        port = daemon.port
        conn = await connect(url(daemon, query=query))
        ready = json.loads(await conn.recv())
        await conn.send(FOUR_BURSTS.tobytes())
        await recv_until(conn, "final", 4)
        stopping = asyncio.create_task(collect(conn))
        await daemon.shutdown()
        await stopping
    return port, ready


@pytest.mark.parametrize("query", ["language=de", "language=en,de"])
def test_a_resume_after_a_restart_on_a_model_without_its_language_is_refused(
    tmp_path: Path, query: str
) -> None:
    """A German session (or one detected among English and German) stopped for a restart on
    an English-only model: its resume is refused as its stream's connect would be, instead of
    decoding German as English (or, with a language the model has no token for, failing the
    batch of every stream with it)."""

    async def scenario() -> tuple[dict[str, Any], int | None]:
        port, ready = await _stopped_for_a_restart(tmp_path, query, RecordingEngine())
        english_only = RecordingEngine(multilingual=False)
        config = _journaled(tmp_path, port=port)
        async with running_daemon(config, engine=english_only) as daemon:
            again = await connect(resume_url(url(daemon), ready["resume_token"]))
            first = json.loads(await again.recv())
            code = (await collect(again)).close_code
        assert english_only.languages == []
        return first, code

    first, code = run(scenario())
    assert first["type"] == "error" and first["code"] == "bad_message"
    assert "English-only: language 'de'" in first["message"] and code == 1008


def test_two_resumes_at_once_after_a_restart_take_back_one_session(tmp_path: Path) -> None:
    """Two connections resume the same journaled session at once (a client retrying while its
    first resume still reads the journal): the later takes it over from the earlier, as from
    memory, and the journal gets each segment once."""

    async def scenario() -> None:
        port, ready = await _stopped_for_a_restart(tmp_path)
        async with running_daemon(_journaled(tmp_path, port=port)) as daemon:
            target = resume_url(url(daemon), ready["resume_token"], since=4)
            both = await asyncio.gather(connect(target), connect(target))
            for conn in both:
                assert json.loads(await conn.recv())["type"] == "resumed"
            closed, _ = await asyncio.wait(
                [asyncio.create_task(c.wait_closed()) for c in both], timeout=5
            )
            assert len(closed) == 1, "one connection is cut: the session is the other's"
            (kept,) = [c for c in both if c.state is not State.CLOSED]
            await kept.send(tone_bursts([0.6]).tobytes())
            await kept.send(json.dumps({"type": "end"}))
            rest = await collect(kept)
        assert [f["segment"] for f in rest.of("final")] == [4]
        journaled = find_session(tmp_path / "journal", ready["session"])
        assert [f.segment for f in journaled.finals] == [0, 1, 2, 3, 4]

    run(scenario())


@pytest.mark.model
def test_a_word_said_at_the_drop_is_not_lost(tiny_en: Engine, jfk: np.ndarray) -> None:
    """JFK with the real model, the connection dropped 5.5 s in, half a second into "what your
    country…" (the utterance open since "And so": "ask not" ends no sentence, so the pause
    after it did not end it), and the client back a second later: it resends from
    `received_bytes` and the finals are those of the same stream without a drop. (Finalised at
    the drop, the half second decoded to nothing and "what" was lost.)"""
    pcm = (jfk * 32767).astype("<i2")
    cut = 5_500 * RATE // 1000
    # No partials: their stable words shape a final and depend on how fast this machine
    # decodes, so with them the two streams' finals may differ for reasons other than the drop.
    config = make_config(server={"max_audio_speed": 1e6}, stream={"partial_interval_ms": 60_000})

    async def send(conn: ClientConnection, audio: bytes) -> None:
        for start in range(0, len(audio), 3200):
            await conn.send(audio[start : start + 3200])
            await asyncio.sleep(0.02)

    async def undropped() -> list[str]:
        async with running_daemon(config, engine=tiny_en, vad_factory=None) as daemon:
            ex = await stream_pcm(url(daemon), pcm, chunk_samples=3200, pause_s=0.02)
        return [f["text"] for f in ex.of("final")]

    async def dropped() -> list[str]:
        async with running_daemon(config, engine=tiny_en, vad_factory=None) as daemon:
            conn = await connect(url(daemon))
            token = json.loads(await conn.recv())["resume_token"]
            await send(conn, pcm[:cut].tobytes())
            await asyncio.sleep(0.5)
            drop(conn)
            await asyncio.sleep(1.0)
            async with connect(resume_url(url(daemon), token, since=0)) as again:
                resumed = json.loads(await again.recv())
                await send(again, pcm.tobytes()[resumed["received_bytes"] :])
                await again.send(json.dumps({"type": "end"}))
                after = await collect(again)
        return [f["text"] for f in after.of("final")]

    expected = asyncio.run(asyncio.wait_for(undropped(), 120))
    texts = asyncio.run(asyncio.wait_for(dropped(), 120))
    assert "what your country" in texts[0].lower(), texts
    assert texts == expected
