#!/usr/bin/env bash
# The peer for `captiond bench ... --peer whisperlive`: WhisperLive 0.10.0 (faster_whisper
# backend) in its own virtual environment, .venv-whisperlive/ at the repository root.
# whisper-live pins a very large dependency list (openvino, openai-whisper, CUDA wheels, ...);
# it is installed with --no-deps, plus only what its websocket server imports on CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venv-whisperlive
PYTHON=${PYTHON:-python3}
"$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/pip" install --disable-pip-version-check --quiet)
"${PIP[@]}" --upgrade pip
"${PIP[@]}" --no-deps "whisper-live==0.10.0"
# faster-whisper as whisper-live pins it (its own deps: ctranslate2, tokenizers, onnxruntime,
# av, huggingface_hub, tqdm); torch is only imported (CUDA probing, Silero VAD): the CPU build.
"${PIP[@]}" "faster-whisper==1.2.0" requests "websockets>=13" "numpy<2.5" scipy fastapi uvicorn
# torch==2.13.0 is the CPU build these machines carry locally; any other spec would pull
# gigabytes of CUDA wheels.
"${PIP[@]}" --no-deps "torch==2.13.0"
"${PIP[@]}" filelock sympy networkx jinja2 fsspec typing-extensions
"$VENV/bin/python" -c "import whisper_live.server, faster_whisper; print('whisper-live ready')"
