"""Beam search with CTranslate2's rules, for the decodes that ask for a beam (finals, by default).

Owns one batch's beam state: R requests of K beams each on rows r * K + k of the KV cache, the
beams' tokens and cumulative log-probabilities, and each request's best finished hypothesis.
The prompts run as the greedy ones do (`GreedyDecoder.run_prompts`, rows 0 .. R - 1); their
cross-attention K/V is then copied to each request's K rows, and each step gathers the
self-attention K/V of the beams that survive. Every step is device work only; the host looks at
the done flags every `check_every_steps` steps, as for a greedy batch. It runs eagerly, also on
CUDA: the step graphs are the greedy step's. Runs on the engine thread only.

Rules copied from CTranslate2's BeamSearch::search as WhisperReplica::generate runs it for
faster-whisper (length_penalty 1, patience 1, one hypothesis), with the prompt's forced prefix
prefilled, which gives the same distributions as CTranslate2's forced steps:
- the first step expands only the prompt's row: its 2K best tokens (log-probabilities after
  `suppress_ids` and `suppress_ids_begin`);
- later steps: every beam's log-probabilities (after `suppress_ids`) plus its cumulative score,
  the 2K best over the request's K x vocabulary;
- of the K best candidates, each <|endoftext|> (all K at the token budget's last step) is a
  finished hypothesis scored cumulative / length, the length counting the forced prefix but not
  <|endoftext|>, and its place goes to the next candidate from the second K that is not one;
- after a forced prefix, CTranslate2 scores a first-step <|endoftext|> other than the best
  candidate at -1e10 (as token 0), so it never finishes there;
- a request is done when K hypotheses have finished (or at its last step); its answer is the
  best scored one.
Unlike a greedy decode, a loop is not stopped (`GreedyDecoder.stop_loops`): CTranslate2's beam
runs it to the budget too, and the session drops what it wrote by its compression ratio.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from captiond.engines.torch_graph.decode import DecodedRow, GreedyDecoder
from captiond.engines.torch_graph.tokens import PromptPlan

# CTranslate2's score of a secondary beam's <|endoftext|> at the first step after a prefix.
_PENALIZED_SCORE = -1e10


class BeamBatch:
    """One batch's beam search: `__init__` prefills and arms it, `run` steps it to the end,
    `read_back` brings each request's best hypothesis to the host."""

    def __init__(self, decoder: GreedyDecoder, plans: Sequence[PromptPlan], beam: int) -> None:
        n = len(plans)
        cache = decoder.cache
        if n * beam > cache.max_batch:
            raise ValueError(f"{n} requests of beam {beam} need more than {cache.max_batch} rows")
        self.decoder = decoder
        self.n = n
        self.beam = beam
        self.steps = max(plan.max_new_tokens for plan in plans)
        self.longest_prompt = max(len(plan.tokens) for plan in plans)
        device = decoder.device
        prefilled = decoder.run_prompts(plans)
        cache.spread_cross(n, beam)
        self.no_speech = prefilled.no_speech
        self.max_new = prefilled.max_new
        self.prefix = torch.tensor([plan.prefix_tokens for plan in plans], device=device)
        self.first_logits = prefilled.logits
        rows = n * beam
        # Every beam of a request is at the same position, after the request's prompt.
        self.positions = (prefilled.last + 1).repeat_interleave(beam)
        self.tokens = torch.full((rows,), decoder.eot, dtype=torch.int64, device=device)
        self.scores = torch.zeros(rows, dtype=torch.float32, device=device)
        self.sequences = torch.zeros((rows, cache.n_text_ctx), dtype=torch.int64, device=device)
        # [n, 1]: the first of each request's K rows.
        self._request_rows = (torch.arange(n, device=device) * beam)[:, None]
        self._slots = torch.arange(beam, device=device)
        self._candidates = torch.arange(2 * beam, device=device)
        self.done = torch.zeros(n, dtype=torch.bool, device=device)
        self.finished = torch.zeros(n, dtype=torch.int64, device=device)
        self.best_norm = torch.full((n,), float("-inf"), device=device)
        self.best_score = torch.zeros(n, device=device)
        self.best_length = torch.zeros(n, dtype=torch.int64, device=device)
        # Until a hypothesis scores above -inf, the answer is the empty one that ended.
        self.best_ended = torch.ones(n, dtype=torch.bool, device=device)
        self.best_sequence = torch.zeros((n, cache.n_text_ctx), dtype=torch.int64, device=device)

    def run(self, check_every_steps: int) -> None:
        """Steps until the longest budget ends or every request is done (the host looks every
        `check_every_steps` steps)."""
        decoder = self.decoder
        for step in range(self.steps):
            if step == 0:
                logprobs = torch.log_softmax(self.first_logits + decoder.suppress_first, dim=-1)
                self._advance(step, logprobs)
            else:
                logits = decoder.model.decoder.step(self.tokens, self.positions, decoder.cache)
                logprobs = torch.log_softmax(logits + decoder.suppress, dim=-1)
                self._advance(step, logprobs + self.scores[:, None])
                # Clamp: the rows of a done request must not index past the cache.
                self.positions.add_(1).clamp_(max=decoder.cache.n_text_ctx - 1)
            if (step + 1) % check_every_steps == 0 and bool(self.done.all()):
                break

    def _advance(self, step: int, totals: torch.Tensor) -> None:
        """One beam step from `totals`, each row's cumulative log-probability of every next
        token ([n, vocab] at the first step, the prompt's row only; then [n * K, vocab])."""
        n, beam, eot = self.n, self.beam, self.decoder.eot
        n_vocab = totals.shape[-1]
        scores, ids = totals.reshape(n, -1).topk(2 * beam, dim=-1)  # best first
        tokens, origins = ids % n_vocab, ids // n_vocab
        if step == 0:
            origin_rows = torch.arange(n, device=ids.device)[:, None].expand_as(ids)
            penalized = (tokens == eot) & (self.prefix[:, None] > 0) & (self._candidates > 0)
            tokens = torch.where(penalized, 0, tokens)
            scores = torch.where(penalized, _PENALIZED_SCORE, scores)
        else:
            origin_rows = self._request_rows + origins
        ended = tokens == eot

        # Finished hypotheses among the K best; the best of them may be the request's answer.
        last = (step + 1 >= self.max_new)[:, None]
        register = (ended[:, :beam] | last) & ~self.done[:, None]
        lengths = step + (~ended[:, :beam]).long()
        norms = scores[:, :beam] / (self.prefix[:, None] + lengths)
        norms = torch.where(register, norms, float("-inf"))
        top_norm, top = norms.max(dim=-1, keepdim=True)
        better = (top_norm > self.best_norm[:, None])[:, 0]
        hypothesis = self.sequences[origin_rows.gather(1, top)[:, 0]]
        hypothesis[:, step] = tokens.gather(1, top)[:, 0]
        self.best_sequence = torch.where(better[:, None], hypothesis, self.best_sequence)
        self.best_norm = torch.where(better, top_norm[:, 0], self.best_norm)
        self.best_score = torch.where(better, scores.gather(1, top)[:, 0], self.best_score)
        self.best_length = torch.where(better, lengths.gather(1, top)[:, 0], self.best_length)
        self.best_ended = torch.where(better, ended.gather(1, top)[:, 0], self.best_ended)
        self.finished += register.sum(dim=-1)
        self.done |= last[:, 0] | (self.finished >= beam)

        # The K beams that go on: each <|endoftext|> among the K best gives its place to the
        # next candidate of the second K that is not one.
        ended_first = ended[:, :beam]
        second = torch.argsort(ended[:, beam:].long() * 2 * beam + self._slots, dim=-1)
        rank = (ended_first.long().cumsum(dim=-1) - 1).clamp(min=0)
        chosen = torch.where(ended_first, beam + second.gather(1, rank), self._slots)
        rows = origin_rows.gather(1, chosen).flatten()
        self.sequences = self.sequences[rows]
        self.sequences[:, step] = tokens.gather(1, chosen).flatten()
        self.tokens = self.sequences[:, step].clone()
        self.scores = scores.gather(1, chosen).flatten()
        # The prompts' slots, and one per step since (written at the step that fed it).
        self.decoder.cache.gather_self(
            rows, min(self.longest_prompt + step, self.decoder.cache.n_text_ctx)
        )

    def read_back(self) -> list[DecodedRow]:
        """Each request's best hypothesis, brought to the host. No per-token probabilities: a
        beam's choice is not one token's."""
        lengths = self.best_length.cpu().tolist()
        longest = max(lengths)
        sequences = self.best_sequence[:, :longest].cpu().tolist()
        scores = self.best_score.cpu().tolist()
        ended = self.best_ended.cpu().tolist()
        no_speech = self.no_speech.float().cpu().tolist()
        return [
            DecodedRow(
                tokens=tuple(sequences[i][: lengths[i]]),
                token_logprobs=(),
                # faster-whisper: cum_logprob / (seq_len + 1), seq_len without <|endoftext|>.
                avg_logprob=scores[i] / (lengths[i] + 1),
                no_speech_prob=no_speech[i],
                truncated=not ended[i],
                looped=False,
            )
            for i in range(self.n)
        ]
