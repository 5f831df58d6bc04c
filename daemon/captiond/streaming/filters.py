"""The rules that judge a decode's text before a session uses it: Whisper's hallucination
filters (silent-looking and unsure, too repetitive, sparse over long audio, no letter at all),
and when a final decoded with the conversation's context is asked for again alone.

Pure functions of a request and its result (Sans-I/O), called by StreamSession on the thread
that feeds it (the event loop's).
"""

from __future__ import annotations

from captiond.config import StreamConfig
from captiond.engines.base import DecodeKind, EngineResult
from captiond.lang.text import has_word, only_punctuation, repeats_the_end_of, units
from captiond.streaming.utterance import DecodeRequest, Utterance
from captiond.whisper import SAMPLE_RATE_HZ


def is_hallucination(request: DecodeRequest, result: EngineResult, cfg: StreamConfig) -> bool:
    """Whisper's rules (silent-looking and unsure, or too repetitive: a loop the engine
    stopped is too), plus sparse-and-unsure text over long audio, and text without a single
    letter or digit."""
    if not has_word(result.text):
        return True
    words = len(request.forced_words) + len(units(result.text))
    silent = (
        result.no_speech_prob > cfg.no_speech_threshold
        and result.avg_logprob < cfg.logprob_threshold
    )
    # From the first voiced frame: the pre-roll would make a short, slow phrase (two Arabic
    # words in 2.2 s) look like long sparse noise.
    duration_s = (request.end_sample - request.speech_start_sample) / SAMPLE_RATE_HZ
    # Partials are judged without the minimum duration: a wrong partial only delays text,
    # while a ghost partial over music would show captions where there are none.
    long_enough = request.kind is DecodeKind.PARTIAL or duration_s >= cfg.sparse_min_s
    sparse = (
        long_enough
        and words < cfg.sparse_words_per_s * duration_s
        and result.avg_logprob < cfg.sparse_logprob_threshold
    )
    repetitive = result.looped or result.compression_ratio > cfg.compression_ratio_threshold
    return silent or sparse or repetitive


def ask_again_alone(
    utt: Utterance, request: DecodeRequest, text: str, result: EngineResult
) -> bool:
    """Whether to ask for the utterance's final again without context (and mark it so): when
    this one was decoded after earlier finals (or prompted with them) and

    - decoded to nothing though the utterance's partials had shown words, or wrote only
      punctuation after a forced prefix. Conditioned on the conversation, Whisper can end
      at once (a Japanese turn decoded to "。" after the turn before it, closing the
      context's sentence), and the words the reader saw would go with the final. An
      utterance that showed no words and whose decode wrote nothing at all is not asked
      again: it may be noise, which Whisper alone may caption;
    - or wrote the context's last words again, once or more, and nothing else: Whisper
      conditioned on a sentence can hear the next one as that sentence (in a Japanese
      session spoken fast, every turn after the second came out as the second), and each
      such final, forced into the next decode, makes the next one likelier. A speaker who
      did say the same again gets it from the decode alone;
    - or wrote words but ran out of tokens after a forced prefix (`EngineResult.truncated`;
      the filters drop a loop that ran out, which the first rule then covers): the prefix
      counts in the decode's budget (`engines.rules.new_token_budget`), and in a script of about
      a token per character (Chinese, Japanese) the context's characters leave a long
      utterance too few; its last words would be lost. Alone it has the whole budget."""
    engine_request = request.engine_request
    if utt.alone or not (engine_request.prefix or engine_request.prompt):
        return False
    wrote = result.text.strip()
    closed_only = bool(wrote) and only_punctuation(wrote) and bool(engine_request.prefix)
    lost = not text and (utt.segment is not None or closed_only)
    # A truncated decode the filters dropped (text "") was a loop, not a long utterance.
    cut_short = bool(text) and result.truncated and bool(engine_request.prefix)
    if not (lost or cut_short or repeats_the_end_of(text, engine_request.prefix)):
        return False
    utt.alone = True
    utt.early_end_sample = 0  # an early final: due again while the speaker stays silent
    return True
