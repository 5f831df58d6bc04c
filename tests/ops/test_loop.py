"""ops/loop.py: which event loop `[server] event_loop` gives a process."""

from __future__ import annotations

import asyncio
import sys

import pytest
import uvloop

from captiond.errors import ConfigError
from captiond.ops.loop import loop_factory, run


async def _loop_module() -> str:
    return type(asyncio.get_running_loop()).__module__


def test_auto_and_uvloop_run_on_uvloop() -> None:
    assert loop_factory("auto") is uvloop.new_event_loop
    assert run(_loop_module()).startswith("uvloop")
    assert run(_loop_module(), "uvloop").startswith("uvloop")


def test_asyncio_runs_on_asyncios_own_loop() -> None:
    assert loop_factory("asyncio") is None
    assert run(_loop_module(), "asyncio").startswith("asyncio")


def test_without_uvloop_auto_falls_back_and_uvloop_is_an_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "uvloop", None)  # import uvloop raises ImportError
    assert loop_factory("auto") is None
    assert run(_loop_module()).startswith("asyncio")
    with pytest.raises(ConfigError, match="pip install uvloop"):
        run(_loop_module(), "uvloop")
