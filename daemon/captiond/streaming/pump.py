"""`drive_session`: one StreamSession's decodes, one at a time, until it is done (event-loop
thread). The connection, the daemon-side sources and the offline transcriber call it with a
`Submit` from decoding/ (or the engine directly); it never imports decoding/.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from captiond.engines.base import EngineResult, Submit
from captiond.streaming.session import StreamSession
from captiond.streaming.utterance import DecodeRequest


async def drive_session(
    session: StreamSession,
    submit: Submit,
    wake: asyncio.Event,
    deliver: Callable[[], Awaitable[None]],
) -> None:
    """Run one session's decodes, one at a time, until it is done (event-loop thread).

    `wake` is set by whoever feeds the session; `deliver` sends the messages it produced.
    """
    while not session.done:
        # Cleared before the session is looked at: whatever wakes it later is seen.
        wake.clear()
        request = session.next_request()
        # next_request may have produced finals that early finals answered (and `done`): they
        # go now, not after the decode it asks for next.
        await deliver()
        if request is None:
            if not session.done:
                await wake.wait()
            continue
        decode = asyncio.ensure_future(submit(request.engine_request))
        try:
            if not await _unless_superseded(decode, request, session, wake, deliver):
                # A partial whose utterance ended (the final makes it moot), or an early final
                # the speaker went on after: withdrawn, it lets what is due now go first.
                session.abandon(request)
                continue
            result = await decode
        finally:
            # Withdrawn, or this pump was cancelled (the client left): the engine skips it.
            decode.cancel()
        session.on_result(request, result)
        await deliver()


async def _unless_superseded(
    decode: asyncio.Future[EngineResult],
    request: DecodeRequest,
    session: StreamSession,
    wake: asyncio.Event,
    deliver: Callable[[], Awaitable[None]],
) -> bool:
    """Wait for `decode`, sending what the session has to say meanwhile (`speech_started` of
    a new utterance); False as soon as the session no longer wants it."""
    while not decode.done():
        if session.superseded(request):
            return False
        wake.clear()
        woken: asyncio.Future[Any] = asyncio.ensure_future(wake.wait())
        waiting: tuple[asyncio.Future[Any], ...] = (decode, woken)
        await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
        woken.cancel()
        await deliver()
    return True
