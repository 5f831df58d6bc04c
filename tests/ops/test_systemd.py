"""systemd: the shipped units are what install-service writes and pass `systemd-analyze verify`;
a real `captiond serve` talks sd_notify to a socket the test binds (READY after warm-up, STATUS,
WATCHDOG, STOPPING) and finalizes a live stream on SIGTERM before closing it with 1001."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from daemon_harness import NotifyListener
from testkit import REPO_ROOT, missing_tool, read_wav_int16
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from captiond.config import config_from_mapping
from captiond.ops.systemd import (
    DEFAULT_EXEC,
    UNIT_FILES,
    Notifier,
    haproxy_servers,
    plan_install,
    render_unit,
)

CAPTIOND = [sys.executable, "-m", "captiond.cli"]


def test_shipped_units_are_what_install_service_writes(tmp_path: Path) -> None:
    for kind, name in UNIT_FILES.items():
        assert (REPO_ROOT / "systemd" / name).read_text() == render_unit(kind), name
        flag = {"system": [], "user": ["--user"], "template": ["--template"]}[kind]
        printed = subprocess.run(
            [*CAPTIOND, "install-service", *flag, "--print", "--exec", DEFAULT_EXEC],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        assert render_unit(kind) in printed
        assert all(text in printed for _, text in plan_install(kind, DEFAULT_EXEC).configs)
    ((_, system_config),) = plan_install("system", DEFAULT_EXEC).configs
    assert (REPO_ROOT / "systemd" / "captiond.toml").read_text() == system_config

    env = {**os.environ, "XDG_CONFIG_HOME": str(tmp_path)}
    install = [*CAPTIOND, "install-service", "--user", "--exec", DEFAULT_EXEC]
    first = subprocess.run(install, env=env, capture_output=True, text=True, check=True)
    unit = tmp_path / "systemd" / "user" / "captiond.service"
    config = tmp_path / "captiond" / "captiond.toml"
    ((_, user_config),) = plan_install("user", DEFAULT_EXEC, env).configs
    assert unit.read_text() == render_unit("user") and config.read_text() == user_config
    assert "systemctl --user enable --now captiond" in first.stdout
    config.write_text("# mine\n")
    second = subprocess.run(install, env=env, capture_output=True, text=True, check=True)
    assert f"kept {config}" in second.stdout and config.read_text() == "# mine\n"


def test_a_system_unit_warns_of_a_captiond_it_cannot_see(tmp_path: Path) -> None:
    """ProtectHome=yes hides /home and /root from the system units: a captiond installed there
    (a user's virtual environment) would not start, and install-service says so."""
    venv = "/home/ana/venv/bin/captiond"
    for flag, warned in (([], True), (["--template"], True), (["--user"], False)):
        run = subprocess.run(
            [*CAPTIOND, "install-service", *flag, "--print", "--exec", venv],
            capture_output=True,
            text=True,
            check=True,
        )
        assert f"ExecStart={venv} serve" in run.stdout
        assert ("warning: /home/ana/venv/bin/captiond is under /home" in run.stderr) is warned


def test_system_units_keep_their_caches_in_their_cache_directory() -> None:
    # A dynamic user's home is /, read-only under ProtectSystem=strict: models joined from
    # packages and the Hugging Face cache go to CacheDirectory= instead; each instance of the
    # template has its own, so that two never join a model into one folder at once.
    for kind, directory in (("system", "captiond"), ("template", "captiond-gpu/%i")):
        unit = render_unit(kind)
        assert f"CacheDirectory={directory}\n" in unit
        assert f"Environment=XDG_CACHE_HOME=%C/{directory}\n" in unit


def test_the_templates_instances_share_one_user_and_one_journal_folder() -> None:
    # systemd shares a dynamic user between the units that name it, so every captiond@N runs
    # as captiond-gpu and can write the one journal folder where any of them takes back the
    # sessions of one that died; the single daemon keeps a user and folders of its own.
    template, system = render_unit("template"), render_unit("system")
    assert (
        "DynamicUser=yes\n" in template and "\nUser=captiond-gpu\nGroup=captiond-gpu\n" in template
    )
    assert "StateDirectory=captiond-gpu\n" in template
    assert "\nUser=" not in system and "StateDirectory=captiond\n" in system


def _printed_config(flag: list[str], env: dict[str, str] | None = None) -> str:
    printed = subprocess.run(
        [*CAPTIOND, "install-service", *flag, "--print", "--exec", DEFAULT_EXEC],
        capture_output=True,
        text=True,
        check=True,
        env=env,
    ).stdout
    return printed[printed.index("# captiond configuration") :]


def test_the_example_journal_is_in_a_folder_the_unit_can_write(tmp_path: Path) -> None:
    # ProtectSystem=strict leaves a system unit only its StateDirectory= to write (the
    # template's instances, the one they share, on in their configs); a user service, the
    # user's own state folder.
    assert "StateDirectory=captiond\n" in render_unit("system")
    assert '# dir = "/var/lib/captiond/journal"\n' in _printed_config([])
    assert "StateDirectory=captiond-gpu\n" in render_unit("template")
    ((_, gpu_config),) = plan_install("template", DEFAULT_EXEC).configs
    assert '\ndir = "/var/lib/captiond-gpu/journal"\n' in gpu_config
    env = {**os.environ, "HOME": str(tmp_path)}
    env.pop("XDG_STATE_HOME", None)
    assert f'# dir = "{tmp_path}/.local/state/captiond/journal"\n' in _printed_config(
        ["--user"], env
    )


def test_one_instance_per_gpu_gets_its_ports_the_shared_journal_and_its_haproxy_lines(
    tmp_path: Path,
) -> None:
    """`install-service --template --gpus 2` writes 0.toml and 1.toml, valid configs with the
    ports and agent ports the shipped haproxy.cfg lists for gpu0 and gpu1, the balancer's keys
    and the one journal folder, and prints that haproxy.cfg's SERVERS block."""
    install = plan_install("template", DEFAULT_EXEC, gpus=2)
    assert [path for path, _ in install.configs] == [
        Path("/etc/captiond/0.toml"),
        Path("/etc/captiond/1.toml"),
    ]
    for n, (_, text) in enumerate(install.configs):
        config = config_from_mapping(tomllib.loads(text))
        assert (config.server.port, config.server.agent_port) == (8766 + n, 9766 + n)
        assert config.server.max_lag_ms == 1000 and config.server.max_loop_busy == 0.8
        assert config.journal.dir == "/var/lib/captiond-gpu/journal"
    shipped = (REPO_ROOT / "deploy" / "haproxy" / "haproxy.cfg").read_text()
    block = shipped[shipped.index("    # BEGIN SERVERS") : shipped.index("# END SERVERS\n") + 14]
    assert haproxy_servers(2) == block
    printed = subprocess.run(
        [*CAPTIOND, "install-service", "--template", "--gpus", "2", "--print"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert block in printed and "# /etc/captiond/1.toml\n" in printed
    # --gpus belongs to the template; a count of 0 is refused.
    for flags in (["--gpus", "2"], ["--template", "--gpus", "0"]):
        run = subprocess.run(
            [*CAPTIOND, "install-service", *flags, "--print"], capture_output=True, text=True
        )
        assert run.returncode == 2 and "--gpus" in run.stderr, run.stderr


def test_a_configuration_mistake_is_not_restarted() -> None:
    # `captiond serve` exits 2 on a configuration mistake (test_cli), 1 on what may pass.
    for kind in UNIT_FILES:
        unit = render_unit(kind)
        assert "Restart=on-failure\n" in unit and "RestartPreventExitStatus=2\n" in unit, kind


def test_units_pass_systemd_analyze_verify(tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        missing_tool("systemd-analyze not installed (apt-get install systemd)")
    captiond = shutil.which("captiond") or str(Path(sys.executable).parent / "captiond")
    for kind, name in UNIT_FILES.items():
        # verify checks that ExecStart exists: use this environment's captiond.
        (tmp_path / name).write_text(render_unit(kind, captiond))
        verify = [analyze, "verify", f"./{name}"]
        run = subprocess.run(verify, cwd=tmp_path, capture_output=True, text=True)
        assert run.returncode == 0 and not run.stderr.strip(), run.stderr


def test_notifier_speaks_to_abstract_sockets_and_reads_the_watchdog() -> None:
    name = f"captiond-test-{os.getpid()}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as server:
        server.bind("\0" + name)
        env = {"NOTIFY_SOCKET": "@" + name, "WATCHDOG_USEC": "3000000"}
        notifier = Notifier(env)
        notifier.send("READY=1", "STATUS=ok")
        assert server.recv(4096) == b"READY=1\nSTATUS=ok"
        notifier.close()
    assert notifier.watchdog_s == 3.0
    assert Notifier({**env, "WATCHDOG_PID": "1"}).watchdog_s is None  # meant for another pid
    assert not Notifier({}).enabled


# -- a real daemon under a pretend service manager -------------------------------------------


@pytest.fixture
def notify(tmp_path: Path) -> Iterator[NotifyListener]:
    listener = NotifyListener(tmp_path / "notify.sock")
    yield listener
    listener.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@pytest.mark.model
def test_serve_notifies_and_finalizes_on_sigterm(
    notify: NotifyListener,
    tmp_path: Path,
    speech_dir: Path,
    speech_manifest: list[dict[str, Any]],
) -> None:
    clip = next(m for m in speech_manifest if m["id"] == "ljspeech_LJ001-0001")
    pcm = read_wav_int16(speech_dir / clip["file"])
    port = free_port()
    env = {
        **os.environ,
        "NOTIFY_SOCKET": str(tmp_path / "notify.sock"),
        "WATCHDOG_USEC": "2000000",
    }
    serve = [*CAPTIOND, "serve", "--port", str(port), "--engine", "faster-whisper"]
    log_path = tmp_path / "daemon.log"
    with log_path.open("w") as log:
        proc = subprocess.Popen([*serve, "--device", "cpu"], env=env, stderr=log)
        try:
            notify.wait_for("READY=1", 180, proc)
            messages = asyncio.run(stream_until_sigterm(port, pcm, proc, notify))
            assert proc.wait(timeout=60) == 0, log_path.read_text()
            notify.wait_for("STOPPING=1", 10, None)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()

    ready = notify.messages.index("READY=1")
    stopping = notify.messages.index("STOPPING=1")
    between = notify.messages[ready:stopping]
    assert between.count("WATCHDOG=1") >= 2, notify.messages
    assert "STATUS=1 streams open, 1 served" in between, notify.messages
    assert notify.messages[ready + 1].startswith("STATUS=0 streams open")

    kinds = [m["type"] for m in messages]
    assert kinds[0] == "ready"
    last_partial = max(i for i, k in enumerate(kinds) if k == "partial")
    finals = [m for m in messages[last_partial:] if m["type"] == "final"]
    assert finals and finals[-1]["segment"] == messages[last_partial]["segment"]
    assert finals[-1]["text"], messages
    assert kinds[-1] == "close 1001", kinds


async def stream_until_sigterm(
    port: int, pcm: np.ndarray, proc: subprocess.Popen[Any], notify: NotifyListener
) -> list[dict[str, Any]]:
    """Stream speech at real time right after READY; SIGTERM the daemon mid-utterance and keep
    sending audio until it closes the stream."""
    messages: list[dict[str, Any]] = []
    async with connect(f"ws://127.0.0.1:{port}/v1/stream") as conn:  # listening at READY=1

        async def send() -> None:
            for start in range(0, len(pcm), 1_600):
                await conn.send(pcm[start : start + 1_600].tobytes())
                await asyncio.sleep(0.1)

        sender = asyncio.create_task(send())
        signalled = False
        try:
            async with asyncio.timeout(120):
                while True:
                    message = json.loads(await conn.recv())
                    messages.append(message)
                    if (
                        not signalled
                        and message["type"] == "partial"
                        # Well into the 9.7-s utterance. (Not "3 stable words": whether a
                        # word is sure enough to be stable differs between CPUs.)
                        and message["end_ms"] >= 3_000
                        and notify.messages.count("WATCHDOG=1") >= 2
                        and "STATUS=1 streams open, 1 served" in notify.messages
                    ):
                        proc.send_signal(signal.SIGTERM)
                        signalled = True
        except ConnectionClosed:
            messages.append({"type": f"close {conn.close_code}"})
        finally:
            sender.cancel()
    assert signalled, messages
    return messages
