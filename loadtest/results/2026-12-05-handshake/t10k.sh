#!/usr/bin/env bash
# t10k.sh OUT N BIN...: interleaved `tunnels --count 10000 --idle 5s` runs: connect rate, CPU per connect, RSS per tunnel.
set -uo pipefail
out=$1; n=$2; shift 2
mkdir -p /work/bench/pairs/$out
ulimit -n 30000
for i in $(seq $n); do
  for bin in "$@"; do
    l=$(basename $bin)-$i; o=/work/bench/pairs/$out/$l; rm -rf $o
    $bin/tether-loadtest --out $o --no-progress --work-dir $o/work --transport wss tunnels --count 10000 --idle 5s > $o.log 2>&1
    rm -rf $o/work
    python3 - $o $l <<'PY'
import json,sys
d=json.load(open(sys.argv[1]+'/tunnels.json'))
f={x['name']:x['value'] for x in d['figures']}
print(f"{sys.argv[2]:10s} connects/s {f.get('tunnel connect rate (all connected, retries included)',0):6.0f} relay µs/connect {f.get('relay CPU per tunnel connect',0):6.1f} client µs/connect {f.get('load client CPU per tunnel connect',0):6.1f} relay KiB/tunnel {f.get('relay RSS per tunnel',0):6.2f}")
PY
  done
done
