"""The one exception tree of captiond.

Every error the daemon raises on purpose derives from `CaptiondError`. Errors that end a client
session carry a protocol `code` (the `error` message's code) and map to protocol v1's close
codes here, in `CLOSE_CODES`, and nowhere else (a vendor dialect maps them to its own).
Requests refused before the websocket upgrade carry their HTTP `status` instead. Pure values:
used on every thread.
"""

from __future__ import annotations

from collections.abc import Mapping


class CaptiondError(Exception):
    """Base of every error captiond raises on purpose."""


class ConfigError(CaptiondError):
    """A configuration file, option or model path is invalid."""


class ListenError(CaptiondError):
    """The daemon could not listen on its address, for now (the port still held): a retry may
    pass, unlike a ConfigError (`captiond serve` exits 1, not 2)."""


class ModelNotFoundError(ConfigError):
    """The model folder does not exist or is not a CTranslate2 Whisper folder."""


class HubUnavailableError(CaptiondError):
    """Downloading the model failed for the Hub's or the network's trouble (no connection, a
    timeout, an HTTP 5xx or 429): a retry may pass, unlike a ModelNotFoundError (`captiond
    serve` exits 1, not 2)."""


class SessionError(CaptiondError):
    """An error that ends one client session; `code` goes into the `error` message."""

    code = "internal"


class BadAudioError(SessionError):
    """Audio the daemon cannot take: odd byte counts, unsupported rate or encoding."""

    code = "bad_audio"


class FrameTooLargeError(SessionError):
    """A websocket frame over the configured maximum."""

    code = "too_large"


class BadMessageError(SessionError):
    """A protocol violation: malformed JSON, unknown type, audio where none belongs."""

    code = "bad_message"


class OverloadedError(SessionError):
    """The daemon is at its session limit."""

    code = "overloaded"


class IdleTimeoutError(SessionError):
    """A stream sent no audio for `[server] idle_timeout_s`."""

    code = "idle_timeout"


class RateLimitedError(SessionError):
    """A stream sent audio faster than `[server] max_audio_speed` times real time."""

    code = "rate_limited"


class ResumeFailedError(SessionError):
    """A resume token that is wrong, unknown or expired (`[server] resume_s`)."""

    code = "resume_failed"


class ShuttingDownError(SessionError):
    """The daemon is stopping: sent after the stream's last finals, instead of `done`."""

    code = "shutting_down"


class RequestRejectedError(CaptiondError):
    """A request refused before the websocket upgrade, with an HTTP status."""

    status = 400


class UnauthorizedError(RequestRejectedError):
    """The client did not present the configured token (RFC 6750 Bearer or ?token=)."""

    status = 401


class OriginNotAllowedError(RequestRejectedError):
    """A browser page of another origin, not in `[server] allowed_origins`."""

    status = 403


class HostNotAllowedError(RequestRejectedError):
    """A request without a token for what a page could read, sent to a name that is not this
    machine's (a site's DNS name rebound to it) and not an allowed origin's host."""

    status = 403


class EngineFailedError(SessionError):
    """The inference engine raised while decoding this session's audio."""

    code = "engine_failed"


class SourceNotFoundError(SessionError):
    """A viewer asked for a daemon-side source that does not exist."""

    code = "no_such_source"


CLOSE_NORMAL = 1000
CLOSE_GOING_AWAY = 1001
CLOSE_DROPPED = 1006  # no close frame: what the journal records for a session never resumed
CLOSE_INTERNAL = 1011
CLOSE_CODES: dict[type[SessionError], int] = {
    ShuttingDownError: 1001,
    BadAudioError: 1007,
    BadMessageError: 1008,
    SourceNotFoundError: 1008,
    FrameTooLargeError: 1009,
    EngineFailedError: 1011,
    OverloadedError: 1013,
    RateLimitedError: 4029,
    IdleTimeoutError: 4408,
    ResumeFailedError: 4410,
}


def close_code_for(
    error: SessionError, codes: Mapping[type[SessionError], int] = CLOSE_CODES
) -> int:
    """The close code for `error` in `codes` (protocol v1's by default): its class's, or the
    nearest base class's."""
    for cls in type(error).__mro__:
        if cls in codes:
            return codes[cls]
    return CLOSE_INTERNAL
