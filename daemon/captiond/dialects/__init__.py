"""Wire dialects: how one websocket protocol maps onto a live stream (Sans-I/O).

A stream's session, scheduler and engine are the same whatever the client speaks; a dialect
only translates. It turns each frame the client sends into audio bytes (in the stream's
encoding), a control for the session, and replies to send at once; and it renders each
message the session produces (`ready`, partials, finals, speech events, `done`, `error`) as
zero or more frames of its own protocol. One dialect instance per connection, used on the
event-loop thread. `native.py` is captiond's protocol v1; the others are cloud vendors' APIs,
so that their unmodified SDKs work against a local daemon (docs/guides/existing-app.md,
docs/reference/dialects.md).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from captiond.errors import SessionError
from captiond.lang.languages import LanguageSetting
from captiond.streaming.events import Ack, Control, ServerMessage, StreamParams, TurnParams

# Raises a SessionError (bad_message) for a Whisper language code the daemon's model cannot
# caption: English-only models take only English, and Cantonese came with large-v3
# (`EngineInfo.check_can`).
LanguageCheck = Callable[[str], None]


def any_language(code: str) -> None:
    """The LanguageCheck of a dialect used alone: it takes every language."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Received:
    """What one client frame means: audio to feed, a control for the session, the language
    of the audio, the stream's prompt, whether a pause ends an utterance and how turns end from
    now on (a session update; None: unchanged), replies to send at once, and those to send when the
    control ends no utterance (a commit with no speech to end)."""

    audio: bytes = b""
    control: Control | Ack | None = None
    language: LanguageSetting | None = None
    prompt: str | None = None
    ends_at_pauses: bool | None = None
    # How the stream's turns end from now on (a vendor's turn-detection keys).
    turn: TurnParams | None = None
    replies: tuple[str, ...] = ()
    if_nothing_ends: tuple[str, ...] = ()


class Dialect(Protocol):
    """Made from the connection's query string (never raises: errors are rendered by it)."""

    # Text frames longer than this are refused before they are parsed (bad_message).
    max_text_bytes: int

    def stream_params(
        self, default_language: str, can_caption: LanguageCheck = any_language
    ) -> StreamParams:
        """The stream's audio format and language from the query string; raises a
        SessionError for one the protocol refuses. `can_caption` checks a language against the
        model: a session update to one it cannot caption is refused, as the protocol refuses a
        bad update (before it is confirmed)."""
        ...

    def receive(self, frame: str | bytes) -> Received:
        """Translate one client frame; raises a SessionError for what the protocol forbids."""
        ...

    def render(self, message: ServerMessage) -> list[str]:
        """The frames that tell the client `message` (none: it has no such event)."""
        ...

    def close_frame(self, error: SessionError) -> tuple[int, str]:
        """The websocket close code and reason that follow `error` in this protocol."""
        ...
