"""Protocol v1's values: stream parameters, client control messages, and server messages as
JSON (Ready, Partial, Final, ...), which every dialect renders in its own form.

Pure values (Sans-I/O), used on the event-loop thread. The message table is in
docs/reference/protocol-v1.md; this module is its single implementation on the daemon side.
"""

from __future__ import annotations

import dataclasses
import enum
import json
from dataclasses import dataclass
from typing import Any, ClassVar

from captiond import PROTOCOL
from captiond.config import END_OF_TURN_MODES, VadConfig
from captiond.errors import BadMessageError
from captiond.lang.languages import AUTO_LANGUAGE, LanguageSetting, parse_language
from captiond.whisper import SAMPLE_RATE_HZ

ENCODINGS = {"pcm_s16le": 2, "f32le": 4}
MIN_SAMPLE_RATE_HZ = 8_000
MAX_SAMPLE_RATE_HZ = 192_000


# The longest pause a client may ask a turn to wait for (`TurnParams`).
MAX_TURN_SILENCE_MS = 10_000


@dataclass(frozen=True, slots=True, kw_only=True)
class TurnParams:
    """How a stream's turns end where its client said so (v1's query, a vendor's keys); None
    keeps the daemon's `[vad]` value of that name (config.VadConfig)."""

    end_of_turn: str | None = None  # "model" or "silence"
    end_of_turn_threshold: float | None = None
    end_of_turn_pause_ms: int | None = None
    max_turn_silence_ms: int | None = None
    endpoint_silence_ms: int | None = None
    unfinished_endpoint_silence_ms: int | None = None

    def __post_init__(self) -> None:
        if self.end_of_turn is not None and self.end_of_turn not in END_OF_TURN_MODES:
            raise BadMessageError(f"end_of_turn must be one of {', '.join(END_OF_TURN_MODES)}")
        if self.end_of_turn_threshold is not None and not 0 <= self.end_of_turn_threshold <= 1:
            raise BadMessageError("end_of_turn_threshold must be from 0 to 1")
        for name in (
            "end_of_turn_pause_ms",
            "max_turn_silence_ms",
            "endpoint_silence_ms",
            "unfinished_endpoint_silence_ms",
        ):
            value = getattr(self, name)
            if value is not None and not 30 <= value <= MAX_TURN_SILENCE_MS:
                raise BadMessageError(f"{name} must be from 30 to {MAX_TURN_SILENCE_MS} ms")

    def applied_to(self, vad: VadConfig) -> VadConfig:
        """`vad` with this stream's own values; a pause that asks the model later than the
        longest wait asks it at that wait."""
        changes = {
            field.name: getattr(self, field.name)
            for field in dataclasses.fields(self)
            if getattr(self, field.name) is not None
        }
        vad = dataclasses.replace(vad, **changes)
        if vad.end_of_turn_pause_ms > vad.max_turn_silence_ms:
            vad = dataclasses.replace(vad, end_of_turn_pause_ms=vad.max_turn_silence_ms)
        return vad

    def journal(self) -> dict[str, Any]:
        """The values a client set, as the journal's header keeps them."""
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}


@dataclass(frozen=True, slots=True, kw_only=True)
class StreamParams:
    """What the client's audio is: from the `/v1/stream` query string."""

    sample_rate_hz: int = SAMPLE_RATE_HZ
    encoding: str = "pcm_s16le"
    language: str = "en"  # or "auto": detected per utterance
    # With "auto": the languages it is detected among (`?language=en,de`), in the order given;
    # empty: any the model knows.
    candidates: tuple[str, ...] = ()
    # The script Chinese is written in, when the language tag named one (`?language=zh-TW`);
    # None: the daemon's `[stream] chinese_variant`.
    chinese_variant: str | None = None
    task: str = "transcribe"  # or "translate": English captions of any language
    # Names and terms the audio may contain, put before every decode's previous text; None:
    # the daemon's `[stream] prompt`.
    prompt: str | None = None
    # Who said what (`?diarize=true`, `?max_speakers=`); None: the daemon's `[stream] diarize`
    # and `max_speakers`.
    diarize: bool | None = None
    max_speakers: int | None = None
    # How its turns end (`?end_of_turn=`, a vendor's turn keys); unset: the daemon's [vad].
    turn: TurnParams = TurnParams()

    @property
    def auto_language(self) -> bool:
        return self.language == AUTO_LANGUAGE

    @property
    def language_setting(self) -> str:
        """`language` as the client wrote it, Chinese variant aside ("de", "auto", "en,de")."""
        return LanguageSetting(self.language, self.candidates).setting

    @property
    def bytes_per_sample(self) -> int:
        return ENCODINGS[self.encoding]


def daemon_stream_params(language: str, task: str = "transcribe") -> StreamParams:
    """The parameters of a stream the daemon opens itself (files, its microphone) in
    `[stream] language` (`parse_language`) and `task`."""
    setting = parse_language(language)
    return StreamParams(language=setting.code, candidates=setting.candidates, task=task)


class Control(enum.Enum):
    """Client → server control messages without fields."""

    FINALIZE = "finalize"
    END = "end"
    KEEPALIVE = "keepalive"


@dataclass(frozen=True, slots=True, kw_only=True)
class Ack:
    """`{"type":"ack","segment":N}`: the client holds every final up to segment N."""

    segment: int


@dataclass(frozen=True, slots=True, kw_only=True)
class ServerMessage:
    TYPE: ClassVar[str] = ""

    def to_dict(self) -> dict[str, Any]:
        return {"type": self.TYPE, **dataclasses.asdict(self)}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), ensure_ascii=False, separators=(",", ":"))


@dataclass(frozen=True, slots=True, kw_only=True)
class Ready(ServerMessage):
    TYPE: ClassVar[str] = "ready"
    protocol: str = PROTOCOL
    session: str
    sample_rate: int
    model: str
    engine: str
    # Reconnect with `?resume=` this within `resume_s` to take the session back (None: off).
    resume_token: str | None = None
    resume_s: float = 0.0
    # The stream's audio speed limit ([server] max_audio_speed after audio_burst_s; counted
    # from the session's start, and anew for one resumed from the journal): a client that
    # sends faster than real time (a file, a resume's backlog) paces itself under it.
    max_audio_speed: float
    audio_burst_s: float


@dataclass(frozen=True, slots=True, kw_only=True)
class Resumed(Ready):
    """The first message of a resumed session, instead of `ready`; the `replayed` finals come
    next. Audio sent now continues the stream after `received_bytes` of audio (a client that
    kept its audio resends from there); `gap_ms` is how long the session had no connection."""

    TYPE: ClassVar[str] = "resumed"
    audio_ms: int
    received_bytes: int
    ended: bool  # the daemon has the client's `end`: do not send it again
    gap_ms: int
    replayed: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Partial(ServerMessage):
    TYPE: ClassVar[str] = "partial"
    segment: int
    rev: int
    start_ms: int
    end_ms: int
    stable: str
    # What goes between `stable` and `unstable` shown together: " ", or "" where the text has
    # no space there (Chinese and Japanese, inside a Thai phrase, "我用" + "Python写").
    separator: str
    unstable: str
    language: str | None = None  # spoken (detected with ?language=auto)
    # With [vad] end_of_turn = "model": the model's probability that the speaker was done, at
    # its latest check of this segment (a pause); None (and absent from the JSON): not asked.
    end_of_turn: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return _without_unasked_turn(ServerMessage.to_dict(self))


def _without_unasked_turn(data: dict[str, Any]) -> dict[str, Any]:
    """`end_of_turn` only where the end-of-turn model was asked: a stream without it sends
    what it always has."""
    if data.get("end_of_turn", 0.0) is None:
        del data["end_of_turn"]
    return data


@dataclass(frozen=True, slots=True, kw_only=True)
class Word:
    """One word of a final: a text unit of its `text` (lang.text.units; the units joined give
    the text back), where it starts and ends on the stream clock, and how sure the model was of
    it (the mean probability of its tokens; None for a word the final's decode did not write,
    see streaming/words.py)."""

    word: str
    start_ms: int
    end_ms: int
    confidence: float | None
    speaker: int | None = None  # diarized streams: who said it (streaming/speakers.py)


@dataclass(frozen=True, slots=True, kw_only=True)
class Speech:
    """A stretch of a diarized final that the VAD heard as speech, on the stream clock: its
    speaker's, whether or not a word was written there (Whisper leaves out most hesitations
    and back-channel "mhm"s, which are still someone speaking)."""

    start_ms: int
    end_ms: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Final(ServerMessage):
    TYPE: ClassVar[str] = "final"
    segment: int
    start_ms: int
    end_ms: int
    text: str
    language: str | None = None  # spoken (detected with ?language=auto)
    # Its words with their times and confidences (streaming/words.py); empty when the engine
    # gives no word timings (every shipped engine gives them) or the text is.
    words: tuple[Word, ...] = ()
    # Who said it, on a diarized stream: speakers are numbered from 0 in the order they first
    # spoke, and a final's speaker is never revised (streaming/speakers.py). None: not diarized,
    # or too little audio to tell.
    speaker: int | None = None
    # As Partial's: at the check that ended the utterance, or the latest before it ended
    # otherwise; on a diarized final split at a speaker change, only its last part's.
    end_of_turn: float | None = None
    # Diarized: where in [start_ms, end_ms] its speaker was heard (streaming/speakers.py), in
    # order; empty (and absent from the JSON) on a stream that is not diarized.
    speech: tuple[Speech, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        data = ServerMessage.to_dict(self)
        data["words"] = list(data["words"])  # a JSON array, as the journal reads it back
        if data["speech"]:
            data["speech"] = list(data["speech"])
        else:
            del data["speech"]
        return _without_unasked_turn(data)


@dataclass(frozen=True, slots=True, kw_only=True)
class SpeechStarted(ServerMessage):
    TYPE: ClassVar[str] = "speech_started"
    start_ms: int


@dataclass(frozen=True, slots=True, kw_only=True)
class SpeechStopped(ServerMessage):
    TYPE: ClassVar[str] = "speech_stopped"
    end_ms: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Done(ServerMessage):
    TYPE: ClassVar[str] = "done"
    audio_ms: int
    segments: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Error(ServerMessage):
    TYPE: ClassVar[str] = "error"
    code: str
    message: str


@dataclass(frozen=True, slots=True, kw_only=True)
class SourceStatus(ServerMessage):
    """A daemon-captured source's state, sent to its viewers on join and on every change.
    `run` names this run of the source (new at each start of the daemon or of its worker):
    its segments are numbered from 0 again, so a viewer's `since` holds within one run."""

    TYPE: ClassVar[str] = "source"
    name: str
    run: str
    state: str  # "capturing" | "waiting_for_device" | "stopped"
    message: str
