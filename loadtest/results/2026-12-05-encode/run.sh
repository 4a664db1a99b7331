#!/usr/bin/env bash
# run.sh OUT N "SCENARIO ARGS" BIN... : interleaved runs of any scenario; prints rates and CPU figures
set -uo pipefail
out=$1; n=$2; args=$3; shift 3
mkdir -p /work/bench/runs/$out
for i in $(seq $n); do
  for bin in "$@"; do
    l=$(basename $bin)-$i; o=/work/bench/runs/$out/$l; rm -rf $o
    $bin/tether-loadtest --out $o --no-progress --work-dir $o/work $args > $o.log 2>&1
    python3 - $o $l <<'PY'
import json,sys,glob
for f in glob.glob(sys.argv[1]+'/*.json'):
    d=json.load(open(f))
    rs=' '.join(f"{r['label']}: {r.get('requests_per_sec',0):.0f}r/s {r.get('mb_per_sec',0):.0f}MB/s" for r in d.get('runs',[]))
    fs=' '.join(f"{x['name'].split(': ')[-1].replace(' per request','/req').replace('CPU ','')}={x['value']:.2f}" for x in d.get('figures',[]))
    print(f"{sys.argv[2]:10s} {rs} | {fs}")
PY
  done
done
