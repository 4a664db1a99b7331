#!/usr/bin/env bash
# sched.sh BIN: a `tunnels --count 10000` run of the binaries in /work/bench/BIN, with `perf sched record` over 3 s
# of the connect ramp (it starts about 12 s in, after the onboarding); writes the per-thread runtime summary.
# wakers.py and overlap.py read the recording (see README.md).
set -uo pipefail
b=$1; o=/work/bench/sched24/$b; rm -rf $o; mkdir -p $o
/work/bench/$b/tether-loadtest --out $o/out --no-progress --work-dir $o/work --transport wss tunnels --count 10000 --idle 5s > $o/log 2>&1 &
lt=$!
sleep 15
perf sched record -g -o $o/sched.data -- sleep 3 > /dev/null 2>&1
wait $lt
rm -rf $o/work
perf sched timehist -i $o/sched.data -s 2>/dev/null | sed -n '/Runtime summary/,$p' > $o/summary.txt
grep -i "tunnels up\|connect rate" $o/log | head -3
