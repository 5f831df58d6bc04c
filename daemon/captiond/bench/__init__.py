"""`captiond bench`: benchmarks that write JSON, one module per subcommand.

The CLI (main thread) builds the parser here; each subcommand's module is imported lazily.
"""

from __future__ import annotations

import argparse


def add_bench_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "bench",
        help="benchmarks: engine, stream, decode, capacity, languages, words, diarize (JSON out)",
    )
    bench_sub = p.add_subparsers(dest="bench_command", required=True)
    from captiond.bench.capacity import add_capacity_parser
    from captiond.bench.decode import add_decode_parser
    from captiond.bench.diarize import add_diarize_parser
    from captiond.bench.engine import add_engine_parser
    from captiond.bench.languages import add_languages_parser
    from captiond.bench.stream import add_stream_parser
    from captiond.bench.words import add_words_parser

    add_engine_parser(bench_sub)
    add_stream_parser(bench_sub)
    add_decode_parser(bench_sub)
    add_capacity_parser(bench_sub)
    add_languages_parser(bench_sub)
    add_words_parser(bench_sub)
    add_diarize_parser(bench_sub)
