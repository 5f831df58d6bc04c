"""`captiond bench capacity`: how many concurrent real-time streams hold the latency bounds.

Main thread and its event loop; a ResourceMonitor thread samples CPU and memory. For each N,
N streams of the chosen clips (rotated, cut to --duration-s, starts staggered) run at real time
against the in-process daemon (or --url), then against WhisperLive with --peer. A level holds
when every stream finished and the pooled p95 partial lag and p95 final latency are within the
bounds; the capacity is the largest N that holds. Two failed levels in a row end the sweep.

    captiond bench capacity --streams 1,2,4,6,8,12 --peer whisperlive --out DIR
"""

from __future__ import annotations

import argparse
import asyncio
import os
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
import numpy.typing as npt

from captiond.bench import common
from captiond.bench.metrics import Trace, final_latencies_ms, partial_lags_ms, summary
from captiond.bench.pacing import stream_native
from captiond.bench.peer_whisperlive import stream_whisperlive, whisperlive_server
from captiond.bench.report import (
    Progress,
    ResourceMonitor,
    plot_capacity,
    print_table,
    write_json,
)
from captiond.models import resolve_model

Streamer = Callable[[str, npt.NDArray[np.float32]], Awaitable[Trace]]


def add_capacity_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("capacity", help="most concurrent real-time streams within latency bounds")
    common.add_options(p, default_clips="long")
    p.add_argument("--streams", default="1,2,4,6,8,12", help="comma list of stream counts")
    p.add_argument("--duration-s", type=float, default=30.0, help="audio per stream (default 30)")
    p.add_argument("--stagger-s", type=float, default=0.3, help="between stream starts")
    p.add_argument("--bound-partial-ms", type=float, default=2000.0, help="p95 partial lag bound")
    p.add_argument("--bound-final-ms", type=float, default=2000.0, help="p95 final latency bound")
    p.set_defaults(func=_bench_capacity)


async def _level(
    n: int, url: str, args: argparse.Namespace, clips: list[common.Clip], stream: Streamer
) -> tuple[list[Trace], int]:
    async def one(i: int) -> Trace:
        await asyncio.sleep(i * args.stagger_s)
        clip = clips[i % len(clips)]
        return await stream(url, clip.samples[: int(args.duration_s * 16_000)])

    outcomes = await asyncio.gather(*(one(i) for i in range(n)), return_exceptions=True)
    traces = [t for t in outcomes if isinstance(t, Trace)]
    return traces, n - len(traces)


async def _sweep(
    args: argparse.Namespace, env: common.BenchEnv, url: str, pid: int, stream: Streamer, name: str
) -> list[dict[str, Any]]:
    levels = [int(n) for n in args.streams.split(",")]
    progress = Progress(name, len(levels))
    out: list[dict[str, Any]] = []
    failures = 0
    for n in levels:
        with ResourceMonitor([pid]) as monitor:
            traces, failed = await _level(n, url, args, env.clips, stream)
        lags = summary([x for t in traces for x in partial_lags_ms(t)])
        finals = summary([x for t in traces for x in final_latencies_ms(t)])
        holds = (
            failed == 0
            and lags["p95"] is not None
            and lags["p95"] <= args.bound_partial_ms
            and finals["p95"] is not None
            and finals["p95"] <= args.bound_final_ms
        )
        out.append(
            {
                "streams": n,
                "failed_streams": failed,
                "partial_lag_ms": lags,
                "final_latency_ms": finals,
                "holds": holds,
                "load_average_1": round(os.getloadavg()[0], 2),
                **monitor.result(),
            }
        )
        progress.step(f"N={n} p95 lag {lags['p95']} final {finals['p95']}")
        failures = 0 if holds else failures + 1
        if failures == 2:
            break
    return out


def _capacity(levels: list[dict[str, Any]]) -> int:
    return max((lv["streams"] for lv in levels if lv["holds"]), default=0)


async def _ours(args: argparse.Namespace, env: common.BenchEnv) -> list[dict[str, Any]]:
    async def stream(url: str, samples: npt.NDArray[np.float32]) -> Trace:
        return await stream_native(url, samples, speed=1.0)

    async with common.daemon_url(args, env) as (url, _):
        return await _sweep(args, env, url, os.getpid(), stream, "captiond")


async def _peer(args: argparse.Namespace, env: common.BenchEnv) -> list[dict[str, Any]]:
    async def stream(url: str, samples: npt.NDArray[np.float32]) -> Trace:
        return await stream_whisperlive(url, samples, speed=1.0)

    with whisperlive_server(resolve_model(args.model), args.peer_mode) as (url, pid):
        return await _sweep(args, env, url, pid, stream, "whisperlive")


def _bench_capacity(args: argparse.Namespace) -> int:
    env = common.prepare(args)
    results = {"captiond": asyncio.run(_ours(args, env))}
    if args.peer:
        results["whisperlive"] = asyncio.run(_peer(args, env))
    data = common.header(args, env, "capacity") | {
        "bounds_ms": {
            "partial_lag_p95": args.bound_partial_ms,
            "final_latency_p95": args.bound_final_ms,
        },
        "duration_s": args.duration_s,
        "gpu": None,
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
                (lv["streams"], lv["partial_lag_ms"]["p95"], lv["final_latency_ms"]["p95"])
                for lv in levels
            ]
            for sys_name, levels in results.items()
        },
    )
    rows = [
        [
            sys_name,
            lv["streams"],
            lv["partial_lag_ms"]["p50"],
            lv["partial_lag_ms"]["p95"],
            lv["final_latency_ms"]["p50"],
            lv["final_latency_ms"]["p95"],
            lv["cpu_percent_mean"],
            lv["peak_rss_mib"],
            "yes" if lv["holds"] else "no",
        ]
        for sys_name, levels in results.items()
        for lv in levels
    ]
    headers = [
        "system",
        "N",
        "lag p50",
        "lag p95",
        "fin p50",
        "fin p95",
        "cpu %",
        "rss MiB",
        "holds",
    ]
    print_table(headers, rows)
    print("capacity:", data["capacity"], f"- wrote {args.out / name}.json and .png")
    return 0
