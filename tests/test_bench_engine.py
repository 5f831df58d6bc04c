"""`captiond bench engine` on the CPU with tiny settings: it runs and writes the promised JSON."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

pytest.importorskip("torch")

from captiond.bench.engine import add_engine_parser

pytestmark = pytest.mark.model


def test_bench_engine_cpu_smoke(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    add_engine_parser(parser.add_subparsers(dest="bench_command", required=True))
    out = tmp_path / "bench.json"
    args = parser.parse_args(
        ["engine", "--device", "cpu", "--batch", "1,2", "--steps", "2", "--out", str(out)]
    )
    assert args.func(args) == 0
    report = json.loads(out.read_text(encoding="utf-8"))
    assert set(report) == {"machine", "versions", "config", "engines"}
    assert {"platform", "cpu", "gpu"} <= set(report["machine"])
    assert {"python", "torch", "ctranslate2", "faster-whisper", "captiond"} <= set(
        report["versions"]
    )
    assert report["config"]["batches"] == [1, 2] and report["config"]["steps"] == 2
    torch_graph = report["engines"]["torch_graph"]
    assert torch_graph["graphs"] is False and torch_graph["peak_host_rss_bytes"] > 0
    for batch in ("1", "2"):
        row = torch_graph["batches"][batch]
        assert row["encoder_ms_per_window"] > 0 and row["decode_eager_us_per_token"] > 0
        assert row["audio_s_per_wall_s"] > 0
        fw_row = report["engines"]["faster-whisper"]["batches"][batch]
        assert fw_row["encoder_ms_per_window"] > 0 and fw_row["decode_us_per_token"] > 0


def test_bench_engine_random_weights_skip_faster_whisper(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    add_engine_parser(parser.add_subparsers(dest="bench_command", required=True))
    out = tmp_path / "bench.json"
    argv = ["engine", "--device", "cpu", "--batch", "1", "--steps", "2"]
    args = parser.parse_args([*argv, "--random-weights", "tiny", "--out", str(out)])
    assert args.func(args) == 0
    report = json.loads(out.read_text(encoding="utf-8"))
    assert report["engines"]["torch_graph"]["model"] == "random-tiny"
    assert "skipped" in report["engines"]["faster-whisper"]
