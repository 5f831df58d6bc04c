"""Several daemons as one service: instance names in session ids, a journal folder they share
(a session is never held by two; one let go, handed over on request, or whose daemon died, is
taken back by another),
and the drain a stop begins with (/readyz fails, new streams are sent elsewhere). HAProxy in
front of real processes: tests/deploy/test_haproxy.py."""

from __future__ import annotations

import asyncio
import json
import socket
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from daemon_harness import (
    collect,
    drop,
    make_config,
    recv_until,
    resume_url,
    running_daemon,
    tone_bursts,
    url,
)
from websockets.asyncio.client import connect

from captiond.config import Config
from captiond.engines.fake import FakeEngine
from captiond.errors import ConfigError
from captiond.journal import handover
from captiond.journal.reader import find_session
from captiond.journal.writer import Ownership, SessionOwnedError
from captiond.server.access import client_address
from captiond.server.load import LOOP_TICK_S, LoadWatch, agent_reply
from captiond.server.resume import session_of_token
from captiond.server.routing import WorkerSlot, worker_of_session

FOUR_BURSTS = tone_bursts([0.6, 0.6, 0.6, 0.6], gap_s=1.0)
LOUD = tone_bursts([6.0], gap_s=0.0)  # one long utterance: partial after partial
RATE = 16_000


def run(coro: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coro, 60))


def _finals(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [m for m in messages if m["type"] == "final"]


def _shared(tmp_path: Path, instance: str, **server: Any) -> Config:
    """An instance of a set that shares one journal folder."""
    return make_config(
        server={"instance": instance, "drop_grace_s": 30.0, **server},
        journal={"dir": str(tmp_path / "journal")},
    )


def test_session_ids_start_with_the_instance_name() -> None:
    async def scenario() -> None:
        async with (
            running_daemon(make_config(server={"instance": "gpu1"})) as daemon,
            connect(url(daemon)) as conn,
        ):
            ready = json.loads(await conn.recv())
        assert ready["session"].startswith("gpu1_")
        assert session_of_token(ready["resume_token"]) == ready["session"]

    run(scenario())
    # Workers route on the number after the name, as they do without one.
    slot = WorkerSlot(index=2, count=3)
    session = slot.new_session_id("gpu1")
    assert session.startswith("gpu1_") and worker_of_session(session, 3) == 2


@pytest.mark.parametrize("name", ["GPU1", "gpu_1", "-gpu", "gpu-", "a" * 41])
def test_an_instance_name_that_is_no_dns_label_is_refused(name: str) -> None:
    from captiond.config import config_from_mapping

    with pytest.raises(ConfigError, match="instance"):
        config_from_mapping({"server": {"instance": name}})


def test_a_live_instance_hands_a_session_over_to_the_one_its_client_resumes_on(
    tmp_path: Path,
) -> None:
    """Instance b is asked for a session that instance a still holds (its client away, the
    resume sent elsewhere: ingress-nginx, or another route): b asks a through the shared
    folder, a lets it go as a drain does (the utterance open at the drop decoded, its end
    record 1001), and b takes it back at once. Every final reaches the client exactly once,
    and the session's journal is one story: a's part, then b's."""

    async def scenario() -> tuple[dict[str, Any], list[dict[str, Any]], float]:
        async with (
            running_daemon(_shared(tmp_path, "a")) as a,
            running_daemon(_shared(tmp_path, "b")) as b,
        ):
            conn = await connect(url(a))
            ready = json.loads(await conn.recv())
            await conn.send(FOUR_BURSTS[: 2 * RATE].tobytes())  # a burst and a half
            await recv_until(conn, "final", 1)
            drop(conn)
            await asyncio.sleep(0.2)
            # Only the session's own client can move it: a forged token moves nothing.
            forged = f"{ready['session']}.not-its-secret"
            async with connect(resume_url(url(b), forged)) as bad:
                error = json.loads(await bad.recv())
                await bad.wait_closed()
            assert (error["code"], bad.close_code) == ("resume_failed", 4410) and a._live
            loop = asyncio.get_running_loop()
            asked_s = loop.time()
            async with connect(resume_url(url(b), ready["resume_token"], since=0)) as back:
                resumed = json.loads(await back.recv())
                waited_s = loop.time() - asked_s
                assert resumed["type"] == "resumed", resumed
                assert not a._live  # let go, not held for a resume any more
                start_sample = resumed["received_bytes"] // 2
                await back.send(FOUR_BURSTS[start_sample:].tobytes())
                await back.send(json.dumps({"type": "end"}))
                ex = await collect(back)
        assert not (tmp_path / "journal" / "handover").exists() or not any(
            (tmp_path / "journal" / "handover").iterdir()
        )  # the request was withdrawn
        return ready, ex.of("final"), waited_s

    ready, finals, waited_s = run(scenario())
    # The half burst open at the drop was decoded by a; the client sends on after it.
    assert [f["segment"] for f in finals] == list(range(len(finals))) and len(finals) == 4
    session = find_session(tmp_path / "journal", ready["session"])
    assert [(f.segment, f.text) for f in session.finals] == [
        (f["segment"], f["text"]) for f in finals
    ]
    assert session.end is not None and session.end["close_code"] == 1000
    assert waited_s < handover.WAIT_S
    print(f"handed over: resumed {1000 * waited_s:.0f} ms after the resume reached b")


def test_a_request_whose_asker_died_lets_the_session_go_once(tmp_path: Path) -> None:
    """A handover request left behind (its asker died while it waited) makes the holder let
    the session go once and is answered: taken back afterwards, here by the same instance, the
    session stays."""

    async def scenario() -> None:
        async with running_daemon(_shared(tmp_path, "a")) as a:
            conn = await connect(url(a))
            ready = json.loads(await conn.recv())
            await conn.send(FOUR_BURSTS[: 2 * RATE].tobytes())
            await recv_until(conn, "final", 1)
            drop(conn)
            handover.request(tmp_path / "journal", ready["session"])
            for _ in range(50):
                await asyncio.sleep(0.1)
                if not a._live:
                    break
            assert not a._live and not handover.requested(tmp_path / "journal")
            async with connect(resume_url(url(a), ready["resume_token"])) as back:
                assert json.loads(await back.recv())["type"] == "resumed"
                await asyncio.sleep(3 * handover.POLL_S)
                assert ready["session"] in a._live
                assert not a._live[ready["session"]].finished.is_set()

    run(scenario())


def test_a_folder_that_takes_no_request_refuses_the_resume_and_keeps_the_owner(
    tmp_path: Path,
) -> None:
    """`handover` cannot be made in the shared folder (here a file is in its way): the
    instance asked, which cannot ask, refuses the resume with `overloaded`, and the owner,
    which cannot read requests either, keeps its session."""

    async def scenario() -> None:
        (tmp_path / "journal").mkdir()
        (tmp_path / "journal" / handover.HANDOVER_DIR).write_text("in the way")
        async with (
            running_daemon(_shared(tmp_path, "a")) as a,
            running_daemon(_shared(tmp_path, "b")) as b,
        ):
            conn = await connect(url(a))
            ready = json.loads(await conn.recv())
            await conn.send(FOUR_BURSTS[: 2 * RATE].tobytes())
            await recv_until(conn, "final", 1)
            drop(conn)
            async with connect(resume_url(url(b), ready["resume_token"])) as wrong:
                refused = json.loads(await wrong.recv())
            assert refused["code"] == "overloaded"
            await asyncio.sleep(3 * handover.POLL_S)
            assert ready["session"] in a._live

    run(scenario())


def test_a_session_is_never_held_by_two_instances(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An owner that does not let the session go (here, one with no instance name, which
    does not look for requests; in life, one wedged): after handover.WAIT_S the instance asked
    refuses with `overloaded` (1013, which clients retry) and has written nothing. Once the
    owner stops (its last finals, 1001), it takes the session back."""
    monkeypatch.setattr(handover, "WAIT_S", 0.5)

    async def scenario() -> None:
        async with (
            running_daemon(_shared(tmp_path, "")) as a,
            running_daemon(_shared(tmp_path, "b")) as b,
        ):
            conn = await connect(url(a))
            ready = json.loads(await conn.recv())
            await conn.send(FOUR_BURSTS[: 2 * RATE].tobytes())
            before = _finals(await recv_until(conn, "final", 1))
            drop(conn)
            await asyncio.sleep(0.2)
            token = ready["resume_token"]
            async with connect(resume_url(url(b), token)) as wrong:
                refused = json.loads(await wrong.recv())
                await wrong.wait_closed()
            assert refused["code"] == "overloaded" and wrong.close_code == 1013
            files = sorted(p.name for p in (tmp_path / "journal").glob("*.jsonl"))
            assert len(files) == 1, files  # b wrote no part of a's session
            await a.shutdown()
            async with connect(resume_url(url(b), token, since=0)) as back:
                resumed = json.loads(await back.recv())
                replay = _finals(await recv_until(back, "final", 1))
        assert resumed["type"] == "resumed"
        assert [f["text"] for f in replay] == [f["text"] for f in before]
        session = find_session(tmp_path / "journal", ready["session"])
        assert [f.segment for f in session.finals] == [f["segment"] for f in before]

    run(scenario())


def test_a_session_whose_daemon_died_is_taken_back_from_its_last_final(tmp_path: Path) -> None:
    """No end record and no lock (its daemon died: here, its lock let go without one): the
    session is taken back from its last journaled final, and the client is told to send the
    audio after that final again (`received_bytes`, in whole samples)."""

    async def scenario() -> tuple[dict[str, Any], list[dict[str, Any]], dict[str, Any]]:
        async with running_daemon(_shared(tmp_path, "b")) as b:
            journal_dir = tmp_path / "journal"
            async with running_daemon(_shared(tmp_path, "a")) as a:
                conn = await connect(url(a))
                ready = json.loads(await conn.recv())
                await conn.send(FOUR_BURSTS[: int(3.5 * RATE)].tobytes())
                finals = _finals(await recv_until(conn, "final", 2))
                # What a crash leaves: the lock is gone with the process, no end record.
                session = find_session(journal_dir, ready["session"])
                for live in list(a._live.values()):
                    assert live.journal is not None
                    target = live.journal._target
                    assert target.owner is not None
                    target.owner.release()
                    live.journal._closed = True  # the dead daemon writes no end record
                assert session.end is None
                async with connect(resume_url(url(b), ready["resume_token"], since=0)) as back:
                    resumed = json.loads(await back.recv())
                    replay = _finals(await recv_until(back, "final", 2))
                drop(conn)
        return resumed, replay, {"finals": finals}

    resumed, replay, seen = run(scenario())
    assert resumed["type"] == "resumed"
    last = seen["finals"][-1]
    assert resumed["audio_ms"] == last["end_ms"]
    assert resumed["received_bytes"] == last["end_ms"] * RATE // 1000 * 2
    assert [f["text"] for f in replay] == [f["text"] for f in seen["finals"]]


def test_ownership_is_one_lock_per_session_file(tmp_path: Path) -> None:
    first = tmp_path / "20261206T000000Z-a_0123456789ab.jsonl"
    first.write_text("")
    held = Ownership.take(first)
    with pytest.raises(SessionOwnedError):
        Ownership.take(first)
    held.release()
    again = Ownership.take(first)
    assert again.held
    again.release()
    assert not again.held


def test_a_draining_daemon_is_not_ready_and_sends_new_streams_away() -> None:
    """While a stop drains the streams (here one whose last decode takes a second): /readyz
    answers 503, /healthz stays 200 (alive: no restart), and a new stream gets
    `shutting_down` (1001), which clients take to another instance."""

    async def scenario() -> None:
        async with running_daemon(engine=FakeEngine(delay_s=1.0)) as daemon:
            base = f"http://127.0.0.1:{daemon.port}"
            assert await asyncio.to_thread(_get, base + "/readyz") == (200, "ready\n")
            conn = await connect(url(daemon))
            await conn.recv()
            await conn.send(FOUR_BURSTS[:RATE].tobytes())
            await asyncio.sleep(0.3)
            stopping = asyncio.create_task(daemon.shutdown())
            await asyncio.sleep(0.2)
            assert await asyncio.to_thread(_get, base + "/readyz") == (
                503,
                "draining: no new streams\n",
            )
            assert (await asyncio.to_thread(_get, base + "/healthz"))[0] == 200
            async with connect(url(daemon)) as late:
                refused = json.loads(await late.recv())
                await late.wait_closed()
            assert refused["code"] == "shutting_down" and late.close_code == 1001
            ex = await collect(conn)
            await stopping
        assert ex.of("error")[-1]["code"] == "shutting_down"

    run(scenario())


def _get(target: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(target, timeout=5) as answer:
            return int(answer.status), answer.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def test_the_lag_watch_takes_the_90th_percentile_of_the_last_seconds() -> None:
    watch = LoadWatch(max_lag_ms=1_000)
    for i in range(4):
        watch.observe(float(i), 5_000)
    assert watch.behind_ms(4.0) == 0 and not watch.behind(4.0, 1)  # too few partials to tell
    for i in range(16):
        watch.observe(4.0 + i / 10, 200)
    # 20 partials, 4 of them late: the 90th percentile is late.
    assert watch.behind_ms(5.6) == 5_000 and watch.behind(5.6, 1)
    assert "5000 ms behind" in (watch.why_behind(5.6, 1) or "")
    # Five seconds on, the late ones have left the window.
    assert watch.behind_ms(8.5) == 200 and not watch.behind(8.5, 1)
    assert not LoadWatch(max_lag_ms=0).behind(0.0, 1)  # 0: no bound
    assert agent_reply(behind=False, full=False) == "up ready 100%\n"
    assert agent_reply(behind=True, full=False) == agent_reply(behind=False, full=True)


def _ticks(watch: LoadWatch, from_s: float, to_s: float, busy: float, streams: int) -> None:
    """`watch_loop`'s ticks from `from_s` to `to_s`: the loop `busy` of the time, with
    `streams` open (the CPU time goes on from where the last tick left it)."""
    cpu_s = watch._ticks[-1][1] if watch._ticks else 0.0
    now_s = from_s
    while now_s <= to_s + 1e-9:
        watch.observe_loop(now_s, cpu_s, streams)
        now_s += LOOP_TICK_S
        cpu_s += busy * LOOP_TICK_S


def test_the_busy_watch_projects_a_streams_cost_onto_the_next_one() -> None:
    watch = LoadWatch(max_lag_ms=0, max_loop_busy=0.7)
    assert watch.busy_share() == 0.0 and not watch.behind(0.0, 500)  # nothing measured yet
    # Five streams keep the loop 5 % busy: too few to say what one costs.
    _ticks(watch, 0.0, 3.0, busy=0.05, streams=5)
    assert watch.busy_share() == pytest.approx(0.05)
    assert watch.projected_busy(500) == pytest.approx(0.05) and not watch.behind(3.0, 500)
    # 30 streams at 30 %: 0.01 each, so a 69th stream would make 0.69 and a 71st 0.71.
    _ticks(watch, 3.1, 6.0, busy=0.3, streams=30)
    assert watch.projected_busy(68) == pytest.approx(0.69) and not watch.behind(6.0, 68)
    assert watch.behind(6.0, 70)
    assert "event loop 71% busy (max_loop_busy 0.7)" in (watch.why_behind(6.0, 70) or "")
    # Sixty streams later cost less each (36 %), but the highest cost of the last minute
    # is what counts: 60 open already make 0.6, and a 71st still 0.71.
    _ticks(watch, 6.1, 9.0, busy=0.36, streams=60)
    assert watch.projected_busy(70) == pytest.approx(0.71)
    # A minute on, only the cheaper cost is remembered.
    _ticks(watch, 9.1, 70.0, busy=0.36, streams=60)
    assert watch.projected_busy(69) == pytest.approx(0.006 * 70)
    # A loop already past the bound refuses whatever the count.
    _ticks(watch, 70.1, 73.0, busy=0.8, streams=5)
    assert watch.behind(73.0, 0)
    assert not LoadWatch(max_lag_ms=0).behind(73.0, 10_000)  # 0: no bound


def test_a_burst_into_an_idle_instance_is_shed_until_a_stream_is_measured() -> None:
    """With no cost learned, the dearest window since the streams began is projected,
    handshakes and all: the door closes early in the burst, stays closed while the count holds
    and the arrivals leave the window (the latest window alone would say a stream is cheaper),
    and opens as far as the cost learned once the count held steady allows."""
    watch = LoadWatch(max_lag_ms=0, max_loop_busy=0.8)
    _ticks(watch, 0.0, 2.0, busy=0.01, streams=0)  # idle
    # 100 streams pour in over a second, their handshakes keeping the loop 60 % busy.
    cpu_s = watch._ticks[-1][1]
    for i in range(1, 11):
        cpu_s += 0.6 * LOOP_TICK_S
        watch.observe_loop(2.0 + i * LOOP_TICK_S, cpu_s, 10 * i)
    # The window's busy share is 0.3 over 16 streams on average: 0.019 each.
    assert watch.behind(3.0, 100)
    # The burst is over; refusals keep the loop 30 % busy for two more seconds.
    _ticks(watch, 3.1, 4.0, busy=0.3, streams=100)
    assert watch.behind(4.0, 100)  # the latest window's 0.006 each would let in 35 more
    # Once the count has held for a whole window, what a stream costs is known: 0.003.
    _ticks(watch, 4.1, 6.5, busy=0.3, streams=100)
    assert watch.projected_busy(100) == pytest.approx(0.303)
    assert not watch.behind(6.5, 265) and watch.behind(6.5, 266)
    # Back to idle, the unsteady estimate is forgotten (the steady cost, for COST_MEMORY_S).
    _ticks(watch, 6.6, 70.0, busy=0.01, streams=0)
    assert watch.projected_busy(500) == pytest.approx(0.01)


def test_a_daemon_whose_event_loop_is_busy_refuses_new_streams() -> None:
    """`max_loop_busy` measured on the daemon's real loop: a callback that spends 80 ms of the
    loop thread's CPU in every 100 ms keeps it busy past 0.2, so a new stream gets `overloaded`
    (1013) naming the loop, and the busy share is on /metrics; once the loop is quiet again a
    stream is let in."""
    config = make_config(server={"max_loop_busy": 0.2})

    async def scenario() -> None:
        async with running_daemon(config) as daemon:
            hog_until_s = time.monotonic() + 3.0

            async def hog() -> None:
                while time.monotonic() < hog_until_s:
                    spent_until = time.thread_time() + 0.08
                    while time.thread_time() < spent_until:
                        pass
                    await asyncio.sleep(0.02)

            hogging = asyncio.create_task(hog())
            await asyncio.sleep(2.5)
            async with connect(url(daemon)) as refused_conn:
                refused = json.loads(await refused_conn.recv())
                await refused_conn.wait_closed()
            assert refused["code"] == "overloaded" and refused_conn.close_code == 1013
            assert "event loop" in refused["message"]
            status, metrics = await asyncio.to_thread(
                _get, f"http://127.0.0.1:{daemon.port}/metrics"
            )
            busy = next(
                float(line.split()[-1])
                for line in metrics.splitlines()
                if line.startswith("captiond_event_loop_busy_ratio ")
            )
            assert status == 200 and busy > 0.2
            await hogging
            await asyncio.sleep(2.5)  # the busy share of the last 2 s is the quiet loop's
            async with connect(url(daemon)) as let_in:
                assert json.loads(await let_in.recv())["type"] == "ready"

    run(scenario())


def test_a_daemon_behind_refuses_new_streams_and_drains_its_agent(tmp_path: Path) -> None:
    """Decodes that take 0.6 s each put one stream's partials far past `max_lag_ms` (100):
    a new stream gets `overloaded` (1013) naming the lag, the agent check answers `drain`, and
    the stream itself goes on (its resume too)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        agent_port = probe.getsockname()[1]
    config = make_config(server={"max_lag_ms": 100.0, "agent_port": agent_port})

    async def agent() -> str:
        reader, writer = await asyncio.open_connection("127.0.0.1", agent_port)
        line = await reader.readline()
        writer.close()
        return line.decode()

    async def scenario() -> None:
        async with running_daemon(config, engine=FakeEngine(delay_s=0.6)) as daemon:
            assert await agent() == "up ready 100%\n"
            conn = await connect(url(daemon))
            ready = json.loads(await conn.recv())
            for start in range(0, 6 * RATE, RATE // 5):
                await conn.send(LOUD[start : start + RATE // 5].tobytes())
                await asyncio.sleep(0.2)
            assert daemon.load.behind(asyncio.get_running_loop().time(), daemon.sessions_open)
            async with connect(url(daemon)) as late:
                refused = json.loads(await late.recv())
                await late.wait_closed()
            assert refused["code"] == "overloaded" and late.close_code == 1013
            assert "behind" in refused["message"]
            assert await agent() == "up drain\n"
            drop(conn)
            async with connect(resume_url(url(daemon), ready["resume_token"])) as back:
                assert json.loads(await back.recv())["type"] == "resumed"

    run(scenario())


@pytest.mark.parametrize(
    ("peer", "header", "client"),
    [
        ("127.0.0.1", "203.0.113.7", "203.0.113.7"),  # the balancer's word
        ("127.0.0.1", "198.51.100.1, 203.0.113.7", "203.0.113.7"),  # the last hop it added
        ("10.1.2.3", "203.0.113.7", "203.0.113.7"),  # a trusted network
        ("192.0.2.9", "203.0.113.7", "192.0.2.9"),  # anyone else's header: ignored
        ("127.0.0.1", "not an address", "127.0.0.1"),
        ("127.0.0.1", None, "127.0.0.1"),
    ],
)
def test_a_trusted_balancers_forwarded_for_names_the_client(
    peer: str, header: str | None, client: str
) -> None:
    assert client_address(peer, header, ["127.0.0.1", "10.0.0.0/8"]) == client
    assert client_address(peer, header, []) == peer


def test_per_ip_limits_count_clients_behind_a_trusted_balancer() -> None:
    """Two streams "from" one client behind the balancer (127.0.0.1, trusted) hit a limit of
    one per address; a second client's stream does not."""
    config = make_config(
        server={"max_sessions_per_ip": 1, "trusted_proxies": ("127.0.0.1",), "resume_s": 0}
    )

    async def scenario() -> list[str]:
        async with running_daemon(config) as daemon:
            answers = []
            for client in ("203.0.113.7", "203.0.113.7", "203.0.113.8"):
                headers = {"X-Forwarded-For": client}
                conn = await connect(url(daemon), additional_headers=headers)
                answers.append(json.loads(await conn.recv()).get("code", "ready"))
            return answers

    assert run(scenario()) == ["ready", "overloaded", "ready"]


def test_trusted_proxies_must_be_addresses_or_networks() -> None:
    from captiond.config import config_from_mapping

    assert config_from_mapping({"server": {"trusted_proxies": ["10.0.0.0/8", "::1"]}})
    with pytest.raises(ConfigError, match="trusted_proxies"):
        config_from_mapping({"server": {"trusted_proxies": ["haproxy.local"]}})
