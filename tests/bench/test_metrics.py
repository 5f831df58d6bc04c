"""The bench's measurements over scripted message streams: no daemon, no clock, no model."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from captiond.bench.metrics import (
    Trace,
    contradicted_stable_words,
    final_latencies_ms,
    first_text_s,
    last_final_before_done,
    partial_lags_ms,
    percentile,
    retracted_stable_words,
    stable_before_final,
    summary,
    unstable_churn,
    word_final_latencies_ms,
)
from captiond.bench.peer_whisperlive import SegmentTranslator
from captiond.bench.speech import SpeechRuns, speech_runs
from captiond.bench.wer import WerCounts, align, gap_interval_points, word_errors
from captiond.samples import samples_to_ms
from captiond.streaming.audio import FRAME_SAMPLES


def partial(seg: int, stable: str, unstable: str, end_ms: int = 0) -> dict[str, Any]:
    return {
        "type": "partial",
        "segment": seg,
        "start_ms": 0,
        "end_ms": end_ms,
        "stable": stable,
        "unstable": unstable,
    }


def scripted_trace() -> Trace:
    """1 s of audio sent in 100 ms chunks at 0.1 s, 0.2 s, …; messages at chosen moments."""
    trace = Trace()
    for i in range(1, 11):
        trace.record_sent(i / 10, i * 100)
    trace.record_message(0.55, partial(0, "", "hello", end_ms=400))
    trace.record_message(0.85, partial(0, "hello", "world", end_ms=700))
    trace.record_message(
        1.30,
        {"type": "final", "segment": 0, "start_ms": 100, "end_ms": 1000, "text": "hello world"},
    )
    trace.record_message(1.31, {"type": "done"})
    return trace


@pytest.mark.parametrize("q", [0, 10, 50, 95, 100])
def test_percentile_matches_numpy(q: float) -> None:
    values = [5.0, 1.0, 9.0, 3.0, 7.5, 2.0]
    assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))


def test_percentile_and_summary_of_nothing() -> None:
    assert percentile([], 50) is None
    assert summary([]) == {"count": 0, "p50": None, "p95": None, "max": None}


def test_partial_lag_is_audio_sent_minus_end_ms() -> None:
    # At 0.55 s, 500 ms had been sent; at 0.85 s, 800 ms.
    trace = scripted_trace()
    assert partial_lags_ms(trace) == [100, 100]
    # In wall ms, as final latency: audio sent at twice real time was sent half as long ago.
    trace.speed = 2.0
    assert partial_lags_ms(trace) == [50, 50]


# Speech from 200 to 700 ms: the final (end_ms 1000) includes 300 ms of the silence after it.
SPEECH = SpeechRuns(starts_ms=(200,), ends_ms=(700,))


def test_final_latency_counts_from_where_the_speaker_stopped() -> None:
    """Not from the final's end_ms, which includes the silence the endpointing waited for:
    speech stopped at 700 ms, sent at 0.7 s; the final arrived at 1.3 s."""
    assert final_latencies_ms(scripted_trace(), SPEECH) == [pytest.approx(600.0)]
    # An utterance cut while the speaker goes on (the cap) counts from the cut.
    going_on = SpeechRuns(starts_ms=(200,), ends_ms=(5_000,))
    assert final_latencies_ms(scripted_trace(), going_on) == [pytest.approx(300.0)]
    assert final_latencies_ms(scripted_trace(), SpeechRuns()) == [pytest.approx(300.0)]


def test_word_latency_counts_from_each_words_end() -> None:
    """Two finals of one turn with no pause, both arriving at 1.3 s: the first speaker's word
    ended at 300 ms (sent at 0.3 s), the second's at 900 ms (sent at 0.9 s)."""
    trace = Trace()
    for i in range(1, 11):
        trace.record_sent(i / 10, i * 100)
    for text, end_ms in (("hello", 300), ("world", 900)):
        words = [{"word": text, "start_ms": end_ms - 200, "end_ms": end_ms}]
        trace.record_message(1.30, {"type": "final", "text": text, "words": words})
    trace.record_message(1.31, {"type": "final", "text": ""})  # no words: nothing counted
    assert word_final_latencies_ms(trace) == [pytest.approx(1000.0), pytest.approx(400.0)]


def test_first_text_counts_from_where_the_speaker_began() -> None:
    """The first partial starts at 0 ms (the pre-roll); its speech at 200 ms, sent with the
    second chunk at 0.2 s; the partial arrived at 0.55 s."""
    assert first_text_s(scripted_trace(), SPEECH) == pytest.approx(0.35)


def test_speech_runs_of_a_real_clip(jfk: np.ndarray) -> None:
    """JFK's clip, and then 2 s of silence: speech starts after the clip's quiet start and
    stops before the silence; runs are ordered and apart."""
    runs = speech_runs(np.concatenate([jfk, np.zeros(32_000, np.float32)]))
    clip_ms = len(jfk) * 1000 // 16_000
    # Positions in the audio, not times: whole frames, the last of which may straddle its end.
    frame_ms = samples_to_ms(FRAME_SAMPLES)
    assert runs.starts_ms[0] > 0 and runs.ends_ms[-1] <= clip_ms + frame_ms
    assert all(s < e for s, e in zip(runs.starts_ms, runs.ends_ms, strict=True))
    assert all(e < s for e, s in zip(runs.ends_ms, runs.starts_ms[1:], strict=False))
    assert runs.stopped_by(clip_ms + 1_500) == runs.ends_ms[-1]


def test_trailing_finals_have_no_latency() -> None:
    trace = scripted_trace()
    trace.messages[2]["trailing"] = True
    assert final_latencies_ms(trace, SPEECH) == []


def test_last_final_before_done() -> None:
    messages = scripted_trace().messages
    assert last_final_before_done(messages)
    assert not last_final_before_done(messages[:-1])
    assert not last_final_before_done([messages[0], messages[3], messages[2]])


def test_retracted_stable_words_counts_words_not_kept_as_prefix() -> None:
    clean = [
        partial(0, "a", "b"),
        partial(0, "a b", "c"),
        partial(1, "", "x"),
        partial(0, "a b c", ""),
    ]
    assert retracted_stable_words(clean) == 0
    bad = [partial(0, "a b c", ""), partial(0, "a x", "y"), partial(1, "q", ""), partial(1, "", "")]
    assert retracted_stable_words(bad) == 2 + 1


def test_unstable_churn_counts_replaced_unstable_words() -> None:
    messages = [
        partial(0, "", "the cat sat"),
        partial(0, "the", "cat sat on"),  # nothing replaced
        partial(0, "the", "hat"),  # "cat" replaced, "sat" and "on" gone
        partial(1, "", "other"),  # another segment: no churn with segment 0
    ]
    assert unstable_churn(messages) == 3


def test_wer_alignment() -> None:
    counts = align(["a", "b", "c", "d"], ["a", "x", "c", "d", "e"])
    assert (counts.substitutions, counts.deletions, counts.insertions) == (1, 0, 1)
    assert counts.wer == pytest.approx(0.5)
    assert word_errors("Hello, World!", "hello world").errors == 0


def _errors(n: int, words: int = 10) -> WerCounts:
    return WerCounts(substitutions=n, deletions=0, insertions=0, reference_words=words)


def test_gap_interval_is_a_paired_bootstrap_over_clips() -> None:
    """`bench languages` reports each group's gap with it: seven clips of ten words, one clip
    two words worse, is a gap of 2.9 points whose interval holds 0; every clip a word worse
    is a gap whose interval does not."""
    same = [(_errors(2), _errors(2))] * 7
    assert gap_interval_points(same) == gap_interval_points([]) == (0.0, 0.0)
    one_clip = [(_errors(4), _errors(2))] + [(_errors(1), _errors(1))] * 6
    low, high = gap_interval_points(one_clip)
    assert low == 0.0 and 2.9 < high <= 20.0
    assert gap_interval_points(one_clip) == (low, high)  # seeded
    every_clip = [(_errors(3), _errors(2))] * 3 + [(_errors(2), _errors(1))] * 4
    assert gap_interval_points(every_clip) == (10.0, 10.0)
    # Clips of different lengths weigh by their words, as the pooled rate does.
    mixed = [(_errors(1, 5), _errors(0, 5)), (_errors(0, 50), _errors(1, 50))]
    low, high = gap_interval_points(mixed)
    assert -2.0 <= low < 0 < high <= 20.0


def test_whisperlive_segments_become_partials_and_finals() -> None:
    trace = Trace()
    trace.record_sent(0.1, 100)
    translator = SegmentTranslator(trace)
    seg = {"start": "0.000", "end": "1.500", "text": " Hello there", "completed": False}
    translator.feed(1.0, [seg])
    done = dict(seg, completed=True)
    nxt = {"start": "1.600", "end": "2.000", "text": " and", "completed": False}
    translator.feed(2.0, [done, nxt])
    translator.feed(2.5, [done, dict(nxt, end="2.400", text=" and more")])  # re-sent, not new
    translator.close(3.0)
    kinds = [
        (m["type"], m.get("segment"), m.get("text", m.get("unstable"))) for m in trace.messages
    ]
    assert kinds == [
        ("partial", 0, "Hello there"),
        ("final", 0, "Hello there"),
        ("partial", 1, "and"),
        ("partial", 1, "and more"),
        ("final", 1, "and more"),
        ("done", None, None),
    ]
    assert trace.messages[4]["trailing"] and trace.messages[1]["end_ms"] == 1500


def test_contradicted_stable_words_counts_promises_the_final_broke() -> None:
    kept = [
        {"type": "partial", "segment": 0, "stable": "and so", "unstable": "my"},
        {"type": "final", "segment": 0, "text": "and so my fellow"},
    ]
    broken = [
        {"type": "partial", "segment": 0, "stable": "and so my", "unstable": ""},
        {"type": "final", "segment": 0, "text": "and so am I"},
        {"type": "partial", "segment": 1, "stable": "never finalised", "unstable": ""},
    ]
    assert contradicted_stable_words(kept) == 0
    assert contradicted_stable_words(broken) == 1 + 2
    # The last stable word grows as stable text may: by punctuation or a hyphenated rest.
    grown = [
        {"type": "partial", "segment": 0, "stable": "yes, time", "unstable": ""},
        {"type": "final", "segment": 0, "text": "yes, time-wise, it"},
        {"type": "partial", "segment": 1, "stable": "ask not what you", "unstable": ""},
        {"type": "final", "segment": 1, "text": "ask not what you."},
        {"type": "partial", "segment": 2, "stable": "time is", "unstable": ""},
        {"type": "final", "segment": 2, "text": "time-wise is"},
    ]
    assert contradicted_stable_words(grown) == 2  # only the last word may grow


def test_stable_before_final_counts_the_last_promise_of_each_segment() -> None:
    messages = [
        partial(0, "and", "so"),
        partial(0, "and so my", "fellow"),
        partial(1, "", "ask"),
        {"type": "final", "segment": 0, "text": "and so my fellow Americans"},
        {"type": "final", "segment": 1, "text": "ask not"},
        {"type": "final", "segment": 2, "text": "never shown"},
    ]
    assert stable_before_final(messages) == (3, 5 + 2 + 2)
    assert stable_before_final([]) == (0, 0)
