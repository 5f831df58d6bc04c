"""`captiond bench engine`: encoder, decode-step and end-to-end speed of the engines, as JSON.

Runs on the main thread (the bench owns the engines for the whole run). Both engines, and the
peer when asked for (`--peer transformers`: Hugging Face transformers' Whisper on the same
weights, see peer_transformers.py), are measured in the same run on the same audio and batch
sizes; torch is imported only through the torch_graph package and the peer's module.

    captiond bench engine --engine torch_graph,faster-whisper --device cuda \
        --batch 1,8,32,128 [--random-weights large-v3] [--steps N] [--peer transformers] \
        [--beside-python 0.9] --out FILE.json

`--beside-python DUTY` also times each end-to-end batch while another thread runs Python DUTY
of the time, as a busy event loop does beside the daemon's engine thread, at Python's default
switch interval and at the daemon's (scheduler.ENGINE_SWITCH_INTERVAL_S): an engine that
releases the GIL often (torch, around every operator) waits for it each time.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import platform
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

import captiond
from captiond.bench.report import count_list, cpu_model, cpu_vector_flags, package_version
from captiond.decoding.scheduler import ENGINE_SWITCH_INTERVAL_S
from captiond.engines.models import model_display_name, resolve_model
from captiond.errors import ConfigError
from captiond.sources.audiofile import AudioFileError, read_audio_16k_mono
from captiond.whisper import SAMPLE_RATE_HZ

SYNTHETIC_AUDIO_S = 10.0
ENGINES = ("torch_graph", "faster-whisper")
PEERS = ("transformers",)
PYTHON_DEFAULT_SWITCH_INTERVAL_S = 0.005
_LOAD_PERIOD_S = 0.010

# Times a timed call (seconds) beside busy Python: seconds per switch interval in ms.
Beside = Callable[[Callable[[], float]], dict[str, float]]


def add_engine_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("engine", help="engine speed: encoder, decode step, end to end (JSON)")
    p.add_argument("--engine", default=",".join(ENGINES), help="comma list of engines")
    p.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: cuda if seen")
    p.add_argument(
        "--batch",
        type=count_list,
        default=None,
        help="comma list; default 1,8,32,128 (cuda), 1,2 (cpu)",
    )
    p.add_argument("--steps", type=int, default=None, help="decode steps timed (128 cuda, 16 cpu)")
    p.add_argument("--random-weights", default=None, metavar="SHAPE", help="tiny ... large-v3")
    p.add_argument(
        "--model",
        default=None,
        help="model name, Hugging Face repo id or folder (default: bundled tiny.en)",
    )
    p.add_argument(
        "--download",
        action="store_true",
        help="download the model from the Hugging Face Hub if it is not cached",
    )
    p.add_argument("--audio", type=Path, default=None, help="16 kHz mono 16-bit WAV (≤ 30 s)")
    p.add_argument(
        "--peer",
        choices=PEERS,
        default=None,
        help="also measure a peer on the same weights, audio and batches (transformers: "
        "Hugging Face's WhisperForConditionalGeneration, static cache, eager and compiled)",
    )
    p.add_argument(
        "--compile-step",
        action="store_true",
        help="torch_graph: torch.compile each bucket's decode step before capture "
        "([engine] compile_step)",
    )
    p.add_argument(
        "--beside-python",
        type=float,
        default=None,
        metavar="DUTY",
        help="also time end to end while another thread runs Python this share (0-1) of the "
        "time, at switch intervals of 5 ms (Python's default) and the daemon's",
    )
    p.add_argument("--out", type=Path, required=True, help="JSON file to write")
    p.set_defaults(func=_bench_engine)


def _cuda_seen() -> bool:
    try:
        from captiond.engines.torch_graph.bench import device_summary
    except ImportError:
        return False
    return device_summary()["gpu"] is not None


def _load_audio(path: Path | None) -> tuple[npt.NDArray[np.float32], str]:
    if path is None:
        # Deterministic speech-band noise under a syllable-rate envelope: no file needed.
        rng = np.random.default_rng(0)
        t_s = np.arange(int(SYNTHETIC_AUDIO_S * SAMPLE_RATE_HZ)) / SAMPLE_RATE_HZ
        envelope = 0.5 + 0.5 * np.sin(2 * np.pi * 4.0 * t_s)
        tones = sum(np.sin(2 * np.pi * f_hz * t_s) for f_hz in (220.0, 440.0, 1200.0))
        audio = (0.05 * envelope * (tones + rng.standard_normal(t_s.size))).astype(np.float32)
        return audio, f"synthetic {SYNTHETIC_AUDIO_S:g} s"
    try:
        return read_audio_16k_mono(path)[: 30 * SAMPLE_RATE_HZ], str(path)
    except (AudioFileError, OSError) as exc:
        raise ConfigError(f"--audio: cannot read {str(path)!r}: {exc}") from None


def _timed_s(work: Any) -> float:
    started_s = time.perf_counter()
    work()
    return time.perf_counter() - started_s


@contextlib.contextmanager
def _python_load(duty: float) -> Iterator[None]:
    """A thread that runs Python (holding the GIL) `duty` of every 10 ms and sleeps the rest."""
    stop = threading.Event()

    def run() -> None:
        while not stop.is_set():
            busy_until_s = time.perf_counter() + duty * _LOAD_PERIOD_S
            while time.perf_counter() < busy_until_s:
                sum(range(200))
            stop.wait((1 - duty) * _LOAD_PERIOD_S)

    thread = threading.Thread(target=run, name="python-load", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def beside_python(duty: float) -> Beside:
    """Time a call beside `_python_load(duty)` at Python's default switch interval and at the
    daemon's engine setting; the interval in force before is restored."""

    def measure(timed: Callable[[], float]) -> dict[str, float]:
        seconds: dict[str, float] = {}
        previous_s = sys.getswitchinterval()
        try:
            for interval_s in (PYTHON_DEFAULT_SWITCH_INTERVAL_S, ENGINE_SWITCH_INTERVAL_S):
                sys.setswitchinterval(interval_s)
                with _python_load(duty):
                    seconds[f"{interval_s * 1e3:g}"] = timed()
        finally:
            sys.setswitchinterval(previous_s)
        return seconds

    return measure


def _faster_whisper_batch(
    model: Any,
    batch: int,
    steps: int,
    audio: npt.NDArray[np.float32],
    beside: Beside | None,
) -> dict[str, Any]:
    from faster_whisper.tokenizer import Tokenizer

    tokenizer = Tokenizer(model.hf_tokenizer, model.model.is_multilingual, "transcribe", "en")
    prompt = model.get_prompt(tokenizer, [], without_timestamps=True)

    def window() -> npt.NDArray[np.float32]:
        features = model.feature_extractor(audio)[:, :3000]
        padded = np.zeros((features.shape[0], 3000), dtype=np.float32)
        padded[:, : features.shape[1]] = features
        return padded

    stacked = np.repeat(window()[None], batch, axis=0)
    model.encode(stacked)  # warm
    encoder_s = _timed_s(lambda: model.encode(stacked))
    encoded = model.encode(stacked)
    # max_length 2*steps makes CTranslate2 decode min(L/2, L-1) = `steps` tokens.
    decode_s = _timed_s(
        lambda: model.model.generate(
            encoded,
            [prompt] * batch,
            beam_size=1,
            max_length=2 * steps,
            suppress_tokens=[-1, tokenizer.eot],
        )
    )
    results: list[Any] = []

    def end_to_end() -> None:
        mel = np.stack([window() for _ in range(batch)])
        results.extend(model.model.generate(model.encode(mel), [prompt] * batch))

    wall_s = _timed_s(end_to_end)
    row: dict[str, Any] = {
        "encoder_ms_per_window": encoder_s / batch * 1e3,
        "decode_us_per_step": decode_s / steps * 1e6,
        "decode_us_per_token": decode_s / steps / batch * 1e6,
        "end_to_end_s": wall_s,
        "tokens_generated": sum(len(r.sequences_ids[0]) for r in results),
        "audio_s_per_wall_s": batch * audio.size / SAMPLE_RATE_HZ / wall_s,
    }
    if beside is not None:
        row["end_to_end_beside_python_s"] = beside(lambda: _timed_s(end_to_end))
    return row


def _faster_whisper(
    model_path: Path,
    device: str,
    batches: list[int],
    steps: int,
    audio: npt.NDArray[np.float32],
    beside: Beside | None,
) -> dict[str, Any]:
    """The same stages through CTranslate2; the decode runs exactly `steps` steps (EOT masked)."""
    from faster_whisper import WhisperModel

    compute_type = "float16" if device == "cuda" else "int8"
    model = WhisperModel(str(model_path), device=device, compute_type=compute_type)
    per_batch = {str(b): _faster_whisper_batch(model, b, steps, audio, beside) for b in batches}
    return {
        "model": model_display_name(model_path),
        "device": device,
        "compute_type": compute_type,
        "batches": per_batch,
        "note": "decode timing includes the one-token prefill; peak device memory is not "
        "visible to Python for CTranslate2",
    }


def run_engine_bench(args: argparse.Namespace) -> dict[str, Any]:
    device = args.device or ("cuda" if _cuda_seen() else "cpu")
    batches: list[int] = args.batch or ([1, 8, 32, 128] if device == "cuda" else [1, 2])
    steps = args.steps or (128 if device == "cuda" else 16)
    engines = [e.strip() for e in args.engine.split(",") if e.strip()]
    unknown = sorted(set(engines) - set(ENGINES))
    if unknown:
        raise ConfigError(f"unknown engine(s) {', '.join(unknown)}; choose from {ENGINES}")
    peer: str | None = args.peer
    # Checked before anything is measured: the engines can take minutes.
    if peer == "transformers" and not all(
        importlib.util.find_spec(m) for m in ("torch", "transformers")
    ):
        raise ConfigError(
            "--peer transformers needs Hugging Face transformers and torch: "
            "pip install transformers torch (or pip install 'captiond[bench,torch]')"
        )
    if peer and steps < 2:
        raise ConfigError("--peer times the decode step as a difference: --steps must be ≥ 2")
    duty: float | None = args.beside_python
    if duty is not None and not 0 < duty < 1:
        raise ConfigError(f"--beside-python is a share of the time, above 0 and below 1: {duty}")
    beside = None if duty is None else beside_python(duty)
    # This command has no config file: --download alone asks for a download.
    model_path = resolve_model(
        args.model, allow_download=args.download, download_options="--download"
    )
    audio, audio_name = _load_audio(args.audio)
    report: dict[str, Any] = {
        "machine": {
            "platform": platform.platform(),
            "cpu": cpu_model(),
            "cpu_vector_flags": cpu_vector_flags(),
            "gpu": None,
        },
        "versions": {
            "python": sys.version.split()[0],
            "torch": package_version("torch"),
            "ctranslate2": package_version("ctranslate2"),
            "faster-whisper": package_version("faster-whisper"),
            "transformers": package_version("transformers"),
            "captiond": captiond.__version__,
        },
        "config": {
            "engines": engines,
            "device": device,
            "batches": batches,
            "steps": steps,
            "random_weights": args.random_weights,
            "peer": peer,
            "beside_python": duty,
            "model": model_display_name(model_path),
            "audio": audio_name,
            "audio_s": audio.size / SAMPLE_RATE_HZ,
        },
        "engines": {},
    }
    for name in engines:
        if name == "torch_graph":
            from captiond.engines.torch_graph import bench

            report["machine"]["gpu"] = bench.device_summary()["gpu"]
            report["engines"][name] = bench.measure(
                model_path,
                device,
                batches,
                steps,
                audio,
                args.random_weights,
                args.compile_step,
                beside,
            )
        elif args.random_weights:
            report["engines"][name] = {"skipped": "faster-whisper cannot use random weights"}
        else:
            report["engines"][name] = _faster_whisper(
                model_path, device, batches, steps, audio, beside
            )
    if peer == "transformers":
        from captiond.bench import peer_transformers

        report["peers"] = {
            peer: peer_transformers.measure(
                model_path, device, batches, steps, audio, args.random_weights
            )
        }
    return report


def _bench_engine(args: argparse.Namespace) -> int:
    report = run_engine_bench(args)
    args.out.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    print(json.dumps({**report["engines"], **report.get("peers", {})}, indent=2))
    return 0
