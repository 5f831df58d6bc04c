"""How the session's language rule treats runs of utterances, replayed from Whisper's detections.

    python3 bench/language_switch_replay.py ../shared/speech ../shared/speech-multi --out FILE

With `?language=auto` an utterance of `language_detect_s` (3 s) or more is detected on its
first 3 s, from where the VAD starts it, and `engines.rules.choose_language` keeps the session's
language or switches. Here every such utterance of the corpora is detected once, as the
session would (faster-whisper base, int8 on the CPU), and runs of them are replayed through
the rule:

- *same language*: each source's utterances in one language, in manifest order, as one
  session already in that language (the English corpus by source and speaker, the
  multilingual one by language): every utterance captioned in another language is wrong;
- *a switch*: each utterance after a session in each other language of the corpora, and the
  next utterance of its own run after it: does the first switch, or the second?

The rule before this version (`p(other) >= 0.7`, no evidence carried) is replayed beside it.
The JSON holds the figures and every wrong utterance; detections are kept only in memory.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from faster_whisper import WhisperModel

from captiond.bench.common import read_manifest
from captiond.config import Config
from captiond.engines.models import resolve_model
from captiond.engines.rules import choose_language
from captiond.sources.audiofile import read_audio_16k_mono
from captiond.streaming.vad import utterance_spans, webrtc_vad
from captiond.whisper import SAMPLE_RATE_HZ

Probabilities = dict[str, float]
Rule = Callable[[list[Probabilities], str], list[str]]


def current_rule(run: list[Probabilities], language: str) -> list[str]:
    """The session's languages through `run`, starting in `language` (choose_language)."""
    chosen: list[str] = []
    evidence: tuple[str | None, float] = (None, 0.0)
    for probabilities in run:
        choice = choose_language(probabilities, language, *evidence)
        language = choice.language
        evidence = (choice.switch_language, choice.switch_nats)
        chosen.append(language)
    return chosen


def previous_rule(run: list[Probabilities], language: str) -> list[str]:
    """The rule before: another language at p >= 0.7 switches, nothing is carried over."""
    chosen: list[str] = []
    for probabilities in run:
        detected = max(probabilities, key=probabilities.__getitem__)
        if probabilities[detected] >= 0.7:
            language = detected
        chosen.append(language)
    return chosen


RULES: dict[str, Rule] = {"current": current_rule, "previous": previous_rule}


def run_key(entry: dict[str, Any]) -> str:
    """The run an utterance belongs to: its language, source and (speechocean762) speaker."""
    source = entry["id"].split("_")[0]
    if source == "speechocean762":
        source += "_" + entry["id"].rsplit("_", 1)[1][:5]
    return f"{entry.get('language', 'en')}/{source}"


def detections(model: WhisperModel, corpora: Iterable[Path]) -> dict[str, list[Probabilities]]:
    """Each run's utterances of 3 s or more, as Whisper's language probabilities on the first
    3 s from the utterance's start."""
    config = Config()
    window = round(config.stream.language_detect_s * SAMPLE_RATE_HZ)
    runs: dict[str, list[Probabilities]] = defaultdict(list)
    for corpus in corpora:
        for entry in read_manifest(corpus / "manifest.jsonl"):
            if entry["kind"] != "utterance":
                continue
            samples = read_audio_16k_mono(corpus / entry["file"])
            # A VAD of its own, as each stream has: webrtcvad adapts to what it has heard.
            vad = webrtc_vad(config.vad.aggressiveness)
            for start, end in utterance_spans(samples, vad, config.vad, config.stream):
                if end - start >= window:
                    *_, pairs = model.detect_language(samples[start : start + window])
                    runs[run_key(entry)].append(dict(pairs))
    return runs


def replay(runs: dict[str, list[Probabilities]], rule: Rule) -> dict[str, Any]:
    wrong = []
    for key, run in runs.items():
        language = key.split("/")[0]
        for i, chosen in enumerate(rule(run, language)):
            if chosen != language:
                wrong.append({"run": key, "utterance": i, "captioned_in": chosen})
    languages = sorted({key.split("/")[0] for key in runs})
    # Per language switched to: [pairs, switched at the first utterance, by the second].
    switches = {language: [0, 0, 0] for language in languages}
    for key, run in runs.items():
        language = key.split("/")[0]
        for i, probabilities in enumerate(run):
            following = run[i + 1 : i + 2]
            for before in languages:
                if before == language:
                    continue
                languages_chosen = rule([probabilities, *following], before)
                counts = switches[language]
                counts[0] += 1
                counts[1] += languages_chosen[0] == language
                counts[2] += languages_chosen[-1] == language
    pairs, first, second = (sum(column) for column in zip(*switches.values(), strict=True))
    return {
        "same_language": {
            "runs": len(runs),
            "utterances": sum(len(run) for run in runs.values()),
            "wrong_language": len(wrong),
            "wrong": wrong,
        },
        "switch": {
            "pairs": pairs,
            "at_the_first_utterance": first,
            "by_the_second": second,
            "per_language": {
                language: dict(
                    zip(("pairs", "at_the_first_utterance", "by_the_second"), c, strict=True)
                )
                for language, c in switches.items()
            },
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("corpora", nargs="+", type=Path, help="folders with a manifest.jsonl")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    model = WhisperModel(str(resolve_model("base")), device="cpu", compute_type="int8")
    runs = detections(model, args.corpora)
    figures = {name: replay(runs, rule) for name, rule in RULES.items()}
    args.out.write_text(json.dumps(figures, indent=1) + "\n")
    for name, result in figures.items():
        same, switch = result["same_language"], result["switch"]
        print(
            f"{name}: {same['wrong_language']} of {same['utterances']} utterances in a wrong"
            f" language; switches {switch['at_the_first_utterance']} at the first utterance,"
            f" {switch['by_the_second']} by the second, of {switch['pairs']}"
        )


if __name__ == "__main__":
    main()
