"""The Whisper encoder and decoder, written for static shapes (openai/whisper model.py layout).

Owns the network: pre-norm transformer blocks, fused q/k/v projections as stored in CTranslate2's
model.bin, a decoder that reads and writes a preallocated `KVCache`. Runs on the engine thread.
Nothing here allocates per step except activations, so the decode step can be graph-captured.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from captiond.engines.torch_graph.kv_cache import KVCache
from captiond.engines.torch_graph.weights import ModelDims

_LN_EPS = 1e-5

# The attention kernels of every eager call (encoder, prefill, language detection): not
# cuDNN. Recent CUDA 13 builds of torch try cuDNN first on Hopper GPUs (sm90, cuDNN newer than
# 9.15), and cuDNN builds an execution plan on the host for each new shape, while the eager
# encoder and prefill see new shapes batch after batch (rows, prompt length, window length). At
# 1,000 streams on an H200 those three eager attention calls were 41 % of the engine thread's
# samples, every other eager operator 3 % (bench/results/pyspy-engine-tiny1000-h200.txt):
# per-shape planning is the likely cause (that run did not record which backend ran). Flash and
# memory-efficient attention keep no per-shape plan, and ran the encoder faster there too (at
# B=128, 0.29 ms per window against cuDNN's 0.53 for tiny; bench/results/attention-step-h200.json).
ATTENTION_BACKENDS = (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH)

# The decode step's kernels: torch's own order, which takes cuDNN's where it has it. The step's
# shapes are fixed per batch bucket, so cuDNN plans each once, when its graph is captured; and
# flash or memory-efficient attention, with one query per row, likely leave most of the GPU idle.
# On an H200 the captured step replayed about twice as fast with cuDNN's as with those two
# (tiny B=1 373 µs against 794, B=128 873 against 1,631; base B=1 529 against 1,158;
# bench/results/attention-step-h200.json, random weights).
STEP_ATTENTION_BACKENDS = (SDPBackend.CUDNN_ATTENTION, *ATTENTION_BACKENDS)


@contextlib.contextmanager
def inference() -> Iterator[None]:
    """Where the model runs (eagerly, or captured into a graph): no autograd, and attention
    from `ATTENTION_BACKENDS` only, but in the decode step (`step_attention`)."""
    with torch.no_grad(), sdpa_kernel(list(ATTENTION_BACKENDS)):
        yield


@contextlib.contextmanager
def step_attention() -> Iterator[None]:
    """Inside `inference()`, where the decode step runs (eagerly, or captured into a graph):
    attention from `STEP_ATTENTION_BACKENDS`."""
    with sdpa_kernel(list(STEP_ATTENTION_BACKENDS)):
        yield


# Modules are built on the meta device: `build_model` binds the real tensors without copies.
# The typed `__call__`s only tell mypy that these modules return tensors.


class LayerNorm(nn.LayerNorm):
    def __init__(self, width: int) -> None:
        super().__init__(width, eps=_LN_EPS, device="meta")

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return cast(torch.Tensor, super().__call__(x))


class Linear(nn.Linear):
    def __init__(self, n_in: int, n_out: int) -> None:
        super().__init__(n_in, n_out, device="meta")

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return cast(torch.Tensor, super().__call__(x))


def _heads(x: torch.Tensor, n_head: int) -> torch.Tensor:
    """[B, T, D] -> [B, H, T, Dh]."""
    batch, n_ctx, width = x.shape
    return x.view(batch, n_ctx, n_head, width // n_head).transpose(1, 2)


def _merge(x: torch.Tensor) -> torch.Tensor:
    """[B, H, T, Dh] -> [B, T, D]."""
    batch, n_head, n_ctx, head_dim = x.shape
    return x.transpose(1, 2).reshape(batch, n_ctx, n_head * head_dim)


class MLP(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc1 = Linear(width, 4 * width)
        self.fc2 = Linear(4 * width, width)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return cast(torch.Tensor, super().__call__(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class EncoderBlock(nn.Module):
    def __init__(self, width: int, n_head: int) -> None:
        super().__init__()
        self.n_head = n_head
        self.attn_ln = LayerNorm(width)
        self.qkv = Linear(width, 3 * width)
        self.attn_out = Linear(width, width)
        self.mlp_ln = LayerNorm(width)
        self.mlp = MLP(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = (_heads(t, self.n_head) for t in self.qkv(self.attn_ln(x)).chunk(3, dim=-1))
        x = x + self.attn_out(_merge(F.scaled_dot_product_attention(q, k, v)))
        return x + self.mlp(self.mlp_ln(x))


class AudioEncoder(nn.Module):
    def __init__(self, dims: ModelDims) -> None:
        super().__init__()
        width = dims.n_audio_state
        self.conv1 = nn.Conv1d(dims.n_mels, width, kernel_size=3, padding=1, device="meta")
        self.conv2 = nn.Conv1d(width, width, kernel_size=3, stride=2, padding=1, device="meta")
        self.positional_embedding = nn.Parameter(
            torch.empty(dims.n_audio_ctx, width, device="meta"), requires_grad=False
        )
        self.blocks = nn.ModuleList(
            EncoderBlock(width, dims.n_audio_head) for _ in range(dims.n_audio_layer)
        )
        self.ln_post = LayerNorm(width)

    @property
    def layers(self) -> tuple[EncoderBlock, ...]:
        return tuple(cast(EncoderBlock, block) for block in self.blocks)

    def __call__(self, mel: torch.Tensor) -> torch.Tensor:
        return cast(torch.Tensor, super().__call__(mel))

    def forward(self, mel: torch.Tensor) -> torch.Tensor:
        """[B, n_mels, 2T] -> [B, T, D]; T = 1500 for a 30-s window (as CTranslate2, a shorter
        window takes the first T positional embeddings)."""
        x = F.gelu(self.conv1(mel))
        x = F.gelu(self.conv2(x)).transpose(1, 2)
        x = x + self.positional_embedding[: x.shape[1]]
        for block in self.layers:
            x = block.forward(x)
        return self.ln_post(x)


class DecoderBlock(nn.Module):
    def __init__(self, width: int, n_head: int, n_audio_state: int) -> None:
        super().__init__()
        self.n_head = n_head
        self.attn_ln = LayerNorm(width)
        self.qkv = Linear(width, 3 * width)
        self.attn_out = Linear(width, width)
        self.cross_ln = LayerNorm(width)
        self.cross_q = Linear(width, width)
        self.cross_kv = Linear(n_audio_state, 2 * width)
        self.cross_out = Linear(width, width)
        self.mlp_ln = LayerNorm(width)
        self.mlp = MLP(width)

    def write_cross(self, audio: torch.Tensor, cache: KVCache, layer: int, rows: slice) -> None:
        """Project the encoder output once per request into the cross-attention cache."""
        k, v = self.cross_kv(audio).chunk(2, dim=-1)
        n_ctx = audio.shape[1]
        cache.cross_k[layer, rows, :, :n_ctx].copy_(_heads(k, self.n_head))
        cache.cross_v[layer, rows, :, :n_ctx].copy_(_heads(v, self.n_head))

    def _cross(
        self, x: torch.Tensor, cache: KVCache, layer: int, cross_mask: torch.Tensor
    ) -> torch.Tensor:
        n = x.shape[0]
        q = _heads(self.cross_q(self.cross_ln(x)), self.n_head)
        out = F.scaled_dot_product_attention(
            q, cache.cross_k[layer, :n], cache.cross_v[layer, :n], attn_mask=cross_mask
        )
        return x + self.cross_out(_merge(out))

    def prefill(
        self, x: torch.Tensor, cache: KVCache, layer: int, cross_mask: torch.Tensor
    ) -> torch.Tensor:
        """Whole right-padded prompts at positions 0..T-1; causal attention over themselves."""
        n, n_ctx, _ = x.shape
        q, k, v = (_heads(t, self.n_head) for t in self.qkv(self.attn_ln(x)).chunk(3, dim=-1))
        cache.self_k[layer, :n, :, :n_ctx].copy_(k)
        cache.self_v[layer, :n, :, :n_ctx].copy_(v)
        x = x + self.attn_out(_merge(F.scaled_dot_product_attention(q, k, v, is_causal=True)))
        x = self._cross(x, cache, layer, cross_mask)
        return x + self.mlp(self.mlp_ln(x))

    def forced(
        self,
        x: torch.Tensor,
        cross: tuple[torch.Tensor, torch.Tensor],
        cross_mask: torch.Tensor,
        heads: Sequence[int],
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Whole right-padded sequences (teacher forcing), touching no cache: `cross` is the
        rows' cross-attention (K, V). Also returns the pre-softmax cross-attention scores of
        `heads` [n, len(heads), T, n_audio_ctx] (None when there are none), as CTranslate2's
        decoder returns its alignment heads'."""
        q, k, v = (_heads(t, self.n_head) for t in self.qkv(self.attn_ln(x)).chunk(3, dim=-1))
        x = x + self.attn_out(_merge(F.scaled_dot_product_attention(q, k, v, is_causal=True)))
        cross_k, cross_v = cross
        q = _heads(self.cross_q(self.cross_ln(x)), self.n_head)
        out = F.scaled_dot_product_attention(q, cross_k, cross_v, attn_mask=cross_mask)
        x = x + self.cross_out(_merge(out))
        scores = None
        if heads:
            chosen = list(heads)
            scale = q.shape[-1] ** -0.5
            scores = (q[:, chosen] @ cross_k[:, chosen].transpose(-1, -2)) * scale
        return x + self.mlp(self.mlp_ln(x)), scores

    def step(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        mask: torch.Tensor,
        cross_mask: torch.Tensor,
        cache: KVCache,
        layer: int,
    ) -> torch.Tensor:
        """One token per row at its own device-side position; attends to the whole cache."""
        q, k, v = (_heads(t, self.n_head) for t in self.qkv(self.attn_ln(x)).chunk(3, dim=-1))
        n = x.shape[0]
        self_k, self_v = cache.self_k[layer, :n], cache.self_v[layer, :n]
        # scatter_ at a device tensor index: no host sync, so the step stays capturable.
        index = positions.view(n, 1, 1, 1).expand(k.shape)
        self_k.scatter_(2, index, k)
        self_v.scatter_(2, index, v)
        attended = F.scaled_dot_product_attention(q, self_k, self_v, attn_mask=mask)
        x = x + self.attn_out(_merge(attended))
        x = self._cross(x, cache, layer, cross_mask)
        return x + self.mlp(self.mlp_ln(x))


class TextDecoder(nn.Module):
    def __init__(self, dims: ModelDims) -> None:
        super().__init__()
        width = dims.n_text_state
        self.token_embedding = nn.Embedding(dims.n_vocab, width, device="meta")
        self.positional_embedding = nn.Parameter(
            torch.empty(dims.n_text_ctx, width, device="meta"), requires_grad=False
        )
        self.blocks = nn.ModuleList(
            DecoderBlock(width, dims.n_text_head, dims.n_audio_state)
            for _ in range(dims.n_text_layer)
        )
        self.ln = LayerNorm(width)

    @property
    def layers(self) -> tuple[DecoderBlock, ...]:
        return tuple(cast(DecoderBlock, block) for block in self.blocks)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Tied output projection (no bias), in float32 for the log-softmax."""
        return (self.ln(hidden) @ self.token_embedding.weight.T).float()

    def write_cross(self, audio: torch.Tensor, cache: KVCache, first_row: int = 0) -> None:
        """The encoder output [n, T, D] of rows first_row .. first_row + n - 1."""
        rows = slice(first_row, first_row + audio.shape[0])
        for layer, block in enumerate(self.layers):
            block.write_cross(audio, cache, layer, rows)
        cache.cross_len[rows].fill_(audio.shape[1])

    @staticmethod
    def _cross_mask(cache: KVCache, n: int) -> torch.Tensor:
        """[n, 1, 1, n_audio_ctx]: the encoder positions each row's window filled."""
        slots = torch.arange(cache.cross_k.shape[3], device=cache.cross_k.device)
        return (slots[None, :] < cache.cross_len[:n, None])[:, None, None, :]

    def prefill(self, tokens: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """[B, T] right-padded prompt tokens -> hidden states [B, T, D] (pre final norm)."""
        x = (
            F.embedding(tokens, self.token_embedding.weight)
            + self.positional_embedding[: tokens.shape[1]]
        )
        cross_mask = self._cross_mask(cache, tokens.shape[0])
        for layer, block in enumerate(self.layers):
            x = block.prefill(x, cache, layer, cross_mask)
        return x

    def forced(
        self,
        tokens: torch.Tensor,
        cache: KVCache,
        rows: torch.Tensor,
        heads: Sequence[tuple[int, int]],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """[n, T] right-padded whole sequences against the cross-attention of cache `rows` [n]
        -> hidden states [n, T, D] (pre final norm) and the pre-softmax cross-attention scores
        of `heads` ((layer, head) pairs) [n, len(heads), T, n_audio_ctx], in the order of the
        layers, then of `heads`. Reads the cache, writes nothing: the decode's state stays."""
        x = (
            F.embedding(tokens, self.token_embedding.weight)
            + self.positional_embedding[: tokens.shape[1]]
        )
        slots = torch.arange(cache.cross_k.shape[3], device=tokens.device)
        cross_mask = (slots[None, :] < cache.cross_len[rows, None])[:, None, None, :]
        scores = []
        for layer, block in enumerate(self.layers):
            layer_heads = [head for at, head in heads if at == layer]
            cross = (cache.cross_k[layer, rows], cache.cross_v[layer, rows])
            x, chosen = block.forced(x, cross, cross_mask, layer_heads)
            if chosen is not None:
                scores.append(chosen)
        return x, torch.cat(scores, dim=1)

    def step(self, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """[B] tokens at [B] positions -> [B, n_vocab] float32 logits."""
        x = (
            F.embedding(tokens, self.token_embedding.weight) + self.positional_embedding[positions]
        )[:, None, :]
        # Row r may see cache slots 0..positions[r]; later slots hold stale or padding K/V.
        slots = torch.arange(cache.n_text_ctx, device=tokens.device)
        mask = (slots[None, :] <= positions[:, None])[:, None, None, :]
        cross_mask = self._cross_mask(cache, tokens.shape[0])
        for layer, block in enumerate(self.layers):
            x = block.step(x, positions, mask, cross_mask, cache, layer)
        return self.logits(x[:, 0])


class Whisper(nn.Module):
    def __init__(self, dims: ModelDims) -> None:
        super().__init__()
        self.dims = dims
        self.encoder = AudioEncoder(dims)
        self.decoder = TextDecoder(dims)


def _ct2_names(dims: ModelDims) -> dict[str, str]:
    """Module parameter name -> CTranslate2 variable name."""
    names = {
        "encoder.conv1.weight": "encoder/conv1/weight",
        "encoder.conv1.bias": "encoder/conv1/bias",
        "encoder.conv2.weight": "encoder/conv2/weight",
        "encoder.conv2.bias": "encoder/conv2/bias",
        "encoder.positional_embedding": "encoder/position_encodings/encodings",
        "encoder.ln_post.weight": "encoder/layer_norm/gamma",
        "encoder.ln_post.bias": "encoder/layer_norm/beta",
        "decoder.token_embedding.weight": "decoder/embeddings/weight",
        "decoder.positional_embedding": "decoder/position_encodings/encodings",
        "decoder.ln.weight": "decoder/layer_norm/gamma",
        "decoder.ln.bias": "decoder/layer_norm/beta",
    }
    shared = {
        "attn_ln": "self_attention/layer_norm",
        "qkv": "self_attention/linear_0",
        "attn_out": "self_attention/linear_1",
        "mlp_ln": "ffn/layer_norm",
        "mlp.fc1": "ffn/linear_0",
        "mlp.fc2": "ffn/linear_1",
    }
    cross = {
        "cross_ln": "attention/layer_norm",
        "cross_q": "attention/linear_0",
        "cross_kv": "attention/linear_1",
        "cross_out": "attention/linear_2",
    }
    for side, n_layer, parts in (
        ("encoder", dims.n_audio_layer, shared),
        ("decoder", dims.n_text_layer, shared | cross),
    ):
        for i in range(n_layer):
            for module, ct2 in parts.items():
                is_norm = module.endswith("_ln")
                for ours, theirs in (("weight", "gamma"), ("bias", "beta")):
                    names[f"{side}.blocks.{i}.{module}.{ours}"] = (
                        f"{side}/layer_{i}/{ct2}/{theirs if is_norm else ours}"
                    )
    return names


def build_model(tensors: Mapping[str, torch.Tensor], dims: ModelDims) -> Whisper:
    """Bind the weight tensors to the modules without copying them (`assign=True`)."""
    model = Whisper(dims)
    state = {ours: tensors[theirs] for ours, theirs in _ct2_names(dims).items()}
    model.load_state_dict(state, strict=True, assign=True)
    return model.eval().requires_grad_(False)
