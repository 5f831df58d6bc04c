"""Handing a session from one live daemon to another through the journal folder they share.

A resume can reach an instance other than the one that holds its session while that one still
runs: ingress-nginx cannot send it back by the token's prefix, and a client whose own network
dropped may come back through any route. The instance asked cannot take the session (its owner
holds its lock, journal/writer.py); instead it asks the owner to let it go, with an empty file
named after the session in `<[journal] dir>/handover/`. Every daemon that shares the folder
looks there a few times a second for the sessions it holds; the owner ends the session as a
drain does (its last finals journaled, the end record 1001, the lock dropped) and removes the
request, and the asker, waiting on the lock, takes it back from the journal as it would after a
restart (and removes the request too, answered or not). Nothing here is
trusted: the asker has checked the client's resume token against the journal first, and a
request for a session nobody holds does nothing.

Plain file operations, each run on a worker thread by the event loop (`asyncio.to_thread`: the
folder may be on NFS).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from captiond.journal.writer import file_safe_id

HANDOVER_DIR = "handover"
# How often a daemon that holds sessions looks for requests: one directory listing, a few
# times a second, is nothing beside the streams it serves.
POLL_S = 0.25
# How long the asker waits for the owner to let go: the owner ends the session as a drain does,
# which decodes its last utterance first (a second or so on a CPU).
WAIT_S = 5.0
# How often the asker tries the session's lock meanwhile.
LOCK_POLL_S = 0.1


def request(journal_dir: Path, session: str) -> None:
    """Ask whichever daemon holds `session` to let it go."""
    folder = journal_dir / HANDOVER_DIR
    folder.mkdir(exist_ok=True)
    (folder / file_safe_id(session)).touch()


def withdraw(journal_dir: Path, session: str) -> None:
    """The request for `session` is answered, or given up: no daemon should act on it now."""
    with contextlib.suppress(FileNotFoundError):
        (journal_dir / HANDOVER_DIR / file_safe_id(session)).unlink()


def requested(journal_dir: Path) -> set[str]:
    """The sessions (as their file names spell them) some daemon asks to be let go."""
    try:
        with os.scandir(journal_dir / HANDOVER_DIR) as entries:
            return {entry.name for entry in entries}
    except FileNotFoundError:
        return set()
