"""Decode context: which committed text and which earlier audio a decode continues from.

Sans-I/O, one instance per StreamSession, on the event-loop thread (or the thread that runs an
offline transcription). A whole-file Whisper decode sees each utterance inside a 30-s window
together with the audio before it, and conditions on the text it already wrote for that audio.
Decoding a short turn ("Yes.") alone, padded into a window of silence, loses both. So a decode of
an utterance gets a window that starts at an earlier committed final (as far back as
`window_samples` and `context_tokens` allow) and the text of those finals as a forced prefix: the
model re-reads the conversation, and only the words it writes after the prefix are new. Without
such finals (the stream's first utterance, or after a break) the window starts where the quiet
before the utterance began, not at its pre-roll: a whole-file decode hears that quiet too.

A final that came out empty (noise, a dropped hallucination) breaks the context: its audio holds
something the committed text does not describe, and a window across it would invite the model to
transcribe it now. Text older than the window is still used as Whisper's previous-text prompt.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from captiond.lang.text import join_texts, joins_without_space


@dataclass(frozen=True, slots=True, kw_only=True)
class CommittedFinal:
    """A final's text and the span of stream audio it transcribes."""

    start_sample: int
    end_sample: int
    text: str


@dataclass(frozen=True, slots=True, kw_only=True)
class DecodeContext:
    """Where a decode's audio starts, the text forced for the audio before the utterance, and
    the older text it is conditioned on."""

    start_sample: int
    prefix: str
    prompt: str


class TranscriptContext:
    """`count_tokens` measures text in the model's tokens (engines.rules.token_counter)."""

    def __init__(
        self, *, context_tokens: int, prompt_chars: int, count_tokens: Callable[[str], int]
    ) -> None:
        self._context_tokens = context_tokens
        self._prompt_chars = prompt_chars
        self._count_tokens = count_tokens
        # Finals since the last break, oldest first, that a later window may still reach, each
        # with its text's tokens (counted once).
        self._recent: deque[tuple[CommittedFinal, int]] = deque()
        # Text of every final that is no longer (or never was) in `_recent`, for the prompt.
        self._older: list[str] = []

    def commit(self, final: CommittedFinal) -> None:
        """Record a final; an empty one breaks the context (see the module docstring)."""
        if final.text:
            self._recent.append((final, self._count_tokens(final.text)))
            return
        self.break_context()

    def break_context(self) -> None:
        """Later decodes start at their utterance: what was committed so far becomes prompt
        text."""
        self._older += [f.text for f, _ in self._recent]
        self._recent.clear()

    def start_over(self) -> None:
        """A new language: nothing committed so far is a later decode's prefix or prompt.
        Whisper conditioned on text in another language writes in that language (Japanese
        speech after an English prompt came out as English text, labelled Japanese)."""
        self._recent.clear()
        self._older.clear()

    def remember(self, text: str) -> None:
        """Text committed before this context existed, whose audio is gone (a session resumed
        after a daemon restart): the prompt only."""
        if text:
            self._older.append(text)

    def for_decode(
        self,
        *,
        utterance_start: int,
        lead_sample: int,
        end_sample: int,
        window_samples: int,
        forced: str = "",
        alone: bool = False,
    ) -> DecodeContext:
        """The context of a decode of audio [utterance_start, end_sample): whole finals whose
        audio fits in the window together with the utterance, newest first, within
        `context_tokens` less the tokens of the utterance's own `forced` words; contiguous, so
        no final between them is left out.

        The whole prefix stays within `context_tokens` because both engines count it inside
        the decode's 224-token budget (engines.rules.new_token_budget): a longer prefix would cut
        the utterance's new words off. It is counted in tokens, not characters, because a
        character is a quarter of a token in English but one or more in Chinese, Japanese or
        Khmer: the 450 characters once allowed are about 115 tokens of English, and of
        Japanese about 450, more than the whole budget.

        Without such finals the audio starts at `lead_sample`, where the quiet before the
        utterance began, as far back as the window allows: a whole-file decode hears that quiet
        too, and Whisper reads the first words after it better than after the pre-roll alone
        (docs/design/streaming-policy.md#context). With them it starts at the oldest one's start:
        hearing the quiet before that one too made dialogues worse.

        `alone`: no finals and no prompt, the utterance as if it began the stream (a final
        that decoded to nothing after them, see streaming/session.py).
        """
        quiet_start = min(utterance_start, max(lead_sample, end_sample - window_samples))
        if alone:
            return DecodeContext(start_sample=quiet_start, prefix="", prompt="")
        used: list[CommittedFinal] = []
        tokens = self._count_tokens(forced)
        for final, final_tokens in reversed(self._recent):
            tokens += final_tokens
            if end_sample - final.start_sample > window_samples or tokens > self._context_tokens:
                break
            used.append(final)
        used.reverse()
        left_out = list(self._recent)[: len(self._recent) - len(used)]
        older = self._older + [f.text for f, _ in left_out]
        return DecodeContext(
            start_sample=used[0].start_sample if used else quiet_start,
            prefix=join_texts(f.text for f in used),
            prompt=tail_words(join_texts(older), self._prompt_chars),
        )

    def keep_from(self, now_sample: int, window_samples: int) -> int:
        """The earliest audio sample a future decode may need; forgets finals out of reach.

        Every future decode ends at or after `now_sample` (the session passes the end of the
        next final to come, not the stream's end: decodes may lag far behind the audio), so a
        final that starts more than one window before it can never be context again: its text
        moves to the prompt.
        """
        while self._recent and now_sample - self._recent[0][0].start_sample > window_samples:
            self._older.append(self._recent.popleft()[0].text)
        # Only the prompt's tail is ever read; keep the list from growing for hours.
        if len(self._older) > 64:
            self._older = [tail_words(join_texts(self._older), self._prompt_chars)]
        return self._recent[0][0].start_sample if self._recent else now_sample


def tail_words(text: str, limit_chars: int) -> str:
    """The last `limit_chars` characters of `text`, starting at a word boundary (between two
    characters of a script without spaces, or after a space)."""
    if len(text) <= limit_chars:
        return text
    if limit_chars <= 0:
        return ""
    cut = len(text) - limit_chars
    tail = text[cut:]
    if text[cut - 1] == " " or joins_without_space(text[:cut], tail):
        return tail
    # A cut word would be a wrong word in the prompt.
    return tail.split(" ", 1)[1] if " " in tail else ""
