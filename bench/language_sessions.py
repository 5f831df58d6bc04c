"""A corpus of sessions of many utterances in one language, for `captiond bench languages`.

    python3 bench/language_sessions.py ../shared/speech-multi OUT [--tempo 1.6] [--gap-s 0.6]
    captiond bench languages --manifest OUT/manifest.jsonl --model base --speed 2 --out DIR

Each clip of the multilingual corpus is a session of one utterance, so its language is
detected without a session language to lean on, and a wrong switch within a session never
shows. Here each language's exact-reference utterances (four or more) follow one another with
1 s of silence between them, as one long clip (kind `long`) whose reference is theirs
joined: with `?language=auto` every utterance after the first is detected with the session's
language as the hint (hysteresis), and the whole-file decode hears the earlier utterances as
its context. `--tempo` speaks every utterance that many times as fast, at its own pitch
(FFmpeg's atempo), for talk faster than the corpus's reading (the gaps stay as they are);
`--gap-s` sets the silence, for turns that follow each other more closely. The clips are
written to OUT (never into the repository).
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np

from captiond.bench.common import read_manifest, select_clips, spoken_faster, write_wav
from captiond.bench.wer import CHARACTER_LANGUAGES
from captiond.sources.audiofile import read_audio_16k_mono
from captiond.whisper import SAMPLE_RATE_HZ

MIN_UTTERANCES = 4


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("corpus", type=Path, help="the multilingual corpus folder (manifest.jsonl)")
    parser.add_argument("out", type=Path, help="folder for the clips and their manifest.jsonl")
    parser.add_argument("--tempo", type=float, default=1.0, help="speech this many times as fast")
    parser.add_argument(
        "--gap-s", type=float, default=1.0, help="seconds of silence after each utterance"
    )
    args = parser.parse_args()
    by_language: defaultdict[str, list[dict[str, Any]]] = defaultdict(list)
    entries = read_manifest(args.corpus / "manifest.jsonl")
    for e in select_clips(entries, "utterance"):  # every utterance with an exact reference
        by_language[e["language"]].append(e)
    (args.out / "wav").mkdir(parents=True, exist_ok=True)
    gap = np.zeros(round(args.gap_s * SAMPLE_RATE_HZ), dtype=np.float32)
    with (args.out / "manifest.jsonl").open("w", encoding="utf-8") as manifest:
        for language, utterances in sorted(by_language.items()):
            if len(utterances) < MIN_UTTERANCES:
                continue
            parts = []
            for e in utterances:
                speech = read_audio_16k_mono(args.corpus / e["file"])
                parts += [spoken_faster(speech, args.tempo) if args.tempo != 1.0 else speech, gap]
            samples = np.concatenate(parts)
            file = f"wav/session_{language}.wav"
            write_wav(args.out / file, samples)
            joiner = "" if language in CHARACTER_LANGUAGES else " "
            entry = {
                "id": f"session_{language}",
                "file": file,
                "language": language,
                "text": joiner.join(e["text"] for e in utterances),
                "duration_s": round(len(samples) / SAMPLE_RATE_HZ, 2),
                "kind": "long",
                "ref_quality": "exact",
                "utterances": [e["id"] for e in utterances],
            }
            manifest.write(json.dumps(entry, ensure_ascii=False) + "\n")
            print(f"{entry['id']}: {len(utterances)} utterances, {entry['duration_s']} s")


if __name__ == "__main__":
    main()
