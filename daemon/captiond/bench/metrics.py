"""The streaming measurements (docs/design/decisions.md#measuring) over one recorded stream (pure
functions, any thread).

A `Trace` is what a benchmark client saw: when each stretch of audio was sent and when each
message arrived, both on one wall clock, with messages in the native protocol's shape (the
WhisperLive adapter translates its segments into partials and finals). Everything here is
arithmetic over that record: percentiles, partial lag, final latency, stable-word retractions,
the share of words promised stable before their final, and unstable-word churn.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from captiond.bench.speech import SpeechRuns
from captiond.lang.text import continuation, ends_sentence

Message = dict[str, Any]


@dataclass(slots=True)
class Trace:
    """One stream as the client saw it; times are seconds on the client's monotonic clock, but
    for the connect and close moments on the wall clock. Picklable, to leave a client process."""

    sent_s: list[float] = field(default_factory=list)  # wall moment of each send …
    sent_ms: list[int] = field(default_factory=list)  # … and the stream audio sent by then
    arrived_s: list[float] = field(default_factory=list)
    messages: list[Message] = field(default_factory=list)
    ended_s: float | None = None  # when the server said `done` (or closed, for the peer)
    # Epoch seconds (time.time()), comparable across the client processes of `bench capacity`:
    # when the websocket opened and when it closed (None if it never opened).
    connect_epoch_s: float | None = None
    close_epoch_s: float | None = None
    speed: float = 1.0  # stream audio sent per wall second (`send_paced`)

    def record_sent(self, wall_s: float, audio_ms: int) -> None:
        self.sent_s.append(wall_s)
        self.sent_ms.append(audio_ms)

    def record_message(self, wall_s: float, message: Message) -> None:
        self.arrived_s.append(wall_s)
        self.messages.append(message)

    def audio_sent_ms(self, wall_s: float) -> int:
        """Stream audio sent at or before `wall_s`."""
        i = bisect.bisect_right(self.sent_s, wall_s)
        return self.sent_ms[i - 1] if i else 0

    def wall_when_sent(self, audio_ms: int) -> float:
        """The wall moment the audio up to `audio_ms` had been sent (the last send if never)."""
        i = bisect.bisect_left(self.sent_ms, audio_ms)
        return self.sent_s[min(i, len(self.sent_s) - 1)]

    def of(self, kind: str) -> list[tuple[float, Message]]:
        return [
            (t, m) for t, m in zip(self.arrived_s, self.messages, strict=True) if m["type"] == kind
        ]


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0 to 100), interpolated linearly as numpy does; None if empty."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def partial_lags_ms(trace: Trace) -> list[float]:
    """At each partial: audio sent so far minus the partial's `end_ms`, in wall ms as final
    latency is: at `--speed 2`, a second of audio not yet captioned was sent half a second
    ago."""
    return [(trace.audio_sent_ms(t) - m["end_ms"]) / trace.speed for t, m in trace.of("partial")]


def final_latencies_ms(trace: Trace, speech: SpeechRuns) -> list[float]:
    """At each final: its arrival minus the wall moment the audio up to where the speaker last
    stopped by its `end_ms` was sent, so the silence the endpointing waits for counts (finals
    the peer adapter made up at the close, marked `trailing`, have no latency)."""
    return [
        (t - trace.wall_when_sent(speech.stopped_by(m["end_ms"]))) * 1000
        for t, m in trace.of("final")
        if not m.get("trailing")
    ]


def word_final_latencies_ms(trace: Trace) -> list[float]:
    """At each final word: the final's arrival minus the wall moment the audio up to the word's
    `end_ms` was sent: how long after a word was said it was final, whichever final it came in.
    Per final, the first speaker's words of a turn with no pause count from the end of the
    second's; per word, from their own. It reads the system's own word timings (captiond's:
    a 50-ms median error, docs/measurements/word-timings.md); a final without words counts
    nothing."""
    return [
        (t - trace.wall_when_sent(word["end_ms"])) * 1000
        for t, m in trace.of("final")
        for word in m.get("words") or ()
    ]


def final_latencies_after_endpoint_ms(trace: Trace) -> list[float]:
    """At each final: its arrival minus the wall moment its `end_ms` was sent, the end of the
    silence that ended it (the measure before `final_latencies_ms` counted from the speech)."""
    return final_latencies_ms(trace, SpeechRuns())


def first_text_s(trace: Trace, speech: SpeechRuns) -> float | None:
    """From sending the start of the speech in the first text's audio (not the pre-roll before
    it) to that text's arrival."""
    for t, m in zip(trace.arrived_s, trace.messages, strict=True):
        text = m.get("text") or f"{m.get('stable', '')} {m.get('unstable', '')}".strip()
        if m["type"] in ("partial", "final") and text:
            return t - trace.wall_when_sent(speech.started_from(m["start_ms"]))
    return None


def _words(text: str) -> list[str]:
    return text.split()


def retracted_stable_words(messages: Sequence[Message]) -> int:
    """Words that were in a segment's `stable` and are not a prefix of its next partial's."""
    last: dict[int, list[str]] = {}
    retracted = 0
    for m in messages:
        if m["type"] != "partial":
            continue
        stable = _words(m.get("stable", ""))
        before = last.get(m["segment"], [])
        kept = 0
        while kept < min(len(before), len(stable)) and before[kept] == stable[kept]:
            kept += 1
        retracted += len(before) - kept
        last[m["segment"]] = stable
    return retracted


def contradicted_stable_words(messages: Sequence[Message]) -> int:
    """Words of a segment's last `stable` that its final does not start with: stable is a
    promise that the final keeps them (0 is the only right count). The last one may have grown
    as stable text does, by punctuation or a hyphenated word's rest ("time" → "time-wise,")."""
    stable: dict[int, list[str]] = {}
    contradicted = 0
    for m in messages:
        if m["type"] == "partial":
            stable[m["segment"]] = _words(m.get("stable", ""))
        elif m["type"] == "final":
            promised = stable.pop(m["segment"], [])
            final = _words(m.get("text", ""))
            kept = 0
            while kept < min(len(promised), len(final)) and (
                promised[kept] == final[kept]
                or (kept == len(promised) - 1 and continuation(promised[kept], final[kept]))
            ):
                kept += 1
            contradicted += len(promised) - kept
    # A segment whose final never came broke every promise it made.
    return contradicted + sum(len(words) for words in stable.values())


def stable_before_final(messages: Sequence[Message]) -> tuple[int, int]:
    """(words promised stable before their segment's final, words of the finals): how much of
    the text a client could show as settled before the endpoint, the other side of never
    contradicting it."""
    stable: dict[int, int] = {}
    promised = final_words = 0
    for m in messages:
        if m["type"] == "partial":
            stable[m["segment"]] = len(_words(m.get("stable", "")))
        elif m["type"] == "final":
            words = len(_words(m.get("text", "")))
            final_words += words
            promised += min(stable.pop(m["segment"], 0), words)
    return promised, final_words


def share(counts: tuple[int, int]) -> float | None:
    """part / whole of a (part, whole) pair such as `stable_before_final`'s, to 3 places."""
    part, whole = counts
    return round(part / whole, 3) if whole else None


def unstable_churn(messages: Sequence[Message]) -> int:
    """Unstable words of a partial that the segment's next partial no longer has in place."""
    last: dict[int, tuple[int, list[str]]] = {}
    churn = 0
    for m in messages:
        if m["type"] != "partial":
            continue
        stable = _words(m.get("stable", ""))
        words = stable + _words(m.get("unstable", ""))
        if m["segment"] in last:
            start, before = last[m["segment"]]
            churn += sum(
                1 for i in range(start, len(before)) if i >= len(words) or words[i] != before[i]
            )
        last[m["segment"]] = (len(stable), words)
    return churn


def final_text(messages: Sequence[Message]) -> str:
    return " ".join(m["text"] for m in messages if m["type"] == "final" and m["text"])


def endpoint_waits_ms(trace: Trace, speech: SpeechRuns) -> list[float]:
    """At each final: how much of its latency the endpoint waited, from where the speaker last
    stopped to its `end_ms` (the rest, `final_latencies_after_endpoint_ms`, is the decode's)."""
    return [
        float(m["end_ms"] - speech.stopped_by(m["end_ms"]))
        for _, m in trace.of("final")
        if not m.get("trailing")
    ]


def mid_sentence_finals(messages: Sequence[Message]) -> int:
    """Finals that end inside a sentence the next final goes on with: no closing mark at their
    end (text.ends_sentence), and the next final with words begins in lower case."""
    texts = [m["text"].strip() for m in messages if m["type"] == "final" and m["text"].strip()]
    return sum(
        1
        for text, after in itertools.pairwise(texts)
        if not ends_sentence(text) and after[:1].islower()
    )


def speakers_found(messages: Sequence[Message]) -> int:
    """How many speakers the finals name (0 on a stream that is not diarized)."""
    return len(
        {m["speaker"] for m in messages if m["type"] == "final" and m.get("speaker") is not None}
    )


def last_final_before_done(messages: Sequence[Message]) -> bool:
    """Every final arrived before `done` (a trace without `done` fails)."""
    types = [m["type"] for m in messages]
    return "done" in types and "final" not in types[types.index("done") :]


def peak_live(traces: Sequence[Trace]) -> int:
    """The most streams connected at one moment, from each trace's connect and close epochs (a
    close and a connect at the same moment do not overlap)."""
    events: list[tuple[float, int]] = []
    for t in traces:
        if t.connect_epoch_s is not None:
            events.append((t.connect_epoch_s, 1))
            events.append((t.close_epoch_s if t.close_epoch_s is not None else math.inf, -1))
    live = peak = 0
    for _, step in sorted(events):  # at a tie -1 sorts first: the close comes before the connect
        live += step
        peak = max(peak, live)
    return peak


def summary(values: Sequence[float], digits: int = 1) -> dict[str, float | int | None]:
    """count, p50, p95 and max, rounded."""
    p50, p95 = percentile(values, 50), percentile(values, 95)
    return {
        "count": len(values),
        "p50": None if p50 is None else round(p50, digits),
        "p95": None if p95 is None else round(p95, digits),
        "max": round(max(values), digits) if values else None,
    }
