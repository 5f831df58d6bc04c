"""The commands a user runs: `captiond serve`, `captiond transcribe`, `captiond-client stream`.

Real processes, the real model on real speech, a real port.
"""

from __future__ import annotations

import asyncio
import errno
import html
import io
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import wave
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import soxr
from daemon_harness import make_config, running_daemon, silent_wav, url
from encoded_audio import encode
from testkit import read_wav_int16

from captiond.cli import main as cli_main
from captiond.cli.serve import _binding
from captiond.config import ServerConfig
from captiond.errors import ConfigError
from captiond_client.cli import main as client_main
from captiond_client.display import CaptionPrinter, render_transcript, write_transcript
from captiond_client.stream import StreamError

CAPTIOND = [sys.executable, "-m", "captiond.cli"]
CLIENT = [sys.executable, "-m", "captiond_client.cli"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@pytest.fixture(scope="module")
def daemon_url() -> Iterator[str]:
    port = free_port()
    proc = subprocess.Popen(
        [*CAPTIOND, "serve", "--port", str(port), "--engine", "faster-whisper", "--device", "cpu"],
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stderr is not None
    deadline = time.monotonic() + 120
    log = []
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        log.append(line)
        if "ready: ws://" in line or proc.poll() is not None:
            break
    assert "ready: ws://" in log[-1], "".join(log)
    yield f"ws://127.0.0.1:{port}/v1/stream"
    proc.terminate()
    assert proc.wait(timeout=30) == 0


def clip(manifest: list[dict[str, Any]], clip_id: str) -> dict[str, Any]:
    return next(m for m in manifest if m["id"] == clip_id)


@pytest.mark.model
def test_client_streams_a_file_and_shows_growing_partials(
    daemon_url: str, speech_dir: Path, speech_manifest: list[dict[str, Any]], tmp_path: Path
) -> None:
    m = clip(speech_manifest, "ljspeech_LJ001-0001")
    out = tmp_path / "t.vtt"
    run = subprocess.run(
        [
            *CLIENT,
            "stream",
            str(speech_dir / m["file"]),
            "--url",
            daemon_url,
            "--speed",
            "2",
            "--json",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    messages = [json.loads(line) for line in run.stdout.splitlines()]
    kinds = [msg["type"] for msg in messages]
    assert kinds[0] == "ready" and kinds[-1] == "done"
    partials = [msg for msg in messages if msg["type"] == "partial"]
    assert len(partials) >= 3, kinds
    lengths = [len((p["stable"] + " " + p["unstable"]).split()) for p in partials]
    assert lengths[-1] > lengths[0], "partials did not grow"
    finals = [msg for msg in messages if msg["type"] == "final" and msg["text"]]
    assert "printing" in finals[0]["text"].lower()
    vtt = out.read_text()
    assert vtt.startswith("WEBVTT") and "-->" in vtt and "rinting" in vtt


@pytest.mark.model
def test_client_plain_output_and_resampling(
    daemon_url: str, speech_dir: Path, speech_manifest: list[dict[str, Any]], tmp_path: Path
) -> None:
    """A 44.1 kHz stereo file is converted by the client; finals print one per line."""
    m = clip(speech_manifest, "jfk_inaugural_1961")
    stereo = tmp_path / "stereo.wav"

    import numpy as np
    import soxr
    from testkit import read_wav_int16

    mono = read_wav_int16(speech_dir / m["file"]).astype(np.float32) / 32768
    up = soxr.resample(mono, 16000, 44100)
    with wave.open(str(stereo), "wb") as wf:
        wf.setnchannels(2)
        wf.setsampwidth(2)
        wf.setframerate(44100)
        wf.writeframes((np.repeat(up[:, None], 2, axis=1) * 32767).astype("<i2").tobytes())
    out = tmp_path / "t.txt"
    run = subprocess.run(
        [*CLIENT, "stream", str(stereo), "--url", daemon_url, "--speed", "0", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    lines = [line for line in run.stdout.splitlines() if line]
    assert lines and all(line.startswith("[00:") for line in lines)
    assert "country" in out.read_text().lower()


def test_a_vtt_cue_is_text_not_markup() -> None:
    """WebVTT reads "<b and c>" in a cue as a tag and drops it: the cue is escaped (SubRip and
    plain text keep the words as said)."""
    finals = [{"start_ms": 0, "end_ms": 3_723_004, "text": "if a <b and c> d, R&D"}]
    assert render_transcript(finals, ".vtt") == (
        "WEBVTT\n\n00:00:00.000 --> 01:02:03.004\nif a &lt;b and c&gt; d, R&amp;D\n"
    )
    assert render_transcript(finals, ".txt") == "if a <b and c> d, R&D\n"
    assert render_transcript(finals, ".srt").endswith("\nif a <b and c> d, R&D\n")


def test_a_json_transcript_has_the_text_and_segments_of_transcribe_json() -> None:
    finals = [
        {"type": "final", "segment": 0, "start_ms": 0, "end_ms": 900, "text": "Ask not."},
        {"type": "final", "segment": 1, "start_ms": 950, "end_ms": 2000, "text": "Ask what."},
    ]
    out = json.loads(render_transcript(finals, ".json"))
    assert out == {"text": "Ask not. Ask what.", "segments": finals}
    with pytest.raises(ValueError, match=r"no transcript format for '\.docx'"):
        render_transcript(finals, ".docx")


def test_client_refuses_an_out_file_it_could_not_write_before_streaming(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Checked first: otherwise the whole stream's finals would be lost at its end (and a
    .json used to be written as plain text)."""
    wav = silent_wav(tmp_path)
    nowhere = f"ws://127.0.0.1:{free_port()}/v1/stream"  # never reached
    for out, message in (
        (tmp_path / "talk.docx", "the file must end in one of .txt, .vtt, .srt, .json, .rttm"),
        (tmp_path / "nope" / "talk.vtt", f"there is no folder {tmp_path / 'nope'}"),
    ):
        with pytest.raises(SystemExit) as exit_:
            client_main(["stream", str(wav), "--url", nowhere, "--out", str(out)])
        assert exit_.value.code == 2
        assert f"argument --out: {out}: {message}\n" in capsys.readouterr().err


def test_client_says_in_one_line_that_a_url_is_no_daemons(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An http:// URL, or a server that answers HTTP but not as a websocket server: one line
    and exit 1, not a traceback (websockets' InvalidURI, InvalidUpgrade)."""
    wav = silent_wav(tmp_path)

    async def scenario() -> list[int]:
        async with running_daemon() as daemon:
            page = f"ws://127.0.0.1:{daemon.port}/"  # the page: 200, no upgrade
            return [
                await asyncio.to_thread(client_main, ["stream", str(wav), "--url", address])
                for address in (f"http://127.0.0.1:{daemon.port}/v1/stream", page)
            ]

    assert asyncio.run(scenario()) == [1, 1]
    lines = capsys.readouterr().err.splitlines()
    assert lines[0].startswith("captiond-client: not a websocket URL (ws:// or wss://): ")
    assert "did not answer as a captiond daemon" in lines[1], lines


def test_client_prints_the_daemons_error_once(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    wav = silent_wav(tmp_path)

    async def scenario() -> int:
        # The client's frames are over this limit: `too_large` after `ready`.
        async with running_daemon(make_config(server={"max_frame_bytes": 1_000})) as daemon:
            return await asyncio.to_thread(client_main, ["stream", str(wav), "--url", url(daemon)])

    assert asyncio.run(scenario()) == 1
    err = capsys.readouterr().err
    assert err.count("too_large") == 1 and err.startswith("captiond-client: "), err


@pytest.mark.parametrize(
    ("ending", "exit_code"), [(KeyboardInterrupt(), 130), (StreamError("the daemon left"), 1)]
)
def test_client_writes_the_finals_received_when_ctrl_c_or_an_error_ends_the_stream(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, ending: BaseException, exit_code: int
) -> None:
    """What was received is written; a stream that ended before any final leaves an earlier
    file as it was."""
    final = {"type": "final", "segment": 0, "start_ms": 0, "end_ms": 900, "text": "Ask not."}
    sent: list[dict[str, Any]] = []

    async def ended(*args: Any, on_message: Any, **kwargs: Any) -> None:
        for message in sent:
            on_message(message)
        raise ending

    monkeypatch.setattr("captiond_client.cli.stream_samples", ended)
    out = tmp_path / "talk.srt"
    out.write_text("earlier\n")
    argv = ["stream", str(silent_wav(tmp_path)), "--out", str(out)]
    assert client_main(argv) == exit_code
    assert out.read_text() == "earlier\n"
    sent.append(final)
    assert client_main(argv) == exit_code
    assert out.read_text() == "1\n00:00:00,000 --> 00:00:00,900\nAsk not.\n"


@pytest.mark.model
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_client_ctrl_c_keeps_the_finals_received(
    daemon_url: str,
    speech_dir: Path,
    speech_manifest: list[dict[str, Any]],
    tmp_path: Path,
    sig: signal.Signals,
) -> None:
    """A real Ctrl-C (SIGINT) or SIGTERM after the first final of a recording streamed in real
    time (221 s: the client is still streaming then). A test run started in the background
    (a script's `pytest &`, nohup) ignores SIGINT, and its children inherit that: the client
    handles both signals itself, as `mic` does, so they end it all the same."""
    m = clip(speech_manifest, "ljspeech_LJ001-0001_to_0032_concat")
    out = tmp_path / "t.vtt"
    command = [*CLIENT, "stream", str(speech_dir / m["file"]), "--url", daemon_url]
    proc = subprocess.Popen(
        [*command, "--out", str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None and proc.stderr is not None
        first = proc.stdout.readline()  # "[00:00:00.000] Printing, in the only sense, …"
        assert first.startswith("[00:"), proc.stderr.read()
        proc.send_signal(sig)
        assert proc.wait(timeout=60) == 130
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    vtt = out.read_text()
    assert vtt.startswith("WEBVTT") and first.split("] ", 1)[1].strip() in vtt
    assert "final(s) received to" in proc.stderr.read()


def test_client_reports_a_missing_daemon(tmp_path: Path) -> None:
    wav = silent_wav(tmp_path)
    run = subprocess.run(
        [*CLIENT, "stream", str(wav), "--url", f"ws://127.0.0.1:{free_port()}/v1/stream"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode != 0 and "captiond-client:" in run.stderr


@pytest.mark.model
def test_transcribe_json(
    speech_dir: Path, speech_manifest: list[dict[str, Any]], tmp_path: Path
) -> None:
    # As a user's recording comes: compressed (Opus), 48 kHz stereo.
    m = clip(speech_manifest, "jfk_inaugural_1961")
    jfk = read_wav_int16(speech_dir / m["file"]).astype(np.float32) / 32768
    ogg = encode(tmp_path / "jfk.ogg", soxr.resample(jfk, 16_000, 48_000), 48_000, "libopus", 2)
    run = subprocess.run(
        [*CAPTIOND, "transcribe", str(ogg), "--json", "--beam", "2"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    out = json.loads(run.stdout)
    # "ask not" is a short, quiet phrase of its own that the speech gate must let through.
    words = " ".join(re.sub(r"[^\w\s']", "", out["text"].lower()).split())
    assert "ask not what your country can do for you" in words
    assert "what you can do for your country" in words
    assert out["segments"] and {"start_ms", "end_ms", "text"} <= set(out["segments"][0])
    # Every segment's words: in order, inside it, joining to its text, with real confidences.
    for segment in out["segments"]:
        said = segment["words"]
        assert " ".join(w["word"] for w in said) == segment["text"]
        assert all(
            segment["start_ms"] <= w["start_ms"] <= w["end_ms"] <= segment["end_ms"] for w in said
        )
        assert all(0 < w["confidence"] <= 1 for w in said if w["confidence"] is not None)


def test_transcribe_refuses_what_the_bundled_model_cannot_do(
    speech_dir: Path, speech_manifest: list[dict[str, Any]]
) -> None:
    """tiny.en has no translate task and one language: it would return nothing, silently."""
    wav = speech_dir / clip(speech_manifest, "jfk_inaugural_1961")["file"]
    for option, words in (
        (["--task", "translate"], "task 'translate'"),
        (["--language", "yue"], "yue"),
    ):
        run = subprocess.run(
            [*CAPTIOND, "transcribe", str(wav), *option],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert run.returncode == 2 and words in run.stderr and "multilingual" in run.stderr, (
            run.stderr
        )


def test_print_config_and_config_errors(tmp_path: Path) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text("[server]\nport = 9999\n[stream]\npartial_interval_ms = 700\n")
    run = subprocess.run(
        [*CAPTIOND, "serve", "--config", str(cfg), "--host", "0.0.0.0", "--print-config"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert 'host = "0.0.0.0"' in run.stdout and "port = 9999" in run.stdout
    assert "partial_interval_ms = 700" in run.stdout
    cfg.write_text("[server]\nprot = 1\n")
    bad = subprocess.run(
        [*CAPTIOND, "serve", "--config", str(cfg)], capture_output=True, text=True, timeout=60
    )
    assert bad.returncode == 2 and "prot" in bad.stderr
    missing = subprocess.run(
        [*CAPTIOND, "transcribe", "x.wav", "--model", str(tmp_path / "nope")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert missing.returncode != 0


def test_the_prompt_option_sets_the_daemons_default_prompt() -> None:
    serve = [*CAPTIOND, "serve", "--print-config", "--prompt"]
    run = subprocess.run(
        [*serve, "Philip Steels, Grafana"], capture_output=True, text=True, timeout=60, check=True
    )
    assert 'prompt = "Philip Steels, Grafana"' in run.stdout
    too_long = subprocess.run([*serve, "x" * 1001], capture_output=True, text=True, timeout=60)
    assert too_long.returncode == 2 and "[stream] prompt is 1001 characters long" in too_long.stderr


def test_the_beam_option_sets_every_finals_beam() -> None:
    """`serve --beam 1`: greedy finals (torch_graph's most streams per GPU); 0 is refused."""
    serve = [*CAPTIOND, "serve", "--print-config", "--beam"]
    run = subprocess.run([*serve, "1"], capture_output=True, text=True, timeout=60, check=True)
    assert "final_beam_size = 1" in run.stdout and "context_beam_size = 1" in run.stdout
    zero = subprocess.run([*serve, "0"], capture_output=True, text=True, timeout=60)
    assert zero.returncode == 2 and "final_beam_size must be 1 or more" in zero.stderr


def test_transcribe_explains_a_file_it_cannot_read(tmp_path: Path) -> None:
    text = tmp_path / "notes.wav"
    text.write_text("not audio")
    for path in (tmp_path / "nope.wav", text):
        run = subprocess.run(
            [*CAPTIOND, "transcribe", str(path)], capture_output=True, text=True, timeout=60
        )
        assert run.returncode == 2 and "Traceback" not in run.stderr, run.stderr
        assert run.stderr.startswith(f"captiond: error: cannot read '{path}'"), run.stderr


def test_client_explains_a_refused_token(tmp_path: Path) -> None:
    wav = silent_wav(tmp_path)

    async def scenario() -> subprocess.CompletedProcess[str]:
        config = make_config(auth={"token": "s3cret"})
        async with running_daemon(config) as daemon:
            return await asyncio.to_thread(
                subprocess.run,
                [*CLIENT, "stream", str(wav), "--url", url(daemon)],
                capture_output=True,
                text=True,
                timeout=60,
            )

    run = asyncio.run(scenario())
    assert run.returncode == 1 and "Traceback" not in run.stderr, run.stderr
    assert "refused the connection (HTTP 401)" in run.stderr and "token" in run.stderr


# `captiond-client mic` with a stand-in microphone (silence, in real time): find_device and
# capture replaced, everything else the real command.
STAND_IN_MIC = """
import asyncio, sys
import numpy as np
import captiond.sources.mic as sources_mic
import captiond_client.mic as mic
from captiond_client.cli import main

async def capture(device, *, channel=None, stop=None):
    while not stop.is_set():
        await asyncio.sleep(0.1)
        yield np.zeros(1600, np.float32)

device = sources_mic.InputDevice(index=0, name="stand-in", channels=1, default_rate_hz=16000)
sources_mic.find_device = lambda _: device
mic.capture = capture
sys.exit(main(["mic", "--json", "--url", sys.argv[1]]))
"""


def test_mic_quits_at_a_second_ctrl_c_while_the_daemon_is_away() -> None:
    """The first Ctrl-C stops the microphone and waits for the last finals: with the daemon
    gone, through the reconnects of `--retry-for` (300 s). A second quits at once, with 130."""

    async def scenario() -> int:
        async with running_daemon() as daemon:
            client = await asyncio.create_subprocess_exec(
                sys.executable,
                "-c",
                STAND_IN_MIC,
                url(daemon),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
            )
            assert client.stdout is not None and client.stderr is not None
            ready = json.loads(await asyncio.wait_for(client.stdout.readline(), 30))
            assert ready["type"] == "ready"
        # The daemon is gone: the client keeps reconnecting.
        client.send_signal(signal.SIGINT)
        async with asyncio.timeout(30):  # its "stopping" line, among "connection lost" ones
            while (line := await client.stderr.readline()) and b"stopping" not in line:
                pass
        client.send_signal(signal.SIGINT)
        try:
            return await asyncio.wait_for(client.wait(), 30)
        finally:
            if client.returncode is None:
                client.kill()

    assert asyncio.run(scenario()) == 130


def test_devices_says_when_there_are_none(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr("captiond.sources.mic.input_devices", lambda: [])
    assert cli_main(["devices"]) == 0
    assert capsys.readouterr().out.startswith("no audio input devices")


# -- start-up errors and signals (--engine fake: no model) -------------------------------------

SERVE_FAKE = [*CAPTIOND, "serve", "--engine", "fake"]


def test_start_up_mistakes_are_one_line_errors_that_stop_restarts(tmp_path: Path) -> None:
    """Exit 2 (the units' RestartPreventExitStatus): no retry fixes these. A TLS file is
    checked before the engine loads."""
    junk = tmp_path / "junk.pem"
    junk.write_text("junk\n")
    missing = tmp_path / "nope.pem"
    cases = [
        (["--log-level", "bogus"], "captiond serve: error: argument --log-level: invalid choice"),
        (["--tls-cert", str(missing)], f"[server] tls_cert '{missing}': cannot read it: No such"),
        (["--tls-cert", str(junk)], "not a PEM certificate and its private key"),
        (["--port", "70000"], "captiond: error: [server] port must be between 0 and 65535"),
        (["--port", "-1"], "captiond: error: [server] port must be between 0 and 65535"),
        (["--host", "999.1.1.1", "--port", str(free_port())], "cannot listen on 999.1.1.1:"),
    ]
    for args, message in cases:
        run = subprocess.run([*SERVE_FAKE, *args], capture_output=True, text=True, timeout=120)
        assert run.returncode == 2 and "Traceback" not in run.stderr, (args, run.stderr)
        assert message in run.stderr.splitlines()[-1], (args, run.stderr)
        if "--tls-cert" in args:
            assert "loaded and warmed up" not in run.stderr


@pytest.mark.parametrize("workers", ["1", "2"])
def test_an_address_it_cannot_listen_on_is_a_one_line_error_to_retry(workers: str) -> None:
    """Exit 1: a port still held by the instance that is stopping, an address the network has
    not brought up yet may both pass on systemd's next try. Both are found before the engine
    loads."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        in_use = held.getsockname()[1]
        for host, port, reason in (
            ("127.0.0.1", in_use, errno.EADDRINUSE),
            ("192.0.2.1", free_port(), errno.EADDRNOTAVAIL),  # TEST-NET-1: on no machine
        ):
            run = subprocess.run(
                [*SERVE_FAKE, "--host", host, "--port", str(port), "--workers", workers],
                capture_output=True,
                text=True,
                timeout=120,
            )
            assert run.returncode == 1 and "Traceback" not in run.stderr, run.stderr
            expected = f"captiond: error: cannot listen on {host}:{port}: {os.strerror(reason)}"
            assert run.stderr.splitlines()[-1] == expected, run.stderr
            # Found before the engine's (on a GPU, minutes of) loading, not after it.
            assert "loaded and warmed up" not in run.stderr, run.stderr


@pytest.mark.parametrize("workers", ["1", "2"])
def test_sighup_stops_the_daemon_as_sigterm_does(workers: str) -> None:
    port = free_port()
    serve = [*SERVE_FAKE, "--port", str(port), "--workers", workers]
    proc = subprocess.Popen(serve, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stderr is not None
        log = []
        while not log or "ready: ws://" not in log[-1]:
            log.append(proc.stderr.readline())
            assert log[-1], "".join(log)  # "": it exited
        proc.send_signal(signal.SIGHUP)
        assert proc.wait(timeout=60) == 0, "".join(log)
        rest = proc.stderr.read()
        assert "SIGHUP: stopping as on SIGTERM" in rest and "captiond: stopped" in rest, rest
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_only_binding_errors_are_named_as_the_address() -> None:
    """A privileged port without the privilege (this test may run as root) is a mistake; an
    OSError that is not the bind's stays as it is."""

    server = ServerConfig(host="::1", port=80)
    with (
        pytest.raises(ConfigError, match=r"^cannot listen on \[::1\]:80: Permission denied$"),
        _binding(server),
    ):
        raise PermissionError(errno.EACCES, "x")
    with pytest.raises(OSError, match="Too many open files"), _binding(server):
        raise OSError(errno.EMFILE, "Too many open files")


def test_a_diarized_transcript_names_its_speakers_in_every_format(tmp_path: Path) -> None:
    """WebVTT voice spans, read back with a real parser (webvtt-py); "Speaker N: " in SubRip
    and plain text; the speaker as received in JSON."""
    import webvtt

    finals = [
        {"start_ms": 0, "end_ms": 1_500, "text": "Are you there?", "speaker": 0},
        {"start_ms": 1_600, "end_ms": 2_900, "text": "Yes, <here>.", "speaker": 1},
    ]
    vtt = tmp_path / "t.vtt"
    vtt.write_text(render_transcript(finals, ".vtt"), encoding="utf-8")
    cues = webvtt.read(str(vtt))
    # webvtt-py gives a cue's text as written: its entities unescaped here.
    assert [(c.voice, html.unescape(c.text)) for c in cues] == [
        ("Speaker 1", "Are you there?"),
        ("Speaker 2", "Yes, <here>."),
    ]
    assert (
        render_transcript(finals, ".txt") == "Speaker 1: Are you there?\nSpeaker 2: Yes, <here>.\n"
    )
    assert "\nSpeaker 2: Yes, <here>.\n" in render_transcript(finals, ".srt")
    assert [s["speaker"] for s in json.loads(render_transcript(finals, ".json"))["segments"]] == [
        0,
        1,
    ]


_MHM = {"start_ms": 3_100, "end_ms": 3_500}


def test_an_rttm_file_says_who_spoke_when(tmp_path: Path) -> None:
    """Read back with pyannote.database's RTTM reader: each final's `speech`, or its span where
    it has none (a journal written before finals had it); a stream not diarized has none."""
    from pyannote.database.util import load_rttm

    finals = [
        {
            "start_ms": 0,
            "end_ms": 2_000,
            "text": "Are you there?",
            "speaker": 0,
            "speech": [{"start_ms": 200, "end_ms": 900}, {"start_ms": 1_300, "end_ms": 1_950}],
        },
        {"start_ms": 2_000, "end_ms": 2_900, "text": "Yes.", "speaker": 1},
        # No words, but heard: an "mhm" the transcript leaves out.
        {"start_ms": 3_000, "end_ms": 3_600, "text": "", "speaker": 0, "speech": [_MHM]},
    ]
    printer = CaptionPrinter(io.StringIO())
    for final in finals:
        printer({"type": "final", **final})
    assert printer.finals == [{"type": "final", **f} for f in finals]
    assert render_transcript(printer.finals, ".txt").count("\n") == 2
    rttm = tmp_path / "team meeting.rttm"
    write_transcript(rttm, printer.finals)
    (annotation,) = load_rttm(str(rttm)).values()
    assert annotation.uri == "team_meeting"
    assert [
        (round(s.start, 3), round(s.end, 3), who)
        for s, _, who in annotation.itertracks(yield_label=True)
    ] == [
        (0.2, 0.9, "Speaker_1"),
        (1.3, 1.95, "Speaker_1"),
        (2.0, 2.9, "Speaker_2"),
        (3.1, 3.5, "Speaker_1"),
    ]
    with pytest.raises(ValueError, match="diarize=true"):
        render_transcript([{"start_ms": 0, "end_ms": 1, "text": "Hi."}], ".rttm")
