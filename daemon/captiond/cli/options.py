"""What `serve` and `transcribe` share: the engine options, the configuration built from the
command line (file, then `--set`, then flags), and loading a warm engine. Main thread.
"""

from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path

from captiond.config import (
    Config,
    load_config,
    override,
)
from captiond.engines import ENGINE_NAMES, load_engine
from captiond.engines.base import Engine, EngineInfo
from captiond.errors import (
    ConfigError,
    SessionError,
)
from captiond.lang.languages import AUTO_LANGUAGE, parse_language
from captiond.ops.logs import LOG_LEVELS

log = logging.getLogger("captiond")


def engine_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", type=Path, help="TOML configuration file")
    parser.add_argument(
        "--model",
        help="model name (base, small, large-v3, … see `captiond models`), Hugging Face repo id"
        " or CTranslate2 Whisper folder (default: bundled tiny.en)",
    )
    parser.add_argument(
        "--download",
        action="store_true",
        default=None,
        help="download the model from the Hugging Face Hub if it is not cached",
    )
    parser.add_argument("--engine", choices=ENGINE_NAMES, help="inference engine (default auto)")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), help="default auto")
    parser.add_argument("--compute-type", help="int8, float16, float32, … (default auto)")
    parser.add_argument(
        "--beam",
        type=int,
        help="beam size of every final decode (default: [stream] final_beam_size 5, "
        "context_beam_size 3 with context); 1: greedy finals, which torch_graph replays from "
        "its CUDA graphs",
    )
    parser.add_argument(
        "--language",
        help="spoken language (en, de, zh-TW, …) or auto: detected per utterance"
        " (multilingual models), or a list (en,de): detected among those;"
        " default [stream] language, en",
    )
    parser.add_argument(
        "--prompt",
        help="names and terms the audio may contain, for streams that give none"
        ' ("Philip Steels, Grafana"); default [stream] prompt',
    )
    parser.add_argument(
        "--log-level", default="info", type=str.lower, choices=LOG_LEVELS, help="default info"
    )


def config_from(args: argparse.Namespace) -> Config:
    # A tag naming a Chinese variant (zh-TW) sets both, as `?language=zh-TW` does.
    language = None if args.language is None else parse_language(args.language)
    config = override(
        load_config(args.config),
        "stream",
        language=None if language is None else language.setting,
        chinese_variant=None if language is None else language.chinese_variant,
        prompt=args.prompt,
        final_beam_size=args.beam,
        context_beam_size=args.beam,
    )
    return override(
        config,
        "engine",
        name=args.engine,
        model=args.model,
        allow_download=args.download,
        device=args.device,
        compute_type=args.compute_type,
    )


def load_warm_engine(config: Config, task: str = "transcribe") -> Engine:
    started = time.monotonic()
    engine = load_engine(config.engine)
    # Before the warm-up: a language or task the model cannot do is refused without waiting.
    info = EngineInfo.of(engine)
    english_only = info.english_only
    language = parse_language(config.stream.language)
    try:
        info.check_can(language.code, task, language.candidates)
    except SessionError as exc:
        engine.close()
        raise ConfigError(f"--language / --task: {exc}") from None
    if language.code == AUTO_LANGUAGE and english_only:
        log.warning("the model %s is English-only: language auto is English", english_only)
    engine.warmup()
    log.info(
        "engine %s (model %s) loaded and warmed up in %.1f s",
        engine.name,
        engine.model_name,
        time.monotonic() - started,
    )
    return engine
