"""`captiond bench languages`: language identification and accuracy per language, streamed with
`?language=auto` and with the language given, against faster-whisper on each whole clip.

Main thread and its event loop; an in-process daemon (or --url) as in `bench stream`. Each clip
of a multilingual corpus (`../shared/speech-multi`: manifest entries carry `language`) is one
session, so each clip's first utterance is detected without a session language to lean on.
Each clip is streamed twice: with `?language=auto` (or `--detect-among`'s list: detected among
those languages alone), for identification (clips of at least
`--lid-min-s`; every confusion listed) and flaps (a segment whose partials and final do not all
carry one language: must be 0); and with its language given. The whole-file reference runs
twice too, with the language given and detected (faster-whisper's own detection on the clip's
first 30 s), so each stream is compared like with like. Reported per language: the pooled WER
(CER for languages without spaces) of the four; `gap_points` (language given) and
`gap_auto_points` (detected, against whole-file detected). `gap_auto_vs_given_points` adds the
cost of identification: detected against whole-file given. A third whole-file decode, language
given, without timestamp tokens (as captiond decodes), shows how far the reference itself moves
with its decoding mode alone (`whole_file_text_only`, and its gap to the default,
`text_only_gap_points`): `whole_file_text_only_within_1_point` counts the groups in which
faster-whisper, on the same whole clips, is within the 1-point bound of itself, which is what
the bound can tell apart on groups this small. A group of a few short clips moves by
whole words, so each gap also comes with a 95 % paired-bootstrap interval over its clips
(`gap_ci95_points`) and the count of its clips streamed with more and with fewer errors than
whole-file (`clips_worse_better`).

    captiond bench languages --manifest ../shared/speech-multi/manifest.jsonl --model base \\
        --speed 4 --out bench/results
"""

from __future__ import annotations

import argparse
import json
from collections import Counter, defaultdict
from typing import Any

from captiond.bench import common
from captiond.bench.metrics import Trace, final_text
from captiond.bench.pacing import stream_native
from captiond.bench.report import Progress, write_json
from captiond.bench.wer import (
    CHARACTER_LANGUAGES,
    NO_ERRORS,
    WerCounts,
    gap_interval_points,
    language_errors,
)
from captiond.engines.faster_whisper import (
    WHOLE_FILE_SETTINGS,
    transcribe_whole_file,
    whole_file_compute_type,
)
from captiond.engines.models import resolve_model
from captiond.ops.loop import run as run_loop


def add_languages_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("languages", help="language identification and WER/CER per language")
    # Long recordings too: a session of many utterances is where a language switch shows.
    common.add_options(p, default_clips="utterance,long")
    p.add_argument(
        "--lid-min-s", type=float, default=3.0, help="clips this long count for identification"
    )
    p.add_argument(
        "--detect-among",
        metavar="CODES",
        help="detect among these languages (?language=en,de) instead of ?language=auto",
    )
    p.set_defaults(func=_bench_languages)


def detected_language(messages: list[dict[str, Any]]) -> str | None:
    """The clip's language as captioned: the language of most of its finals' audio."""
    spoken: Counter[str] = Counter()
    for m in messages:
        if m["type"] == "final" and m.get("text") and m.get("language"):
            spoken[m["language"]] += m["end_ms"] - m["start_ms"]
    return spoken.most_common(1)[0][0] if spoken else None


def flaps(messages: list[dict[str, Any]]) -> int:
    """Segments shown in more than one language (partials and final together)."""
    languages: defaultdict[int, set[str]] = defaultdict(set)
    for m in messages:
        if m["type"] in ("partial", "final") and m.get("language"):
            languages[m["segment"]].add(m["language"])
    return sum(len(seen) > 1 for seen in languages.values())


def _languages(manifest: Any) -> dict[str, str]:
    """Each clip's language; the English corpus's entries name none."""
    with manifest.open(encoding="utf-8") as fh:
        return {e["id"]: e.get("language", "en") for e in map(json.loads, filter(str.strip, fh))}


async def _stream_all(
    args: argparse.Namespace, env: common.BenchEnv, languages: dict[str, str]
) -> tuple[dict[str, Trace], dict[str, Trace]]:
    """Every clip with ?language=auto (or --detect-among's list), then with its own language."""
    auto: dict[str, Trace] = {}
    given: dict[str, Trace] = {}
    progress = Progress("captiond", 2 * len(env.clips))
    detect = args.detect_among or "auto"
    async with common.bench_daemon(args, env) as daemon:
        for clip in env.clips:
            for traces, language in ((auto, detect), (given, languages[clip.id])):
                traces[clip.id] = await stream_native(
                    f"{daemon.url}?language={language}", clip.samples, speed=args.speed
                )
                progress.step(f"{clip.id} {language}")
    return auto, given


def _whole_file(
    env: common.BenchEnv, languages: dict[str, str]
) -> tuple[dict[str, str], dict[str, str], dict[str, str]]:
    """faster-whisper on every whole clip with its language given, detected, and given without
    timestamp tokens."""
    compute_type = whole_file_compute_type(env.config.engine)
    model = resolve_model(env.config.engine.model)
    progress = Progress("whole-file", 3 * len(env.clips))
    given: dict[str, str] = {}
    auto: dict[str, str] = {}
    text_only: dict[str, str] = {}
    for clip in env.clips:
        language = languages[clip.id]
        for texts, spoken, without_timestamps in (
            (given, language, False),
            (auto, None, False),
            (text_only, language, True),
        ):
            texts[clip.id] = transcribe_whole_file(
                model,
                clip.samples,
                device="cpu",
                compute_type=compute_type,
                language=spoken,
                without_timestamps=without_timestamps,
                chinese_variant=env.config.stream.chinese_variant,
            )
            progress.step(f"{clip.id} {spoken or 'auto'}")
    return given, auto, text_only


def _interval(points: tuple[float, float]) -> str:
    return f"{points[0]:+.1f} to {points[1]:+.1f}"


def _bench_languages(args: argparse.Namespace) -> int:
    env = common.prepare(args)
    languages = _languages(env.manifest)
    whole, whole_auto, whole_text_only = _whole_file(env, languages)
    traces, given = run_loop(_stream_all(args, env, languages), env.config.server.event_loop)
    clips: dict[str, Any] = {}
    groups: defaultdict[str, dict[str, Any]] = defaultdict(
        lambda: {"clips": 0, "lid_clips": 0, "lid_correct": 0, "confusions": [], "flaps": 0}
    )
    streamed_counts: defaultdict[str, WerCounts] = defaultdict(lambda: NO_ERRORS)
    auto_counts: defaultdict[str, WerCounts] = defaultdict(lambda: NO_ERRORS)
    whole_counts: defaultdict[str, WerCounts] = defaultdict(lambda: NO_ERRORS)
    whole_auto_counts: defaultdict[str, WerCounts] = defaultdict(lambda: NO_ERRORS)
    text_only_counts: defaultdict[str, WerCounts] = defaultdict(lambda: NO_ERRORS)
    # Each clip's (streamed, whole-file) counts, language given, for the gap's interval.
    pairs: defaultdict[str, list[tuple[WerCounts, WerCounts]]] = defaultdict(list)
    for clip in env.clips:
        language = languages[clip.id]
        messages = traces[clip.id].messages
        text = final_text(messages)
        given_text = final_text(given[clip.id].messages)
        detected = detected_language(messages)
        auto = language_errors(clip.text, text, language)
        streamed = language_errors(clip.text, given_text, language)
        reference = language_errors(clip.text, whole[clip.id], language)
        reference_auto = language_errors(clip.text, whole_auto[clip.id], language)
        reference_text_only = language_errors(clip.text, whole_text_only[clip.id], language)
        auto_counts[language] += auto
        streamed_counts[language] += streamed
        whole_counts[language] += reference
        whole_auto_counts[language] += reference_auto
        text_only_counts[language] += reference_text_only
        pairs[language].append((streamed, reference))
        group = groups[language]
        group["clips"] += 1
        group["flaps"] += flaps(messages)
        if clip.duration_s >= args.lid_min_s:
            group["lid_clips"] += 1
            group["lid_correct"] += detected == language
            if detected != language:
                group["confusions"].append({"clip": clip.id, "detected": detected})
        clips[clip.id] = {
            "language": language,
            "detected": detected,
            "duration_s": round(clip.duration_s, 2),
            "text": given_text,
            "auto_text": text,
            "whole_file_text": whole[clip.id],
            "whole_file_auto_text": whole_auto[clip.id],
            "whole_file_text_only_text": whole_text_only[clip.id],
            "error_rate": round(streamed.wer, 4),
            "auto_error_rate": round(auto.wer, 4),
            "whole_file_error_rate": round(reference.wer, 4),
            "whole_file_auto_error_rate": round(reference_auto.wer, 4),
            "whole_file_text_only_error_rate": round(reference_text_only.wer, 4),
        }
    per_language = {}
    for language, group in sorted(groups.items()):
        streamed_rate, whole_rate = streamed_counts[language].wer, whole_counts[language].wer
        auto_rate, whole_auto_rate = auto_counts[language].wer, whole_auto_counts[language].wer
        text_only_rate = text_only_counts[language].wer
        per_language[language] = group | {
            "metric": "cer" if language in CHARACTER_LANGUAGES else "wer",
            "streamed": round(streamed_rate, 4),
            "streamed_auto": round(auto_rate, 4),
            "whole_file": round(whole_rate, 4),
            "whole_file_auto": round(whole_auto_rate, 4),
            "whole_file_text_only": round(text_only_rate, 4),
            "errors": {
                "streamed": streamed_counts[language].errors,
                "whole_file": whole_counts[language].errors,
                "whole_file_text_only": text_only_counts[language].errors,
                "reference_units": whole_counts[language].reference_words,
            },
            "gap_points": round(100 * (streamed_rate - whole_rate), 2),
            "gap_ci95_points": gap_interval_points(pairs[language]),
            "clips_worse_better": [
                sum(s.errors > w.errors for s, w in pairs[language]),
                sum(s.errors < w.errors for s, w in pairs[language]),
            ],
            "gap_auto_points": round(100 * (auto_rate - whole_auto_rate), 2),
            "gap_auto_vs_given_points": round(100 * (auto_rate - whole_rate), 2),
            "text_only_gap_points": round(100 * (text_only_rate - whole_rate), 2),
        }
    lid_clips = sum(g["lid_clips"] for g in groups.values())
    every_clip = [pair for group in pairs.values() for pair in group]
    streamed_all = sum(streamed_counts.values(), NO_ERRORS)
    whole_all = sum(whole_counts.values(), NO_ERRORS)
    overall = {
        "lid_accuracy": round(sum(g["lid_correct"] for g in groups.values()) / lid_clips, 4)
        if lid_clips
        else None,
        "lid_clips": lid_clips,
        "flaps": sum(g["flaps"] for g in groups.values()),
        "languages_within_1_point": sum(g["gap_points"] <= 1.0 for g in per_language.values()),
        "languages_within_1_point_auto": sum(
            g["gap_auto_points"] <= 1.0 for g in per_language.values()
        ),
        "whole_file_text_only_within_1_point": sum(
            g["text_only_gap_points"] <= 1.0 for g in per_language.values()
        ),
        "languages": len(per_language),
        # All clips together, words and characters alike: a relative figure.
        "pooled_gap_points": round(100 * (streamed_all.wer - whole_all.wer), 2),
        "pooled_gap_ci95_points": gap_interval_points(every_clip),
    }
    data = common.header(args, env, "languages") | {
        "detect_among": args.detect_among,
        "whole_file_settings": {
            **WHOLE_FILE_SETTINGS,
            "language": ["given", "detected"],
            "text_only": "a third run, language given, without timestamp tokens",
            "chinese_variant": env.config.stream.chinese_variant,
        },
        "per_language": per_language,
        "overall": overall,
        "clips": clips,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"languages-{data['machine']['host']}.json"
    write_json(path, data)
    print(
        f"{'lang':<5} {'metric':<4} {'clips':>5} {'LID':>7} {'flaps':>5} {'given':>7} "
        f"{'whole':>7} {'gap':>6} {'95 %':>13} {'auto':>7} {'whole':>7} {'gap':>6} "
        f"{'text-only':>9} {'gap':>6}"
    )
    for language, g in per_language.items():
        lid = f"{g['lid_correct']}/{g['lid_clips']}"
        print(
            f"{language:<5} {g['metric']:<4} {g['clips']:>5} {lid:>7} {g['flaps']:>5} "
            f"{100 * g['streamed']:>6.1f}% {100 * g['whole_file']:>6.1f}% "
            f"{g['gap_points']:>+6.1f} {_interval(g['gap_ci95_points']):>13} "
            f"{100 * g['streamed_auto']:>6.1f}% "
            f"{100 * g['whole_file_auto']:>6.1f}% {g['gap_auto_points']:>+6.1f} "
            f"{100 * g['whole_file_text_only']:>8.1f}% {g['text_only_gap_points']:>+6.1f}"
        )
    print(
        f"LID {overall['lid_accuracy']}, flaps {overall['flaps']}; all clips pooled: gap "
        f"{overall['pooled_gap_points']:+.1f} points "
        f"(95 % {_interval(overall['pooled_gap_ci95_points'])}); groups within 1 point: streamed "
        f"{overall['languages_within_1_point']}, whole-file text-only "
        f"{overall['whole_file_text_only_within_1_point']} of {overall['languages']}; wrote {path}"
    )
    return 0
