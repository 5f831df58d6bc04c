"""The event loop a captiond process runs its asyncio code on (`[server] event_loop`).

"auto" is uvloop (libuv) where it is installed, which is every Linux and macOS install (a
dependency), else asyncio's own loop. A worker's time goes to socket reads and writes,
callbacks and futures, which uvloop runs in C: 600 fake-engine streams on the 2-core VM had a
p95 final latency of 9.9 s on asyncio's loop and 2.4 s on uvloop. Runs on the calling thread,
which becomes the process's event-loop thread.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from captiond.errors import ConfigError

T = TypeVar("T")


def loop_factory(name: str) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """The loop constructor `name` ("auto", "uvloop", "asyncio") means; None: asyncio's."""
    if name == "asyncio":
        return None
    try:
        import uvloop
    except ImportError:
        if name == "uvloop":
            raise ConfigError(
                "[server] event_loop = 'uvloop', but uvloop is not installed: "
                "pip install uvloop, or use 'auto'"
            ) from None
        return None
    return uvloop.new_event_loop


def run(main: Coroutine[Any, Any, T], event_loop: str = "auto") -> T:
    """`asyncio.run(main)` on the loop `event_loop` names."""
    try:
        factory = loop_factory(event_loop)
    except ConfigError:
        main.close()  # never awaited: no "coroutine was never awaited" warning on top
        raise
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(main)
