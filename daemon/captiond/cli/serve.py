"""`captiond serve`: the composition root. Builds the configuration, loads the engine, starts the
engine thread (decoding.scheduler) or the worker pool (workers.pool), binds the port (with a
retry while another instance lets it go), runs the daemon on the event loop, and shuts down on
SIGTERM or Ctrl-C. Main thread; the event loop runs there too.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import errno
import logging
import os
import shutil
import signal
import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path

from captiond.cli.options import config_from, engine_options, load_warm_engine
from captiond.config import (
    Config,
    ServerConfig,
    config_from_mapping,
    dump_toml,
    override,
)
from captiond.errors import (
    ConfigError,
    ListenError,
)
from captiond.ops.loop import run as run_loop

log = logging.getLogger("captiond")


def add_serve(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("serve", help="run the websocket daemon")
    engine_options(p)
    p.add_argument("--host", help="listen address (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="listen port (default 8765; 0 picks a free one)")
    p.add_argument("--max-sessions", type=int, help="concurrent stream limit (default 64)")
    p.add_argument(
        "--workers",
        type=int,
        help="processes serving websockets and VAD; the engine stays in this one (default 1)",
    )
    p.add_argument(
        "--instance",
        help="this instance's name behind a load balancer (a DNS label): session ids start "
        "with it, so a resume finds its instance",
    )
    p.add_argument("--tls-cert", help="PEM certificate: serve wss:// and https://")
    p.add_argument("--tls-key", help="PEM private key for --tls-cert")
    p.add_argument(
        "--source",
        action="append",
        default=[],
        metavar="NAME[=DEVICE]",
        help="caption a microphone for viewers of /v1/captions?source=NAME (repeatable; "
        "DEVICE: index or name from `captiond devices`, default the system's input)",
    )
    p.add_argument("--print-config", action="store_true", help="print the effective config")
    p.set_defaults(func=_serve)


def _with_sources(config: Config, specs: list[str]) -> Config:
    """`--source NAME[=DEVICE]` options appended to the config's [[sources]]."""
    if not specs:
        return config
    tables: list[dict[str, object]] = [
        {k: v for k, v in dataclasses.asdict(s).items() if v is not None} for s in config.sources
    ]
    for spec in specs:
        name, _, device = spec.partition("=")
        tables.append(
            {"name": name, "device": int(device) if device.isdigit() else device or "default"}
        )
    return config_from_mapping({"sources": tables}, base=config)


def _serve(args: argparse.Namespace) -> int:
    config = override(
        config_from(args),
        "server",
        host=args.host,
        port=args.port,
        max_sessions=args.max_sessions,
        workers=args.workers,
        instance=args.instance,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
    )
    config = _with_sources(config, args.source)
    if args.print_config:
        print(dump_toml(config), end="")
        return 0
    from captiond.decoding.scheduler import InferenceScheduler
    from captiond.engines import scheduler_models
    from captiond.ops.metrics import share_across_processes

    metrics_dir: Path | None = None
    if config.server.workers > 1:
        # Before the engine's metrics exist: the workers' /metrics shows them too.
        metrics_dir = Path(tempfile.mkdtemp(prefix="captiond-metrics-"))
        share_across_processes(metrics_dir)
    from captiond.ops.systemd import Notifier, Supervised, supervise
    from captiond.server.daemon import tls_context

    tls_context(config.server)  # a wrong file is found before the engine's minutes of loading
    _probe_address(config.server)
    scheduler = InferenceScheduler(
        load_warm_engine(config),
        config.scheduler,
        **scheduler_models(config),
    )
    scheduler.start()
    notifier = Notifier()

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        loop.add_signal_handler(signal.SIGHUP, lambda: _hang_up(stop))
        daemon: Supervised
        if metrics_dir is None:
            from captiond.server.daemon import Daemon

            daemon = single = Daemon(config, scheduler)
            with _binding(config.server):
                await single.start()
            port = single.port
        else:
            from captiond.workers.pool import WorkerPool

            daemon = pool = WorkerPool(config, scheduler, metrics_dir=metrics_dir)
            with _binding(config.server):
                await pool.start()
            port = pool.port
        scheme = "wss" if config.server.tls_cert else "ws"
        log.info("ready: %s://%s:%d/v1/stream", scheme, config.server.host, port)
        supervisor = asyncio.create_task(supervise(daemon, notifier, stop))
        try:
            await stop.wait()
        finally:
            await daemon.shutdown()
            await supervisor
        log.info("stopped")

    try:
        run_loop(main(), config.server.event_loop)
    finally:
        notifier.close()
        scheduler.stop()
        scheduler.engine.close()
        if metrics_dir is not None:
            shutil.rmtree(metrics_dir, ignore_errors=True)
    return 0


# What binding the socket raises. The port still held (by the instance that is stopping) or an
# address the network has not brought up yet may pass on a retry; a port below 1024 without the
# privilege to bind it does not.
_BIND_RETRYABLE = (errno.EADDRINUSE, errno.EADDRNOTAVAIL)


_BIND_REFUSED = (errno.EACCES,)


@contextlib.contextmanager
def _binding(server: ServerConfig) -> Iterator[None]:
    """Around what binds the daemon's address: a failure names the address, as a ListenError
    (a retry may pass) or a ConfigError (see `main`)."""
    host = f"[{server.host}]" if ":" in server.host else server.host
    where = f"cannot listen on {host}:{server.port}"
    try:
        yield
    except socket.gaierror as exc:
        # The host is no address and no name this machine can resolve: a configuration
        # mistake, unless resolving only failed for now (no DNS server reachable yet).
        error = ListenError if exc.errno == socket.EAI_AGAIN else ConfigError
        raise error(f"{where}: {exc.strerror}") from None
    except OSError as exc:
        if exc.errno not in (*_BIND_RETRYABLE, *_BIND_REFUSED):
            raise  # not the bind (a worker that could not be spawned): as it is
        # asyncio's strerror restates the address: the errno's own text says just why.
        error = ListenError if exc.errno in _BIND_RETRYABLE else ConfigError
        raise error(f"{where}: {os.strerror(exc.errno)}") from None


def _probe_address(server: ServerConfig) -> None:
    """Bind the daemon's address once and let it go, before the engine's minutes of loading:
    a port in use (two instances on one port) is found at once, not after every reload of
    the model that systemd's retries would make. The daemon binds it again for good."""
    if server.port == 0:
        return
    with _binding(server):
        flags = socket.AI_PASSIVE
        for family, kind, proto, _, address in socket.getaddrinfo(
            server.host, server.port, type=socket.SOCK_STREAM, flags=flags
        ):
            with socket.socket(family, kind, proto) as probe:
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as asyncio
                probe.bind(address)


def _hang_up(stop: asyncio.Event) -> None:
    # Nothing here can be reloaded; a hang-up (a closed terminal, `kill -HUP`) stops the daemon
    # as SIGTERM does, draining its streams, rather than killing it with their last finals.
    log.warning("SIGHUP: stopping as on SIGTERM (captiond has no reload: restart it instead)")
    stop.set()
