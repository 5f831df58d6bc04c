"""Showing captions on a terminal, and writing transcripts (.txt, .vtt, .srt, .json, .rttm).

Main-thread helpers of the CLI. On a terminal the current partial is redrawn in place: stable
words plain, the unstable tail dim; each final is printed on its own line.
"""

from __future__ import annotations

import html
import json
import shutil
import sys
import unicodedata
from pathlib import Path
from typing import Any, TextIO

from captiond.lang.text import join_texts, joins_without_space

DIM, BOLD, RESET, CLEAR_LINE = "\x1b[2m", "\x1b[1m", "\x1b[0m", "\r\x1b[2K"
TRANSCRIPT_SUFFIXES = (".txt", ".vtt", ".srt", ".json", ".rttm")


class CaptionPrinter:
    """Consumes server messages; prints them for a person (or as JSON lines)."""

    def __init__(self, out: TextIO = sys.stdout, *, as_json: bool = False) -> None:
        self._out = out
        self._json = as_json
        self._tty = out.isatty()
        self._partial_shown = False
        self.finals: list[dict[str, Any]] = []

    def __call__(self, message: dict[str, Any]) -> None:
        kind = message.get("type")
        # A diarized final with no words may still say someone spoke (an "mhm"): the RTTM
        # file keeps it, the other formats skip it.
        if kind == "final" and (message.get("text") or message.get("speech")):
            self.finals.append(message)
        if self._json:
            print(json.dumps(message, ensure_ascii=False), file=self._out, flush=True)
        elif kind == "partial" and self._tty:
            stable, unstable = message["stable"], message["unstable"]
            space = message.get("separator")
            if space is None:  # a daemon before `separator`: a space unless both sides are CJK
                glued = not stable or not unstable or joins_without_space(stable, unstable)
                space = "" if glued else " "
            self._show_partial(stable, space, unstable)
        elif kind == "final":
            self._clear()
            if message.get("text"):
                stamp = format_clock(message["start_ms"])
                print(f"[{stamp}] {_said(message)}", file=self._out, flush=True)
        elif kind == "error":
            self._clear()  # its StreamError follows, and the command prints that once

    def _show_partial(self, stable: str, space: str, unstable: str) -> None:
        """The live line: `stable`, then `space` (the partial's separator), then `unstable`."""
        width = shutil.get_terminal_size().columns - 1
        text = f"{stable}{space}{unstable}"
        # Keep the newest words visible: trim from the left when the line is too long (a line
        # that wraps could not be redrawn in place).
        cut = len(text) - len(_tail(text, width))
        rest = f"{space}{unstable}"[max(0, cut - len(stable)) :]
        line = f"{BOLD}{stable[cut:]}{RESET}{DIM}{rest}{RESET}"
        print(f"{CLEAR_LINE}{line}", end="", file=self._out, flush=True)
        self._partial_shown = True

    def _clear(self) -> None:
        if self._partial_shown and self._tty:
            print(CLEAR_LINE, end="", file=self._out, flush=True)
            self._partial_shown = False


def _columns(char: str) -> int:
    """Terminal columns `char` takes: two for a wide or full-width character (Chinese,
    Japanese, Korean), none for a combining mark."""
    if unicodedata.combining(char) or unicodedata.category(char) in ("Mn", "Me", "Cf"):
        return 0
    return 2 if unicodedata.east_asian_width(char) in ("W", "F") else 1


def _tail(text: str, columns: int) -> str:
    """The end of `text` that fits in `columns` terminal columns."""
    used = 0
    for i in range(len(text) - 1, -1, -1):
        used += _columns(text[i])
        if used > columns:
            return text[i + 1 :]
    return text


def format_clock(ms: int, sep: str = ".") -> str:
    hours, rest = divmod(ms, 3_600_000)
    minutes, rest = divmod(rest, 60_000)
    seconds, millis = divmod(rest, 1000)
    return f"{hours:02d}:{minutes:02d}:{seconds:02d}{sep}{millis:03d}"


def speaker_name(final: dict[str, Any]) -> str | None:
    """A diarized final's speaker as the page names it by default ("Speaker 1" for speaker 0);
    None for a stream that is not diarized."""
    speaker = final.get("speaker")
    return None if speaker is None else f"Speaker {int(speaker) + 1}"


def render_transcript(finals: list[dict[str, Any]], suffix: str, file_id: str = "stream") -> str:
    """Plain text, WebVTT, SubRip, JSON or RTTM, chosen by the output file's suffix (one of
    TRANSCRIPT_SUFFIXES). A diarized stream's cues name their speaker: a WebVTT voice span
    (`<v Speaker 1>`), "Speaker 1: " before the text in SubRip and plain text. RTTM (`file_id`
    its recording's name) is who spoke when: a diarized stream's only."""
    if suffix == ".rttm":
        return _rttm(finals, file_id)
    finals = [f for f in finals if f["text"]]
    if suffix == ".vtt":
        # Cue text is markup in WebVTT: "&", "<" and ">" are escaped (the page's export too).
        cues = []
        for f in finals:
            name = speaker_name(f)
            voice = "" if name is None else f"<v {html.escape(name)}>"
            cues.append(
                f"{format_clock(f['start_ms'])} --> {format_clock(f['end_ms'])}\n"
                f"{voice}{html.escape(f['text'], quote=False)}\n"
            )
        return "WEBVTT\n\n" + "\n".join(cues)
    if suffix == ".srt":
        cues = [
            f"{i}\n{format_clock(f['start_ms'], ',')} --> {format_clock(f['end_ms'], ',')}\n"
            f"{_said(f)}\n"
            for i, f in enumerate(finals, start=1)
        ]
        return "\n".join(cues)
    if suffix == ".json":
        # The "text" and "segments" of `captiond transcribe --json`: the finals as received.
        transcript = {"text": join_texts(f["text"] for f in finals), "segments": finals}
        return json.dumps(transcript, ensure_ascii=False) + "\n"
    if suffix == ".txt":
        return "".join(f"{_said(f)}\n" for f in finals)
    raise ValueError(f"no transcript format for {suffix!r}: {', '.join(TRANSCRIPT_SUFFIXES)}")


def _rttm(finals: list[dict[str, Any]], name: str) -> str:
    """NIST RTTM, one SPEAKER line per stretch a speaker was heard: each final's `speech`
    (where the VAD heard its speaker, written words or not), or its span where a final has
    none (one journaled before finals had it). Speakers are `Speaker_1`...: RTTM's fields are
    separated by spaces."""
    if not any(f.get("speaker") is not None for f in finals):
        raise ValueError("an RTTM file says who spoke when: stream with diarize=true")
    file_id = "_".join(name.split()) or "stream"
    lines = []
    for f in finals:
        if f.get("speaker") is None:
            continue
        who = f"Speaker_{int(f['speaker']) + 1}"
        for s in f.get("speech") or [f]:
            start_s, duration_s = s["start_ms"] / 1000, (s["end_ms"] - s["start_ms"]) / 1000
            lines.append(
                f"SPEAKER {file_id} 1 {start_s:.3f} {duration_s:.3f} <NA> <NA> {who} <NA> <NA>\n"
            )
    return "".join(lines)


def _said(final: dict[str, Any]) -> str:
    name = speaker_name(final)
    return final["text"] if name is None else f"{name}: {final['text']}"


def write_transcript(path: Path, finals: list[dict[str, Any]]) -> None:
    path.write_text(render_transcript(finals, path.suffix.lower(), path.stem), encoding="utf-8")
