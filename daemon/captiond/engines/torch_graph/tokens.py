"""Whisper tokens for the torch_graph engine: special ids, prompts, suppression sets, decoding.

Owns what faster-whisper decides around the model: the prompt (`get_prompt`, with language and
task tokens on multilingual models), the language tokens detection scores, the suppressed tokens
(`get_suppressed_tokens` with the default `suppress_tokens=[-1]`, plus config.json's
`suppress_ids`, plus `suppress_ids_begin` on the first step) and text decoding. Runs on the engine
thread; built once on the thread that builds the engine.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import tokenizers

from captiond.engines.rules import case_variants, fit_prompt, new_token_budget, text_tokens

_MULTILINGUAL_MIN_VOCAB = 51865  # .en vocabularies have 51864 entries
TASKS = ("transcribe", "translate")


@dataclass(frozen=True, slots=True, kw_only=True)
class SpecialTokens:
    eot: int
    sot: int
    sot_prev: int
    sot_lm: int
    no_timestamps: int
    no_speech: int
    transcribe: int
    translate: int


@dataclass(frozen=True, slots=True, kw_only=True)
class PromptPlan:
    """One request's prompt and where CTranslate2 reads its scores."""

    tokens: tuple[int, ...]
    sot_index: int
    # CTranslate2 decodes at most min(448 // 2, 448 - (len(prompt) - 1)) tokens, the forced
    # prefix (the tokens after <|notimestamps|>) included.
    max_new_tokens: int
    # The forced prefix's tokens, the last of `tokens`: a beam's length counts them.
    prefix_tokens: int = 0


def _non_speech_tokens(tokenizer: tokenizers.Tokenizer) -> set[int]:
    """faster_whisper.tokenizer.Tokenizer.non_speech_tokens, verbatim in behaviour."""

    def encode(text: str) -> list[int]:
        return list(tokenizer.encode(text, add_special_tokens=False).ids)

    symbols = list('"#()*+/:;<=>@[\\]^_`{|}~「」『』')
    symbols += [
        "<<",
        ">>",
        "<<<",
        ">>>",
        "--",
        "---",
        "-(",
        "-[",
        "('",
        '("',
        "((",
        "))",
        "(((",
        ")))",
        "[[",
        "]]",
        "{{",
        "}}",
        "♪♪",
        "♪♪♪",
    ]
    miscellaneous = set("♩♪♫♬♭♮♯")
    # Hyphens and quotes are fine inside words, not at the start of one.
    result = {encode(" -")[0], encode(" '")[0]}
    for symbol in symbols + sorted(miscellaneous):
        for tokens in (encode(symbol), encode(" " + symbol)):
            if len(tokens) == 1 or symbol in miscellaneous:
                result.add(tokens[0])
    return result


class WhisperTokens:
    """The tokenizer and the model's token rules (from tokenizer.json and config.json)."""

    def __init__(self, model_path: Path, n_vocab: int) -> None:
        self.tokenizer_path = str(model_path / "tokenizer.json")
        self.tokenizer = tokenizers.Tokenizer.from_file(self.tokenizer_path)
        config = json.loads((model_path / "config.json").read_text(encoding="utf-8"))
        self.multilingual = n_vocab >= _MULTILINGUAL_MIN_VOCAB
        special = SpecialTokens(
            eot=self._id("<|endoftext|>"),
            sot=self._id("<|startoftranscript|>"),
            sot_prev=self._id("<|startofprev|>"),
            sot_lm=self._id("<|startoflm|>"),
            no_timestamps=self._id("<|notimestamps|>"),
            no_speech=self._optional_id("<|nospeech|>") or self._id("<|nocaptions|>"),
            transcribe=self._id("<|transcribe|>"),
            translate=self._id("<|translate|>"),
        )
        self.special = special
        # The language tokens, in CTranslate2's order (config.json's `lang_ids`; older
        # conversions lack it: then every token between <|startoftranscript|> and <|translate|>).
        lang_ids = config.get("lang_ids") or range(special.sot + 1, special.translate)
        self.language_ids = tuple(int(i) for i in lang_ids)
        self.language_codes = tuple(
            str(self.tokenizer.id_to_token(i)).removeprefix("<|").removesuffix("|>")
            for i in self.language_ids
        )
        self._language_id = dict(zip(self.language_codes, self.language_ids, strict=True))
        every_step = set(config.get("suppress_ids", ())) | _non_speech_tokens(self.tokenizer)
        every_step |= {
            special.transcribe,
            special.translate,
            special.sot,
            special.sot_prev,
            special.sot_lm,
            special.no_speech,
        }
        self.suppress_ids = tuple(sorted(every_step))
        # suppress_blank: config.json's suppress_ids_begin (" " and <|endoftext|>) on step one.
        self.suppress_ids_begin = tuple(sorted(config.get("suppress_ids_begin", ())))
        # Word probabilities decode every word of every partial, and a stream's partials repeat
        # the same words: cached (with text.units' ASCII path, 0.53 -> 0.07 ms a 60-token row).
        self.decode_words = functools.lru_cache(maxsize=1 << 16)(self.decode)
        self.text_tokens = text_tokens(self.encode)
        # A partial's word probabilities count a capitalized token's other cases (the decoder
        # adds them up).
        texts = self.tokenizer.decode_batch([[t] for t in range(special.eot)])
        self.case_variants = case_variants(texts)

    def _optional_id(self, token: str) -> int | None:
        found = self.tokenizer.token_to_id(token)
        return None if found is None else int(found)

    def _id(self, token: str) -> int:
        found = self._optional_id(token)
        if found is None:
            raise ValueError(f"tokenizer.json has no {token} token")
        return found

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def language_token(self, language: str) -> int:
        """<|xx|> for a language code the model knows."""
        # The tokenizer's own token when config.json's ids disagree with it (random weights of
        # a multilingual shape read with tiny.en's tokenizer, in `captiond bench engine`).
        found = self._language_id.get(language) or self._optional_id(f"<|{language}|>")
        if found is None:
            raise ValueError(f"the model knows no language {language!r}")
        return found

    def prompt(
        self,
        previous_text: str,
        language: str | None,
        prefix: str = "",
        task: str = "transcribe",
        stream_prompt: str = "",
        cap: int | None = None,
    ) -> PromptPlan:
        """The faster-whisper engine's prompt: get_prompt(without_timestamps=True) + prefix,
        the stream's prompt before the previous text (`fit_prompt`).

        Multilingual models get <|language|> (English when None) and the task token; English-only
        models get neither (they only transcribe English). `cap` bounds the new tokens below
        the budget, as the faster-whisper engine's `max_length` does for a partial.
        """
        if task not in TASKS:
            raise ValueError(f"unknown task {task!r}; choose one of {', '.join(TASKS)}")
        previous, prefix_tokens = fit_prompt(
            self.text_tokens(stream_prompt),
            self.text_tokens(previous_text),
            self.text_tokens(prefix),
        )
        tokens: list[int] = []
        if previous:
            tokens = [self.special.sot_prev, *previous]
        sot_index = len(tokens)
        tokens.append(self.special.sot)
        if self.multilingual:
            task_token = self.special.translate if task == "translate" else self.special.transcribe
            tokens += [self.language_token(language or "en"), task_token]
        tokens.append(self.special.no_timestamps)
        max_new = new_token_budget(len(tokens), len(prefix_tokens))
        if cap is not None:  # a partial's (`partial_token_cap`)
            max_new = min(max_new, cap)
        tokens += prefix_tokens
        return PromptPlan(
            tokens=tuple(tokens),
            sot_index=sot_index,
            max_new_tokens=max_new,
            prefix_tokens=len(prefix_tokens),
        )

    def decode(self, tokens: Sequence[int]) -> str:
        """Text tokens only (ids below <|endoftext|>), as faster-whisper's Tokenizer.decode."""
        return str(self.tokenizer.decode([t for t in tokens if t < self.special.eot]))
