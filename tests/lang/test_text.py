"""Text units for every script (lang/text.py), stable text on them (streaming/stabilize.py), and
the terminal
client's partial line: Chinese and Japanese have no spaces, Arabic is written right to left with
spaces."""

from __future__ import annotations

import io
import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from captiond.lang.text import (
    continuation,
    ends_sentence,
    has_word,
    join_texts,
    join_units,
    plain_unit,
    repeats_the_end_of,
    separator,
    units,
    written_after,
)
from captiond.streaming.stabilize import LocalAgreement, keep_stable
from captiond_client.display import CaptionPrinter


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("And so, my fellow Americans.", ["And", "so,", "my", "fellow", "Americans."]),
        ("甚至出现交易几乎停滞的情况", list("甚至出现交易几乎停滞的情况")),
        ("会合に 出席できなかった。", [*"会合に出席できなかっ", "た。"]),
        ("我用Python写", ["我", "用", "Python", "写"]),
        ("مرحبا بالعالم، كيف حالك؟", ["مرحبا", "بالعالم،", "كيف", "حالك؟"]),
        ("Привет, мир", ["Привет,", "мир"]),
        # A combining mark stays with its character: "ค่ะ" is "ค่" and "ะ", never "ค", "่", "ะ".
        ("สวัสดีค่ะ", ["ส", "วั", "ส", "ดี", "ค่", "ะ"]),
        ("नमस्ते दुनिया", ["नमस्ते", "दुनिया"]),
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
        # As Whisper wrote them: no space added next to digits, Latin or ASCII punctuation.
        ("加進38年登建式", "加進38年登建式"),
        ("我用Python写", "我用Python写"),
        ("對於更高階的保術,我們可以", "對於更高階的保術,我們可以"),
        ("2020年に東京で", "2020年に東京で"),
        ("(日本)と", "(日本)と"),
        # Thai, Lao and Khmer part phrases with a space: it stays.
        ("สวัสดีครับ ผมชื่อสมชาย", "สวัสดีครับ ผมชื่อสมชาย"),
        ("ສະບາຍດີ ເຈົ້າ", "ສະບາຍດີ ເຈົ້າ"),
        ("សួស្តី ពិភពលោក", "សួស្តី ពិភពលោក"),
    ],
)
def test_join_units(text: str, joined: str) -> None:
    assert join_units(units(text)) == joined


@given(st.text(alphabet=st.sampled_from([*"ab1.,(", "日", "本", "。", "م", "ر"]), max_size=30))
def test_text_without_spaces_comes_back_as_written(text: str) -> None:
    assert join_units(units(text)) == text


@given(
    st.text(alphabet=st.sampled_from([*"ab .,", "日", "本", "。", "م", "ر", "ส", "ค"]), max_size=30)
)
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
    # Digits and Latin letters inside the sentence stay as Whisper wrote them.
    assert keep_stable(tuple("加進"), "加近38年登建式") == "加進38年登建式"
    assert keep_stable(tuple("我用"), "我用Python写") == "我用Python写"
    # Anchored at the "年" two characters from its place, not at a "三" far along the decode
    # ("第三甲"), which left "登进" out.
    stable = tuple(units("嘉靖三十八年"))
    assert (
        keep_stable(stable, "嘉靖38年,登进士第三甲第二名。") == "嘉靖三十八年,登进士第三甲第二名。"
    )


def test_a_final_that_writes_the_stable_characters_end_otherwise_loses_nothing_after_it() -> None:
    # Three stable characters written as one unit ("三十八" as "38"), or three kana as two
    # kanji ("てんき" as "天気"): the decode goes on where the newest partial went on after the
    # stable text ("年", "が"), not a unit of it for each stable one, which lost "年,登" and "が".
    stable = tuple(units("嘉靖三十八"))
    decoded = "嘉靖38年,登进士第三甲第二名。"
    assert keep_stable(stable, decoded, units("年登进")) == "嘉靖三十八年,登进士第三甲第二名。"
    stable = tuple(units("今日はてんき"))
    assert (
        keep_stable(stable, "今日は天気がいいです。", units("がいい")) == "今日はてんきがいいです。"
    )


@pytest.mark.parametrize(
    ("unit", "plain"),
    [
        ("Hello,", "hello"),
        ("码。", "码"),
        ("«Bonjour»", "bonjour"),
        # A vendor's unpunctuated word keeps its vowel signs and tone marks (combining marks).
        ("दुनिया,", "दुनिया"),
        ("हिंदी", "हिंदी"),
        ("বাংলায়", "বাংলায়"),
        ("ที่", "ที่"),
        ("İstanbul'da,", "istanbul'da"),  # not "i̇stanbul'da", with a combining dot
    ],
)
def test_a_plain_unit_loses_punctuation_not_marks(unit: str, plain: str) -> None:
    assert plain_unit(unit) == plain


@pytest.mark.parametrize(
    ("unit", "said", "rest"),
    [
        ("you", "you.", "."),
        ("you", "You.", "."),  # the stable word's case is kept; the decode's does not matter
        ("time", "time-wise,", "-wise,"),
        ("acredita", "acredita-se", "-se"),
        ("well", "well\u2011known", "\u2011known"),  # a non-breaking hyphen
        ("码", "码。", "。"),
        ("time", "times", ""),  # another word, not this one continued
        ("time", "time", ""),
        ("time,", "time-wise,", ""),
        ("de", "dé-jà", ""),
    ],
)
def test_what_a_decode_writes_after_a_word_it_continues(unit: str, said: str, rest: str) -> None:
    assert continuation(unit, said) == rest


@pytest.mark.parametrize(
    ("text", "stable_units", "between"),
    [
        ("And so my fellow", 2, " "),
        ("病気のため彼はその", 6, ""),
        ("我用Python写", 2, ""),  # Latin written onto Chinese: no space, though Latin has them
        ("Tokyo 東京 is big", 1, " "),
        ("สวัสดีครับ ผมชื่อสมชาย", 7, " "),  # Thai's phrase space
        ("สวัสดีครับ ผมชื่อสมชาย", 4, ""),  # inside a Thai phrase
        ("And so", 2, ""),  # nothing after
    ],
)
def test_a_partials_separator_is_what_the_text_had_there(
    text: str, stable_units: int, between: str
) -> None:
    parts = units(text)
    stable, unstable = parts[:stable_units], parts[stable_units:]
    assert separator(join_units(stable), unstable[0] if unstable else "") == between
    assert join_units(stable) + between + join_units(unstable) == join_units(parts)


@pytest.mark.parametrize(
    ("texts", "joined"),
    [
        (["And so.", "Ask not"], "And so. Ask not"),
        (["出席できなかった。", "顔に"], "出席できなかった。顔に"),
        (["加进38年", "登进士"], "加进38年登进士"),
        (["Tokyo", "東京"], "Tokyo 東京"),
        (["", "はい", ""], "はい"),
        (["สวัสดีครับ", "ยินดีที่ได้รู้จัก"], "สวัสดีครับ ยินดีที่ได้รู้จัก"),  # Thai parts sentences
    ],
)
def test_join_texts(texts: list[str], joined: str) -> None:
    assert join_texts(texts) == joined


@pytest.mark.parametrize(
    ("forced", "unit", "joined"),
    [
        ("加进", "38", "加进38"),
        ("加进38", "年", "加进38年"),
        ("我用", "Python", "我用Python"),
        ("And so my fel", "a", "And so my fel a"),  # a word Whisper extends stays as shown
    ],
)
def test_text_written_right_after_a_forced_character_is_glued_to_it(
    forced: str, unit: str, joined: str
) -> None:
    before = units(forced)
    assert join_units([*before, written_after(before[-1], unit)]) == joined


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


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize(
    ("stable", "between", "unstable", "shown"),
    [
        ("And so", " ", "my fellow", "And so my fellow"),
        ("病気のため彼", "", "はその", "病気のため彼はその"),
        ("我用", "", "Python写", "我用Python写"),
        ("สวัสดีครับ", " ", "ผมชื่อ", "สวัสดีครับ ผมชื่อ"),
        ("", "", "はい", "はい"),
    ],
)
def test_the_terminal_client_joins_a_partial_with_its_separator(
    stable: str, between: str, unstable: str, shown: str
) -> None:
    out = _Terminal()
    partial = {"type": "partial", "stable": stable, "separator": between, "unstable": unstable}
    CaptionPrinter(out)(partial)
    assert re.sub(r"\x1b\[[0-9;]*[A-Za-z]|\r", "", out.getvalue()) == shown


@pytest.mark.parametrize(
    ("stable", "unstable", "shown"),
    [
        ("And so", "my fellow", "And so my fellow"),
        ("病気のため彼", "はその", "病気のため彼はその"),
        ("できなかった。", "次は", "できなかった。次は"),
        ("Tokyo", "東京", "Tokyo 東京"),
        ("保术,", "我们", "保术,我们"),
        ("Привет,", "мир", "Привет, мир"),
        ("", "はい", "はい"),
    ],
)
def test_the_terminal_client_joins_an_older_daemons_partial_as_its_script_is_written(
    stable: str, unstable: str, shown: str
) -> None:
    """A daemon before `separator`: a space unless both sides are Chinese or Japanese."""
    out = _Terminal()
    CaptionPrinter(out)({"type": "partial", "stable": stable, "unstable": unstable})
    assert re.sub(r"\x1b\[[0-9;]*[A-Za-z]|\r", "", out.getvalue()) == shown


@pytest.mark.parametrize(
    ("stable", "unstable", "shown"),
    [
        # Chinese characters take two columns each: the newest 10 fit in 20.
        ("我们今天讨论", "项目的进度安排", "天讨论项目的进度安排"),
        ("", "项目的进度安排和下一步的计划", "度安排和下一步的计划"),
        ("And so my fellow Americans", "ask not", "ow Americans ask not"),
    ],
)
def test_the_terminal_clients_live_line_fits_the_terminals_columns(
    monkeypatch: pytest.MonkeyPatch, stable: str, unstable: str, shown: str
) -> None:
    """A line that wraps cannot be redrawn in place: the live line keeps its newest text
    within the terminal's width, counted in columns (a Chinese character takes two)."""
    monkeypatch.setenv("COLUMNS", "21")  # 20 columns for text
    out = _Terminal()
    separator = " " if stable and unstable[0].isascii() else ""
    partial = {"type": "partial", "stable": stable, "separator": separator, "unstable": unstable}
    CaptionPrinter(out)(partial)
    assert re.sub(r"\x1b\[[0-9;]*[A-Za-z]|\r", "", out.getvalue()) == shown


@pytest.mark.parametrize(
    ("text", "before", "repeats"),
    [
        ("顔に車を止めた", "病気のため…。顔に車を止めた。", True),
        ("顔に車を止めた。顔に車を止めた。", "病気のため…。顔に車を止めた", True),
        ("We met.", "Hello there. we met", True),
        ("We met again.", "Hello there. We met.", False),
        ("met", "Hello there. We met.", True),
        ("。", "顔に車を止めた。", False),  # no words: another rule's case
        ("She saw him.", "", False),
    ],
)
def test_a_text_that_only_repeats_the_end_of_what_came_before(
    text: str, before: str, repeats: bool
) -> None:
    assert repeats_the_end_of(text, before) is repeats


@pytest.mark.parametrize(
    ("text", "ends"),
    [
        ("And so, my fellow Americans, ask not what your country can do for you.", True),
        ("Is it?", True),
        ("¡Sí!", True),
        ("«Hola.»", True),
        ('He said "go."', True),
        ("今日は晴れです。", True),
        ("你好吗\uff1f", True),
        ("هل أنت بخير؟", True),
        ("यह ठीक है।", True),
        ("And so my fellow Americans ask not", False),
        ("Las arenas son blanquecinas,", False),
        ("They may benefit from the...", False),
        ("They may benefit from the…", False),
        ("今日は、", False),
        ("", False),
    ],
)
def test_ends_sentence(text: str, ends: bool) -> None:
    assert ends_sentence(text) is ends
