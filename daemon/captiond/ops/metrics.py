"""The daemon's Prometheus metrics (prometheus_client), served at /metrics.

One `Metrics` per scheduler and daemon, with its own registry (tests run several daemons in one
process). With worker processes (workers/pool.py) every process also writes prometheus_client's
multiprocess files into $PROMETHEUS_MULTIPROC_DIR, and `render` adds all of them up. The
event-loop thread records sessions, audio, latencies, speech-gate checks and closes; the engine
thread records batches, queue wait and engine time (prometheus_client's metrics are
thread-safe).
"""

from __future__ import annotations

import os
from pathlib import Path

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
    values,
)

# Latency buckets in seconds: from a fast GPU partial to an overloaded CPU.
_LATENCY_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 30.0)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.sessions_open = Gauge(
            "captiond_sessions_open",
            "Open stream sessions",
            registry=r,
            multiprocess_mode="livesum",  # with workers: the sum over the live ones
        )
        self.sessions = Counter("captiond_sessions", "Stream sessions opened", registry=r)
        self.loop_busy = Gauge(
            "captiond_event_loop_busy_ratio",
            "Share of the last 2 s the event-loop thread was on the CPU (with max_loop_busy)",
            registry=r,
            multiprocess_mode="max",  # with workers: the busiest one's
        )
        self.refused = Counter(
            "captiond_refused",
            "Connections refused, by reason",
            ["reason"],
            registry=r,
        )
        self.audio_seconds = Counter(
            "captiond_audio_seconds", "Seconds of client audio received", registry=r
        )
        self.decode_requests = Counter(
            "captiond_decode_requests", "Decodes run by the engine", ["kind"], registry=r
        )
        self.batch_size = Histogram(
            "captiond_batch_size", "Requests per engine call", buckets=_BATCH_BUCKETS, registry=r
        )
        self.queue_wait_seconds = Histogram(
            "captiond_queue_wait_seconds",
            "Time a decode waited for the engine",
            buckets=_LATENCY_BUCKETS_S,
            registry=r,
        )
        self.engine_seconds = Histogram(
            "captiond_engine_seconds",
            "Engine time per batch",
            buckets=_LATENCY_BUCKETS_S,
            registry=r,
        )
        self.diarization_seconds = Histogram(
            "captiond_diarization_seconds",
            "Speaker-embedding time per engine batch with speaker windows to embed",
            buckets=_LATENCY_BUCKETS_S,
            registry=r,
        )
        self.turn_seconds = Histogram(
            "captiond_turn_seconds",
            "End-of-turn model time per engine batch with turns to judge",
            buckets=_LATENCY_BUCKETS_S,
            registry=r,
        )
        self.engine_phase_seconds = Counter(
            "captiond_engine_phase_seconds",
            "Engine time by phase of its batches (named by the engine)",
            ["phase"],
            registry=r,
        )
        self.speech_gate_checks = Counter(
            "captiond_speech_gate_checks",
            "Decodes the speech gate checked, by whether it found speech",
            ["speech"],
            registry=r,
        )
        self.speech_gate_seconds = Counter(
            "captiond_speech_gate_seconds",
            "Time decodes waited for the speech gate's checks",
            registry=r,
        )
        self.partial_lag_seconds = Histogram(
            "captiond_partial_lag_seconds",
            "Audio received minus a partial's end, when it is sent",
            buckets=_LATENCY_BUCKETS_S,
            registry=r,
        )
        self.final_latency_seconds = Histogram(
            "captiond_final_latency_seconds",
            "Time from receiving the audio at a final's end to sending the final",
            buckets=_LATENCY_BUCKETS_S,
            registry=r,
        )
        self.closes = Counter(
            "captiond_closes", "Stream sessions closed, by close code", ["code"], registry=r
        )

    def render(self) -> tuple[str, str]:
        """The exposition text and its content type."""
        registry = self.registry
        if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            from prometheus_client import multiprocess

            registry = CollectorRegistry()
            multiprocess.MultiProcessCollector(registry)  # type: ignore[no-untyped-call]
        return generate_latest(registry).decode(), CONTENT_TYPE_LATEST


def share_across_processes(folder: Path) -> None:
    """Metrics created in this process from now on are also written to `folder`, where the
    workers' /metrics adds them up (prometheus_client's multiprocess mode, which it otherwise
    only picks at import time)."""
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(folder)
    values.ValueClass = values.get_value_class()  # type: ignore[no-untyped-call]
