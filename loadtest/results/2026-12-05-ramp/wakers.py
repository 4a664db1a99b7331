#!/usr/bin/env python3
# wakers.py COMM_PREFIX [TID,TID…] < `perf script -F comm,tid,time,event,trace` of a `perf sched record`:
# for each sleep of a matching thread, who woke it (sched_waking) and how long it had slept.
import sys, re, collections
# perf script lines: comm tid time: event: trace
waking = re.compile(r'^\s*(.+?)\s+(\d+)\s+([\d.]+):\s+sched:sched_waking: comm=(.+?) pid=(\d+)')
switch = re.compile(r'^\s*(.+?)\s+(\d+)\s+([\d.]+):\s+sched:sched_switch: prev_comm=(.+?) prev_pid=(\d+) prev_prio=\d+ prev_state=(\S+) ==> next_comm=(.+?) next_pid=(\d+)')
target = sys.argv[1]; tids = set(sys.argv[2].split(",")) if len(sys.argv) > 2 else None
sleep_at = {}
by = collections.Counter(); wait = collections.Counter()
waits = []
for line in sys.stdin:
    m = switch.match(line)
    if m:
        comm, tid, t, pc, pp, st, nc, np = m.groups()
        if pc.startswith(target) and st.startswith("S") and (tids is None or pp in tids):
            sleep_at[pp] = float(t)
        continue
    m = waking.match(line)
    if m:
        comm, tid, t, wc, wp = m.groups()
        if wc.startswith(target) and wp in sleep_at:
            d = float(t) - sleep_at.pop(wp)
            key = comm.strip() + (":" + tid if comm.strip()=="tokio-rt-worker" else "")
            by[key] += 1; wait[key] += d; waits.append(d)
tot = sum(wait.values())
print(f"sleeps {sum(by.values())} total wait {tot*1000:.0f} ms")
for k, n in by.most_common(12):
    print(f"  {k:22s} wakes {n:6d}  wait {wait[k]*1000:8.1f} ms  avg {wait[k]/n*1e6:7.1f} us")
waits.sort()
if waits:
    for q in (0.5, 0.9, 0.99):
        print(f"  p{int(q*100)} {waits[int(q*len(waits))-1]*1e6:.0f} us")
