"""The websocket paths that carry a stream, and the dialect each one speaks.

Sans-I/O table, read by server/daemon.py on the event-loop thread: for each path, how a connection's
query string becomes its dialect, which Authorization schemes its clients send
(besides `?token=`), and whether its sessions can be resumed (only protocol v1 has resume).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from captiond.dialects import Dialect, deepgram
from captiond.dialects.assemblyai import AssemblyAIDialect
from captiond.dialects.native import NativeDialect, Query
from captiond.dialects.openai_realtime import OpenAIRealtimeDialect


@dataclass(frozen=True, slots=True, kw_only=True)
class Endpoint:
    dialect: Callable[[Query], Dialect]  # from the connection's query string
    auth_schemes: tuple[str, ...] = ("bearer",)
    resumable: bool = False
    # A query its protocol refuses gets HTTP 400 before the upgrade (Deepgram's behaviour),
    # instead of an error message after it.
    check_query_first: bool = False
    # A refused handshake's body and headers, from its status and reason, where the protocol
    # defines them (None: the reason as plain text).
    refusal: Callable[[int, str], tuple[str, dict[str, str]]] | None = None


ENDPOINTS: dict[str, Endpoint] = {
    "/v1/stream": Endpoint(dialect=NativeDialect, resumable=True),
    # Deepgram SDK: Token KEY (an access token: Bearer)
    "/v1/listen": Endpoint(
        dialect=deepgram.DeepgramDialect,
        auth_schemes=("token", "bearer"),
        check_query_first=True,
        refusal=deepgram.refusal,
    ),
    "/v1/realtime": Endpoint(dialect=OpenAIRealtimeDialect),  # OpenAI SDK: Bearer KEY
    # AssemblyAI SDK: the bare key (Authorization: KEY)
    "/v3/ws": Endpoint(dialect=AssemblyAIDialect, auth_schemes=("", "bearer")),
}
