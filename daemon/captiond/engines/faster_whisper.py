"""The faster-whisper (CTranslate2) engine: the CPU default and the accuracy reference.

Constructed on the main thread, then used only on the engine thread. A batch of requests from
many sessions becomes one `encode` of stacked 30 s windows and one `generate` per beam size,
with one prompt per stream.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from captiond.config import EngineConfig
from captiond.engines import EngineRequest, EngineResult
from captiond.errors import ConfigError
from captiond.models import model_display_name

N_FRAMES = 3000  # one 30 s Whisper window of 10 ms mel frames
MAX_LENGTH = 448  # Whisper's text context: prompt plus generated tokens


def compression_ratio(text: str) -> float:
    data = text.encode("utf-8")
    return len(data) / len(zlib.compress(data)) if data else 0.0


class FasterWhisperEngine:
    """Batched greedy/beam decoding through CTranslate2, without timestamps."""

    def __init__(self, model_path: Path, config: EngineConfig) -> None:
        from faster_whisper import WhisperModel

        try:
            self._model = WhisperModel(
                str(model_path),
                device=config.device,
                compute_type=config.compute_type,
                cpu_threads=config.cpu_threads,
                local_files_only=True,
            )
        except (RuntimeError, ValueError) as exc:
            raise ConfigError(f"faster-whisper cannot load {str(model_path)!r}: {exc}") from exc
        self._model_name = model_display_name(model_path)
        self._tokenizers: dict[str | None, Any] = {}

    @property
    def name(self) -> str:
        return "faster-whisper"

    @property
    def model_name(self) -> str:
        return self._model_name

    def warmup(self) -> None:
        silence = np.zeros(16_000, dtype=np.float32)
        from captiond.engines import DecodeKind

        self.transcribe_batch([EngineRequest(audio=silence, kind=DecodeKind.PARTIAL)])

    def close(self) -> None:
        del self._model

    def features(self, audio: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
        """faster-whisper's recipe: 160 samples of padding, last frame dropped, 3000 frames."""
        mel: npt.NDArray[np.float32] = self._model.feature_extractor(audio)[..., :-1]
        mel = mel[:, :N_FRAMES]
        return np.pad(mel, ((0, 0), (0, N_FRAMES - mel.shape[-1]))).astype(np.float32)

    def _tokenizer(self, language: str | None) -> Any:
        from faster_whisper.tokenizer import Tokenizer

        multilingual = self._model.model.is_multilingual
        key = (language or "en") if multilingual else None
        if key not in self._tokenizers:
            self._tokenizers[key] = Tokenizer(
                self._model.hf_tokenizer, multilingual, task="transcribe", language=key
            )
        return self._tokenizers[key]

    def _prompt(self, tokenizer: Any, text: str) -> list[int]:
        previous = tokenizer.encode(" " + text.strip()) if text.strip() else []
        prompt: list[int] = self._model.get_prompt(tokenizer, previous, without_timestamps=True)
        return prompt

    def transcribe_batch(self, requests: Sequence[EngineRequest]) -> list[EngineResult]:
        from faster_whisper.transcribe import get_suppressed_tokens

        if not requests:
            return []
        encoded = self._model.encode(np.stack([self.features(r.audio) for r in requests]))
        tokenizers = [self._tokenizer(r.language) for r in requests]
        prompts = [self._prompt(t, r.prompt) for t, r in zip(tokenizers, requests, strict=True)]
        results: list[EngineResult | None] = [None] * len(requests)
        # CTranslate2 needs <|startoftranscript|> at one position in a generate batch, so
        # requests are grouped by prompt length (and beam size); the encoder batch is shared.
        groups: dict[tuple[int, int], list[int]] = {}
        for i, r in enumerate(requests):
            groups.setdefault((r.beam_size, len(prompts[i])), []).append(i)
        for (beam, _), idx in sorted(groups.items()):
            generated = self._model.model.generate(
                encoded if len(idx) == len(requests) else self._select(encoded, idx),
                [prompts[i] for i in idx],
                beam_size=beam,
                max_length=MAX_LENGTH,
                return_scores=True,
                return_no_speech_prob=True,
                suppress_blank=True,
                suppress_tokens=get_suppressed_tokens(tokenizers[idx[0]], [-1]),
            )
            for i, out in zip(idx, generated, strict=True):
                results[i] = self._result(tokenizers[i], out)
        return [r for r in results if r is not None]

    @staticmethod
    def _select(encoded: Any, idx: list[int]) -> Any:
        import ctranslate2

        return ctranslate2.StorageView.from_array(np.asarray(encoded)[idx])

    @staticmethod
    def _result(tokenizer: Any, out: Any) -> EngineResult:
        tokens = list(out.sequences_ids[0])
        # As faster-whisper: the score is the length-normalised cumulative log-prob (penalty 1).
        avg_logprob = out.scores[0] * len(tokens) / (len(tokens) + 1)
        text = tokenizer.decode(tokens).strip()
        return EngineResult(
            text=text,
            tokens=tuple(tokens),
            avg_logprob=float(avg_logprob),
            no_speech_prob=float(out.no_speech_prob),
            compression_ratio=compression_ratio(text),
        )
