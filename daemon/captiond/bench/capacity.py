"""`captiond bench capacity`: how many real-time streams, live at once, hold the latency bounds.

Main thread and its event loop, which also serves the in-process daemon with --workers 1 (with
more, worker processes serve the websockets and the engine core stays here); the engine runs on
the scheduler's thread, ResourceMonitor and GpuMonitor sample on threads of their own, and the
streams run in --client-procs client processes (clients.py; 0: in this event loop, where their
CPU counts as the daemon's).

For each N, N streams start spread over --start-within-s on one wall-clock schedule and each
plays --duration-s of audio at real time (clips rotated; a short clip loops, with 1 s of silence
between repeats), against the daemon started here (or --url), then against WhisperLive with
--peer. A level holds when no stream failed, all N were connected at one moment, and the pooled
p95 partial lag and p95 final latency are within the bounds; the capacity is the largest N that
holds. Two failed levels in a row end the sweep.

A stream refused at connect (`overloaded`, or a balancer's HTTP 503) counts as refused, not
failed: a level with refusals does not hold, and `admitted_within_bounds` says whether the
streams let in kept the bounds (what a daemon shedding load promises, [server] max_lag_ms).
--also-url NAME=URL sweeps another daemon after the first in the same run: HAProxy in front
of the --url instance shows what the balancer adds.

With --diarize both, the daemon's sweep runs twice in one run, without and with every stream
diarized ([stream] diarize: speaker embeddings for every final), so the two capacities and the
daemon's CPU per stream compare on the same machine and audio.

    captiond bench capacity --streams 16,64,256 --workers 4 --client-procs 4 --out DIR
    captiond bench capacity --engine fake --diarize both --streams 4,8,16 --out DIR
    captiond bench capacity --url ws://127.0.0.1:9001/v1/stream --streams 100,300 --out DIR
        --also-url haproxy=ws://127.0.0.1:9000/v1/stream  (run-local.sh --instances 1)
"""

from __future__ import annotations

import argparse
import os
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from captiond.bench import common
from captiond.bench.clients import LevelClients, StreamOutcome, plan_level, raise_fd_limit
from captiond.bench.metrics import (
    final_latencies_after_endpoint_ms,
    final_latencies_ms,
    partial_lags_ms,
    peak_live,
    summary,
)
from captiond.bench.peer_whisperlive import peer_language, whisperlive_server
from captiond.bench.report import (
    GpuMonitor,
    Progress,
    ResourceMonitor,
    count_list,
    gpu_facts,
    plot_capacity,
    print_table,
    write_json,
)
from captiond.bench.speech import SpeechRuns, speech_runs
from captiond.decoding.scheduler import InferenceScheduler
from captiond.engines.models import resolve_model
from captiond.errors import ConfigError
from captiond.ops.loop import run as run_loop
from captiond.whisper import SAMPLE_RATE_HZ

# Between a clip's repeats when it is shorter than --duration-s: the silence ends its utterance.
_LOOP_GAP_S = 1.0
# The level's start epoch is this far after every client is ready: it has to reach them all.
_START_LEAD_S = 1.0
# The bench daemon's session limits: the largest level plus this many per worker (the limits
# are split evenly over the workers), so that no limit ever refuses one of the level's streams.
_SPARE_SESSIONS = 16
_ENGINE_SAMPLES = (
    "captiond_engine_seconds_sum",
    "captiond_engine_seconds_count",
    "captiond_batch_size_sum",
    "captiond_batch_size_count",
)
# Speaker-embedding time over the level (the batches with speaker windows; --diarize).
_DIARIZATION_SAMPLES = ("captiond_diarization_seconds_sum", "captiond_diarization_seconds_count")


def add_capacity_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("capacity", help="most live real-time streams within latency bounds")
    common.add_options(p, default_clips="long")
    p.add_argument(
        "--streams", type=count_list, default=[1, 2, 4, 6, 8, 12], help="comma list of live streams"
    )
    p.add_argument("--duration-s", type=float, default=60.0, help="audio per stream (default 60)")
    p.add_argument(
        "--start-within-s",
        type=float,
        default=10.0,
        help="stream i of N starts at i/N of this (default 10)",
    )
    p.add_argument(
        "--client-procs",
        type=int,
        default=2,
        help="client processes the streams are split over (0: in the bench process; default 2)",
    )
    p.add_argument(
        "--workers",
        type=int,
        default=1,
        help="daemon worker processes serving websockets (default 1: all in this process)",
    )
    common.add_daemon_run_options(p)
    p.add_argument(
        "--also-url",
        action="append",
        default=[],
        type=_named_url,
        metavar="NAME=URL",
        help="after the daemon's sweep, the same sweep against this one, named NAME in the "
        "JSON (repeatable): e.g. HAProxy in front of the --url instance",
    )
    p.add_argument("--bound-partial-ms", type=float, default=1000.0, help="p95 partial lag bound")
    p.add_argument("--bound-final-ms", type=float, default=1000.0, help="p95 final latency bound")
    p.set_defaults(func=_bench_capacity)


def loop_audio(samples: npt.NDArray[np.float32], duration_s: float) -> npt.NDArray[np.float32]:
    """`duration_s` of the clip: cut, or repeated with `_LOOP_GAP_S` of silence between."""
    want = int(duration_s * SAMPLE_RATE_HZ)
    if len(samples) >= want:
        return samples[:want]
    period = np.concatenate(
        [samples, np.zeros(int(_LOOP_GAP_S * SAMPLE_RATE_HZ), dtype=np.float32)]
    )
    return np.tile(period, -(-want // len(period)))[:want]


@dataclass(frozen=True, slots=True, kw_only=True)
class _Audio:
    """What the streams play (stream i plays `samples[i % len(samples)]`: plan_level), and
    where each has speech, which final latencies count from."""

    samples: list[npt.NDArray[np.float32]]
    speech: list[SpeechRuns]


@dataclass(frozen=True, slots=True, kw_only=True)
class _Target:
    name: str  # the system, as the JSON names it
    protocol: str  # clients.PROTOCOLS
    url: str
    scheduler: InferenceScheduler | None  # the engine's metrics, when the daemon is ours
    pids: list[int]  # the system's processes, for the resource monitor
    peer_language: str | None = None  # WhisperLive's stream language (None: it detects)


def _engine_totals(scheduler: InferenceScheduler | None) -> dict[str, float] | None:
    """The engine's counters so far: _ENGINE_SAMPLES, and seconds per phase ("phase:NAME")."""
    if scheduler is None:
        return None
    registry = scheduler.metrics.registry
    totals = {
        name: registry.get_sample_value(name) or 0.0
        for name in (*_ENGINE_SAMPLES, *_DIARIZATION_SAMPLES)
    }
    for family in registry.collect():
        if family.name == "captiond_engine_phase_seconds":
            for sample in family.samples:
                if sample.name.endswith("_total"):
                    totals[f"phase:{sample.labels['phase']}"] = sample.value
    return totals


def _engine_figures(
    before: dict[str, float] | None, after: dict[str, float] | None
) -> dict[str, Any]:
    """Engine time, its phases and requests per batch over the level, from the counters'
    deltas."""
    if before is None or after is None:
        return {
            "engine_batches": None,
            "engine_ms_per_batch_mean": None,
            "batch_size_mean": None,
            "diarization_s": None,
            "diarization_batches": None,
        }
    delta = {name: value - before.get(name, 0.0) for name, value in after.items()}
    engine_s, batches, requests, sized = (delta[name] for name in _ENGINE_SAMPLES)
    diarization_s, diarization_batches = (delta[name] for name in _DIARIZATION_SAMPLES)
    phases_ms = {
        name.removeprefix("phase:"): round(1000 * seconds / batches, 2)
        for name, seconds in delta.items()
        if name.startswith("phase:") and batches
    }
    return {
        "engine_batches": int(batches),
        "engine_ms_per_batch_mean": round(1000 * engine_s / batches, 2) if batches else None,
        "engine_phase_ms_per_batch": phases_ms,
        "batch_size_mean": round(requests / sized, 2) if sized else None,
        "diarization_s": round(diarization_s, 3),
        "diarization_batches": int(diarization_batches),
    }


async def _level(
    n: int, target: _Target, args: argparse.Namespace, audio: _Audio
) -> dict[str, Any]:
    plans = plan_level(
        n,
        procs=args.client_procs,
        protocol=target.protocol,
        url=target.url,
        audio=audio.samples,
        start_within_s=args.start_within_s,
        peer_language=target.peer_language,
    )
    clients = LevelClients(plans, in_process=args.client_procs == 0)
    try:
        await clients.start()
        start_epoch_s = time.time() + _START_LEAD_S
        before = _engine_totals(target.scheduler)
        with ResourceMonitor(target.pids, clients.pids) as monitor, GpuMonitor() as gpu:
            outcomes = await clients.run(start_epoch_s)
        after = _engine_totals(target.scheduler)
    finally:
        await clients.stop()
    done = [o for o in outcomes if o.error is None]
    refused = [o for o in outcomes if _refused(o)]
    errors = [o.error for o in outcomes if o.error is not None and o not in refused]
    lags = summary([x for o in done for x in partial_lags_ms(o.trace)])
    speech = audio.speech
    finals = summary(
        [x for o in done for x in final_latencies_ms(o.trace, speech[o.index % len(speech)])]
    )
    endpoint = summary([x for o in done for x in final_latencies_after_endpoint_ms(o.trace)])
    live = peak_live([o.trace for o in outcomes])
    start_delays_ms = [
        1000 * (o.trace.connect_epoch_s - o.scheduled_epoch_s)
        for o in outcomes
        if o.trace.connect_epoch_s is not None
    ]
    within_bounds = (
        lags["p95"] is not None
        and lags["p95"] <= args.bound_partial_ms
        and finals["p95"] is not None
        and finals["p95"] <= args.bound_final_ms
    )
    holds = not errors and not refused and live == n and within_bounds
    return {
        "streams": n,
        "client_procs": 0 if args.client_procs == 0 else len(plans),
        "peak_live_streams": live,
        "failed_streams": len(errors),
        "errors": sorted(set(errors))[:5],
        # Refused at connect (`overloaded`, or a balancer's 503): a daemon shedding load.
        "refused_streams": len(refused),
        # What shedding promises: the streams let in kept within the bounds, none failed.
        "admitted_within_bounds": not errors and within_bounds,
        "connect_delay_ms": summary(start_delays_ms),
        "partial_lag_ms": lags,
        "final_latency_ms": finals,
        "final_after_endpoint_ms": endpoint,
        "holds": holds,
        **_engine_figures(before, after),
        "load_average_1": round(os.getloadavg()[0], 2),
        **_per_stream(monitor.result(), n),
        **gpu.result(),
    }


def _refused(outcome: StreamOutcome) -> bool:
    """Refused before `ready`: the daemon's `overloaded` or a balancer's HTTP 503."""
    if outcome.error is None or any(m["type"] == "ready" for m in outcome.trace.messages):
        return False
    return "overloaded" in outcome.error or "HTTP 503" in outcome.error


def _per_stream(resources: dict[str, Any], n: int) -> dict[str, Any]:
    """The resource monitor's figures, and the daemon's CPU per stream (percent of one core)."""
    daemon_cpu = resources.get("daemon_cpu_percent_mean")
    per_stream = None if daemon_cpu is None else round(daemon_cpu / n, 2)
    return resources | {"daemon_cpu_percent_per_stream": per_stream}


async def _sweep(args: argparse.Namespace, target: _Target, audio: _Audio) -> list[dict[str, Any]]:
    progress = Progress(target.name, len(args.streams))
    out: list[dict[str, Any]] = []
    failures = 0
    for n in args.streams:
        level = await _level(n, target, args, audio)
        out.append(level)
        lags, finals = level["partial_lag_ms"], level["final_latency_ms"]
        progress.step(
            f"N={n} live {level['peak_live_streams']} p95 lag {lags['p95']} final {finals['p95']}"
        )
        failures = 0 if level["holds"] else failures + 1
        if failures == 2:
            break
    return out


async def _ours(
    args: argparse.Namespace, env: common.BenchEnv, audio: _Audio, name: str = "captiond"
) -> list[dict[str, Any]]:
    sessions = max(args.streams) + _SPARE_SESSIONS * args.workers
    async with common.bench_daemon(
        args, env, max_sessions=sessions, workers=args.workers
    ) as daemon:
        target = _Target(
            name=name,
            protocol="native",
            url=daemon.url,
            scheduler=daemon.scheduler,
            pids=daemon.pids,
        )
        return await _sweep(args, target, audio)


async def _peer(
    args: argparse.Namespace, env: common.BenchEnv, audio: _Audio
) -> list[dict[str, Any]]:
    clients = max(args.streams) + _SPARE_SESSIONS  # WhisperLive refuses clients beyond this
    # The model and language captiond runs, however they were chosen.
    model = resolve_model(env.config.engine.model)
    with whisperlive_server(model, args.peer_mode, clients) as (url, pid):
        target = _Target(
            name="whisperlive",
            protocol="whisperlive",
            url=url,
            scheduler=None,
            pids=[pid],
            peer_language=peer_language(env.config.stream.language),
        )
        return await _sweep(args, target, audio)


def _named_url(spec: str) -> tuple[str, str]:
    """`NAME=URL` of --also-url (an argparse type: a mistake is one line, exit 2)."""
    name, _, url = spec.partition("=")
    if not name or not url.startswith(("ws://", "wss://")) or name in ("captiond", "whisperlive"):
        raise argparse.ArgumentTypeError(f"{spec!r}: NAME=ws://HOST:PORT/v1/stream, NAME new")
    return name, url


def _check(args: argparse.Namespace) -> None:
    if args.duration_s <= 0 or not 0 <= args.start_within_s < args.duration_s:
        # Otherwise the first streams end before the last start: N are never live at once.
        raise ConfigError("bench capacity: need 0 <= --start-within-s < --duration-s")
    if args.client_procs < 0 or args.workers < 1:
        raise ConfigError("bench capacity: need --client-procs >= 0 and --workers >= 1")
    if args.speed != 1.0:
        raise ConfigError("bench capacity: streams play at real time; --speed is for other benches")
    if args.workers > 1 and args.url:
        raise ConfigError("bench capacity: --workers starts a daemon here; not with --url")


def _bench_capacity(args: argparse.Namespace) -> int:
    _check(args)
    raise_fd_limit()
    env = common.prepare(args)
    looped = [loop_audio(c.samples, args.duration_s) for c in env.clips]
    audio = _Audio(samples=looped, speech=[speech_runs(a) for a in looped])
    loop = env.config.server.event_loop
    results = {
        name: run_loop(_ours(args, run_env, audio, name), loop)
        for name, run_env in common.daemon_runs(args, env)
    }
    for name, url in args.also_url:
        target = _Target(name=name, protocol="native", url=url, scheduler=None, pids=[])
        results[name] = run_loop(_sweep(args, target, audio), loop)
    if args.peer:
        results["whisperlive"] = run_loop(_peer(args, env, audio), loop)
    gpu, gpu_note = gpu_facts()
    data = common.header(args, env, "capacity") | {
        "bounds_ms": {
            "partial_lag_p95": args.bound_partial_ms,
            "final_latency_p95": args.bound_final_ms,
        },
        "duration_s": args.duration_s,
        "start_within_s": args.start_within_s,
        "client_procs": args.client_procs,
        "workers": None if args.url else args.workers,
        "gpu": gpu,
        "gpu_note": gpu_note,
        "capacity": {name: _capacity(levels) for name, levels in results.items()},
        "levels": results,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    name = f"capacity-{data['machine']['host']}"
    write_json(args.out / f"{name}.json", data)
    plot_capacity(
        args.out / f"{name}.png",
        f"captiond bench capacity ({env.engine.name}, {data['machine']['cpu_count']} cores)",
        {
            sys_name: [
                (
                    lv["peak_live_streams"],
                    lv["partial_lag_ms"]["p95"],
                    lv["final_latency_ms"]["p95"],
                )
                for lv in levels
            ]
            for sys_name, levels in results.items()
        },
    )
    _table(results)
    print("capacity:", data["capacity"], f"- wrote {args.out / name}.json and .png")
    return 0


def _capacity(levels: list[dict[str, Any]]) -> int:
    return max((lv["streams"] for lv in levels if lv["holds"]), default=0)


def _table(results: dict[str, list[dict[str, Any]]]) -> None:
    rows = [
        [
            sys_name,
            lv["streams"],
            lv["peak_live_streams"],
            lv["failed_streams"],
            lv["refused_streams"],
            lv["partial_lag_ms"]["p50"],
            lv["partial_lag_ms"]["p95"],
            lv["final_latency_ms"]["p50"],
            lv["final_latency_ms"]["p95"],
            lv["daemon_cpu_percent_mean"],
            lv["client_cpu_percent_mean"],
            lv["gpu_busy_percent_mean"],
            lv["engine_ms_per_batch_mean"],
            lv["batch_size_mean"],
            lv["peak_rss_mib"],
            "yes" if lv["holds"] else "no",
        ]
        for sys_name, levels in results.items()
        for lv in levels
    ]
    headers = [
        "system",
        "N",
        "live",
        "failed",
        "refused",
        "lag p50",
        "lag p95",
        "fin p50",
        "fin p95",
        "daemon %",
        "client %",
        "gpu %",
        "ms/batch",
        "batch",
        "rss MiB",
        "holds",
    ]
    print_table(headers, rows)
