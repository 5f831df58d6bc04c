#!/usr/bin/env bash
# On the GPU machine, in the last of prepare.sh's calls: join the chunks into /var/tmp/g.
set -euo pipefail
last=$(ls -d .carry/c* | sort -V | tail -1)
parts=$( (ls /var/tmp/m/part* 2>/dev/null || true; ls "$last"/part*) | awk -F/ '{print $NF" "$0}' | sort -V | cut -d' ' -f2)
cat $parts > /var/tmp/all.tgz
echo "$(cat "$last/sha256")  /var/tmp/all.tgz" | sha256sum -c --quiet
tar xzf /var/tmp/all.tgz -C /var/tmp && rm -f /var/tmp/all.tgz /var/tmp/m/part*
