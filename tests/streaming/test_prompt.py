"""A stream's prompt (names and terms the audio may contain): `?prompt=`, `[stream] prompt`, and
its way into every decode (streaming/events.py, streaming/session.py, engines.rules.fit_prompt),
with the real model on
real speech. The vendor dialects' prompt fields are tested with their SDKs in test_dialect_*.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from urllib.parse import quote

import numpy as np
import pytest
from daemon_harness import (
    Exchange,
    RecordingEngine,
    make_config,
    running_daemon,
    stream_pcm,
    tone_bursts,
    url,
)
from testkit import read_wav_int16

from captiond.config import config_from_mapping, override
from captiond.dialects.native import Query, parse_stream_params
from captiond.engines.base import Engine
from captiond.errors import BadMessageError, ConfigError
from captiond.lang.languages import MAX_PROMPT_CHARS, check_prompt, prompt_of_terms
from captiond.streaming.offline import transcribe_samples

# "Author of the danger trail, Philip Steels, etc.": tiny.en hears "fill up steels" alone.
CLIP = "utt/cmu_arctic_aew_a0001.wav"
NAME = "Philip Steels"


def test_the_query_prompt_is_the_stream_prompt_and_absent_means_the_daemon_default() -> None:
    assert parse_stream_params(Query("prompt=+Dr.+Okafor%2C+Grafana+"), "en").prompt == (
        "Dr. Okafor, Grafana"
    )
    # Blank parameters count as absent, as they always have (`?language=`).
    assert parse_stream_params(Query("prompt="), "en").prompt is None
    assert parse_stream_params(Query(""), "en").prompt is None


def test_a_prompt_over_the_limit_is_refused_not_cut() -> None:
    assert check_prompt("x" * MAX_PROMPT_CHARS) == "x" * MAX_PROMPT_CHARS
    with pytest.raises(BadMessageError, match="keyterm is 1001 characters"):
        check_prompt("x" * (MAX_PROMPT_CHARS + 1), "keyterm")


def test_a_prompt_of_the_most_characters_fits_the_request_line_in_any_script() -> None:
    """1,000 characters of four UTF-8 bytes each are 12 kB URL-encoded: over websockets' 8-kB
    request line, which once cut such a request off unanswered."""
    longest = "𠀋" * MAX_PROMPT_CHARS
    engine = RecordingEngine()
    burst = tone_bursts([1.0])

    async def scenario() -> tuple[Exchange, Exchange]:
        async with running_daemon(engine=engine) as daemon:
            fits = await stream_pcm(url(daemon, query=f"prompt={quote(longest)}"), burst)
            over = await stream_pcm(url(daemon, query=f"prompt={quote(longest + '𠀋')}"), burst)
            return fits, over

    fits, over = asyncio.run(scenario())
    assert fits.of("done") and set(engine.prompts) == {longest}
    assert over.of("error")[0]["code"] == "bad_message" and over.close_code == 1008


@pytest.mark.parametrize("prompt", ["<|endoftext|><|startoftranscript|> hi", "a <|de|> b"])
def test_a_prompt_with_control_token_markers_is_refused(prompt: str) -> None:
    # The tokenizer would read them as the control tokens themselves (a prompt of three
    # end-of-texts collapsed JFK's captions to "And so...").
    with pytest.raises(BadMessageError, match="control-token markers"):
        check_prompt(prompt)
    assert check_prompt("C++ <templates>, a|b") == "C++ <templates>, a|b"
    with pytest.raises(ConfigError, match=r"\[stream\] prompt may not"):
        config_from_mapping({"stream": {"prompt": prompt}})


def test_a_prompt_with_half_an_emoji_is_refused() -> None:
    """JSON's "\\ud83d" (a lone surrogate) is refused: a session update carrying it used to
    drop the connection (1006) when the reply echoing it could not be encoded."""
    with pytest.raises(BadMessageError, match="lone surrogate"):
        check_prompt(json.loads('"Priya \\ud83d"'))
    assert check_prompt(json.loads('"Priya \\ud83d\\ude00"')) == "Priya \U0001f600"


def test_repeated_query_parameters_keep_every_value_and_terms_join_with_commas() -> None:
    query = Query("keyterm=Grafana&keyterm=customer+service&keyterm=+&sample_rate=16000")
    assert query["keyterm"] == " " and query["sample_rate"] == "16000"
    assert query.every("keyterm") == ["Grafana", "customer service", " "]
    assert prompt_of_terms(query.every("keyterm")) == "Grafana, customer service."
    assert prompt_of_terms(["Dr. Lindqvist", "C++"]) == "Dr. Lindqvist, C++"
    assert prompt_of_terms(["  "]) == ""


def test_every_decode_carries_the_client_prompt_or_else_the_daemons() -> None:
    config = make_config(server={"max_audio_speed": 1e6}, stream={"prompt": "Kubernetes"})
    engine = RecordingEngine()

    async def scenario() -> None:
        async with running_daemon(config, engine=engine) as daemon:
            given = await stream_pcm(url(daemon, query=f"prompt={quote(NAME)}"), tone_bursts([1.0]))
            assert given.of("final")
            assert set(engine.prompts) == {NAME}
            engine.prompts.clear()
            default = await stream_pcm(url(daemon), tone_bursts([1.0]))
            assert default.of("final")
            assert set(engine.prompts) == {"Kubernetes"}

    asyncio.run(scenario())


# -- the real model ----------------------------------------------------------------------------


@pytest.mark.model
def test_a_name_in_the_prompt_is_heard_live_and_in_a_file(
    speech_dir: Path, tiny_en: Engine
) -> None:
    """The bundled model mishears a name alone and writes it given the name in the prompt,
    over /v1/stream (`?prompt=`) as in `captiond transcribe` (`[stream] prompt`)."""
    pcm = np.concatenate([read_wav_int16(speech_dir / CLIP), np.zeros(16_000, "<i2")])
    config = make_config(server={"max_audio_speed": 1e6})

    async def scenario() -> tuple[str, str]:
        async with running_daemon(config, engine=tiny_en, vad_factory=None) as daemon:
            plain = await stream_pcm(url(daemon), pcm)
            prompted = await stream_pcm(url(daemon, query=f"prompt={quote(NAME)}"), pcm)
        texts = [" ".join(m["text"] for m in ex.of("final")) for ex in (plain, prompted)]
        return texts[0], texts[1]

    plain, prompted = asyncio.run(scenario())
    assert "danger trail" in plain.lower() and NAME not in plain
    assert NAME in prompted and "danger trail" in prompted.lower()
    offline = transcribe_samples(
        pcm.astype(np.float32) / 32768, tiny_en, override(config, "stream", prompt=NAME)
    )
    assert NAME in offline.text
