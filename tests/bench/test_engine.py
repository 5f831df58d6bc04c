"""`captiond bench engine` on the CPU with tiny settings: it runs and writes the promised JSON."""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")

from captiond.bench.engine import add_engine_parser
from captiond.errors import ConfigError

pytestmark = pytest.mark.model


def test_bench_engine_cpu_smoke(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    add_engine_parser(parser.add_subparsers(dest="bench_command", required=True))
    out = tmp_path / "bench.json"
    argv = ["engine", "--device", "cpu", "--batch", "1,2", "--steps", "2", "--out", str(out)]
    args = parser.parse_args([*argv, "--beside-python", "0.5"])
    switch_interval_s = sys.getswitchinterval()
    assert args.func(args) == 0
    assert sys.getswitchinterval() == switch_interval_s  # restored
    report = json.loads(out.read_text(encoding="utf-8"))
    assert set(report) == {"machine", "versions", "config", "engines"}
    assert {"platform", "cpu", "gpu"} <= set(report["machine"])
    assert {"python", "torch", "ctranslate2", "faster-whisper", "captiond"} <= set(
        report["versions"]
    )
    assert report["config"]["batches"] == [1, 2] and report["config"]["steps"] == 2
    assert report["config"]["beside_python"] == 0.5
    torch_graph = report["engines"]["torch_graph"]
    assert torch_graph["graphs"] is False and torch_graph["peak_host_rss_bytes"] > 0
    # On the CPU both orders pick the same kernel; on Hopper GPUs the default is where cuDNN shows.
    kernels = torch_graph["attention_kernel"]
    assert kernels["torch_graph"] == kernels["torch_default"] != "CUDNN_ATTENTION"
    assert kernels["step"] in {"FLASH_ATTENTION", "MATH"}  # the CPU's, for a masked query
    for batch in ("1", "2"):
        row = torch_graph["batches"][batch]
        assert row["encoder_ms_per_window"] > 0 and row["decode_eager_us_per_token"] > 0
        assert row["audio_s_per_wall_s"] > 0 and row["stream_mel_ms_per_window"] > 0
        fw_row = report["engines"]["faster-whisper"]["batches"][batch]
        assert fw_row["encoder_ms_per_window"] > 0 and fw_row["decode_us_per_token"] > 0
        for timed in (row, fw_row):
            # Python's default switch interval and the daemon's, in ms.
            beside = timed["end_to_end_beside_python_s"]
            assert set(beside) == {"5", "0.5"} and all(_positive_finite(s) for s in beside.values())


@pytest.mark.parametrize("duty", ["0", "1", "1.5"])
def test_bench_engine_beside_python_is_a_share(tmp_path: Path, duty: str) -> None:
    parser = argparse.ArgumentParser()
    add_engine_parser(parser.add_subparsers(dest="bench_command", required=True))
    out = tmp_path / "bench.json"
    args = parser.parse_args(["engine", "--beside-python", duty, "--out", str(out)])
    with pytest.raises(ConfigError, match="share of the time"):
        args.func(args)
    assert not out.exists()


def test_bench_engine_says_which_audio_it_cannot_read(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    add_engine_parser(parser.add_subparsers(dest="bench_command", required=True))
    out = tmp_path / "bench.json"
    args = parser.parse_args(["engine", "--audio", str(tmp_path / "none.wav"), "--out", str(out)])
    with pytest.raises(ConfigError, match=r"--audio: cannot read .*none\.wav"):
        args.func(args)
    assert not out.exists()


@pytest.mark.parametrize("batches", ["1,x", "0,8", ","])
def test_bench_engine_batch_sizes_are_counts(
    tmp_path: Path, batches: str, capsys: pytest.CaptureFixture[str]
) -> None:
    parser = argparse.ArgumentParser()
    add_engine_parser(parser.add_subparsers(dest="bench_command", required=True))
    with pytest.raises(SystemExit) as exit_:
        parser.parse_args(["engine", "--batch", batches, "--out", str(tmp_path / "b.json")])
    assert exit_.value.code == 2
    assert "argument --batch: " in capsys.readouterr().err


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


def _positive_finite(value: object) -> bool:
    return isinstance(value, float) and math.isfinite(value) and value > 0


def test_bench_engine_transformers_peer_random_weights(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    parser = argparse.ArgumentParser()
    add_engine_parser(parser.add_subparsers(dest="bench_command", required=True))
    out = tmp_path / "bench.json"
    # faster-whisper alone skips random weights: only the peer is measured.
    argv = ["engine", "--engine", "faster-whisper", "--device", "cpu", "--batch", "1"]
    argv += ["--steps", "3", "--random-weights", "tiny", "--peer", "transformers"]
    args = parser.parse_args([*argv, "--out", str(out)])
    assert args.func(args) == 0
    report = json.loads(out.read_text(encoding="utf-8"))
    assert report["config"]["peer"] == "transformers"
    peer = report["peers"]["transformers"]
    assert peer["version"] == report["versions"]["transformers"]
    assert (peer["weights"], peer["model"]) == ("random", "random-tiny")
    assert (peer["device"], peer["dtype"], peer["cache"]) == ("cpu", "float32", "static")
    row = peer["batches"]["1"]
    for key in (
        "mel_ms_per_window",
        "encoder_ms_per_window",
        "decode_eager_us_per_step",
        "decode_eager_us_per_token",
        "end_to_end_s",
        "audio_s_per_wall_s",
    ):
        assert _positive_finite(row[key]), (key, row[key])
    # Random weights never say <|endoftext|>: the length limit, as the torch_graph engine.
    assert row["tokens_generated"] == 224


def test_transformers_peer_matches_torch_graph_on_real_speech(jfk: np.ndarray) -> None:
    pytest.importorskip("transformers")
    from captiond.bench import peer_transformers
    from captiond.config import EngineConfig
    from captiond.engines.base import DecodeKind, EngineRequest
    from captiond.engines.models import resolve_model
    from captiond.engines.torch_graph import TorchGraphEngine

    model_path = resolve_model(None)
    config = EngineConfig(name="torch_graph", device="cpu")
    engine = TorchGraphEngine(model_path, config, max_batch=1)
    audio = jfk.astype(np.float32)
    [ours] = engine.transcribe_batch([EngineRequest(audio=audio, kind=DecodeKind.FINAL)])
    peer = peer_transformers.build(model_path, "cpu", None)
    assert peer.weights == "real"
    # The same log-mel into both: the comparison is of the networks and the decoding rules.
    [theirs] = peer_transformers.transcribe(peer, engine.mel([audio]))
    assert theirs == ours.tokens
    assert peer.tokens.decode(theirs).strip() == ours.text
    assert "ask not what your country can do for you" in ours.text


def test_transformers_peer_compiled_run_failure_is_recorded(tmp_path: Path) -> None:
    """The compiled timings run in a child interpreter: its death is a string in the row."""
    pytest.importorskip("transformers")
    from captiond.bench import peer_transformers

    audio = np.zeros(16_000, dtype=np.float32)
    row = peer_transformers._compiled_in_child(tmp_path / "no-model", "cpu", "tiny", 1, 2, audio)
    assert set(row) == {"decode_compiled_error"}
    assert row["decode_compiled_error"].startswith("the compiled run died (exit status 1)")
    assert "No such file or directory" in row["decode_compiled_error"]


def test_bench_engine_peer_without_transformers_says_how_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import importlib.util

    real_find_spec = importlib.util.find_spec

    def find_spec(name: str, package: str | None = None) -> object:
        return None if name == "transformers" else real_find_spec(name, package)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    parser = argparse.ArgumentParser()
    add_engine_parser(parser.add_subparsers(dest="bench_command", required=True))
    argv = ["engine", "--device", "cpu", "--peer", "transformers", "--out", str(tmp_path / "b")]
    args = parser.parse_args(argv)
    with pytest.raises(ConfigError, match="pip install transformers"):
        args.func(args)
    assert not (tmp_path / "b").exists()
