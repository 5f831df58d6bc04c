"""A corpus of utterances that follow seconds of noise or music, for `captiond bench decode`.

    python3 bench/noise_before_speech.py ../shared/speech OUT
    captiond bench decode --manifest OUT/manifest.jsonl --clips utterance --out DIR

A decode without context hears the quiet before its utterance (streaming/context.py). In the speech
corpus that quiet is short and quiet; here every 4th of the first 80 exact-reference utterances
follows 5, 15 or 25 s of one of the corpus's noise or music clips at 0.3 of its level, so the
bench shows whether Whisper then writes words for the noise or loses the utterance's first
words. The clips are written to OUT (never into the repository); each keeps its utterance's
reference text.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from captiond.bench.common import read_manifest, select_clips, write_wav
from captiond.sources.audiofile import read_audio_16k_mono
from captiond.whisper import SAMPLE_RATE_HZ

NOISES = (
    "noise_doing_the_dishes",
    "noise_exercise_bike",
    "music_kevin_macleod_vibe_ace",
    "music_brahms_hungarian_dance5",
)
LEADS_S = (5, 15, 25)
NOISE_GAIN = 0.3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("corpus", type=Path, help="the speech corpus folder (manifest.jsonl)")
    parser.add_argument("out", type=Path, help="folder for the clips and their manifest.jsonl")
    args = parser.parse_args()
    clips = read_manifest(args.corpus / "manifest.jsonl")
    by_id = {clip["id"]: clip for clip in clips}
    (args.out / "wav").mkdir(parents=True, exist_ok=True)
    with (args.out / "manifest.jsonl").open("w") as manifest:
        for i, utterance in enumerate(select_clips(clips, "utterance")[:80:4]):
            noise_id, lead_s = NOISES[i % len(NOISES)], LEADS_S[i % len(LEADS_S)]
            noise = read_audio_16k_mono(args.corpus / by_id[noise_id]["file"])
            speech = read_audio_16k_mono(args.corpus / utterance["file"])
            # In float64, as the 16-bit samples were scaled when the committed figures were made.
            lead = noise[: lead_s * SAMPLE_RATE_HZ].astype(np.float64) * NOISE_GAIN
            mixed = np.concatenate([lead, speech])
            clip_id = f"{utterance['id']}__{noise_id}_{lead_s}s"
            write_wav(args.out / "wav" / f"{clip_id}.wav", mixed)
            entry = dict(utterance, id=clip_id, file=f"wav/{clip_id}.wav")
            entry["duration_s"] = len(mixed) / SAMPLE_RATE_HZ
            manifest.write(json.dumps(entry) + "\n")


if __name__ == "__main__":
    main()
