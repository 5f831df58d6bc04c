"""Choosing and loading an engine: `ENGINE_NAMES`, `resolve_engine_config`, `load_engine`.

The seam itself (requests, results, the Engine protocol) is `engines.base`; the Whisper rules
both engines share are `engines.rules`. `load_engine` is called once at start-up, by the CLI or
a worker, before the engine thread (decoding.scheduler) takes ownership of the engine.
Engine modules are imported lazily so that `import captiond` never imports torch or ctranslate2.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from captiond.engines.base import Embedder, Engine, TurnModel
from captiond.engines.models import TURN_MODEL_HINT, diarization_available, turn_model_available
from captiond.errors import ConfigError

if TYPE_CHECKING:
    from captiond.config import Config, EngineConfig

ENGINE_NAMES = ("auto", "faster-whisper", "torch_graph", "fake")


def cuda_available() -> bool:
    """True when torch is installed and sees a CUDA device (False without torch)."""
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def resolve_engine_config(config: EngineConfig) -> EngineConfig:
    """Replace every `auto` with a concrete choice.

    Engine `auto` picks torch_graph on CUDA when torch sees a GPU, else faster-whisper on the
    CPU; device `auto` is cuda when torch sees a GPU; compute type `auto` is float16 on cuda,
    int8 for faster-whisper on the CPU and float32 for torch_graph on the CPU.
    """
    import dataclasses

    device = config.device
    if device == "auto":
        device = "cuda" if cuda_available() else "cpu"
    name = config.name
    if name == "auto":
        name = "torch_graph" if device == "cuda" else "faster-whisper"
    compute_type = config.compute_type
    if compute_type == "auto":
        if device == "cuda":
            compute_type = "float16"
        else:
            compute_type = "int8" if name == "faster-whisper" else "float32"
    return dataclasses.replace(config, name=name, device=device, compute_type=compute_type)


def load_engine(config: EngineConfig) -> Engine:
    """Build the engine the config names (imports its backend only now)."""
    from captiond.engines.models import resolve_model
    from captiond.errors import ConfigError

    config = resolve_engine_config(config)
    name = config.name
    if name == "fake":
        from captiond.engines.fake import FakeEngine

        return FakeEngine()
    model_path = resolve_model(config.model, allow_download=config.allow_download)
    engine: Engine
    if name == "faster-whisper":
        from captiond.engines.faster_whisper import FasterWhisperEngine

        engine = FasterWhisperEngine(model_path, config)
    elif name == "torch_graph":
        from captiond.engines.torch_graph import TorchGraphEngine

        engine = TorchGraphEngine(model_path, config)
    else:
        raise ConfigError(f"unknown engine {name!r}; choose one of {', '.join(ENGINE_NAMES)}")
    return engine


def speaker_embedder(
    config: EngineConfig, *, beside_decodes: bool = False
) -> Callable[[], Embedder] | None:
    """How the engine thread loads the speaker-embedding model, on the engine's device, when a
    diarized stream first needs it (loading it costs torch's import and 30 MB that most
    daemons never use); None when diarization cannot run here (engines.models).
    `beside_decodes`: on the CPU it runs on the scheduler's speaker thread, beside the decodes,
    on half the cores (engines/speakers.py); otherwise on torch's own count of threads."""
    if not diarization_available():
        return None
    device = resolve_engine_config(config).device

    def load() -> Embedder:
        from captiond.engines.speakers import SpeakerEmbedder

        threads = max(1, (os.cpu_count() or 2) // 2) if beside_decodes else 0
        return SpeakerEmbedder(device, threads=threads)

    return load


def turn_model(config: Config) -> Callable[[], TurnModel] | None:
    """How the engine thread loads the end-of-turn model (engines/turn.py) when a stream whose
    turns end by it first asks; None when it is not installed. A daemon whose turns end by it
    (`[vad] end_of_turn = "model"`) cannot start without it."""
    if not turn_model_available():
        if config.vad.end_of_turn == "model":
            raise ConfigError(TURN_MODEL_HINT)
        return None
    threads = resolve_engine_config(config.engine).cpu_threads

    def load() -> TurnModel:
        from captiond.engines.turn import SmartTurn

        return SmartTurn(threads)

    return load


def scheduler_models(config: Config) -> dict[str, Any]:
    """The models the engine thread runs beside the engine (`InferenceScheduler`'s keywords), as
    `captiond serve` and the benches' daemons load them: the ones every stream needs before
    the daemon serves, the others when a stream first asks."""
    return {
        "embedder": speaker_embedder(config.engine, beside_decodes=True),
        "load_embedder_at_start": config.stream.diarize,
        "turn_model": turn_model(config),
        "load_turn_model_at_start": config.vad.end_of_turn == "model",
    }
