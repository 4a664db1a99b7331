#!/usr/bin/env bash
# perf-ramp.sh BIN: a 10k tunnels run with perf sampling 4 s of the connect ramp.
set -uo pipefail
b=$1; o=/work/bench/prof23/$b; rm -rf $o; mkdir -p $o
/work/bench/$b/tether-loadtest --out $o/out --no-progress --work-dir $o/work --transport wss tunnels --count 10000 --idle 5s > $o/log 2>&1 &
lt=$!
# The ramp starts after ~2 s of start-up and ~12 s of onboarding.
sleep 15
perf record -F 1999 -a -o $o/perf.data -- sleep 4 > /dev/null 2>&1
wait $lt
rm -rf $o/work
