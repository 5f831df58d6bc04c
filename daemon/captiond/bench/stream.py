"""`captiond bench stream`: accuracy, latency and stability of real-time streams, per clip.

Main thread and its event loop. The engine is loaded once: the main thread uses it first for the
offline transcripts (captiond.streaming.offline), then hands it to an in-process daemon's engine
thread
(unless --url names a running daemon). The accuracy reference is faster-whisper's own `transcribe`
of each whole clip with the same model (the `whole-file` column). With --peer whisperlive the same
clips are streamed to WhisperLive at the same pace, one clip at a time, after ours. Each clip
goes to both with `TAIL_SILENCE_S` of silence after it, so each system ends its last utterance
by its own endpointing, as in a live meeting, before captiond is sent `end` and WhisperLive
END_OF_AUDIO. Latencies count from the speech in the audio (bench.speech), the same for both. With
--diarize both the clips are streamed to the daemon twice, without and with `[stream] diarize`
(the JSON's "captiond" and "captiond-diarize"), so what speaker labels cost in final latency
is measured in one run; --end-of-turn both does the same with turns ended by silence and by the
end-of-turn model ("captiond" and "captiond-turn-model"). Each run reports its finals' latency
from where the speaker stopped, split into the endpoint's wait and the decode after it, and
the finals that end inside a sentence the next final goes on with.

    captiond bench stream --clips long,utterance:6,nonspeech:3 --max-clip-s 240 --out DIR
    captiond bench stream --clips meeting_pub_00,spokenwoz_SNG0072 --diarize both --out DIR
    captiond bench stream --clips meeting,long --end-of-turn both --peer whisperlive --out DIR
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from captiond.bench import common
from captiond.bench.metrics import (
    Trace,
    contradicted_stable_words,
    endpoint_waits_ms,
    final_latencies_after_endpoint_ms,
    final_latencies_ms,
    final_text,
    first_text_s,
    last_final_before_done,
    mid_sentence_finals,
    partial_lags_ms,
    retracted_stable_words,
    share,
    speakers_found,
    stable_before_final,
    summary,
    unstable_churn,
    word_final_latencies_ms,
)
from captiond.bench.pacing import stream_native
from captiond.bench.peer_whisperlive import peer_language, stream_whisperlive, whisperlive_server
from captiond.bench.report import Progress, plot_cdfs, print_table, write_json
from captiond.bench.speech import SpeechRuns, speech_runs
from captiond.bench.wer import NO_ERRORS, align, normalize, word_errors
from captiond.engines.faster_whisper import (
    WHOLE_FILE_SETTINGS,
    transcribe_whole_file,
    whole_file_compute_type,
)
from captiond.engines.models import resolve_model
from captiond.ops.loop import run as run_loop
from captiond.streaming.offline import transcribe_samples
from captiond.whisper import SAMPLE_RATE_HZ

# Silence after each clip: well past captiond's endpoint (500 ms); WhisperLive is given its
# adapter's settle time after it too (peer_whisperlive.stream_whisperlive).
TAIL_SILENCE_S = 2.0


def add_stream_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("stream", help="per-clip WER, latency, stability vs offline and the peer")
    common.add_options(p, default_clips="long:1,utterance:6,nonspeech:3")
    common.add_daemon_run_options(p)
    p.add_argument(
        "--no-whole-file",
        dest="whole_file",
        action="store_false",
        help="skip the whole-file faster-whisper reference",
    )
    p.set_defaults(func=_bench_stream)


def clip_figures(
    trace: Trace, clip: common.Clip, speech: SpeechRuns, offline: str | None
) -> dict[str, Any]:
    """Every per-clip figure of one streamed clip (ours or the peer's)."""
    text = final_text(trace.messages)
    figures: dict[str, Any] = {
        "text": text,
        "words": len(normalize(text)),
        "partial_lag_ms": summary(partial_lags_ms(trace)),
        "final_latency_ms": summary(final_latencies_ms(trace, speech)),
        "word_final_latency_ms": summary(word_final_latencies_ms(trace)),
        "first_text_s": _round(first_text_s(trace, speech)),
        "retracted_stable_words": retracted_stable_words(trace.messages),
        "contradicted_stable_words": contradicted_stable_words(trace.messages),
        "stable_before_final_share": share(stable_before_final(trace.messages)),
        "unstable_churn_words": unstable_churn(trace.messages),
        "last_final_before_done": last_final_before_done(trace.messages),
        "speakers": speakers_found(trace.messages),
        "finals": len(trace.of("final")),
        "mid_sentence_finals": mid_sentence_finals(trace.messages),
        "end_wait_s": _round(trace.ended_s - trace.sent_s[-1] if trace.ended_s else None),
    }
    if clip.kind != "nonspeech":
        figures["wer"] = round(word_errors(clip.text, text).wer, 4)
    if offline is not None:
        off_words = normalize(offline)
        tail = off_words[-8:]
        figures["tail_words_missing_vs_offline"] = align(
            tail, normalize(text)[-(len(tail) + 4) :]
        ).deletions
    return figures


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


def pooled_wer(clips: list[common.Clip], texts: dict[str, str]) -> dict[str, float | None]:
    """WER over the exact-reference clips, and over the long clips (dialogues and the LJ reading,
    whose references are partly approximate: a relative figure)."""
    exact = long = NO_ERRORS
    for clip in clips:
        if clip.kind != "nonspeech" and clip.ref_quality == "exact":
            exact += word_errors(clip.text, texts[clip.id])
        if clip.kind == "long":
            long += word_errors(clip.text, texts[clip.id])
    return {
        "wer_exact_refs": round(exact.wer, 4),
        "wer_long_pooled": round(long.wer, 4) if long.reference_words else None,
    }


def _overall(
    clips: list[common.Clip],
    runs: dict[str, Trace],
    streamed: dict[str, Streamed],
    texts: dict[str, str],
) -> dict[str, Any]:
    counts = NO_ERRORS
    for clip in clips:
        if clip.kind != "nonspeech" and clip.ref_quality == "exact":
            counts += word_errors(clip.text, texts[clip.id])
    lags = [x for c in clips for x in partial_lags_ms(runs[c.id])]
    finals = [x for c in clips for x in final_latencies_ms(runs[c.id], streamed[c.id].speech)]
    endpoint = [x for c in clips for x in final_latencies_after_endpoint_ms(runs[c.id])]
    waits = [x for c in clips for x in endpoint_waits_ms(runs[c.id], streamed[c.id].speech)]
    promised = [stable_before_final(runs[c.id].messages) for c in clips]
    return pooled_wer(clips, texts) | {
        "reference_words": counts.reference_words,
        "nonspeech_words": sum(len(normalize(texts[c.id])) for c in clips if c.kind == "nonspeech"),
        "partial_lag_ms": summary(lags),
        "final_latency_ms": summary(finals),
        "final_after_endpoint_ms": summary(endpoint),
        "word_final_latency_ms": summary(
            [x for c in clips for x in word_final_latencies_ms(runs[c.id])]
        ),
        "endpoint_wait_ms": summary(waits),
        "finals": sum(len(runs[c.id].of("final")) for c in clips),
        "mid_sentence_finals": sum(mid_sentence_finals(runs[c.id].messages) for c in clips),
        "retracted_stable_words": sum(retracted_stable_words(runs[c.id].messages) for c in clips),
        "contradicted_stable_words": sum(
            contradicted_stable_words(runs[c.id].messages) for c in clips
        ),
        "stable_before_final_share": share(
            (sum(p for p, _ in promised), sum(w for _, w in promised))
        ),
        "unstable_churn_words": sum(unstable_churn(runs[c.id].messages) for c in clips),
        "all_finals_before_done": all(last_final_before_done(runs[c.id].messages) for c in clips),
    }


@dataclass(frozen=True, slots=True)
class Streamed:
    """A clip as either system is sent it, `TAIL_SILENCE_S` of silence after it, and where it
    has speech (bench.speech)."""

    samples: npt.NDArray[np.float32]
    speech: SpeechRuns

    @classmethod
    def of(cls, clip: common.Clip) -> Streamed:
        silence = np.zeros(int(TAIL_SILENCE_S * SAMPLE_RATE_HZ), np.float32)
        samples = np.concatenate([clip.samples, silence])
        return cls(samples, speech_runs(samples))


async def _run_ours(
    args: argparse.Namespace, name: str, env: common.BenchEnv, streamed: dict[str, Streamed]
) -> dict[str, Any]:
    runs: dict[str, Trace] = {}
    requests: dict[str, float] = {}
    progress = Progress(name, len(env.clips))
    async with common.bench_daemon(args, env) as daemon:
        url, scheduler = daemon.url, daemon.scheduler
        for clip in env.clips:
            before = scheduler.stats.requests if scheduler else 0
            audio = streamed[clip.id].samples
            runs[clip.id] = await stream_native(url, audio, speed=args.speed)
            if scheduler is not None:
                requests[clip.id] = (scheduler.stats.requests - before) / clip.duration_s
            progress.step(clip.id)
    return _results(env, runs, streamed, requests)


async def _run_peer(
    args: argparse.Namespace, env: common.BenchEnv, streamed: dict[str, Streamed]
) -> dict[str, Any]:
    runs: dict[str, Trace] = {}
    progress = Progress("whisperlive", len(env.clips))
    # The model and language captiond runs, however they were chosen.
    model = resolve_model(env.config.engine.model)
    language = peer_language(env.config.stream.language)
    with whisperlive_server(model, args.peer_mode) as (url, _pid):
        for clip in env.clips:
            runs[clip.id] = await stream_whisperlive(
                url, streamed[clip.id].samples, speed=args.speed, language=language
            )
            progress.step(clip.id)
    return _results(env, runs, streamed, {})


def _results(
    env: common.BenchEnv,
    runs: dict[str, Trace],
    streamed: dict[str, Streamed],
    requests: dict[str, float],
) -> dict[str, Any]:
    """One system's figures per clip and overall (its traces kept under "_runs")."""
    out = {
        c.id: clip_figures(runs[c.id], c, streamed[c.id].speech, env.offline[c.id])
        for c in env.clips
    }
    for clip_id, rate in requests.items():
        out[clip_id]["decode_requests_per_audio_s"] = round(rate, 2)
    texts = {c.id: final_text(runs[c.id].messages) for c in env.clips}
    return {"clips": out, "overall": _overall(env.clips, runs, streamed, texts), "_runs": runs}


def _bench_stream(args: argparse.Namespace) -> int:
    env = common.prepare(args, one_language=True)
    for clip in env.clips:
        started = time.monotonic()
        env.offline[clip.id] = transcribe_samples(clip.samples, env.engine, env.config).text
        env.offline_rtf[clip.id] = (time.monotonic() - started) / clip.duration_s
    whole = _whole_file(env) if args.whole_file else None
    streamed = {c.id: Streamed.of(c) for c in env.clips}
    loop = env.config.server.event_loop
    results: dict[str, Any] = {
        name: run_loop(_run_ours(args, name, run_env, streamed), loop)
        for name, run_env in common.daemon_runs(args, env)
    }
    if args.peer:
        results["whisperlive"] = run_loop(_run_peer(args, env, streamed), loop)
    series: dict[str, list[float]] = {}
    for name, res in results.items():
        runs = res.pop("_runs")
        series[f"partial lag: {name}"] = [x for t in runs.values() for x in partial_lags_ms(t)]
        series[f"final latency: {name}"] = [
            x for i, t in runs.items() for x in final_latencies_ms(t, streamed[i].speech)
        ]
    offline = {
        c.id: {
            "text": env.offline[c.id],
            "wer": None
            if c.kind == "nonspeech"
            else round(word_errors(c.text, env.offline[c.id]).wer, 4),
            "rtf": round(env.offline_rtf[c.id], 3),
        }
        for c in env.clips
    }
    data = common.header(args, env, "stream") | {
        "offline": {"clips": offline, "overall": pooled_wer(env.clips, env.offline)},
        "whole_file": whole,
        **results,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    name = f"stream-{data['machine']['host']}"
    write_json(args.out / f"{name}.json", data)
    plot_cdfs(args.out / f"{name}.png", f"captiond bench stream ({env.engine.name})", series)
    if "captiond" in data:
        _table(env.clips, data)
    for run_name in results:
        overall = data[run_name]["overall"]
        print(
            f"{run_name}: final latency p50 {overall['final_latency_ms']['p50']} ms "
            f"(endpoint wait {overall.get('endpoint_wait_ms', {}).get('p50')} ms), "
            f"p95 {overall['final_latency_ms']['p95']} ms, per word p50 "
            f"{overall['word_final_latency_ms']['p50']} ms, WER {overall['wer_exact_refs']} "
            f"(long {overall['wer_long_pooled']}), mid-sentence finals "
            f"{overall.get('mid_sentence_finals')} of {overall.get('finals')}"
        )
    print(f"wrote {args.out / name}.json and .png")
    return 0


def _whole_file(env: common.BenchEnv) -> dict[str, Any]:
    """faster-whisper `transcribe` on every whole clip: the same weights, on the CPU with the
    engine's compute type for faster-whisper (float32 for torch_graph, whose CPU path is FP32)."""
    compute_type = whole_file_compute_type(env.config.engine)
    texts: dict[str, str] = {}
    clips: dict[str, Any] = {}
    progress = Progress("whole-file", len(env.clips))
    for c in env.clips:
        texts[c.id] = transcribe_whole_file(
            resolve_model(env.config.engine.model),
            c.samples,
            device="cpu",
            compute_type=compute_type,
            language=env.config.stream.language,
            chinese_variant=env.config.stream.chinese_variant,
        )
        wer = None if c.kind == "nonspeech" else round(word_errors(c.text, texts[c.id]).wer, 4)
        clips[c.id] = {"text": texts[c.id], "wer": wer}
        progress.step(c.id)
    overall = pooled_wer(env.clips, texts)
    return {
        "compute_type": compute_type,
        "settings": dict(WHOLE_FILE_SETTINGS),
        "clips": clips,
        "overall": overall,
    }


def _table(clips: list[common.Clip], data: dict[str, Any]) -> None:
    rows = []
    peer = data.get("whisperlive")
    for clip in [*clips, None]:
        key = "overall" if clip is None else clip.id
        ours = data["captiond"]["overall" if clip is None else "clips"]
        ours = ours if clip is None else ours[key]
        theirs = None if peer is None else (peer["overall"] if clip is None else peer["clips"][key])
        off = (
            data["offline"]["overall"]["wer_exact_refs"]
            if clip is None
            else data["offline"]["clips"][key]["wer"]
        )
        whole = data["whole_file"]
        if whole is not None:
            whole = (
                whole["overall"]["wer_exact_refs"] if clip is None else whole["clips"][key]["wer"]
            )
        rows.append(
            [
                key[:34],
                ours.get("wer", ours.get("wer_exact_refs")),
                whole,
                off,
                None if theirs is None else theirs.get("wer", theirs.get("wer_exact_refs")),
                ours["partial_lag_ms"]["p50"],
                ours["final_latency_ms"]["p50"],
                ours["final_latency_ms"]["p95"],
                None if theirs is None else theirs["final_latency_ms"]["p50"],
                None if theirs is None else theirs["final_latency_ms"]["p95"],
                ours["retracted_stable_words"],
                ours["contradicted_stable_words"],
                ours["stable_before_final_share"],
            ]
        )
    if data["whole_file"] is not None:
        long_ours = data["captiond"]["overall"]["wer_long_pooled"]
        long_whole = data["whole_file"]["overall"]["wer_long_pooled"]
        if long_ours is not None:
            rows.append(["long clips pooled", long_ours, long_whole, None, *[None] * 9])
    headers = [
        "clip",
        "WER",
        "whole-file",
        "offline",
        "peer",
        "lag p50",
        "fin p50",
        "fin p95",
        "peer p50",
        "peer p95",
        "retract",
        "contra",
        "stable",
    ]
    print_table(headers, rows)
