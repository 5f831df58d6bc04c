"""The administrative commands: `captiond models`, `devices`, `install-service` and
`journal show|list`. Main thread; each runs to completion and returns an exit code.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

from captiond.config import (
    load_config,
)
from captiond.errors import (
    ConfigError,
)


def add_service_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("devices", help="list the audio input devices a source can use")
    p.set_defaults(func=_devices)
    p = sub.add_parser("models", help="list model names and which are available offline")
    p.set_defaults(func=_models)
    p = sub.add_parser("install-service", help="write the systemd unit and an example config")
    kind = p.add_mutually_exclusive_group()
    kind.add_argument("--user", action="store_true", help="a user unit (desktop session mic)")
    kind.add_argument("--template", action="store_true", help="captiond@GPU.service, one per GPU")
    p.add_argument(
        "--gpus",
        type=_gpu_count,
        help="with --template: write /etc/captiond/0.toml … N-1.toml, one instance per GPU "
        "behind HAProxy (default 1)",
    )
    p.add_argument("--exec", dest="exec_path", help="path of captiond (default: this one)")
    p.add_argument("--print", action="store_true", help="print the unit and config, write nothing")
    p.set_defaults(func=_install_service)


def _models(args: argparse.Namespace) -> int:
    from captiond.engines.models import MODEL_REPOS, list_models

    width = max(len(name) for name in MODEL_REPOS)
    for entry in list_models():
        # A repo id found in the cache is its own name: one column for both.
        label = (
            f"{entry.name:<{width}}  {entry.repo_id:<44}"
            if entry.name in MODEL_REPOS
            else f"{entry.name:<{width + 46}}"
        )
        if entry.where and entry.note:
            print(f"{label}  {entry.where} ({entry.note})")
        else:
            print(f"{label}  {entry.where or entry.note}")
    print("\n--model also takes any Hugging Face repo id (owner/name) or a model folder.")
    return 0


def _devices(args: argparse.Namespace) -> int:
    from captiond.sources.mic import DeviceError, input_devices

    try:
        devices = input_devices()
    except DeviceError as exc:
        raise ConfigError(str(exc)) from exc
    if not devices:
        print("no audio input devices (is PulseAudio or PipeWire running for this user?)")
        return 0
    print(f"{'index':>5}  {'channels':>8}  {'rate_hz':>7}  name")
    for d in devices:
        print(f"{d.index:>5}  {d.channels:>8}  {d.default_rate_hz:>7}  {d.name}")
    return 0


def _gpu_count(text: str) -> int:
    if not text.isdigit() or not 1 <= int(text) <= 64:
        raise argparse.ArgumentTypeError(f"{text!r} is no GPU count (1 to 64)")
    return int(text)


def _install_service(args: argparse.Namespace) -> int:
    from captiond.ops.systemd import DEFAULT_EXEC, haproxy_servers, plan_install, write_install

    kind = "user" if args.user else "template" if args.template else "system"
    if args.gpus is not None and kind != "template":
        raise ConfigError("--gpus goes with --template (one instance per GPU)")
    gpus = args.gpus or 1
    exec_path = args.exec_path or shutil.which("captiond") or DEFAULT_EXEC
    resolved = Path(exec_path).resolve()
    install = plan_install(kind, str(resolved), gpus=gpus)
    hidden = [d for d in ("/home", "/root") if resolved.is_relative_to(d)]
    if kind != "user" and hidden:
        # ProtectHome=yes hides these from the service: it would fail to start.
        print(
            f"warning: {resolved} is under {hidden[0]}, which the system unit cannot see"
            " (ProtectHome=yes): install captiond outside it (a virtual environment in /opt,"
            " say) and pass its path with --exec",
            file=sys.stderr,
        )
    # The balancer in front of a template's instances: its SERVERS block for them.
    servers = (
        f"\n# haproxy.cfg's SERVERS block (deploy/haproxy/haproxy.cfg) for these instances:\n"
        f"{haproxy_servers(gpus)}"
        if kind == "template"
        else ""
    )
    if args.print:
        print(f"# {install.unit_path}\n{install.unit_text}")
        for path, text in install.configs:
            print(f"# {path}\n{text}")
        print(servers, end="")
        return 0
    try:
        print("\n".join(write_install(install)))
    except OSError as exc:
        raise ConfigError(f"cannot write {exc.filename}: {exc.strerror} (root needed?)") from exc
    scope = "--user " if kind == "user" else ""
    units = " ".join(f"captiond@{n}" for n in range(gpus)) if kind == "template" else "captiond"
    print(f"then: systemctl {scope}daemon-reload && systemctl {scope}enable --now {units}")
    print(servers, end="")
    return 0


def add_journal(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("journal", help="read the transcript journal ([journal] dir)")
    actions = p.add_subparsers(dest="journal_command", required=True)
    show = actions.add_parser("show", help="list journaled sessions, or print one's transcript")
    show.add_argument("session", nargs="?", help="session id, unique id prefix, or a .jsonl file")
    show.add_argument("--config", type=Path, help="TOML configuration file (its [journal] dir)")
    show.add_argument("--dir", help="journal folder (default: [journal] dir of --config)")
    show.add_argument("--json", action="store_true", help="print the records as JSON lines")
    show.set_defaults(func=_journal_show)


def _clock(ms: int) -> str:
    s, ms = divmod(ms, 1000)
    h, s = divmod(s, 3600)
    return f"{h:02d}:{s // 60:02d}:{s % 60:02d}.{ms:03d}"


def _journal_show(args: argparse.Namespace) -> int:
    from captiond.journal.reader import find_session, read_session

    key: str | None = args.session
    if key is not None and (key.endswith(".jsonl") or "/" in key):
        session = read_session(Path(key))
    else:
        folder = args.dir or load_config(args.config).journal.dir
        if not folder:
            raise ConfigError("no journal folder: pass --dir, or --config with a [journal] dir")
        if key is None:
            return _journal_list(Path(folder), as_json=args.json)
        session = find_session(Path(folder), key)
    if args.json:
        for record in session.records:
            print(json.dumps(record, ensure_ascii=False, separators=(",", ":")))
    else:
        for final in session.finals:
            if final.text:
                print(f"[{_clock(final.start_ms)} → {_clock(final.end_ms)}] {final.text}")
    return 0


def _journal_list(folder: Path, *, as_json: bool) -> int:
    from captiond.journal.reader import list_sessions

    sessions = list_sessions(folder)
    if not sessions:
        print(f"no journaled sessions in {folder}", file=sys.stderr)
    elif not as_json:
        print(f"{'started':<24}  {'session':<12}  {'finals':>6}  {'audio':>12}  status")
    for s in sessions:
        if as_json:
            summary = {
                "session": s.session,
                "started": s.started,
                "files": [str(f) for f in s.files],
                "finals": len(s.finals),
                "ended": s.ended,
                "audio_ms": s.audio_ms,
                "close_code": s.close_code,
            }
            print(json.dumps(summary, ensure_ascii=False, separators=(",", ":")))
        else:
            audio = "-" if s.audio_ms is None else _clock(s.audio_ms)
            status = "ended" if s.ended else "open (crashed or live)"
            print(f"{s.started:<24}  {s.session:<12}  {len(s.finals):>6}  {audio:>12}  {status}")
    return 0
