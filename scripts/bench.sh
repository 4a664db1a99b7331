#!/usr/bin/env bash
# Runs Tether's load tests (docs/BENCHMARKS.md) with release binaries; results go to ./loadtest-results.
#
#   bash scripts/bench.sh                 # every scenario with its defaults (about 10 minutes on 2 cores)
#   bash scripts/bench.sh requests --concurrency 64 --protocol h2
#   bash scripts/bench.sh tunnels --count 10000
#   bash scripts/bench.sh profile         # perf (else callgrind) profiles of relay and agent under `requests`
#   bash scripts/bench.sh transports      # requests, bulk and hol with the agent on QUIC and on WebSocket, side by side
#   bash scripts/bench.sh hol-loss 0.01   # hol, QUIC and WebSocket side by side, 1 % of the tunnel's packets
#                                         # dropped (in a network namespace of its own: needs root and iptables)
set -euo pipefail
cd "$(dirname "$0")/.."

scenario="${1:-all}"
shift || true

cargo build --release -p tether-relay -p tether-loadtest --bins
# The agent on its own, as deploy/docker builds it: its link order (cluster-agent/link-order.txt) names the
# functions of that build; built beside the relay, other features change many names and the idle agent's RSS.
cargo build --release -p tether-agent --bin tether-agent
command -v iperf3 >/dev/null || echo "note: iperf3 not found (apt-get install -y iperf3): raw loopback figures skipped" >&2
command -v rathole >/dev/null || [ -x "$HOME/.cargo/bin/rathole" ] \
  || echo "note: rathole not found (cargo install rathole): rathole runs skipped" >&2
# Each tunnel is a file descriptor in the relay and in the load generator.
ulimit -n "$(ulimit -Hn)" 2>/dev/null || true

out=loadtest-results
lt=target/release/tether-loadtest

case "$scenario" in
  profile)
    mkdir -p "$out/profile"
    if command -v perf >/dev/null && perf record -e cpu-clock -o /dev/null -- true 2>/dev/null; then
      # Sample relay and agent (cpu-clock works without hardware counters) while `requests` runs through them.
      rm -rf "$out/profile/work"
      "$lt" --out "$out/profile" --no-progress --work-dir "$out/profile/work" requests --paths tether \
        --duration 20s --warmup 2s &
      lt_pid=$!
      # The load generator writes each child's pid next to its log.
      relay_pid="$out/profile/work/relay/relay.pid"
      agent_pid="$out/profile/work/agent/agent-loadtest.pid"
      for _ in $(seq 300); do
        [ -s "$relay_pid" ] && [ -s "$agent_pid" ] && break
        kill -0 "$lt_pid" 2>/dev/null || { echo "the load generator exited early" >&2; exit 1; }
        sleep 0.2
      done
      relay=$(cat "$relay_pid")
      agent=$(cat "$agent_pid")
      sleep 3
      perf record -e cpu-clock -F 499 -g -p "$relay" -o "$out/profile/relay.perf" -- sleep 12 &
      perf record -e cpu-clock -F 499 -g -p "$agent" -o "$out/profile/agent.perf" -- sleep 12 &
      wait "$lt_pid"
      wait
      for p in relay agent; do
        { perf report -i "$out/profile/$p.perf" --stdio --no-children --sort symbol -g none 2>/dev/null \
          | grep -v '^#' | grep -v '^$' | head -60 > "$out/profile/$p.top.txt"; } || true
        echo "== $p: top symbols ($out/profile/$p.top.txt)"; head -25 "$out/profile/$p.top.txt"
      done
    else
      # Instruction counts: stable on a noisy machine, ~50× slower, so a short light run.
      "$lt" --out "$out/profile" --no-progress --work-dir "$out/profile/work" \
        --relay-wrapper "valgrind --tool=callgrind --callgrind-out-file=$PWD/$out/profile/callgrind.relay.%p" \
        --agent-wrapper "valgrind --tool=callgrind --callgrind-out-file=$PWD/$out/profile/callgrind.agent.%p" \
        requests --paths tether --duration 10s --warmup 2s --concurrency 4
      for f in "$out"/profile/callgrind.*; do
        echo "== $f"; { callgrind_annotate "$f" 2>/dev/null | head -40; } || true
      done
    fi
    ;;
  transports)
    for s in requests bulk hol; do
      "$lt" --out "$out/transports" --transport quic,wss "$s" "$@"
    done
    ;;
  hol-loss)
    # In a network namespace of its own, so the iptables rules that drop a share of the tunnel's packets (both
    # ways; the client's and the upstream's hops stay clean) touch nothing else. tc netem is not in every kernel
    # (not in this machine's): iptables' statistic match drops packets at random just as well.
    loss="${1:-0.01}"
    shift || true
    ns="tether-bench-loss-$$"
    ip netns add "$ns"
    trap 'ip netns del "$ns" 2>/dev/null || true' EXIT
    ip -n "$ns" link set lo up
    ip netns exec "$ns" "$lt" --out "$out/hol-loss-$loss" --transport quic,wss hol --tunnel-loss "$loss" "$@"
    ;;
  *)
    exec "$lt" --out "$out" "$scenario" "$@"
    ;;
esac
