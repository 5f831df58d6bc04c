"""`python -m captiond.workers.main`: one worker process of `captiond serve --workers N`.

Started by the main process (workers/pool.py), never by hand. Reads the daemon's config (TOML) from
stdin, takes the engine's facts from the link to the main process, and runs a `Daemon` in
worker mode on its event-loop thread: connections arrive as file descriptors on the ctrl
socket, decodes go over the link (decoding/client.py). It reports its counters once a second;
SIGTERM drains it (last finals, then 1001); it exits when the main process goes away.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib
import logging
import signal
import socket
import sys
import tomllib
from collections.abc import Callable, Sequence

from captiond.config import Config, config_from_mapping
from captiond.decoding.client import EngineClient
from captiond.errors import CaptiondError
from captiond.ops.logs import configure_logging
from captiond.ops.loop import run as run_loop
from captiond.server.daemon import Daemon
from captiond.server.routing import WorkerSlot
from captiond.streaming.vad import Vad

log = logging.getLogger(__name__)

_STATUS_EVERY_S = 1.0


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="captiond.workers.main", description=__doc__)
    p.add_argument("--index", type=int, required=True)
    p.add_argument("--count", type=int, required=True)
    p.add_argument("--ctrl-fd", type=int, required=True)
    p.add_argument("--link-fd", type=int, required=True)
    p.add_argument("--log-level", default="info")
    p.add_argument(
        "--vad",
        help="MODULE:CALLABLE making each stream's VAD instead of webrtcvad (for tests)",
    )
    return p


def _vad_factory(spec: str | None) -> Callable[[], Vad] | None:
    if not spec:
        return None
    module, _, name = spec.partition(":")
    factory: Callable[[], Vad] = getattr(importlib.import_module(module), name)
    return factory


async def _serve(args: argparse.Namespace, config: Config) -> None:
    slot = WorkerSlot(args.index, args.count)
    link = socket.socket(fileno=args.link_fd)
    ctrl = socket.socket(fileno=args.ctrl_fd)
    ctrl.setblocking(False)
    reader, writer = await asyncio.open_unix_connection(sock=link)
    decoder = await EngineClient.connect(reader, writer)
    daemon = Daemon(config, decoder, _vad_factory(args.vad), slot=slot)
    await daemon.start()
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    # Ctrl-C in a terminal, a hang-up or `systemctl kill -s HUP` reaches the whole process
    # group: the main process decides (it drains the workers with SIGTERM).
    loop.add_signal_handler(signal.SIGINT, lambda: None)
    loop.add_signal_handler(signal.SIGHUP, lambda: None)
    adopting: set[asyncio.Task[None]] = set()

    def take_connections() -> None:
        while True:
            try:
                _, fds, _, _ = socket.recv_fds(ctrl, 16, 64)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                stop.set()
                return
            if not fds:  # the main process closed its end
                stop.set()
                return
            for fd in fds:
                task = asyncio.create_task(daemon.adopt(socket.socket(fileno=fd)))
                adopting.add(task)
                task.add_done_callback(adopting.discard)

    loop.add_reader(ctrl.fileno(), take_connections)
    engine_link = asyncio.create_task(decoder.run())
    reporter = asyncio.create_task(_report(daemon, decoder))
    closed = asyncio.create_task(decoder.closed.wait())
    stopped = asyncio.create_task(stop.wait())
    await asyncio.wait((closed, stopped), return_when=asyncio.FIRST_COMPLETED)
    if decoder.closed.is_set():
        log.error("worker %d: the main process is gone; stopping", args.index)
    loop.remove_reader(ctrl.fileno())
    ctrl.close()
    await daemon.shutdown()
    for task in (reporter, closed, stopped, engine_link):
        task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await engine_link


async def _report(daemon: Daemon, decoder: EngineClient) -> None:
    while True:
        behind = daemon.load.behind(asyncio.get_running_loop().time(), daemon.sessions_open)
        decoder.report(daemon.sessions_open, daemon.sessions_total, daemon.sources_status(), behind)
        await asyncio.sleep(_STATUS_EVERY_S)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    configure_logging(args.log_level)
    config = config_from_mapping(tomllib.loads(sys.stdin.read()))
    try:
        run_loop(_serve(args, config), config.server.event_loop)
    except CaptiondError as exc:  # a journal dir it cannot write, …: one line, not a traceback
        log.error("worker %d cannot start: %s", args.index, exc)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
