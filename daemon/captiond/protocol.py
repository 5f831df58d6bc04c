"""Protocol v1 codec: stream parameters, client control messages, server messages as JSON.

Pure functions and values (Sans-I/O), used on the event-loop thread. The message table is in
DESIGN.md §3 and the README; this module is its single implementation on the daemon side.
"""

from __future__ import annotations

import dataclasses
import enum
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple
from urllib.parse import parse_qsl

from captiond import PROTOCOL
from captiond.chinese import variant_of
from captiond.errors import BadAudioError, BadMessageError

ENCODINGS = {"pcm_s16le": 2, "f32le": 4}
AUTO_LANGUAGE = "auto"
TASKS = ("transcribe", "translate")
MIN_SAMPLE_RATE_HZ = 8_000
MAX_SAMPLE_RATE_HZ = 192_000
# The languages Whisper's multilingual models know (openai/whisper's tokenizer.LANGUAGES): a
# code outside them is refused when the stream opens, not by the engine at its first decode.
_WHISPER_CODES = (
    "af am ar as az ba be bg bn bo br bs ca cs cy da de el en es et eu fa fi fo fr gl gu ha haw "
    "he hi hr ht hu hy id is it ja jw ka kk km kn ko la lb ln lo lt lv mg mi mk ml mn mr ms mt my "
    "ne nl nn no oc pa pl ps pt ro ru sa sd si sk sl sn so sq sr su sv sw ta te tg th tk tl tr tt "
    "uk ur uz vi yi yo yue zh"
)
WHISPER_LANGUAGES = frozenset(_WHISPER_CODES.split())
# Tags whose primary subtag Whisper spells otherwise: ISO 639-1 Javanese, BCP 47's Norwegian
# Bokmål, and Hebrew's withdrawn code (still sent by Java and Android).
_WHISPER_SPELLING = {"jv": "jw", "nb": "no", "iw": "he"}
# A stream's prompt (names, terms): engines keep at most 111 tokens of it (engines.fit_prompt),
# a few hundred characters in most scripts; longer text is a mistake, refused rather than cut.
MAX_PROMPT_CHARS = 1_000


@dataclass(frozen=True, slots=True, kw_only=True)
class StreamParams:
    """What the client's audio is: from the `/v1/stream` query string."""

    sample_rate_hz: int = 16_000
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


def parse_stream_params(query: Mapping[str, str], default_language: str) -> StreamParams:
    """Validate the query string of `/v1/stream`; unknown parameters are ignored."""
    encoding = query.get("encoding", "pcm_s16le")
    if encoding not in ENCODINGS:
        raise BadAudioError(
            f"unsupported encoding {encoding!r}: use one of {', '.join(sorted(ENCODINGS))}"
        )
    rate_text = query.get("sample_rate", "16000")
    try:
        rate_hz = int(rate_text)
    except ValueError:
        raise BadAudioError(f"sample_rate must be an integer, got {rate_text!r}") from None
    if not MIN_SAMPLE_RATE_HZ <= rate_hz <= MAX_SAMPLE_RATE_HZ:
        raise BadAudioError(
            f"unsupported sample_rate {rate_hz}: use {MIN_SAMPLE_RATE_HZ}..{MAX_SAMPLE_RATE_HZ} Hz"
        )
    language = parse_language(query.get("language", default_language))
    task = query.get("task", "transcribe")
    if task not in TASKS:
        raise BadMessageError(f"task must be one of {', '.join(TASKS)}, got {task[:20]!r}")
    prompt = query.get("prompt")
    return StreamParams(
        sample_rate_hz=rate_hz,
        encoding=encoding,
        language=language.code,
        candidates=language.candidates,
        chinese_variant=language.chinese_variant,
        task=task,
        prompt=None if prompt is None else check_prompt(prompt),
    )


class LanguageSetting(NamedTuple):
    """What a stream's `language` asks for: a Whisper language code or "auto", the languages
    "auto" is detected among (empty: any), and the Chinese variant a tag names."""

    code: str
    candidates: tuple[str, ...] = ()
    chinese_variant: str | None = None

    @property
    def setting(self) -> str:
        """As `[stream] language` writes it: "de", "auto", or the candidates ("en,de")."""
        return ",".join(self.candidates) or self.code


def daemon_stream_params(language: str, task: str = "transcribe") -> StreamParams:
    """The parameters of a stream the daemon opens itself (files, its microphone) in
    `[stream] language` (`parse_language`) and `task`."""
    setting = parse_language(language)
    return StreamParams(language=setting.code, candidates=setting.candidates, task=task)


def parse_language(value: str) -> LanguageSetting:
    """A language tag's Whisper language (`check_language`) and the Chinese variant it names
    (`chinese.variant_of`: "zh-TW" is zh with "zh-TW", "en-US" en with none); or a
    comma-separated list of tags ("en,de,zh-TW"): "auto", detected among them."""
    tags = [tag.strip() for tag in value.split(",")]
    if len(tags) == 1:
        return parse_language_tag(value)
    codes = [check_language(tag) for tag in tags]
    if AUTO_LANGUAGE in codes:
        raise BadMessageError(
            f"language {value[:40]!r}: a list names the languages to detect among, not 'auto'"
        )
    variant = next((v for v in map(variant_of, tags) if v), None)
    return LanguageSetting(AUTO_LANGUAGE, tuple(dict.fromkeys(codes)), variant)


def parse_language_tag(tag: str) -> LanguageSetting:
    """One language tag's setting ("zh-TW": zh, naming traditional script), as the protocols
    that take no list of languages read theirs."""
    return LanguageSetting(check_language(tag), (), variant_of(tag))


def check_language(tag: str) -> str:
    """The Whisper language code (one of `WHISPER_LANGUAGES`) of a language tag ("de", "en-US",
    "zh-TW": BCP 47's primary subtag), or "auto"."""
    if tag.lower() == AUTO_LANGUAGE:
        return AUTO_LANGUAGE
    primary, *subtags = tag.split("-")
    if not (
        primary.isascii()
        and primary.isalpha()
        and 2 <= len(primary) <= 3
        and all(s.isascii() and s.isalnum() and 1 <= len(s) <= 8 for s in subtags)
    ):
        raise BadMessageError(
            f"language must be a language code (de, en-US, zh-TW) or 'auto', got {tag[:20]!r}"
        )
    code = primary.lower()
    code = _WHISPER_SPELLING.get(code, code)
    if code not in WHISPER_LANGUAGES:
        raise BadMessageError(
            f"language {tag[:20]!r} is not one Whisper knows: use a code such as de, es, ja, "
            "zh-TW (the list: README, Models and languages) or 'auto'"
        )
    return code


def check_model_language(language: str, english_only: str) -> None:
    """Refuse a language an English-only model cannot caption (`english_only`: the model's
    name when it captions English only, "" when it knows every language): it would decode
    the audio as English, which for other speech is mostly nothing at all."""
    if english_only and language not in ("en", AUTO_LANGUAGE):
        raise BadMessageError(
            f"the model {english_only} is English-only: language {language!r} needs a "
            "multilingual model (captiond serve --model base)"
        )


def check_prompt(prompt: str, what: str = "prompt") -> str:
    """A stream's prompt, stripped; `what` names it in the error as the client's protocol does."""
    if len(prompt) > MAX_PROMPT_CHARS:
        raise BadMessageError(
            f"{what} is {len(prompt)} characters long: at most {MAX_PROMPT_CHARS} are taken"
        )
    if "<|" in prompt and "|>" in prompt:
        # Whisper's tokenizer reads "<|endoftext|>" in text as the control token itself: a
        # prompt could end the prompt early or start a new transcript inside it.
        raise BadMessageError(f"{what} may not contain Whisper's control-token markers <|…|>")
    try:
        prompt.encode()
    except UnicodeEncodeError:
        # JSON lets "\ud83d" (half an emoji) through as a lone surrogate; the tokenizer, the
        # journal and the reply that echoes the prompt could not encode it.
        raise BadMessageError(f"{what} is not valid Unicode (a lone surrogate)") from None
    return prompt.strip()


def prompt_of_terms(terms: Sequence[str], what: str = "key terms") -> str:
    """Key terms (Deepgram's `keyterm`, AssemblyAI's `keyterms_prompt`) as one prompt, the way
    Whisper reads a list in its previous text: comma-separated, ended with a full stop.
    Whisper imitates its prompt's style, and the app cannot write it: JFK with the prompt
    "Kennedy" came out without a full stop or a capital, with "Kennedy." as written."""
    listed = ", ".join(t.strip() for t in terms if t.strip())
    if listed and listed[-1].isalnum():
        listed += "."
    return check_prompt(listed, what)


class Query(dict[str, str]):
    """A query string: each parameter's last value (a dict), and every value of one that is
    repeated (`every`: Deepgram's `keyterm=a&keyterm=b`)."""

    def __init__(self, text: str = "") -> None:
        self._pairs = parse_qsl(text)
        super().__init__(self._pairs)

    def every(self, name: str) -> list[str]:
        return [value for key, value in self._pairs if key == name]


@dataclass(frozen=True, slots=True, kw_only=True)
class ResumeRequest:
    """`/v1/stream?resume=TOKEN&since=N`: take a dropped session back; replay its finals from
    segment `since` (None: every final not acknowledged)."""

    token: str
    since: int | None


def parse_resume(query: Mapping[str, str]) -> ResumeRequest | None:
    """The resume asked for in a `/v1/stream` or `/v1/captions` query string, if any."""
    token = query.get("resume")
    since = parse_since(query)
    return None if token is None else ResumeRequest(token=token, since=since)


def parse_since(query: Mapping[str, str]) -> int | None:
    text = query.get("since")
    if text is None:
        return None
    if not (text.isascii() and text.isdigit() and len(text) <= 9):
        raise BadMessageError(f"since must be a segment number, got {text[:20]!r}")
    return int(text)


class Control(enum.Enum):
    """Client → server control messages without fields."""

    FINALIZE = "finalize"
    END = "end"
    KEEPALIVE = "keepalive"


@dataclass(frozen=True, slots=True, kw_only=True)
class Ack:
    """`{"type":"ack","segment":N}`: the client holds every final up to segment N."""

    segment: int


def parse_control(text: str) -> Control | Ack:
    """Decode one client text frame; unknown fields are ignored, unknown types are errors."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise BadMessageError(f"malformed JSON: {exc.msg} at position {exc.pos}") from exc
    except (RecursionError, ValueError) as exc:  # nested too deep; a number too long
        raise BadMessageError(f"not a control message: {exc}") from exc
    if not isinstance(data, dict):
        raise BadMessageError("a control message must be a JSON object with a 'type'")
    kind = data.get("type")
    if not isinstance(kind, str):
        raise BadMessageError("a control message needs a string 'type'")
    if kind == "ack":
        segment = data.get("segment")
        if type(segment) is not int or segment < 0:
            raise BadMessageError("'ack' needs a 'segment' number")
        return Ack(segment=segment)
    try:
        return Control(kind)
    except ValueError:
        known = ", ".join([*(c.value for c in Control), "ack"])
        raise BadMessageError(f"unknown message type {kind!r} (known: {known})") from None


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


@dataclass(frozen=True, slots=True, kw_only=True)
class Final(ServerMessage):
    TYPE: ClassVar[str] = "final"
    segment: int
    start_ms: int
    end_ms: int
    text: str
    language: str | None = None  # spoken (detected with ?language=auto)


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
