"""A session's audio intake: sample rates and encodings."""

from __future__ import annotations

import numpy as np
import pytest
from session_harness import RATE, Driver, silence, tone, two_utterances

from captiond.engines.base import DecodeKind
from captiond.streaming.events import Control, Done, Final, SpeechStopped, StreamParams


@pytest.mark.parametrize("rate_hz", [8_000, 48_000])
def test_finalize_of_a_resampled_stream_keeps_its_last_audio(rate_hz: int) -> None:
    """soxr holds back its filter's delay (114 ms at 8 kHz): a finalize (a push-to-talk key
    released) ends the utterance with it, and the stream's clock goes on exactly."""
    driver = Driver(params=StreamParams(sample_rate_hz=rate_hz))
    driver.send(silence(0.5, rate=rate_hz))
    driver.send(tone(2.0, rate=rate_hz))
    driver.control(Control.FINALIZE)
    (final,) = driver.of(Final)
    assert final.end_ms == 2500
    driver.send(silence(0.5, rate=rate_hz))
    driver.control(Control.END)
    assert driver.of(Done)[0].audio_ms == 3000


def test_48k_f32le_stream_is_resampled() -> None:
    params = StreamParams(sample_rate_hz=48_000, encoding="f32le")
    driver = Driver(params=params)
    driver.send(silence(1.0, rate=48_000), encode=lambda x: x.astype("<f4").tobytes())
    driver.send(tone(1.5, rate=48_000), encode=lambda x: x.astype("<f4").tobytes())
    driver.send(silence(1.0, rate=48_000), encode=lambda x: x.astype("<f4").tobytes())
    driver.control(Control.END)
    done = driver.messages[-1]
    assert isinstance(done, Done)
    assert abs(done.audio_ms - 3500) <= 5
    assert done.segments == 1
    # Decodes get 16 kHz audio: the final's request spans its 16 kHz sample count, from the
    # stream's start (the quiet before the utterance, see streaming/context.py).
    final_req = next(r for r in driver.requests if r.kind is DecodeKind.FINAL)
    audio = final_req.engine_request.audio
    assert audio.dtype == np.float32
    assert len(audio) == final_req.end_sample
    assert 1.5 * RATE < final_req.end_sample - final_req.start_sample < 2.5 * RATE
    (stop,) = driver.of(SpeechStopped)
    assert 2500 < stop.end_ms <= 3100


def test_session_passes_language_to_the_engine() -> None:
    driver = Driver(params=StreamParams(language="de"))
    two_utterances(driver)
    assert driver.requests
    assert {r.engine_request.language for r in driver.requests} == {"de"}
