"""The engine seam: request/result values, the Engine protocol and `load_engine`.

Everything here is called on the engine thread only (see scheduler.py), except `load_engine`,
which the CLI calls once at start-up before the engine thread takes ownership of the engine.
Engine modules are imported lazily so that `import captiond` never imports torch or ctranslate2.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

    from captiond.config import EngineConfig

ENGINE_NAMES = ("auto", "faster-whisper", "torch_graph", "fake")


class DecodeKind(enum.Enum):
    """Why a decode was asked for: partials are revisable, finals are committed."""

    PARTIAL = "partial"
    FINAL = "final"


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineRequest:
    """One Whisper window to decode: 16 kHz mono float32 audio, at most 30 s."""

    audio: npt.NDArray[np.float32]
    kind: DecodeKind
    language: str | None = None
    prompt: str = ""
    beam_size: int = 1


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineResult:
    """The decode of one request; scores follow Whisper's definitions."""

    text: str
    tokens: tuple[int, ...] = ()
    avg_logprob: float = 0.0
    no_speech_prob: float = 0.0
    compression_ratio: float = 1.0


class Engine(Protocol):
    """A loaded model that decodes batches of requests, synchronously, on the engine thread."""

    @property
    def name(self) -> str: ...

    @property
    def model_name(self) -> str: ...

    @property
    def max_batch(self) -> int:
        """The most requests worth decoding in one call (the scheduler's default limit)."""
        ...

    def warmup(self) -> None:
        """Run one throw-away batch so the first real request is not slow (graph capture etc.)."""

    def transcribe_batch(self, requests: Sequence[EngineRequest]) -> list[EngineResult]:
        """Decode every request; the result list has the same order and length."""
        ...

    def close(self) -> None:
        """Release the model (device memory, threads)."""


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
    from captiond.errors import ConfigError
    from captiond.models import resolve_model

    config = resolve_engine_config(config)
    name = config.name
    if name == "fake":
        from captiond.engines.fake import FakeEngine

        return FakeEngine()
    model_path = resolve_model(config.model)
    if name == "faster-whisper":
        from captiond.engines.faster_whisper import FasterWhisperEngine

        return FasterWhisperEngine(model_path, config)
    if name == "torch_graph":
        from captiond.engines.torch_graph import TorchGraphEngine

        return TorchGraphEngine(model_path, config)
    raise ConfigError(f"unknown engine {name!r}; choose one of {', '.join(ENGINE_NAMES)}")
