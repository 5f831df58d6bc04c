"""`captiond`: serve, transcribe, bench. Parses options, configures logging, owns start-up.

Runs on the main thread; `serve` then hands the event loop to server.py and the engine to the
scheduler's engine thread.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from captiond.config import Config, dump_toml, load_config, override
from captiond.engines import ENGINE_NAMES, Engine, load_engine
from captiond.errors import CaptiondError

log = logging.getLogger("captiond")


def _engine_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", type=Path, help="TOML configuration file")
    parser.add_argument("--model", help="CTranslate2 Whisper folder (default: bundled tiny.en)")
    parser.add_argument("--engine", choices=ENGINE_NAMES, help="inference engine (default auto)")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), help="default auto")
    parser.add_argument("--compute-type", help="int8, float16, float32, … (default auto)")
    parser.add_argument("--log-level", default="info", help="debug, info, warning, error")


def _config_from(args: argparse.Namespace) -> Config:
    config = load_config(args.config)
    return override(
        config,
        "engine",
        name=args.engine,
        model=args.model,
        device=args.device,
        compute_type=args.compute_type,
    )


def _load_warm_engine(config: Config) -> Engine:
    started = time.monotonic()
    engine = load_engine(config.engine)
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
    p.add_argument("--tls-cert", help="PEM certificate: serve wss:// and https://")
    p.add_argument("--tls-key", help="PEM private key for --tls-cert")
    p.add_argument("--print-config", action="store_true", help="print the effective config")
    p.set_defaults(func=_serve)


def _serve(args: argparse.Namespace) -> int:
    config = override(
        _config_from(args),
        "server",
        host=args.host,
        port=args.port,
        max_sessions=args.max_sessions,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
    )
    if args.print_config:
        print(dump_toml(config), end="")
        return 0
    from captiond.scheduler import InferenceScheduler
    from captiond.server import Daemon, run_daemon

    scheduler = InferenceScheduler(_load_warm_engine(config), config.scheduler)
    scheduler.start()

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)

        async def ready(daemon: Daemon) -> None:
            log.info("ready: ws://%s:%d/v1/stream", config.server.host, daemon.port)

        await run_daemon(config, scheduler, on_ready=ready, stop=stop)
        log.info("stopped")

    try:
        asyncio.run(main())
    finally:
        scheduler.stop()
        scheduler.engine.close()
    return 0


# -- transcribe ------------------------------------------------------------------------------


def _add_transcribe(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("transcribe", help="transcribe a WAV file offline (same segmentation)")
    p.add_argument("file", type=Path, help="WAV file, any rate and channel count")
    _engine_options(p)
    p.add_argument("--beam", type=int, help="beam size of the final decodes (default 1)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=_transcribe)


def _transcribe(args: argparse.Namespace) -> int:
    from captiond.offline import transcribe_samples
    from captiond_client.wavfile import read_wav_16k_mono

    config = override(_config_from(args), "stream", final_beam_size=args.beam)
    samples = read_wav_16k_mono(args.file)
    engine = _load_warm_engine(config)
    try:
        started = time.monotonic()
        transcript = transcribe_samples(samples, engine, config)
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


# -- main ------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="captiond", description="Streaming real-time speech transcription daemon."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    _add_serve(sub)
    _add_transcribe(sub)
    from captiond.bench import add_bench_parser

    add_bench_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from captiond.logs import configure_logging

    args = build_parser().parse_args(argv)
    configure_logging(getattr(args, "log_level", "info"))
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        return func(args)
    except CaptiondError as exc:
        print(f"captiond: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
