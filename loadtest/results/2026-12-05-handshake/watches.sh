#!/usr/bin/env bash
# watches.sh OUT N MODE BIN...: interleaved watches runs. MODE: h2 (30x100 + 1) | all (defaults: 20x100 + 1000 over HTTP/1.1)
set -euo pipefail
out=$1; n=$2; mode=$3; shift 3
mkdir -p /work/bench/pairs/$out
case $mode in
  h2) extra="--principals 30 --watches-per-principal 100 --controller-watches 1";;
  *) extra="";;
esac
for i in $(seq $n); do
  for bin in "$@"; do
    l=$(basename $bin)-$mode-$i; o=/work/bench/pairs/$out/$l; rm -rf $o
    $bin/tether-loadtest --out $o --no-progress --work-dir $o/work --transport wss watches $extra > $o.log 2>&1 || true
    python3 - $o $l <<'PY'
import json,sys
d=json.load(open(sys.argv[1]+'/watches.json'))
f={x['name']:x['value'] for x in d['figures']}
print(f"{sys.argv[2]:16s} relay KiB/watch {f.get('relay memory per open watch',0):6.2f} agent {f.get('agent memory per open watch',0):6.2f} relay RSS before {f.get('relay RSS before',0):6.2f} with {f.get('relay RSS with the watches open',0):6.2f}")
PY
    rm -rf $o/work
  done
done
