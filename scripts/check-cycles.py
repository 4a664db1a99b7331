#!/usr/bin/env python3
"""Reports import cycles between the files of each crate in the workspace.

For every workspace member, each `.rs` file under `src/` is one module (`foo.rs` and `foo/mod.rs` name `crate::foo`).
An edge A -> B is drawn when A's code names `crate::B…` (in a `use` or a path) or, inside a `use crate::{…}` group,
names B; `super::` is resolved relative to A's module; `crate::X` where lib.rs has `pub use b::X` names B; a
parent's `mod child;` line is not an edge, and `#[cfg(test)] mod` blocks are skipped. Strongly connected
components with more than one file are cycles. Exits 1 if any crate has one, 0 otherwise.

Usage: scripts/check-cycles.py [crate-dir ...]   (relative to the workspace root; default: every member of the root Cargo.toml's workspace)
"""

import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def workspace_members():
    text = open(os.path.join(ROOT, "Cargo.toml"), encoding="utf-8").read()
    m = re.search(r"members\s*=\s*\[(.*?)\]", text, re.S)
    return re.findall(r'"([^"]+)"', m.group(1)) if m else []


def strip_comments_and_strings(src):
    src = re.sub(r"/\*.*?\*/", " ", src, flags=re.S)
    src = re.sub(r"//[^\n]*", " ", src)
    src = re.sub(r'r#*"(?:.|\n)*?"#*', '""', src)
    src = re.sub(r'"(?:\\.|[^"\\])*"', '""', src)
    return src


def strip_tests(src):
    """Drops `#[cfg(test)] mod … { … }` blocks: test modules may import anything of their parent."""
    out, i = [], 0
    pattern = re.compile(r"#\[cfg\(test\)\]\s*(pub(\([^)]*\))?\s+)?mod\s+\w+\s*\{")
    while True:
        m = pattern.search(src, i)
        if not m:
            out.append(src[i:])
            return "".join(out)
        out.append(src[i : m.start()])
        depth, j = 1, m.end()
        while j < len(src) and depth:
            depth += {"{": 1, "}": -1}.get(src[j], 0)
            j += 1
        i = j


def modules(crate_dir):
    """Maps module path (tuple) -> file, for every .rs file under src/ (bin targets are their own roots)."""
    src = os.path.join(crate_dir, "src")
    mods = {}
    for dirpath, _, files in os.walk(src):
        for name in files:
            if not name.endswith(".rs"):
                continue
            rel = os.path.relpath(os.path.join(dirpath, name), src)
            parts = rel[:-3].split(os.sep)
            if parts in (["lib"], ["main"]):
                parts = [] if parts == ["lib"] else ["<main>"]
            elif parts[0] == "bin":
                parts = ["<bin>", *parts[1:]]
            elif parts[-1] == "mod":
                parts = parts[:-1]
            mods[tuple(parts)] = os.path.join(dirpath, name)
    return mods


def resolve(path, mods):
    """The longest known module prefix of `path` (a tuple of names)."""
    for n in range(len(path), 0, -1):
        if path[:n] in mods:
            return path[:n]
    return None


def expand_use_tree(tree):
    """`a::{b, c::{d}}` -> [a::b, a::c::d] (paths as lists of segments)."""
    tree = tree.strip()
    m = re.match(r"^(.*?)\{(.*)\}$", tree, re.S)
    if not m:
        return [[s.strip() for s in re.split(r"::", tree.split(" as ")[0]) if s.strip()]]
    prefix = [s for s in m.group(1).split("::") if s.strip()]
    inner, depth, parts, cur = m.group(2), 0, [], ""
    for ch in inner:
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
            continue
        depth += {"{": 1, "}": -1}.get(ch, 0)
        cur += ch
    parts.append(cur)
    out = []
    for p in parts:
        if p.strip():
            out.extend([prefix + sub for sub in expand_use_tree(p)])
    return out


def edges_of(module, src):
    """Module paths named by `src` (absolute tuples, before resolution)."""
    named = []
    for m in re.finditer(r"\buse\s+([^;]+);", src):
        for segs in expand_use_tree(m.group(1)):
            named.append(segs)
    for m in re.finditer(r"\b(crate|super)((?:::\w+)+)", src):
        named.append([m.group(1)] + [s for s in m.group(2).split("::") if s])
    out = []
    for segs in named:
        if not segs:
            continue
        if segs[0] == "crate":
            out.append(tuple(segs[1:]))
        elif segs[0] == "super":
            base = list(module)
            while segs and segs[0] == "super":
                base = base[:-1]
                segs = segs[1:]
            out.append(tuple(base + segs))
        elif segs[0] == "self":
            out.append(tuple(list(module) + segs[1:]))
    return out


def tarjan(graph):
    index, low, stack, on, sccs, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            scc = []
            while True:
                w = stack.pop()
                on.discard(w)
                scc.append(w)
                if w == v:
                    break
            sccs.append(scc)

    sys.setrecursionlimit(10000)
    for v in graph:
        if v not in index:
            visit(v)
    return sccs


def root_reexports(mods):
    """`pub use a::B;` in lib.rs: `crate::B` then names module `a` (re-exports are followed, not ignored)."""
    root = mods.get(())
    aliases = {}
    if root is None:
        return aliases
    src = strip_tests(strip_comments_and_strings(open(root, encoding="utf-8").read()))
    for m in re.finditer(r"\bpub(?:\([^)]*\))?\s+use\s+([^;]+);", src):
        for segs in expand_use_tree(m.group(1)):
            segs = segs[1:] if segs and segs[0] in ("crate", "self") else segs
            target = resolve(tuple(segs), mods)
            if len(segs) >= 2 and target:
                aliases[segs[-1]] = target
    return aliases


def check(crate_dir):
    mods = modules(crate_dir)
    aliases = root_reexports(mods)
    graph = {}
    for mod, path in mods.items():
        src = strip_tests(strip_comments_and_strings(open(path, encoding="utf-8").read()))
        targets = set()
        for named in edges_of(mod, src):
            # bin targets (main.rs, src/bin) see the library only by its crate name, never crate::.
            if mod and mod[0] in ("<main>", "<bin>"):
                continue
            target = resolve(named, mods)
            if target == () and named and named[0] in aliases:
                target = aliases[named[0]]
            # A module naming its own descendants or ancestors through the tree is not a cycle between files
            # unless the other side names it back; only the lib root (the tree's re-export hub) is ignored.
            if target is not None and target != mod and target != ():
                targets.add(target)
        graph[mod] = sorted(targets)
    return [sorted(s) for s in tarjan(graph) if len(s) > 1], mods


def main():
    dirs = [os.path.join(ROOT, m) for m in (sys.argv[1:] or workspace_members())]
    failed = False
    for d in dirs:
        name = os.path.relpath(d, ROOT)
        cycles, mods = check(d)
        if cycles:
            failed = True
            for scc in cycles:
                files = ", ".join(os.path.relpath(mods[m], ROOT) for m in scc)
                print(f"{name}: import cycle between {len(scc)} files: {files}")
        else:
            print(f"{name}: no import cycle ({len(mods)} files)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
