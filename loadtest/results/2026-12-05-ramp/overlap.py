#!/usr/bin/env python3
# overlap.py GROUP=TID,TID … < `perf script -F comm,tid,time,event,trace` of a `perf sched record`:
# the share of the recording during which each group had 0, 1, 2… threads running or runnable.
import sys, re
# thread states over time from sched_switch: running when switched in, not running when switched out.
sw = re.compile(r'^\s*(.+?)\s+(\d+)\s+([\d.]+):\s+sched:sched_switch: prev_comm=(.+?) prev_pid=(\d+) prev_prio=\d+ prev_state=(\S+) ==> next_comm=(.+?) next_pid=(\d+)')
groups = {k: set(v.split(',')) for k, v in (a.split('=') for a in sys.argv[1:])}
state = {}  # tid -> 'run' | 'ready' | 'sleep'
events = []
for line in sys.stdin:
    m = sw.match(line)
    if not m: continue
    _, _, t, pc, pp, st, nc, np = m.groups()
    t = float(t)
    events.append((t, pp, 'ready' if st.startswith('R') else 'sleep'))
    events.append((t, np, 'run'))
t0 = events[0][0]; last = t0
acc = {}
def busy(g):
    return sum(1 for tid in groups[g] if state.get(tid, 'sleep') != 'sleep')
names = list(groups)
for t, tid, s in events:
    key = tuple(busy(g) for g in names)
    acc[key] = acc.get(key, 0) + (t - last)
    last = t
    state[tid] = s
tot = sum(acc.values())
print("busy threads per group", names, "share of time")
for k in sorted(acc):
    print(f"  {k}: {acc[k]/tot*100:5.1f} %")
