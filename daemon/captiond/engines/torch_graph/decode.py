"""Greedy decoding with CTranslate2's rules: eager prefill, a capturable single-token step.

Owns the static decode state (next token, position, finished flag, token count, cumulative
log-probability and generated tokens per row, all on the device), the suppression masks and the
table of each token's other cases (`CaseVariants`: a capitalized word's probability counts
them). The step writes only into these buffers and the KV cache, never reads anything back to
the host, so CUDA graphs can capture it. The prompts' pass (`run_prompts`) is also the beam
search's (beam.py). Runs on the engine thread only.

Rules copied from CTranslate2's WhisperReplica::generate + GreedySearch (what faster-whisper
calls): the prompt minus its last token is the prefill; <|nospeech|> probability is the softmax
at the <|startoftranscript|> position; every step masks `suppress_ids`, the first step also
`suppress_ids_begin`; log-probabilities are taken after masking; at most
min(224, 448 - (len(prompt) - 1)) tokens are generated, <|endoftext|> included. One rule is
ours (`GreedyDecoder.stop_loops`): a row whose last tokens repeat with a short period is
finished there and marked looped, instead of running to its budget.

Language detection is Whisper's (openai/whisper `detect_language`, CTranslate2's
WhisperReplica::detect_language): one eager decoder step on [<|startoftranscript|>] against the
encoded window, softmax over the language tokens' logits only. It runs before the prefill and
leaves nothing the step reads: the real prefill rewrites the self-attention cache it touched.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from captiond.engines.torch_graph.kv_cache import KVCache
from captiond.engines.torch_graph.model import Whisper
from captiond.engines.torch_graph.staging import Staged
from captiond.engines.torch_graph.tokens import PromptPlan, WhisperTokens


@dataclass(frozen=True, slots=True, kw_only=True)
class DecodedRow:
    tokens: tuple[int, ...]  # without the final <|endoftext|>
    token_logprobs: tuple[float, ...]  # of each of `tokens` with its case variants (`_select`)
    avg_logprob: float
    no_speech_prob: float
    truncated: bool  # stopped at its token budget or as a loop, before <|endoftext|>
    looped: bool  # stopped by `GreedyDecoder.stop_loops`


@dataclass(frozen=True, slots=True, kw_only=True)
class StepState:
    """Per-row decode state of the largest bucket; bucket b works on the first b rows."""

    tokens: torch.Tensor  # [B] int64, the token each row feeds next
    positions: torch.Tensor  # [B] int64, where that token goes in the self-attention cache
    finished: torch.Tensor  # [B] bool
    counts: torch.Tensor  # [B] int64, tokens generated so far
    max_new: torch.Tensor  # [B] int64
    cum_logprob: torch.Tensor  # [B] float32
    out_tokens: torch.Tensor  # [B, n_text_ctx] int64
    out_logprobs: torch.Tensor  # [B, n_text_ctx] float32, of each out_tokens with its variants
    looped: torch.Tensor  # [B] bool, finished by `GreedyDecoder.stop_loops`


@dataclass(frozen=True, slots=True, kw_only=True)
class Prefilled:
    """The prompts' pass (`GreedyDecoder.run_prompts`), a row per request, on the device."""

    logits: torch.Tensor  # [n, n_vocab] float32, for the first token (before any mask)
    no_speech: torch.Tensor  # [n] p(<|nospeech|>) at <|startoftranscript|>
    last: torch.Tensor  # [n] int64, index of the prompt's last token
    max_new: torch.Tensor  # [n] int64, the token budget


_ROW_FIELDS = 3  # per prefill row after its prompt: last prompt index, sot index, token budget

# A row whose last LOOP_RUN_TOKENS tokens each equal the token p before them, for some period
# p <= LOOP_MAX_PERIOD_TOKENS, is looping ("the 雙雙雙…", "engraved in relief, engraved in
# relief, …"): greedy Whisper does not leave such a loop, and the session's filters drop what
# it wrote (Whisper's compression-ratio rule). Without the stop it runs to its budget, ~200
# tokens, and on a GPU holds every row of its batch that long. The longest such run in every
# decode the committed bench results hold is 18 tokens, itself a loop ("arms, arms, …").
LOOP_RUN_TOKENS = 32
LOOP_MAX_PERIOD_TOKENS = 16


def _mask(n_vocab: int, token_ids: Sequence[int], device: torch.device) -> torch.Tensor:
    mask = torch.zeros(n_vocab, dtype=torch.float32)
    mask[[t for t in token_ids if t < n_vocab]] = float("-inf")
    return mask.to(device)


@dataclass(frozen=True, slots=True)
class CaseVariants:
    """`WhisperTokens.case_variants` as a [n_vocab, widest] table on the device: each token's
    variants, padded with itself where `bias` is -inf (every token past the text tokens has
    only itself)."""

    ids: torch.Tensor  # [n_vocab, widest] int64
    bias: torch.Tensor  # [n_vocab, widest] float32: 0, or -inf for padding

    @classmethod
    def build(
        cls, variants: Sequence[Sequence[int]], n_vocab: int, device: torch.device
    ) -> CaseVariants:
        rows = [list(v) for v in variants[:n_vocab]]
        rows += [[token] for token in range(len(rows), n_vocab)]
        widest = max(len(row) for row in rows)
        ids = torch.tensor([row + row[:1] * (widest - len(row)) for row in rows])
        pad = [float("-inf")]
        bias = torch.tensor([[0.0] * len(row) + pad * (widest - len(row)) for row in rows])
        return cls(ids=ids.to(device), bias=bias.to(device))


def _select(
    logits: torch.Tensor, mask: torch.Tensor, variants: CaseVariants
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Greedy choice, its log-probability under the masked distribution (avg_logprob's), and
    that of it with its `case_variants` together (what a word's probability is made of)."""
    logprobs = torch.log_softmax(logits + mask, dim=-1)
    token = logprobs.argmax(dim=-1)
    same_text = logprobs.gather(-1, variants.ids[token]) + variants.bias[token]
    return token, logprobs.gather(-1, token[:, None])[:, 0], torch.logsumexp(same_text, dim=-1)


class GreedyDecoder:
    def __init__(
        self, model: Whisper, cache: KVCache, tokens: WhisperTokens, device: torch.device
    ) -> None:
        self.model = model
        self.cache = cache
        self.tokens = tokens
        self.device = device
        self.eot = tokens.special.eot
        n_vocab = model.dims.n_vocab
        self.suppress = _mask(n_vocab, tokens.suppress_ids, device)
        self.suppress_first = _mask(
            n_vocab, tokens.suppress_ids + tokens.suppress_ids_begin, device
        )
        self.language_ids = torch.tensor(tokens.language_ids, dtype=torch.int64).to(device)
        self.case_variants = CaseVariants.build(tokens.case_variants, n_vocab, device)
        rows = cache.max_batch

        def zeros(*shape: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=device)

        self.state = StepState(
            tokens=zeros(rows),
            positions=zeros(rows),
            finished=zeros(rows, dtype=torch.bool),
            counts=zeros(rows),
            max_new=zeros(rows),
            cum_logprob=zeros(rows, dtype=torch.float32),
            out_tokens=zeros(rows, cache.n_text_ctx),
            out_logprobs=zeros(rows, cache.n_text_ctx, dtype=torch.float32),
            looped=zeros(rows, dtype=torch.bool),
        )
        # stop_loops' offsets back from a row's end: its last LOOP_RUN_TOKENS tokens, and the
        # periods they are compared over.
        self._loop_back = torch.arange(1, LOOP_RUN_TOKENS + 1).to(device)
        self._loop_periods = torch.arange(1, LOOP_MAX_PERIOD_TOKENS + 1).to(device)
        # Host mirrors, pinned on CUDA so device-to-host copies are async DMA.
        pinned = device.type == "cuda"
        self.host_finished = torch.zeros(rows, dtype=torch.bool, pin_memory=pinned)
        self.host_counts = torch.zeros(rows, dtype=torch.int64, pin_memory=pinned)
        self.host_cum = torch.zeros(rows, dtype=torch.float32, pin_memory=pinned)
        self.host_tokens = torch.zeros(
            (rows, cache.n_text_ctx), dtype=torch.int64, pin_memory=pinned
        )
        self.host_logprobs = torch.zeros(
            (rows, cache.n_text_ctx), dtype=torch.float32, pin_memory=pinned
        )
        self.host_no_speech = torch.zeros(rows, dtype=torch.float32, pin_memory=pinned)
        self.host_looped = torch.zeros(rows, dtype=torch.bool, pin_memory=pinned)
        # The prefill's inputs, a row per request: its prompt (padded), then the index of the
        # prompt's last token and of <|startoftranscript|>, and its token budget; one copy, and
        # the host does not wait for the encoder before it queues the prefill.
        self.inputs = Staged(rows * (cache.n_text_ctx + _ROW_FIELDS), torch.int64, device)

    def encode(self, mel: torch.Tensor, first_row: int = 0) -> None:
        """Batched encoder of rows first_row ..; its output lives only as the cross-attention
        cache."""
        self.model.decoder.write_cross(self.model.encoder(mel), self.cache, first_row)

    def language_probs(self, n: int) -> torch.Tensor:
        """[n, languages] float32: p(language) of the first n rows of the cross-attention cache,
        in `tokens.language_ids` order (all other tokens masked out of the softmax)."""
        sot = torch.full((n, 1), self.tokens.special.sot, dtype=torch.int64, device=self.device)
        hidden = self.model.decoder.prefill(sot, self.cache)
        logits = self.model.decoder.logits(hidden[:, 0])
        return torch.softmax(logits.index_select(-1, self.language_ids), dim=-1)

    def _send_inputs(self, plans: Sequence[PromptPlan]) -> torch.Tensor:
        """[n, longest prompt + _ROW_FIELDS] on the device: prompts right-padded with
        <|endoftext|>, then each row's last prompt index, <|startoftranscript|> index and
        token budget. Queued without waiting for the device."""
        longest = max(len(plan.tokens) for plan in plans)
        shape = (len(plans), longest + _ROW_FIELDS)
        table = self.inputs.write(shape)
        table[:, :longest] = self.eot
        for row, plan in enumerate(plans):
            table[row, : len(plan.tokens)] = plan.tokens
            table[row, longest:] = (len(plan.tokens) - 1, plan.sot_index, plan.max_new_tokens)
        return self.inputs.send(shape)

    def run_prompts(self, plans: Sequence[PromptPlan]) -> Prefilled:
        """The prompts through the decoder into rows 0 .. len(plans) - 1 of the self-attention
        cache. Queues it without waiting for the work queued before (the encoder)."""
        n = len(plans)
        inputs = self._send_inputs(plans)
        prompt = inputs[:, :-_ROW_FIELDS]
        last, sot, max_new = inputs[:, -_ROW_FIELDS:].unbind(dim=1)
        hidden = self.model.decoder.prefill(prompt, self.cache)
        rows = torch.arange(n, device=self.device)
        logits = self.model.decoder.logits(torch.cat([hidden[rows, last], hidden[rows, sot]]))
        no_speech = torch.softmax(logits[n:], dim=-1)[:, self.tokens.special.no_speech]
        return Prefilled(logits=logits[:n], no_speech=no_speech, last=last, max_new=max_new)

    def prefill(self, plans: Sequence[PromptPlan], bucket: int) -> torch.Tensor:
        """Run the prompts, pick each row's first token, arm the step state; returns p(nospeech).
        Queues all of it without waiting for the work queued before (the encoder)."""
        n = len(plans)
        prefilled = self.run_prompts(plans)
        last, max_new = prefilled.last, prefilled.max_new
        first, first_logprob, first_text_logprob = _select(
            prefilled.logits, self.suppress_first, self.case_variants
        )
        no_speech = prefilled.no_speech

        state = self.state
        # Padding rows of the bucket are born finished: the step leaves them untouched.
        state.finished[:bucket].fill_(True)
        state.finished[:n].copy_((first == self.eot) | (max_new <= 1))
        state.tokens[:bucket].fill_(self.eot)
        state.tokens[:n].copy_(first)
        state.positions[:bucket].zero_()
        state.positions[:n].copy_(last + 1)
        state.counts[:bucket].zero_()
        state.counts[:n].fill_(1)
        state.max_new[:bucket].fill_(1)
        state.max_new[:n].copy_(max_new)
        state.cum_logprob[:bucket].zero_()
        state.cum_logprob[:n].copy_(first_logprob)
        state.out_tokens[:n, 0].copy_(first)
        state.out_logprobs[:n, 0].copy_(first_text_logprob)
        state.looped[:bucket].fill_(False)
        return no_speech

    def step(self, bucket: int) -> None:
        """One token for every row of the bucket; device-only work (graph-capturable)."""
        s = self.state
        tokens, positions, finished = s.tokens[:bucket], s.positions[:bucket], s.finished[:bucket]
        counts = s.counts[:bucket]
        logits = self.model.decoder.step(tokens, positions, self.cache)
        chosen, logprob, text_logprob = _select(logits, self.suppress, self.case_variants)
        active = ~finished
        chosen = torch.where(active, chosen, self.eot)
        s.cum_logprob[:bucket].add_(torch.where(active, logprob, 0.0))
        # Finished rows write <|endoftext|> past their end; the host reads only `counts` tokens.
        s.out_tokens[:bucket].scatter_(1, counts[:, None], chosen[:, None])
        s.out_logprobs[:bucket].scatter_(1, counts[:, None], text_logprob.float()[:, None])
        counts.add_(active.long())
        finished.logical_or_(chosen == self.eot).logical_or_(counts >= s.max_new[:bucket])
        # Clamp: a row that just finished must not index past the cache on later replays.
        positions.add_(active.long()).clamp_(max=self.cache.n_text_ctx - 1)
        tokens.copy_(chosen)

    def stop_loops(self, n: int) -> None:
        """Finish the first n rows that are looping (`LOOP_RUN_TOKENS`) and mark them looped.
        Device-only work, queued between step replays (not captured: it runs every
        `check_every_steps` steps, not every step)."""
        s = self.state
        counts, out = s.counts[:n], s.out_tokens[:n]
        recent_at = counts[:, None] - self._loop_back  # [n, run]
        earlier_at = recent_at[:, None, :] - self._loop_periods[:, None]  # [n, periods, run]
        # Indices before a row's start read column 0: harmless, `long_enough` rules them out.
        recent = out.gather(1, recent_at.clamp(min=0))
        earlier = out.gather(1, earlier_at.flatten(1).clamp(min=0)).view(earlier_at.shape)
        long_enough = counts[:, None] >= LOOP_RUN_TOKENS + self._loop_periods  # [n, periods]
        repeats = (earlier == recent[:, None]).all(dim=-1)
        looping = (repeats & long_enough).any(dim=-1) & ~s.finished[:n]
        s.looped[:n].logical_or_(looping)
        s.finished[:n].logical_or_(looping)

    def _to_host(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        for host, device_tensor in pairs:
            host.copy_(device_tensor, non_blocking=True)
        if self.device.type == "cuda":
            # Waits for these copies only (and the work queued before them), not the device.
            done = torch.cuda.Event()  # type: ignore[no-untyped-call]
            done.record()
            done.synchronize()

    def all_finished(self, n: int) -> bool:
        """The host's look at the finished flags (every k steps, not every step)."""
        self._to_host([(self.host_finished[:n], self.state.finished[:n])])
        return bool(self.host_finished[:n].all())

    def read_back(self, no_speech: torch.Tensor, n: int) -> list[DecodedRow]:
        """One device-to-host transfer of the finished batch."""
        s = self.state
        self._to_host(
            [
                (self.host_counts[:n], s.counts[:n]),
                (self.host_cum[:n], s.cum_logprob[:n]),
                (self.host_tokens[:n], s.out_tokens[:n]),
                (self.host_logprobs[:n], s.out_logprobs[:n]),
                (self.host_no_speech[:n], no_speech.float()),
                (self.host_looped[:n], s.looped[:n]),
            ]
        )
        counts = self.host_counts[:n].tolist()
        # Only the columns a row wrote: a whole [128, 448] table as Python lists took 1 ms.
        longest = max(counts)
        out = self.host_tokens[:n, :longest].tolist()
        logprobs = self.host_logprobs[:n, :longest].tolist()
        cum = self.host_cum[:n].tolist()
        no_speech_host = self.host_no_speech[:n].tolist()
        looped = self.host_looped[:n].tolist()
        rows = []
        for i in range(n):
            generated = out[i][: counts[i]]
            ended = bool(generated) and generated[-1] == self.eot
            if ended:
                generated = generated[:-1]
            # faster-whisper: cum_logprob / (seq_len + 1), seq_len without <|endoftext|>.
            rows.append(
                DecodedRow(
                    tokens=tuple(generated),
                    token_logprobs=tuple(logprobs[i][: len(generated)]),
                    avg_logprob=cum[i] / (len(generated) + 1),
                    no_speech_prob=no_speech_host[i],
                    truncated=not ended,
                    looped=looped[i],
                )
            )
        return rows
