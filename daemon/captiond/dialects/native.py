"""captiond's own protocol v1 (DESIGN.md §3, README "Protocol v1"): binary frames are audio,
text frames are small JSON control messages, every server message is its JSON. Sans-I/O,
event-loop thread."""

from __future__ import annotations

from collections.abc import Mapping

from captiond.dialects import LanguageCheck, Received, any_language
from captiond.errors import SessionError, close_code_for
from captiond.protocol import ServerMessage, StreamParams, parse_control, parse_stream_params

# Control messages are a few dozen bytes; a text frame this long is not one.
MAX_CONTROL_BYTES = 4_096


class NativeDialect:
    max_text_bytes = MAX_CONTROL_BYTES

    def __init__(self, query: Mapping[str, str]) -> None:
        self._query = query

    def stream_params(
        self, default_language: str, can_caption: LanguageCheck = any_language
    ) -> StreamParams:
        return parse_stream_params(self._query, default_language)

    def receive(self, frame: str | bytes) -> Received:
        if isinstance(frame, bytes):
            return Received(audio=frame)
        return Received(control=parse_control(frame))

    def render(self, message: ServerMessage) -> list[str]:
        return [message.to_json()]

    def close_frame(self, error: SessionError) -> tuple[int, str]:
        return close_code_for(error), error.code
