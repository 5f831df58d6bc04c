"""`captiond bench words`: word timings and confidences against reference alignments, per clip.

Main thread. Every clip of the manifest that has reference word times (`words`: a JSON list of
`{"word", "start", "end"}` in seconds; in ../shared/speech, the Montreal Forced Aligner's own
alignments of its two test recordings) is captioned as a live stream would caption it (the
session with partials and early finals, streaming.offline.transcribe_samples), and its finals'
words are scored against the reference. The peer, in the same run and on the same model: what a
user would run instead, faster-whisper's `transcribe(word_timestamps=True)` on the whole
recording. A hypothesis word is matched to a reference word by its plain spelling along the
best alignment of the two word sequences (difflib); the scores are over the matched words.

    captiond bench words --out bench/results/words
"""

from __future__ import annotations

import argparse
import difflib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from captiond.bench import common
from captiond.bench.report import (
    config_dict,
    machine_facts,
    parse_settings,
    print_table,
    write_json,
)
from captiond.config import Config, load_config, override
from captiond.engines import ENGINE_NAMES, load_engine
from captiond.engines.faster_whisper import whole_file_compute_type, whole_file_segments
from captiond.engines.models import resolve_model
from captiond.lang.text import plain_unit
from captiond.sources.audiofile import read_audio_16k_mono
from captiond.streaming.events import Final
from captiond.streaming.offline import transcribe_samples

# A word within this many ms of its reference start counts as "within" (the bound).
WITHIN_MS = 200


@dataclass(frozen=True, slots=True)
class TimedWord:
    word: str  # plain: lower case, no edge punctuation
    start_ms: float
    end_ms: float
    confidence: float | None = None


def add_words_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("words", help="word timings against reference alignments (and the peer)")
    p.add_argument("--manifest", type=Path, default=None, help="speech corpus manifest.jsonl")
    p.add_argument("--config", type=Path, help="TOML configuration file")
    p.add_argument("--engine", choices=ENGINE_NAMES, help="inference engine (default auto)")
    p.add_argument("--model", default=None, help="model name or folder (default: tiny.en)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default=None)
    p.add_argument(
        "--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="config override"
    )
    p.add_argument("--out", type=Path, required=True, help="folder for words.json")
    p.set_defaults(func=_bench_words)


def matched_start_errors_ms(
    reference: Sequence[TimedWord], hypothesis: Sequence[TimedWord]
) -> list[float]:
    """Hypothesis start minus reference start, for every word matched along the best alignment
    of the two spellings (a word either side that has no match is not scored)."""
    matcher = difflib.SequenceMatcher(
        None, [w.word for w in reference], [w.word for w in hypothesis], autojunk=False
    )
    errors: list[float] = []
    for block in matcher.get_matching_blocks():
        for k in range(block.size):
            errors.append(hypothesis[block.b + k].start_ms - reference[block.a + k].start_ms)
    return errors


def score(reference: Sequence[TimedWord], hypothesis: Sequence[TimedWord]) -> dict[str, Any]:
    """Median and p95 |start error|, the share within WITHIN_MS, the median signed error (how
    late), over the matched words; and the mean confidence of the matched and unmatched."""
    errors = np.asarray(matched_start_errors_ms(reference, hypothesis))
    sure = [w.confidence for w in hypothesis if w.confidence is not None]
    if not len(errors):
        return {"reference_words": len(reference), "matched": 0}
    absolute = np.abs(errors)
    return {
        "reference_words": len(reference),
        "hypothesis_words": len(hypothesis),
        "matched": len(errors),
        "median_abs_start_error_ms": round(float(np.median(absolute)), 1),
        "p95_abs_start_error_ms": round(float(np.percentile(absolute, 95)), 1),
        "within_200_ms": round(float(np.mean(absolute <= WITHIN_MS)), 4),
        "median_start_error_ms": round(float(np.median(errors)), 1),
        "mean_confidence": round(float(np.mean(sure)), 4) if sure else None,
        "_errors": errors.tolist(),  # pooled below, then dropped
    }


def reference_words(path: Path) -> list[TimedWord]:
    entries = json.loads(path.read_text(encoding="utf-8"))
    return [
        TimedWord(plain_unit(e["word"]), e["start"] * 1000, e["end"] * 1000)
        for e in entries
        if plain_unit(e["word"])
    ]


def captiond_words(finals: Sequence[Final]) -> list[TimedWord]:
    return [
        TimedWord(plain, w.start_ms, w.end_ms, w.confidence)
        for f in finals
        for w in f.words
        if (plain := plain_unit(w.word))
    ]


def peer_words(
    model_path: Path, samples: np.ndarray, compute_type: str, language: str | None
) -> list[TimedWord]:
    """faster-whisper's own word timestamps on the whole recording, decoded as the accuracy
    reference decodes it (engines.faster_whisper.whole_file_segments)."""
    segments, _ = whole_file_segments(
        model_path,
        samples,
        device="cpu",
        compute_type=compute_type,
        language=language,
        word_timestamps=True,
    )
    return [
        TimedWord(plain, w.start * 1000, w.end * 1000, w.probability)
        for s in segments
        for w in s.words or ()
        if (plain := plain_unit(w.word.strip()))
    ]


def _bench_words(args: argparse.Namespace) -> int:
    config: Config = override(
        load_config(args.config), "engine", name=args.engine, model=args.model, device=args.device
    )
    config = parse_settings(args.set, config)
    manifest = args.manifest or common.default_manifest()
    entries = [e for e in common.read_manifest(manifest) if e.get("words")]
    engine = load_engine(config.engine)
    engine.warmup()
    model_path = resolve_model(config.engine.model)
    compute_type = whole_file_compute_type(config.engine)
    language = None if config.stream.language == "auto" else config.stream.language
    systems = ("captiond", "faster_whisper_word_timestamps")
    clips: list[dict[str, Any]] = []
    for e in entries:
        samples = read_audio_16k_mono(manifest.parent / e["file"])
        reference = reference_words(manifest.parent / e["words"])
        transcript = transcribe_samples(samples, engine, config, partials=True)
        hypotheses = {
            "captiond": captiond_words(transcript.segments),
            "faster_whisper_word_timestamps": peer_words(
                model_path, samples, compute_type, language
            ),
        }
        clips.append({"id": e["id"], **{s: score(reference, hypotheses[s]) for s in systems}})
    pooled = {}
    for s in systems:
        errors = np.abs([x for c in clips for x in c[s].pop("_errors", [])])
        pooled[s] = {
            "matched": len(errors),
            "median_abs_start_error_ms": round(float(np.median(errors)), 1),
            "p95_abs_start_error_ms": round(float(np.percentile(errors, 95)), 1),
            "within_200_ms": round(float(np.mean(errors <= WITHIN_MS)), 4),
        }
    rows = [[c["id"], s, *(c[s].get(k) for k in _COLUMNS)] for c in clips for s in systems] + [
        ["pooled", s, *(pooled[s].get(k) for k in _COLUMNS)] for s in systems
    ]
    print_table(["clip", "system", *_COLUMNS], rows)
    write_json(
        args.out / "words.json",
        {
            "bench": "words",
            "machine": machine_facts(),
            "engine": {"name": engine.name, "model": engine.model_name},
            "peer": {"name": "faster-whisper word_timestamps", "compute_type": compute_type},
            "config": config_dict(config),
            "manifest": str(manifest),
            "clips": clips,
            "pooled": pooled,
        },
    )
    return 0


_COLUMNS = ("matched", "median_abs_start_error_ms", "p95_abs_start_error_ms", "within_200_ms")
