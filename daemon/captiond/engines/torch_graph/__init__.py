"""The torch_graph engine: FP16 Whisper with a CUDA-graph-captured decoder, batched across streams.

Owns the wiring of weights, stream audio, mel front end, encoder, static KV cache, greedy and beam
decoders and step graphs behind the `Engine` protocol. Built on the main thread by `load_engine`;
every other call (warmup, transcribe_batch, close) runs on the engine thread only. This package is
the only place in the daemon that imports torch (the bench's transformers peer is the other).

Per batch: the audio the device lacks of each request's stream (normally only what arrived since the
stream's last decode) through a pinned buffer into the stream's ring on the device, log-mel there of
each window gathered from its ring, one batched encoder pass per window length (partials encode a
trimmed window, as faster-whisper's; rows longest first) writing cross-attention K/V, language
detection where a request asks for it (one eager decoder step; requests whose detection window
starts later get their own batched encoder pass first), an eager prefill of the prompts (language
and task tokens included), then the single-token step replayed from a CUDA graph of the batch's
bucket; every `check_every_steps` steps, rows caught in a loop are stopped and the host looks at
the finished flags. Requests that ask for a beam (finals, by default) decode in batches of their
own, one per beam size, with CTranslate2's beam search (beam.py), eagerly. The finals' words are
then aligned on the device from the same cross-attention cache, eagerly, outside the graphs
(align.py). On the CPU the same code runs eagerly in FP32 (how CI tests it).
"""

from __future__ import annotations

import itertools
import logging
import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from captiond.config import EngineConfig
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
    compression_ratio,
    partial_token_cap,
    request_language,
    unit_probabilities,
    window_frames,
)
from captiond.engines.torch_graph.align import Aligner, alignment_heads
from captiond.engines.torch_graph.beam import BeamBatch
from captiond.engines.torch_graph.cuda_graph import StepGraphs, bucket_for, bucket_sizes
from captiond.engines.torch_graph.decode import DecodedRow, GreedyDecoder
from captiond.engines.torch_graph.kv_cache import allocate_cache, bytes_per_row
from captiond.engines.torch_graph.mel import MelFrontend
from captiond.engines.torch_graph.model import build_model, inference
from captiond.engines.torch_graph.stream_audio import RING_SAMPLES, Clip, StreamAudio
from captiond.engines.torch_graph.tokens import PromptPlan, WhisperTokens
from captiond.engines.torch_graph.weights import (
    ModelDims,
    dims_from_tensors,
    load_tensors,
    random_tensors,
)
from captiond.whisper import N_FRAMES, SAMPLE_RATE_HZ

__all__ = ["TorchGraphEngine"]

logger = logging.getLogger(__name__)

# Buckets up to this many rows. On CUDA the largest power of two up to 128 whose KV cache fits a
# quarter of the GPU's memory, at most 16 GiB (80 GB H100: tiny.en and base 128 rows, 1.4 and
# 2.9 GiB; large-v3 32, 9.5 GiB); batches of 32 were the ceiling at 500 streams on an H100. The
# CPU default stays small (its KV cache is FP32 and in RAM).
MAX_BATCH_CUDA = 128
KV_CACHE_BUDGET_BYTES = 16 * 2**30
DEFAULT_MAX_BATCH_CPU = 8
# The streams whose audio stays on the device between decodes (stream_audio.py), 2 MiB each: on
# CUDA what fits a sixteenth of the GPU's memory, at most 4 GiB with the scratch rings (80 GB
# H100: 1,920 streams with batches of 128); on the CPU two batches' worth.
STREAM_AUDIO_BUDGET_BYTES = 4 * 2**30
WARMUP_AUDIO_SAMPLES = SAMPLE_RATE_HZ  # one second
CHECK_EVERY_STEPS_CUDA = 8


def resolve_device(name: str) -> torch.device:
    """`auto` is CUDA when torch sees a GPU, else the CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def _cuda_max_batch(dims: ModelDims, dtype: torch.dtype, device_bytes: int) -> int:
    budget_bytes = min(KV_CACHE_BUDGET_BYTES, device_bytes // 4)
    rows = MAX_BATCH_CUDA
    while rows > 1 and rows * bytes_per_row(dims, dtype) > budget_bytes:
        rows //= 2
    return rows


def _stream_rings(max_batch: int, device_bytes: int | None) -> int:
    """Stream rings for the device: see STREAM_AUDIO_BUDGET_BYTES (None: the CPU)."""
    ring_bytes = RING_SAMPLES * 4
    if device_bytes is None:
        return 2 * max_batch
    budget_bytes = min(STREAM_AUDIO_BUDGET_BYTES, device_bytes // 16)
    return max(2 * max_batch, budget_bytes // ring_bytes - max_batch)


def _detect_offset(request: EngineRequest) -> int:
    """Where detection's window starts: `detect_from_sample`, or 0 when that leaves no audio."""
    offset = request.detect_from_sample
    return offset if 0 < offset < len(request.audio) else 0


class TorchGraphEngine:
    """Whisper decoding that matches faster-whisper's tokens (no timestamps): greedy, or
    CTranslate2's beam search where `request.beam_size > 1` (eager; the graphs are the greedy
    step's). Multilingual models decode in `request.language`, or, when it is None, in the
    language `choose_language` picks from Whisper's detection on
    `request.audio[request.detect_from_sample:]`, `request.language_hint` and
    `request.candidates`; `request.task` "translate" puts <|translate|> in the prompt.
    English-only models always decode English (reported as ("en", 1.0)).

    `compute_type="float32"` keeps FP32 on CUDA; any other value means FP16 there. On the CPU the
    model always runs in FP32. `graphs=None` captures graphs on CUDA only; False runs the same
    step eagerly (debugging, tests). `check_every_steps` (default 8 on CUDA, 1 on the CPU): how
    often loops are stopped and the host looks at the finished flags. `random_shape` ("tiny" ...
    "large-v3") replaces the weights with random ones of that size for speed work; the tokenizer
    still comes from `model_path`.
    """

    def __init__(
        self,
        model_path: Path,
        config: EngineConfig,
        *,
        graphs: bool | None = None,
        max_batch: int | None = None,
        check_every_steps: int | None = None,
        random_shape: str | None = None,
    ) -> None:
        self.device = resolve_device(config.device)
        on_cuda = self.device.type == "cuda"
        if graphs and not on_cuda:
            raise ValueError("CUDA graphs need --device cuda")
        if config.cpu_threads > 0:
            torch.set_num_threads(config.cpu_threads)
        fp16 = on_cuda and config.compute_type != "float32"
        self.dtype = torch.float16 if fp16 else torch.float32
        if random_shape is None:
            tensors = load_tensors(model_path / "model.bin", self.device, self.dtype)
            self._model_name = model_display_name(model_path)
        else:
            tensors = random_tensors(random_shape, self.device, self.dtype)
            self._model_name = f"random-{random_shape}"
        dims = dims_from_tensors(tensors)
        self.model = build_model(tensors, dims)
        self.tokens = WhisperTokens(model_path, dims.n_vocab)
        if max_batch is None:
            max_batch = (
                _cuda_max_batch(
                    dims, self.dtype, torch.cuda.get_device_properties(self.device).total_memory
                )
                if on_cuda
                else DEFAULT_MAX_BATCH_CPU
            )
        self.max_batch = max_batch
        if check_every_steps is None:
            # On CUDA a look at the finished flags waits for the device; on the CPU it costs
            # nothing, and a step past the end costs a whole step.
            check_every_steps = CHECK_EVERY_STEPS_CUDA if on_cuda else 1
        self.check_every_steps = check_every_steps
        self._partial_min_frames = round(config.partial_window_min_s * 100)
        self._phases = PhaseTimes()
        self.cache = allocate_cache(dims, max_batch, self.device, self.dtype)
        device_bytes = (
            torch.cuda.get_device_properties(self.device).total_memory if on_cuda else None
        )
        self.audio = StreamAudio(_stream_rings(max_batch, device_bytes), max_batch, self.device)
        self.mel = MelFrontend(dims.n_mels, self.audio, self.device)
        self.decoder = GreedyDecoder(self.model, self.cache, self.tokens, self.device)
        self.aligner = Aligner(
            self.model, self.cache, self.tokens, alignment_heads(model_path, dims)
        )
        use_graphs = on_cuda if graphs is None else graphs
        self.graphs = StepGraphs(
            self.decoder.step,
            bucket_sizes(max_batch),
            enabled=use_graphs,
            compiled=config.compile_step and on_cuda,
        )
        logger.info(
            "torch_graph: %s on %s (%s), max batch %d, KV cache %.1f MiB, "
            "audio of %d streams %.1f MiB",
            self._model_name,
            self.device,
            str(self.dtype).removeprefix("torch."),
            max_batch,
            self.cache.n_bytes / 2**20,
            self.audio.n_streams,
            self.audio.n_bytes / 2**20,
        )

    @property
    def phases(self) -> PhaseTimes:
        """encode (new audio to the device, log-mel, encoder, detection), prefill (prompts and
        their prefill), decode (the steps, waiting on the finished flags), read_back (the last
        wait for the device and the copy back), align (the finals' word timings, align.py), results
        (text and word probabilities). On CUDA
        the device work is asynchronous: a phase that only queues work is fast, and the waits
        for it show in decode and read_back."""
        return self._phases

    @property
    def name(self) -> str:
        return "torch_graph"

    @property
    def model_name(self) -> str:
        return self._model_name

    @property
    def multilingual(self) -> bool:
        return self.tokens.multilingual

    @property
    def tokenizer_path(self) -> str:
        return self.tokens.tokenizer_path

    @property
    def known_languages(self) -> frozenset[str]:
        return frozenset(self.tokens.language_codes) if self.multilingual else frozenset({"en"})

    def warmup(self) -> None:
        """One eager batch (kernel selection, language detection on multilingual models), then
        graph capture for every bucket (on CUDA)."""
        silence = EngineRequest(
            audio=np.zeros(WARMUP_AUDIO_SAMPLES, dtype=np.float32),
            kind=DecodeKind.PARTIAL,
            language=None,
        )
        self.transcribe_batch([silence])
        with inference():
            self.graphs.capture()

    def transcribe_batch(self, requests: Sequence[EngineRequest]) -> list[EngineResult]:
        """Greedy requests in batches of up to `max_batch`; each beam size in batches of its
        own, of up to `max_batch` // beam requests (a beam wider than `max_batch` is cut to
        it)."""
        by_beam: dict[int, list[int]] = {}
        for i, request in enumerate(requests):
            by_beam.setdefault(min(request.beam_size, self.max_batch), []).append(i)
        results: dict[int, EngineResult] = {}
        for beam, indices in sorted(by_beam.items()):
            size = self.max_batch // beam
            for start in range(0, len(indices), size):
                chunk = indices[start : start + size]
                decoded = self._transcribe_chunk([requests[i] for i in chunk], beam)
                results.update(zip(chunk, decoded, strict=True))
        return [results[i] for i in range(len(requests))]

    def _transcribe_chunk(self, requests: Sequence[EngineRequest], beam: int) -> list[EngineResult]:
        """Rows ordered by window length, longest first, so each length's rows are one encoder
        call; the results come back in the requests' order."""
        frames = [window_frames(r, self._partial_min_frames) for r in requests]
        order = sorted(range(len(requests)), key=lambda i: -frames[i])
        decoded = self._decode_rows([requests[i] for i in order], [frames[i] for i in order], beam)
        row_of = {i: row for row, i in enumerate(order)}
        return [decoded[row_of[i]] for i in range(len(requests))]

    def _decode_rows(
        self, requests: Sequence[EngineRequest], frames: Sequence[int], beam: int
    ) -> list[EngineResult]:
        n = len(requests)
        if n == 0:
            return []
        phase = self.phases.phase
        with inference():
            with phase("encode"):
                languages = self._encode_and_detect(requests, frames)
            with phase("prefill"):  # the prompts' tokens; the decoders' prefill adds to it
                plans = [
                    self.tokens.prompt(
                        r.prompt,
                        choice.language,
                        r.prefix,
                        r.task,
                        stream_prompt=r.stream_prompt,
                        cap=partial_token_cap(r),
                    )
                    for r, choice in zip(requests, languages, strict=True)
                ]
            rows = self._greedy(plans) if beam == 1 else self._beam(plans, beam)
            finals = [i for i, r in enumerate(requests) if r.kind is DecodeKind.FINAL]
            words: dict[int, tuple[WordTiming, ...]] = {}
            if finals:
                with phase("align"):
                    aligned = self.aligner.words(
                        [plans[i] for i in finals],
                        [rows[i].tokens for i in finals],
                        # A beam's request r keeps its cross-attention on rows r * beam ...
                        [i * beam for i in finals],
                        [len(requests[i].audio) for i in finals],
                        [frames[i] for i in finals],
                        [languages[i].language for i in finals],
                    )
                    words = dict(zip(finals, aligned, strict=True))
        with phase("results"):
            return self._results(rows, requests, languages, words)

    def _greedy(self, plans: Sequence[PromptPlan]) -> list[DecodedRow]:
        """The prefill chooses each row's first token; the bucket's step graph the rest."""
        n = len(plans)
        bucket = bucket_for(n, self.graphs.buckets)
        phase = self.phases.phase
        with phase("prefill"):
            no_speech = self.decoder.prefill(plans, bucket)
        with phase("decode"):
            for step in range(max(plan.max_new_tokens for plan in plans) - 1):
                self.graphs.run(bucket)
                if (step + 1) % self.check_every_steps == 0:
                    self.decoder.stop_loops(n)
                    if self.decoder.all_finished(n):
                        break
        with phase("read_back"):
            return self.decoder.read_back(no_speech, n)

    def _beam(self, plans: Sequence[PromptPlan], beam: int) -> list[DecodedRow]:
        """CTranslate2's beam search (beam.py), eagerly."""
        phase = self.phases.phase
        with phase("prefill"):
            batch = BeamBatch(self.decoder, plans, beam)
        with phase("decode"):
            batch.run(self.check_every_steps)
        with phase("read_back"):
            return batch.read_back()

    def _results(
        self,
        rows: Sequence[DecodedRow],
        requests: Sequence[EngineRequest],
        languages: Sequence[LanguageChoice],
        words: dict[int, tuple[WordTiming, ...]],
    ) -> list[EngineResult]:
        """Text, compression ratio, (partials) word probabilities and (finals) words of each
        decoded row."""
        results = []
        for i, (row, request, choice) in enumerate(zip(rows, requests, languages, strict=True)):
            written = self.tokens.decode(row.tokens)
            text = written.strip()
            unit_probs: tuple[float, ...] = ()
            # Finals need no word probabilities, and a beam's choice is not one token's.
            if request.kind is DecodeKind.PARTIAL and row.token_logprobs:
                probs = [math.exp(p) for p in row.token_logprobs]
                unit_probs = unit_probabilities(self.tokens.decode_words, row.tokens, probs)
            results.append(
                EngineResult(
                    text=text,
                    tokens=row.tokens,
                    avg_logprob=row.avg_logprob,
                    no_speech_prob=row.no_speech_prob,
                    compression_ratio=compression_ratio(text),
                    language=choice.language,
                    language_probability=choice.probability,
                    switch_language=choice.switch_language,
                    switch_nats=choice.switch_nats,
                    unit_probs=unit_probs,
                    spaced=begins_with_space(written),
                    truncated=row.truncated,
                    looped=row.looped,
                    words=words.get(i, ()),
                )
            )
        return results

    def _encode(self, clips: Sequence[Clip], frames: Sequence[int] | None = None) -> None:
        """Log-mel and encoder for `clips`, into the first rows of the cross-attention cache:
        one encoder call per run of equal `frames` (mel frames, 30-s windows when None)."""
        mel = self.mel.log_mel(clips).to(self.dtype)
        first = 0
        for length, run in itertools.groupby(frames or [N_FRAMES] * len(clips)):
            rows = len(list(run))
            self.decoder.encode(mel[first : first + rows, :, :length], first)
            first += rows

    def _encode_and_detect(
        self, requests: Sequence[EngineRequest], frames: Sequence[int]
    ) -> list[LanguageChoice]:
        """Encode the decode windows (`frames` mel frames each, equal ones adjacent; left in
        the cross-attention cache for the prefill) and return each request's decode language
        and its probability, detecting where asked.

        Detection sees a full 30-s window (as faster-whisper's). Those that start later than
        the decode window, or whose decode window is shorter, are encoded first, as one batch
        of their own; the others are the decode window, so detection reads the decode
        encoding. One host transfer brings every probability back.
        """
        clips = self.audio.put(requests)
        detect = [i for i, r in enumerate(requests) if r.language is None and self.multilingual]
        shifted = [i for i in detect if _detect_offset(requests[i]) > 0 or frames[i] < N_FRAMES]
        detected: list[torch.Tensor] = []
        if shifted:
            self._encode([clips[i].after(_detect_offset(requests[i])) for i in shifted])
            detected.append(self.decoder.language_probs(len(shifted)))
        self._encode(clips, frames)
        in_place = [i for i in detect if i not in shifted]
        if in_place:
            # Rows 0 .. last in-place row; the rows between cost one token each.
            probs = self.decoder.language_probs(in_place[-1] + 1)
            detected.append(probs[torch.tensor(in_place, device=probs.device)])
        chosen = [
            LanguageChoice("en" if r.language is None or not self.multilingual else r.language, 1.0)
            for r in requests
        ]
        if not detect:
            return chosen
        rows = torch.cat(detected).cpu().tolist()
        codes = self.tokens.language_codes
        for i, row in zip(shifted + in_place, rows, strict=True):
            chosen[i] = request_language(requests[i], dict(zip(codes, row, strict=True)))
        return chosen

    def close(self) -> None:
        self.graphs.reset()
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
