"""Text units: words, or characters for scripts written without spaces (Sans-I/O, any thread).

Stable text, forced prefixes and word counts work on units. Splitting on spaces is right for
scripts that separate words (Latin, Cyrillic, Greek, Arabic, Hebrew, Hangul, …) and wrong for
Chinese, Japanese and Thai, where a sentence has no spaces between its words: there every
character is a unit, so LocalAgreement can agree on a growing prefix of a Japanese sentence as
it does on English words. Punctuation stays attached to the unit before it, and so does a
combining mark (a Thai tone or vowel mark is no unit of its own: a stable text never ends
between "ค" and its "่").
`join_units` is the inverse: it gives back the text as written ("2020年", "我用Python写",
"保术,我们" keep their lack of spaces; Thai, Lao, Khmer and Burmese keep the spaces that part
their phrases and sentences), except that a stray space between two Chinese or Japanese
characters goes.
"""

from __future__ import annotations

import unicodedata
from collections.abc import Iterable, Sequence

# Scripts whose sentences have no spaces between words, so each character is a unit. Thai,
# Lao, Burmese and Khmer part phrases and sentences with a space, which is kept as written.
_PHRASE_SPACED_RANGES = (
    (0x0E00, 0x0EFF),  # Thai, Lao
    (0x1000, 0x109F),  # Myanmar
    (0x1780, 0x17FF),  # Khmer
)
# Chinese and Japanese (and their punctuation) use no spaces at all: one between two of their
# characters is stray (Whisper writes some), and two texts in them join with none.
_UNSPACED_RANGES = (
    (0x2E80, 0x2FDF),  # CJK radicals
    (0x3000, 0x30FF),  # CJK punctuation, Hiragana, Katakana
    (0x3100, 0x31FF),  # Bopomofo, Katakana extensions
    (0x3400, 0x4DBF),  # CJK extension A
    (0x4E00, 0x9FFF),  # CJK unified ideographs
    (0xF900, 0xFAFF),  # CJK compatibility ideographs
    (0xFF00, 0xFFEF),  # full-width forms (Japanese and Chinese punctuation)
    (0x20000, 0x3FFFF),  # CJK extensions B…
)
# What joins the parts of a compound word ("time-wise"): hyphen-minus, hyphen, non-breaking hyphen.
_HYPHENS = frozenset("-\u2010\u2011")


def _in(char: str, ranges: tuple[tuple[int, int], ...]) -> bool:
    code = ord(char)
    # Below Thai every script separates words: most text never reaches the range scan.
    return code >= 0x0E00 and any(low <= code <= high for low, high in ranges)


def _no_space(char: str) -> bool:
    """A character of a script without spaces between words: a unit of its own."""
    return _in(char, _UNSPACED_RANGES) or _in(char, _PHRASE_SPACED_RANGES)


def _unspaced(char: str) -> bool:
    """A Chinese or Japanese character: no space goes next to another one."""
    return _in(char, _UNSPACED_RANGES)


def _punctuation(char: str) -> bool:
    return unicodedata.category(char).startswith("P")


def _mark(char: str) -> bool:
    """A combining mark (Thai tone and vowel marks, Devanagari vowel signs, …): part of the
    character before it."""
    return unicodedata.category(char).startswith("M")


def _edge(char: str) -> bool:
    """What a vendor's unpunctuated word leaves off its edges: punctuation, symbols, spaces."""
    return unicodedata.category(char)[0] in "PSZ"


def has_word(text: str) -> bool:
    """Whether `text` has a letter or digit in any script (not just punctuation or symbols)."""
    return any(char.isalnum() for char in text)


def only_punctuation(text: str) -> bool:
    """Whether `text` is punctuation and symbols alone: no letter, digit or combining mark (a
    decode's "่" that continues a forced "ค" is text, not punctuation)."""
    return all(_edge(char) for char in text)


# What ends a sentence in the scripts Whisper writes: the full stop, question and exclamation
# marks; their ideographic, full-width and half-width forms (Chinese, Japanese); the Arabic
# question mark and full stop (Urdu); the Devanagari danda and double danda.
_SENTENCE_ENDS = frozenset(".?!\u3002\uff1f\uff01\uff61\u061f\u06d4\u0964\u0965")
# What may close a sentence after its mark: quotes, guillemets, brackets, corner brackets.
_CLOSERS = frozenset("\"')]\u2019\u201d\u00bb\u300d\u300f\uff09")


def ends_sentence(text: str) -> bool:
    """Whether `text` ends with a sentence's closing mark ("… again.", "…ですか。", "«Sí.»"). An
    ellipsis does not end one: Whisper writes it where speech trails off and goes on ("from
    the... situation")."""
    end = text.rstrip()
    while end and end[-1] in _CLOSERS:
        end = end[:-1]
    return end[-1:] in _SENTENCE_ENDS and not end.endswith(("..", "…"))


def plain_text(text: str) -> str:
    """`text`'s letters, digits and combining marks, lower-cased, with nothing between them:
    what two writings of the same words share ("Thank you." and "thank you", "止めた。" and
    "止めた")."""
    return "".join(char for char in text.lower() if not _edge(char))


def repeats_the_end_of(text: str, before: str) -> bool:
    """Whether `text` is the end of `before` written again, once or more, and nothing else
    (punctuation, spaces and case aside): "車を止めた" or "車を止めた。車を止めた" after
    "…顔に車を止めた。"."""
    plain = plain_text(text)
    if not plain:
        return False
    # The shortest piece that `plain` is copies of ("abab": "ab"): a string is its own
    # rotation by that length and by no shorter one.
    piece = plain[: (plain + plain).find(plain, 1)]
    return plain_text(before).endswith(piece)


class Unit(str):
    """A text unit that remembers whether it was written right after the one before it, with no
    space between ("38" in "加进38年"): `join_units` then writes it back the same way. It is a
    str, so comparing and normalising units is unchanged."""

    glued = False


def _unit(text: str, glued: bool) -> str:
    if not glued:
        return text
    unit = Unit(text)
    unit.glued = True
    return unit


def with_marks(unit: str, marks: str) -> str:
    """`unit` with `marks` written right after it ("you" + ".", "time" + "-wise,"), spaced as
    `unit` was."""
    return _unit(unit + marks, getattr(unit, "glued", False))


def continues_with_hyphen(unit: str) -> bool:
    """Whether `unit`, written right after a word, is more of it after a hyphen ("-wise,")."""
    return unit[:1] in _HYPHENS and has_word(unit)


def continuation(unit: str, said: str) -> str:
    """What `said` writes after `unit` when it is `unit` (up to case) continued: punctuation
    added ("you." after "you": "."), or more joined by a hyphen ("time-wise," after "time":
    "-wise,"); else ""."""
    rest = said[len(unit) :]
    if not rest or said[: len(unit)].lower() != unit.lower():
        return ""
    return rest if only_punctuation(rest) or continues_with_hyphen(rest) else ""


def plain_unit(unit: str) -> str:
    """`unit` lower-cased, without punctuation or symbols at its edges (in any script: "码。"
    → "码", "Hello," → "hello"; a combining mark stays, "दुनिया," → "दुनिया"), spaced as `unit`
    was: a vendor's unpunctuated word."""
    start, end = 0, len(unit)
    while start < end and _edge(unit[start]):
        start += 1
    while end > start and _edge(unit[end - 1]):
        end -= 1
    # Turkish and Azerbaijani İ is i (Python lower-cases it to "i" + a combining dot above).
    plain = unit[start:end].replace("İ", "i").lower()
    return _unit(plain, getattr(unit, "glued", False))


def units(text: str) -> list[str]:
    """Words, with every character of a no-space script a unit of its own."""
    if text.isascii():
        return text.split()  # the engine thread's hot path: every word of every partial
    out: list[str] = []
    for token in text.split():
        # (text, glued) per unit of this token: all but its first follow without a space.
        parts: list[tuple[str, bool]] = []
        word = ""
        for char in token:
            if _mark(char) and not word and parts:
                parts[-1] = (parts[-1][0] + char, parts[-1][1])  # "่" after "ค"
            elif _no_space(char) and not _punctuation(char) and not _mark(char):
                if word:
                    parts.append((word, bool(parts)))
                word = ""
                parts.append((char, bool(parts)))
            elif _punctuation(char) and not word and parts and _no_space(parts[-1][0][-1]):
                parts[-1] = (parts[-1][0] + char, parts[-1][1])  # "。" after a character
            else:
                word += char
        if word:
            parts.append((word, bool(parts)))
        out += [_unit(part, glued) for part, glued in parts]
    return out


def _last_letter(text: str) -> str:
    """The last character of `text` that is not punctuation ("术" of "术,"), else its last."""
    for char in reversed(text):
        if not _punctuation(char):
            return char
    return text[-1]


def joins_without_space(first: str, second: str) -> bool:
    """Whether `second` is written right after `first` when nothing says how they were
    written: both sides are Chinese or Japanese characters, whatever punctuation ends `first`
    ("保术," + "我们"). Finals join by this rule; a Thai final after another keeps a space, as
    Thai parts sentences."""
    return bool(first and second) and _unspaced(second[0]) and _unspaced(_last_letter(first))


def separator(first: str, unit: str) -> str:
    """What `join_units` writes between the text `first` and the `unit` after it: "" where the
    unit was written glued to it or both sides are Chinese or Japanese, else " " ("" when
    either is empty). A partial's `separator` between its `stable` and `unstable`."""
    if not first or not unit or getattr(unit, "glued", False) or joins_without_space(first, unit):
        return ""
    return " "


def written_after(previous: str, unit: str) -> str:
    """`unit` as a decode wrote it right after `previous` (its forced prefix) with no space
    between: glued to it where either side is a character of a script without spaces ("加进"
    + "38年", "我用" + "Python"). Between words of other scripts the space stays: a word that
    Whisper extends past the commit point stays as the stable words showed it."""
    if previous and unit and (_no_space(_last_letter(previous)) or _no_space(unit[0])):
        return _unit(unit, True)
    return unit


def join_texts(texts: Iterable[str]) -> str:
    """Texts (finals) one after another as they are written: a space between them, none where
    both sides are Chinese or Japanese characters ("…出席できなかった。" + "顔…"). A
    Chinese or Japanese conversation forced on Whisper as its prefix then reads as it would
    have written it."""
    return join_units([text for text in texts if text])


def join_units(parts: Sequence[str]) -> str:
    """Units back into text: a space between words, none before a unit that was written glued
    to the one before it, none between two Chinese or Japanese characters (`separator`)."""
    text = ""
    for part in parts:
        text += separator(text, part) + part
    return text
