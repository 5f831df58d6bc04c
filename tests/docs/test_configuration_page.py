"""docs/reference/configuration.md against captiond.config: every `[section] key` of the
`Config` dataclasses is documented, nothing documented is gone, and each default on the page
is the code's."""

from __future__ import annotations

import dataclasses
import re
import tomllib
import typing
from typing import Any

from testkit import REPO_ROOT

from captiond.config import Config

PAGE = REPO_ROOT / "docs" / "reference" / "configuration.md"
HEADING = re.compile(r"^## `(\[\[?[a-z_.]+\]\]?)`\s*$")
ROW = re.compile(r"^\| `([a-z_]+)` \| [^|]* \| ([^|]*) \|")


def code_keys(cls: type[Any] = Config, name: str = "") -> dict[str, dict[str, Any]]:
    """Every TOML table the config reads, by its header, with its keys' defaults. A field whose
    type is a dataclass is a `[section]`, one that is a tuple of dataclasses an array of tables
    `[[name]]`; recursively, so a dataclass inside a section would be `[section.sub]`."""
    hints = typing.get_type_hints(cls)
    defaults = cls()
    own: dict[str, Any] = {}
    tables: dict[str, dict[str, Any]] = {}
    for field in dataclasses.fields(cls):
        kind = hints[field.name]
        args = typing.get_args(kind)
        path = f"{name}.{field.name}" if name else field.name
        if dataclasses.is_dataclass(kind):
            tables.update(_headed(code_keys(kind, path), f"[{path}]"))
        elif typing.get_origin(kind) is tuple and args and dataclasses.is_dataclass(args[0]):
            tables.update(_headed(code_keys(args[0], path), f"[[{path}]]"))
        else:
            own[field.name] = getattr(defaults, field.name)
    return {"": own, **tables} if own else tables


def _headed(tables: dict[str, dict[str, Any]], header: str) -> dict[str, dict[str, Any]]:
    """A table's own keys (under "") named by `header`, its nested tables as they are."""
    return {header if key == "" else key: keys for key, keys in tables.items()}


def page_keys() -> dict[str, dict[str, str]]:
    """Each `## `[section]`` heading of the page with its table's keys and default cells."""
    tables: dict[str, dict[str, str]] = {}
    current: dict[str, str] | None = None
    for line in PAGE.read_text(encoding="utf-8").splitlines():
        if heading := HEADING.match(line):
            current = tables.setdefault(heading[1], {})
        elif line.startswith("## "):
            current = None
        elif current is not None and (row := ROW.match(line)):
            current[row[1]] = row[2].strip()
    return tables


def page_value(cell: str) -> Any:
    """A default cell as a value: `absent` is None, otherwise the TOML between backticks."""
    if cell == "absent":
        return None
    assert cell.startswith("`") and cell.endswith("`"), f"a default is `toml` or absent: {cell}"
    return tomllib.loads(f"v = {cell[1:-1]}")["v"]


def same(documented: Any, default: Any) -> bool:
    if isinstance(default, tuple):
        default = list(default)
    if isinstance(default, bool) or isinstance(documented, bool):
        return type(default) is type(documented) and default == documented
    return bool(documented == default)


def test_every_configuration_key_is_on_the_page() -> None:
    documented = page_keys()
    missing = [
        f"{header} {key}"
        for header, keys in code_keys().items()
        for key in keys
        if key not in documented.get(header, {})
    ]
    assert not missing, f"add to {PAGE.relative_to(REPO_ROOT)}: {', '.join(missing)}"


def test_the_page_documents_no_key_that_is_gone() -> None:
    code = code_keys()
    gone = [
        f"{header} {key}"
        for header, keys in page_keys().items()
        for key in keys
        if key not in code.get(header, {})
    ]
    assert not gone, f"no longer in captiond.config: {', '.join(gone)}"


def test_every_default_on_the_page_is_the_codes() -> None:
    documented = page_keys()
    wrong = [
        f"{header} {key}: page {documented[header][key]}, code {default!r}"
        for header, keys in code_keys().items()
        for key, default in keys.items()
        if key in documented.get(header, {})
        and not same(page_value(documented[header][key]), default)
    ]
    assert not wrong, "; ".join(wrong)


def test_the_walk_sees_every_section() -> None:
    """The walk itself: the sections config.py reads from TOML, sources as an array of tables."""
    assert set(code_keys()) == {
        "[server]",
        "[vad]",
        "[stream]",
        "[scheduler]",
        "[engine]",
        "[auth]",
        "[journal]",
        "[[sources]]",
    }
