"""Transcript journal: every final appended to its session's JSON-lines file and fsync'd first.

Owns the `[journal] dir` folder: one file per session (`<start>-<id>.jsonl`, then `.1.jsonl`, …
once a part reaches `max_file_bytes`), retention by age and total size, and the readers behind
`captiond journal show`. Two sides. The asyncio side (`SessionJournal`, event-loop thread) queues
a line with a future and awaits it. The writer thread (`captiond-journal`, the only thread that
touches journal files) drains the queue, writes every line, fsyncs each touched file once (group
commit), then resolves the futures through `call_soon_threadsafe`. Reading the files back is
journal/reader.py's.

Which daemon owns a session: several instances may share one `[journal] dir` (a folder on NFS
or a ReadWriteMany volume) so that any of them can take a session back, and exactly one may
write a session at a time. The owner holds an exclusive `flock` on the session's first part file
(`<stem>.jsonl`, which every session has, opened once, read-only, for the lock alone) from its
first line until its end record (`Ownership`); an instance that wants the session takes the same
lock without waiting first, and only then reads whether it may go on. The kernel drops the lock
when the owner's process dies however it dies (kill -9 included), so a crashed instance's
sessions are free at once and nothing has to expire. Linux's NFS client turns `flock` into an
NFS lock, which the server holds for the client host (NFSv4: a dead host's locks go after its
lease time). A new session's lock is taken on the writer thread; a take-back's on a thread of
the event loop's (`asyncio.to_thread`), before it reads the session. Retention leaves alone the
files of a session a live daemon holds, whichever instance it is.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import logging
import math
import os
import re
import threading
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from captiond.config import JournalConfig
from captiond.errors import CaptiondError
from captiond.streaming.events import Final

log = logging.getLogger(__name__)

JOURNAL_FILE_NAME = re.compile(
    r"^(?P<stem>\d{8}T\d{6}Z-[A-Za-z0-9_-]+)(?:\.(?P<part>\d+))?\.jsonl$"
)


def file_safe_id(session: str) -> str:
    """A session id as its file names spell it (`<start>-<id>.jsonl`)."""
    return re.sub(r"[^A-Za-z0-9_-]", "_", session) or "_"


_DAY_S = 86_400.0


class JournalError(CaptiondError):
    """A journal file could not be written or read."""


class SessionOwnedError(JournalError):
    """Another live process holds the session."""


class Ownership:
    """The lock on one session's first file, held until `release`."""

    def __init__(self, fd: int) -> None:
        self._fd: int | None = fd

    @classmethod
    def take(cls, path: Path) -> Ownership:
        """The session whose first file is `path`, now ours; SessionOwnedError when a live
        process holds it, JournalError when the file cannot be opened."""
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as exc:
            raise JournalError(f"cannot open {str(path)!r}: {exc.strerror}") from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise SessionOwnedError(f"{path.name} is held by a live daemon") from None
        except OSError as exc:
            os.close(fd)
            raise JournalError(f"cannot lock {str(path)!r}: {exc.strerror}") from exc
        return cls(fd)

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        """Let the session go (closing the file drops the lock); a second call does nothing."""
        fd, self._fd = self._fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)


def _now() -> datetime:
    return datetime.now(UTC)


def _iso(when: datetime) -> str:
    return when.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _line(record: dict[str, Any]) -> bytes:
    return (json.dumps(record, ensure_ascii=False, separators=(",", ":")) + "\n").encode()


def open_journal(config: JournalConfig, *, retain: bool = True) -> Journal | None:
    """The journal `config` asks for (not started), or None when `dir` is empty. `retain`:
    this process applies retention (one of several processes sharing the folder does)."""
    return Journal(config, retain=retain) if config.dir else None


@dataclass(eq=False, slots=True)
class _SessionFile:
    """One session's file state: created on the event loop, then touched by the writer only."""

    stem: str
    header: dict[str, Any]
    next_part: int = 0
    fd: int | None = None
    path: Path | None = None
    size_bytes: int = 0
    owner: Ownership | None = None  # held from the first line to the end record


@dataclass(slots=True)
class _Item:
    target: _SessionFile
    line: bytes | None  # None: only open the file (its header line)
    last: bool = False  # the end record: close the file after it
    future: asyncio.Future[None] | None = None
    loop: asyncio.AbstractEventLoop | None = None


class Journal:
    """The journal folder and its writer thread; `open_session` once per client session."""

    def __init__(
        self, config: JournalConfig, *, retain: bool = True, retain_every_s: float = 60.0
    ) -> None:
        self._config = config
        self._retains = retain
        # Retention lists the whole folder (a month of a busy daemon: 30,000 files, 0.3 s),
        # on the writer thread that every stream's finals wait for: after the start, at
        # most once per `retain_every_s` when files are created, not for every one.
        self._retain_every_s = retain_every_s
        self._retained_at_s = -math.inf  # monotonic; by start(), then the writer thread
        self._dir = Path(config.dir)
        self._queue: list[_Item] = []
        self._cond = threading.Condition()
        self._started = False
        self._stopping = False
        self._open: set[_SessionFile] = set()  # writer thread only
        self._owned: set[_SessionFile] = set()  # writer thread only: their locks are held
        self._dir_dirty = False  # writer thread only
        self._thread = threading.Thread(target=self._run, name="captiond-journal", daemon=True)

    @property
    def dir(self) -> Path:
        return self._dir

    def start(self) -> None:
        """Create the folder, apply retention once, start the writer thread."""
        try:
            self._dir.mkdir(mode=0o700, parents=True, exist_ok=True)
            self._retain()
        except OSError as exc:
            raise JournalError(f"journal dir {str(self._dir)!r}: {exc.strerror}") from exc
        self._started = True
        self._thread.start()

    def stop(self) -> None:
        """Write and fsync everything queued, close every file, join the writer thread."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._started:
            self._thread.join()

    def open_session(
        self,
        *,
        session: str,
        peer: str,
        source: str | None,
        language: str,
        model: str,
        engine: str,
        stream: dict[str, Any] | None = None,
        continues: str | None = None,
        owner: Ownership | None = None,
    ) -> SessionJournal:
        """Start a session's file (its header line is written without waiting). `stream` is
        what a restarted daemon needs to take the session back (audio format, the resume
        token's hash); `continues` is the file stem of a session taken back (after a restart,
        or from another instance), which goes on in its next part, and `owner` the lock taken
        on it; a new session's lock is taken with its first file."""
        started = _now()
        safe_id = file_safe_id(session)
        header: dict[str, Any] = {"type": "session", "session": session, "part": 0}
        header.update(started=_iso(started), peer=peer, source=source, language=language)
        header.update(model=model, engine=engine, **(stream or {}))
        stem = continues or f"{started:%Y%m%dT%H%M%SZ}-{safe_id}"
        target = _SessionFile(stem=stem, header=header, owner=owner)
        self._put(_Item(target, None))
        return SessionJournal(self, target)

    def _put(self, item: _Item) -> None:
        with self._cond:
            if not self._started or self._stopping:
                raise JournalError("the journal is not running")
            self._queue.append(item)
            self._cond.notify()

    async def _write(self, target: _SessionFile, record: dict[str, Any], *, last: bool) -> None:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()
        self._put(_Item(target, _line(record), last, future, loop))
        await future

    # -- writer thread ---------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._stopping:
                    self._cond.wait()
                batch, self._queue = self._queue, []
            if not batch:
                break
            try:
                self._commit(batch)
            except Exception as exc:  # a bug: fail the waiters rather than hang them
                log.exception("journal writer failed")
                for item in batch:
                    _settle(item, JournalError(f"journal writer failed: {exc}"))
        for target in list(self._open):
            self._close(target)
        for target in list(self._owned):
            self._release(target)

    def _commit(self, batch: list[_Item]) -> None:
        """Write every line, fsync each touched file (and the folder) once, then resolve."""
        failed: dict[int, JournalError] = {}  # id(item) -> its error
        dirty: dict[_SessionFile, list[_Item]] = {}
        for item in batch:
            target = item.target
            try:
                if target.fd is None:
                    self._open_part(target)
                written = dirty.setdefault(target, [])
                if item.line is not None:
                    _write_all(target, item.line)
                    written.append(item)
                if item.last or target.size_bytes >= self._config.max_file_bytes:
                    self._sync(target, dirty.pop(target, []), failed)
                    self._close(target)
                if item.last:
                    self._release(target)  # the end record is on disk: another may take it
            except OSError as exc:
                failed[id(item)] = JournalError(f"journal write failed: {exc}")
                # A torn line may end the part: go on in a fresh part.
                self._sync(target, dirty.pop(target, []), failed)
                self._close(target)
        for target, items in dirty.items():
            self._sync(target, items, failed)
        if self._dir_dirty:
            try:
                _fsync_dir(self._dir)
                self._dir_dirty = False
            except OSError as exc:
                for item in batch:
                    failed.setdefault(id(item), JournalError(f"journal dir fsync failed: {exc}"))
        for item in batch:
            _settle(item, failed.get(id(item)))

    def _sync(
        self, target: _SessionFile, items: list[_Item], failed: dict[int, JournalError]
    ) -> None:
        if target.fd is None:
            return
        try:
            os.fsync(target.fd)
        except OSError as exc:
            for item in items:
                failed.setdefault(id(item), JournalError(f"journal fsync failed: {exc}"))
            self._close(target)

    def _open_part(self, target: _SessionFile) -> None:
        """Create the session's next part file (0o600) and write its header line."""
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND | os.O_CLOEXEC
        while True:
            part = target.next_part
            path = self._dir / (f"{target.stem}.{part}.jsonl" if part else f"{target.stem}.jsonl")
            try:
                fd = os.open(path, flags, 0o600)
                break
            except FileExistsError:
                target.next_part += 1
        target.next_part += 1
        target.fd, target.path, target.size_bytes = fd, path, 0
        self._open.add(target)
        if target.owner is None:
            try:
                target.owner = Ownership.take(path)  # a new file: no one else can hold it yet
            except JournalError as exc:
                log.warning("journal %s: %s; the session is not locked", target.stem, exc)
        if target.owner is not None:
            self._owned.add(target)
        self._dir_dirty = True
        _write_all(target, _line({**target.header, "part": part}))
        if time.monotonic() - self._retained_at_s < self._retain_every_s:
            return
        try:
            self._retain()
        except OSError as exc:
            log.warning("journal retention failed: %s", exc)

    def _close(self, target: _SessionFile) -> None:
        self._open.discard(target)
        if target.fd is not None:
            fd, target.fd = target.fd, None
            with contextlib.suppress(OSError):  # already fsync'd, or already failed
                os.close(fd)

    def _release(self, target: _SessionFile) -> None:
        self._owned.discard(target)
        if target.owner is not None:
            target.owner.release()

    def _retain(self) -> None:
        """Delete files older than max_age_days, then the oldest while over max_total_bytes."""
        if not self._retains:
            return
        self._retained_at_s = time.monotonic()
        busy = {t.path for t in self._open}
        files: list[tuple[float, str, Path, int]] = []
        for entry in os.scandir(self._dir):
            if JOURNAL_FILE_NAME.match(entry.name) and entry.is_file(follow_symlinks=False):
                st = entry.stat(follow_symlinks=False)
                files.append((st.st_mtime, entry.name, Path(entry.path), st.st_size))
        files.sort()
        total = sum(f[3] for f in files)
        cutoff = time.time() - self._config.max_age_days * _DAY_S
        held: dict[str, bool] = {}  # by stem: a live session (another instance's too)
        for mtime, name, path, size in files:
            if path in busy:
                continue
            if mtime < cutoff or total > self._config.max_total_bytes:
                stem = JOURNAL_FILE_NAME.match(name)["stem"]  # type: ignore[index]
                if stem not in held:
                    held[stem] = _held_elsewhere(self._dir / f"{stem}.jsonl")
                if held[stem]:
                    continue
                path.unlink(missing_ok=True)
                total -= size
                log.info("journal retention: deleted %s", path.name)


def _held_elsewhere(first: Path) -> bool:
    """Whether a live daemon (another instance sharing the folder) holds the session whose
    first file is `first`: retention leaves its files alone."""
    try:
        Ownership.take(first).release()
    except SessionOwnedError:
        return True
    except JournalError:
        pass  # no first part (deleted already): nobody holds the rest
    return False


def _write_all(target: _SessionFile, data: bytes) -> None:
    assert target.fd is not None
    view = memoryview(data)
    while view:
        written = os.write(target.fd, view)
        target.size_bytes += written
        view = view[written:]


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _settle(item: _Item, error: JournalError | None) -> None:
    future, loop = item.future, item.loop
    if future is None or loop is None:
        if error is not None:
            log.warning("%s", error)
        return

    def resolve() -> None:
        if not future.done():
            if error is None:
                future.set_result(None)
            else:
                future.set_exception(error)

    with contextlib.suppress(RuntimeError):  # a closed loop: nobody waits any more
        loop.call_soon_threadsafe(resolve)


class SessionJournal:
    """One session's journal, used on the event-loop thread."""

    def __init__(self, journal: Journal, target: _SessionFile) -> None:
        self._journal = journal
        self._target = target
        self._closed = False
        self._failed_finals = 0  # the current run of finals `record_final` could not write

    async def append_final(self, final: Final, *, end_byte: int | None = None) -> None:
        """Return once the final's line is written and fsync'd (JournalError if it is not).
        `end_byte`: where in the client's audio (bytes it sent) the final ends; a session taken
        back after its daemon died asks the client to send again from there."""
        if self._closed:
            raise JournalError("the session's journal is closed")
        record = {**final.to_dict(), "at": _iso(_now())}
        if end_byte is not None:
            record["end_byte"] = end_byte
        await self._journal._write(self._target, record, last=False)

    async def record_final(self, final: Final, *, end_byte: int | None = None) -> None:
        """`append_final` for a live stream, whose captions go on whatever the disk does: a
        failure (disk full) is logged, not raised, and the next final tries again, in a fresh
        part (the writer closed the torn one). A run of failures is logged when it starts and
        when the journal writes again, so a full disk does not log once per final."""
        try:
            await self.append_final(final, end_byte=end_byte)
        except JournalError as exc:
            if self._failed_finals == 0:
                log.error("journal %s: %s; trying again with each final", self._target.stem, exc)
            self._failed_finals += 1
            return
        if self._failed_finals:
            log.warning(
                "journal %s: writing again; %d finals before this one were not journaled",
                self._target.stem,
                self._failed_finals,
            )
            self._failed_finals = 0

    async def close(
        self, *, audio_ms: int, segments: int, close_code: int, received_bytes: int = 0
    ) -> None:
        """Write the session's end record and close its file; a second call does nothing. A
        failure is logged, not raised: the stream or the shutdown that ends goes on without it
        (as `record_final`)."""
        if self._closed:
            return
        self._closed = True
        record = {
            "type": "end",
            "at": _iso(_now()),
            "audio_ms": audio_ms,
            "segments": segments,
            "received_bytes": received_bytes,
            "close_code": close_code,
        }
        try:
            await self._journal._write(self._target, record, last=True)
        except JournalError as exc:
            log.error("journal %s: end record failed: %s", self._target.stem, exc)
