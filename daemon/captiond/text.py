"""Text units: words, or characters for scripts written without spaces (Sans-I/O, any thread).

Stable text, forced prefixes and word counts work on units. Splitting on spaces is right for
scripts that separate words (Latin, Cyrillic, Greek, Arabic, Hebrew, Hangul, …) and wrong for
Chinese, Japanese and Thai, where a sentence has no spaces: there every character is a unit, so
LocalAgreement can agree on a growing prefix of a Japanese sentence as it does on English words.
Punctuation stays attached to the unit before it. `join_units` is the inverse: a space between
two units unless both sides are characters of such a script.
"""

from __future__ import annotations

import unicodedata
from collections.abc import Sequence

# Scripts written without spaces between words, and their punctuation (code point ranges).
_NO_SPACE_RANGES = (
    (0x0E00, 0x0EFF),  # Thai, Lao
    (0x1000, 0x109F),  # Myanmar
    (0x1780, 0x17FF),  # Khmer
    (0x2E80, 0x2FDF),  # CJK radicals
    (0x3000, 0x30FF),  # CJK punctuation, Hiragana, Katakana
    (0x3100, 0x31FF),  # Bopomofo, Katakana extensions
    (0x3400, 0x4DBF),  # CJK extension A
    (0x4E00, 0x9FFF),  # CJK unified ideographs
    (0xF900, 0xFAFF),  # CJK compatibility ideographs
    (0xFF00, 0xFFEF),  # full-width forms (Japanese and Chinese punctuation)
    (0x20000, 0x3FFFF),  # CJK extensions B…
)


def _no_space(char: str) -> bool:
    code = ord(char)
    # Below Thai every script separates words: most text never reaches the range scan.
    return code >= _NO_SPACE_RANGES[0][0] and any(
        low <= code <= high for low, high in _NO_SPACE_RANGES
    )


def _punctuation(char: str) -> bool:
    return unicodedata.category(char).startswith("P")


def has_word(text: str) -> bool:
    """Whether `text` has a letter or digit in any script (not just punctuation or symbols)."""
    return any(char.isalnum() for char in text)


def units(text: str) -> list[str]:
    """Words, with every character of a no-space script a unit of its own."""
    if text.isascii():
        return text.split()  # the engine thread's hot path: every word of every partial
    out: list[str] = []
    for token in text.split():
        word = ""
        for char in token:
            if _no_space(char) and not _punctuation(char):
                if word:
                    out.append(word)
                word = ""
                out.append(char)
            elif _punctuation(char) and not word and out and _no_space(out[-1][-1]):
                out[-1] += char  # "。" after a character belongs to it
            else:
                word += char
        if word:
            out.append(word)
    return out


def join_units(parts: Sequence[str]) -> str:
    """Units back into text: spaces between words, none between no-space characters."""
    text = ""
    for part in parts:
        if text and not (_no_space(text[-1]) and _no_space(part[0])):
            text += " "
        text += part
    return text
