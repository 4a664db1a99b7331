#!/usr/bin/env bash
# A 10 s small-GET run over the tunnel with `perf sched record` over 2 s of it; then the per-thread summary and
# the overlap of the path's threads (../2026-12-05-ramp/overlap.py; thread ids from the summary).
b=${1:-binW}; o=/work/bench/sched25; rm -rf $o/out $o/work
/work/bench/$b/tether-loadtest --out $o/out --no-progress --work-dir $o/work --transport wss requests --mix get=1 --paths tether --duration 10s > $o/log 2>&1 &
sleep 9; perf sched record -o $o/sched.data -- sleep 2 > /dev/null 2>&1; wait
perf sched timehist -i $o/sched.data -s 2>/dev/null | sed -n '/Runtime summary/,$p' > $o/summary.txt
perf script -i $o/sched.data -F comm,tid,time,event,trace > $o/script.txt
