#!/usr/bin/env bash
# cg.sh BINDIR LABEL: callgrind instructions per small GET (slope between a 4 s and a 12 s run), relay and agent.
set -euo pipefail
bin=$1; label=$2; out=/work/bench/cg/$label; rm -rf "$out"; mkdir -p "$out"
for d in 4 12; do
  o=$out/d$d; mkdir -p $o
  $bin/tether-loadtest --out $o --no-progress --work-dir $o/work --transport wss \
    --relay-wrapper "valgrind --tool=callgrind --callgrind-out-file=$o/cg.relay.%p" \
    --agent-wrapper "valgrind --tool=callgrind --callgrind-out-file=$o/cg.agent.%p" \
    requests --mix get=1 --paths tether --duration ${d}s --warmup 1s --concurrency 4 > $o/lt.log 2>&1
done
python3 - "$out" <<'PY'
import sys,json,glob,re
out=sys.argv[1]
def ir(f):
    for l in open(f):
        if l.startswith(('summary:','totals:')): return int(l.split()[1])
res={}
for d in (4,12):
    o=f'{out}/d{d}'; n=json.load(open(f'{o}/requests.json'))['runs'][0]['requests']
    res[d]={'n':n}
    for p in ('relay','agent'):
        fs=glob.glob(f'{o}/cg.{p}.*'); res[d][p]=sum(ir(f) for f in fs)
dn=res[12]['n']-res[4]['n']
print(out.split('/')[-1], 'requests', res[4]['n'], res[12]['n'], ' '.join(f"{p} {(res[12][p]-res[4][p])/dn/1000:.1f}k" for p in ('relay','agent')))
PY
