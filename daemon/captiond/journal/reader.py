"""Reading the transcript journal back (`captiond journal show`): sessions, their finals.

Runs on the caller's thread (the CLI's main thread). Tolerates what a crash leaves: a torn last
line is ignored, a session without an `end` record is reported as not ended.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from captiond.journal.writer import JOURNAL_FILE_NAME, JournalError, file_safe_id
from captiond.lang.chinese import VARIANTS
from captiond.lang.languages import parse_language
from captiond.lang.text import join_texts
from captiond.samples import ms_to_samples
from captiond.streaming.events import Speech, StreamParams, TurnParams, Word
from captiond.streaming.utterance import StreamOrigin

log = logging.getLogger(__name__)

_FINAL_KEYS = {"segment", "start_ms", "end_ms", "text", "at"}


# Text of a session's earlier finals a session taken back after a restart is prompted with.
_EARLIER_TEXT_CHARS = 2_000


@dataclass(frozen=True, slots=True, kw_only=True)
class JournaledFinal:
    segment: int
    start_ms: int
    end_ms: int
    text: str
    at: str
    language: str | None = None
    words: tuple[Word, ...] = ()  # none in a journal written before finals had them
    speaker: int | None = None  # diarized streams' (streaming/speakers.py)
    speech: tuple[Speech, ...] = ()  # diarized streams'; none before finals had it
    # Where in the client's audio the final ends (bytes); none before finals had it.
    end_byte: int | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class JournalSession:
    session: str
    started: str
    files: tuple[Path, ...]
    finals: tuple[JournaledFinal, ...]
    ended: bool
    close_code: int | None = None
    audio_ms: int | None = None
    # The newest header (a session taken back after a restart has one per part it went on
    # in) and end record: what a restarted daemon resumes the session from.
    header: dict[str, Any] = field(default_factory=dict, repr=False)
    end: dict[str, Any] | None = field(default=None, repr=False)
    # Every record of every part, in order (`journal show --json`).
    records: tuple[dict[str, Any], ...] = field(default=(), repr=False)

    def stream_params(self) -> StreamParams:
        """The stream parameters the session was opened with (its newest header)."""
        header = self.header
        language = parse_language(str(header["language"]))
        return StreamParams(
            sample_rate_hz=int(header["sample_rate"]),
            encoding=str(header["encoding"]),
            language=language.code,
            candidates=language.candidates,
            # Journals written before these were kept transcribe with the daemon's prompt.
            task=str(header.get("task", "transcribe")),
            prompt=None if header.get("prompt") is None else str(header["prompt"]),
            chinese_variant=_variant_from(header.get("chinese_variant")),
            diarize=None if header.get("diarize") is None else bool(header["diarize"]),
            max_speakers=None
            if header.get("max_speakers") is None
            else int(header["max_speakers"]),
            turn=TurnParams(**header.get("turn", {})),
        )

    def origin(self) -> StreamOrigin:
        """Where the session goes on when taken back: its stream clock and segment numbers
        continue, its earlier text is the prompt (its audio is gone). After its end record
        (its daemon stopped it), from where it stopped; without one (its daemon died), from its
        last final's end, the audio after it to be sent again (`resume_bytes`)."""
        if self.end is not None:
            start_ms, first_segment = int(self.end["audio_ms"]), int(self.end["segments"])
        elif self.finals:
            start_ms, first_segment = self.finals[-1].end_ms, self.finals[-1].segment + 1
        else:
            start_ms, first_segment = 0, 0
        return StreamOrigin(
            start_sample=ms_to_samples(start_ms),
            first_segment=first_segment,
            earlier_text=join_texts(f.text for f in self.finals)[-_EARLIER_TEXT_CHARS:],
            # With ?language=auto the conversation's language goes on as the next hint.
            language=next((f.language for f in reversed(self.finals) if f.text), None),
        )

    def resume_bytes(self) -> int | None:
        """How much of the client's audio the session taken back has had (the `received_bytes`
        of its `resumed`): all it received when its daemon stopped it; up to its last final's
        end when its daemon died (0 before any final). None when that is not known (a final
        journaled before finals had `end_byte`)."""
        if self.end is not None:
            return int(self.end.get("received_bytes", 0))
        if not self.finals:
            return 0
        return self.finals[-1].end_byte

    def last_written(self) -> str:
        """When the session's newest record was written (ISO 8601)."""
        for record in reversed(self.records):
            at = record.get("at") or record.get("started")
            if isinstance(at, str):
                return at
        return self.started


def _read_records(path: Path) -> list[dict[str, Any]]:
    """A file's records; an incomplete last line (a crash mid-write) and bad lines are skipped."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise JournalError(f"cannot read {str(path)!r}: {exc.strerror}") from exc
    records = []
    for number, raw in enumerate(data.split(b"\n")[:-1], start=1):
        try:
            record = json.loads(raw)
        except ValueError:
            record = None
        if isinstance(record, dict):
            records.append(record)
        else:
            log.warning("%s:%d: not a journal record, skipped", path, number)
    return records


def _session_of(stem: str, parts: list[Path]) -> JournalSession:
    records = [r for path in parts for r in _read_records(path)]
    headers = [r for r in records if r.get("type") == "session"] or [{}]
    header = headers[-1]
    end = next((r for r in reversed(records) if r.get("type") == "end"), None)
    if end is not None and header and records.index(end) < records.index(header):
        end = None  # taken back after a restart and not ended since
    finals = tuple(
        JournaledFinal(
            **{k: r[k] for k in _FINAL_KEYS},
            language=r.get("language"),
            words=_words(r),
            speaker=_speaker(r.get("speaker")),
            speech=_speech(r),
            end_byte=_end_byte(r.get("end_byte")),
        )
        for r in records
        if r.get("type") == "final" and r.keys() >= _FINAL_KEYS
    )
    stamp, _, safe_id = stem.partition("-")
    return JournalSession(
        session=str(header.get("session", safe_id)),
        started=str(headers[0].get("started", stamp)),
        files=tuple(parts),
        finals=finals,
        ended=end is not None,
        close_code=None if end is None else end.get("close_code"),
        audio_ms=None if end is None else end.get("audio_ms"),
        header=header,
        end=end,
        records=tuple(records),
    )


def _group(paths: list[Path]) -> dict[str, list[Path]]:
    groups: dict[str, list[tuple[int, Path]]] = {}
    for path in paths:
        if m := JOURNAL_FILE_NAME.match(path.name):
            groups.setdefault(m["stem"], []).append((int(m["part"] or 0), path))
    return {stem: [p for _, p in sorted(parts)] for stem, parts in groups.items()}


def list_sessions(dir: Path, id_prefix: str = "") -> list[JournalSession]:
    """Every session journaled in `dir` (with `id_prefix`: those whose ids can start with it,
    by their file names, the others' files unread), oldest first."""
    if not dir.is_dir():
        raise JournalError(f"journal dir {str(dir)!r} does not exist")
    safe_prefix = file_safe_id(id_prefix) if id_prefix else ""
    groups = _group(list(dir.iterdir()))
    return [
        _session_of(stem, parts)
        for stem, parts in sorted(groups.items())
        if stem.partition("-")[2].startswith(safe_prefix)
    ]


def read_session(path: Path) -> JournalSession:
    """The session that the journal file `path` (any of its parts) belongs to."""
    m = JOURNAL_FILE_NAME.match(path.name)
    if m is None or not path.is_file():
        raise JournalError(f"{str(path)!r} is not a journal file (<start>-<session>.jsonl)")
    return _session_of(m["stem"], _group(list(path.parent.iterdir()))[m["stem"]])


def find_session(dir: Path, key: str) -> JournalSession:
    """The one session in `dir` whose id is `key` or starts with it. Only the files whose
    names can be its are read: a resume after a restart looks its session up here, and a
    journal of a month of meetings is hundreds of megabytes."""
    sessions = list_sessions(dir, id_prefix=key)
    exact = [s for s in sessions if s.session == key]
    found = exact or [s for s in sessions if s.session.startswith(key)]
    if not found:
        raise JournalError(f"no session {key!r} in {dir}")
    if len(found) > 1:
        ids = ", ".join(s.session for s in found)
        raise JournalError(f"session {key!r} is ambiguous ({len(found)} sessions): {ids}")
    return found[0]


def _variant_from(value: object) -> str | None:
    """A journal header's Chinese variant; None (the daemon's) for one this version does not
    know, or a header written before variants were kept."""
    return value if isinstance(value, str) and (value == "" or value in VARIANTS) else None


def _end_byte(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def _speaker(value: Any) -> int | None:
    """A speaker number as the writer writes it; anything else (a hand edit) is nobody's."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def _speech(record: dict[str, Any]) -> tuple[Speech, ...]:
    """A final record's speech stretches; ones not as the writer writes them (a hand edit)
    are dropped, the rest of the final kept."""
    try:
        return tuple(
            Speech(start_ms=int(s["start_ms"]), end_ms=int(s["end_ms"]))
            for s in record.get("speech", ())
        )
    except (KeyError, TypeError, ValueError, AttributeError):
        return ()


def _words(record: dict[str, Any]) -> tuple[Word, ...]:
    """A final record's words; a record whose words are not what the writer writes (a file
    edited by hand) keeps its text and loses only its words."""
    try:
        return tuple(
            Word(
                word=str(w["word"]),
                start_ms=int(w["start_ms"]),
                end_ms=int(w["end_ms"]),
                confidence=None if w.get("confidence") is None else float(w["confidence"]),
                speaker=_speaker(w.get("speaker")),
            )
            for w in record.get("words", ())
        )
    except (KeyError, TypeError, ValueError, AttributeError):
        return ()
