"""Preallocated static key/value caches (gpt-fast style), one set shared by every batch bucket.

Owns the device memory the decoder attends to: self-attention K/V `[L, B, H, 448, Dh]`, written at
a device-side position each step, and cross-attention K/V `[L, B, H, 1500, Dh]`, written once per
request from the encoder output. A bucket of b rows uses the first b rows of each layer, which is
a contiguous view, so CUDA graphs captured for different buckets read the same buffers. A row's
cross-attention reads only its first `cross_len` encoder positions: a window shorter than 30 s
encodes to fewer. Runs on the engine thread only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from captiond.engines.torch_graph.weights import ModelDims


@dataclass(frozen=True, slots=True, kw_only=True)
class KVCache:
    self_k: torch.Tensor
    self_v: torch.Tensor
    cross_k: torch.Tensor
    cross_v: torch.Tensor
    # [B] int64: encoder positions each row's cross-attention sees (a partial's shorter window
    # fills only the first ones; the rest hold an earlier request's K/V).
    cross_len: torch.Tensor

    @property
    def n_text_ctx(self) -> int:
        return int(self.self_k.shape[3])

    @property
    def max_batch(self) -> int:
        return int(self.self_k.shape[1])

    def spread_cross(self, n: int, copies: int) -> None:
        """Row r's cross-attention K/V (r < n) into rows r * copies .. r * copies + copies - 1:
        a beam's rows attend to their request's audio. Last row first, one row at a time, so
        no source is overwritten before it is read and no copy of the whole cache is made."""
        for row in reversed(range(n)):
            rows = slice(row * copies, (row + 1) * copies)
            for tensor in (self.cross_k, self.cross_v):
                # clone(): for row 0 the source is one of the rows written.
                tensor[:, rows].copy_(tensor[:, row : row + 1].clone().expand_as(tensor[:, rows]))
        self.cross_len[: n * copies].copy_(self.cross_len[:n].repeat_interleave(copies))

    def gather_self(self, rows: torch.Tensor, positions: int) -> None:
        """Self-attention K/V of rows 0 .. len(rows) - 1 become those of `rows` (a beam step's
        surviving beams, each with its origin's history), over the first `positions` slots (the
        ones written)."""
        n = rows.shape[0]
        for tensor in (self.self_k, self.self_v):
            written = tensor[:, :, :, :positions]
            written[:, :n].copy_(written.index_select(1, rows))

    @property
    def n_bytes(self) -> int:
        tensors = (self.self_k, self.self_v, self.cross_k, self.cross_v)
        return sum(t.numel() * t.element_size() for t in tensors)


def bytes_per_row(dims: ModelDims, dtype: torch.dtype) -> int:
    """KV cache bytes of one batch row (self and cross attention, K and V, every layer)."""
    positions = dims.n_text_ctx + dims.n_audio_ctx
    element_bytes = torch.empty((), dtype=dtype).element_size()
    return 2 * dims.n_text_layer * positions * dims.n_text_state * element_bytes


def allocate_cache(
    dims: ModelDims, max_batch: int, device: torch.device, dtype: torch.dtype
) -> KVCache:
    head_dim = dims.n_text_state // dims.n_text_head
    self_shape = (dims.n_text_layer, max_batch, dims.n_text_head, dims.n_text_ctx, head_dim)
    cross_shape = (dims.n_text_layer, max_batch, dims.n_text_head, dims.n_audio_ctx, head_dim)
    # Zeros, not empty: padding rows of a bucket read these before any request wrote them.
    return KVCache(
        self_k=torch.zeros(self_shape, device=device, dtype=dtype),
        self_v=torch.zeros(self_shape, device=device, dtype=dtype),
        cross_k=torch.zeros(cross_shape, device=device, dtype=dtype),
        cross_v=torch.zeros(cross_shape, device=device, dtype=dtype),
        cross_len=torch.full((max_batch,), dims.n_audio_ctx, dtype=torch.int64, device=device),
    )
