#!/usr/bin/env bash
# storm.sh OUT N RATE BIN_A BIN_B ...: interleaved small-GET runs (32 clients, WSS) with a reconnect storm of RATE tunnel connects/s.
set -euo pipefail
out=$1; n=$2; rate=$3; shift 3
mkdir -p /work/bench/pairs/$out
for i in $(seq $n); do
  for bin in "$@"; do
    l=$(basename $bin)-$i; o=/work/bench/pairs/$out/$l; rm -rf $o
    $bin/tether-loadtest --out $o --no-progress --work-dir $o/work --transport wss requests --mix get=1 --paths tether --duration 10s --warmup 2s --storm-rate $rate --storm-agents 64 > $o.log 2>&1 || true
    python3 - $o $l <<'PY'
import json,sys
d=json.load(open(sys.argv[1]+'/requests.json')); r=d['runs'][0]
f={x['name'].split(': ',1)[1]:x['value'] for x in d['figures']}
l=r['latency']
print(f"{sys.argv[2]:12s} req/s {r['requests_per_sec']:7.0f} p50 {l['p50_ms']:6.3f} p99 {l['p99_ms']:6.3f} p999 {l['p999_ms']:6.3f} relay {f.get('relay CPU per request',0):6.2f} agent {f.get('agent CPU per request',0):6.2f} storm {f.get('storm tunnel connects',0):6.1f}/s conn p50 {f.get('storm connect p50',0):6.2f} p99 {f.get('storm connect p99',0):7.2f} err {f.get('storm connect errors',0):.0f} skip {f.get('storm ticks skipped (connects in flight at the bound)',0):.0f}")
PY
  done
done
