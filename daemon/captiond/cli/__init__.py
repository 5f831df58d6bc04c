"""`captiond`: the command's parser and `main` (exit codes, logging, errors as one line). The
subcommands live beside it: serve.py, transcribe.py, admin.py, and captiond.bench.

Runs on the main thread; `serve` then hands the event loop to server/daemon.py and the engine
to the scheduler's engine thread.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence

from captiond.cli.admin import add_journal, add_service_commands
from captiond.cli.serve import add_serve
from captiond.cli.transcribe import add_transcribe
from captiond.errors import CaptiondError, HubUnavailableError, ListenError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="captiond", description="Streaming real-time speech transcription daemon."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    add_serve(sub)
    add_transcribe(sub)
    add_service_commands(sub)
    add_journal(sub)
    from captiond.bench import add_bench_parser

    add_bench_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from captiond.ops.logs import configure_logging

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
