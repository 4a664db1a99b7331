#!/usr/bin/env bash
# Rewrites cluster-agent/link-order.txt, the order in which the release tether-agent's functions are linked
# (cluster-agent/build.rs; docs/BENCHMARKS.md "The idle agent's layout"), then rebuilds the agent with it and
# reports how much of the order the binary matched and the idle agent's RSS.
#
#   bash scripts/link-order.sh [--helpers DIR]
#
# The agent is built as deploy/docker builds it (`cargo build --release --locked -p tether-agent --bin
# tether-agent`): symbol names depend on the features cargo unifies for the command, so the order fits that
# build (a `--workspace` build of the agent matches only part of it, and is laid out only that much). Its
# functions are profiled with callgrind under `tether-loadtest`: an idle agent first (start, onboarding,
# tunnel, heartbeats, metadata), then small GETs, lists and watches over WebSocket and over QUIC. Run it again
# when the agent's code, its dependency tree or the toolchain changes: a stale order costs memory, never
# correctness. It records what the names were made from in cluster-agent/link-order.deps, which CI checks
# (scripts/check-link-order.sh).
# --helpers DIR: take tether-relay, tether-loadtest and tether-sample-apiserver from DIR instead of building them.
# Needs valgrind and python3.
set -euo pipefail
cd "$(dirname "$0")/.."
helpers=""
while [ $# -gt 0 ]; do
  case "$1" in
    --helpers) helpers="$2"; shift 2 ;;
    -h|--help) sed -n '2,18p' "$0"; exit 0 ;;
    *) echo "unknown argument $1" >&2; exit 64 ;;
  esac
done
command -v valgrind >/dev/null || { echo "valgrind is needed (apt-get install -y valgrind)" >&2; exit 1; }
target="${CARGO_TARGET_DIR:-$PWD/target}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/bin"

if [ -z "$helpers" ]; then
  cargo build --release --locked -p tether-relay -p tether-loadtest -p tether-testkit --bins
  helpers="$target/release"
fi
for b in tether-relay tether-loadtest tether-sample-apiserver; do
  [ -x "$helpers/$b" ] || { echo "no $helpers/$b" >&2; exit 1; }
  cp "$helpers/$b" "$work/bin/"
done
# The agent last: the command above may rebuild it with other features.
cargo build --release --locked -p tether-agent --bin tether-agent
cp "$target/release/tether-agent" "$work/bin/"

lt=("$work/bin/tether-loadtest" --bin-dir "$work/bin" --no-progress)
cg="valgrind --tool=callgrind --demangle=no --compress-strings=no --callgrind-out-file"
"${lt[@]}" --out "$work/idle" --agent-wrapper "$cg=$work/idle.cg" tunnels --count 10 --idle 40s >"$work/idle.log" 2>&1 \
  || { cat "$work/idle.log" >&2; exit 1; }
for t in wss quic; do
  "${lt[@]}" --transport "$t" --out "$work/$t" --agent-wrapper "$cg=$work/$t.cg" \
    requests --mix get=1,list=1,watch=1 --paths tether --concurrency 4 --duration 3s --warmup 1s \
    >"$work/$t.log" 2>&1 || { cat "$work/$t.log" >&2; exit 1; }
done
python3 scripts/link-order.py "$work/bin/tether-agent" cluster-agent/link-order.txt \
  "$work/idle.cg" "$work/wss.cg" "$work/quic.cg"

# Only the link arguments change: the same names, laid out by the new order.
cargo build --release --locked -p tether-agent --bin tether-agent
python3 scripts/link-order.py --check "$target/release/tether-agent" cluster-agent/link-order.txt
# What the names were made from, so that CI notices when they change (scripts/check-link-order.sh).
bash scripts/check-link-order.sh --write
cp "$target/release/tether-agent" "$work/bin/"
"${lt[@]}" --out "$work/check" tunnels --count 10 2>&1 | grep -i "idle agent" || true
