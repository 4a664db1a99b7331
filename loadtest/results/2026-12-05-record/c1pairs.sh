#!/usr/bin/env bash
# c1pairs.sh OUT N BIN... : one client, small GETs, interleaved; prints p50/p99 per path
set -uo pipefail
out=$1; n=$2; shift 2
mkdir -p /work/bench/runs/$out
for i in $(seq $n); do
  for bin in "$@"; do
    l=$(basename $bin)-$i; o=/work/bench/runs/$out/$l; rm -rf $o
    $bin/tether-loadtest --out $o --no-progress --work-dir $o/work --transport wss,quic requests --mix get=1 --concurrency 1 --paths direct,tether --duration 8s > $o.log 2>&1
    python3 - $o/requests.json $l <<'PY'
import json,sys
d=json.load(open(sys.argv[1])); rs={r['label']:r['latency'] for r in d['runs']}
dp=rs['direct']['p50_ms']
print(f"{sys.argv[2]:10s} "+' '.join(f"{k}: p50 {v['p50_ms']:.3f} (+{(v['p50_ms']-dp)*1000:.0f} µs) p99 {v['p99_ms']:.3f}" for k,v in rs.items()))
PY
  done
done
