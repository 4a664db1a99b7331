#!/usr/bin/env bash
# run.sh BIN: a 10k tunnels run with perf sampling the connect phase.
set -uo pipefail
b=$1; o=/work/bench/prof23/$b; rm -rf $o; mkdir -p $o
/work/bench/$b/tether-loadtest --out $o/out --no-progress --work-dir $o/work --transport wss tunnels --count 10000 --idle 5s > $o/log 2>&1 &
lt=$!
# wait for the connect phase: the relay's onboarding phase takes ~12 s

sleep 15
perf record -F 1999 -a -o $o/perf.data -- sleep 4 > /dev/null 2>&1
wait $lt
rm -rf $o/work
