"""Broadcast: one daemon-side source's messages fanned out to all of its viewers.

Event-loop thread only. A viewer that joins gets the source's state, then the recent finals (a
bounded backlog; a viewer that reconnects asks for those from a segment on), then live messages
in order. Each viewer has its own queue; one that falls
`viewer_queue_limit` messages behind is dropped (OverloadedError), so a stalled browser never
holds back the others or grows memory without bound.
"""

from __future__ import annotations

import asyncio
from collections import deque

from websockets.asyncio.server import ServerConnection

from captiond.errors import OverloadedError
from captiond.streaming.events import Final, ServerMessage, SourceStatus

_DROPPED = "dropped"  # queue sentinel: the viewer fell too far behind
_CLOSED = "closed"  # queue sentinel: the source stopped


class Broadcast:
    def __init__(self, *, backlog_finals: int, viewer_queue_limit: int = 1_000) -> None:
        self._backlog: deque[tuple[int, str]] = deque(maxlen=backlog_finals)  # (segment, JSON)
        self._status: str | None = None
        self._viewers: set[asyncio.Queue[str]] = set()
        self._limit = viewer_queue_limit
        self._closed = False

    @property
    def viewers(self) -> int:
        return len(self._viewers)

    def publish(self, message: ServerMessage) -> None:
        text = message.to_json()
        if isinstance(message, Final) and message.text:
            self._backlog.append((message.segment, text))
        elif isinstance(message, SourceStatus):
            self._status = text
        for queue in list(self._viewers):
            if queue.qsize() >= self._limit:
                self._viewers.discard(queue)
                queue.put_nowait(_DROPPED)
            else:
                queue.put_nowait(text)

    def close(self) -> None:
        """End every viewer's feed (the source stopped); later viewers get the backlog only."""
        self._closed = True
        for queue in self._viewers:
            queue.put_nowait(_CLOSED)
        self._viewers.clear()

    async def watch(self, conn: ServerConnection, since: int | None = None) -> None:
        """Feed one viewer until the source stops, the backlog from segment `since` first;
        raises OverloadedError if it fell behind and ConnectionClosed if it left. Anything the
        viewer sends is ignored."""
        queue: asyncio.Queue[str] = asyncio.Queue()
        backlog = [text for segment, text in self._backlog if since is None or segment >= since]
        for text in [*([self._status] if self._status else []), *backlog]:
            queue.put_nowait(text)
        if self._closed:
            queue.put_nowait(_CLOSED)
        else:
            self._viewers.add(queue)
        reader = asyncio.create_task(_ignore_incoming(conn))
        try:
            while True:
                getter = asyncio.create_task(queue.get())
                await asyncio.wait({getter, reader}, return_when=asyncio.FIRST_COMPLETED)
                if reader.done():
                    getter.cancel()
                    reader.result()  # raises ConnectionClosed when the viewer went away
                    return
                text = getter.result()
                if text == _CLOSED:
                    return
                if text == _DROPPED:
                    raise OverloadedError(f"viewer fell {self._limit} messages behind")
                await conn.send(text)
        finally:
            self._viewers.discard(queue)
            reader.cancel()


async def _ignore_incoming(conn: ServerConnection) -> None:
    async for _ in conn:
        pass
