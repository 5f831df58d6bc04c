"""How much a one-sentence clip's text depends on where its decode window starts and ends.

    python3 bench/decode_window_sweep.py ../shared/speech-multi --clips pt_fleurs_002 \
        --starts 0,0.24,0.44 --ends 5.9,6.21,6.6,6.99,7.5,end --out FILE
    python3 bench/decode_window_sweep.py ../shared/speech-multi --fallback --out FILE

A stream's final decodes its utterance from a little before the first voiced frame to a little
after the last one; faster-whisper's whole-file decode, the accuracy reference, decodes the
whole clip. Each window here is decoded as a final without context is (faster-whisper, beam 5,
text tokens only, temperature 0); its errors against the clip's reference text are counted with
the bench's metric, beside the decode's avg_logprob: could the model's own score pick the better
window?

`--fallback` instead decodes each clip (`--clips`, by default the utterances with exact
references: all 78 of the multilingual corpus) as the whole-file reference does
(`WHOLE_FILE_SETTINGS`: timestamp tokens, the temperature fallback, seeded) with its language
given, and lists the clips where a window was decoded again above temperature 0, the fallback
captiond's finals do not have.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import ctranslate2
from faster_whisper import WhisperModel

from captiond.bench.common import Clip, load_clips
from captiond.bench.report import machine_facts
from captiond.bench.wer import language_errors
from captiond.engines.faster_whisper import WHOLE_FILE_SETTINGS, segments_text
from captiond.engines.models import resolve_model
from captiond.whisper import SAMPLE_RATE_HZ


def seconds(spec: str) -> list[float]:
    """The window starts of `--starts`: "0,0.24" gives [0.0, 0.24]."""
    return [float(item) for item in spec.split(",")]


def ends(spec: str) -> list[float | None]:
    """The window ends of `--ends`: "6.8,end" gives [6.8, None], None being the clip's end."""
    return [None if item == "end" else float(item) for item in spec.split(",")]


def sweep(
    model: WhisperModel, clip: Clip, starts_s: list[float], ends_s: list[float | None]
) -> list[dict[str, Any]]:
    """Every (start, end) window of the clip, decoded as a final without context."""
    rows = []
    for start_s in starts_s:
        for end_s in ends_s:
            first = int(start_s * SAMPLE_RATE_HZ)
            last = len(clip.samples) if end_s is None else int(end_s * SAMPLE_RATE_HZ)
            segments, _ = model.transcribe(
                clip.samples[first:last],
                language=clip.language,
                beam_size=5,
                temperature=0.0,
                without_timestamps=True,
                vad_filter=False,
            )
            decoded = list(segments)
            text = segments_text(decoded)
            counts = language_errors(clip.text, text, clip.language)
            rows.append(
                {
                    "clip": clip.id,
                    "start_s": first / SAMPLE_RATE_HZ,
                    "end_s": last / SAMPLE_RATE_HZ,
                    "errors": counts.errors,
                    "reference_units": counts.reference_words,
                    "avg_logprob": [round(s.avg_logprob, 4) for s in decoded],
                    "text": text,
                }
            )
            print(json.dumps(rows[-1], ensure_ascii=False), flush=True)
    return rows


def fallbacks(model: WhisperModel, clip: Clip) -> dict[str, Any] | None:
    """The clip's whole-file decode when one of its windows fell back above temperature 0."""
    ctranslate2.set_random_seed(0)  # as transcribe_whole_file: the same sampled windows
    segments, _ = model.transcribe(clip.samples, language=clip.language, **WHOLE_FILE_SETTINGS)
    decoded = list(segments)
    if all(s.temperature == 0.0 for s in decoded):
        return None
    return {
        "clip": clip.id,
        "language": clip.language,
        "temperatures": [s.temperature for s in decoded],
        "avg_logprob": [round(s.avg_logprob, 4) for s in decoded],
        "compression_ratio": [round(s.compression_ratio, 3) for s in decoded],
        "text": segments_text(decoded),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("corpus", type=Path, help="a folder with a manifest.jsonl")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--model", default="base")
    parser.add_argument("--compute-type", default="float32")
    parser.add_argument("--clips", default="utterance", help="ids or kinds, as `captiond bench`'s")
    parser.add_argument("--starts", type=seconds, default="0", help="seconds, comma-separated")
    parser.add_argument(
        "--ends", type=ends, default="end", help="seconds, comma-separated; 'end' = clip end"
    )
    parser.add_argument("--fallback", action="store_true", help="list the whole-file fallbacks")
    args = parser.parse_args()
    model = WhisperModel(
        str(resolve_model(args.model)), device="cpu", compute_type=args.compute_type
    )
    clips = load_clips(args.corpus / "manifest.jsonl", args.clips, None)
    report: dict[str, Any] = {
        "machine": machine_facts(),
        "model": args.model,
        "compute_type": args.compute_type,
        "clips": len(clips),
    }
    if args.fallback:
        found = (fallbacks(model, clip) for clip in clips)
        report["fallbacks"] = [row for row in found if row is not None]
        print(json.dumps(report["fallbacks"], ensure_ascii=False, indent=1))
    else:
        report["windows"] = [
            row for clip in clips for row in sweep(model, clip, args.starts, args.ends)
        ]
    args.out.write_text(json.dumps(report, ensure_ascii=False, indent=1) + "\n")


if __name__ == "__main__":
    main()
