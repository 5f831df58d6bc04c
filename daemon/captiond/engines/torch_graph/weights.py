"""Whisper weights for the torch_graph engine: CTranslate2 `model.bin` reader, random weights.

Owns the binary format (read without importing ctranslate2), the model dimensions derived from the
weights, and random weights of a named Whisper shape for speed work. Runs on the thread that builds
the engine (the main thread at start-up) and never again.

`model.bin` layout, little-endian: u32 version, string name, u32 revision, u32 variable count; per
variable: string name, u8 rank, u32 dims, u8 dtype id, u32 byte count, raw C-order data; then u32
alias count and (alias, target) string pairs. A string is a u16 byte count (NUL included) + bytes.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt
import torch

from captiond.errors import ConfigError

_DTYPES: dict[int, np.dtype[np.generic]] = {
    0: np.dtype("<f4"),
    1: np.dtype("i1"),
    2: np.dtype("<i2"),
    3: np.dtype("<i4"),
    4: np.dtype("<f2"),
    # bfloat16 has no numpy dtype: kept as raw u16 words and widened in `_to_torch`.
    5: np.dtype("<u2"),
}
_BF16_ID = 5
HEAD_DIM = 64  # every released Whisper size uses 64-wide attention heads


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelBin:
    """The variables of a `model.bin`, as read-only views of one memory map (aliases resolved)."""

    name: str
    revision: int
    variables: Mapping[str, npt.NDArray[np.generic]]
    bfloat16_names: frozenset[str]


class _Cursor:
    """Sequential little-endian reads over the memory-mapped file; a read past its end is a
    ValueError (a file cut short), never a short read."""

    def __init__(self, data: npt.NDArray[np.uint8]) -> None:
        self.data = data
        self.offset_bytes = 0

    def unpack(self, fmt: str) -> int:
        (value,) = struct.unpack("<" + fmt, self.take(struct.calcsize("<" + fmt)).tobytes())
        return int(value)

    def string(self) -> str:
        length = self.unpack("H")
        return bytes(self.take(length)).rstrip(b"\0").decode("utf-8")

    def take(self, n_bytes: int) -> npt.NDArray[np.uint8]:
        end_bytes = self.offset_bytes + n_bytes
        if end_bytes > self.data.size:
            raise ValueError(
                f"cut short: it ends at byte {self.data.size}, inside a record that runs to "
                f"byte {end_bytes}"
            )
        chunk = self.data[self.offset_bytes : end_bytes]
        self.offset_bytes = end_bytes
        return chunk


def read_model_bin(path: Path) -> ModelBin:
    """Map `path` once and return views of every variable; nothing is copied here. A file that
    is not a whole model.bin (an interrupted copy) is a ConfigError in one line, as
    faster-whisper's refusal of it is."""
    try:
        return _parse_model_bin(np.memmap(path, dtype=np.uint8, mode="r"))
    except ValueError as exc:  # the cursor's, numpy's (an empty file), UTF-8's
        raise ConfigError(f"{str(path)!r} is not a whole CTranslate2 model file: {exc}") from None


def _parse_model_bin(data: npt.NDArray[np.uint8]) -> ModelBin:
    cursor = _Cursor(data)
    cursor.unpack("I")  # format version: every version we know has the same variable records
    name = cursor.string()
    revision = cursor.unpack("I")
    variables: dict[str, npt.NDArray[np.generic]] = {}
    bfloat16: set[str] = set()
    for _ in range(cursor.unpack("I")):
        var_name = cursor.string()
        rank = cursor.unpack("B")
        shape = tuple(cursor.unpack("I") for _ in range(rank))
        dtype_id = cursor.unpack("B")
        raw = cursor.take(cursor.unpack("I"))
        if dtype_id not in _DTYPES:
            raise ValueError(f"unknown variable type {dtype_id} of {var_name}")
        dtype = _DTYPES[dtype_id]
        if raw.size != dtype.itemsize * math.prod(shape):
            raise ValueError(f"{var_name} holds {raw.size} bytes, not its shape {shape}'s")
        variables[var_name] = raw.view(dtype).reshape(shape)
        if dtype_id == _BF16_ID:
            bfloat16.add(var_name)
    for _ in range(cursor.unpack("I")):
        alias = cursor.string()
        target = cursor.string()
        if target not in variables:
            raise ValueError(f"the alias {alias} names no variable ({target})")
        variables[alias] = variables[target]
        if target in bfloat16:
            bfloat16.add(alias)
    return ModelBin(
        name=name, revision=revision, variables=variables, bfloat16_names=frozenset(bfloat16)
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelDims:
    """Whisper's hyper-parameters, all read off the weights."""

    n_mels: int
    n_audio_ctx: int
    n_audio_state: int
    n_audio_head: int
    n_audio_layer: int
    n_vocab: int
    n_text_ctx: int
    n_text_state: int
    n_text_head: int
    n_text_layer: int


def _count_layers(names: Mapping[str, object], prefix: str) -> int:
    count = 0
    while f"{prefix}/layer_{count}/ffn/linear_0/weight" in names:
        count += 1
    return count


def _heads(tensors: Mapping[str, torch.Tensor], prefix: str, n_state: int) -> int:
    stored = tensors.get(f"{prefix}/num_heads")
    return int(stored.item()) if stored is not None else n_state // HEAD_DIM


def dims_from_tensors(tensors: Mapping[str, torch.Tensor]) -> ModelDims:
    """Read the dimensions off the weight shapes (and the stored head counts when present)."""
    conv1 = tensors["encoder/conv1/weight"]
    embedding = tensors["decoder/embeddings/weight"]
    return ModelDims(
        n_mels=conv1.shape[1],
        n_audio_ctx=tensors["encoder/position_encodings/encodings"].shape[0],
        n_audio_state=conv1.shape[0],
        n_audio_head=_heads(tensors, "encoder", conv1.shape[0]),
        n_audio_layer=_count_layers(tensors, "encoder"),
        n_vocab=embedding.shape[0],
        n_text_ctx=tensors["decoder/position_encodings/encodings"].shape[0],
        n_text_state=embedding.shape[1],
        n_text_head=_heads(tensors, "decoder", embedding.shape[1]),
        n_text_layer=_count_layers(tensors, "decoder"),
    )


def _to_torch(
    array: npt.NDArray[np.generic], *, bfloat16: bool, device: torch.device, dtype: torch.dtype
) -> torch.Tensor:
    # One host copy into aligned memory (mapped records are not aligned), then the device copy.
    if bfloat16:
        widened = array.astype(np.uint32) << 16
        host = torch.from_numpy(widened.view(np.float32))
    else:
        host = torch.from_numpy(np.array(array))
    if host.is_floating_point():
        return host.to(device=device, dtype=dtype)
    return host.to(device=device)


def load_tensors(path: Path, device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Every variable of `path` as a tensor on `device`; floating tensors are cast to `dtype`."""
    model = read_model_bin(path)
    # Aliases share the target's tensor so tied weights stay tied (and are copied once).
    by_id: dict[int, torch.Tensor] = {}
    tensors: dict[str, torch.Tensor] = {}
    for name, array in model.variables.items():
        key = id(array)
        if key not in by_id:
            by_id[key] = _to_torch(
                array, bfloat16=name in model.bfloat16_names, device=device, dtype=dtype
            )
        tensors[name] = by_id[key]
    return tensors


# name: (n_mels, n_state, n_layer, n_vocab); heads follow from HEAD_DIM.
WHISPER_SHAPES: dict[str, tuple[int, int, int, int]] = {
    "tiny": (80, 384, 4, 51865),
    "base": (80, 512, 6, 51865),
    "small": (80, 768, 12, 51865),
    "medium": (80, 1024, 24, 51865),
    "large-v3": (128, 1280, 32, 51866),
}


def shape_dims(shape_name: str) -> ModelDims:
    """The dimensions of a released Whisper size (encoder and decoder are symmetric)."""
    n_mels, n_state, n_layer, n_vocab = WHISPER_SHAPES[shape_name]
    return ModelDims(
        n_mels=n_mels,
        n_audio_ctx=1500,
        n_audio_state=n_state,
        n_audio_head=n_state // HEAD_DIM,
        n_audio_layer=n_layer,
        n_vocab=n_vocab,
        n_text_ctx=448,
        n_text_state=n_state,
        n_text_head=n_state // HEAD_DIM,
        n_text_layer=n_layer,
    )


def variable_shapes(dims: ModelDims) -> dict[str, tuple[int, ...]]:
    """The floating variables a CTranslate2 Whisper `model.bin` holds for `dims`."""
    d_a, d_t = dims.n_audio_state, dims.n_text_state
    shapes: dict[str, tuple[int, ...]] = {
        "encoder/conv1/weight": (d_a, dims.n_mels, 3),
        "encoder/conv1/bias": (d_a,),
        "encoder/conv2/weight": (d_a, d_a, 3),
        "encoder/conv2/bias": (d_a,),
        "encoder/position_encodings/encodings": (dims.n_audio_ctx, d_a),
        "decoder/embeddings/weight": (dims.n_vocab, d_t),
        "decoder/position_encodings/encodings": (dims.n_text_ctx, d_t),
    }

    def norm(name: str, width: int) -> None:
        shapes[f"{name}/gamma"] = (width,)
        shapes[f"{name}/beta"] = (width,)

    def linear(name: str, n_out: int, n_in: int) -> None:
        shapes[f"{name}/weight"] = (n_out, n_in)
        shapes[f"{name}/bias"] = (n_out,)

    def block(prefix: str, width: int, cross: bool) -> None:
        norm(f"{prefix}/self_attention/layer_norm", width)
        linear(f"{prefix}/self_attention/linear_0", 3 * width, width)
        linear(f"{prefix}/self_attention/linear_1", width, width)
        if cross:
            norm(f"{prefix}/attention/layer_norm", width)
            linear(f"{prefix}/attention/linear_0", width, width)
            linear(f"{prefix}/attention/linear_1", 2 * width, d_a)
            linear(f"{prefix}/attention/linear_2", width, width)
        norm(f"{prefix}/ffn/layer_norm", width)
        linear(f"{prefix}/ffn/linear_0", 4 * width, width)
        linear(f"{prefix}/ffn/linear_1", width, 4 * width)

    for i in range(dims.n_audio_layer):
        block(f"encoder/layer_{i}", d_a, cross=False)
    for i in range(dims.n_text_layer):
        block(f"decoder/layer_{i}", d_t, cross=True)
    norm("encoder/layer_norm", d_a)
    norm("decoder/layer_norm", d_t)
    return shapes


def random_tensors(
    shape_name: str, device: torch.device, dtype: torch.dtype, seed: int = 0
) -> dict[str, torch.Tensor]:
    """Random weights of a named Whisper size, made on `device` (no file): for speed work only."""
    dims = shape_dims(shape_name)
    generator = torch.Generator(device=device).manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for name, shape in variable_shapes(dims).items():
        if name.endswith("/gamma"):
            tensors[name] = torch.ones(shape, device=device, dtype=dtype)
        elif name.endswith(("/beta", "/bias")):
            tensors[name] = torch.zeros(shape, device=device, dtype=dtype)
        else:
            # Small weights keep FP16 activations finite through 32 random layers.
            weight = torch.randn(shape, generator=generator, device=device, dtype=torch.float32)
            tensors[name] = (weight * 0.02).to(dtype)
    # Whisper ties the output projection to the token embedding, as model.bin's alias does.
    tensors["decoder/projection/weight"] = tensors["decoder/embeddings/weight"]
    return tensors
