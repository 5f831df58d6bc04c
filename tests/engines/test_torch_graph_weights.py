"""model.bin reader round trip, dimensions, random weights and mel filterbank (no model files)."""

from __future__ import annotations

import shutil
import struct
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from captiond.config import EngineConfig  # noqa: E402
from captiond.engines import load_engine  # noqa: E402
from captiond.engines.base import DecodeKind, EngineRequest  # noqa: E402
from captiond.engines.models import resolve_model  # noqa: E402
from captiond.engines.torch_graph.cuda_graph import bucket_for, bucket_sizes  # noqa: E402
from captiond.engines.torch_graph.kv_cache import allocate_cache, bytes_per_row  # noqa: E402
from captiond.engines.torch_graph.mel import MelFrontend  # noqa: E402
from captiond.engines.torch_graph.model import build_model  # noqa: E402
from captiond.engines.torch_graph.stream_audio import (  # noqa: E402
    RING_SAMPLES,
    WINDOW_SAMPLES,
    StreamAudio,
)
from captiond.engines.torch_graph.weights import (  # noqa: E402
    dims_from_tensors,
    load_tensors,
    random_tensors,
    read_model_bin,
    shape_dims,
)
from captiond.errors import ConfigError  # noqa: E402

_DTYPE_IDS = {np.dtype("<f4"): 0, np.dtype("i1"): 1, np.dtype("<i2"): 2, np.dtype("<f2"): 4}


def _string(text: str) -> bytes:
    raw = text.encode() + b"\0"
    return struct.pack("<H", len(raw)) + raw


def write_model_bin(path: Path, variables: dict[str, np.ndarray], aliases: dict[str, str]) -> None:
    """The CTranslate2 layout, written independently of the reader under test."""
    out = struct.pack("<I", 6) + _string("WhisperSpec") + struct.pack("<I", 3)
    out += struct.pack("<I", len(variables))
    for name, array in variables.items():
        out += _string(name) + struct.pack("<B", array.ndim)
        out += b"".join(struct.pack("<I", d) for d in array.shape)
        data = np.ascontiguousarray(array).tobytes()
        out += struct.pack("<B", _DTYPE_IDS[array.dtype]) + struct.pack("<I", len(data)) + data
    out += struct.pack("<I", len(aliases))
    for alias, target in aliases.items():
        out += _string(alias) + _string(target)
    path.write_bytes(out)


def test_model_bin_round_trip(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    variables = {
        "decoder/embeddings/weight": rng.standard_normal((7, 3)).astype(np.float16),
        "encoder/conv1/bias": rng.standard_normal(5).astype(np.float32),
        "decoder/num_heads": np.array(6, dtype=np.int16),
        "decoder/alibi": np.array(0, dtype=np.int8),
    }
    write_model_bin(
        tmp_path / "model.bin",
        variables,
        {"decoder/projection/weight": "decoder/embeddings/weight"},
    )
    model = read_model_bin(tmp_path / "model.bin")
    assert model.name == "WhisperSpec" and model.revision == 3
    for name, array in variables.items():
        assert model.variables[name].dtype == array.dtype
        np.testing.assert_array_equal(model.variables[name], array)
    np.testing.assert_array_equal(
        model.variables["decoder/projection/weight"], variables["decoder/embeddings/weight"]
    )
    tensors = load_tensors(tmp_path / "model.bin", torch.device("cpu"), torch.float32)
    # The alias is the same tensor, not a copy: the output projection stays tied.
    assert tensors["decoder/projection/weight"] is tensors["decoder/embeddings/weight"]
    assert tensors["decoder/embeddings/weight"].dtype == torch.float32
    assert int(tensors["decoder/num_heads"].item()) == 6


def test_random_tiny_weights_build_and_decode_a_step() -> None:
    device = torch.device("cpu")
    tensors = random_tensors("tiny", device, torch.float32)
    dims = dims_from_tensors(tensors)
    assert dims == shape_dims("tiny")
    assert (dims.n_text_head, dims.n_audio_layer, dims.n_vocab) == (6, 4, 51865)
    model = build_model(tensors, dims)
    cache = allocate_cache(dims, 2, device, torch.float32)
    with torch.no_grad():
        audio = model.encoder(torch.zeros(2, dims.n_mels, 3000))
        assert audio.shape == (2, dims.n_audio_ctx, dims.n_audio_state)
        model.decoder.write_cross(audio, cache)
        hidden = model.decoder.prefill(torch.tensor([[50257, 50362]] * 2), cache)
        logits = model.decoder.step(torch.tensor([1, 2]), torch.tensor([2, 2]), cache)
    assert hidden.shape == (2, 2, dims.n_text_state)
    assert logits.shape == (2, dims.n_vocab) and bool(torch.isfinite(logits).all())


def test_large_v3_shape_dims() -> None:
    dims = shape_dims("large-v3")
    assert (dims.n_mels, dims.n_text_head, dims.n_text_layer, dims.n_vocab) == (128, 20, 32, 51866)


def test_buckets() -> None:
    assert bucket_sizes(32) == (1, 2, 4, 8, 16, 32)
    assert bucket_sizes(12) == (1, 2, 4, 8, 12)
    assert bucket_for(5, bucket_sizes(32)) == 8
    assert bucket_for(1, bucket_sizes(1)) == 1


def test_cuda_batch_rows_fit_a_quarter_of_the_gpu_and_16_gib() -> None:
    from captiond.engines.torch_graph import _cuda_max_batch

    def rows(shape: str, gpu_gb: int) -> int:
        return _cuda_max_batch(shape_dims(shape), torch.float16, gpu_gb * 10**9)

    assert (rows("tiny", 80), rows("base", 80), rows("large-v3", 80)) == (128, 128, 32)
    assert (rows("base", 12), rows("large-v3", 12)) == (64, 8)
    for shape, gpu_gb in (("small", 80), ("medium", 24), ("large-v3", 80)):
        dims = shape_dims(shape)
        cache = allocate_cache(dims, 1, torch.device("meta"), torch.float16)
        assert cache.n_bytes == bytes_per_row(dims, torch.float16)
        assert rows(shape, gpu_gb) * cache.n_bytes <= min(16 * 2**30, gpu_gb * 10**9 // 4)


CPU = torch.device("cpu")


def test_stream_rings_fit_a_sixteenth_of_the_gpu_and_4_gib() -> None:
    from captiond.engines.torch_graph import _stream_rings

    assert _stream_rings(128, 80 * 10**9) == 1920  # 4 GiB with the 128 scratch rings
    assert _stream_rings(128, 24 * 10**9) == 24 * 10**9 // 16 // (RING_SAMPLES * 4) - 128
    assert _stream_rings(128, 4 * 10**9) == 256  # never fewer than two batches' worth
    assert _stream_rings(8, None) == 16  # the CPU
    StreamAudio(_stream_rings(128, 80 * 10**9), 128, torch.device("meta"))  # int32 indices hold


@pytest.mark.parametrize("n_samples", [0, 1, 39, 40, 41, 239, 240, 241, 16_000, 480_000, 500_000])
def test_centred_clip_is_faster_whispers_padding(n_samples: int) -> None:
    """The gathered signal equals faster-whisper's tail pad + np.pad reflect (reflected again
    and again where the clip is shorter than the pad), any clip length; past 30 s, cut."""
    clip = np.random.default_rng(n_samples).standard_normal(n_samples).astype(np.float32)
    centred = np.pad(np.pad(clip[:WINDOW_SAMPLES], (0, 160)), 200, mode="reflect")
    audio = StreamAudio(4, 2, CPU)
    audio.put_audio([np.ones(WINDOW_SAMPLES, np.float32)])  # the scratch ring's last clip
    signal, n = audio.centred(audio.put_audio([clip]))
    assert np.array_equal(signal[0, : centred.size].numpy(), centred)
    assert int(n[0]) == min(n_samples, WINDOW_SAMPLES)


def _window(stream: str, audio: np.ndarray, start: int, end: int) -> EngineRequest:
    return EngineRequest(
        audio=audio[start:end], kind=DecodeKind.PARTIAL, stream=stream, end_sample=end
    )


def test_stream_windows_send_only_new_audio_and_read_as_sent_whole() -> None:
    """Streams' overlapping windows, past the ring's end, with more streams than rings (the
    least recently decoded gives its ring up), a window reaching back before what is held, a
    gap, and one stream twice in a batch: every window reads exactly its audio, and a window
    continuing its stream's last sends only the samples after it."""
    rng = np.random.default_rng(3)
    streams = {name: rng.standard_normal(3 * RING_SAMPLES).astype(np.float32) for name in "abcde"}
    audio = StreamAudio(4, 2, CPU)
    sent: list[int] = []
    batches = [
        [("a", 0, 8_000), ("b", 0, 16_000)],
        [("a", 0, 16_000), ("b", 8_000, 24_000)],  # a: 8,000 new; b: 8,000 new
        # After a gap: sent whole, across the ring's end.
        [("a", RING_SAMPLES - 100_000, RING_SAMPLES + 300_000)],
        [("a", RING_SAMPLES, RING_SAMPLES + 308_000)],  # a's window goes on: 8,000 new
        [("c", 0, 4_000), ("d", 0, 4_000)],
        # e takes the ring of b (decoded least recently), b then a's: both sent whole
        [("e", 0, 4_000), ("b", 10_000, 24_000)],
        [("a", RING_SAMPLES, RING_SAMPLES + 316_000)],  # a was given up: sent whole
        [("a", RING_SAMPLES - 8_000, RING_SAMPLES + 316_000)],  # before what is held: whole
        [("b", 20_000, 28_000), ("b", 24_000, 30_000)],  # twice: the second goes to scratch
    ]
    expected_sent = [24_000, 16_000, 400_000, 8_000, 8_000, 18_000, 316_000, 324_000, 10_000]
    for batch in batches:
        windows = [_window(name, streams[name], start, end) for name, start, end in batch]
        before = audio.samples_sent
        signal, n = audio.centred(audio.put(windows))
        sent.append(audio.samples_sent - before)
        for row, (name, start, end) in enumerate(batch):
            clip = streams[name][start:end]
            centred = np.pad(np.pad(clip, (0, 160)), 200, mode="reflect")
            assert np.array_equal(signal[row, : centred.size].numpy(), centred), (name, start)
            assert int(n[row]) == end - start
    assert sent == expected_sent


def test_log_mel_reads_only_the_clips_own_frames() -> None:
    """A short clip's log-mel does not depend on the samples past its signal (another clip's,
    in the same ring position of an earlier batch)."""
    rng = np.random.default_rng(7)
    long_clip = (rng.standard_normal(480_000) * 0.1).astype(np.float32)
    short_clip = (rng.standard_normal(3_000) * 0.1).astype(np.float32)
    fresh = MelFrontend(80, StreamAudio(4, 2, CPU), CPU)([short_clip, long_clip[:40]])
    reused = MelFrontend(80, StreamAudio(4, 2, CPU), CPU)
    reused([long_clip, long_clip])
    assert torch.equal(reused([short_clip, long_clip[:40]]), fresh)


def _tiny_model_bin(path: Path) -> bytes:
    rng = np.random.default_rng(0)
    variables = {
        "decoder/embeddings/weight": rng.standard_normal((7, 3)).astype(np.float16),
        "encoder/conv1/bias": rng.standard_normal(5).astype(np.float32),
    }
    write_model_bin(path, variables, {"decoder/projection/weight": "decoder/embeddings/weight"})
    return path.read_bytes()


@pytest.mark.parametrize("kept_bytes", [0, 3, 10, 40, 60, -30, -1])
def test_a_cut_short_model_bin_is_a_one_line_config_error(tmp_path: Path, kept_bytes: int) -> None:
    # An interrupted copy: cut in the header, a name, a variable's data, the aliases.
    whole = _tiny_model_bin(tmp_path / "whole.bin")
    cut = tmp_path / "model.bin"
    cut.write_bytes(whole[:kept_bytes])
    with pytest.raises(ConfigError) as info:
        read_model_bin(cut)
    message = str(info.value)
    assert message.startswith(f"{str(cut)!r} is not a whole CTranslate2 model file"), message
    assert "\n" not in message


def test_a_model_bin_with_an_unknown_type_is_a_config_error(tmp_path: Path) -> None:
    whole = bytearray(_tiny_model_bin(tmp_path / "model.bin"))
    # The first variable's dtype id: after the header, its name, rank and two dims.
    header = 4 + 2 + len("WhisperSpec") + 1 + 4 + 4
    dtype_at = header + 2 + len("decoder/embeddings/weight") + 1 + 1 + 2 * 4
    assert whole[dtype_at] == 4  # float16
    whole[dtype_at] = 99
    (tmp_path / "model.bin").write_bytes(bytes(whole))
    with pytest.raises(ConfigError, match="unknown variable type 99"):
        read_model_bin(tmp_path / "model.bin")


def test_torch_graph_refuses_a_truncated_model_folder_in_one_line(tmp_path: Path) -> None:
    # The files resolve_model checks are there: only model.bin is cut short.
    bundled = resolve_model(None)
    for name in ("config.json", "tokenizer.json", "vocabulary.txt"):
        shutil.copy(bundled / name, tmp_path / name)
    with (bundled / "model.bin").open("rb") as whole:
        (tmp_path / "model.bin").write_bytes(whole.read(1_000_000))
    config = EngineConfig(name="torch_graph", device="cpu", model=str(tmp_path))
    with pytest.raises(ConfigError, match="is not a whole CTranslate2 model file"):
        load_engine(config)
