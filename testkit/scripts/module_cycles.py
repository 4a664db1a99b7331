#!/usr/bin/env python3
"""Module import graph of a crate's src/ (`use crate::X`, `crate::X::` paths) and its strongly connected components."""
import os, re, sys
src = sys.argv[1]
mods = {}
for f in sorted(os.listdir(src)):
    if f.endswith('.rs') and f not in ('lib.rs', 'main.rs'):
        mods[f[:-3]] = os.path.join(src, f)
edges = {m: set() for m in mods}
for m, path in mods.items():
    text = open(path).read()
    # Drop the tests module: it may import anything.
    cut = text.find('#[cfg(test)]\nmod tests')
    if cut >= 0:
        text = text[:cut]
    text = re.sub(r'//[^\n]*', '', text)
    for dep in re.findall(r'crate::([a-z_]+)', text):
        if dep in mods and dep != m:
            edges[m].add(dep)
    for group in re.findall(r'use crate::\{([^}]*)\}', text):
        for dep in re.findall(r'\b([a-z_]+)\b', group):
            if dep in mods and dep != m:
                edges[m].add(dep)
# Tarjan
index, low, on, stack, sccs, counter = {}, {}, set(), [], [], [0]
def visit(v):
    index[v] = low[v] = counter[0]; counter[0] += 1; stack.append(v); on.add(v)
    for w in sorted(edges[v]):
        if w not in index:
            visit(w); low[v] = min(low[v], low[w])
        elif w in on:
            low[v] = min(low[v], index[w])
    if low[v] == index[v]:
        comp = []
        while True:
            w = stack.pop(); on.discard(w); comp.append(w)
            if w == v: break
        sccs.append(sorted(comp))
sys.setrecursionlimit(10000)
for v in sorted(mods):
    if v not in index: visit(v)
cycles = [c for c in sccs if len(c) > 1]
for m in sorted(edges):
    print(f"{m} -> {', '.join(sorted(edges[m])) or '-'}")
print()
if cycles:
    for c in cycles: print("CYCLE:", " <-> ".join(c))
    sys.exit(1)
print(f"no import cycles among {len(mods)} modules")
