"""engines/timing.py: words from token start frames and probabilities."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from captiond.engines.models import resolve_model
from captiond.engines.timing import (
    START_LEAD_S,
    TOKENS_PER_S,
    path_starts,
    split_words,
    words_of,
)


@pytest.fixture(scope="module")
def model_path() -> Path:
    return resolve_model(None)


# A toy tokenizer: token ids index this vocabulary; a token with a leading space starts a word.
_VOCAB = [" Hello", ",", " wor", "ld", ".", " So", ' "', "yes", '"', " um"]


def split(tokens: list[int]) -> tuple[list[str], list[list[int]]]:
    texts: list[str] = []
    groups: list[list[int]] = []
    for token in tokens:
        piece = _VOCAB[token]
        if piece.startswith(" ") or not groups or piece in {",", ".", '"'}:
            texts.append(piece)
            groups.append([token])
        else:
            texts[-1] += piece
            groups[-1].append(token)
    return texts, groups


def frames(*seconds: float) -> list[int]:
    return [round(s * TOKENS_PER_S) for s in seconds]


def test_words_join_tokens_and_punctuation_and_lead_every_time() -> None:
    # " Hello" "," " wor" "ld" ".": Hello at 1.0, the comma at 1.3, world at 1.4-1.8, the stop.
    words = words_of(
        [0, 1, 2, 3, 4],
        frames(1.0, 1.3, 1.4, 1.6, 1.8),
        frames(1.9)[0],
        [0.9, 0.8, 0.6, 0.4, 1.0],
        split,
        window_s=30.0,
    )
    assert [w.word for w in words] == [" Hello,", " world."]
    assert words[0].start_s == pytest.approx(1.0 - START_LEAD_S)
    assert words[0].end_s == pytest.approx(1.4 - START_LEAD_S)  # the comma's end
    assert words[1].end_s == pytest.approx(1.9 - START_LEAD_S)
    # A word's confidence: the mean probability of its tokens, punctuation included.
    assert words[0].probability == pytest.approx(0.85)
    assert words[1].probability == pytest.approx((0.6 + 0.4 + 1.0) / 3)


def test_a_forced_prefix_is_aligned_but_not_returned() -> None:
    words = words_of(
        [5, 0, 1], frames(0.5, 1.0, 1.2), frames(1.5)[0], [0.5, 0.9, 0.9], split,
        first_token=1, window_s=30.0,
    )  # fmt: skip
    assert [w.word for w in words] == [" Hello,"]


def test_opening_punctuation_joins_the_next_word() -> None:
    words = words_of(
        [6, 7, 8], frames(2.0, 2.1, 2.4), frames(2.5)[0], [1.0, 1.0, 1.0], split, window_s=30.0
    )
    assert [w.word for w in words] == [' "yes"']
    assert words[0].start_s == pytest.approx(2.0 - START_LEAD_S)


def test_a_first_word_that_absorbed_the_silence_before_it_is_cut() -> None:
    """ " So" aligned from 0.0 to 2.0 s (it took the pause before the speech): its start is cut
    to twice the median word before its end."""
    words = words_of(
        [5, 0, 2, 3, 9],
        frames(0.0, 2.0, 2.3, 2.5, 2.6),
        frames(2.9)[0],
        [1.0] * 5,
        split,
        window_s=30.0,
    )
    so = words[0]
    assert so.word == " So"
    assert so.end_s == pytest.approx(2.0 - START_LEAD_S)
    assert so.end_s - so.start_s == pytest.approx(0.6)  # 2 x the median of 0.3 s


def test_times_stay_inside_the_window() -> None:
    words = words_of([0], frames(0.02), frames(0.5)[0], [1.0], split, window_s=0.3)
    assert words[0].start_s == 0.0  # not led before the window's start
    assert words[0].end_s == 0.3  # nor past its end


def test_no_tokens_no_words() -> None:
    assert words_of([5], frames(0.5), 30, [1.0], split, first_token=1, window_s=30.0) == ()


def _negative_dtw_steps(x: np.ndarray) -> np.ndarray:
    """CTranslate2's negative_dtw, cell by cell: the trace [n + 1, m + 1] (0 diagonal, 1 up,
    2 left; strict comparisons, a tie goes left)."""
    n, m = x.shape
    cost = np.full((n + 1, m + 1), np.inf, dtype=np.float32)
    trace = np.full((n + 1, m + 1), 2, dtype=np.int8)
    cost[0, 0] = 0
    for j in range(1, m + 1):
        for i in range(1, n + 1):
            c0, c1, c2 = cost[i - 1, j - 1], cost[i - 1, j], cost[i, j - 1]
            if c0 < c1 and c0 < c2:
                c, t = c0, 0
            elif c1 < c0 and c1 < c2:
                c, t = c1, 1
            else:
                c, t = c2, 2
            cost[i, j] = -x[i - 1, j - 1] + c
            trace[i, j] = t
    return trace


def test_batched_dtw_walks_the_paths_ctranslate2_walks() -> None:
    """torch_graph's DTW (a token row at a time, batched over matrices of different sizes)
    reaches every token at the frame CTranslate2's cell-by-cell DTW does, on random weights
    and on weights with a clear diagonal path."""
    torch = pytest.importorskip("torch")
    from captiond.engines.torch_graph.align import _dtw_trace

    rng = np.random.default_rng(7)
    shapes = [(4, 30), (12, 90), (1, 5), (25, 200), (7, 7)]
    matrices = [rng.standard_normal(shape).astype(np.float32) for shape in shapes]
    diagonal = np.full((10, 100), -1.0, dtype=np.float32)
    for i in range(10):
        diagonal[i, i * 10 : i * 10 + 10] = 2.0
    matrices.append(diagonal)
    trace = _dtw_trace([torch.from_numpy(x) for x in matrices]).numpy()
    for k, x in enumerate(matrices):
        n, m = x.shape
        expected = path_starts(_negative_dtw_steps(x), n, m)
        assert path_starts(trace[k], n, m) == expected, f"matrix {k} {x.shape}"
    assert path_starts(trace[-1], 10, 100) == [i * 10 for i in range(10)]


def test_a_path_that_runs_out_of_frames_reaches_no_token() -> None:
    trace = np.full((4, 3), 2, dtype=np.int8)  # always left: row 3 never moves up
    assert path_starts(trace, 3, 2) is None


def test_words_split_as_faster_whisper_splits_them(model_path: Path) -> None:
    """`split_words` is faster-whisper's split_to_word_tokens: on spaces, punctuation apart,
    and for a language written without spaces where tokens decode to whole characters."""
    faster_whisper = pytest.importorskip("faster_whisper")
    import tokenizers

    hf = tokenizers.Tokenizer.from_file(str(model_path / "tokenizer.json"))
    theirs = faster_whisper.tokenizer.Tokenizer(hf, False, "transcribe", "en")

    def decode(tokens: list[int]) -> str:
        return str(hf.decode(tokens))

    texts = [
        ' Hello, world. It\'s 3:30 p.m. -- "quoted" (aside) e-mail!',
        " Dr. Okafor's co-pilot said: 'no'... Grafana?",
        "这是一个测试，我们用中文说话。",  # noqa: RUF001
        " naïve café über straße",
    ]
    for text in texts:
        tokens = hf.encode(text, add_special_tokens=False).ids
        assert split_words(decode, tokens, "en") == theirs.split_tokens_on_spaces(tokens)
        assert split_words(decode, tokens, "zh") == theirs.split_tokens_on_unicode(tokens)
