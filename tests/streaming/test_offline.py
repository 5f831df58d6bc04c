"""A file transcribed as a stream (streaming/offline.py): `captiond transcribe --diarize` and
`bench diarize` run the session with a speaker model in the same thread."""

from __future__ import annotations

import numpy as np
from daemon_harness import ToneEmbedder, tone_bursts

from captiond.config import load_config
from captiond.engines.fake import FakeEngine
from captiond.streaming.offline import transcribe_samples


def test_a_diarized_file_names_who_spoke_in_every_final() -> None:
    """Most decodes fill no speaker window (a partial's first second): they are answered with
    no embeddings, not an error."""
    pcm = tone_bursts([2.5, 2.5], gap_s=2.0, tones_hz=[220, 880])
    transcript = transcribe_samples(
        pcm.astype(np.float32) / 32768,
        FakeEngine(),
        load_config(None),
        partials=True,
        embedder=ToneEmbedder(),
        diarize=True,
    )
    assert transcript.segments
    for final in transcript.segments:
        assert final.speaker is not None and final.speech
