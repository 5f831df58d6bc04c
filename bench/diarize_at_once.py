"""A speaker change at the nearest sentence end or where the windows put it, through a real
daemon with each clip sent at once (the accuracy test's configuration), both from one run.

    python3 bench/diarize_at_once.py --manifest ../shared/speech/manifest.jsonl --out FILE

Each clip with a speaker reference is streamed to an in-process daemon (tests/helpers'
`running_daemon`, tiny.en, CAM++ on the CPU) at full speed, so its partials fall elsewhere than
in real time (`captiond bench diarize`). Every diarized final is labelled twice by
`by_speaker`, with `snap_ms` 0 and with SENTENCE_SNAP_MS: the split does not change what is
decoded next, so one run gives both. Scored as `bench diarize` scores: DER of the finals'
`speech`, cpWER against WER.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "helpers"))

from daemon_harness import make_config, running_daemon, stream_pcm, url
from testkit import read_wav_int16

import captiond.streaming.session as session_module
from captiond.bench import common
from captiond.bench.diarize import (
    _speaker_texts,
    cp_word_errors,
    der,
    final_turns,
    read_rttm,
)
from captiond.bench.report import machine_facts
from captiond.bench.wer import word_errors
from captiond.config import load_config
from captiond.engines import load_engine
from captiond.streaming import speakers
from captiond.streaming.events import Final

SNAPS_MS = (0, speakers.SENTENCE_SNAP_MS)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--manifest", type=Path, default=None)
    parser.add_argument("--out", type=Path, required=True, help="JSON file")
    args = parser.parse_args()
    manifest = args.manifest or common.default_manifest()
    labelled: dict[int, list[Final]] = {snap: [] for snap in SNAPS_MS}
    shipped = speakers.by_speaker

    def by_speaker(
        final: Final,
        spans: list[tuple[int, int]],
        labels: list[int],
        snap_ms: int = speakers.SENTENCE_SNAP_MS,
    ) -> list[Final]:
        for snap in SNAPS_MS:
            labelled[snap] += shipped(final, spans, labels, snap)
        return shipped(final, spans, labels, snap_ms)

    session_module.__dict__["by_speaker"] = by_speaker  # what the session calls, by name
    engine = load_engine(load_config(None).engine)
    engine.warmup()
    from captiond.engines.speakers import SpeakerEmbedder

    config = make_config(server={"max_audio_speed": 1e6})
    clips: dict[str, dict[str, Any]] = {}
    for entry in common.read_manifest(manifest):
        if not entry.get("rttm"):
            continue
        for finals in labelled.values():
            finals.clear()
        pcm = read_wav_int16(manifest.parent / entry["file"])

        async def scenario(pcm: Any = pcm) -> None:
            async with running_daemon(
                config, engine=engine, vad_factory=None, embedder=lambda: SpeakerEmbedder("cpu")
            ) as daemon:
                await stream_pcm(url(daemon, query="diarize=true"), pcm, chunk_samples=3_200)

        asyncio.run(scenario())
        reference = read_rttm(manifest.parent / entry["rttm"])
        clips[entry["id"]] = {}
        for snap, finals in labelled.items():
            said = [f for f in finals if f.text]
            wer = word_errors(entry["text"], " ".join(f.text for f in said)).wer
            texts = _speaker_texts([(str(f.speaker), f.text) for f in said])
            cpwer = cp_word_errors(entry["speaker_text"], texts).wer
            clips[entry["id"]][str(snap)] = {
                **der(reference, final_turns(finals)),
                "cpwer_minus_wer": round(cpwer - wer, 4),
            }
        print(entry["id"], clips[entry["id"]], flush=True)
    pooled = {}
    for key in map(str, SNAPS_MS):
        rows = [c[key] for c in clips.values()]
        scored = sum(r["scored_s"] for r in rows)
        pooled[key] = {
            "der": round(sum(r["der"] * r["scored_s"] for r in rows) / scored, 4),
            "mean_cpwer_minus_wer": round(float(np.mean([r["cpwer_minus_wer"] for r in rows])), 4),
        }
    print(pooled)
    result = {
        "bench": "diarize_at_once",
        "machine": machine_facts(),
        "snaps_ms": list(SNAPS_MS),
        "scoring": "pyannote.metrics DER collar=0.5 (±0.25 s), skip_overlap=False",
        "pooled": pooled,
        "clips": clips,
    }
    args.out.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
