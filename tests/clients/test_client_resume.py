"""The Python client across a dropped network and a daemon restart: no final lost, none twice.

A real daemon (fake engine, scripted VAD) behind a TCP proxy that the test can cut as a pulled
cable would (both sockets aborted, no close frame). The client (`captiond_client.stream`) keeps
its source running, reconnects with backoff, resumes with the session's token, resends the audio
the daemon did not get, and reports every final exactly once.
"""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from daemon_harness import RATE, make_config, running_daemon, tone_bursts

from captiond.journal.reader import find_session
from captiond_client.stream import Stream, StreamError, paced_chunks, stream_samples

Message = dict[str, Any]
# Ten 0.6-s "words" a second apart, streamed at 4x real time: ~4 s of streaming.
PCM = tone_bursts([0.6] * 10, gap_s=1.0)
SPEED = 4.0


class Proxy:
    """A TCP forwarder on a free port; `cut` aborts every connection through it. While
    `unavailable` is above 0, each new connection is answered HTTP 503 instead (a reverse
    proxy whose daemon is restarting), and counts it down; while `unanswered` is, it is
    closed without a word (an ssh tunnel or a TCP balancer whose daemon is away)."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.pairs: list[tuple[asyncio.StreamWriter, asyncio.StreamWriter]] = []
        self.server: asyncio.Server | None = None
        self.unavailable = 0
        self.unanswered = 0

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        port: int = self.server.sockets[0].getsockname()[1]
        return port

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.unanswered > 0:
            self.unanswered -= 1
            writer.close()
            return
        if self.unavailable > 0:
            self.unavailable -= 1
            await reader.readuntil(b"\r\n\r\n")
            writer.write(
                b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 11\r\n\r\nrestarting\n"
            )
            await writer.drain()
            writer.close()
            return
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            writer.transport.abort()
            return
        self.pairs.append((writer, up_writer))
        await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))

    def cut(self) -> None:
        for a, b in self.pairs:
            a.transport.abort()
            b.transport.abort()
        self.pairs.clear()

    def close(self) -> None:
        self.cut()
        if self.server is not None:
            self.server.close()


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    with contextlib.suppress(OSError):
        while data := await reader.read(65_536):
            writer.write(data)
            await writer.drain()
    writer.transport.abort()


def samples() -> np.ndarray:
    return PCM.astype(np.float32) / 32768


def start_client(port: int, messages: list[Message], **options: Any) -> asyncio.Task[None]:
    """The client streaming PCM at SPEED to the daemon (or proxy) on `port`."""
    target = f"ws://127.0.0.1:{port}/v1/stream"
    return asyncio.create_task(
        stream_samples(target, samples(), speed=SPEED, on_message=messages.append, **options)
    )


def uncaptioned_words_ms(finals: list[Message]) -> list[int]:
    """The middles of PCM's words (after 0.5 s of silence, 0.6 s each, a second apart) that no
    final's span holds."""
    middles = [500 + i * 1_600 + 300 for i in range(10)]
    return [m for m in middles if not any(f["start_ms"] <= m <= f["end_ms"] for f in finals)]


def check_exactly_once(messages: list[Message]) -> list[Message]:
    finals = [m for m in messages if m["type"] == "final"]
    assert [f["segment"] for f in finals] == list(range(len(finals))), "each final once, in order"
    ends = [f["end_ms"] for f in finals]
    assert ends == sorted(ends), "times go on across reconnects"
    return finals


@pytest.mark.parametrize(("pulls", "answered_503"), [(2, 0), (1, 2)])
def test_a_pulled_cable_loses_no_final(
    tmp_path: Path, pulls: int, answered_503: int, caplog: pytest.LogCaptureFixture
) -> None:
    """Pulls while words are streaming; with `answered_503`, the first reconnects after the
    pull meet a reverse proxy whose daemon is away (HTTP 503): tried again, not given up (the
    client's backoff then takes most of the stream's 4 s, hence one pull). The backoff starts
    over after each resume: a later drop waits 0.5 s again, not the doubled delay."""

    async def scenario() -> tuple[list[Message], Any]:
        config = make_config(journal={"dir": str(tmp_path)})
        async with running_daemon(config) as daemon:
            proxy = Proxy(daemon.port)
            port = await proxy.start()
            messages: list[Message] = []
            client = start_client(port, messages)
            for _ in range(pulls):
                await asyncio.sleep(1.2)
                proxy.unavailable = answered_503
                proxy.cut()
            await asyncio.wait_for(client, 30)
            proxy.close()
            assert proxy.unavailable == 0, "the client tried again through the 503s"
            session = next(m["session"] for m in messages if m["type"] == "ready")
            return messages, find_session(tmp_path, session)

    messages, journaled = asyncio.run(scenario())
    finals = check_exactly_once(messages)
    assert [m["type"] for m in messages].count("resumed") == pulls
    assert [(f["segment"], f["text"]) for f in finals] == [
        (f.segment, f.text) for f in journaled.finals
    ], "the client holds every final the daemon committed"
    # All ten words arrived (a word cut by a pull goes on in the resumed utterance).
    assert sum(len(f["text"].split()) for f in finals) >= 10
    assert finals[-1]["end_ms"] >= len(PCM) * 1000 // RATE - 1_100
    delays = [r.message.rsplit(" in ", 1)[1] for r in caplog.records if "reconnecting" in r.message]
    assert delays == ["0.5 s", "1.0 s", "2.0 s"][: answered_503 + 1] * pulls


def test_back_after_the_session_expired_the_client_resends_what_the_burst_allows(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Away longer than `resume_s` (the defaults scaled down: 1 s, and an `audio_burst_s` of
    3 s), the client starts a new session and sends it at most `fresh_resend_s` of the audio
    it missed, not all of it at once, which the daemon refuses (`rate_limited`); it says what
    it skipped, and the new session's times go on from the audio it got."""

    async def scenario() -> list[Message]:
        config = make_config(server={"resume_s": 1.0, "audio_burst_s": 3.0})
        async with running_daemon(config) as daemon:
            proxy = Proxy(daemon.port)
            port = await proxy.start()
            messages: list[Message] = []
            client = start_client(port, messages, fresh_resend_s=2.0)
            await asyncio.sleep(1.2)
            proxy.unavailable = 3  # away for the backoff's 0.5 + 1 + 2 s: the session expires
            proxy.cut()
            await asyncio.wait_for(client, 30)
            proxy.close()
            return messages

    messages = asyncio.run(scenario())
    kinds = [m["type"] for m in messages]
    assert kinds.count("ready") == 2 and "error" not in kinds and kinds[-1] == "done"
    assert any("were not resent" in r.message for r in caplog.records)
    finals = check_exactly_once(messages)
    # Stream audio time, not wall time: the new session's clock starts where its audio does.
    assert finals[-1]["end_ms"] >= len(PCM) * 1000 // RATE - 1_100


@pytest.mark.parametrize("journal", [True, False])
def test_a_daemon_restart_loses_no_final(tmp_path: Path, journal: bool) -> None:
    """With the journal the session is resumed by the new daemon; without it the client starts
    a new session from the audio the old one had not transcribed, numbering on."""

    async def scenario() -> list[Message]:
        sections: dict[str, Any] = {"journal": {"dir": str(tmp_path)}} if journal else {}
        messages: list[Message] = []
        async with running_daemon(make_config(**sections)) as daemon:
            port = daemon.port
            client = start_client(port, messages)
            await asyncio.sleep(1.5)
        await asyncio.sleep(1.0)  # the daemon is away
        restarted = make_config(server={"port": port}, **sections)
        async with running_daemon(restarted):
            await asyncio.wait_for(client, 30)
        return messages

    messages = asyncio.run(scenario())
    finals = check_exactly_once(messages)
    kinds = [m["type"] for m in messages]
    assert kinds.count("ready") == (1 if journal else 2)
    assert kinds.count("resumed") == (1 if journal else 0)
    assert uncaptioned_words_ms(finals) == []
    # `done` counts the whole stream, as one session would (the new session's own count and
    # audio start over).
    done = messages[-1]
    assert done["type"] == "done" and done["segments"] >= len(finals)
    assert done["audio_ms"] == len(PCM) * 1000 // RATE


def test_a_resume_after_a_restart_sends_its_backlog_at_a_pace_the_daemon_takes(
    tmp_path: Path,
) -> None:
    """A session the restarted daemon takes back from its journal gets a fresh speed limit:
    the first `audio_burst_s` (here 3 s), then `max_audio_speed` (10x). The seconds of audio
    a 4x stream made while the daemon was away go out at most `fresh_resend_s` (2 s) ahead of
    8x real time, not at once, which was `rate_limited`."""

    async def scenario() -> list[Message]:
        sections: dict[str, Any] = {"journal": {"dir": str(tmp_path)}}
        limits = {"audio_burst_s": 3.0}
        messages: list[Message] = []
        async with running_daemon(make_config(server=limits, **sections)) as daemon:
            port = daemon.port
            client = start_client(port, messages, fresh_resend_s=2.0)
            await asyncio.sleep(1.2)
        await asyncio.sleep(1.5)  # the daemon is away: 6 s of audio or more wait for it
        async with running_daemon(make_config(server={"port": port, **limits}, **sections)):
            await asyncio.wait_for(client, 30)
        return messages

    messages = asyncio.run(scenario())
    kinds = [m["type"] for m in messages]
    assert "error" not in kinds and kinds.count("resumed") == 1 and kinds[-1] == "done"
    assert uncaptioned_words_ms(check_exactly_once(messages)) == []


def test_an_unreachable_daemon_is_an_error_at_once() -> None:
    with pytest.raises(StreamError, match="cannot reach"):
        asyncio.run(
            stream_samples("ws://127.0.0.1:9/v1/stream", samples(), on_message=lambda m: None)
        )


def test_a_relay_that_closes_unanswered_while_the_daemon_is_away_is_retried() -> None:
    """A tunnel that accepts the connection and closes it without an HTTP answer (websockets'
    InvalidMessage) is a daemon away, like a refused connection: reconnect and resume."""

    async def scenario() -> list[Message]:
        async with running_daemon() as daemon:
            proxy = Proxy(daemon.port)
            port = await proxy.start()
            messages: list[Message] = []
            client = start_client(port, messages)
            await asyncio.sleep(1.2)
            proxy.unanswered = 2
            proxy.cut()
            await asyncio.wait_for(client, 30)
            proxy.close()
            assert proxy.unanswered == 0
            return messages

    messages = asyncio.run(scenario())
    assert [m["type"] for m in messages].count("resumed") == 1
    assert uncaptioned_words_ms(check_exactly_once(messages)) == []


def test_a_daemon_that_does_not_resume_loses_no_final_after_a_drop() -> None:
    """`resume_s = 0`: every reconnect is a new session, whose segments count from 0 again;
    the client numbers them on after the earlier sessions' and reports each."""

    async def scenario() -> list[Message]:
        async with running_daemon(make_config(server={"resume_s": 0.0})) as daemon:
            proxy = Proxy(daemon.port)
            port = await proxy.start()
            messages: list[Message] = []
            client = start_client(port, messages)
            await asyncio.sleep(1.2)
            proxy.cut()
            await asyncio.wait_for(client, 30)
            proxy.close()
            return messages

    messages = asyncio.run(scenario())
    readies = [m for m in messages if m["type"] == "ready"]
    assert len(readies) == 2 and all(r["resume_token"] is None for r in readies)
    assert uncaptioned_words_ms(check_exactly_once(messages)) == []


def test_at_full_speed_the_whole_file_is_sent_at_the_pace_the_daemon_allows() -> None:
    """`--speed 0`: the first session gets the file from its start, not only its newest
    `fresh_resend_s`; past that burst it goes at `max_send_speed`, under the daemon's
    `max_audio_speed` (here scaled down: a 3-s burst, 4x), so it is not refused."""

    async def scenario() -> list[Message]:
        config = make_config(server={"audio_burst_s": 3.0, "max_audio_speed": 4.0})
        async with running_daemon(config) as daemon:
            messages: list[Message] = []
            target = f"ws://127.0.0.1:{daemon.port}/v1/stream"
            await stream_samples(
                target,
                samples(),
                speed=0,
                on_message=messages.append,
                fresh_resend_s=2.0,
                max_send_speed=3.0,
            )
            return messages

    messages = asyncio.run(scenario())
    assert uncaptioned_words_ms(check_exactly_once(messages)) == []
    assert messages[-1]["type"] == "done" and messages[-1]["audio_ms"] == len(PCM) * 1000 // RATE


def test_the_client_paces_itself_under_the_limit_its_daemon_announces() -> None:
    """A daemon with lower limits than the defaults (a 3-s burst, then 3x real time) says so
    in `ready`; the client, at `--speed 0`, sends at most 80 % of them, not its own 50 s and
    8x, which that daemon refuses (`rate_limited`)."""

    async def scenario() -> list[Message]:
        config = make_config(server={"audio_burst_s": 3.0, "max_audio_speed": 3.0})
        async with running_daemon(config) as daemon:
            messages: list[Message] = []
            target = f"ws://127.0.0.1:{daemon.port}/v1/stream"
            await stream_samples(target, samples(), speed=0, on_message=messages.append)
            return messages

    messages = asyncio.run(scenario())
    assert messages[0]["max_audio_speed"] == 3.0 and messages[0]["audio_burst_s"] == 3.0
    assert uncaptioned_words_ms(check_exactly_once(messages)) == []


def test_an_overloaded_daemon_is_waited_for_even_before_a_first_session() -> None:
    """`overloaded` (1013, try later) answers: the URL is right, so the client retries within
    `retry_for_s` instead of giving up as for a daemon that never answered."""

    async def scenario() -> list[Message]:
        async with running_daemon(make_config(server={"max_sessions": 1})) as daemon:
            target = f"ws://127.0.0.1:{daemon.port}/v1/stream"
            blocker: list[Message] = []
            first = asyncio.create_task(
                stream_samples(target, samples(), speed=SPEED, on_message=blocker.append)
            )
            while not blocker:  # its session holds the only slot
                await asyncio.sleep(0.02)
            messages: list[Message] = []
            second = start_client(daemon.port, messages)
            await asyncio.wait_for(asyncio.gather(first, second), 30)
            return messages

    messages = asyncio.run(scenario())
    assert [m["type"] for m in messages][-1] == "done"
    assert uncaptioned_words_ms(check_exactly_once(messages)) == []


def test_a_resend_after_a_restart_starts_on_a_whole_sample() -> None:
    """At 22,050 Hz a millisecond is 44.1 bytes: the offset a final's `end_ms` gives must land
    on a sample, or the new session's first frame is refused as `bad_audio`."""
    stream = Stream("ws://x/v1/stream", sample_rate_hz=22_050, on_message=lambda m: None)
    assert all(stream._bytes_at_ms(ms) % 2 == 0 for ms in range(10_000))


def test_audio_the_client_no_longer_kept_shifts_the_resumed_sessions_times(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Away longer than it keeps audio (possible with `resume_s` over the client's 120 s; here
    1 s kept, 6 s of audio away), the client resumes from the oldest audio it still has. The
    daemon's clock goes on from what it received, so the client shifts the later times by the
    audio it skipped: the transcript stays on the source's clock (it was 5 s early)."""

    async def scenario() -> list[Message]:
        async with running_daemon(make_config()) as daemon:
            proxy = Proxy(daemon.port)
            port = await proxy.start()
            messages: list[Message] = []
            stream = Stream(
                f"ws://127.0.0.1:{port}/v1/stream",
                sample_rate_hz=RATE,
                on_message=messages.append,
                keep_audio_s=1.0,
            )
            client = asyncio.create_task(stream.run(paced_chunks(samples(), SPEED)))
            await asyncio.sleep(1.2)
            proxy.unavailable = 1  # away for the backoff's 0.5 + 1 s: 6 s of audio at 4x
            proxy.cut()
            await asyncio.wait_for(client, 30)
            proxy.close()
            return messages

    messages = asyncio.run(scenario())
    assert [m["type"] for m in messages].count("resumed") == 1
    assert any("were not kept" in r.message for r in caplog.records)
    finals = check_exactly_once(messages)
    # On the source's clock: `done` counts all of PCM, and the last final holds PCM's last word
    # (the audio after the skip was resent); on the daemon's, both were 5 s early.
    assert messages[-1]["type"] == "done"
    assert messages[-1]["audio_ms"] == len(PCM) * 1000 // RATE
    last_word_ms = 500 + 9 * 1_600 + 300
    assert last_word_ms not in uncaptioned_words_ms(finals[-1:])
