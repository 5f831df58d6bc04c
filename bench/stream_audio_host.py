"""The engine thread's own work to get a batch's audio to the GPU, before and after stream audio.

    python3 bench/stream_audio_host.py [--rows 107] [--batches 12]

A batch of partials as at 1,000 streams on the H200 (107 rows, windows of 8-20 s, each stream
0.5 s further on than in its previous batch). "staging": every window copied whole into a reused
[rows, 30-s] row buffer, as torch_graph staged audio before `stream_audio.py` (and 30-s rows sent
to the device). "put" and "centred": `StreamAudio` on torch's meta device, where operators only
work out shapes, so the time is the engine thread's own (Python, packing the new audio, operator
dispatch), as on a GPU where the kernels run asynchronously. Prints JSON: medians over the
batches after the first (which sends every window whole).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch

from captiond.engines.base import DecodeKind, EngineRequest
from captiond.engines.torch_graph.stream_audio import (
    CENTRE_PAD_SAMPLES,
    CENTRED_SAMPLES,
    TAIL_PAD_SAMPLES,
    StreamAudio,
)
from captiond.whisper import SAMPLE_RATE_HZ

PARTIAL_HOP_SAMPLES = 8_000  # 0.5 s: the partial interval


def stage_whole(rows: np.ndarray, windows: list[np.ndarray]) -> None:
    """The staging before stream audio: each window centred in its row (tail pad, reflections)."""
    pad = CENTRE_PAD_SAMPLES
    for row, clip in zip(rows, windows, strict=False):
        signal = clip.size + TAIL_PAD_SAMPLES
        row[pad : pad + clip.size] = clip
        row[pad + clip.size : pad + signal] = 0.0
        row[:pad] = row[pad + 1 : 2 * pad + 1][::-1]
        row[pad + signal : 2 * pad + signal] = row[signal - 1 : pad + signal - 1][::-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=107)
    parser.add_argument("--batches", type=int, default=12)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    lengths = rng.integers(8 * SAMPLE_RATE_HZ, 20 * SAMPLE_RATE_HZ, args.rows)
    total_s = 20 + args.batches
    streams = [
        (rng.standard_normal(total_s * SAMPLE_RATE_HZ) * 0.1).astype(np.float32) for _ in lengths
    ]
    rows = np.zeros((args.rows, CENTRED_SAMPLES), np.float32)
    audio = StreamAudio(max(256, 2 * args.rows), args.rows, torch.device("meta"))
    timings: dict[str, list[float]] = {"staging": [], "put": [], "centred": []}
    sent: list[int] = []
    for batch in range(args.batches):
        ends = [int(n) + SAMPLE_RATE_HZ + batch * PARTIAL_HOP_SAMPLES for n in lengths]
        requests = [
            EngineRequest(
                audio=stream[end - int(n) : end],
                kind=DecodeKind.PARTIAL,
                stream=str(i),
                end_sample=end,
            )
            for i, (stream, n, end) in enumerate(zip(streams, lengths, ends, strict=True))
        ]
        started = time.perf_counter()
        stage_whole(rows, [r.audio for r in requests])
        timings["staging"].append(time.perf_counter() - started)
        before = audio.samples_sent
        started = time.perf_counter()
        clips = audio.put(requests)
        timings["put"].append(time.perf_counter() - started)
        started = time.perf_counter()
        audio.centred(clips)
        timings["centred"].append(time.perf_counter() - started)
        sent.append(audio.samples_sent - before)
    report = {
        "rows": args.rows,
        "host_ms_per_batch": {
            name: round(statistics.median(seconds[1:]) * 1e3, 2)
            for name, seconds in timings.items()
        },
        "mb_to_device_per_batch": {
            "staging": round(args.rows * CENTRED_SAMPLES * 4 / 1e6, 1),
            "stream_audio": round(statistics.median(sent[1:]) * 4 / 1e6, 2),
        },
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
