"""The machine facts every bench JSON carries: enough to tell two CPUs apart whose int8 decodes
differ (a VM may name its CPU no more than "AMD EPYC")."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from captiond.bench.report import cpu_vector_flags, machine_facts


def test_machine_facts_name_the_cpus_generation_and_vector_flags() -> None:
    facts = machine_facts()
    family, model = facts["cpu_family_model"].split("/")
    flags = facts["cpu_vector_flags"]
    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.is_file():
        assert (family, model, flags) == ("?", "?", [])
        return
    text = cpuinfo.read_text(encoding="utf-8")

    def field(name: str) -> str:  # the first processor's, as the kernel writes it
        found = re.search(rf"^{name}\s*:\s*(.*)$", text, re.MULTILINE)
        return found.group(1).strip() if found else "?"

    assert (family, model) == (field("cpu family"), field("model"))
    assert set(flags) <= set(field("flags").split())


def test_an_isa_cap_in_the_environment_is_recorded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    monkeypatch.delenv("CT2_FORCE_CPU_ISA", raising=False)
    monkeypatch.delenv("DNNL_MAX_CPU_ISA", raising=False)
    assert cpu_vector_flags()[-1] == "ONEDNN_MAX_CPU_ISA=AVX2"
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA")
    assert not any("=" in flag for flag in cpu_vector_flags())
