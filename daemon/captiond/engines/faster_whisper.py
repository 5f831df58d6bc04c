"""The faster-whisper (CTranslate2) engine: the CPU default and the accuracy reference.

Constructed on the main thread, then used only on the engine thread. A batch of requests from
many sessions becomes one `encode` of stacked 30 s windows and one `generate` per beam size,
with one prompt per stream. On the CPU the encoder runs on every core and `generate` on a
second copy of the model with `decoder_threads` (1): decode steps are too small to split.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from captiond.config import EngineConfig
from captiond.engines import resolve_engine_config
from captiond.engines.base import (
    DecodeKind,
    EngineRequest,
    EngineResult,
    PhaseTimes,
    WordTiming,
    begins_with_space,
)
from captiond.engines.models import model_display_name
from captiond.engines.rules import (
    LanguageChoice,
    case_variants,
    compression_ratio,
    fit_prompt,
    new_token_budget,
    partial_token_cap,
    request_language,
    text_tokens,
    unit_probabilities,
    window_frames,
)
from captiond.engines.timing import MEDIAN_FILTER_WIDTH, words_of
from captiond.errors import ConfigError
from captiond.lang.chinese import written
from captiond.whisper import HOP_SAMPLES, MAX_LENGTH, N_FRAMES, SAMPLE_RATE_HZ, WHISPER_LANGUAGES

if TYPE_CHECKING:  # faster-whisper is imported where a model is loaded
    from faster_whisper.transcribe import Segment


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
            self._decoder = self._model.model
            if self._model.model.device == "cpu" and config.decoder_threads not in (
                0,
                config.cpu_threads or os.cpu_count(),
            ):
                import ctranslate2

                self._decoder = ctranslate2.models.Whisper(
                    str(model_path),
                    device="cpu",
                    compute_type=config.compute_type,
                    intra_threads=config.decoder_threads,
                )
        except (RuntimeError, ValueError) as exc:
            raise ConfigError(f"faster-whisper cannot load {str(model_path)!r}: {exc}") from exc
        self._model_name = model_display_name(model_path)
        self._tokenizer_path = str(model_path / "tokenizer.json")
        self._partial_min_frames = round(config.partial_window_min_s * 100)
        self._tokenizers: dict[tuple[str, str] | None, Any] = {}
        # faster-whisper's Tokenizer.encode, which no language or task changes.
        english = self._tokenizer("en", "transcribe")
        self._text_tokens = text_tokens(english.encode)
        # Each text token's text, decoded once (50k tokens: 0.1 s): a partial's word
        # probabilities count a capitalized token's other cases.
        texts = self._model.hf_tokenizer.decode_batch([[t] for t in range(english.eot)])
        self._case_variants = case_variants(texts)
        self._phases = PhaseTimes()

    @property
    def phases(self) -> PhaseTimes:
        """languages (detection), encode (log-mel and encoder), generate, results."""
        return self._phases

    @property
    def name(self) -> str:
        return "faster-whisper"

    @property
    def model_name(self) -> str:
        return self._model_name

    @property
    def multilingual(self) -> bool:
        return bool(self._model.model.is_multilingual)

    @property
    def tokenizer_path(self) -> str:
        return self._tokenizer_path

    @property
    def known_languages(self) -> frozenset[str]:
        # faster-whisper's `supported_languages` lists every code Whisper ever had, whatever
        # the model: its tokenizer says which it has.
        if not self.multilingual:
            return frozenset({"en"})
        vocabulary = self._model.hf_tokenizer
        known = (c for c in WHISPER_LANGUAGES if vocabulary.token_to_id(f"<|{c}|>") is not None)
        return frozenset(known)

    @property
    def separate_decoder(self) -> bool:
        """`generate` runs on its own copy of the model, with `decoder_threads`."""
        return self._decoder is not self._model.model

    @property
    def max_batch(self) -> int:
        # On the CPU a batch costs as much as its requests one by one (measured: 331 ms per
        # 30 s window alone, 346 ms per window in fours), so batching only delays finals.
        return 16 if self._model.model.device == "cuda" else 1

    def warmup(self) -> None:
        silence = np.zeros(SAMPLE_RATE_HZ, dtype=np.float32)
        self.transcribe_batch([EngineRequest(audio=silence, kind=DecodeKind.PARTIAL)])

    def close(self) -> None:
        del self._model, self._decoder

    def features(
        self, audio: npt.NDArray[np.float32], frames: int = N_FRAMES
    ) -> npt.NDArray[np.float32]:
        """faster-whisper's recipe: 160 samples of padding, last frame dropped, zero-padded."""
        mel: npt.NDArray[np.float32] = self._model.feature_extractor(audio)[..., :-1]
        mel = mel[:, :frames]
        return np.pad(mel, ((0, 0), (0, frames - mel.shape[-1]))).astype(np.float32)

    def _tokenizer(self, language: str, task: str) -> Any:
        from faster_whisper.tokenizer import Tokenizer

        multilingual = self.multilingual
        key = (language, task) if multilingual else None
        if key not in self._tokenizers:
            self._tokenizers[key] = Tokenizer(
                self._model.hf_tokenizer,
                multilingual,
                task=task if multilingual else "transcribe",
                language=language if multilingual else None,
            )
        return self._tokenizers[key]

    def languages(self, requests: Sequence[EngineRequest]) -> list[LanguageChoice]:
        """The language each request decodes in, with its probability: given, or detected on
        the first 30 s of the utterance (one batched encode) and chosen with the session's
        hint among the request's candidates (`choose_language`). An English-only model decodes
        English."""
        if not self.multilingual:
            return [LanguageChoice("en", 1.0)] * len(requests)
        chosen = [LanguageChoice(r.language or "", 1.0) for r in requests]
        todo = [i for i, r in enumerate(requests) if r.language is None]
        if todo:
            features = np.stack(
                [self.features(requests[i].audio[requests[i].detect_from_sample :]) for i in todo]
            )
            detected = self._decoder.detect_language(self._model.encode(features))
            for i, pairs in zip(todo, detected, strict=True):
                # Tokens look like "<|de|>": the code between the brackets.
                probabilities = {token[2:-2]: prob for token, prob in pairs}
                chosen[i] = request_language(requests[i], probabilities)
        return chosen

    def _prompt(self, tokenizer: Any, request: EngineRequest) -> tuple[list[int], int]:
        """get_prompt(without_timestamps=True, prefix=…) with `fit_prompt`'s budget, and the
        number of prefix tokens (CTranslate2 returns them at the start of the sequence)."""
        previous, prefix = fit_prompt(
            self._text_tokens(request.stream_prompt),
            self._text_tokens(request.prompt),
            self._text_tokens(request.prefix),
        )
        prompt: list[int] = self._model.get_prompt(tokenizer, previous, without_timestamps=True)
        return prompt + prefix, len(prefix)

    def transcribe_batch(self, requests: Sequence[EngineRequest]) -> list[EngineResult]:
        from faster_whisper.transcribe import get_suppressed_tokens

        phase = self.phases.phase
        with phase("languages"):
            languages = self.languages(requests)
        tokenizers = [
            self._tokenizer(choice.language, r.task)
            for choice, r in zip(languages, requests, strict=True)
        ]
        planned = [self._prompt(t, r) for t, r in zip(tokenizers, requests, strict=True)]
        prompts = [prompt for prompt, _ in planned]
        limits = [_limits(r, *plan) for r, plan in zip(requests, planned, strict=True)]
        # One encode + generate per group: requests share a window length, a beam size, a
        # prompt shape (CTranslate2 needs <|startoftranscript|> at one position in a batch, and
        # prompts of one length) and a max_length.
        groups: dict[tuple[int, int, int, int, int], list[int]] = {}
        for i, r in enumerate(requests):
            sot = prompts[i].index(tokenizers[i].sot)
            frames = window_frames(r, self._partial_min_frames)
            key = (frames, r.beam_size, sot, len(prompts[i]), limits[i][1])
            groups.setdefault(key, []).append(i)
        results: dict[int, EngineResult] = {}
        for (frames, beam, _, _, max_length), idx in sorted(groups.items()):
            with phase("encode"):
                features = np.stack([self.features(requests[i].audio, frames) for i in idx])
                encoded = self._model.encode(features)
            # A greedy partial's per-step distributions give its words' probabilities.
            partials = beam == 1 and any(requests[i].kind is DecodeKind.PARTIAL for i in idx)
            with phase("generate"):
                generated = self._decoder.generate(
                    encoded,
                    [prompts[i] for i in idx],
                    beam_size=beam,
                    max_length=max_length,
                    return_scores=True,
                    return_logits_vocab=partials,
                    return_no_speech_prob=True,
                    suppress_blank=True,
                    suppress_tokens=get_suppressed_tokens(tokenizers[idx[0]], [-1]),
                )
            words: dict[int, tuple[WordTiming, ...]] = {}
            if any(requests[i].kind is DecodeKind.FINAL for i in idx):
                with phase("align"):
                    words = self._align(
                        encoded,
                        features,
                        [(requests[i], tokenizers[i], planned[i][1]) for i in idx],
                        [list(out.sequences_ids[0]) for out in generated],
                        frames,
                    )
            with phase("results"):
                for k, (i, out) in enumerate(zip(idx, generated, strict=True)):
                    partial = requests[i].kind is DecodeKind.PARTIAL
                    n_prefix, budget = planned[i][1], limits[i][0]
                    result = self._result(tokenizers[i], out, n_prefix, partial, budget)
                    choice = languages[i]
                    results[i] = dataclasses.replace(
                        result,
                        language=choice.language,
                        language_probability=choice.probability,
                        switch_language=choice.switch_language,
                        switch_nats=choice.switch_nats,
                        words=words.get(k, ()),
                    )
        return [results[i] for i in range(len(requests))]

    def _align(
        self,
        encoded: Any,
        features: npt.NDArray[np.float32],
        rows: Sequence[tuple[EngineRequest, Any, int]],
        sequences: Sequence[list[int]],
        frames: int,
    ) -> dict[int, tuple[WordTiming, ...]]:
        """The words of each final row of one generate batch, from CTranslate2's `align` (the
        alignment heads' cross-attention and DTW, as faster-whisper's `word_timestamps`): the
        whole sequence, forced prefix included, is aligned over the window, and the words are
        those after the prefix (engines/timing.py). `align` takes one start sequence for its
        batch: rows in one language share the batch's encoder output, and a batch of several
        languages (rare: a mixed meeting) aligns each language's rows from their features."""
        finals = [k for k, (request, _, _) in enumerate(rows) if request.kind is DecodeKind.FINAL]
        by_start: dict[tuple[int, ...], list[int]] = {}
        for k in finals:
            by_start.setdefault(tuple(rows[k][1].sot_sequence), []).append(k)
        # One language: every row is aligned on the batch's own encoder output, the partials'
        # too (their words are dropped below), since `align` takes the whole batch's output and
        # aligning a partial costs less than encoding the finals' features again.
        if len(by_start) == 1:
            by_start = {start: list(range(len(rows))) for start in by_start}
        words: dict[int, tuple[WordTiming, ...]] = {}
        for start, members in by_start.items():
            whole = len(members) == len(rows)
            source = encoded if whole else np.ascontiguousarray(features[members])
            content = [min(frames, max(1, len(rows[k][0].audio) // HOP_SAMPLES)) for k in members]
            aligned = self._decoder.align(
                source,
                list(start),
                [sequences[k] for k in members],
                content,
                median_filter_width=MEDIAN_FILTER_WIDTH,
            )
            for k, alignment in zip(members, aligned, strict=True):
                request, tokenizer, n_prefix = rows[k]
                if request.kind is not DecodeKind.FINAL:
                    continue
                words[k] = _words(tokenizer, sequences[k], n_prefix, alignment, request)
        return words

    def _result(
        self, tokenizer: Any, out: Any, n_prefix: int, partial: bool, budget: int
    ) -> EngineResult:
        """`budget`: the tokens the decode could write (`new_token_budget`); CTranslate2 leaves
        <|endoftext|> out of the sequence, so one that used them all never wrote it."""
        sequence = list(out.sequences_ids[0])
        tokens = sequence[n_prefix:]
        # CTranslate2's score is the cumulative log-prob over the whole sequence (forced prefix
        # tokens count 0) divided by its length (penalty 1); Whisper's avg_logprob divides it
        # by the generated tokens + 1 (faster-whisper's rule, here without the prefix).
        avg_logprob = out.scores[0] * len(sequence) / (len(tokens) + 1)
        written = tokenizer.decode(tokens)
        text = written.strip()
        unit_probs: tuple[float, ...] = ()
        # logits[0][k] is the distribution sequence[k] was chosen from (greedy decodes only).
        steps = out.logits[0][n_prefix : len(sequence)] if out.logits else []
        if partial and len(steps) == len(tokens):
            probs = token_probabilities(steps, tokens, self._case_variants)
            unit_probs = unit_probabilities(tokenizer.decode, tokens, probs)
        return EngineResult(
            text=text,
            tokens=tuple(tokens),
            avg_logprob=float(avg_logprob),
            no_speech_prob=float(out.no_speech_prob),
            compression_ratio=compression_ratio(text),
            unit_probs=unit_probs,
            spaced=begins_with_space(written),
            truncated=len(tokens) >= budget,
        )


def _words(
    tokenizer: Any, sequence: list[int], n_prefix: int, alignment: Any, request: EngineRequest
) -> tuple[WordTiming, ...]:
    """One aligned row's words: a token starts where the DTW path first reaches it (the
    path's jumps, as faster-whisper's find_alignment), <|endoftext|>'s start ends the last."""
    path = np.asarray(alignment.alignments, dtype=np.int64).reshape(-1, 2)
    if not len(sequence) or not len(path):
        return ()
    jumps = np.diff(path[:, 0], prepend=-1).astype(bool)
    starts = path[jumps, 1]
    if len(starts) < len(sequence) + 1:
        return ()  # a path that never reached <|endoftext|>: no times to give
    eot = tokenizer.eot

    def split(tokens: list[int]) -> tuple[list[str], list[list[int]]]:
        texts, groups = tokenizer.split_to_word_tokens([*tokens, eot])
        return list(texts[:-1]), [list(g) for g in groups[:-1]]

    return words_of(
        sequence,
        [int(s) for s in starts[: len(sequence)]],
        int(starts[len(sequence)]),
        list(alignment.text_token_probs),
        split,
        first_token=n_prefix,
        window_s=len(request.audio) / SAMPLE_RATE_HZ,
    )


def _limits(
    request: EngineRequest, prompt_and_prefix: Sequence[int], n_prefix: int
) -> tuple[int, int]:
    """The tokens the decode may write after its prefix (`new_token_budget`, or a partial's
    `partial_token_cap` below it), and the `max_length` that tells CTranslate2 so: the
    smallest whose budget (`new_token_budget` with it) is the cap."""
    prompt_tokens = len(prompt_and_prefix) - n_prefix
    budget = new_token_budget(prompt_tokens, n_prefix)
    cap = partial_token_cap(request)
    if cap is None or cap >= budget:
        return budget, MAX_LENGTH
    written = n_prefix + cap  # prefix included
    max_length = max(2 * written, written + prompt_tokens - 1)
    assert new_token_budget(prompt_tokens, n_prefix, max_length) == cap
    return cap, max_length


def token_probabilities(
    steps: Sequence[Any], tokens: Sequence[int], variants: Sequence[Sequence[int]]
) -> list[float]:
    """softmax(step) summed over the token's `case_variants` (a token past them: its own), for
    each of CTranslate2's per-step logits vectors (in float64)."""
    probs = []
    for step, token in zip(steps, tokens, strict=True):
        logits = np.asarray(step, dtype=np.float64)
        shifted = np.exp(logits - logits.max())
        same = list(variants[token]) if token < len(variants) else [token]
        probs.append(float(shifted[same].sum() / shifted.sum()))
    return probs


# What `transcribe_whole_file` passes to faster-whisper besides the language and the mode, as
# the bench JSONs that compare against the reference record it. The temperatures are
# faster-whisper's default fallback: a window whose text repeats itself (compression ratio over
# 2.4) or that the model doubts (average log-prob under -1) is decoded again at the next one.
# At temperature 0 alone the reference looped: on 5 of the 353 English utterances (tiny.en,
# 1,545 errors in 3,144 words against 778 with the fallback), on 58 s of German turns.
WHOLE_FILE_SETTINGS: Mapping[str, object] = MappingProxyType(
    {"beam_size": 5, "temperature": (0.0, 0.2, 0.4, 0.6, 0.8, 1.0), "vad_filter": False}
)


def whole_file_compute_type(engine: EngineConfig) -> str:
    """The compute type the reference decodes with on the CPU: the engine's own when the engine
    is faster-whisper on the CPU, else float32 (torch_graph's CPU path is FP32; a GPU
    engine's float16 is compared with float32 on the CPU)."""
    resolved = resolve_engine_config(engine)
    on_cpu = resolved.name == "faster-whisper" and resolved.device == "cpu"
    return resolved.compute_type if on_cpu else "float32"


def transcribe_whole_file(
    model_path: Path,
    audio: npt.NDArray[np.float32],
    *,
    device: str,
    compute_type: str,
    language: str | None,
    without_timestamps: bool = False,
    chinese_variant: str = "",
) -> str:
    """The accuracy reference: faster-whisper's own long-form `transcribe` of a whole recording
    (whole_file_segments). `without_timestamps` decodes text tokens only, as captiond's decodes
    do; Chinese is written in `chinese_variant`'s script, as captiond writes it
    (lang/chinese.py)."""
    segments, spoken = whole_file_segments(
        model_path,
        audio,
        device=device,
        compute_type=compute_type,
        language=language,
        without_timestamps=without_timestamps,
    )
    return written(segments_text(segments), spoken, chinese_variant)


def whole_file_segments(
    model_path: Path,
    audio: npt.NDArray[np.float32],
    *,
    device: str,
    compute_type: str,
    language: str | None,
    without_timestamps: bool = False,
    word_timestamps: bool = False,
) -> tuple[list[Segment], str]:
    """faster-whisper's `transcribe` of a whole recording as a user runs it afterwards (its
    30-s windows, timestamps, previous-text conditioning), beam 5, its temperature fallback, no
    VAD: the segments (with `word_timestamps`, their words) and the language spoken."""
    import ctranslate2
    from faster_whisper import WhisperModel

    model = WhisperModel(str(model_path), device=device, compute_type=compute_type)
    # A window decoded again above temperature 0 is sampled. CTranslate2 seeds each of its
    # threads' generators on first use, and this model's threads are new: a rerun gives the
    # same reference.
    ctranslate2.set_random_seed(0)
    segments, info = model.transcribe(
        audio,
        language=language,
        without_timestamps=without_timestamps,
        word_timestamps=word_timestamps,
        **WHOLE_FILE_SETTINGS,
    )
    return list(segments), info.language


def segments_text(segments: Iterable[Segment]) -> str:
    """The text of a `transcribe`'s segments, one space between them, empty ones left out."""
    return " ".join(s.text.strip() for s in segments if s.text.strip())
