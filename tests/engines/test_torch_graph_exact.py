"""torch_graph on the CPU (FP32, eager) against faster-whisper on the real model and real speech.

Greedy tokens must be identical to CTranslate2's generate (beam 1, no timestamps, same prompt,
same suppression) on the same padded 3000-frame features; log-mel within 1e-4 of faster-whisper's
FeatureExtractor; a mixed batch must decode exactly as its requests one at a time. Partials encode
a window shorter than 30 s, as faster-whisper's partials do, and must match its decode of it.
"""

from __future__ import annotations

import dataclasses
import wave
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest

torch = pytest.importorskip("torch")

from captiond.config import EngineConfig  # noqa: E402
from captiond.engines.base import (  # noqa: E402
    DecodeKind,
    Engine,
    EngineRequest,
    EngineResult,
    WordTiming,
)
from captiond.engines.faster_whisper import token_probabilities  # noqa: E402
from captiond.engines.models import resolve_model  # noqa: E402
from captiond.engines.rules import partial_token_cap, unit_probabilities, window_frames  # noqa: E402
from captiond.engines.torch_graph import TorchGraphEngine  # noqa: E402
from captiond.engines.torch_graph.decode import (  # noqa: E402
    LOOP_MAX_PERIOD_TOKENS,
    LOOP_RUN_TOKENS,
)
from captiond.engines.torch_graph.mel import N_FRAMES  # noqa: E402
from captiond.lang.text import units  # noqa: E402

pytestmark = pytest.mark.model

N_UTTERANCES = 18
N_NONSPEECH = 2
LONG_WINDOWS_S = ((0.0, 25.0), (60.0, 85.0))


def _read_wav(path: Path) -> npt.NDArray[np.float32]:
    with wave.open(str(path), "rb") as wf:
        assert wf.getframerate() == 16_000 and wf.getnchannels() == 1
        samples = np.frombuffer(wf.readframes(wf.getnframes()), dtype="<i2")
    return (samples.astype(np.float32) / 32768.0).astype(np.float32)


@pytest.fixture(scope="module")
def clips(speech_dir: Path, speech_manifest: list[dict[str, Any]]) -> list[EngineRequest]:
    """Utterances spread over every source, two non-speech clips, two 25-s long-clip windows.

    Every third request carries the previous utterance's reference text as its prompt; every
    third, starting with the second, its own first words as a forced prefix (as a decode with
    context or stable words does), one of them together with a prompt; one long window too.
    Every fourth, starting with the fourth, has a stream prompt (names, as a client gives).
    """
    utterances = [e for e in speech_manifest if e["kind"] == "utterance" and e["duration_s"] <= 30]
    stride = max(1, len(utterances) // N_UTTERANCES)
    chosen = utterances[::stride][:N_UTTERANCES]
    chosen += [e for e in speech_manifest if e["kind"] == "nonspeech"][:N_NONSPEECH]
    requests = []
    for i, entry in enumerate(chosen):
        prompt = chosen[i - 1]["text"][:200] if i % 3 == 2 or i == 4 else ""
        prefix = " ".join(entry["text"].split()[:5]) if i % 3 == 1 else ""
        audio = _read_wav(speech_dir / entry["file"])[: 30 * 16_000]
        stream_prompt = "Philip Steels, Grafana, Dr. Okafor." if i % 4 == 3 else ""
        requests.append(
            EngineRequest(
                audio=audio,
                kind=DecodeKind.FINAL,
                prompt=prompt,
                prefix=prefix,
                stream_prompt=stream_prompt,
            )
        )
    long_entry = next(e for e in speech_manifest if e["kind"] == "long" and e["duration_s"] > 90)
    long_audio = _read_wav(speech_dir / long_entry["file"])
    for start_s, end_s in LONG_WINDOWS_S:
        window = long_audio[int(start_s * 16_000) : int(end_s * 16_000)]
        requests.append(EngineRequest(audio=window, kind=DecodeKind.FINAL))
    # The first window again, with the text of its first seconds forced.
    first_words = " ".join(long_entry["text"].split()[:12])
    requests.append(
        EngineRequest(audio=requests[-2].audio, kind=DecodeKind.FINAL, prefix=first_words)
    )
    return requests


@pytest.fixture(scope="module")
def model_path() -> Path:
    return resolve_model(None)


@pytest.fixture(scope="module")
def engine(model_path: Path) -> TorchGraphEngine:
    config = EngineConfig(name="torch_graph", device="cpu", compute_type="float32")
    return TorchGraphEngine(model_path, config, max_batch=8)


@pytest.fixture(scope="module")
def reference(model_path: Path) -> Engine:
    """captiond's faster-whisper engine in float32, for what it adds to CTranslate2's result."""
    from captiond.engines.faster_whisper import FasterWhisperEngine

    config = EngineConfig(name="faster-whisper", device="cpu", compute_type="float32")
    return FasterWhisperEngine(model_path, config)


@pytest.fixture(scope="module")
def faster_whisper_model(model_path: Path) -> Any:
    faster_whisper = pytest.importorskip("faster_whisper")
    return faster_whisper.WhisperModel(str(model_path), device="cpu", compute_type="float32")


@pytest.fixture(scope="module")
def singles(engine: TorchGraphEngine, clips: list[EngineRequest]) -> list[EngineResult]:
    return [engine.transcribe_batch([request])[0] for request in clips]


def _reference_features(
    model: Any, audio: npt.NDArray[np.float32], frames: int = N_FRAMES
) -> npt.NDArray[np.float32]:
    # As faster-whisper's `transcribe` and captiond's faster-whisper engine: one frame fewer.
    features = model.feature_extractor(audio)[:, :-1][:, :frames]
    padded = np.zeros((features.shape[0], frames), dtype=np.float32)
    padded[:, : features.shape[1]] = features
    return padded


def _reference_decode(
    model: Any, request: EngineRequest, frames: int = N_FRAMES
) -> tuple[Any, int]:
    """CTranslate2's result for the request, and how many prefix tokens start its sequence."""
    from faster_whisper.tokenizer import Tokenizer
    from faster_whisper.transcribe import get_suppressed_tokens

    tokenizer = Tokenizer(model.hf_tokenizer, model.model.is_multilingual, "transcribe", "en")
    previous = tokenizer.encode(" " + request.prompt.strip()) if request.prompt.strip() else []
    prefix = request.prefix or None
    # A stream prompt is faster-whisper's `hotwords`, which it drops when there is a prefix;
    # captiond keeps it there too, in the same place: first in the previous text.
    hotwords = request.stream_prompt or None
    if hotwords and prefix:
        previous = tokenizer.encode(" " + hotwords.strip()) + previous
    prompt = model.get_prompt(
        tokenizer, previous, without_timestamps=True, prefix=prefix, hotwords=hotwords
    )
    n_prefix = len(tokenizer.encode(" " + request.prefix.strip())) if prefix else 0
    # faster-whisper's default suppress_tokens=[-1] resolved, plus -1 for config.json's list.
    suppress = [-1, *get_suppressed_tokens(tokenizer, [-1])]
    encoded = model.encode(_reference_features(model, request.audio, frames)[None])
    return model.model.generate(
        encoded,
        [prompt],
        beam_size=1,
        max_length=448,
        return_scores=True,
        return_logits_vocab=True,
        return_no_speech_prob=True,
        suppress_blank=True,
        suppress_tokens=suppress,
    )[0], n_prefix


def test_log_mel_matches_faster_whisper(
    engine: TorchGraphEngine, faster_whisper_model: Any, clips: list[EngineRequest]
) -> None:
    worst = 0.0
    for request in clips[:: max(1, len(clips) // 6)] + clips[-1:]:
        ours = engine.mel([request.audio])[0].numpy()
        theirs = _reference_features(faster_whisper_model, request.audio)
        worst = max(worst, float(np.abs(ours - theirs).max()))
    print(f"max |log-mel - faster-whisper| = {worst:.2e}")
    assert worst < 1e-4


def test_greedy_tokens_identical_to_faster_whisper(
    engine: TorchGraphEngine,
    faster_whisper_model: Any,
    clips: list[EngineRequest],
    singles: list[EngineResult],
) -> None:
    mismatches = []
    worst_p = 0.0
    # Partials carry word probabilities (stable words need them); finals do not.
    assert all(r.unit_probs == () for r in singles)
    partials = engine.transcribe_batch(
        [dataclasses.replace(r, kind=DecodeKind.PARTIAL) for r in clips]
    )
    trimmed = 0
    for i, (request, ours, partial) in enumerate(zip(clips, singles, partials, strict=True)):
        theirs, n_prefix = _reference_decode(faster_whisper_model, request)
        sequence = list(theirs.sequences_ids[0])
        tokens = sequence[n_prefix:]
        if list(ours.tokens) != tokens:
            mismatches.append(i)
            continue
        # faster-whisper: avg_logprob = score * len / (len + 1) for length_penalty 1; the score
        # is normalised over the whole sequence, ours counts the generated tokens only.
        avg_logprob = theirs.scores[0] * len(sequence) / (len(tokens) + 1)
        assert ours.avg_logprob == pytest.approx(avg_logprob, abs=1e-3)
        assert ours.no_speech_prob == pytest.approx(theirs.no_speech_prob, abs=1e-3)
        # A partial encodes a shorter window (partial_window_min_s), as faster-whisper's does.
        partial_request = dataclasses.replace(request, kind=DecodeKind.PARTIAL)
        frames = window_frames(partial_request, round(EngineConfig().partial_window_min_s * 100))
        trimmed += frames < N_FRAMES
        theirs, n_prefix = _reference_decode(faster_whisper_model, request, frames)
        sequence = list(theirs.sequences_ids[0])
        tokens = sequence[n_prefix:]
        if list(partial.tokens) != tokens:
            mismatches.append(i)
            continue
        # The words' probabilities (stable words need them): CTranslate2's distributions.
        steps = theirs.logits[0][n_prefix : len(sequence)]
        probs = token_probabilities(steps, tokens, engine.tokens.case_variants)
        expected = unit_probabilities(engine.tokens.decode, tokens, probs)
        assert len(partial.unit_probs) == len(expected) == len(units(partial.text))
        gaps = [abs(a - b) for a, b in zip(partial.unit_probs, expected, strict=True)]
        worst_p = max([worst_p, *gaps])
    print(f"{len(clips) - len(mismatches)}/{len(clips)} clips token-identical")
    assert trimmed >= len(clips) // 2, "most partials encode a window shorter than 30 s"
    print(f"max |p(word) - faster-whisper| = {worst_p:.2e}")
    assert worst_p < 0.01
    assert not mismatches, f"token mismatch on clips {mismatches}"


@pytest.fixture(scope="module")
def beam_finals(
    engine: TorchGraphEngine, reference: Engine, clips: list[EngineRequest]
) -> tuple[list[EngineResult], list[EngineResult]]:
    """The clips as finals with the session's beams (5 alone, 3 after a forced prefix), in one
    call to each engine: ours, then faster-whisper float32's."""
    requests = [dataclasses.replace(r, beam_size=3 if r.prefix else 5) for r in clips]
    return engine.transcribe_batch(requests), reference.transcribe_batch(requests)


def test_beam_finals_identical_to_faster_whisper(
    beam_finals: tuple[list[EngineResult], list[EngineResult]], singles: list[EngineResult]
) -> None:
    """Each beam size decodes in batches of its own (in 8 rows, one request of beam 5 or two
    of beam 3, with different prompts), and every result is faster-whisper's beam search's,
    its score included."""
    ours, theirs = beam_finals
    mismatches = [
        i for i, (a, b) in enumerate(zip(ours, theirs, strict=True)) if a.tokens != b.tokens
    ]
    assert not mismatches, f"token mismatch on clips {mismatches}"
    for a, b in zip(ours, theirs, strict=True):
        assert a.text == b.text and a.truncated is b.truncated
        assert a.avg_logprob == pytest.approx(b.avg_logprob, abs=1e-3)
        assert a.no_speech_prob == pytest.approx(b.no_speech_prob, abs=1e-3)
    changed = sum(a.tokens != greedy.tokens for a, greedy in zip(ours, singles, strict=True))
    print(f"{len(ours)} clips token-identical at beam 5/3; the beam changed {changed}")
    assert changed > 0, "the beam decodes as greedy would: the test proves nothing"


def test_word_timings_within_20_ms_of_faster_whisper(
    beam_finals: tuple[list[EngineResult], list[EngineResult]], singles: list[EngineResult]
) -> None:
    """The finals' words (align.py: the alignment heads' cross-attention and DTW on the
    device) are faster-whisper float32's (CTranslate2's `align`): the same words, each start
    and end within one 20-ms encoder frame, each confidence within 1e-3; a greedy final's too
    (the one-at-a-time decodes), whose words the beam's share where the tokens agree."""
    ours, theirs = beam_finals
    worst_s, worst_p, n_words = 0.0, 0.0, 0
    for a, b in zip(ours, theirs, strict=True):
        assert [w.word for w in a.words] == [w.word for w in b.words]
        assert "".join(w.word for w in a.words).strip() == a.text
        for x, y in zip(a.words, b.words, strict=True):
            worst_s = max(worst_s, abs(x.start_s - y.start_s), abs(x.end_s - y.end_s))
            worst_p = max(worst_p, abs(x.probability - y.probability))
        n_words += len(a.words)
    print(
        f"{n_words} words: worst |time - faster-whisper| {worst_s * 1000:.0f} ms, "
        f"worst |confidence - faster-whisper| {worst_p:.1e}"
    )
    assert n_words > 200, "the clips' finals carry words"
    assert worst_s <= 0.020 + 1e-9
    assert worst_p < 1e-3
    same = [(a, g) for a, g in zip(ours, singles, strict=True) if a.tokens == g.tokens]
    assert same and all(_same_words(a.words, g.words) for a, g in same)


def _same_words(a: tuple[WordTiming, ...], b: tuple[WordTiming, ...]) -> bool:
    """The same words and times; confidences as equal as two batches' arithmetic allows."""
    times = [(w.word, w.start_s, w.end_s) for w in a] == [(w.word, w.start_s, w.end_s) for w in b]
    return times and all(
        x.probability == pytest.approx(y.probability, abs=1e-4) for x, y in zip(a, b, strict=True)
    )


@pytest.mark.parametrize("beam", [1, 5])
def test_both_engines_say_when_a_decode_runs_out_of_tokens(
    engine: TorchGraphEngine, reference: Engine, jfk: npt.NDArray[np.float32], beam: int
) -> None:
    """A forced prefix counts in the decode's budget (new_token_budget): after 13 copies of the
    sentence (~220 tokens) the JFK clip has room for a few tokens only. Both engines stop at
    the same token and say so (the session then decodes the final again alone); a beam keeps
    its best hypothesis at the last step."""
    text = "And so, my fellow Americans, ask not what your country can do for you;"
    long_prefix = " ".join([text] * 13)
    budget = engine.tokens.prompt("", "en", long_prefix).max_new_tokens
    assert 0 < budget < 10, "the prefix leaves fewer tokens than the clip's words need"
    for prefix, truncated in (("", False), (long_prefix, True)):
        request = EngineRequest(
            audio=jfk, kind=DecodeKind.FINAL, language="en", prefix=prefix, beam_size=beam
        )
        (ours,) = engine.transcribe_batch([request])
        (theirs,) = reference.transcribe_batch([request])
        assert ours.tokens == theirs.tokens
        assert ours.truncated is theirs.truncated is truncated
        if truncated:
            assert len(ours.tokens) == budget


def test_a_loop_stops_early_where_faster_whisper_runs_to_its_budget(
    engine: TorchGraphEngine, reference: Engine, jfk: npt.NDArray[np.float32]
) -> None:
    """After a forced prefix that repeats itself, greedy Whisper goes on repeating it ("ha ha
    …", one token; "arms, arms, …", two). faster-whisper runs to the budget (over 200 tokens);
    torch_graph stops such a row soon after its last LOOP_RUN_TOKENS tokens repeat
    (`GreedyDecoder.stop_loops`) and says so: the same tokens, cut short. The batch's other row
    goes on to its end."""
    loops = ("Ha ha ha ha ha ha ha ha ha ha ha", "Arms, arms, arms, arms, arms, arms, arms,")
    requests = [
        EngineRequest(audio=jfk, kind=DecodeKind.FINAL, language="en", prefix=prefix)
        for prefix in (*loops, "")
    ]
    ours = engine.transcribe_batch(requests)
    theirs = reference.transcribe_batch(requests)
    latest_stop = LOOP_RUN_TOKENS + LOOP_MAX_PERIOD_TOKENS + engine.check_every_steps
    for looping, their in zip(ours[:2], theirs[:2], strict=True):
        assert their.truncated and not their.looped and len(their.tokens) > 200
        assert looping.looped and looping.truncated
        assert LOOP_RUN_TOKENS < len(looping.tokens) <= latest_stop
        assert looping.tokens == their.tokens[: len(looping.tokens)]
    assert not ours[2].looped and not ours[2].truncated and ours[2].tokens == theirs[2].tokens


def test_both_engines_cap_a_partial_at_the_same_token(
    engine: TorchGraphEngine, reference: Engine, clips: list[EngineRequest]
) -> None:
    """A partial writes at most partial_token_cap tokens: 24 + 12 per started second of its
    utterance. A 25-s reading whose last second is the utterance, after ~90 tokens of previous
    text, is cut at 36 tokens by both engines alike; as a final it is not cut."""
    window = clips[-3]  # the long clip's first 25 s
    partial = dataclasses.replace(
        window,
        kind=DecodeKind.PARTIAL,
        detect_from_sample=len(window.audio) - 16_000,
        # CTranslate2's max_length also bounds the prompt: the cap must leave room for it.
        prompt=" ".join(["The printing of books began in the fifteenth century."] * 8),
    )
    assert partial_token_cap(partial) == 36 and partial_token_cap(window) is None
    for request, truncated in ((partial, True), (window, False)):
        (ours,) = engine.transcribe_batch([request])
        (theirs,) = reference.transcribe_batch([request])
        assert ours.tokens == theirs.tokens
        assert ours.truncated is theirs.truncated is truncated
    assert len(ours.tokens) > 36 and len(engine.transcribe_batch([partial])[0].tokens) == 36


def test_batch_equals_one_at_a_time(
    engine: TorchGraphEngine, clips: list[EngineRequest], singles: list[EngineResult]
) -> None:
    # Mixed lengths, prompts and a 25-s window in one bucket of 8 (6 rows + 2 padding rows).
    picked = [0, 2, 5, 8, len(clips) - 3, len(clips) - 1]
    batched = engine.transcribe_batch([clips[i] for i in picked])
    assert [r.tokens for r in batched] == [singles[i].tokens for i in picked]
    for ours, single in zip(batched, (singles[i] for i in picked), strict=True):
        assert ours.text == single.text
        assert _same_words(ours.words, single.words)
        assert ours.avg_logprob == pytest.approx(single.avg_logprob, abs=1e-4)
        assert ours.no_speech_prob == pytest.approx(single.no_speech_prob, abs=1e-4)


def test_result_fields(singles: list[EngineResult]) -> None:
    speech = singles[0]
    assert speech.text and speech.text == speech.text.strip()
    assert speech.spaced  # Whisper wrote " The…": a first word has a space before it
    assert speech.compression_ratio > 0 and speech.avg_logprob < 0
    assert all(0.0 <= r.no_speech_prob <= 1.0 for r in singles)


def test_english_only_model_decodes_english(
    engine: TorchGraphEngine, clips: list[EngineRequest], singles: list[EngineResult]
) -> None:
    """tiny.en neither detects nor translates: language None and task translate change nothing."""
    assert not engine.multilingual
    request = dataclasses.replace(
        clips[0], language=None, language_hint="de", task="translate", detect_from_sample=8_000
    )
    ours = engine.transcribe_batch([request])[0]
    assert ours.tokens == singles[0].tokens
    assert (ours.language, ours.language_probability) == ("en", 1.0)
    assert (singles[0].language, singles[0].language_probability) == ("en", 1.0)


def test_mixed_window_lengths_batch_as_one_at_a_time(
    engine: TorchGraphEngine, clips: list[EngineRequest], singles: list[EngineResult]
) -> None:
    """Finals (30 s) and partials of several window lengths in one batch: each row decodes as
    it does alone, and the results come back in the requests' order."""
    picked = [len(clips) - 3, 0, 2, len(clips) - 1, 5, 8]
    kinds = [DecodeKind.PARTIAL, DecodeKind.FINAL, DecodeKind.PARTIAL] * 2
    requests = [dataclasses.replace(clips[i], kind=k) for i, k in zip(picked, kinds, strict=True)]
    # 13 s of the long window: a 15-s partial window.
    requests[0] = dataclasses.replace(requests[0], audio=requests[0].audio[: 13 * 16_000])
    frames = {window_frames(r, 1000) for r in requests}
    assert len(frames) >= 3, f"window lengths {frames}: the batch must mix several"
    alone = [engine.transcribe_batch([r])[0] for r in requests]
    batched = engine.transcribe_batch(requests)
    assert [r.tokens for r in batched] == [r.tokens for r in alone]
    for ours, single in zip(batched, alone, strict=True):
        assert ours.avg_logprob == pytest.approx(single.avg_logprob, abs=1e-4)


def test_stream_windows_decode_as_whole_windows(
    engine: TorchGraphEngine, clips: list[EngineRequest]
) -> None:
    """Two streams' growing and sliding windows, batched together: the engine keeps each
    stream's audio and takes only what is new, and every decode equals the same window sent
    whole (no stream)."""
    long_audio = clips[len(clips) - 3].audio  # 25 s
    short_audio = clips[0].audio
    spans = [
        [("long", 0, 6), ("short", 0, 2)],
        [("long", 0, 9), ("short", 0, len(short_audio) / 16_000)],
        [("long", 4, 17)],  # the next utterance, with context reaching back
        [("long", 10, 25), ("short", 1, len(short_audio) / 16_000)],
    ]
    audio = {"long": long_audio, "short": short_audio}
    for batch in spans:
        requests = []
        for name, start_s, end_s in batch:
            start, end = round(start_s * 16_000), round(end_s * 16_000)
            requests.append(
                dataclasses.replace(
                    clips[0], audio=audio[name][start:end], stream=name, end_sample=end
                )
            )
        sent = engine.audio.samples_sent
        kept = engine.transcribe_batch(requests)
        if batch is spans[1]:  # each stream's window continues its last: only the new audio
            assert engine.audio.samples_sent - sent == 3 * 16_000 + len(short_audio) - 2 * 16_000
        whole = engine.transcribe_batch([dataclasses.replace(r, stream=None) for r in requests])
        assert [r.tokens for r in kept] == [r.tokens for r in whole]
        assert kept[0].tokens, "the long clip's window has speech"


def test_phases_account_for_the_batch(engine: TorchGraphEngine, clips: list[EngineRequest]) -> None:
    """The scheduler reports where a batch's time goes: every phase is timed, none twice."""
    import time

    engine.phases.drain()
    started = time.perf_counter()
    engine.transcribe_batch(clips[:3])
    wall_s = time.perf_counter() - started
    phases = engine.phases.drain()
    assert set(phases) == {"encode", "prefill", "decode", "read_back", "align", "results"}
    assert all(s >= 0 for s in phases.values())
    assert 0.5 * wall_s < sum(phases.values()) <= wall_s
    assert engine.phases.drain() == {}


def test_only_the_decode_step_may_ask_for_cudnn(
    engine: TorchGraphEngine, clips: list[EngineRequest], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The eager attention calls of a batch (encoder, prefill) run with cuDNN attention off: on
    Hopper GPUs torch would try it first, and it plans each new shape on the host. The decode
    step, whose shapes are fixed per bucket, may take it (on an H200 it replayed twice as fast)."""
    import sys

    from captiond.engines.torch_graph import decode, model

    sdpa = model.F.scaled_dot_product_attention
    cudnn_allowed: dict[bool, list[bool]] = {True: [], False: []}  # in the step: allowed
    step_code = decode.GreedyDecoder.step.__code__

    def in_step() -> bool:
        frame = sys._getframe(2)
        while frame is not None and frame.f_code is not step_code:
            frame = frame.f_back  # type: ignore[assignment]
        return frame is not None

    def recording(*args: Any, **kwargs: Any) -> Any:
        cudnn_allowed[in_step()].append(torch.backends.cuda.cudnn_sdp_enabled())
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(model.F, "scaled_dot_product_attention", recording)
    engine.transcribe_batch(clips[:2])
    assert cudnn_allowed[False] and not any(cudnn_allowed[False])
    assert cudnn_allowed[True] and all(cudnn_allowed[True])
    assert torch.backends.cuda.cudnn_sdp_enabled()  # restored after the batch
