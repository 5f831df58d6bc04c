"""Offline transcription of a whole file through the streaming session, without partials (or,
for `captiond bench decode --partials`, with them, each decode answered at once).

Runs on the calling thread, which owns the engine for the duration (the CLI's main thread, or a
benchmark), and checks the speech gate there too. Using StreamSession itself guarantees the same
VAD, segmentation, prompts and hallucination filter as streaming, so streaming and offline differ
only in what streaming adds.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from captiond.config import Config
from captiond.engines.base import DecodeKind, Embedder, Engine, embed_speakers
from captiond.engines.rules import token_counter
from captiond.engines.speech_gate import applies, gate
from captiond.lang.text import join_texts
from captiond.samples import ms_to_samples
from captiond.streaming.audio import CHUNK_MS as CLIENT_CHUNK_MS
from captiond.streaming.events import Control, Final, Partial, daemon_stream_params
from captiond.streaming.session import StreamSession
from captiond.streaming.vad import webrtc_vad

_CHUNK_MS = 500


@dataclass(frozen=True, slots=True, kw_only=True)
class Transcript:
    text: str
    audio_ms: int
    # The partials (with `partials`) and finals in the order the session sent them: what
    # `bench decode --partials` measures stable words on.
    messages: tuple[Partial | Final, ...] = ()
    # Final decodes the engine ran: one per final, more where an early final was thrown away
    # (the speaker went on after `final_tail_ms` of silence) or one was decoded again alone.
    final_decodes: int = 0

    @property
    def segments(self) -> tuple[Final, ...]:
        """The finals, in order."""
        return tuple(message for message in self.messages if isinstance(message, Final))

    @property
    def partials(self) -> int:
        """Partial messages the session sent."""
        return sum(1 for message in self.messages if isinstance(message, Partial))


def transcribe_samples(
    samples: npt.NDArray[np.float32],
    engine: Engine,
    config: Config,
    task: str = "transcribe",
    *,
    partials: bool = False,
    embedder: Embedder | None = None,
    diarize: bool = False,
) -> Transcript:
    """16 kHz mono float32 audio to the finals a stream of it would produce. With `partials`,
    the session also asks for partials and early finals, as a live stream's does: its stable
    words are then forced into partials and kept in finals, as they would be live. With
    `diarize`, the finals carry speakers, from `embedder`'s embeddings."""
    session = StreamSession(
        config=config,
        vad=webrtc_vad(config.vad.aggressiveness),
        params=dataclasses.replace(
            daemon_stream_params(config.stream.language, task), diarize=diarize
        ),
        partials=partials,
        # Without partials a file has no latency to save: an early final would only decode
        # again what the final decodes the same way (its audio ends at the same sample).
        early_finals=partials,
        count_tokens=token_counter(engine.tokenizer_path),
    )
    sent: list[Partial | Final] = []
    gated = applies(config.engine, engine.name)
    final_decodes = 0

    def drain() -> None:
        nonlocal final_decodes
        while (request := session.next_request()) is not None:
            result = gate(request.engine_request) if gated else None
            if result is None:
                (result,) = engine.transcribe_batch([request.engine_request])
                if embedder is not None:
                    (result,) = embed_speakers(embedder, [request.engine_request], [result])
                if request.engine_request.kind is DecodeKind.FINAL:
                    final_decodes += 1
            session.on_result(request, result)
        for message in session.take_messages():
            if isinstance(message, Partial | Final):
                sent.append(message)

    # With partials, audio goes in as the client streams it, so partials fall where a
    # stream's would.
    chunk = ms_to_samples(CLIENT_CHUNK_MS if partials else _CHUNK_MS)
    for start in range(0, len(samples), chunk):
        session.receive_samples(samples[start : start + chunk])
        drain()
    session.receive_control(Control.END)
    drain()
    return Transcript(
        text=join_texts(m.text for m in sent if isinstance(m, Final)),
        audio_ms=session.audio_ms,
        messages=tuple(sent),
        final_decodes=final_decodes,
    )
