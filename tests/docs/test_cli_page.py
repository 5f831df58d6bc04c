"""docs/reference/cli.md against the parsers: every command of `captiond` and
`captiond-client` has its section on the page, and every option and subcommand is in it."""

from __future__ import annotations

import argparse
import re
from collections.abc import Iterator

import pytest
from testkit import REPO_ROOT

from captiond.cli import build_parser as daemon_parser
from captiond_client.cli import build_parser as client_parser

PAGE = REPO_ROOT / "docs" / "reference" / "cli.md"
HEADING = re.compile(r"^#{2,3} `([a-z -]+)`\s*$", re.MULTILINE)


def commands(
    parser: argparse.ArgumentParser, path: str
) -> Iterator[tuple[str, argparse.ArgumentParser]]:
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from commands(sub, f"{path} {name}")


def every_command() -> list[tuple[str, argparse.ArgumentParser]]:
    return [*commands(daemon_parser(), "captiond"), *commands(client_parser(), "captiond-client")]


def sections() -> dict[str, str]:
    text = PAGE.read_text(encoding="utf-8")
    heads = list(HEADING.finditer(text))
    ends = [h.start() for h in heads[1:]] + [len(text)]
    return {h[1]: text[h.end() : end] for h, end in zip(heads, ends, strict=True)}


COMMANDS = every_command()


@pytest.mark.parametrize(("name", "parser"), COMMANDS, ids=[name for name, _ in COMMANDS])
def test_every_option_is_on_the_page(name: str, parser: argparse.ArgumentParser) -> None:
    section = sections().get(name)
    assert section is not None, f"{PAGE.name} has no section for `{name}`"
    missing = []
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        if isinstance(action, argparse._SubParsersAction):
            missing += [f"`{sub}`" for sub in action.choices if f"`{sub}`" not in section]
        elif action.option_strings:
            missing += [f"`{o}`" for o in action.option_strings if f"`{o}`" not in section]
        elif f"`{action.metavar or action.dest}`" not in section:
            missing.append(f"`{action.metavar or action.dest}`")
    assert not missing, f"`{name}` on {PAGE.name} lacks {', '.join(missing)}"


def test_the_page_has_no_command_that_is_gone() -> None:
    known = {name for name, _ in every_command()}
    assert set(sections()) <= known, set(sections()) - known
