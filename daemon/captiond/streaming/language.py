"""A session's language decision: which language each utterance is decoded in, and what the
conversation so far is in.

With `?language=auto` every utterance's language is detected by its first decode and never
changes within it (no flapping). The session's language so far is the hint detection leans on,
and the evidence for another language that consecutive utterances leave is added up
(engines.rules.choose_language) before the session's language switches.

Sans-I/O; owned by its StreamSession, on the thread that feeds it (the event loop's).
"""

from __future__ import annotations

from captiond.config import StreamConfig
from captiond.engines.base import DecodeKind, EngineResult
from captiond.lang.languages import LanguageSetting
from captiond.samples import ms_to_samples
from captiond.streaming.events import StreamParams
from captiond.streaming.utterance import DecodeRequest, Utterance

# Audio an utterance's language is detected on once the session has a language to fall back
# on (`language_detect_s` before that).
_HINTED_DETECT_MS = 1_000
# Below this probability of the session's language, 1 s of an utterance does not decide it:
# the detection waits for `language_detect_s` of audio. One second of English after Spanish
# was heard as Spanish (English short of the odds a switch needs), and the whole eight-second
# sentence was then decoded as Spanish: translated.
_SURE_SAME_LANGUAGE = 0.5
# Nor does a detection of another language on less than `language_detect_s` of audio switch
# the session's: base heard one second of German as English at 0.91, 1.6 s of Spanish as
# Portuguese at 0.89, and decoded the sentences in those languages (the German one translated
# to English). On the first 3 s of 109 utterances of the two corpora (14 languages) no other
# language reached 0.7. A partial waits for `language_detect_s`; an utterance shorter than
# that is decoded in the session's language (`too_short_to_switch`).


class SessionLanguage:
    """The conversation's language so far and the evidence against it."""

    def __init__(self, stream: StreamConfig, params: StreamParams, resumed: str | None) -> None:
        # The session's language so far: what an utterance in ?language=auto is decoded in
        # unless the evidence for another one is strong enough (engines.rules.choose_language).
        # A resumed session goes on in the language its journal last recorded.
        self.language: str | None = resumed if params.auto_language else params.language
        # The evidence for another language its utterances so far left (choose_language adds
        # it up over consecutive ones): the language and ln of its odds against the session's.
        self.switch: tuple[str | None, float] = (None, 0.0)
        self._detect_samples = ms_to_samples(round(stream.language_detect_s * 1000))
        self._detect_hinted_samples = min(self._detect_samples, ms_to_samples(_HINTED_DETECT_MS))

    def set(self, setting: LanguageSetting, params: StreamParams) -> None:
        """The client said what is spoken from now on (`params` already updated to `setting`)."""
        if not params.auto_language:
            self.language = params.language
        elif setting.candidates and self.language not in setting.candidates:
            self.language = None  # the conversation so far is in none of them
        self.switch = (None, 0.0)  # no evidence against what the client said

    def detect_samples_of(self, utt: Utterance) -> int:
        """Audio an utterance needs before its language is decided (see StreamConfig)."""
        hinted = self.language is not None and not utt.detect_longer
        return self._detect_hinted_samples if hinted else self._detect_samples

    def too_short_to_switch(self, utt: Utterance, end_sample: int) -> bool:
        """Whether the utterance's audio up to `end_sample` is too little to leave the session's
        language on (the comment after `_SURE_SAME_LANGUAGE`); False while there is none."""
        return self.language is not None and end_sample - utt.start_sample < self._detect_samples

    def for_decode(self, utt: Utterance, kind: DecodeKind, end_sample: int) -> str | None:
        """The language a decode of `utt` up to `end_sample` is asked in (None: detect it). A
        final of an utterance too short to switch the session's language is in that language."""
        short = kind is DecodeKind.FINAL and self.too_short_to_switch(utt, end_sample)
        return self.language if utt.language is None and short else utt.language

    def take(self, utt: Utterance, request: DecodeRequest, result: EngineResult) -> bool | None:
        """Decide the utterance's language from the decode that detected it. None when that
        decode's text is not to be used because the detection is not decided yet: a partial's
        detection on the first second found another language, or kept the session's without
        being sure of it, and the utterance is detected again on `language_detect_s` of audio
        (`_SURE_SAME_LANGUAGE`; a final decides in any case). Otherwise whether the language
        changed: an utterance in another language than the conversation so far does not
        continue its context, neither prefix nor prompt, both in the wrong language (Japanese
        speech came out as English), so the caller starts the context over, and a decode that
        had that context is not used either."""
        assert result.language is not None
        if (
            request.kind is DecodeKind.PARTIAL
            and not utt.detect_longer
            and (
                result.language != self.language
                or result.language_probability < _SURE_SAME_LANGUAGE
            )
            and self.too_short_to_switch(utt, request.end_sample)
        ):
            utt.detect_longer = True
            return None
        if request.engine_request.language is None:  # detected: else no evidence either way
            utt.switch = (result.switch_language, result.switch_nats)
        utt.language = result.language
        return self.language is not None and result.language != self.language

    def on_final(self, utt: Utterance, text: str) -> None:
        """Only a caption says what the conversation is in: an utterance of noise that Whisper
        heard as Welsh and decoded to nothing must not hold the next one to Welsh."""
        if text:
            self.language = utt.language or self.language
            if utt.switch is not None:
                self.switch = utt.switch
