"""`captiond bench`: benchmarks that write JSON, one module per subcommand.

The CLI (main thread) builds the parser here; each subcommand's module is imported lazily.
"""

from __future__ import annotations

import argparse


def add_bench_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("bench", help="benchmarks: engine, stream, capacity (JSON out)")
    bench_sub = p.add_subparsers(dest="bench_command", required=True)
    try:
        from captiond.bench.engine import add_engine_parser
    except ImportError:  # pragma: no cover - only while the engine bench is absent
        return
    add_engine_parser(bench_sub)
