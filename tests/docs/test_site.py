"""The docs site builds with `mkdocs build --strict` (broken links and anchors fail it), and the
README stays a five-minute read whose links lead somewhere."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

from testkit import REPO_ROOT, missing_tool

README = REPO_ROOT / "README.md"
README_MAX_LINES = 250


def test_the_site_builds_strict(tmp_path: Path) -> None:
    if importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("material") is None:
        missing_tool("mkdocs-material is not installed (python3 -m pip install mkdocs-material)")
    built = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert built.returncode == 0, built.stderr[-4_000:]
    assert (tmp_path / "index.html").is_file()
    assert (tmp_path / "reference" / "protocol-v1" / "index.html").is_file()


def test_the_readme_is_short() -> None:
    lines = README.read_text(encoding="utf-8").count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines (at most {README_MAX_LINES})"


def test_the_readmes_relative_links_exist() -> None:
    text = README.read_text(encoding="utf-8")
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    missing = [t for t in targets if "://" not in t and not (REPO_ROOT / t).exists()]
    assert not missing, missing
