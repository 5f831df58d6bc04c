"""`captiond bench decode`: the streaming decode without real time, to compare settings quickly.

Main thread only. Each clip goes through `captiond.offline.transcribe_samples`, the path of
`captiond transcribe`: the session's VAD, segmentation, context and final decodes, without
partials and without waiting for the audio. So a setting that changes what a final decodes
(`[vad] final_tail_ms`, `[stream] context_s`, `context_tokens`, a beam size) can be weighed in
minutes over hundreds of utterances, by its errors and by the engine time each final costs,
before a real-time `bench stream` run confirms it. With `--partials` the session also asks for
partials and early finals, each answered at once: what partials do to finals (stable words kept,
an utterance shown in partials whose final is empty) shows, still without real time, and so do
the early finals thrown away at pauses the speaker went on after (`final_decodes` against
`finals`: `--set vad.endpoint_silence_ms=N` weighs an endpoint). A clip is
decoded in its manifest's `language`, and scored in it (WER, or CER for languages written
without spaces), with totals per language:

    captiond bench decode --clips utterance --set vad.final_tail_ms=390 --out DIR
    captiond bench decode --manifest ../shared/speech-multi/manifest.jsonl --model base --out DIR
    captiond bench decode --clips utterance,long,nonspeech --partials --out DIR
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from captiond.bench import common
from captiond.bench.metrics import share, stable_before_final
from captiond.bench.report import Progress, write_json
from captiond.bench.wer import NO_ERRORS, WerCounts, language_errors, normalize
from captiond.config import override
from captiond.streaming.offline import transcribe_samples


def add_decode_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("decode", help="errors and engine time per final, without real time")
    common.add_options(p, default_clips="utterance")
    p.add_argument(
        "--partials",
        action="store_true",
        help="also decode partials and early finals, as a stream does (each answered at once)",
    )
    p.set_defaults(func=_bench_decode)


def _bench_decode(args: argparse.Namespace) -> int:
    env = common.prepare(args)
    env.engine.phases.drain()  # the warm-up's
    clips: dict[str, Any] = {}
    speech = exact = long = NO_ERRORS
    finals, empty_finals, final_decodes, audio_s = 0, 0, 0, 0.0
    promised_words = final_words = 0
    per_language: dict[str, WerCounts] = {}
    progress = Progress("decode", len(env.clips))
    started = time.monotonic()
    for clip in env.clips:
        config = override(env.config, "stream", language=clip.language)
        transcript = transcribe_samples(clip.samples, env.engine, config, partials=args.partials)
        # An empty final only follows partials (offline, an utterance decoded to nothing
        # sends none): an utterance whose words were shown, then lost.
        segments = transcript.segments  # a property: the finals among the messages
        empty = sum(1 for final in segments if not final.text)
        finals += len(segments)
        empty_finals += empty
        final_decodes += transcript.final_decodes
        audio_s += clip.duration_s
        figures: dict[str, Any] = {
            "text": transcript.text,
            "finals": len(segments),
            "empty_finals": empty,
            "final_decodes": transcript.final_decodes,
            "partials": transcript.partials,
        }
        if args.partials:
            promised, words = stable_before_final([m.to_dict() for m in transcript.messages])
            promised_words += promised
            final_words += words
            figures["stable_before_final_share"] = share((promised, words))
        if clip.kind == "nonspeech":
            figures["words"] = len(normalize(transcript.text))
        else:
            counts = language_errors(clip.text, transcript.text, clip.language)
            speech += counts
            exact += counts if clip.ref_quality == "exact" else NO_ERRORS
            long += counts if clip.kind == "long" else NO_ERRORS
            per_language[clip.language] = per_language.get(clip.language, NO_ERRORS) + counts
            figures |= {"errors": counts.errors, "wer": round(counts.wer, 4)}
        clips[clip.id] = figures
        progress.step(clip.id)
    wall_s = time.monotonic() - started
    phases_s = env.engine.phases.drain()
    # Engine time by phase (encode, generate, …), per final sent: what a final costs.
    per_final_ms = {
        phase: round(1000 * seconds / max(1, finals), 1) for phase, seconds in phases_s.items()
    }
    overall: dict[str, Any] = {
        # As `bench stream` pools them: the exact references, and the long clips.
        "wer_exact_refs": round(exact.wer, 4) if exact.reference_words else None,
        "wer_long_pooled": round(long.wer, 4) if long.reference_words else None,
        "errors": speech.errors,
        "reference_words": speech.reference_words,
        "wer": round(speech.wer, 4),
        "nonspeech_words": sum(clips[c.id]["words"] for c in env.clips if c.kind == "nonspeech"),
        "finals": finals,
        "empty_finals": empty_finals,
        # Engine decodes for the finals: more than finals where early finals were thrown away
        # (the speaker went on) or a final was decoded again alone.
        "final_decodes": final_decodes,
        # With --partials: the share of the finals' words shown as stable before their final.
        "stable_before_final_share": (
            share((promised_words, final_words)) if args.partials else None
        ),
        "engine_ms_per_final": per_final_ms,
        "per_language": {
            language: {"errors": c.errors, "reference_units": c.reference_words}
            for language, c in sorted(per_language.items())
        },
        "rtf": round(wall_s / audio_s, 3) if audio_s else None,
    }
    data = common.header(args, env, "decode") | {
        "partials": args.partials,
        "overall": overall,
        "per_clip": clips,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"decode-{data['machine']['host']}.json"
    write_json(path, data)
    per_final = ", ".join(f"{k} {v} ms" for k, v in per_final_ms.items())
    share_text = f"; {overall['stable_before_final_share']} of their words stable before them"
    stable = share_text if args.partials else ""
    print(
        f"{len(env.clips)} clips, {finals} finals ({empty_finals} empty{stable}; {final_decodes} "
        f"final decodes): {speech.errors} "
        f"errors in {speech.reference_words} words ({100 * speech.wer:.2f} %); exact references "
        f"{overall['wer_exact_refs']}, long clips {overall['wer_long_pooled']}; non-speech words "
        f"{overall['nonspeech_words']}; per final: {per_final}; wrote {path}"
    )
    return 0
