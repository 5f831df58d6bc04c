"""systemd integration: the sd_notify client (READY, STATUS, WATCHDOG, STOPPING) and the units.

`supervise` is one task on the event-loop thread of `captiond serve`; a datagram to
$NOTIFY_SOCKET never blocks. WATCHDOG=1 goes out at half the watchdog period, and only while the
engine thread's heartbeat (with workers, also the pool's check that replaces hung workers) is
fresh, so a hung engine gets the service restarted. The unit texts are rendered here and nowhere
else: the files in systemd/ are `captiond install-service --print`
output (a test holds them equal).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

log = logging.getLogger(__name__)

# With no watchdog, STATUS= is refreshed this often.
STATUS_EVERY_S = 5.0


class Notifier:
    """Sends sd_notify datagrams to $NOTIFY_SOCKET; does nothing when it is not set."""

    def __init__(self, env: Mapping[str, str] = os.environ) -> None:
        address = env.get("NOTIFY_SOCKET", "")
        if address.startswith("@"):  # abstract namespace
            address = "\0" + address[1:]
        self._address = address if address.startswith(("/", "\0")) else ""
        if address and not self._address:
            log.warning("NOTIFY_SOCKET %r is not a unix socket path: not notifying", address)
        self._socket: socket.socket | None = None
        watchdog_usec = env.get("WATCHDOG_USEC", "")
        watchdog_pid = env.get("WATCHDOG_PID", "")
        for_us = not watchdog_pid or watchdog_pid == str(os.getpid())
        self.watchdog_s = int(watchdog_usec) / 1e6 if watchdog_usec.isdigit() and for_us else None

    @property
    def enabled(self) -> bool:
        return bool(self._address)

    def send(self, *assignments: str) -> None:
        """One datagram of `KEY=VALUE` lines; a failure is logged, never raised."""
        if not self._address:
            return
        try:
            if self._socket is None:
                self._socket = socket.socket(
                    socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC
                )
            self._socket.sendto("\n".join(assignments).encode(), self._address)
        except OSError as exc:
            log.warning("sd_notify to %r failed: %s", self._address, exc)

    def close(self) -> None:
        if self._socket is not None:
            self._socket.close()
            self._socket = None


class Supervised(Protocol):
    """What `supervise` reports on: the daemon, or the main process of several workers."""

    def status_line(self) -> str: ...

    def healthy(self, within_s: float) -> bool:
        """The engine thread (and every worker) showed signs of life within `within_s`."""
        ...

    async def shutdown(self) -> None:
        """Stop accepting, send every open stream's last finals, close."""


async def supervise(daemon: Supervised, notifier: Notifier, stop: asyncio.Event) -> None:
    """READY=1 now (call it once the engine is warm and the socket listens), then STATUS= on
    change and WATCHDOG=1 while the daemon is healthy; STOPPING=1 when `stop` is set."""
    status = daemon.status_line()
    notifier.send("READY=1", f"STATUS={status}")
    watchdog_s = notifier.watchdog_s
    period_s = watchdog_s / 2 if watchdog_s else STATUS_EVERY_S
    while not stop.is_set():
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), period_s)
        if stop.is_set():
            break
        update = []
        if (new := daemon.status_line()) != status:
            status = new
            update.append(f"STATUS={status}")
        if watchdog_s:
            if daemon.healthy(watchdog_s):
                update.append("WATCHDOG=1")
            else:
                log.error("the engine or a worker is silent: withholding the watchdog ping")
        if update:
            notifier.send(*update)
    notifier.send("STOPPING=1", "STATUS=finalizing open sessions and shutting down")


# -- units -----------------------------------------------------------------------------------

DEFAULT_EXEC = "/usr/local/bin/captiond"
UNIT_FILES = {
    "system": "captiond.service",
    "user": "captiond-user.service",
    "template": "captiond@.service",
}


def _hardening(cache: str, state: str, user: str = "") -> str:
    """The system units' sandbox; `cache` and `state` name their cache and state folders, and
    `user` their dynamic user (empty: one of the unit's own name)."""
    return f"""\
DynamicUser=yes
{user}SupplementaryGroups=audio video render
NoNewPrivileges=yes
ProtectSystem=strict
ProtectHome=yes
PrivateTmp=yes
ProtectKernelTunables=yes
ProtectKernelModules=yes
ProtectKernelLogs=yes
ProtectControlGroups=yes
ProtectClock=yes
ProtectHostname=yes
RestrictNamespaces=yes
RestrictSUIDSGID=yes
LockPersonality=yes
RestrictAddressFamilies=AF_UNIX AF_INET AF_INET6 AF_NETLINK
SystemCallArchitectures=native
CacheDirectory={cache}
# Models joined from packages (--model base) or fetched with --download, and the Hugging Face
# cache, go there: a dynamic user's home is /, read-only here.
Environment=XDG_CACHE_HOME=%C/{cache}
# /var/lib/{state}: the transcript journal's home ([journal] dir), kept across restarts.
StateDirectory={state}
StateDirectoryMode=0700
# The GPU (and the sound card) stay visible: no PrivateDevices, an explicit device list.
DevicePolicy=closed
DeviceAllow=/dev/nvidiactl rw
DeviceAllow=/dev/nvidia-uvm rw
DeviceAllow=/dev/nvidia-uvm-tools rw
DeviceAllow=char-nvidia-frontend rw
DeviceAllow=char-nvidia-caps rw
DeviceAllow=char-alsa rw
"""


@dataclass(frozen=True, slots=True, kw_only=True)
class _UnitSpec:
    description: str
    config: str
    after: str
    environment: str
    hardening: str
    wanted_by: str
    # `serve` options after --config: the template's instance name (its session ids' prefix,
    # which a load balancer in front of the GPUs reads: deploy/haproxy).
    options: str = ""


_SPECS = {
    "system": _UnitSpec(
        description="captiond streaming speech transcription daemon",
        config="/etc/captiond/captiond.toml",
        after="network-online.target sound.target",
        environment="",
        hardening=_hardening("captiond", "captiond"),
        wanted_by="multi-user.target",
    ),
    "user": _UnitSpec(
        description="captiond streaming speech transcription daemon (this user's microphone)",
        config="%E/captiond/captiond.toml",
        after="pipewire-pulse.service pulseaudio.service",
        environment="",
        # A user manager cannot change groups or mount namespaces without privileges.
        hardening="NoNewPrivileges=yes\nLockPersonality=yes\n",
        wanted_by="default.target",
    ),
    "template": _UnitSpec(
        description="captiond streaming speech transcription daemon on GPU %i",
        config="/etc/captiond/%i.toml",
        after="network-online.target",
        environment="Environment=CUDA_VISIBLE_DEVICES=%i\n",
        hardening=_hardening(
            "captiond-gpu/%i",
            "captiond-gpu",
            "# One dynamic user for every instance (systemd shares it between the units that\n"
            "# name it), so that they share one journal folder, where each takes back the\n"
            "# sessions of one that died.\n"
            "User=captiond-gpu\nGroup=captiond-gpu\n",
        ),
        wanted_by="multi-user.target",
        options=" --instance gpu%i",
    ),
}


def render_unit(kind: str, exec_path: str = DEFAULT_EXEC) -> str:
    spec = _SPECS[kind]
    wants = "" if kind == "user" else "Wants=network-online.target\n"
    return f"""\
# Written by `captiond install-service`; edit the config file, not this unit.
[Unit]
Description={spec.description}
After={spec.after}
{wants}
[Service]
Type=notify
NotifyAccess=main
ExecStart={exec_path} serve --config {spec.config}{spec.options}
{spec.environment}Restart=on-failure
RestartSec=5
# Exit 2 is a configuration mistake, which no restart fixes; 1 (the port still held, say) may be
# gone by the next try.
RestartPreventExitStatus=2
# Loading and warming the model comes before READY=1.
TimeoutStartSec=300
TimeoutStopSec=30
WatchdogSec=30
{spec.hardening}
[Install]
WantedBy={spec.wanted_by}
"""


_EXAMPLE_CONFIG = """\
# captiond configuration; every key is optional (`captiond serve --print-config` shows them all).

[server]
# This machine only. To serve other machines, listen on all interfaces, set a token below
# (clients send `Authorization: Bearer …`, the page `/?token=…`), list the other sites whose
# pages may connect (the daemon's own page always may), and give browsers HTTPS (tls_cert,
# tls_key) for their microphones.
host = "127.0.0.1"
# host = "0.0.0.0"
port = 8765
# allowed_origins = ["https://intranet.example.com"]
# A client whose connection drops takes its session back within this many seconds; with the
# journal on, also across a restart of the daemon (`systemctl restart captiond`).
# resume_s = 60

# [auth]
# token = "a long random string"

# Every final written to disk (fsync'd) before it is sent; read with `captiond journal show`.
# It also lets clients resume their sessions across a daemon restart.
# [journal]
# dir = "{journal_dir}"

[engine]
# auto: the GPU engine when a GPU is visible, else faster-whisper on the CPU.
name = "auto"

# The microphone of this machine, captioned for every viewer of
# ws://HOST:8765/v1/captions?source=room (list devices with `captiond devices`).
# [[sources]]
# name = "room"
# device = "default"
"""


def example_config(journal_dir: str) -> str:
    """The example config, its journal in `journal_dir`: a folder the unit lets the daemon
    write (ProtectSystem=strict leaves it only its StateDirectory=)."""
    return _EXAMPLE_CONFIG.replace("{journal_dir}", journal_dir)


# The template's instances behind HAProxy on their host (deploy/haproxy/haproxy.cfg, whose
# front end is 8765): instance N listens on GPU_PORT_BASE + N, its agent on GPU_AGENT_BASE + N.
GPU_PORT_BASE = 8766
GPU_AGENT_BASE = 9766
# The template's StateDirectory=captiond-gpu: one journal folder for all its instances.
GPU_JOURNAL_DIR = "/var/lib/captiond-gpu/journal"


def gpu_instance_config(gpu: int) -> str:
    """/etc/captiond/N.toml for `captiond@N`: its ports among the host's instances, the keys an
    instance behind a balancer wants, and the journal folder they share."""
    port, agent_port = GPU_PORT_BASE + gpu, GPU_AGENT_BASE + gpu
    return f"""\
# captiond@{gpu}: instance gpu{gpu} on GPU {gpu}, behind HAProxy on this host, which lists it
# as gpu{gpu} on {port}, its agent on {agent_port} (deploy/haproxy/haproxy.cfg). Every key is
# optional: `captiond serve --print-config` shows them all.

[server]
host = "127.0.0.1"
port = {port}
# HAProxy's agent check: "drain" while this instance is behind or full.
agent_port = {agent_port}
# Refuse a new stream while this instance falls behind; the agent sends it elsewhere.
max_lag_ms = 1000
max_loop_busy = 0.8
# Every stream comes from HAProxy: its X-Forwarded-For names the client.
trusted_proxies = ["127.0.0.1"]

# One folder for every instance: any of them takes back the sessions of one that stopped or
# died, or hands one over that a client resumes elsewhere.
[journal]
dir = "{GPU_JOURNAL_DIR}"

[engine]
# auto: the GPU engine when a GPU is visible (this instance sees only GPU {gpu}), else
# faster-whisper on the CPU.
name = "auto"
"""


def haproxy_servers(gpus: int) -> str:
    """haproxy.cfg's SERVERS block for the template's instances 0 … gpus - 1."""
    names = [f"gpu{n}" for n in range(gpus)]
    routes = [
        f"    use-server {name} if {{ urlp(resume) -m beg {name}_ }} || "
        f"{{ var(txn.instance) -m str {name} }}\n"
        for name in names
    ]
    servers = [
        f"    server {name} 127.0.0.1:{GPU_PORT_BASE + n} agent-port {GPU_AGENT_BASE + n}\n"
        for n, name in enumerate(names)
    ]
    return "".join(["    # BEGIN SERVERS\n", *routes, *servers, "    # END SERVERS\n"])


@dataclass(frozen=True, slots=True, kw_only=True)
class Install:
    unit_path: Path
    unit_text: str
    configs: tuple[tuple[Path, str], ...]  # (path, text): written unless there already


def plan_install(
    kind: str, exec_path: str, env: Mapping[str, str] = os.environ, gpus: int = 1
) -> Install:
    """Where `install-service` writes the unit and its config (the template: one per GPU,
    `gpus` of them), and what."""
    unit_text = render_unit(kind, exec_path)
    if kind == "user":
        home = Path(env.get("HOME", "~"))
        config_home = Path(env.get("XDG_CONFIG_HOME") or home / ".config")
        state_home = Path(env.get("XDG_STATE_HOME") or home / ".local" / "state")
        return Install(
            unit_path=config_home / "systemd" / "user" / "captiond.service",
            unit_text=unit_text,
            configs=(
                (
                    config_home / "captiond" / "captiond.toml",
                    example_config(str(state_home / "captiond" / "journal")),
                ),
            ),
        )
    unit_path = Path("/etc/systemd/system") / UNIT_FILES[kind]
    if kind == "template":
        configs = tuple(
            (Path("/etc/captiond") / f"{n}.toml", gpu_instance_config(n)) for n in range(gpus)
        )
        return Install(unit_path=unit_path, unit_text=unit_text, configs=configs)
    config = example_config("/var/lib/captiond/journal")
    return Install(
        unit_path=unit_path,
        unit_text=unit_text,
        configs=((Path("/etc/captiond") / "captiond.toml", config),),
    )


def write_install(install: Install) -> list[str]:
    """Write the unit (replacing it) and the configs (never over an existing one)."""
    install.unit_path.parent.mkdir(parents=True, exist_ok=True)
    install.unit_path.write_text(install.unit_text, encoding="utf-8")
    done = [f"wrote {install.unit_path}"]
    for path, text in install.configs:
        if path.exists():
            done.append(f"kept {path}")
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text, encoding="utf-8")
            done.append(f"wrote {path}")
    return done
