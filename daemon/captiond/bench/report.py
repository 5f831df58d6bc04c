"""What every bench run writes: machine facts, versions, config, JSON, a terminal table, plots;
and the options every bench reads alike (comma lists of counts, `--set` overrides).

Main thread, except `ResourceMonitor` and `GpuMonitor`, which sample CPU and memory, and the
GPU's busy share (through pynvml, when it is installed), each on its own thread. matplotlib is
imported only when a plot is drawn (extra `bench`).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib
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

from captiond.bench.metrics import percentile
from captiond.config import Config, config_from_mapping
from captiond.errors import ConfigError

_VERSIONED = ("captiond", "faster-whisper", "ctranslate2", "numpy", "websockets", "torch")


def count_list(text: str) -> list[int]:
    """An argparse type: a comma list of counts, each ≥ 1 (stream counts, batch sizes)."""
    try:
        counts = [int(n) for n in text.split(",") if n.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma list of counts, got {text!r}") from None
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"counts must be >= 1, got {text!r}")
    return counts


def parse_settings(settings: Sequence[str], base: Config) -> Config:
    """`section.key=value` overrides (values in TOML syntax; bare words are strings)."""
    data: dict[str, dict[str, Any]] = {}
    for item in settings:
        key, sep, raw = item.partition("=")
        section, dot, name = key.partition(".")
        if not (sep and dot):
            raise ConfigError(f"--set expects section.key=value, got {item!r}")
        try:
            value = tomllib.loads(f"v = {raw}")["v"]
        except tomllib.TOMLDecodeError:
            value = raw
        data.setdefault(section, {})[name] = value
    return config_from_mapping(data, base=base)


# The vector extensions the CPU kernels of CTranslate2 and of oneDNN under it (its int8 and
# float32 GEMMs) dispatch on, and the variables that cap them. Decodes move with them: on one
# 2-core "AMD EPYC" VM with VNNI, capping oneDNN at AVX2 changed the int8 whole-file text of 35
# of the 78 multilingual clips (docs/measurements/languages-log.md). A figure records its CPU's.
_VECTOR_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "amx_int8")
_ISA_CAPS = ("CT2_FORCE_CPU_ISA", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA")


@functools.cache  # the fields read do not change while the process runs
def _cpuinfo() -> dict[str, str]:
    """The first processor's fields in /proc/cpuinfo; empty where there is none."""
    fields: dict[str, str] = {}
    try:
        text = Path("/proc/cpuinfo").read_text(encoding="utf-8")
    except OSError:
        return fields
    for line in text.split("\n\n", 1)[0].splitlines():
        key, sep, value = line.partition(":")
        if sep:
            fields.setdefault(key.strip(), value.strip())
    return fields


def cpu_model() -> str:
    return _cpuinfo().get("model name") or platform.processor() or platform.machine()


def cpu_vector_flags() -> list[str]:
    """Which of `_VECTOR_FLAGS` this CPU has, and any of `_ISA_CAPS` set (as NAME=VALUE)."""
    flags = set(_cpuinfo().get("flags", "").split())
    caps = [f"{name}={os.environ[name]}" for name in _ISA_CAPS if os.environ.get(name)]
    return [flag for flag in _VECTOR_FLAGS if flag in flags] + caps


def package_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def machine_facts() -> dict[str, Any]:
    import psutil

    cpu = _cpuinfo()
    return {
        "host": platform.node(),
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "cpu_model": cpu_model(),
        # A VM's model name can be as bare as "AMD EPYC"; family and model tell generations apart.
        "cpu_family_model": f"{cpu.get('cpu family', '?')}/{cpu.get('model', '?')}",
        "cpu_vector_flags": cpu_vector_flags(),
        "cpu_count": os.cpu_count(),
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "load_average_1_5_15": [round(x, 2) for x in os.getloadavg()],
        "versions": {name: package_version(name) for name in _VERSIONED},
    }


def config_dict(config: Config) -> dict[str, Any]:
    data = dataclasses.asdict(config)
    data["auth"] = {"token": "***" if config.auth.token else ""}
    return data


class ResourceMonitor:
    """System CPU % (all cores), and the CPU % (100 = one core) and peak RSS of two groups of
    processes: `pids` (the daemon: this process and its worker processes, or the peer server)
    and `client_pids` (the bench's client processes).

    A watched process counts with its children, except this process's own: those are the client
    processes and multiprocessing's helpers, and the daemon's workers are named in `pids`.
    """

    def __init__(
        self, pids: Sequence[int], client_pids: Sequence[int] = (), interval_s: float = 0.5
    ) -> None:
        import psutil

        self._psutil = psutil
        self._groups = {"daemon": list(pids), "client": list(client_pids)}
        self._interval_s = interval_s
        self._cpu: list[float] = []
        self._per_core: list[list[float]] = []
        self._peak_rss = dict.fromkeys(self._groups, 0)
        # CPU seconds each process had used at its last sample, and the sum of the increments.
        self._cpu_s: dict[int, float] = {}
        self._busy_s = dict.fromkeys(self._groups, 0.0)
        self._started_s = 0.0
        self._elapsed_s = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-monitor", daemon=True)

    def __enter__(self) -> ResourceMonitor:
        self._psutil.cpu_percent(percpu=True)
        self._sample_processes()
        self._started_s = time.monotonic()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._sample_processes()
        self._elapsed_s = time.monotonic() - self._started_s

    def _members(self, pids: Sequence[int]) -> list[Any]:
        seen: dict[int, Any] = {}
        for pid in pids:
            try:
                proc = self._psutil.Process(pid)
                children = [] if pid == os.getpid() else proc.children(recursive=True)
            except self._psutil.Error:
                continue
            for p in [proc, *children]:
                seen.setdefault(p.pid, p)
        return list(seen.values())

    def _sample_processes(self) -> None:
        for group, pids in self._groups.items():
            rss = 0
            for proc in self._members(pids):
                try:
                    times = proc.cpu_times()
                    rss += proc.memory_info().rss
                except self._psutil.Error:
                    continue
                used_s = times.user + times.system
                # A process first seen now counts from now: its past is not this level's.
                self._busy_s[group] += used_s - self._cpu_s.get(proc.pid, used_s)
                self._cpu_s[proc.pid] = used_s
            self._peak_rss[group] = max(self._peak_rss[group], rss)

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            cores = self._psutil.cpu_percent(percpu=True)
            self._per_core.append(cores)
            self._cpu.append(sum(cores) / len(cores))
            self._sample_processes()

    def _group_cpu(self, group: str) -> float | None:
        if not self._groups[group] or self._elapsed_s <= 0:
            return None
        return round(100 * self._busy_s[group] / self._elapsed_s, 1)

    def result(self) -> dict[str, Any]:
        cores = [sum(c) / len(c) for c in zip(*self._per_core, strict=True)] if self._cpu else []
        return {
            "cpu_percent_mean": round(sum(self._cpu) / len(self._cpu), 1) if self._cpu else None,
            "cpu_percent_per_core_mean": [round(c, 1) for c in cores],
            "daemon_cpu_percent_mean": self._group_cpu("daemon"),
            "client_cpu_percent_mean": self._group_cpu("client"),
            "peak_rss_mib": self._group_rss_mib("daemon"),
            "client_peak_rss_mib": self._group_rss_mib("client"),
        }

    def _group_rss_mib(self, group: str) -> float | None:
        return round(self._peak_rss[group] / 2**20, 1) if self._groups[group] else None


def _nvml() -> tuple[Any, str | None]:
    """pynvml (package nvidia-ml-py), initialised, or None and why not."""
    try:
        # Imported by name: it is only on GPU machines, and it has no type information.
        nvml = importlib.import_module("pynvml")
    except ImportError:
        return None, "nvidia-ml-py (pynvml) not installed"
    try:
        nvml.nvmlInit()
        if nvml.nvmlDeviceGetCount() < 1:
            nvml.nvmlShutdown()
            return None, "NVML found no GPU"
    except Exception as exc:  # pynvml raises NVMLError subclasses, made up per error code
        return None, f"NVML unavailable: {exc}"
    return nvml, None


def gpu_facts() -> tuple[str | None, str | None]:
    """GPU 0's name, or None and why there is none to report."""
    nvml, note = _nvml()
    if nvml is None:
        return None, note
    try:
        name = nvml.nvmlDeviceGetName(nvml.nvmlDeviceGetHandleByIndex(0))
    finally:
        nvml.nvmlShutdown()
    return name.decode() if isinstance(name, bytes) else str(name), None


class GpuMonitor:
    """GPU 0's busy share (NVML `utilization.gpu`: the time a kernel was running, in %) every
    100 ms on its own thread; no figures without pynvml or a GPU."""

    def __init__(self, interval_s: float = 0.1) -> None:
        self._interval_s = interval_s
        self._busy: list[float] = []
        self._nvml: Any = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-gpu-monitor", daemon=True)

    def __enter__(self) -> GpuMonitor:
        self._nvml, _ = _nvml()
        if self._nvml is not None:
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._nvml is not None:
            self._stop.set()
            self._thread.join()
            self._nvml.nvmlShutdown()

    def _run(self) -> None:
        try:
            handle = self._nvml.nvmlDeviceGetHandleByIndex(0)
            while not self._stop.wait(self._interval_s):
                self._busy.append(float(self._nvml.nvmlDeviceGetUtilizationRates(handle).gpu))
        except Exception:  # e.g. NVMLError_NotSupported (a MIG slice): no figures, no crash
            return

    def result(self) -> dict[str, float | None]:
        mean = sum(self._busy) / len(self._busy) if self._busy else None
        p95 = percentile(self._busy, 95)
        return {
            "gpu_busy_percent_mean": None if mean is None else round(mean, 1),
            "gpu_busy_percent_p95": None if p95 is None else round(p95, 1),
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
    """p95 partial lag and p95 final latency (seconds) against the peak of live streams: one
    point per level, `(peak_live_streams, lag_p95_ms, final_p95_ms)`, one line per system."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    for name, points in series.items():
        for ax, index in zip(axes, (1, 2), strict=True):
            xy = [(p[0], y / 1000) for p in points if (y := p[index]) is not None]
            ax.plot([x for x, _ in xy], [y for _, y in xy], marker="o", label=name)
    for ax, what in zip(axes, ("p95 partial lag", "p95 final latency"), strict=True):
        ax.set(title=what, xlabel="peak live real-time streams", ylabel="seconds")
        ax.grid(alpha=0.3)
        ax.legend()
    _save(plt, fig, path, title)
