"""The Hugging Face transformers peer of `captiond bench engine --peer transformers`.

Owns the plain-PyTorch alternative a user would reach for: `WhisperForConditionalGeneration`
built on the very weights the torch_graph engine measures (our CTranslate2 `model.bin` mapped
into transformers' state dict, or the same random weights of a named shape), decoding with our
rules (prompt, suppressed tokens, length limit) through its own `generate`, and the timing of its
log-mel, encoder, static-cache decode step (eager, then with the forward `torch.compile`d) and
end to end. Runs on the bench's main thread after the engines; transformers is imported only
here. The compiled timings of each batch size run in a child interpreter of their own
(`python -m captiond.bench.peer_transformers`, its main thread), so that a compile that crashes
its process becomes an error string in the report.

The decode step is timed as (t(N) - t(1)) / (N - 1) over greedy `generate` calls with
`max_new_tokens = min_new_tokens = N` (end-of-text masked until N, so no row stops early) on a
precomputed encoder output: the prefill, the cache set-up and the per-call overhead cancel out.
The static cache holds n_text_ctx (448) positions, as the torch_graph engine's does.
"""

from __future__ import annotations

import importlib.metadata
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
import transformers
from transformers.modeling_outputs import BaseModelOutput

from captiond.engines.models import model_display_name
from captiond.engines.torch_graph import resolve_device
from captiond.engines.torch_graph.bench import timed_s
from captiond.engines.torch_graph.tokens import WhisperTokens
from captiond.engines.torch_graph.weights import (
    ModelDims,
    dims_from_tensors,
    load_tensors,
    random_tensors,
)
from captiond.whisper import SAMPLE_RATE_HZ

N_FRAMES = 3000  # one 30 s window of log-mel frames
REPEATS = 3  # each decode timing is the best of this many calls (after one warm call)
CHILD_TIMEOUT_S = 1800  # one batch size's compile and compiled timings
COMPILE_NOTE = (
    'model.forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True); '
    "generate(disable_compile=True) so generate adds no compile of its own; one fresh process "
    "per batch size"
)


@dataclass(frozen=True, slots=True, kw_only=True)
class Peer:
    """A transformers Whisper on our weights, with our tokens' rules in its generation config."""

    model: transformers.WhisperForConditionalGeneration
    tokens: WhisperTokens
    device: torch.device
    dtype: torch.dtype
    weights: str  # "real" or "random"
    model_name: str


def _linear(
    state: dict[str, torch.Tensor], hf: str, tensors: Mapping[str, torch.Tensor], ct2: str
) -> None:
    state[f"{hf}.weight"] = tensors[f"{ct2}/weight"]
    state[f"{hf}.bias"] = tensors[f"{ct2}/bias"]


def _norm(
    state: dict[str, torch.Tensor], hf: str, tensors: Mapping[str, torch.Tensor], ct2: str
) -> None:
    state[f"{hf}.weight"] = tensors[f"{ct2}/gamma"]
    state[f"{hf}.bias"] = tensors[f"{ct2}/beta"]


def _fused_qkv(
    state: dict[str, torch.Tensor], hf: str, tensors: Mapping[str, torch.Tensor], ct2: str
) -> None:
    """CTranslate2 fuses q/k/v into one [3D, D] projection; transformers keeps three (k without
    a bias: CTranslate2's converter stores zeros there)."""
    q_w, k_w, v_w = tensors[f"{ct2}/weight"].chunk(3)
    q_b, _, v_b = tensors[f"{ct2}/bias"].chunk(3)
    state |= {
        f"{hf}.q_proj.weight": q_w,
        f"{hf}.q_proj.bias": q_b,
        f"{hf}.k_proj.weight": k_w,
        f"{hf}.v_proj.weight": v_w,
        f"{hf}.v_proj.bias": v_b,
    }


def hf_state_dict(tensors: Mapping[str, torch.Tensor], dims: ModelDims) -> dict[str, torch.Tensor]:
    """transformers' parameter names -> our CTranslate2-named tensors (views, nothing copied).

    The CTranslate2 names are the ones `engines/torch_graph/model.py` (`_ct2_names`) binds.
    """
    state: dict[str, torch.Tensor] = {}
    enc, dec = "model.encoder", "model.decoder"
    for conv in ("conv1", "conv2"):
        _linear(state, f"{enc}.{conv}", tensors, f"encoder/{conv}")
    state[f"{enc}.embed_positions.weight"] = tensors["encoder/position_encodings/encodings"]
    _norm(state, f"{enc}.layer_norm", tensors, "encoder/layer_norm")
    embedding = tensors["decoder/embeddings/weight"]
    # Whisper ties the output projection to the token embedding: one tensor for both names.
    state[f"{dec}.embed_tokens.weight"] = embedding
    state["proj_out.weight"] = embedding
    state[f"{dec}.embed_positions.weight"] = tensors["decoder/position_encodings/encodings"]
    _norm(state, f"{dec}.layer_norm", tensors, "decoder/layer_norm")
    for side, prefix, n_layer in (
        ("encoder", enc, dims.n_audio_layer),
        ("decoder", dec, dims.n_text_layer),
    ):
        for i in range(n_layer):
            hf, ct2 = f"{prefix}.layers.{i}", f"{side}/layer_{i}"
            _norm(state, f"{hf}.self_attn_layer_norm", tensors, f"{ct2}/self_attention/layer_norm")
            _fused_qkv(state, f"{hf}.self_attn", tensors, f"{ct2}/self_attention/linear_0")
            _linear(state, f"{hf}.self_attn.out_proj", tensors, f"{ct2}/self_attention/linear_1")
            _norm(state, f"{hf}.final_layer_norm", tensors, f"{ct2}/ffn/layer_norm")
            _linear(state, f"{hf}.fc1", tensors, f"{ct2}/ffn/linear_0")
            _linear(state, f"{hf}.fc2", tensors, f"{ct2}/ffn/linear_1")
            if side == "decoder":
                cross = f"{hf}.encoder_attn"
                _norm(state, f"{cross}_layer_norm", tensors, f"{ct2}/attention/layer_norm")
                _linear(state, f"{cross}.q_proj", tensors, f"{ct2}/attention/linear_0")
                # CTranslate2 fuses the cross-attention k/v ([2D, D_audio]); k has no bias.
                k_w, v_w = tensors[f"{ct2}/attention/linear_1/weight"].chunk(2)
                _, v_b = tensors[f"{ct2}/attention/linear_1/bias"].chunk(2)
                state |= {
                    f"{cross}.k_proj.weight": k_w,
                    f"{cross}.v_proj.weight": v_w,
                    f"{cross}.v_proj.bias": v_b,
                }
                _linear(state, f"{cross}.out_proj", tensors, f"{ct2}/attention/linear_2")
    return state


def whisper_config(dims: ModelDims, tokens: WhisperTokens) -> transformers.WhisperConfig:
    """A `WhisperConfig` of our dimensions and special tokens."""
    if dims.n_audio_state != dims.n_text_state:
        raise ValueError("transformers' Whisper has one width for encoder and decoder")
    special = tokens.special
    return transformers.WhisperConfig(
        vocab_size=dims.n_vocab,
        num_mel_bins=dims.n_mels,
        d_model=dims.n_audio_state,
        encoder_layers=dims.n_audio_layer,
        encoder_attention_heads=dims.n_audio_head,
        encoder_ffn_dim=4 * dims.n_audio_state,
        decoder_layers=dims.n_text_layer,
        decoder_attention_heads=dims.n_text_head,
        decoder_ffn_dim=4 * dims.n_text_state,
        max_source_positions=dims.n_audio_ctx,
        max_target_positions=dims.n_text_ctx,
        decoder_start_token_id=special.sot,
        bos_token_id=special.eot,
        eos_token_id=special.eot,
        pad_token_id=special.eot,
        suppress_tokens=None,
        begin_suppress_tokens=None,
    )


def _generation_config(
    model: transformers.WhisperForConditionalGeneration, tokens: WhisperTokens, n_vocab: int
) -> None:
    """Our decoding rules on the model's generation config: the torch_graph engine's prompt
    (<|en|> and <|transcribe|> on multilingual models), suppressed tokens, and its length limit."""
    special = tokens.special
    config = model.generation_config
    config.decoder_start_token_id = special.sot
    config.eos_token_id = special.eot
    config.pad_token_id = special.eot
    config.bos_token_id = special.eot
    config.suppress_tokens = [t for t in tokens.suppress_ids if t < n_vocab]
    config.begin_suppress_tokens = [t for t in tokens.suppress_ids_begin if t < n_vocab]
    config.max_length = model.config.max_target_positions
    config.max_new_tokens = tokens.prompt("", "en" if tokens.multilingual else None).max_new_tokens
    config.do_sample = False
    config.num_beams = 1
    # Whisper's own entries (a released checkpoint's generation_config.json carries them).
    whisper: dict[str, object] = {
        "no_timestamps_token_id": special.no_timestamps,
        "return_timestamps": False,
        "forced_decoder_ids": None,
        "is_multilingual": tokens.multilingual,
    }
    if tokens.multilingual:
        whisper |= {
            "lang_to_id": {"<|en|>": tokens.language_token("en")},
            "task_to_id": {"transcribe": special.transcribe, "translate": special.translate},
            "language": "en",
            "task": "transcribe",
        }
    for key, value in whisper.items():
        setattr(config, key, value)


def build(model_path: Path, device_name: str, random_shape: str | None) -> Peer:
    """transformers' Whisper on `model_path`'s weights (or random ones of `random_shape`), FP16
    on CUDA and FP32 on the CPU, as the torch_graph engine runs; the tokenizer is `model_path`'s."""
    device = resolve_device(device_name)
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    if random_shape is None:
        tensors = load_tensors(model_path / "model.bin", device, dtype)
        weights, name = "real", model_display_name(model_path)
    else:
        tensors = random_tensors(random_shape, device, dtype)
        weights, name = "random", f"random-{random_shape}"
    dims = dims_from_tensors(tensors)
    tokens = WhisperTokens(model_path, dims.n_vocab)
    config = whisper_config(dims, tokens)
    with torch.device("meta"):
        model = transformers.WhisperForConditionalGeneration(config)
    model.load_state_dict(hf_state_dict(tensors, dims), strict=True, assign=True)
    model.requires_grad_(False)
    model.train(False)
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise RuntimeError(f"transformers' Whisper has tensors no weight maps to: {left}")
    _generation_config(model, tokens, dims.n_vocab)
    return Peer(
        model=model, tokens=tokens, device=device, dtype=dtype, weights=weights, model_name=name
    )


def _generate_kwargs(peer: Peer) -> dict[str, Any]:
    return {
        "cache_implementation": "static",
        # The torch_graph engine's cache holds n_text_ctx positions: the same here, every call.
        "max_cache_len": peer.model.config.max_target_positions,
        "disable_compile": True,
    }


def generated_tokens(peer: Peer, sequences: torch.Tensor) -> list[tuple[int, ...]]:
    """Each row of `generate`'s output without the prompt, <|endoftext|> and padding."""
    eot = peer.tokens.special.eot
    prompt = peer.tokens.prompt("", "en" if peer.tokens.multilingual else None).tokens
    rows: list[tuple[int, ...]] = []
    for row in sequences.tolist():
        if tuple(row[: len(prompt)]) == prompt:
            row = row[len(prompt) :]
        rows.append(tuple(row[: row.index(eot)] if eot in row else row))
    return rows


def transcribe(peer: Peer, mel: torch.Tensor) -> list[tuple[int, ...]]:
    """Greedy `generate` on a [B, n_mels, 3000] log-mel batch: the tokens of each row."""
    features = mel.to(device=peer.device, dtype=peer.dtype)
    sequences = peer.model.generate(features, **_generate_kwargs(peer))
    return generated_tokens(peer, sequences)


def _best_s(device: torch.device, work: Callable[[], object]) -> float:
    work()  # warm
    return min(timed_s(device, work) for _ in range(REPEATS))


def _decode_us_per_step(peer: Peer, encoded: torch.Tensor, steps: int) -> float:
    """(t(steps) - t(1)) / (steps - 1): one decode step, prefill and call overhead cancelled."""
    outputs = BaseModelOutput(last_hidden_state=encoded)

    def generate(n: int) -> Callable[[], object]:
        return lambda: peer.model.generate(
            encoder_outputs=outputs,
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            **_generate_kwargs(peer),
        )

    # The longest call first: the cache and any compiled graph are set up for it once.
    long_s = _best_s(peer.device, generate(steps))
    short_s = _best_s(peer.device, generate(1))
    return (long_s - short_s) / (steps - 1) * 1e6


def _features(
    extractor: transformers.WhisperFeatureExtractor,
    peer: Peer,
    audios: list[npt.NDArray[np.float32]],
) -> torch.Tensor:
    """transformers' own log-mel (on the device, as a user would ask for it), 30 s windows."""
    batch = extractor(
        audios,
        sampling_rate=SAMPLE_RATE_HZ,
        return_tensors="pt",
        device=peer.device.type,
    )
    features: torch.Tensor = batch.input_features
    return features[:, :, :N_FRAMES].to(device=peer.device, dtype=peer.dtype)


def _end_to_end(
    peer: Peer,
    extractor: transformers.WhisperFeatureExtractor,
    audios: list[npt.NDArray[np.float32]],
    suffix: str,
) -> dict[str, Any]:
    """Log-mel and greedy `generate` to the end of text (or the length limit), timed once.

    Warmed by the stage timings before it: the same batch size, log-mel, encoder, cache shape
    and (compiled) graphs; a warm call of its own would double the longest part of the run.
    """
    results: list[tuple[int, ...]] = []
    wall_s = timed_s(
        peer.device,
        lambda: results.extend(transcribe(peer, _features(extractor, peer, audios))),
    )
    audio_s = sum(a.size for a in audios) / SAMPLE_RATE_HZ
    row: dict[str, Any] = {
        f"end_to_end{suffix}_s": wall_s,
        f"audio_s_per_wall_s{suffix}": audio_s / wall_s,
    }
    if not suffix:
        row["tokens_generated"] = sum(len(r) for r in results)
    return row


def _measure_batch(
    peer: Peer,
    extractor: transformers.WhisperFeatureExtractor,
    batch: int,
    steps: int,
    audio: npt.NDArray[np.float32],
) -> dict[str, Any]:
    audios = [audio] * batch
    mel_s = _best_s(peer.device, lambda: _features(extractor, peer, audios))
    mel = _features(extractor, peer, audios)
    encoder = peer.model.model.encoder
    with torch.no_grad():
        encoder_s = _best_s(peer.device, lambda: encoder(mel))
        encoded = encoder(mel).last_hidden_state
    eager_us = _decode_us_per_step(peer, encoded, steps)
    row: dict[str, Any] = {
        "mel_ms_per_window": mel_s / batch * 1e3,
        "encoder_ms_per_window": encoder_s / batch * 1e3,
        "decode_eager_us_per_step": eager_us,
        "decode_eager_us_per_token": eager_us / batch,
    }
    row |= _end_to_end(peer, extractor, audios, "")
    return row


def _compiled_batch(
    peer: Peer,
    extractor: transformers.WhisperFeatureExtractor,
    batch: int,
    steps: int,
    audio: npt.NDArray[np.float32],
) -> dict[str, Any]:
    """The decode step and end to end with the forward compiled (HF's static-cache recipe).

    Runs in a process of its own (`_compiled_in_child`): one compile per process and batch size.
    """
    model = peer.model
    model.forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
    try:
        audios = [audio] * batch
        with torch.no_grad():
            encoded = model.model.encoder(_features(extractor, peer, audios)).last_hidden_state
        compile_s = timed_s(
            peer.device,
            lambda: model.generate(
                encoder_outputs=BaseModelOutput(last_hidden_state=encoded),
                max_new_tokens=steps,
                min_new_tokens=steps,
                **_generate_kwargs(peer),
            ),
        )
        compiled_us = _decode_us_per_step(peer, encoded, steps)
        row: dict[str, Any] = {
            "compile_s": compile_s,
            "decode_compiled_us_per_step": compiled_us,
            "decode_compiled_us_per_token": compiled_us / batch,
        }
        return row | _end_to_end(peer, extractor, audios, "_compiled")
    except Exception as exc:  # a compile failure is a result, not a crash
        where = traceback.extract_tb(exc.__traceback__)[-1]
        error = f"{type(exc).__name__}: {exc} (at {where.filename}:{where.lineno})"
        return {"decode_compiled_error": error[-2000:]}


def _compiled_in_child(
    model_path: Path,
    device: str,
    random_shape: str | None,
    batch: int,
    steps: int,
    audio: npt.NDArray[np.float32],
) -> dict[str, Any]:
    """`_compiled_batch` in a fresh interpreter: torch.compile's CUDA graphs and caches stay out
    of the bench's process, and a compile that kills its process (a segfault in a cudagraph
    recording has been seen) is recorded as an error instead of ending the bench."""
    with tempfile.TemporaryDirectory(prefix="captiond-peer-") as folder:
        audio_path, row_path = Path(folder) / "audio.npy", Path(folder) / "row.json"
        np.save(audio_path, audio)
        argv = [str(model_path), device, random_shape or "", str(batch), str(steps)]
        command = [sys.executable, "-m", __name__, *argv, str(audio_path), str(row_path)]
        # The child finds captiond where this process found it.
        env = os.environ | {"PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        try:
            done = subprocess.run(
                command, env=env, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S
            )
        except subprocess.TimeoutExpired:
            return {"decode_compiled_error": f"the compiled run took over {CHILD_TIMEOUT_S} s"}
        if row_path.is_file():
            row: dict[str, Any] = json.loads(row_path.read_text(encoding="utf-8"))
            return row
        code = done.returncode
        how = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit status {code}"
        # The last lines of its stderr, less faulthandler's list of extension modules.
        lines = [ln for ln in done.stderr.splitlines() if not ln.startswith("Extension modules")]
        tail = "\n".join(lines)[-1500:]
        return {"decode_compiled_error": f"the compiled run died ({how}): {tail}"}


def _child_main(argv: Sequence[str]) -> None:
    model_path, device, random_shape, batch, steps, audio_path, row_path = argv
    transformers.logging.set_verbosity(logging.ERROR)
    peer = build(Path(model_path), device, random_shape or None)
    n_mels = peer.model.config.num_mel_bins
    extractor = transformers.WhisperFeatureExtractor(feature_size=n_mels)  # type: ignore[no-untyped-call]
    audio = np.load(audio_path)
    row = _compiled_batch(peer, extractor, int(batch), int(steps), audio)
    Path(row_path).write_text(json.dumps(row), encoding="utf-8")


def measure(
    model_path: Path,
    device: str,
    batches: Sequence[int],
    steps: int,
    audio: npt.NDArray[np.float32],
    random_shape: str | None,
    *,
    compile_forward: bool | None = None,
) -> dict[str, Any]:
    """Per batch size: ms per log-mel and encoder window, µs per decode step and token (eager and
    compiled), end to end. `compile_forward` None compiles on CUDA only."""
    if steps < 2:
        raise ValueError("the decode step is timed as a difference: steps must be at least 2")
    # transformers warns on every Whisper `generate` that passes lengths (its own defaults
    # clash with them); the figures are what matter here.
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity(logging.ERROR)
    try:
        return _measure(model_path, device, batches, steps, audio, random_shape, compile_forward)
    finally:
        transformers.logging.set_verbosity(verbosity)


def _measure(
    model_path: Path,
    device: str,
    batches: Sequence[int],
    steps: int,
    audio: npt.NDArray[np.float32],
    random_shape: str | None,
    compile_forward: bool | None,
) -> dict[str, Any]:
    peer = build(model_path, device, random_shape)
    on_cuda = peer.device.type == "cuda"
    compile_forward = on_cuda if compile_forward is None else compile_forward
    if on_cuda:
        torch.cuda.reset_peak_memory_stats()
    n_mels = peer.model.config.num_mel_bins
    extractor = transformers.WhisperFeatureExtractor(feature_size=n_mels)  # type: ignore[no-untyped-call]
    per_batch: dict[str, dict[str, Any]] = {}
    for batch in batches:
        row = _measure_batch(peer, extractor, batch, steps, audio)
        if compile_forward:
            row |= _compiled_in_child(model_path, device, random_shape, batch, steps, audio)
        per_batch[str(batch)] = row
    summary: dict[str, Any] = {
        "version": importlib.metadata.version("transformers"),
        "model": peer.model_name,
        "weights": peer.weights,
        "device": str(peer.device),
        "dtype": str(peer.dtype).removeprefix("torch."),
        "attn_implementation": peer.model.config._attn_implementation,
        "cache": "static",
        "compiled": COMPILE_NOTE if compile_forward else f"not tried on {peer.device.type}",
        "batches": per_batch,
        "note": "decode µs per step = (t(N) - t(1)) / (N - 1) over generate(max_new_tokens = "
        f"min_new_tokens = N) on a precomputed encoder output, best of {REPEATS}; log-mel is "
        "transformers' WhisperFeatureExtractor",
    }
    if on_cuda:
        summary["peak_device_memory_bytes"] = torch.cuda.max_memory_allocated()
    return summary


if __name__ == "__main__":
    _child_main(sys.argv[1:])
