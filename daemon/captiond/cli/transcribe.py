"""`captiond transcribe FILE`: a file through the same session logic as streaming, without
partials (streaming.offline). Main thread; the engine runs there too.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from captiond.cli.options import config_from, engine_options, load_warm_engine
from captiond.errors import (
    CaptiondError,
)


def add_transcribe(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("transcribe", help="transcribe an audio file offline (same segmentation)")
    p.add_argument(
        "file", type=Path, help="audio file (WAV, FLAC, MP3, M4A, a video, …): any rate, channels"
    )
    engine_options(p)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument(
        "--task",
        choices=("transcribe", "translate"),
        default="transcribe",
        help="translate: English text of any language (multilingual models)",
    )
    p.set_defaults(func=_transcribe)


def _transcribe(args: argparse.Namespace) -> int:
    from captiond.sources.audiofile import AudioFileError, read_audio_16k_mono
    from captiond.streaming.offline import transcribe_samples

    config = config_from(args)
    try:
        samples = read_audio_16k_mono(args.file)
    except (AudioFileError, OSError) as exc:
        raise CaptiondError(f"cannot read {str(args.file)!r}: {exc}") from None
    engine = load_warm_engine(config, args.task)
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
