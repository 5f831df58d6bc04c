"""Language tags, tasks and prompts: parsing `?language=` (with Chinese script variants and
Whisper's spellings), checking a language against a model, and bounding a stream's prompt.

Pure functions (any thread); config, the engines and the dialects all use them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from captiond.errors import BadMessageError
from captiond.lang.chinese import variant_of
from captiond.whisper import WHISPER_LANGUAGES

AUTO_LANGUAGE = "auto"


TASKS = ("transcribe", "translate")


# Tags whose primary subtag Whisper spells otherwise: ISO 639-1 Javanese, BCP 47's Norwegian
# Bokmål, and Hebrew's withdrawn code (still sent by Java and Android).
_WHISPER_SPELLING = {"jv": "jw", "nb": "no", "iw": "he"}


# A stream's prompt (names, terms): engines keep at most 111 tokens of it
# (engines.rules.fit_prompt),
# a few hundred characters in most scripts; longer text is a mistake, refused rather than cut.
MAX_PROMPT_CHARS = 1_000


class LanguageSetting(NamedTuple):
    """What a stream's `language` asks for: a Whisper language code or "auto", the languages
    "auto" is detected among (empty: any), and the Chinese variant a tag names."""

    code: str
    candidates: tuple[str, ...] = ()
    chinese_variant: str | None = None

    @property
    def setting(self) -> str:
        """As `[stream] language` writes it: "de", "auto", or the candidates ("en,de")."""
        return ",".join(self.candidates) or self.code


def parse_language(value: str) -> LanguageSetting:
    """A language tag's Whisper language (`check_language`) and the Chinese variant it names
    (`chinese.variant_of`: "zh-TW" is zh with "zh-TW", "en-US" en with none); or a
    comma-separated list of tags ("en,de,zh-TW"): "auto", detected among them."""
    tags = [tag.strip() for tag in value.split(",")]
    if len(tags) == 1:
        return parse_language_tag(value)
    codes = [check_language(tag) for tag in tags]
    if AUTO_LANGUAGE in codes:
        raise BadMessageError(
            f"language {value[:40]!r}: a list names the languages to detect among, not 'auto'"
        )
    variant = next((v for v in map(variant_of, tags) if v), None)
    return LanguageSetting(AUTO_LANGUAGE, tuple(dict.fromkeys(codes)), variant)


def parse_language_tag(tag: str) -> LanguageSetting:
    """One language tag's setting ("zh-TW": zh, naming traditional script), as the protocols
    that take no list of languages read theirs."""
    return LanguageSetting(check_language(tag), (), variant_of(tag))


def check_language(tag: str) -> str:
    """The Whisper language code (one of `WHISPER_LANGUAGES`) of a language tag ("de", "en-US",
    "zh-TW": BCP 47's primary subtag), or "auto"."""
    if tag.lower() == AUTO_LANGUAGE:
        return AUTO_LANGUAGE
    primary, *subtags = tag.split("-")
    if not (
        primary.isascii()
        and primary.isalpha()
        and 2 <= len(primary) <= 3
        and all(s.isascii() and s.isalnum() and 1 <= len(s) <= 8 for s in subtags)
    ):
        raise BadMessageError(
            f"language must be a language code (de, en-US, zh-TW) or 'auto', got {tag[:20]!r}"
        )
    code = primary.lower()
    code = _WHISPER_SPELLING.get(code, code)
    if code not in WHISPER_LANGUAGES:
        raise BadMessageError(
            f"language {tag[:20]!r} is not one Whisper knows: use a code such as de, es, ja, "
            "zh-TW (the list: docs/guides/languages.md) or 'auto'"
        )
    return code


def check_model_language(language: str, english_only: str) -> None:
    """Refuse a language an English-only model cannot caption (`english_only`: the model's
    name when it captions English only, "" when it knows every language): it would decode
    the audio as English, which for other speech is mostly nothing at all."""
    if english_only and language not in ("en", AUTO_LANGUAGE):
        raise BadMessageError(
            f"the model {english_only} is English-only: language {language!r} needs a "
            "multilingual model (captiond serve --model base)"
        )


def check_prompt(prompt: str, what: str = "prompt") -> str:
    """A stream's prompt, stripped; `what` names it in the error as the client's protocol does."""
    if len(prompt) > MAX_PROMPT_CHARS:
        raise BadMessageError(
            f"{what} is {len(prompt)} characters long: at most {MAX_PROMPT_CHARS} are taken"
        )
    if "<|" in prompt and "|>" in prompt:
        # Whisper's tokenizer reads "<|endoftext|>" in text as the control token itself: a
        # prompt could end the prompt early or start a new transcript inside it.
        raise BadMessageError(f"{what} may not contain Whisper's control-token markers <|…|>")
    try:
        prompt.encode()
    except UnicodeEncodeError:
        # JSON lets "\ud83d" (half an emoji) through as a lone surrogate; the tokenizer, the
        # journal and the reply that echoes the prompt could not encode it.
        raise BadMessageError(f"{what} is not valid Unicode (a lone surrogate)") from None
    return prompt.strip()


def prompt_of_terms(terms: Sequence[str], what: str = "key terms") -> str:
    """Key terms (Deepgram's `keyterm`, AssemblyAI's `keyterms_prompt`) as one prompt, the way
    Whisper reads a list in its previous text: comma-separated, ended with a full stop.
    Whisper imitates its prompt's style, and the app cannot write it: JFK with the prompt
    "Kennedy" came out without a full stop or a capital, with "Kennedy." as written."""
    listed = ", ".join(t.strip() for t in terms if t.strip())
    if listed and listed[-1].isalnum():
        listed += "."
    return check_prompt(listed, what)
