"""What every bench run writes: machine facts, versions, config, JSON, a terminal table, plots.

Main thread, except `ResourceMonitor`, which samples CPU and memory on its own thread. matplotlib
is imported only when a plot is drawn (extra `bench`).
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import os
import platform
import sys
import threading
import time
import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from captiond.config import Config, config_from_mapping

_VERSIONED = ("captiond", "faster-whisper", "ctranslate2", "numpy", "websockets", "torch")


def parse_settings(settings: Sequence[str], base: Config) -> Config:
    """`section.key=value` overrides (values in TOML syntax; bare words are strings)."""
    data: dict[str, dict[str, Any]] = {}
    for item in settings:
        key, sep, raw = item.partition("=")
        section, dot, name = key.partition(".")
        if not (sep and dot):
            raise ValueError(f"--set expects section.key=value, got {item!r}")
        try:
            value = tomllib.loads(f"v = {raw}")["v"]
        except tomllib.TOMLDecodeError:
            value = raw
        data.setdefault(section, {})[name] = value
    return config_from_mapping(data, base=base)


def _cpu_model() -> str:
    with open("/proc/cpuinfo", encoding="utf-8") as fh:
        for line in fh:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor()


def _version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def machine_facts() -> dict[str, Any]:
    import psutil

    return {
        "host": platform.node(),
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "cpu_model": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "load_average_1_5_15": [round(x, 2) for x in os.getloadavg()],
        "versions": {name: _version(name) for name in _VERSIONED},
    }


def config_dict(config: Config) -> dict[str, Any]:
    data = dataclasses.asdict(config)
    data["auth"] = {"token": "***" if config.auth.token else ""}
    return data


class ResourceMonitor:
    """System CPU % (all cores), and peak RSS of the watched processes with their children."""

    def __init__(self, pids: Sequence[int], interval_s: float = 0.5) -> None:
        import psutil

        self._psutil = psutil
        self._procs = [psutil.Process(pid) for pid in pids]
        self._interval_s = interval_s
        self._cpu: list[float] = []
        self._per_core: list[list[float]] = []
        self._peak_rss = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-monitor", daemon=True)

    def __enter__(self) -> ResourceMonitor:
        self._psutil.cpu_percent(percpu=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _rss(self) -> int:
        total = 0
        for proc in self._procs:
            try:
                total += sum(p.memory_info().rss for p in [proc, *proc.children(recursive=True)])
            except self._psutil.Error:
                continue
        return total

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            cores = self._psutil.cpu_percent(percpu=True)
            self._per_core.append(cores)
            self._cpu.append(sum(cores) / len(cores))
            self._peak_rss = max(self._peak_rss, self._rss())

    def result(self) -> dict[str, Any]:
        cores = [sum(c) / len(c) for c in zip(*self._per_core, strict=True)] if self._cpu else []
        return {
            "cpu_percent_mean": round(sum(self._cpu) / len(self._cpu), 1) if self._cpu else None,
            "cpu_percent_per_core_mean": [round(c, 1) for c in cores],
            "peak_rss_mib": round(self._peak_rss / 2**20, 1),
        }


def write_json(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def print_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    cells = [[_cell(v) for v in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    print("  ".join(h.rjust(w) for h, w in zip(headers, widths, strict=True)))
    for row in cells:
        print("  ".join(v.rjust(w) for v, w in zip(row, widths, strict=True)))


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 10 else f"{value:.0f}"
    return str(value)


class Progress:
    """One stderr line, rewritten: `label i/n detail`."""

    def __init__(self, label: str, total: int) -> None:
        self._label, self._total, self._done = label, total, 0
        self._started = time.monotonic()

    def step(self, detail: str) -> None:
        self._done += 1
        elapsed = time.monotonic() - self._started
        end = "\n" if self._done == self._total else ""
        print(
            f"\r{self._label} {self._done}/{self._total} {detail[:50]:50s} {elapsed:5.0f} s",
            end=end,
            file=sys.stderr,
            flush=True,
        )


def _pyplot() -> Any:
    """matplotlib's pyplot on the file-only backend (no display here or under systemd)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(plt: Any, fig: Any, path: Path, title: str) -> None:
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_cdfs(path: Path, title: str, series: Mapping[str, Sequence[float]]) -> None:
    """One panel per figure name prefix (before ': '), one CDF line per series, in seconds."""
    plt = _pyplot()
    panels = sorted({name.split(": ", 1)[0] for name in series})
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4), squeeze=False)
    for ax, panel in zip(axes[0], panels, strict=True):
        for name, values in series.items():
            if name.startswith(panel + ": ") and values:
                xs = sorted(v / 1000 for v in values)
                ys = [(i + 1) / len(xs) for i in range(len(xs))]
                ax.step(xs, ys, where="post", label=name.split(": ", 1)[1])
        ax.set(title=panel, xlabel="seconds", ylabel="fraction ≤ x")
        ax.grid(alpha=0.3)
        ax.legend()
    _save(plt, fig, path, title)


def plot_capacity(
    path: Path, title: str, series: dict[str, list[tuple[int, float | None, float | None]]]
) -> None:
    """p95 partial lag and p95 final latency (seconds) against concurrent streams."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    for name, points in series.items():
        for ax, index in zip(axes, (1, 2), strict=True):
            xy = [(p[0], y / 1000) for p in points if (y := p[index]) is not None]
            ax.plot([x for x, _ in xy], [y for _, y in xy], marker="o", label=name)
    for ax, what in zip(axes, ("p95 partial lag", "p95 final latency"), strict=True):
        ax.set(title=what, xlabel="concurrent real-time streams", ylabel="seconds")
        ax.grid(alpha=0.3)
        ax.legend()
    _save(plt, fig, path, title)
