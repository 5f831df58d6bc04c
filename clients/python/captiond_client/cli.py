"""`captiond-client`: stream a WAV file to a captiond daemon and show the captions.

Main thread; one asyncio loop per command.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Sequence
from pathlib import Path

from captiond_client import DEFAULT_URL
from captiond_client.display import CaptionPrinter, write_transcript
from captiond_client.stream import StreamError, stream_samples
from captiond_client.wavfile import WavError, read_wav_16k_mono


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="captiond-client", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("stream", help="stream a WAV file (any rate, any channels)")
    p.add_argument("file", type=Path)
    p.add_argument("--url", default=DEFAULT_URL, help=f"daemon stream URL (default {DEFAULT_URL})")
    p.add_argument(
        "--speed", type=float, default=1.0, help="times real time; 0 sends as fast as possible"
    )
    p.add_argument("--json", action="store_true", help="print every server message as JSON")
    p.add_argument("--out", type=Path, help="write the final transcript (.txt, .vtt or .srt)")
    return parser


def _stream(args: argparse.Namespace) -> int:
    samples = read_wav_16k_mono(args.file)
    printer = CaptionPrinter(as_json=args.json)
    asyncio.run(stream_samples(args.url, samples, speed=args.speed, on_message=printer))
    if args.out:
        write_transcript(args.out, printer.finals)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return _stream(args)
    except (WavError, OSError) as exc:
        print(f"captiond-client: {exc}", file=sys.stderr)
        return 2
    except StreamError as exc:
        print(f"captiond-client: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
