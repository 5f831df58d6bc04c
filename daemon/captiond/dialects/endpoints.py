"""The websocket paths that carry a stream, and the dialect each one speaks.

Sans-I/O table, read by server.py on the event-loop thread: for each path, how a connection's
query string becomes its dialect, which Authorization schemes its clients send
(besides `?token=`), and whether its sessions can be resumed (only protocol v1 has resume).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from captiond.dialects import Dialect
from captiond.dialects.native import NativeDialect


@dataclass(frozen=True, slots=True, kw_only=True)
class Endpoint:
    dialect: Callable[[Mapping[str, str]], Dialect]  # from the connection's query string
    auth_schemes: tuple[str, ...] = ("bearer",)
    resumable: bool = False


ENDPOINTS: dict[str, Endpoint] = {
    "/v1/stream": Endpoint(dialect=NativeDialect, resumable=True),
}
