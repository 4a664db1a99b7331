#!/usr/bin/env bash
# pairs.sh OUT N TRANSPORT BIN_A BIN_B ...: interleaved small-GET runs (32 clients), CPU per request per process.
set -euo pipefail
out=$1; n=$2; tr=$3; shift 3
mkdir -p /work/bench/pairs/$out
for i in $(seq $n); do
  for bin in "$@"; do
    l=$(basename $bin)-$i; o=/work/bench/pairs/$out/$l; rm -rf $o
    $bin/tether-loadtest --out $o --no-progress --work-dir $o/work --transport $tr requests --mix get=1 --paths tether --duration 10s --warmup 2s > $o.log 2>&1 || true
    python3 - $o $l <<'PY'
import json,sys
d=json.load(open(sys.argv[1]+'/requests.json')); r=d['runs'][0]
f={x['name'].split(': ')[1]:x['value'] for x in d['figures']}
print(f"{sys.argv[2]:12s} req/s {r['requests_per_sec']:8.0f} relay {f.get('relay CPU per request',0):6.2f} agent {f.get('agent CPU per request',0):6.2f} upstream {f.get('upstream CPU per request',0):6.2f} client {f.get('load client CPU per request',0):6.2f}")
PY
  done
done
