#!/usr/bin/env bash
# The GPU tests and `bench engine` (tiny.en, base), each under its own time limit; results and
# logs in $OUT/checks.tgz, rewritten after every step so a cut-off run still returns them.
R=/tmp/checks; mkdir -p $R
save() { tar czf "$OUT/checks.tgz" -C /tmp checks; }
t0=$(date +%s)
step() {  # name, seconds, command...
  local name=$1 limit=$2; shift 2
  echo "== $name at $(( $(date +%s) - t0 )) s"
  timeout "$limit" "$@" > "$R/$name.log" 2>&1; echo "rc=$?"; tail -4 "$R/$name.log"; save
}
nvidia-smi > $R/nvidia-smi.txt 2>&1
step pytest-gpu 300 python3 -m pytest tests/test_torch_graph_gpu.py -v -rs -p no:cacheprovider
step engine-tiny 120 python3 -m captiond.cli bench engine --engine torch_graph --device cuda --out $R/engine-tiny.json
step engine-base 120 python3 -m captiond.cli bench engine --engine torch_graph --device cuda --model base --out $R/engine-base.json
echo "== done at $(( $(date +%s) - t0 )) s"
