#!/usr/bin/env python3
"""Samples the CPU time of processes by name every second until the named file appears; prints per-name totals."""
import os, sys, time
names = sys.argv[2].split(',')
stop = sys.argv[1]
tck = os.sysconf('SC_CLK_TCK')
last = {}
tot = {n: 0 for n in names}
perpid = {}
maxrss = {}
series = []
def scan():
    cur = {}
    for pid in os.listdir('/proc'):
        if not pid.isdigit(): continue
        try:
            comm = open(f'/proc/{pid}/comm').read().strip()
            if comm not in names: continue
            f = open(f'/proc/{pid}/stat').read().rsplit(')', 1)[1].split()
            cur[pid] = (comm, int(f[11]) + int(f[12]))
            for l in open(f'/proc/{pid}/status'):
                if l.startswith('VmRSS:'):
                    maxrss[(pid, comm)] = max(maxrss.get((pid, comm), 0), int(l.split()[1]))
        except OSError:
            pass
    return cur
t0 = time.time()
while not os.path.exists(stop):
    cur = scan()
    row = {n: 0 for n in names}
    for pid, (comm, t) in cur.items():
        d = t - last.get(pid, (comm, t))[1] if pid in last else t if t0 + 1 < time.time() else 0
        row[comm] += d
        tot[comm] += d
        perpid[(pid, comm)] = perpid.get((pid, comm), 0) + d
    last = cur
    series.append((round(time.time() - t0, 1), {n: row[n] / tck for n in names}))
    time.sleep(1)
for t, r in series:
    print(t, ' '.join(f'{n}={v:.2f}' for n, v in r.items()))
print('total', ' '.join(f'{n}={v / tck:.2f}s' for n, v in tot.items()))
for (pid, comm), v in perpid.items():
    print('pid', pid, comm, f'{v / tck:.2f}s')
for (pid, comm), v in maxrss.items():
    print('maxrss', pid, comm, f'{v / 1024:.0f} MiB')
