"""`captiond-client`: stream an audio file or the microphone to a captiond daemon; show captions.

Main thread; one asyncio loop per command.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from captiond.sources.audiofile import AudioFileError, read_audio_16k_mono
from captiond_client import DEFAULT_URL
from captiond_client.display import TRANSCRIPT_SUFFIXES, CaptionPrinter, write_transcript
from captiond_client.stream import StreamError, stream_samples

_RETRY_HELP = (
    "seconds to keep reconnecting (and resuming the session) after the connection drops; "
    "0 gives up at once (default 300)"
)
_OUT_HELP = (
    "write the final transcript: .txt, .vtt, .srt, .json, or .rttm (who spoke when, a "
    "diarized stream's) by the suffix; also what was received when Ctrl-C, SIGTERM or an "
    "error ends the stream"
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="captiond-client", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("stream", help="stream an audio file (WAV, FLAC, MP3, …), any rate")
    p.add_argument("file", type=Path)
    p.add_argument("--url", default=DEFAULT_URL, help=f"daemon stream URL (default {DEFAULT_URL})")
    p.add_argument(
        "--speed",
        type=float,
        default=1.0,
        help="times real time; 0: as fast as the daemon takes it (at most the first 50 s at once,"
        " then 8x real time, and under the limit the daemon announces)",
    )
    p.add_argument("--json", action="store_true", help="print every server message as JSON")
    p.add_argument("--out", type=_transcript_path, help=_OUT_HELP)
    p.add_argument("--retry-for", type=float, default=300.0, help=_RETRY_HELP)
    p.set_defaults(func=_stream)
    m = sub.add_parser("mic", help="stream this machine's microphone until Ctrl-C")
    m.add_argument("--url", default=DEFAULT_URL, help=f"daemon stream URL (default {DEFAULT_URL})")
    m.add_argument("--device", default="default", help="input device: index, name or 'default'")
    m.add_argument("--channel", type=int, help="input channel (default: mean of the first two)")
    m.add_argument("--json", action="store_true", help="print every server message as JSON")
    m.add_argument("--out", type=_transcript_path, help=_OUT_HELP)
    m.add_argument("--retry-for", type=float, default=300.0, help=_RETRY_HELP)
    m.set_defaults(func=_mic)
    return parser


def _transcript_path(value: str) -> Path:
    """--out, checked before anything is streamed: a transcript that cannot be written at the
    end would lose the whole stream's finals."""
    path = Path(value)
    if path.suffix.lower() not in TRANSCRIPT_SUFFIXES:
        formats = ", ".join(TRANSCRIPT_SUFFIXES)
        raise argparse.ArgumentTypeError(f"{value}: the file must end in one of {formats}")
    if not path.parent.is_dir():
        raise argparse.ArgumentTypeError(f"{value}: there is no folder {path.parent}")
    return path


@contextlib.contextmanager
def _transcript_kept(path: Path | None, printer: CaptionPrinter) -> Iterator[None]:
    """Writes `path` when the stream ends, and also when Ctrl-C or an error ends it: then with
    the finals received so far, if any (a stream that never started does not overwrite an
    earlier transcript with nothing)."""
    try:
        yield
    except BaseException:
        if path is not None and printer.finals:
            write_transcript(path, printer.finals)
            received = f"the {len(printer.finals)} final(s) received"
            print(f"captiond-client: wrote {received} to {path}", file=sys.stderr)
        raise
    if path is not None:
        write_transcript(path, printer.finals)


def _on_ctrl_c_and_sigterm(handler: Callable[[], object]) -> None:
    """Ctrl-C and SIGTERM (`timeout`, a service manager) call `handler` in the running loop,
    so that a client ended either way writes the finals received to `--out`. Only signals
    to the main thread can be handled: `main` run on another thread leaves them to its host."""
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in (signal.SIGINT, signal.SIGTERM):
        asyncio.get_running_loop().add_signal_handler(sig, handler)


def _stream(args: argparse.Namespace) -> int:
    samples = read_audio_16k_mono(args.file)
    printer = CaptionPrinter(as_json=args.json)

    async def run() -> None:
        running = asyncio.current_task()
        assert running is not None
        _on_ctrl_c_and_sigterm(running.cancel)
        try:
            await stream_samples(
                args.url, samples, speed=args.speed, on_message=printer, retry_for_s=args.retry_for
            )
        except asyncio.CancelledError:
            raise KeyboardInterrupt from None  # exit 130, the transcript written so far

    with _transcript_kept(args.out, printer):
        asyncio.run(run())
    return 0


def _mic(args: argparse.Namespace) -> int:
    from captiond.sources.mic import find_device
    from captiond_client.mic import stream_microphone

    device = find_device(int(args.device) if args.device.isdigit() else args.device)
    printer = CaptionPrinter(as_json=args.json)
    print(f"listening on {device.name} ({device.default_rate_hz} Hz); Ctrl-C ends", file=sys.stderr)

    async def run() -> None:
        stop = asyncio.Event()
        running = asyncio.current_task()
        assert running is not None

        def on_signal() -> None:
            # The first stops the microphone and waits for the last finals, which may take
            # the reconnects of `--retry-for` while the daemon is away; a second quits now.
            if stop.is_set():
                running.cancel()
                return
            stop.set()
            print("stopping: waiting for the last captions (Ctrl-C again quits)", file=sys.stderr)

        _on_ctrl_c_and_sigterm(on_signal)
        try:
            await stream_microphone(
                args.url,
                device,
                channel=args.channel,
                stop=stop,
                on_message=printer,
                retry_for_s=args.retry_for,
            )
        except asyncio.CancelledError:
            raise KeyboardInterrupt from None  # exit 130, the transcript written so far

    with _transcript_kept(args.out, printer):
        asyncio.run(run())
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        func: Callable[[argparse.Namespace], int] = args.func
        return func(args)
    except (AudioFileError, OSError) as exc:
        print(f"captiond-client: {exc}", file=sys.stderr)
        return 2
    except StreamError as exc:
        print(f"captiond-client: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
