"""Text units for every script (text.py), and stable text on them (stabilize.py): Chinese and
Japanese have no spaces, Arabic is written right to left with spaces."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from captiond.stabilize import LocalAgreement, keep_stable
from captiond.text import has_word, join_units, units


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("And so, my fellow Americans.", ["And", "so,", "my", "fellow", "Americans."]),
        ("甚至出现交易几乎停滞的情况", list("甚至出现交易几乎停滞的情况")),
        ("会合に 出席できなかった。", [*"会合に出席できなかっ", "た。"]),
        ("我用Python写", ["我", "用", "Python", "写"]),
        ("مرحبا بالعالم، كيف حالك؟", ["مرحبا", "بالعالم،", "كيف", "حالك؟"]),
        ("Привет, мир", ["Привет,", "мир"]),
    ],
)
def test_units(text: str, expected: list[str]) -> None:
    assert units(text) == expected


@pytest.mark.parametrize(
    ("text", "joined"),
    [
        ("会合に 出席できなかった。", "会合に出席できなかった。"),  # Whisper's stray space goes
        ("Tokyo 東京 is big", "Tokyo 東京 is big"),
        ("مرحبا بالعالم", "مرحبا بالعالم"),
        ("  two   spaces  ", "two spaces"),
    ],
)
def test_join_units(text: str, joined: str) -> None:
    assert join_units(units(text)) == joined


@given(st.text(alphabet=st.sampled_from([*"ab .,", "日", "本", "。", "م", "ر"]), max_size=30))
def test_join_is_a_fixed_point(text: str) -> None:
    once = join_units(units(text))
    assert join_units(units(once)) == once
    assert "".join(units(text)) == "".join(text.split())  # no character lost or added


def test_japanese_partials_stabilise_character_by_character() -> None:
    agreement = LocalAgreement(hold_back=1)
    agreement.update("病気のため")
    split = agreement.update("病気のため彼は")
    assert join_units(split.stable) == "病気のた"  # the last agreed character is held back
    split = agreement.update("病気のため彼はその会合に")
    assert join_units(split.stable) == "病気のため彼"
    assert join_units(split.unstable) == "はその会合に"


def test_a_chinese_final_keeps_the_stable_characters() -> None:
    stable = tuple("甚至出现交易")
    assert keep_stable(stable, "甚至出现交意几乎停滞的情况") == "甚至出现交易几乎停滞的情况"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("word", True),
        ("日本", True),
        ("ليس", True),
        ("42", True),
        (",", False),
        ("。…!", False),
        ("", False),
    ],
)
def test_has_word_in_any_script(text: str, expected: bool) -> None:
    assert has_word(text) is expected
