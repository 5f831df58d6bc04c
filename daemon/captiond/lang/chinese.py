"""Chinese in the reader's script: Whisper writes Mandarin in simplified or in traditional
characters as its training data happened to, and can switch between utterances of one stream.
A stream's Chinese variant (`zh-Hans`, `zh-Hant`, `zh-TW`, `zh-HK`) converts every decode's text
with OpenCC, a maintained phrase-aware converter, before any of it is shown, made stable or
used as context; "" keeps what Whisper wrote.

Pure functions (Sans-I/O), called on the event-loop thread of whichever process runs the
session; converters are built once per process.
"""

from __future__ import annotations

import functools

import opencc

# Traditional text as OpenCC's standard forms, whichever script and regional forms it came in
# (s2t alone leaves Taiwan's 為 and 裡 as they are beside its own 爲 and 裏).
_TO_TRADITIONAL = ("s2t", "tw2t", "hk2t")
# The variants, by BCP 47 tag: the OpenCC configurations that write each from any input.
VARIANTS = {
    "zh-Hans": ("t2s",),  # simplified (mainland China, Singapore)
    "zh-Hant": _TO_TRADITIONAL,  # traditional, OpenCC's standard forms (爲, 裏)
    "zh-TW": (*_TO_TRADITIONAL, "t2tw"),  # traditional, Taiwan's standard forms (為, 裡)
    "zh-HK": (*_TO_TRADITIONAL, "t2hk"),  # traditional, Hong Kong's standard forms (為, 裏)
}
# Regions whose tag names a variant without a script subtag (what Deepgram and browsers send).
_REGIONS = {
    "cn": "zh-Hans",
    "sg": "zh-Hans",
    "my": "zh-Hans",
    "tw": "zh-TW",
    "hk": "zh-HK",
    "mo": "zh-HK",
}


def variant_of(tag: str) -> str | None:
    """The Chinese variant a language tag names, or None when it names none (any other
    language, or plain "zh"): its script subtag decides simplified or traditional, its region
    the traditional forms ("zh-TW", "zh-Hant-HK"; "zh-CN" is simplified, "zh-Hant-CN"
    traditional)."""
    primary, *subtags = tag.lower().split("-")
    if primary != "zh":
        return None
    script = next((s for s in subtags if s in ("hans", "hant")), None)
    by_region = next((_REGIONS[s] for s in subtags if s in _REGIONS), None)
    if script == "hans":
        return "zh-Hans"
    if script == "hant":
        return by_region if by_region in ("zh-TW", "zh-HK") else "zh-Hant"
    return by_region


def written(text: str, language: str | None, variant: str) -> str:
    """`text`, decoded in `language`, as a reader of `variant` writes it: converted when the
    language is Chinese and a variant is set, else unchanged."""
    if language != "zh" or not variant or not text:
        return text
    for converter in _converters(variant):
        text = converter.convert(text)
    return text


@functools.cache
def _converters(variant: str) -> tuple[opencc.OpenCC, ...]:
    return tuple(opencc.OpenCC(config) for config in VARIANTS[variant])
