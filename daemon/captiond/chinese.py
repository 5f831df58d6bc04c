"""Chinese in the reader's script: Whisper writes Mandarin in simplified or in traditional
characters as its training data happened to, and can switch between utterances of one stream.
A stream's Chinese variant (`zh-Hans`, `zh-Hant`, `zh-TW`, `zh-HK`) converts every decode's text
with OpenCC, a maintained phrase-aware converter, before any of it is shown, made stable or
used as context; "" keeps what Whisper wrote.

Pure functions (Sans-I/O), called on the event-loop thread of whichever process runs the
session; converters are built once per process and variant.
"""

from __future__ import annotations

import functools

import opencc

# The variants, by BCP 47 tag, and the OpenCC configuration that writes each from either
# script (its simplified-to-X configurations leave characters already in X as they are).
VARIANTS = {
    "zh-Hans": "t2s",  # simplified (mainland China, Singapore)
    "zh-Hant": "s2t",  # traditional, OpenCC's standard forms
    "zh-TW": "s2tw",  # traditional, Taiwan's standard forms (為, 裡)
    "zh-HK": "s2hk",  # traditional, Hong Kong's standard forms
}
# Tags that name a variant by region (what Deepgram and browsers send), lower case.
_ALIASES = {
    "zh-hans": "zh-Hans",
    "zh-cn": "zh-Hans",
    "zh-sg": "zh-Hans",
    "zh-my": "zh-Hans",
    "zh-hans-cn": "zh-Hans",
    "zh-hans-sg": "zh-Hans",
    "zh-hant": "zh-Hant",
    "zh-tw": "zh-TW",
    "zh-hant-tw": "zh-TW",
    "zh-hk": "zh-HK",
    "zh-mo": "zh-HK",
    "zh-hant-hk": "zh-HK",
    "zh-hant-mo": "zh-HK",
}


def variant_of(tag: str) -> str | None:
    """The Chinese variant a language tag names ("zh-TW" → "zh-TW", "zh-CN" → "zh-Hans"), or
    None when it names none (any other language, or plain "zh")."""
    return _ALIASES.get(tag.lower())


def written(text: str, language: str | None, variant: str) -> str:
    """`text`, decoded in `language`, as a reader of `variant` writes it: converted when the
    language is Chinese and a variant is set, else unchanged."""
    if language != "zh" or not variant or not text:
        return text
    converted: str = _converter(variant).convert(text)
    return converted


@functools.cache
def _converter(variant: str) -> opencc.OpenCC:
    return opencc.OpenCC(VARIANTS[variant])
