"""Whisper's fixed facts, with their units: the one leaf every layer may import.

Pure values, no imports of the package's own modules (any thread). Modelled on openai/whisper's
`audio.py` constants: the rate, the 30-s window and its mel frames, and the text-context budgets
both engines share.
"""

from __future__ import annotations

SAMPLE_RATE_HZ = 16_000
# One Whisper window: every decode reads at most 30 s of audio.
WINDOW_S = 30.0
HOP_SAMPLES = 160  # 10 ms at 16 kHz: one mel frame
N_FRAMES = 3000  # one 30 s Whisper window of 10 ms mel frames
WINDOW_SAMPLES = N_FRAMES * HOP_SAMPLES

# Whisper's text context, prompt and generated tokens together (faster-whisper's max_length).
MAX_LENGTH = 448
# Whisper's text budget before the first generated token: faster-whisper keeps at most
# max_length // 2 - 1 = 223 tokens of previous text, so that half the 448-token context is left
# for the decode. The stream's prompt, previous text and prefix share it (engines.rules.fit_prompt).
PROMPT_BUDGET_TOKENS = MAX_LENGTH // 2 - 1
# A stream's own prompt (names, terms) takes at most half of that budget, so that previous text
# still conditions the decode; faster-whisper cuts its `hotwords` the same way, keeping the start.
STREAM_PROMPT_MAX_TOKENS = PROMPT_BUDGET_TOKENS // 2

# The languages Whisper's multilingual models know (openai/whisper's tokenizer.LANGUAGES): a
# code outside them is refused when the stream opens, not by the engine at its first decode.
_WHISPER_CODES = (
    "af am ar as az ba be bg bn bo br bs ca cs cy da de el en es et eu fa fi fo fr gl gu ha haw "
    "he hi hr ht hu hy id is it ja jw ka kk km kn ko la lb ln lo lt lv mg mi mk ml mn mr ms mt my "
    "ne nl nn no oc pa pl ps pt ro ru sa sd si sk sl sn so sq sr su sv sw ta te tg th tk tl tr tt "
    "uk ur uz vi yi yo yue zh"
)
WHISPER_LANGUAGES = frozenset(_WHISPER_CODES.split())
