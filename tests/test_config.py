"""Config: defaults, TOML loading, strict keys and types, overrides, dump/load round trip."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from captiond.config import (
    END_OF_TURN_MODES,
    EVENT_LOOPS,
    INSTANCE_NAME,
    RANGES,
    AuthConfig,
    Config,
    EngineConfig,
    JournalConfig,
    Range,
    SchedulerConfig,
    ServerConfig,
    StreamConfig,
    VadConfig,
    config_from_mapping,
    dump_toml,
    load_config,
    override,
)
from captiond.errors import ConfigError
from captiond.lang.chinese import VARIANTS


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "captiond.toml"
    path.write_text(text, encoding="utf-8")
    return path


# -- defaults ---------------------------------------------------------------------------------


def test_defaults_match_design() -> None:
    config = Config()
    assert load_config(None) == config
    assert config.server == ServerConfig()
    assert config.server.host == "127.0.0.1"
    assert config.server.port == 8765
    assert config.vad.aggressiveness == 3
    assert config.vad.start_window_ms == 300
    assert config.vad.start_voiced_ratio == pytest.approx(0.9)
    assert config.vad.preroll_ms == 300
    assert config.vad.endpoint_silence_ms == 500
    assert config.stream.partial_interval_ms == 500
    assert config.stream.max_utterance_s == pytest.approx(20.0)
    assert config.stream.max_utterance_s < 30.0
    assert config.stream.prompt_chars == 600
    assert config.stream.context_s == pytest.approx(30.0)
    assert config.stream.final_beam_size == 5
    assert config.stream.context_beam_size == 3
    assert config.stream.compression_ratio_threshold == pytest.approx(2.4)
    assert config.scheduler == SchedulerConfig()
    assert config.engine.name == "auto"
    assert config.auth.token == ""


def test_config_values_are_frozen() -> None:
    config = Config()
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.server.port = 1  # type: ignore[misc]


# -- loading ----------------------------------------------------------------------------------


def test_load_file_overlays_defaults(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        """
[server]
host = "0.0.0.0"
port = 9000

[vad]
endpoint_silence_ms = 700
rms_floor_dbfs = -60.5

[engine]
name = "fake"

[auth]
token = "s3cret"
""",
    )
    config = load_config(path)
    assert config.server == ServerConfig(host="0.0.0.0", port=9000)
    assert config.vad == VadConfig(endpoint_silence_ms=700, rms_floor_dbfs=-60.5)
    assert config.engine == EngineConfig(name="fake")
    assert config.auth == AuthConfig(token="s3cret")
    # Sections not in the file keep their defaults.
    assert config.stream == StreamConfig()
    assert config.scheduler == SchedulerConfig()


def test_empty_file_is_defaults(tmp_path: Path) -> None:
    assert load_config(_write(tmp_path, "")) == Config()


def test_unknown_section_is_named(tmp_path: Path) -> None:
    path = _write(tmp_path, "[bogus]\nx = 1\n[also_bogus]\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = str(info.value)
    assert "bogus" in message
    assert "also_bogus" in message
    assert str(path) in message


def test_unknown_keys_are_named(tmp_path: Path) -> None:
    path = _write(tmp_path, "[server]\nport = 1\nprot = 2\nhots = 'x'\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = str(info.value)
    assert "prot" in message
    assert "hots" in message
    assert "[server]" in message


def test_section_must_be_a_table() -> None:
    with pytest.raises(ConfigError, match="server"):
        config_from_mapping({"server": 5})


@pytest.mark.parametrize(
    ("section", "key", "value"),
    [
        ("server", "port", '"8765"'),
        ("server", "port", "true"),
        ("server", "port", "8765.0"),
        ("vad", "aggressiveness", "false"),
        ("stream", "max_utterance_s", '"20"'),
        ("stream", "max_utterance_s", "true"),
        ("server", "host", "1234"),
        ("engine", "cpu_threads", "[1, 2]"),
    ],
)
def test_wrong_types_are_rejected_naming_the_key(
    tmp_path: Path, section: str, key: str, value: str
) -> None:
    path = _write(tmp_path, f"[{section}]\n{key} = {value}\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert key in str(info.value)
    assert f"[{section}]" in str(info.value)


def test_int_is_accepted_for_float(tmp_path: Path) -> None:
    config = load_config(_write(tmp_path, "[stream]\nmax_utterance_s = 15\n[vad]\n"))
    assert config.stream.max_utterance_s == 15.0
    assert isinstance(config.stream.max_utterance_s, float)


def test_invalid_toml_names_the_path(tmp_path: Path) -> None:
    path = _write(tmp_path, "[server\nport = = 1\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(path) in str(info.value)
    assert "TOML" in str(info.value)


def test_missing_file_names_the_path(tmp_path: Path) -> None:
    path = tmp_path / "nope" / "captiond.toml"
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(path) in str(info.value)
    assert isinstance(info.value.__cause__, OSError)


# -- override ---------------------------------------------------------------------------------


def test_override_ignores_none() -> None:
    base = Config()
    assert override(base, "server", host=None, port=None) is base
    changed = override(base, "server", host="0.0.0.0", port=None)
    assert changed.server == ServerConfig(host="0.0.0.0")
    assert changed.vad == base.vad


def test_override_is_type_checked() -> None:
    with pytest.raises(ConfigError, match="port"):
        override(Config(), "server", port="80")
    with pytest.raises(ConfigError, match="nosuch"):
        override(Config(), "server", nosuch=1)


# -- dump_toml round trip ----------------------------------------------------------------------


def test_dump_toml_round_trips_defaults(tmp_path: Path) -> None:
    text = dump_toml(Config())
    for section in ("server", "vad", "stream", "scheduler", "engine", "auth"):
        assert f"[{section}]" in text
    assert load_config(_write(tmp_path, text)) == Config()


def test_dump_toml_round_trips_changed_values(tmp_path: Path) -> None:
    config = Config(
        server=ServerConfig(host="::1", port=1, tls_cert='/etc/a "b"\\c.pem'),
        vad=VadConfig(start_voiced_ratio=0.75, rms_floor_dbfs=-61.25),
        stream=StreamConfig(max_utterance_s=12.5, language="de", logprob_threshold=-0.3),
        scheduler=SchedulerConfig(max_batch=16),
        engine=EngineConfig(name="fake", model="/m/tiny", compute_type="int8"),
        auth=AuthConfig(token="tab\there 'quoted' ünïcode"),
    )
    assert load_config(_write(tmp_path, dump_toml(config))) == config


_printable_text = st.text(alphabet=st.characters(blacklist_categories=("Cc", "Cs")), max_size=20)


# Numeric keys: any value within their range (config.RANGES); cut_search_s stays below the
# shortest max_utterance_s.
_origins = st.lists(
    st.sampled_from(["*", "https://app.example.com", "http://127.0.0.1:8765", "http://[::1]"])
).map(tuple)


def _in_range(allowed: Range, default: float) -> st.SearchStrategy[Any]:
    if isinstance(default, int):
        low = max(allowed.low, -(2**62)) + allowed.low_open
        return st.integers(min_value=int(low), max_value=int(min(allowed.high, 2**62)))
    return st.floats(
        min_value=allowed.low,
        max_value=allowed.high,
        exclude_min=allowed.low_open and allowed.low != -math.inf,
        allow_nan=False,
    )


def _section_strategy(cls: type[Any]) -> st.SearchStrategy[Any]:
    fields: dict[str, st.SearchStrategy[Any]] = {}
    for f in dataclasses.fields(cls):
        default = f.default
        if f.name == "cut_search_s":
            fields[f.name] = st.floats(min_value=0.0, max_value=0.99)
        elif f.name == "workers":  # > 1 refuses TLS: see test_workers_need_plain_ws
            fields[f.name] = st.just(1)
        # The longest wait for a turn is at least the pause the model is asked at.
        elif f.name == "end_of_turn_pause_ms":
            fields[f.name] = st.integers(min_value=30, max_value=1_000)
        elif f.name == "max_turn_silence_ms":
            fields[f.name] = st.integers(min_value=1_000, max_value=10**6)
        elif f.name == "end_of_turn":
            fields[f.name] = st.sampled_from(END_OF_TURN_MODES)
        elif f.name in RANGES[cls]:
            fields[f.name] = _in_range(RANGES[cls][f.name], default)
        elif f.name == "allowed_origins":
            fields[f.name] = _origins
        elif f.name == "event_loop":
            fields[f.name] = st.sampled_from(EVENT_LOOPS)
        elif f.name == "instance":
            fields[f.name] = st.just("") | st.from_regex(INSTANCE_NAME, fullmatch=True)
        elif f.name == "trusted_proxies":
            addresses = st.sampled_from(["127.0.0.1", "10.0.0.0/8", "::1", "fd00::/8"])
            fields[f.name] = st.lists(addresses, max_size=3).map(tuple)
        elif f.name == "language":
            fields[f.name] = st.sampled_from(["en", "de", "yue", "auto", "en,de"])
        elif f.name == "chinese_variant":
            fields[f.name] = st.sampled_from(["", *VARIANTS])
        elif isinstance(default, bool):
            fields[f.name] = st.booleans()
        else:
            fields[f.name] = _printable_text
    return st.builds(cls, **fields)


@settings(max_examples=60, deadline=None)
@given(
    server=_section_strategy(ServerConfig),
    vad=_section_strategy(VadConfig),
    stream=_section_strategy(StreamConfig),
    engine=_section_strategy(EngineConfig),
    auth=_section_strategy(AuthConfig),
)
def test_dump_toml_round_trips_any_values(
    server: ServerConfig,
    vad: VadConfig,
    stream: StreamConfig,
    engine: EngineConfig,
    auth: AuthConfig,
) -> None:
    import tomllib

    config = Config(server=server, vad=vad, stream=stream, engine=engine, auth=auth)
    assert config_from_mapping(tomllib.loads(dump_toml(config))) == config


def test_the_languages_to_detect_among_are_written_as_the_daemon_passes_them_on() -> None:
    config = config_from_mapping({"stream": {"language": "en,de"}})
    assert config.stream.language == "en,de"
    with pytest.raises(ConfigError, match='write "en,de"'):
        config_from_mapping({"stream": {"language": "en, DE"}})
    with pytest.raises(ConfigError, match='write "en,zh" and chinese_variant = "zh-TW"'):
        config_from_mapping({"stream": {"language": "en,zh-TW"}})
    with pytest.raises(ConfigError, match="not 'auto'"):
        config_from_mapping({"stream": {"language": "en,auto"}})


@pytest.mark.parametrize("escape", ["\\n", "\\u0007", "\\u007f"])
def test_dump_toml_round_trips_control_characters(tmp_path: Path, escape: str) -> None:
    # A TOML file may legally hold control characters through escapes; the dumped config
    # (`serve --print-config`) must read back too.
    config = load_config(_write(tmp_path, f'[auth]\ntoken = "line1{escape}line2"\n'))
    assert "line1" in config.auth.token
    again = load_config(_write(tmp_path, dump_toml(config)))
    assert again == config


@pytest.mark.parametrize(
    "table", [{"context_s": 31.0}, {"partial_context_s": -1.0}, {"max_utterance_s": 45.0}]
)
def test_windows_longer_than_whisper_are_refused(table: dict[str, float]) -> None:
    with pytest.raises(ConfigError, match=r"\[stream\]"):
        config_from_mapping({"stream": table})


@pytest.mark.parametrize("p", [-0.1, 1.5])
def test_stable_min_probability_is_a_probability(p: float) -> None:
    with pytest.raises(ConfigError, match="stable_min_probability must be between 0 and 1"):
        config_from_mapping({"stream": {"stable_min_probability": p}})


@pytest.mark.parametrize("key", ["final_beam_size", "context_beam_size", "partial_beam_size"])
def test_beam_sizes_are_positive(key: str) -> None:
    with pytest.raises(ConfigError, match=f"{key} must be 1 or more"):
        config_from_mapping({"stream": {key: 0}})


def test_context_tokens_fit_whispers_prompt_budget() -> None:
    assert Config().stream.context_tokens == 112
    with pytest.raises(ConfigError, match="context_tokens must be between 0 and 223"):
        config_from_mapping({"stream": {"context_tokens": 224}})


def test_context_chars_of_an_older_config_is_read_as_tokens(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A service's config file from before the rename still starts the daemon, warned."""
    with caplog.at_level("WARNING", logger="captiond"):
        config = config_from_mapping({"stream": {"context_chars": 450}})
    assert config.stream.context_tokens == 112
    assert "[stream] context_chars is replaced by context_tokens: read as" in caplog.text
    both = {"stream": {"context_chars": 450, "context_tokens": 60}}
    assert config_from_mapping(both).stream.context_tokens == 60
    with pytest.raises(ConfigError, match="context_chars: expected int"):
        config_from_mapping({"stream": {"context_chars": "450"}})


@pytest.mark.parametrize("key", ["cpu_threads", "decoder_threads"])
def test_thread_counts_are_not_negative(key: str) -> None:
    with pytest.raises(ConfigError, match=f"{key} must be 0 or more"):
        config_from_mapping({"engine": {key: -1}})


@pytest.mark.parametrize(
    ("table", "match"),
    [
        ({"idle_timeout_s": 0}, "idle_timeout_s"),
        ({"max_sessions_per_ip": 0}, "max_sessions_per_ip"),
        ({"resume_s": -1}, "resume_s"),
        ({"resume_s": 1e9}, "resume_s"),
        ({"allowed_origins": "https://a.example"}, "array of strings"),
        ({"allowed_origins": ["a.example"]}, "not an origin"),
        ({"allowed_origins": ["null"]}, "not an origin"),
    ],
)
def test_server_limits_and_origins_are_checked(table: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        config_from_mapping({"server": table})


def test_allowed_origins_round_trip(tmp_path: Path) -> None:
    text = '[server]\nallowed_origins = ["https://app.example.com", "*"]\n'
    config = load_config(_write(tmp_path, text))
    assert config.server.allowed_origins == ("https://app.example.com", "*")
    assert load_config(_write(tmp_path, dump_toml(config))) == config


def test_end_of_turn_is_silence_or_model_and_waits_at_least_its_pause() -> None:
    with pytest.raises(ConfigError, match=r"\[vad\] end_of_turn must be one of silence, model"):
        config_from_mapping({"vad": {"end_of_turn": "smart"}})
    with pytest.raises(ConfigError, match=r"max_turn_silence_ms \(150\) must be at least"):
        config_from_mapping({"vad": {"end_of_turn_pause_ms": 180, "max_turn_silence_ms": 150}})
    with pytest.raises(ConfigError, match=r"\[vad\] end_of_turn_threshold"):
        config_from_mapping({"vad": {"end_of_turn_threshold": 1.5}})
    vad = config_from_mapping({"vad": {"end_of_turn": "model"}}).vad
    assert (vad.end_of_turn, vad.end_of_turn_threshold) == ("model", 0.5)


def test_event_loop_is_one_of_the_known() -> None:
    assert EVENT_LOOPS == ("auto", "uvloop", "asyncio")
    with pytest.raises(ConfigError, match=r"\[server\] event_loop must be one of auto"):
        config_from_mapping({"server": {"event_loop": "trio"}})


def test_workers_need_plain_ws() -> None:
    with pytest.raises(ConfigError, match="between 1 and 64"):
        config_from_mapping({"server": {"workers": 0}})
    with pytest.raises(ConfigError, match="terminate TLS in front"):
        config_from_mapping({"server": {"workers": 2, "tls_cert": "cert.pem"}})
    assert config_from_mapping({"server": {"workers": 4}}).server.workers == 4


def test_a_final_tail_under_one_vad_frame_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"\[vad\] final_tail_ms"):
        config_from_mapping({"vad": {"final_tail_ms": 20}})
    assert config_from_mapping({"vad": {"final_tail_ms": 30}}).vad.final_tail_ms == 30


# -- ranges -----------------------------------------------------------------------------------

_SECTIONS = {
    "server": ServerConfig,
    "vad": VadConfig,
    "stream": StreamConfig,
    "scheduler": SchedulerConfig,
    "engine": EngineConfig,
    "auth": AuthConfig,
    "journal": JournalConfig,
}


def test_every_numeric_key_has_a_range() -> None:
    assert set(_SECTIONS) == {f.name for f in dataclasses.fields(Config)} - {"sources"}
    for cls in _SECTIONS.values():
        numeric = {
            f.name
            for f in dataclasses.fields(cls)
            if f.type in ("int", "float")  # annotations are strings (from __future__)
        }
        assert set(RANGES[cls]) == numeric, cls.__name__


def _outside(allowed: Range) -> float:
    if allowed.low != -math.inf:
        return allowed.low if allowed.low_open else allowed.low - 1
    return allowed.high + 1


_EVERY_RANGE = [
    (name, key, allowed) for name, cls in _SECTIONS.items() for key, allowed in RANGES[cls].items()
]


@pytest.mark.parametrize(
    ("name", "key", "allowed"), _EVERY_RANGE, ids=[f"{n}.{k}" for n, k, _ in _EVERY_RANGE]
)
def test_every_range_is_checked(name: str, key: str, allowed: Range) -> None:
    default = getattr(_SECTIONS[name](), key)
    bad: list[float] = [_outside(allowed)]
    if isinstance(default, float):
        bad.append(math.nan)
    for value in bad:
        with pytest.raises(ConfigError, match=rf"^\[{name}\] {key} must be .*, got "):
            config_from_mapping({name: {key: type(default)(value)}})


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[vad]\naggressiveness = 7", "[vad] aggressiveness must be between 0 and 3"),
        ("[stream]\npartial_interval_ms = 0", "partial_interval_ms must be 30 or more"),
        ("[vad]\nstart_voiced_ratio = 1.5", "greater than 0 and at most 1, got 1.5"),
        ("[stream]\nmax_utterance_s = -1", "max_utterance_s must be between 1 and 30 s"),
        ("[server]\nmax_sessions = 0", "[server] max_sessions must be 1 or more, got 0"),
        ("[server]\nidle_timeout_s = nan", "idle_timeout_s must be greater than 0, got nan"),
        ("[server]\ndrain_timeout_s = nan", "drain_timeout_s must be greater than 0"),
        ("[server]\nport = 70000", "[server] port must be between 0 and 65535"),
        ("[server]\nport = -1", "[server] port must be between 0 and 65535"),
        ("[stream]\nmax_utterance_s = 2.0", "cut_search_s (3 s) must be less than max_utt"),
        ("[[sources]]\ndevice = -1", "[[sources]] mic: backlog_finals, channel and a device"),
        ('[[sources]]\ndevice = ""', '[[sources]] mic: device is empty: write "default"'),
        ('[[sources]]\ndevice = "  "', "[[sources]] mic: device is empty"),
    ],
)
def test_values_that_broke_or_silenced_streams_are_refused(
    tmp_path: Path, text: str, message: str
) -> None:
    with pytest.raises(ConfigError) as refused:
        load_config(_write(tmp_path, text + "\n"))
    assert message in str(refused.value)


def test_range_bounds_themselves_are_allowed() -> None:
    config = config_from_mapping(
        {
            "server": {"port": 65535, "max_sessions": 1},
            "vad": {"aggressiveness": 0, "start_voiced_ratio": 1.0},
            "stream": {"partial_interval_ms": 30, "max_utterance_s": 30.0, "cut_search_s": 0.0},
        }
    )
    assert (config.server.port, config.vad.aggressiveness) == (65535, 0)
    assert config_from_mapping({"server": {"port": 0}}).server.port == 0
