"""`captiond transcribe FILE`: a file through the same session logic as streaming, without
partials (streaming.offline). Main thread; the engine runs there too.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from captiond.cli.options import config_from, engine_options, load_warm_engine
from captiond.engines import speaker_embedder
from captiond.engines.base import Embedder
from captiond.engines.models import SPEAKER_MODEL_HINT
from captiond.errors import (
    CaptiondError,
)
from captiond.lang.text import join_texts


def add_transcribe(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("transcribe", help="transcribe an audio file offline (same segmentation)")
    p.add_argument(
        "file", type=Path, help="audio file (WAV, FLAC, MP3, M4A, a video, …): any rate, channels"
    )
    engine_options(p)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument(
        "--diarize",
        action="store_true",
        help="say who spoke: each segment's speaker (needs the CAM++ model, see docs)",
    )
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
    embedder: Embedder | None = None
    if args.diarize:
        load = speaker_embedder(config.engine)
        if load is None:
            raise CaptiondError(SPEAKER_MODEL_HINT)
        embedder = load()
    engine = load_warm_engine(config, args.task)
    try:
        started = time.monotonic()
        transcript = transcribe_samples(
            samples, engine, config, task=args.task, embedder=embedder, diarize=args.diarize
        )
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
    elif args.diarize:
        # One line per turn: "Speaker 1: …", a speaker's consecutive segments joined.
        turns: list[tuple[int | None, list[str]]] = []
        for segment in transcript.segments:
            if not segment.text:
                continue
            if turns and turns[-1][0] == segment.speaker:
                turns[-1][1].append(segment.text)
            else:
                turns.append((segment.speaker, [segment.text]))
        for speaker, texts in turns:
            who = "Speaker ?" if speaker is None else f"Speaker {speaker + 1}"
            print(f"{who}: {join_texts(texts)}")
    else:
        print(transcript.text)
    return 0
