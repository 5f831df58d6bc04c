"""`captiond`: serve, transcribe, bench. Parses options, configures logging, owns start-up.

Runs on the main thread; `serve` then hands the event loop to server.py and the engine to the
scheduler's engine thread.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import errno
import json
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from captiond.config import (
    Config,
    ServerConfig,
    config_from_mapping,
    dump_toml,
    load_config,
    override,
)
from captiond.engines import ENGINE_NAMES, Engine, EngineInfo, load_engine
from captiond.errors import (
    CaptiondError,
    ConfigError,
    HubUnavailableError,
    ListenError,
    SessionError,
)
from captiond.logs import LOG_LEVELS
from captiond.loop import run as run_loop
from captiond.protocol import (
    AUTO_LANGUAGE,
    parse_language,
)

log = logging.getLogger("captiond")


def _engine_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", type=Path, help="TOML configuration file")
    parser.add_argument(
        "--model",
        help="model name (base, small, large-v3, … see `captiond models`), Hugging Face repo id"
        " or CTranslate2 Whisper folder (default: bundled tiny.en)",
    )
    parser.add_argument(
        "--download",
        action="store_true",
        default=None,
        help="download the model from the Hugging Face Hub if it is not cached",
    )
    parser.add_argument("--engine", choices=ENGINE_NAMES, help="inference engine (default auto)")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), help="default auto")
    parser.add_argument("--compute-type", help="int8, float16, float32, … (default auto)")
    parser.add_argument(
        "--beam",
        type=int,
        help="beam size of every final decode (default: [stream] final_beam_size 5, "
        "context_beam_size 3 with context); 1: greedy finals, which torch_graph replays from "
        "its CUDA graphs",
    )
    parser.add_argument(
        "--language",
        help="spoken language (en, de, zh-TW, …) or auto: detected per utterance"
        " (multilingual models), or a list (en,de): detected among those;"
        " default [stream] language, en",
    )
    parser.add_argument(
        "--prompt",
        help="names and terms the audio may contain, for streams that give none"
        ' ("Philip Steels, Grafana"); default [stream] prompt',
    )
    parser.add_argument(
        "--log-level", default="info", type=str.lower, choices=LOG_LEVELS, help="default info"
    )


def _config_from(args: argparse.Namespace) -> Config:
    # A tag naming a Chinese variant (zh-TW) sets both, as `?language=zh-TW` does.
    language = None if args.language is None else parse_language(args.language)
    config = override(
        load_config(args.config),
        "stream",
        language=None if language is None else language.setting,
        chinese_variant=None if language is None else language.chinese_variant,
        prompt=args.prompt,
        final_beam_size=args.beam,
        context_beam_size=args.beam,
    )
    return override(
        config,
        "engine",
        name=args.engine,
        model=args.model,
        allow_download=args.download,
        device=args.device,
        compute_type=args.compute_type,
    )


def _load_warm_engine(config: Config, task: str = "transcribe") -> Engine:
    started = time.monotonic()
    engine = load_engine(config.engine)
    # Before the warm-up: a language or task the model cannot do is refused without waiting.
    info = EngineInfo.of(engine)
    english_only = info.english_only
    language = parse_language(config.stream.language)
    try:
        info.check_can(language.code, task, language.candidates)
    except SessionError as exc:
        engine.close()
        raise ConfigError(f"--language / --task: {exc}") from None
    if language.code == AUTO_LANGUAGE and english_only:
        log.warning("the model %s is English-only: language auto is English", english_only)
    engine.warmup()
    log.info(
        "engine %s (model %s) loaded and warmed up in %.1f s",
        engine.name,
        engine.model_name,
        time.monotonic() - started,
    )
    return engine


# -- serve -----------------------------------------------------------------------------------


def _add_serve(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("serve", help="run the websocket daemon")
    _engine_options(p)
    p.add_argument("--host", help="listen address (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="listen port (default 8765; 0 picks a free one)")
    p.add_argument("--max-sessions", type=int, help="concurrent stream limit (default 64)")
    p.add_argument(
        "--workers",
        type=int,
        help="processes serving websockets and VAD; the engine stays in this one (default 1)",
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
        _config_from(args),
        "server",
        host=args.host,
        port=args.port,
        max_sessions=args.max_sessions,
        workers=args.workers,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
    )
    config = _with_sources(config, args.source)
    if args.print_config:
        print(dump_toml(config), end="")
        return 0
    from captiond.metrics import share_across_processes
    from captiond.scheduler import InferenceScheduler

    metrics_dir: Path | None = None
    if config.server.workers > 1:
        # Before the engine's metrics exist: the workers' /metrics shows them too.
        metrics_dir = Path(tempfile.mkdtemp(prefix="captiond-metrics-"))
        share_across_processes(metrics_dir)
    from captiond.server import tls_context
    from captiond.systemd import Notifier, Supervised, supervise

    tls_context(config.server)  # a wrong file is found before the engine's minutes of loading
    _probe_address(config.server)
    scheduler = InferenceScheduler(_load_warm_engine(config), config.scheduler)
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
            from captiond.server import Daemon

            daemon = single = Daemon(config, scheduler)
            with _binding(config.server):
                await single.start()
            port = single.port
        else:
            from captiond.workers import WorkerPool

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


# -- devices, install-service ----------------------------------------------------------------


def _add_service_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("devices", help="list the audio input devices a source can use")
    p.set_defaults(func=_devices)
    p = sub.add_parser("models", help="list model names and which are available offline")
    p.set_defaults(func=_models)
    p = sub.add_parser("install-service", help="write the systemd unit and an example config")
    kind = p.add_mutually_exclusive_group()
    kind.add_argument("--user", action="store_true", help="a user unit (desktop session mic)")
    kind.add_argument("--template", action="store_true", help="captiond@GPU.service, one per GPU")
    p.add_argument("--exec", dest="exec_path", help="path of captiond (default: this one)")
    p.add_argument("--print", action="store_true", help="print the unit and config, write nothing")
    p.set_defaults(func=_install_service)


def _models(args: argparse.Namespace) -> int:
    from captiond.models import MODEL_REPOS, list_models

    width = max(len(name) for name in MODEL_REPOS)
    for entry in list_models():
        # A repo id found in the cache is its own name: one column for both.
        label = (
            f"{entry.name:<{width}}  {entry.repo_id:<44}"
            if entry.name in MODEL_REPOS
            else f"{entry.name:<{width + 46}}"
        )
        if entry.where and entry.note:
            print(f"{label}  {entry.where} ({entry.note})")
        else:
            print(f"{label}  {entry.where or entry.note}")
    print("\n--model also takes any Hugging Face repo id (owner/name) or a model folder.")
    return 0


def _devices(args: argparse.Namespace) -> int:
    from captiond_client.mic import DeviceError, input_devices

    try:
        devices = input_devices()
    except DeviceError as exc:
        raise ConfigError(str(exc)) from exc
    if not devices:
        print("no audio input devices (is PulseAudio or PipeWire running for this user?)")
        return 0
    print(f"{'index':>5}  {'channels':>8}  {'rate_hz':>7}  name")
    for d in devices:
        print(f"{d.index:>5}  {d.channels:>8}  {d.default_rate_hz:>7}  {d.name}")
    return 0


def _install_service(args: argparse.Namespace) -> int:
    from captiond.systemd import DEFAULT_EXEC, plan_install, write_install

    kind = "user" if args.user else "template" if args.template else "system"
    exec_path = args.exec_path or shutil.which("captiond") or DEFAULT_EXEC
    resolved = Path(exec_path).resolve()
    install = plan_install(kind, str(resolved))
    hidden = [d for d in ("/home", "/root") if resolved.is_relative_to(d)]
    if kind != "user" and hidden:
        # ProtectHome=yes hides these from the service: it would fail to start.
        print(
            f"warning: {resolved} is under {hidden[0]}, which the system unit cannot see"
            " (ProtectHome=yes): install captiond outside it (a virtual environment in /opt,"
            " say) and pass its path with --exec",
            file=sys.stderr,
        )
    if args.print:
        print(
            f"# {install.unit_path}\n{install.unit_text}\n"
            f"# {install.config_path}\n{install.config_text}"
        )
        return 0
    try:
        print("\n".join(write_install(install)))
    except OSError as exc:
        raise ConfigError(f"cannot write {exc.filename}: {exc.strerror} (root needed?)") from exc
    scope = "--user " if kind == "user" else ""
    unit = "captiond@0" if kind == "template" else "captiond"
    print(f"then: systemctl {scope}daemon-reload && systemctl {scope}enable --now {unit}")
    return 0


# -- transcribe ------------------------------------------------------------------------------


def _add_transcribe(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("transcribe", help="transcribe an audio file offline (same segmentation)")
    p.add_argument(
        "file", type=Path, help="audio file (WAV, FLAC, MP3, M4A, a video, …): any rate, channels"
    )
    _engine_options(p)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument(
        "--task",
        choices=("transcribe", "translate"),
        default="transcribe",
        help="translate: English text of any language (multilingual models)",
    )
    p.set_defaults(func=_transcribe)


def _transcribe(args: argparse.Namespace) -> int:
    from captiond.offline import transcribe_samples
    from captiond_client.audiofile import AudioFileError, read_audio_16k_mono

    config = _config_from(args)
    try:
        samples = read_audio_16k_mono(args.file)
    except (AudioFileError, OSError) as exc:
        raise CaptiondError(f"cannot read {str(args.file)!r}: {exc}") from None
    engine = _load_warm_engine(config, args.task)
    try:
        started = time.monotonic()
        transcript = transcribe_samples(samples, engine, config, task=args.task)
        wall_s = time.monotonic() - started
    finally:
        engine.close()
    if args.json:
        out = {
            "file": str(args.file),
            "engine": engine.name,
            "model": engine.model_name,
            "audio_ms": transcript.audio_ms,
            "wall_s": round(wall_s, 3),
            "text": transcript.text,
            "segments": [s.to_dict() for s in transcript.segments if s.text],
        }
        print(json.dumps(out, ensure_ascii=False))
    else:
        print(transcript.text)
    return 0


# -- journal ---------------------------------------------------------------------------------


def _add_journal(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("journal", help="read the transcript journal ([journal] dir)")
    actions = p.add_subparsers(dest="journal_command", required=True)
    show = actions.add_parser("show", help="list journaled sessions, or print one's transcript")
    show.add_argument("session", nargs="?", help="session id, unique id prefix, or a .jsonl file")
    show.add_argument("--config", type=Path, help="TOML configuration file (its [journal] dir)")
    show.add_argument("--dir", help="journal folder (default: [journal] dir of --config)")
    show.add_argument("--json", action="store_true", help="print the records as JSON lines")
    show.set_defaults(func=_journal_show)


def _clock(ms: int) -> str:
    s, ms = divmod(ms, 1000)
    h, s = divmod(s, 3600)
    return f"{h:02d}:{s // 60:02d}:{s % 60:02d}.{ms:03d}"


def _journal_show(args: argparse.Namespace) -> int:
    from captiond.journal_read import find_session, read_session

    key: str | None = args.session
    if key is not None and (key.endswith(".jsonl") or "/" in key):
        session = read_session(Path(key))
    else:
        folder = args.dir or load_config(args.config).journal.dir
        if not folder:
            raise ConfigError("no journal folder: pass --dir, or --config with a [journal] dir")
        if key is None:
            return _journal_list(Path(folder), as_json=args.json)
        session = find_session(Path(folder), key)
    if args.json:
        for record in session.records:
            print(json.dumps(record, ensure_ascii=False, separators=(",", ":")))
    else:
        for final in session.finals:
            if final.text:
                print(f"[{_clock(final.start_ms)} → {_clock(final.end_ms)}] {final.text}")
    return 0


def _journal_list(folder: Path, *, as_json: bool) -> int:
    from captiond.journal_read import list_sessions

    sessions = list_sessions(folder)
    if not sessions:
        print(f"no journaled sessions in {folder}", file=sys.stderr)
    elif not as_json:
        print(f"{'started':<24}  {'session':<12}  {'finals':>6}  {'audio':>12}  status")
    for s in sessions:
        if as_json:
            summary = {
                "session": s.session,
                "started": s.started,
                "files": [str(f) for f in s.files],
                "finals": len(s.finals),
                "ended": s.ended,
                "audio_ms": s.audio_ms,
                "close_code": s.close_code,
            }
            print(json.dumps(summary, ensure_ascii=False, separators=(",", ":")))
        else:
            audio = "-" if s.audio_ms is None else _clock(s.audio_ms)
            status = "ended" if s.ended else "open (crashed or live)"
            print(f"{s.started:<24}  {s.session:<12}  {len(s.finals):>6}  {audio:>12}  {status}")
    return 0


# -- main ------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="captiond", description="Streaming real-time speech transcription daemon."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    _add_serve(sub)
    _add_transcribe(sub)
    _add_service_commands(sub)
    _add_journal(sub)
    from captiond.bench import add_bench_parser

    add_bench_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from captiond.logs import configure_logging

    args = build_parser().parse_args(argv)
    configure_logging(getattr(args, "log_level", "info"))
    func: Callable[[argparse.Namespace], int] = args.func
    # Exit 2: a mistake in the configuration or the command line (as argparse's own), which
    # no restart fixes: the units' RestartPreventExitStatus=2 stops systemd retrying it. Exit 1
    # for what a retry may get past: the port still held by the instance that is stopping, an
    # address the network has not brought up yet, a Hub down while the model downloads (the
    # units restart it after RestartSec).
    try:
        return func(args)
    except (ListenError, HubUnavailableError) as exc:
        print(f"captiond: error: {exc}", file=sys.stderr)
        return 1
    except CaptiondError as exc:
        print(f"captiond: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # The reader left (`captiond models | head`): nothing more to say, and Python's own
        # flush of stdout at exit must not fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


if __name__ == "__main__":
    sys.exit(main())
