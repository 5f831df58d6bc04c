"""What `bench stream` and `bench capacity` share: options, clips, the engine, the daemon.

Main thread (and its event loop for `bench_daemon`, whose scheduler runs the engine on its own
thread; with workers > 1 worker processes serve the websockets). Clips come from a manifest in
the speech corpus format (../shared/speech/manifest.jsonl by default, or $CAPTIOND_SPEECH_DIR).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import wave
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
from websockets.asyncio.client import connect

from captiond.bench.peer_whisperlive import MODES, peer_version
from captiond.bench.report import config_dict, machine_facts, parse_settings
from captiond.config import Config, load_config, override
from captiond.decoding.scheduler import InferenceScheduler
from captiond.engines import ENGINE_NAMES, load_engine, scheduler_models
from captiond.engines.base import Engine
from captiond.errors import ConfigError
from captiond.lang.languages import AUTO_LANGUAGE, check_language
from captiond.ops.logs import LOG_LEVELS
from captiond.ops.loop import run as run_loop
from captiond.samples import Samples
from captiond.server.daemon import Daemon
from captiond.sources.audiofile import read_audio_16k_mono, to_pcm_s16le
from captiond.whisper import SAMPLE_RATE_HZ
from captiond_client.stream import stream_url

# The corpus's kinds of clip (../shared/speech/README.md): `--clips KIND[:N]`.
KINDS = ("long", "utterance", "nonspeech", "meeting")


def add_options(p: argparse.ArgumentParser, default_clips: str) -> None:
    p.add_argument(
        "--clips",
        default=default_clips,
        help="comma list of KIND[:N] (long, utterance, nonspeech, meeting; utterances with exact "
        f"references) or clip ids (default {default_clips})",
    )
    p.add_argument("--manifest", type=Path, default=None, help="speech corpus manifest.jsonl")
    p.add_argument("--max-clip-s", type=float, default=None, help="cut clips to this length")
    p.add_argument("--speed", type=float, default=1.0, help="times real time (default 1.0)")
    p.add_argument("--url", default=None, help="stream to this daemon instead of in-process")
    p.add_argument("--config", type=Path, help="TOML configuration file")
    p.add_argument("--engine", choices=ENGINE_NAMES, help="inference engine (default auto)")
    p.add_argument(
        "--model",
        default=None,
        help="model name, Hugging Face repo id or folder (default: bundled tiny.en)",
    )
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default=None)
    p.add_argument(
        "--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="config override"
    )
    p.add_argument("--peer", choices=("whisperlive",), default=None, help="also measure the peer")
    p.add_argument("--peer-mode", choices=MODES, default="default", help="WhisperLive model mode")
    p.add_argument("--out", type=Path, required=True, help="folder for the JSON and the PNG")
    p.add_argument(
        "--log-level",
        default="warning",
        type=str.lower,
        choices=LOG_LEVELS,
        help="daemon log level (default warning)",
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class Clip:
    id: str
    kind: str
    text: str
    ref_quality: str
    samples: npt.NDArray[np.float32]
    language: str = "en"  # the manifest's `language` (../shared/speech has none: English)

    @property
    def duration_s(self) -> float:
        return len(self.samples) / SAMPLE_RATE_HZ


@dataclass(slots=True, kw_only=True)
class BenchEnv:
    config: Config
    engine: Engine
    clips: list[Clip]
    manifest: Path
    offline: dict[str, str] = field(default_factory=dict)
    offline_rtf: dict[str, float] = field(default_factory=dict)


# The sweep with every stream diarized (--diarize on/both), as the JSONs name it; turns ended
# by the end-of-turn model (--end-of-turn model/both) add TURN_MODEL_SUFFIX to the name.
DIARIZED = "captiond-diarize"
TURN_MODEL_SUFFIX = "-turn-model"


def add_daemon_run_options(p: argparse.ArgumentParser) -> None:
    """--diarize and --end-of-turn: the daemon's streams without speaker labels or with them,
    their turns ended by silence or by the end-of-turn model, or both ways in one run (the
    same audio, machine and engine, so that they compare)."""
    p.add_argument(
        "--diarize",
        choices=("off", "on", "both"),
        default="off",
        help="diarize every stream ([stream] diarize); both: without, then with, in one run",
    )
    p.add_argument(
        "--end-of-turn",
        choices=("silence", "model", "both"),
        default=None,
        help="what ends turns ([vad] end_of_turn; default: the config's); both: silence, then "
        "the end-of-turn model, in one run",
    )


def daemon_runs(args: argparse.Namespace, env: BenchEnv) -> list[tuple[str, BenchEnv]]:
    """The daemon runs --diarize and --end-of-turn ask for, named as the JSON keys them
    ("captiond", DIARIZED, each + TURN_MODEL_SUFFIX with the model), each with its env's
    `[stream] diarize` and `[vad] end_of_turn` set."""
    if args.url and (args.diarize != "off" or args.end_of_turn is not None):
        raise ConfigError("bench: --diarize and --end-of-turn start a daemon here; not with --url")
    modes = {
        "silence": ["silence"],
        "model": ["model"],
        "both": ["silence", "model"],
        None: [env.config.vad.end_of_turn],
    }[args.end_of_turn]
    runs = []
    for name, diarize, wanted in (("captiond", False, "off"), (DIARIZED, True, "on")):
        if args.diarize not in (wanted, "both"):
            continue
        for mode in modes:
            config = override(env.config, "stream", diarize=diarize)
            config = override(config, "vad", end_of_turn=mode)
            suffix = TURN_MODEL_SUFFIX if mode == "model" else ""
            runs.append((name + suffix, dataclasses.replace(env, config=config)))
    return runs


def default_manifest() -> Path:
    root = os.environ.get("CAPTIOND_SPEECH_DIR")
    return Path(root) / "manifest.jsonl" if root else Path("../shared/speech/manifest.jsonl")


def select_clips(entries: list[dict[str, Any]], spec: str) -> list[dict[str, Any]]:
    """KIND[:N] picks N clips of a kind (utterances: exact references, spread out); else ids."""
    by_id = {e["id"]: e for e in entries}
    chosen: list[dict[str, Any]] = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        kind, _, count = item.partition(":")
        if kind in KINDS:
            pool = [e for e in entries if e["kind"] == kind]
            if kind == "utterance":
                pool = [e for e in pool if e.get("ref_quality") == "exact"]
            if count and not (count.isdecimal() and int(count) > 0):
                raise ConfigError(f"--clips: {item!r}: the count after {kind}: is a number ≥ 1")
            n = int(count) if count else len(pool)
            step = max(1, len(pool) // max(n, 1)) if kind == "utterance" else 1
            chosen += pool[::step][:n]
        elif item in by_id:
            chosen.append(by_id[item])
        else:
            raise ConfigError(f"--clips: {item!r} is neither a kind ({', '.join(KINDS)}) nor an id")
    return chosen


def write_wav(path: Path, samples: npt.NDArray[np.floating[Any]]) -> None:
    """A 16 kHz mono 16-bit WAV, for corpora the bench scripts build (bench/*.py)."""
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(SAMPLE_RATE_HZ)
        w.writeframes(to_pcm_s16le(samples))


def read_manifest(manifest: Path) -> list[dict[str, Any]]:
    """A corpus manifest's entries (one JSON object per line), in order."""
    try:
        with manifest.open(encoding="utf-8") as fh:
            return [json.loads(line) for line in fh if line.strip()]
    except FileNotFoundError:
        raise ConfigError(
            f"no speech corpus manifest at {manifest}: give one with --manifest, or the"
            " corpus's folder in $CAPTIOND_SPEECH_DIR"
        ) from None


def load_clips(manifest: Path, spec: str, max_s: float | None) -> list[Clip]:
    clips = []
    for e in select_clips(read_manifest(manifest), spec):
        samples = read_audio_16k_mono(manifest.parent / e["file"])
        if max_s is not None:
            samples = samples[: int(max_s * SAMPLE_RATE_HZ)]
        # A cut clip's reference no longer matches: keep it only for the clip's own kind.
        exact = e.get("ref_quality", "exact") == "exact" and (
            max_s is None or max_s >= e["duration_s"]
        )
        clips.append(
            Clip(
                id=e["id"],
                kind=e["kind"],
                text=e["text"],
                ref_quality="exact" if exact else "approximate",
                samples=samples,
                language=e.get("language", "en"),
            )
        )
    return clips


def prepare(args: argparse.Namespace, *, one_language: bool = False) -> BenchEnv:
    """Config (file, options, --set), clips, and the warmed-up engine. `one_language`: the bench
    runs every clip in the stream's language, so a clip in another is refused before the model
    loads (its figures would be of the wrong language's decode)."""
    config = override(
        load_config(args.config), "engine", name=args.engine, model=args.model, device=args.device
    )
    config = parse_settings(args.set, config)
    manifest = args.manifest or default_manifest()
    clips = load_clips(manifest, args.clips, args.max_clip_s)
    if one_language:
        _check_one_language(args.bench_command, config.stream.language, clips)
    engine = load_engine(config.engine)
    engine.warmup()
    return BenchEnv(config=config, engine=engine, clips=clips, manifest=manifest)


def _check_one_language(bench: str, tag: str, clips: list[Clip]) -> None:
    code = check_language(tag)
    others = sorted({c.language for c in clips} - {code})
    if code != AUTO_LANGUAGE and others:
        raise ConfigError(
            f"bench {bench} streams every clip in the stream's language ({tag}), and the"
            f" manifest has clips in {', '.join(others)}: `captiond bench languages` streams"
            " each clip in its own; or pick clips with --clips, or --set stream.language=auto"
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class BenchDaemon:
    url: str  # the native stream endpoint
    scheduler: InferenceScheduler | None  # None with --url: the daemon is not ours to read
    pids: list[int]  # the daemon's processes (this one and its workers); none with --url


@contextlib.asynccontextmanager
async def bench_daemon(
    args: argparse.Namespace, env: BenchEnv, *, max_sessions: int = 1024, workers: int = 1
) -> AsyncIterator[BenchDaemon]:
    """--url as given, or a daemon started here (port 0) on the bench's engine: in this process
    (`workers` 1), or with the engine core here and `workers` processes serving websockets."""
    if args.url:
        yield BenchDaemon(url=args.url, scheduler=None, pids=[])
        return
    # Every bench stream comes from this machine's one address.
    config = override(
        env.config,
        "server",
        port=0,
        max_sessions=max_sessions,
        max_sessions_per_ip=max_sessions,
    )
    # As `captiond serve`: the models every stream needs load before it serves.
    scheduler = InferenceScheduler(
        env.engine,
        config.scheduler,
        **scheduler_models(config),
    )
    scheduler.start()
    try:
        if workers > 1:
            pool_config = override(config, "server", workers=workers)
            async with _worker_pool(pool_config, scheduler) as (port, pids):
                yield BenchDaemon(url=_stream_url(port), scheduler=scheduler, pids=pids)
        else:
            daemon = Daemon(config, scheduler)
            await daemon.start()
            try:
                yield BenchDaemon(
                    url=_stream_url(daemon.port), scheduler=scheduler, pids=[os.getpid()]
                )
            finally:
                await daemon.shutdown()
    finally:
        scheduler.stop()


def _stream_url(port: int) -> str:
    return f"ws://127.0.0.1:{port}/v1/stream"


@contextlib.asynccontextmanager
async def _worker_pool(
    config: Config, scheduler: InferenceScheduler
) -> AsyncIterator[tuple[int, list[int]]]:
    """The multi-process daemon (workers/pool.py); its port and its processes' ids."""
    # Imported here: only `bench capacity --workers` needs it.
    from captiond.workers.pool import WorkerPool

    # The workers' metrics go to a folder of the pool's own; this process keeps its metrics in
    # memory, where the bench reads the engine's figures.
    pool = WorkerPool(config, scheduler)
    await pool.start()
    try:
        yield pool.port, list(pool.pids)
    finally:
        await pool.shutdown()


async def served_engine(url: str) -> dict[str, str]:
    """The engine and model a daemon says it serves (its `ready`): what --url measured."""
    async with connect(stream_url(url)) as conn:
        ready = json.loads(await conn.recv())
        await conn.send(json.dumps({"type": "end"}))
    return {"name": ready["engine"], "model": ready["model"]}


def header(args: argparse.Namespace, env: BenchEnv, bench: str) -> dict[str, Any]:
    """Machine, versions, config and the clips: the head of every bench JSON. With --url, the
    engine is the daemon's (asked), its config unknown here, and this process's engine is the
    offline and whole-file references' (`reference_engine`)."""
    local = {"name": env.engine.name, "model": env.engine.model_name}
    peer = None
    if args.peer:  # on the model captiond runs here (stream, capacity)
        version = peer_version()
        peer = {
            "name": "whisperlive",
            "version": version,
            "mode": args.peer_mode,
            "model": env.engine.model_name,
        }
    return {
        "bench": bench,
        "machine": machine_facts(),
        "engine": run_loop(served_engine(args.url)) if args.url else local,
        "reference_engine": local if args.url else None,
        "config": None if args.url else config_dict(env.config),
        "speed": args.speed,
        "url": args.url,
        "peer": peer,
        "manifest": str(env.manifest),
        "clips": [
            {"id": c.id, "kind": c.kind, "duration_s": round(c.duration_s, 2), "ref": c.ref_quality}
            for c in env.clips
        ],
    }


def spoken_faster(samples: Samples, tempo: float) -> Samples:
    """16 kHz `samples` spoken `tempo` times as fast at the same pitch (FFmpeg's atempo, through
    PyAV): talk faster than a corpus's reading."""
    import av

    graph = av.filter.Graph()
    source = graph.add_abuffer(format="flt", sample_rate=SAMPLE_RATE_HZ, layout="mono")
    atempo = graph.add("atempo", str(tempo))
    sink = graph.add("abuffersink")
    source.link_to(atempo)
    atempo.link_to(sink)
    graph.configure()
    frame = av.AudioFrame.from_ndarray(samples[None, :], format="flt", layout="mono")
    frame.sample_rate = SAMPLE_RATE_HZ
    graph.push(frame)
    graph.push(None)
    out = []
    while True:
        try:
            out.append(graph.pull().to_ndarray().reshape(-1))
        except (av.error.EOFError, BlockingIOError):
            return np.concatenate(out).astype(np.float32)
