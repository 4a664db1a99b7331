#!/usr/bin/env bash
# Builds tether-relay and tether-agent with profile-guided optimisation (PGO): an instrumented build of both
# carries a short, representative load from tether-loadtest (small GETs and the kubectl-like mix over WebSocket,
# small GETs over QUIC and from users speaking HTTP/2, one client alone, bulk responses over one stream and
# eight), llvm-profdata merges what they counted, and the release build is made again with those counts. What it
# buys is measured in docs/BENCHMARKS.md ("Twelfth pass", "Thirteenth pass").
#
#   scripts/pgo-build.sh [--out DIR] [--profile PROFILE]
#
# DIR (default: $CARGO_TARGET_DIR or target, then /pgo) receives tether-relay and tether-agent;
# `deploy/docker/build-local.sh --bin-dir DIR` makes images of them. PROFILE is the cargo profile of
# both builds (default release: fat LTO, as shipped). Each binary is built on its own, as deploy/docker builds it,
# and for the host without --target, so that the agent's symbol names are the ones cluster-agent/link-order.txt
# lists (another feature set, target flag or profile renames them and the idle agent loses its layout). They
# are built in a directory of their own (…/pgo-build beside DIR's default), so the plain ones stay as they were.
# Needs llvm-profdata of rustc's own LLVM version: rustup's llvm-tools component, or the distribution's llvm-N
# package (N = the major version `rustc -vV` prints; Rust 1.95 is LLVM 22: apt-get install llvm-22). The
# training runs on loopback only, about two minutes, and stops by itself; the build takes about three times as
# long as a plain one (two builds of relay and agent, one of the load generator).
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
target="${CARGO_TARGET_DIR:-$repo/target}"
out=""
profile=release
while [ $# -gt 0 ]; do
  case "$1" in
    --out) out="$2"; shift 2 ;;
    --profile) profile="$2"; shift 2 ;;
    -h|--help) sed -n '2,19p' "$0"; exit 0 ;;
    *) echo "unknown argument $1 (see --help)" >&2; exit 64 ;;
  esac
done
out="${out:-$target/pgo}"

host="$(rustc -vV | sed -n 's/^host: //p')"
llvm_major="$(rustc -vV | sed -n 's/^LLVM version: \([0-9]*\).*/\1/p')"
profdata=""
for candidate in "$(rustc --print sysroot)/lib/rustlib/$host/bin/llvm-profdata" \
  "$(command -v "llvm-profdata-$llvm_major" || true)" "/usr/lib/llvm-$llvm_major/bin/llvm-profdata"; do
  if [ -n "$candidate" ] && [ -x "$candidate" ]; then
    profdata="$candidate"
    break
  fi
done
if [ -z "$profdata" ]; then
  echo "no llvm-profdata for LLVM $llvm_major (rustc's): rustup component add llvm-tools, or apt-get install llvm-$llvm_major" >&2
  exit 1
fi
profile_dir="$profile"
[ "$profile" = dev ] && profile_dir=debug

work="$(mktemp -d)"
bins="$work/bin"
cleanup() {
  pkill -KILL -f "$bins/tether-(relay|agent)" 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT
mkdir -p "$bins" "$work/raw"

# Relay and agent, each on its own, with extra rustc flags ($1), into $pgo_target.
pgo_target="$target/pgo-build"
build_pair() {
  local pkg
  for pkg in relay agent; do
    (cd "$repo" && CARGO_TARGET_DIR="$pgo_target" RUSTFLAGS="${RUSTFLAGS:-} $1" \
      cargo build --profile "$profile" --locked -p "tether-$pkg" --bin "tether-$pkg")
  done
}

echo "== 1/4 the load generator, and relay and agent instrumented"
(cd "$repo" && cargo build --profile "$profile" --locked -p tether-loadtest --bin tether-loadtest)
build_pair "-Cprofile-generate=$work/raw"
cp "$target/$profile_dir/tether-loadtest" "$bins/"
cp "$pgo_target/$profile_dir/tether-relay" "$pgo_target/$profile_dir/tether-agent" "$bins/"
# Without --target the flags reach build scripts and proc macros too, which count their own runs: only the
# training's counts are kept.
rm -f "$work"/raw/*.profraw

echo "== 2/4 training: representative load through the instrumented relay and agent"
# The load generator stops its processes with SIGKILL, and a program killed so writes no profile: each runs as
# the child of a wrapper that the kill ends instead, and is stopped with SIGTERM (a clean exit) after the run.
cat > "$work/keep.sh" <<'EOF'
#!/usr/bin/env bash
"$@" &
wait $!
EOF
chmod +x "$work/keep.sh"
stop() {
  pkill -TERM -f "$bins/tether-(relay|agent)" 2>/dev/null || true
  for _ in $(seq 1 120); do
    pgrep -f "$bins/tether-(relay|agent)" >/dev/null || return 0
    sleep 1
  done
  echo "relay or agent did not stop within 120 s of SIGTERM" >&2
  exit 1
}
train() {
  echo "-- $*"
  rm -rf "$work/run" "$work/results"
  "$bins/tether-loadtest" --bin-dir "$bins" --no-progress --out "$work/results" --work-dir "$work/run" \
    --relay-wrapper "$work/keep.sh" --agent-wrapper "$work/keep.sh" "$@" > "$work/train.log" 2>&1 || {
    tail -20 "$work/train.log" >&2
    exit 1
  }
  stop
}
train --transport wss requests --mix get=1 --paths tether --warmup 1s --duration 8s
train --transport wss requests --paths tether --warmup 1s --duration 8s
train --transport quic requests --mix get=1 --paths tether --warmup 1s --duration 6s
train --transport wss requests --mix get=1 --paths tether --concurrency 1 --warmup 1s --duration 4s
train --transport wss bulk --paths tether --warmup 1s --duration 4s
train --transport wss requests --mix get=1 --paths tether --protocol h2 --warmup 1s --duration 6s

echo "== 3/4 merging the counts ($profdata)"
shopt -s nullglob
raw=("$work"/raw/*.profraw)
[ ${#raw[@]} -gt 0 ] || { echo "the training wrote no profile" >&2; exit 1; }
"$profdata" merge -o "$work/merged.profdata" "${raw[@]}"

echo "== 4/4 relay and agent built with the profile"
build_pair "-Cprofile-use=$work/merged.profdata"
mkdir -p "$out"
install -m 0755 "$pgo_target/$profile_dir/tether-relay" "$pgo_target/$profile_dir/tether-agent" "$out/"
# The agent's layout: how many of the functions link-order.txt lists this agent defines (2,684 of 3,054 with the
# release profile on Rust 1.95, the rest inlined by the profile; none when the build renames them).
if [ "$profile" = release ] && command -v nm >/dev/null && command -v python3 >/dev/null; then
  python3 "$repo/scripts/link-order.py" --check "$out/tether-agent" "$repo/cluster-agent/link-order.txt"
fi
echo "PGO-built tether-relay and tether-agent in $out"
