"""Speed measurements of the torch_graph engine for `captiond bench engine` (torch stays in here).

Owns the timing of each stage at each batch size: log-mel (of whole windows, and of streams' windows
whose audio the device mostly holds), encoder (+ cross-attention K/V), the decode step eager and
graph-replayed, end-to-end transcription, and peak memory. Runs on the bench's main thread, which
owns the engine for the whole run.
"""

from __future__ import annotations

import resource
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
from torch.nn.attention import SDPBackend

from captiond.config import EngineConfig
from captiond.engines.base import DecodeKind, EngineRequest
from captiond.engines.torch_graph import TorchGraphEngine
from captiond.engines.torch_graph.cuda_graph import bucket_for
from captiond.engines.torch_graph.model import inference, step_attention
from captiond.whisper import SAMPLE_RATE_HZ


def device_summary() -> dict[str, Any]:
    """torch's version and the GPU it sees (None without one)."""
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {"torch": torch.__version__, "gpu": gpu, "cuda": torch.version.cuda}


def timed_s(device: torch.device, work: Callable[[], object]) -> float:
    """Wall time of `work`, the device synchronised before and after."""
    if device.type == "cuda":
        torch.cuda.synchronize()
    started_s = time.perf_counter()
    work()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - started_s


def _step_us(engine: TorchGraphEngine, bucket: int, steps: int, graphed: bool) -> float:
    run = engine.graphs.run if graphed else engine.graphs.step

    def loop() -> None:
        for _ in range(steps):
            run(bucket)

    with inference():
        loop()  # warm: first calls select kernels
        return timed_s(engine.device, loop) / steps * 1e6


def _measure_batch(
    engine: TorchGraphEngine,
    batch: int,
    steps: int,
    audio: npt.NDArray[np.float32],
    beside: Callable[[Callable[[], float]], dict[str, float]] | None,
) -> dict[str, Any]:
    audios = [audio] * batch
    requests = [EngineRequest(audio=audio, kind=DecodeKind.FINAL)] * batch
    bucket = bucket_for(batch, engine.graphs.buckets)
    with inference():
        mel_s = timed_s(engine.device, lambda: engine.mel(audios))
        mel = engine.mel(audios).to(engine.dtype)
        encoder_s = timed_s(engine.device, lambda: engine.decoder.encode(mel))
        engine.decoder.prefill([engine.tokens.prompt("", None)] * batch, bucket)
    eager_us = _step_us(engine, bucket, steps, graphed=False)
    row: dict[str, Any] = {
        "bucket": bucket,
        "mel_ms_per_window": mel_s / batch * 1e3,
        "stream_mel_ms_per_window": _stream_mel_s(engine, batch, audio) / batch * 1e3,
        "encoder_ms_per_window": encoder_s / batch * 1e3,
        "decode_eager_us_per_step": eager_us,
        "decode_eager_us_per_token": eager_us / batch,
    }
    if engine.graphs.captured:
        graphed_us = _step_us(engine, bucket, steps, graphed=True)
        row["decode_graphed_us_per_step"] = graphed_us
        row["decode_graphed_us_per_token"] = graphed_us / batch
    results: list[Any] = []
    wall_s = timed_s(engine.device, lambda: results.extend(engine.transcribe_batch(requests)))
    row["end_to_end_s"] = wall_s
    row["tokens_generated"] = sum(len(r.tokens) for r in results)
    row["audio_s_per_wall_s"] = batch * audio.size / SAMPLE_RATE_HZ / wall_s
    if beside is not None:
        row["end_to_end_beside_python_s"] = beside(
            lambda: timed_s(engine.device, lambda: engine.transcribe_batch(requests))
        )
    return row


def _stream_mel_s(engine: TorchGraphEngine, batch: int, audio: npt.NDArray[np.float32]) -> float:
    """The log-mel of `batch` streams' windows of `audio`, each stream half a second on since
    its previous window: the device holds the rest (stream_audio.py), so only the new half
    second goes there. The second window's time, audio included."""
    hop = SAMPLE_RATE_HZ // 2

    def windows(end: int) -> list[EngineRequest]:
        return [
            EngineRequest(
                audio=audio[:end],
                kind=DecodeKind.PARTIAL,
                stream=f"bench-{batch}-{i}",
                end_sample=end,
            )
            for i in range(batch)
        ]

    with inference():
        engine.mel.log_mel(engine.audio.put(windows(len(audio) - hop)))
        return timed_s(
            engine.device, lambda: engine.mel.log_mel(engine.audio.put(windows(len(audio))))
        )


def _attention_kernels(engine: TorchGraphEngine) -> dict[str, str]:
    """The attention kernel torch picks for one 30-s window's encoder self-attention, by its
    own order and inside `inference()` (where torch_graph runs): on Hopper GPUs the first shows
    whether torch would have taken cuDNN's. `step`: the one it picks for the decode step's
    self-attention (one query per row against the masked cache) under `step_attention()`."""
    dims = engine.model.dims

    def zeros(*shape: int, dtype: torch.dtype = engine.dtype) -> torch.Tensor:
        return torch.zeros(shape, dtype=dtype, device=engine.device)

    q = zeros(1, dims.n_audio_head, dims.n_audio_ctx, dims.n_audio_state // dims.n_audio_head)
    text_head_width = dims.n_text_state // dims.n_text_head
    step_q = zeros(1, dims.n_text_head, 1, text_head_width)
    step_kv = zeros(1, dims.n_text_head, dims.n_text_ctx, text_head_width)
    step_mask = zeros(1, 1, 1, dims.n_text_ctx, dtype=torch.bool)

    def chosen(q: torch.Tensor, kv: torch.Tensor, mask: torch.Tensor | None = None) -> str:
        return SDPBackend(torch._fused_sdp_choice(q, kv, kv, attn_mask=mask)).name

    by_default = chosen(q, q)
    with inference():
        eager = chosen(q, q)
        with step_attention():
            step = chosen(step_q, step_kv, step_mask)
    return {"torch_default": by_default, "torch_graph": eager, "step": step}


def measure(
    model_path: Path,
    device: str,
    batches: Sequence[int],
    steps: int,
    audio: npt.NDArray[np.float32],
    random_shape: str | None,
    compile_step: bool = False,
    beside: Callable[[Callable[[], float]], dict[str, float]] | None = None,
) -> dict[str, Any]:
    """Per batch size: ms per encoder window, µs per decode step and token, audio s per wall s,
    and with `beside` (bench.engine.beside_python) the end-to-end seconds beside busy Python."""
    config = EngineConfig(name="torch_graph", device=device, compile_step=compile_step)
    engine = TorchGraphEngine(model_path, config, max_batch=max(batches), random_shape=random_shape)
    on_cuda = engine.device.type == "cuda"
    if on_cuda:
        torch.cuda.reset_peak_memory_stats()
    warmup_s = timed_s(engine.device, engine.warmup)
    per_batch = {str(b): _measure_batch(engine, b, steps, audio, beside) for b in batches}
    memory = (
        {"peak_device_memory_bytes": torch.cuda.max_memory_allocated()}
        if on_cuda
        else {"peak_host_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    )
    summary = {
        "model": engine.model_name,
        "device": str(engine.device),
        "dtype": str(engine.dtype).removeprefix("torch."),
        "graphs": engine.graphs.captured,
        "compiled_step": engine.graphs.compiled,
        "warmup_s": warmup_s,
        "kv_cache_bytes": engine.cache.n_bytes,
        "attention_kernel": _attention_kernels(engine),
        "batches": per_batch,
        **memory,
    }
    engine.close()
    return summary
