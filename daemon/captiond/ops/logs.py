"""Logging set-up for the CLI (the daemon's modules only ever call logging.getLogger).

Under systemd (JOURNAL_STREAM set) lines carry no timestamp, since journald adds its own, and
start with the syslog priority prefix so `journalctl -p` filters work. At INFO the daemon logs
one line per session; websockets' per-connection and per-request lines (access logs), and the
request lines of huggingface_hub's HTTP library (a model download's), only show at DEBUG.
"""

from __future__ import annotations

import logging
import os

_PRIORITY = {
    logging.DEBUG: 7,
    logging.INFO: 6,
    logging.WARNING: 4,
    logging.ERROR: 3,
    logging.CRITICAL: 2,
}


class _JournalFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return f"<{_PRIORITY.get(record.levelno, 6)}>{super().format(record)}"


# The levels `--log-level` takes (any case).
LOG_LEVELS = ("debug", "info", "warning", "error")


def configure_logging(level: str) -> None:
    handler = logging.StreamHandler()
    if os.environ.get("JOURNAL_STREAM"):
        handler.setFormatter(_JournalFormatter("%(name)s: %(message)s"))
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)
    access_level = logging.DEBUG if level.upper() == "DEBUG" else logging.WARNING
    # huggingface_hub's HTTP library (httpx2 since 2.0, httpx in 1.x) logs every request at
    # INFO: a model download's requests, like websockets' access lines, only show at DEBUG.
    for name in ("websockets", "httpx", "httpx2"):
        logging.getLogger(name).setLevel(access_level)
