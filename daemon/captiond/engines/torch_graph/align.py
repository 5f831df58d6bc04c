"""torch_graph's word timings: the alignment heads' cross-attention and DTW, on the device.

Owns the alignment pass of one decoded batch. After the decode, each final row's whole sequence
(<|startoftranscript|>, its language and task, <|notimestamps|>, the forced prefix, the decoded
tokens, <|endoftext|>) runs once more through the decoder, teacher-forced and eager, against the
cross-attention K/V the decode left in the cache (model.py `TextDecoder.forced`, which writes no
cache, so the step graphs and their buffers are untouched). From it, on the device:
- each token's probability under the text vocabulary (ids below <|endoftext|>), as CTranslate2's
  `align` gives faster-whisper's `word.probability`;
- the alignment heads' scores, softmaxed over the row's own frames (its audio, not the window's
  padding), normalized over the tokens, median-filtered over the frames (reflected at the
  edges), averaged over the heads: CTranslate2's `align` (openai/whisper's timing.py is the same
  design);
- the dynamic time warping over that matrix, batched across the rows: a token row at a time,
  its horizontal moves folded into a cumulative minimum, and CTranslate2's tie rule.
Only the DTW's trace comes back to the host, where each row's path is walked back
(engines/timing.py `path_starts`) and turned into words (`words_of`).

Runs on the engine thread, inside `inference()`.
"""

from __future__ import annotations

import functools
import itertools
import json
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F

from captiond.engines.base import WordTiming
from captiond.engines.timing import MEDIAN_FILTER_WIDTH, path_starts, split_words, words_of
from captiond.engines.torch_graph.kv_cache import KVCache
from captiond.engines.torch_graph.model import Whisper
from captiond.engines.torch_graph.tokens import PromptPlan, WhisperTokens
from captiond.engines.torch_graph.weights import ModelDims
from captiond.whisper import HOP_SAMPLES, SAMPLE_RATE_HZ

# Mel frames per encoder frame (the second convolution's stride).
_MEL_PER_ENCODER_FRAME = 2


def alignment_heads(model_path: Path, dims: ModelDims) -> tuple[tuple[int, int], ...]:
    """config.json's `alignment_heads` ((decoder layer, head) pairs) that exist in `dims`
    (random weights of another shape keep the ones that fit); () when it has none."""
    config_path = model_path / "config.json"
    config = json.loads(config_path.read_text()) if config_path.exists() else {}
    return tuple(
        (int(layer), int(head))
        for layer, head in config.get("alignment_heads", ())
        if layer < dims.n_text_layer and head < dims.n_text_head
    )


class Aligner:
    """The alignment pass of one model, cache and tokenizer (see the module docstring)."""

    def __init__(
        self,
        model: Whisper,
        cache: KVCache,
        tokens: WhisperTokens,
        heads: Sequence[tuple[int, int]],
    ) -> None:
        self.model, self.cache, self.tokens = model, cache, tokens
        self.heads = tuple(heads)

    def words(
        self,
        plans: Sequence[PromptPlan],
        decoded: Sequence[tuple[int, ...]],
        cache_rows: Sequence[int],
        audio_samples: Sequence[int],
        mel_frames: Sequence[int],
        languages: Sequence[str],
    ) -> list[tuple[WordTiming, ...]]:
        """Each row's words: `plans[i]` its prompt, `decoded[i]` its tokens (without the prefix
        and <|endoftext|>), `cache_rows[i]` where its cross-attention is, `audio_samples[i]`
        its audio and `mel_frames[i]` its window (the frames it may align to: the audio's,
        within the window, as the faster-whisper engine's), `languages[i]` how its words are
        split."""
        if not self.heads or not plans:
            return [() for _ in plans]
        eot = self.tokens.special.eot
        sequences = [
            [*plan.tokens[plan.sot_index :], *row, eot]
            for plan, row in zip(plans, decoded, strict=True)
        ]
        # The row of <|notimestamps|> is the matrix's first: it predicts the first text token.
        offsets = [len(plan.tokens) - plan.sot_index - plan.prefix_tokens - 1 for plan in plans]
        texts = [
            list(plan.tokens[len(plan.tokens) - plan.prefix_tokens :]) + list(row)
            for plan, row in zip(plans, decoded, strict=True)
        ]
        frames = [
            min(window, max(1, n // HOP_SAMPLES)) // _MEL_PER_ENCODER_FRAME
            for n, window in zip(audio_samples, mel_frames, strict=True)
        ]
        device = self.cache.cross_k.device
        longest = max(len(s) for s in sequences)
        padded = torch.tensor(
            [s + [eot] * (longest - len(s)) for s in sequences], dtype=torch.int64, device=device
        )
        rows = torch.tensor(list(cache_rows), dtype=torch.int64, device=device)
        hidden, scores = self.model.decoder.forced(padded, self.cache, rows, self.heads)
        matrices, probs = [], []
        for i, sequence in enumerate(sequences):
            n, m, start, length = len(sequence), frames[i], offsets[i], len(texts[i])
            # Positions start .. start + length - 1 predict the text tokens (all below eot).
            logits = self.model.decoder.logits(hidden[i, start : start + length])[:, :eot]
            targets = padded[i, start + 1 : start + length + 1]
            probs.append(logits.log_softmax(-1).gather(1, targets[:, None])[:, 0].exp())
            # A window shorter than one encoder frame has nothing to align to (no words).
            weights = _weights(scores[i, :, :n, : max(m, 1)].float())
            matrices.append(weights[start : start + length + 1])
        trace = _dtw_trace(matrices).cpu().numpy()
        flat: list[float] = torch.cat(probs).cpu().tolist()
        ends = list(itertools.accumulate(len(t) for t in texts))
        probabilities = [flat[end - len(t) : end] for t, end in zip(texts, ends, strict=True)]
        words: list[tuple[WordTiming, ...]] = []
        for i, text in enumerate(texts):
            starts = path_starts(trace[i], len(text) + 1, frames[i]) if frames[i] else None
            if starts is None:
                words.append(())
                continue
            words.append(
                words_of(
                    text,
                    starts[: len(text)],
                    starts[len(text)],
                    probabilities[i],
                    functools.partial(split_words, self.tokens.decode, language=languages[i]),
                    first_token=plans[i].prefix_tokens,
                    window_s=audio_samples[i] / SAMPLE_RATE_HZ,
                )
            )
        return words


def _weights(scores: torch.Tensor) -> torch.Tensor:
    """[heads, tokens, frames] pre-softmax scores of one row -> [tokens, frames]: softmax over
    the frames, each (head, frame) normalized over the tokens (no epsilon, as CTranslate2's
    LayerNorm(-2, 0)), median-filtered over the frames with reflected edges, mean of the
    heads."""
    weights = scores.softmax(-1)
    var, mean = torch.var_mean(weights, dim=-2, keepdim=True, correction=0)
    weights = (weights - mean) / var.sqrt()
    half = MEDIAN_FILTER_WIDTH // 2
    if weights.shape[-1] > half:
        weights = F.pad(weights, (half, half), mode="reflect")
        weights = weights.unfold(-1, MEDIAN_FILTER_WIDTH, 1).median(-1).values
    return weights.mean(0)


def _dtw_trace(matrices: Sequence[torch.Tensor]) -> torch.Tensor:
    """The DTW trace of each [n_i, m_i] matrix, maximizing the summed weights (CTranslate2's
    negative_dtw): [rows, max n + 1, max m + 1] int8, 0 diagonal, 1 up, 2 left.

    Cost row i from row i - 1: cost[i, j] = a_j + min(b_j, cost[i, j - 1]) with a_j = -x[i, j]
    and b_j the smaller of the two moves from row i - 1, which unrolls to
    S_j + min over k <= j of (b_k - S_{k-1}), S the running sum of a: one cumulative minimum a
    row, batched across the matrices (padding cells only feed cells right of or below a
    matrix's end, which no path reads). In float64, so the sums keep the per-cell precision a
    sequential float32 pass has."""
    n = max(x.shape[0] for x in matrices)
    m = max(x.shape[1] for x in matrices)
    device = matrices[0].device
    x = torch.zeros((len(matrices), n, m), dtype=torch.float64, device=device)
    for i, matrix in enumerate(matrices):
        x[i, : matrix.shape[0], : matrix.shape[1]] = matrix
    inf = torch.tensor(float("inf"), dtype=torch.float64, device=device)
    previous = torch.full((len(matrices), m + 1), float("inf"), dtype=torch.float64, device=device)
    previous[:, 0] = 0.0
    trace = torch.full((len(matrices), n + 1, m + 1), 2, dtype=torch.int8, device=device)
    for i in range(1, n + 1):
        diagonal, up = previous[:, :-1], previous[:, 1:]
        best = torch.minimum(diagonal, up)
        running = torch.cumsum(-x[:, i - 1], dim=1)
        before = F.pad(running[:, :-1], (1, 0))
        current = torch.cat(
            [inf.expand(len(matrices), 1), running + torch.cummin(best - before, dim=1).values],
            dim=1,
        )
        left = current[:, :-1]
        step = torch.where(
            (diagonal < up) & (diagonal < left),
            0,
            torch.where((up < diagonal) & (up < left), 1, 2),
        )
        trace[:, i, 1:] = step.to(torch.int8)
        previous = current
    return trace
