"""One short `captiond bench decode` run end to end: real model, the offline decode path, JSON.

No timing is asserted: only that the figures are there and add up.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from captiond.cli import main

pytestmark = pytest.mark.model
CLIPS = "jfk_inaugural_1961,ljspeech_LJ001-0002,bird_robin_inspectorj"


def test_bench_decode_counts_errors_and_engine_time_per_final(
    speech_dir: Path, tmp_path: Path
) -> None:
    argv = ["bench", "decode", "--clips", CLIPS, "--out", str(tmp_path)]
    argv += ["--manifest", str(speech_dir / "manifest.jsonl"), "--engine", "faster-whisper"]
    argv += ["--set", "vad.final_tail_ms=390"]
    assert main(argv) == 0
    (path,) = tmp_path.glob("decode-*.json")
    data = json.loads(path.read_text())
    assert data["bench"] == "decode" and data["config"]["vad"]["final_tail_ms"] == 390
    per_clip, overall = data["per_clip"], data["overall"]
    assert list(per_clip) == CLIPS.split(",")
    speech = [per_clip[c] for c in CLIPS.split(",")[:2]]
    assert all(c["finals"] >= 1 and c["wer"] < 0.3 for c in speech), speech
    assert overall["errors"] == sum(c["errors"] for c in speech)
    assert overall["per_language"] == {
        "en": {"errors": overall["errors"], "reference_units": overall["reference_words"]}
    }
    assert overall["finals"] == sum(c["finals"] for c in per_clip.values())
    assert per_clip["bird_robin_inspectorj"]["words"] == overall["nonspeech_words"] == 0
    assert {"encode", "generate"} <= set(overall["engine_ms_per_final"])
    assert overall["engine_ms_per_final"]["generate"] > 0 < overall["engine_ms_per_final"]["encode"]


def test_bench_decode_with_partials_shows_them_and_counts_empty_finals(
    speech_dir: Path, tmp_path: Path
) -> None:
    argv = [
        "bench",
        "decode",
        "--clips",
        "jfk_inaugural_1961",
        "--partials",
        "--out",
        str(tmp_path),
    ]
    argv += ["--manifest", str(speech_dir / "manifest.jsonl"), "--engine", "faster-whisper"]
    assert main(argv) == 0
    (path,) = tmp_path.glob("decode-*.json")
    data = json.loads(path.read_text())
    assert data["partials"] is True
    clip, overall = data["per_clip"]["jfk_inaugural_1961"], data["overall"]
    # About one partial per half second of its 11 s of speech, and no utterance lost.
    assert clip["partials"] >= 10
    assert clip["empty_finals"] == overall["empty_finals"] == 0
    assert clip["finals"] >= 2 and clip["wer"] < 0.3, clip
    # The share of the finals' words shown as stable first: the clip's is the total's.
    share = clip["stable_before_final_share"]
    assert share is not None and 0 <= share <= 1
    assert overall["stable_before_final_share"] == share


def test_bench_decode_counts_the_final_decodes_thrown_away(
    speech_dir: Path, tmp_path: Path
) -> None:
    """LJ001-0009 has a pause longer than `final_tail_ms` and shorter than the endpoint: an
    early final is decoded there and thrown away when the reader goes on. The fake engine's
    text does not matter here: the pauses are webrtcvad's."""
    argv = ["bench", "decode", "--clips", "ljspeech_LJ001-0009", "--partials"]
    argv += ["--manifest", str(speech_dir / "manifest.jsonl"), "--engine", "fake"]
    argv += ["--out", str(tmp_path)]
    assert main(argv) == 0
    (path,) = tmp_path.glob("decode-*.json")
    data = json.loads(path.read_text())
    clip, overall = data["per_clip"]["ljspeech_LJ001-0009"], data["overall"]
    assert clip["final_decodes"] > clip["finals"] >= 1, clip
    assert overall["final_decodes"] == clip["final_decodes"]
