#!/usr/bin/env bash
# N captiond instances and HAProxy in front of them, on loopback: for trying the set-up and
# for its tests (tests/deploy/test_haproxy.py).
#
#   deploy/haproxy/run-local.sh --instances 3 --port 9000 [--state DIR] [-- SERVE OPTIONS...]
#
# HAProxy listens on PORT and instance i (named i1 ... iN) on PORT+i, its HAProxy agent on
# PORT+N+i, all with one journal folder (DIR/journal), so that any instance can take a session
# back. Options after `--` go to
# every `captiond serve` (e.g. `--engine fake`; `--max-sessions N` also becomes each server's
# maxconn and the per-address limit: every local client is 127.0.0.1). An instance that exits
# is started again (as systemd's Restart= would): SIGTERM one for a rolling restart; while
# DIR/iK.hold exists, instance K is not started again. DIR (default: a new temporary folder)
# holds the journal, haproxy.cfg, each instance's config, PID (iK.pid) and log. Ctrl-C stops
# everything.
set -euo pipefail

instances=2
port=8765
state=""
serve_options=()
while (($#)); do
    case "$1" in
        --instances) instances="$2"; shift 2 ;;
        --port) port="$2"; shift 2 ;;
        --state) state="$2"; shift 2 ;;
        --) shift; serve_options=("$@"); break ;;
        -h|--help) sed -n '2,15p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "run-local.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
    esac
done
if ! [[ "$instances" =~ ^[1-9][0-9]*$ && "$port" =~ ^[1-9][0-9]*$ ]]; then
    echo "run-local.sh: --instances and --port take positive numbers" >&2
    exit 2
fi
if ((port + 2 * instances > 65535)); then
    echo "run-local.sh: ports $port to $((port + 2 * instances)) do not all exist" >&2
    exit 2
fi
for tool in captiond haproxy; do
    if ! command -v "$tool" >/dev/null; then
        echo "run-local.sh: $tool is not installed (haproxy: apt-get install haproxy)" >&2
        exit 2
    fi
done
maxconn=64  # captiond's default [server] max_sessions
for ((k = 0; k < ${#serve_options[@]}; k++)); do
    [[ "${serve_options[k]}" == --max-sessions ]] && maxconn="${serve_options[k + 1]:-64}"
done
state="${state:-$(mktemp -d -t captiond-local.XXXXXX)}"
mkdir -p "$state/journal"
here="$(cd "$(dirname "$0")" && pwd)"

# The shipped haproxy.cfg, its SERVERS block written for these instances and its front end
# moved to PORT.
servers="$state/servers.cfg"
: >"$servers"
for ((i = 1; i <= instances; i++)); do
    echo "    use-server i$i if { urlp(resume) -m beg i${i}_ } || { var(txn.instance) -m str i$i }" >>"$servers"
done
for ((i = 1; i <= instances; i++)); do
    echo "    server i$i 127.0.0.1:$((port + i)) agent-port $((port + instances + i))" >>"$servers"
done
awk -v servers="$servers" -v port="$port" -v maxconn="$maxconn" '
    /# BEGIN SERVERS/ { print; while ((getline line < servers) > 0) print line; skip = 1; next }
    /# END SERVERS/ { skip = 0 }
    skip { next }
    /^    bind :8765$/ { print "    bind 127.0.0.1:" port; next }
    /^    default-server / { sub(/maxconn [0-9]+/, "maxconn " maxconn) }
    { print }
' "$here/haproxy.cfg" >"$state/haproxy.cfg"
haproxy -c -q -f "$state/haproxy.cfg"

children=()
stop() {
    trap - INT TERM EXIT
    touch "$state/stopping"
    for ((i = 1; i <= instances; i++)); do
        [[ -s "$state/i$i.pid" ]] && kill -TERM "$(cat "$state/i$i.pid")" 2>/dev/null || true
    done
    kill -TERM "${children[@]}" 2>/dev/null || true
    wait || true
}
trap stop INT TERM EXIT

# One instance, started again whenever it exits, until the script stops.
instance() {
    local i="$1"
    # The agent for HAProxy, admission by lag and by the event loop's busy share, HAProxy's
    # X-Forwarded-For believed, the journal.
    cat >"$state/i$i.toml" <<TOML
[server]
# Every local client is 127.0.0.1: one address may take every session.
max_sessions_per_ip = $maxconn
agent_port = $((port + instances + i))
max_lag_ms = 1000
max_loop_busy = 0.8
trusted_proxies = ["127.0.0.1"]

[journal]
dir = "$state/journal"
TOML
    while [[ ! -e "$state/stopping" ]]; do
        captiond serve --config "$state/i$i.toml" --host 127.0.0.1 --port "$((port + i))" \
            --instance "i$i" "${serve_options[@]}" >>"$state/i$i.log" 2>&1 &
        echo "$!" >"$state/i$i.pid"
        wait "$!" || true
        sleep 0.5
        while [[ -e "$state/i$i.hold" && ! -e "$state/stopping" ]]; do sleep 0.2; done
    done
}
rm -f "$state/stopping"
for ((i = 1; i <= instances; i++)); do
    instance "$i" &
    children+=("$!")
done
haproxy -db -f "$state/haproxy.cfg" >>"$state/haproxy.log" 2>&1 &
children+=("$!")
echo "HAProxy on 127.0.0.1:$port, instances i1..i$instances on ports $((port + 1))..$((port + instances)) (agents $((port + instances + 1))..$((port + 2 * instances))); state in $state"
wait
