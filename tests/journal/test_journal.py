"""Transcript journal: durable finals (fsync before return, group commit), part files,
retention, torn lines, file modes, config validation and `captiond journal show`."""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import os
import stat
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from captiond.cli import main
from captiond.config import Config, JournalConfig, config_from_mapping, dump_toml, load_config
from captiond.errors import ConfigError
from captiond.journal import reader as journal_read
from captiond.journal import writer as journal_module
from captiond.journal.reader import find_session, list_sessions, read_session
from captiond.journal.writer import (
    Journal,
    JournalError,
    Ownership,
    SessionJournal,
    open_journal,
)
from captiond.streaming.events import Final, Word

_DAY_S = 86_400


def _final(segment: int, text: str = "hello world") -> Final:
    start_ms = 1000 * segment
    words = tuple(
        Word(word=w, start_ms=start_ms + 400 * i, end_ms=start_ms + 400 * i + 300, confidence=0.9)
        for i, w in enumerate(text.split())
    )
    return Final(segment=segment, start_ms=start_ms, end_ms=start_ms + 800, text=text, words=words)


def _open(journal: Journal, session: str = "abc123def456") -> SessionJournal:
    return journal.open_session(
        session=session,
        peer="127.0.0.1:5555",
        source=None,
        language="en",
        model="tiny.en",
        engine="fake",
    )


@pytest.fixture
def journal_dir(tmp_path: Path) -> Path:
    return tmp_path / "journal"


@pytest.fixture
def journal(journal_dir: Path) -> Iterator[Journal]:
    j = Journal(JournalConfig(dir=str(journal_dir)))
    j.start()
    yield j
    j.stop()


def _lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


# -- writing -----------------------------------------------------------------------------------


def test_open_journal_is_none_without_dir(tmp_path: Path) -> None:
    assert open_journal(JournalConfig()) is None
    assert isinstance(open_journal(JournalConfig(dir=str(tmp_path))), Journal)


def test_round_trip(journal: Journal, journal_dir: Path) -> None:
    async def run() -> None:
        s = _open(journal)
        await s.append_final(_final(0, "grüß dich"))
        await s.append_final(_final(1))
        await s.close(audio_ms=2500, segments=2, close_code=1000)
        with pytest.raises(JournalError):
            await s.append_final(_final(2))

    asyncio.run(run())
    (path,) = journal_dir.iterdir()
    assert path.name.endswith("-abc123def456.jsonl") and path.name[8] == "T"
    raw = path.read_text(encoding="utf-8")
    assert "grüß" in raw and ", " not in raw  # ensure_ascii=False, compact separators
    records = _lines(path)
    assert [r["type"] for r in records] == ["session", "final", "final", "end"]
    header = records[0]
    assert header["session"] == "abc123def456" and header["part"] == 0
    assert header["peer"] == "127.0.0.1:5555" and header["source"] is None
    assert (header["language"], header["model"], header["engine"]) == ("en", "tiny.en", "fake")
    assert header["started"].endswith("Z")
    assert records[1] == {**_final(0, "grüß dich").to_dict(), "at": records[1]["at"]}
    assert records[3]["audio_ms"] == 2500 and records[3]["close_code"] == 1000
    session = read_session(path)
    assert session.session == "abc123def456" and session.ended and session.close_code == 1000
    assert session.audio_ms == 2500 and session.files == (path,)
    assert [f.text for f in session.finals] == ["grüß dich", "hello world"]
    assert session.finals[1].start_ms == 1000 and session.finals[1].end_ms == 1800
    # Words come back as they were written (resume replays them, `journal show` prints them).
    assert session.finals[1].words == _final(1).words and len(session.finals[1].words) == 2


def test_private_file_and_dir_modes(journal: Journal, journal_dir: Path) -> None:
    asyncio.run(_open(journal).append_final(_final(0)))
    assert stat.S_IMODE(journal_dir.stat().st_mode) == 0o700
    (path,) = journal_dir.iterdir()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def _record_fsyncs(monkeypatch: pytest.MonkeyPatch, delay_s: float = 0.0) -> list[tuple[str, int]]:
    """Patch os.fsync: log ("dir", 0) or ("file", size at the fsync) for every call."""
    calls: list[tuple[str, int]] = []
    real = os.fsync

    def fsync(fd: int) -> None:
        st = os.fstat(fd)
        calls.append(("dir", 0) if stat.S_ISDIR(st.st_mode) else ("file", st.st_size))
        time.sleep(delay_s)
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    return calls


def test_append_returns_only_after_fsync(
    journal: Journal, journal_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = _record_fsyncs(monkeypatch, delay_s=0.05)

    async def run() -> None:
        s = _open(journal)
        for segment in range(3):
            await s.append_final(_final(segment))
            (path,) = journal_dir.iterdir()
            # The last fsync of the file covered everything written so far.
            assert [c for c in calls if c[0] == "file"][-1][1] == path.stat().st_size
        await s.close(audio_ms=1, segments=3, close_code=1000)

    asyncio.run(run())
    assert ("dir", 0) in calls  # the new file's directory entry is durable too
    assert calls.index(("dir", 0)) < 2


def test_group_commit_fsyncs_once_per_file_per_round(
    journal: Journal, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = _record_fsyncs(monkeypatch, delay_s=0.02)
    n_sessions, n_finals = 8, 20

    async def run() -> None:
        sessions = [_open(journal, f"s{i}") for i in range(n_sessions)]
        await asyncio.gather(
            *(s.append_final(_final(k)) for k in range(n_finals) for s in sessions)
        )

    asyncio.run(run())
    file_fsyncs = sum(1 for kind, _ in calls if kind == "file")
    assert file_fsyncs < n_sessions * n_finals / 4, file_fsyncs
    for session in list_sessions(Path(journal._config.dir)):
        assert [f.segment for f in session.finals] == list(range(n_finals))


def test_rollover_to_part_files(journal_dir: Path) -> None:
    journal = Journal(JournalConfig(dir=str(journal_dir), max_file_bytes=600))
    journal.start()

    async def run() -> None:
        s = _open(journal)
        for segment in range(20):
            await s.append_final(_final(segment))
        await s.close(audio_ms=20_000, segments=20, close_code=1000)

    asyncio.run(run())
    journal.stop()
    session = read_session(next(journal_dir.iterdir()))
    assert len(session.files) > 2
    assert session.files[0].name.endswith("-abc123def456.jsonl")
    assert session.files[1].name.endswith("-abc123def456.1.jsonl")
    for part, path in enumerate(session.files):
        records = _lines(path)
        assert records[0]["type"] == "session" and records[0]["part"] == part
        if path != session.files[-1]:
            # Over the limit by at most the record that crossed it.
            longest = max(len(line) + 1 for line in path.read_bytes().splitlines())
            assert 600 <= path.stat().st_size < 600 + longest
    assert [f.segment for f in session.finals] == list(range(20))
    assert session.ended and _lines(session.files[-1])[-1]["type"] == "end"


def test_stop_flushes_and_unended_sessions_read_as_open(journal_dir: Path) -> None:
    journal = Journal(JournalConfig(dir=str(journal_dir)))
    journal.start()
    asyncio.run(_open(journal).append_final(_final(0)))
    _open(journal, "second")  # header only, written by stop()
    journal.stop()
    sessions = list_sessions(journal_dir)
    assert [s.session for s in sessions] == ["abc123def456", "second"]
    assert not any(s.ended for s in sessions) and sessions[0].close_code is None
    with pytest.raises(JournalError, match="not running"):
        _open(journal)


# -- retention ---------------------------------------------------------------------------------


def _old_file(folder: Path, name: str, size: int, age_days: float) -> Path:
    path = folder / name
    path.write_bytes(b"x" * (size - 1) + b"\n")
    when = time.time() - age_days * _DAY_S
    os.utime(path, (when, when))
    return path


def test_retention_by_age_on_start(journal_dir: Path) -> None:
    journal_dir.mkdir()
    old = _old_file(journal_dir, "20200101T000000Z-old.jsonl", 10, age_days=40)
    recent = _old_file(journal_dir, "20200102T000000Z-recent.jsonl", 10, age_days=2)
    other = _old_file(journal_dir, "notes.txt", 10, age_days=400)  # not ours: kept
    journal = Journal(JournalConfig(dir=str(journal_dir), max_age_days=30))
    journal.start()
    journal.stop()
    assert not old.exists() and recent.exists() and other.exists()


def test_retention_by_total_size_oldest_first(journal_dir: Path) -> None:
    journal_dir.mkdir()
    files = [
        _old_file(journal_dir, f"2020010{i}T000000Z-s{i}.jsonl", 400, age_days=10 - i)
        for i in range(1, 4)
    ]
    journal = Journal(JournalConfig(dir=str(journal_dir), max_total_bytes=1000))
    journal.start()
    journal.stop()
    assert [f.exists() for f in files] == [False, True, True]


def test_retention_leaves_a_session_another_instance_holds(journal_dir: Path) -> None:
    """Instances that share the folder each apply retention: none deletes the files (every
    part) of a session that a live daemon holds, its own or another's."""
    journal_dir.mkdir()
    held = [
        _old_file(journal_dir, "20200101T000000Z-a_1.jsonl", 400, age_days=40),
        _old_file(journal_dir, "20200101T000000Z-a_1.1.jsonl", 400, age_days=40),
    ]
    free = _old_file(journal_dir, "20200102T000000Z-b_2.jsonl", 400, age_days=40)
    other_instance = Ownership.take(held[0])
    try:
        journal = Journal(JournalConfig(dir=str(journal_dir), max_age_days=30))
        journal.start()
        journal.stop()
    finally:
        other_instance.release()
    assert all(f.exists() for f in held) and not free.exists()


def test_retention_runs_once_a_minute_not_for_every_new_file(
    journal_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Twenty sessions opening at once (a meeting on the hour, clients back after a restart)
    do not each list the folder on the writer thread that every final waits for."""
    journal = Journal(JournalConfig(dir=str(journal_dir), max_age_days=1))
    runs: list[float] = []
    real = journal._retain

    def counted() -> None:
        runs.append(time.monotonic())
        real()

    monkeypatch.setattr(journal, "_retain", counted)
    journal.start()

    async def run() -> None:
        for i in range(20):
            await _open(journal, f"s{i}").append_final(_final(0))

    asyncio.run(run())
    journal.stop()
    assert len(runs) == 1, "retention ran at the start only"
    assert len(list(journal_dir.iterdir())) == 20


def test_retention_never_deletes_an_open_file(journal_dir: Path) -> None:
    journal = Journal(JournalConfig(dir=str(journal_dir), max_age_days=1), retain_every_s=0)
    journal.start()

    async def run() -> None:
        first = _open(journal, "first")
        await first.append_final(_final(0))
        (path,) = journal_dir.iterdir()
        when = time.time() - 10 * _DAY_S
        os.utime(path, (when, when))
        await _open(journal, "second").append_final(_final(0))  # a new file: retention runs
        assert path.exists()
        await first.close(audio_ms=1000, segments=1, close_code=1000)
        os.utime(path, (when, when))  # the end record touched it
        await _open(journal, "third").append_final(_final(0))
        assert not path.exists()

    asyncio.run(run())
    journal.stop()


# -- reading -----------------------------------------------------------------------------------


def test_torn_last_line_is_ignored(tmp_path: Path) -> None:
    path = tmp_path / "20240501T120000Z-torn.jsonl"
    header = {"type": "session", "session": "torn", "part": 0, "started": "2024-05-01T12:00:00Z"}
    final = {**_final(0).to_dict(), "at": "2024-05-01T12:00:01Z"}
    path.write_text(
        json.dumps(header) + "\n" + json.dumps(final) + '\n{"type":"final","segm', encoding="utf-8"
    )
    session = read_session(path)
    assert session.session == "torn" and len(session.finals) == 1 and not session.ended
    assert len(session.records) == 2


def test_find_session_by_prefix(tmp_path: Path) -> None:
    for name in ("20240501T120000Z-abc111", "20240501T120001Z-abc222"):
        (tmp_path / f"{name}.jsonl").write_text("", encoding="utf-8")
    assert find_session(tmp_path, "abc1").session == "abc111"
    with pytest.raises(JournalError, match="ambiguous"):
        find_session(tmp_path, "abc")
    with pytest.raises(JournalError, match="no session"):
        find_session(tmp_path, "zzz")


def test_find_session_reads_only_the_files_named_for_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A resume after a restart looks its session up by id: the other sessions' files, a
    month of them, are not parsed."""
    names = ["20240501T120000Z-abc111", "20240501T120000Z-abc111.1", "20240502T080000Z-zz9"]
    for name in names:
        (tmp_path / f"{name}.jsonl").write_text("", encoding="utf-8")
    read: list[str] = []
    real = journal_read._read_records

    def spy(path: Path) -> list[dict[str, Any]]:
        read.append(path.name)
        return real(path)

    monkeypatch.setattr(journal_read, "_read_records", spy)
    assert find_session(tmp_path, "abc111").session == "abc111"
    assert read == ["20240501T120000Z-abc111.jsonl", "20240501T120000Z-abc111.1.jsonl"]


def test_write_error_fails_the_append_and_the_session_goes_on_in_a_new_part(
    journal: Journal, journal_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = os.write

    def full(fd: int, data: Any) -> int:
        real(fd, bytes(data[:5]))  # a torn line, then the disk is full
        raise OSError(errno.ENOSPC, "No space left on device")

    async def run() -> None:
        s = _open(journal)
        await s.append_final(_final(0))
        monkeypatch.setattr(os, "write", full)
        with pytest.raises(JournalError, match="No space left"):
            await s.append_final(_final(1))
        monkeypatch.setattr(os, "write", real)
        await s.append_final(_final(2))
        await s.close(audio_ms=3000, segments=3, close_code=1000)

    asyncio.run(run())
    session = find_session(journal_dir, "abc")
    assert len(session.files) == 2 and session.files[1].name.endswith(".1.jsonl")
    assert [f.segment for f in session.finals] == [0, 2] and session.ended


def test_a_live_streams_final_that_fails_is_logged_once_per_run_and_the_next_one_is_journaled(
    journal: Journal,
    journal_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """record_final never raises: a disk full for two finals costs those two (one error logged
    for the run, one warning when writing works again), and the session's record goes on."""
    real = journal_module._write_all
    failing = {1, 2}

    def full_for_some(target: Any, data: bytes) -> None:
        if failing and b'"segment":' + str(min(failing)).encode() in data:
            failing.discard(min(failing))
            raise OSError(errno.ENOSPC, "No space left on device")
        real(target, data)

    monkeypatch.setattr(journal_module, "_write_all", full_for_some)

    async def run() -> None:
        s = _open(journal)
        for segment in range(4):
            await s.record_final(_final(segment))
        await s.close(audio_ms=4000, segments=4, close_code=1000)

    with caplog.at_level(logging.WARNING, logger="captiond.journal.writer"):
        asyncio.run(run())
    session = find_session(journal_dir, "abc")
    assert [f.segment for f in session.finals] == [0, 3] and session.ended
    assert [(r.levelno, "No space left" in r.getMessage()) for r in caplog.records] == [
        (logging.ERROR, True),
        (logging.WARNING, False),
    ]
    assert "2 finals before this one were not journaled" in caplog.records[1].getMessage()


def test_an_end_record_that_fails_is_logged_not_raised(
    journal: Journal, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The stream (or the shutdown) that ends goes on: close never raises into it."""

    def full(target: Any, data: bytes) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    async def run() -> None:
        s = _open(journal)
        monkeypatch.setattr(journal_module, "_write_all", full)
        await s.close(audio_ms=0, segments=0, close_code=1000)

    with caplog.at_level(logging.ERROR, logger="captiond.journal.writer"):
        asyncio.run(run())
    assert ["end record failed" in r.getMessage() for r in caplog.records] == [True]


# -- config ------------------------------------------------------------------------------------


def test_config_section(tmp_path: Path) -> None:
    assert Config().journal == JournalConfig()
    path = tmp_path / "c.toml"
    path.write_text('[journal]\ndir = "/var/lib/captiond/journal"\nmax_age_days = 7\n')
    config = load_config(path)
    assert config.journal == JournalConfig(dir="/var/lib/captiond/journal", max_age_days=7.0)
    assert config_from_mapping(__import__("tomllib").loads(dump_toml(config))) == config


@pytest.mark.parametrize(
    ("key", "value"),
    [("max_file_bytes", 0), ("max_total_bytes", -1), ("max_age_days", 0.0)],
)
def test_config_values_must_be_positive(key: str, value: float) -> None:
    with pytest.raises(ConfigError, match=rf"\[journal\] {key}"):
        config_from_mapping({"journal": {key: value}})


def test_config_nan_is_refused() -> None:
    with pytest.raises(ConfigError, match="max_age_days"):
        config_from_mapping({"journal": {"max_age_days": float("nan")}})


# -- captiond journal show ---------------------------------------------------------------------


def _two_sessions(journal_dir: Path) -> None:
    journal = Journal(JournalConfig(dir=str(journal_dir)))
    journal.start()

    async def run() -> None:
        done = _open(journal, "aaaa11112222")
        await done.append_final(Final(segment=0, start_ms=62_340, end_ms=65_120, text="hi there"))
        await done.append_final(Final(segment=1, start_ms=65_120, end_ms=65_500, text=""))
        await done.append_final(
            Final(segment=2, start_ms=3_723_004, end_ms=3_724_000, text="later")
        )
        await done.close(audio_ms=3_725_000, segments=3, close_code=1000)
        await _open(journal, "bbbb33334444").append_final(_final(0, "unfinished"))

    asyncio.run(run())
    journal.stop()


def test_cli_lists_sessions(journal_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _two_sessions(journal_dir)
    assert main(["journal", "show", "--dir", str(journal_dir)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["started", "session", "finals", "audio", "status"]
    assert "aaaa11112222" in lines[1] and "01:02:05.000" in lines[1]
    assert lines[1].split()[2] == "3" and lines[1].endswith("ended")
    assert "bbbb33334444" in lines[2] and lines[2].endswith("open (crashed or live)")
    assert main(["journal", "show", "--dir", str(journal_dir), "--json"]) == 0
    summaries = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(s["session"], s["finals"], s["ended"]) for s in summaries] == [
        ("aaaa11112222", 3, True),
        ("bbbb33334444", 1, False),
    ]


def test_cli_prints_a_transcript(
    journal_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _two_sessions(journal_dir)
    config = tmp_path / "c.toml"
    config.write_text(f'[journal]\ndir = "{journal_dir}"\n')
    assert main(["journal", "show", "--config", str(config), "aaaa"]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "[00:01:02.340 → 00:01:05.120] hi there",
        "[01:02:03.004 → 01:02:04.000] later",
    ]
    part = next(journal_dir.glob("*-bbbb33334444.jsonl"))
    assert main(["journal", "show", str(part), "--json"]) == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["type"] for r in records] == ["session", "final"]
    assert records[1]["text"] == "unfinished"


def test_cli_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["journal", "show"]) == 2
    assert "no journal folder" in capsys.readouterr().err
    assert main(["journal", "show", "--dir", str(tmp_path / "nope")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["journal", "show", "--dir", str(tmp_path), "nosuch"]) == 2
    assert "no session 'nosuch'" in capsys.readouterr().err
