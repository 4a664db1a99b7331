#!/usr/bin/env python3
"""Writes a linker symbol-ordering file from callgrind profiles of a binary, or checks one against a binary.

    link-order.py BINARY OUT PROFILE.cg [PROFILE.cg ...]
    link-order.py --check BINARY ORDER

Each profile comes from `valgrind --tool=callgrind --demangle=no --compress-strings=no` on BINARY. The
functions that ran are listed in profile order (the first profile's first: give the idle one first), each
profile's new functions by instructions spent, most first; names BINARY does not define are dropped. Linked
with `-Wl,--symbol-ordering-file=OUT` (lld), the code a process runs sits together at the start of `.text`
instead of spread over the whole binary, where the kernel's fault-around maps 64 KiB per touched page.
--check says how many of ORDER's names BINARY defines and how much of its text they span.
"""
import collections
import subprocess
import sys


def defined_functions(binary):
    """Each function BINARY defines: its address and size."""
    out = subprocess.run(["nm", "-S", binary], capture_output=True, text=True, check=True).stdout
    functions = {}
    for line in out.splitlines():
        parts = line.split()
        if len(parts) == 4 and parts[2] in "tTwW":
            functions[parts[3]] = (int(parts[0], 16), int(parts[1], 16))
    return functions


def check(binary, order):
    defined = defined_functions(binary)
    with open(order) as f:
        names = [line.strip() for line in f if line.strip()]
    found = [defined[n] for n in names if n in defined]
    span = max(a + s for a, s in found) - min(a for a, s in found) if found else 0
    print(f"{binary}: {len(found)} of {len(names)} ordered functions found, laid out in {span / 1e6:.2f} MB")


def self_cost(profile):
    """Instructions spent in each function itself (call costs excluded)."""
    cost = collections.Counter()
    current, after_calls = None, False
    with open(profile) as f:
        for line in f:
            if line.startswith("fn="):
                current, after_calls = line[3:].strip(), False
            elif line.startswith("calls="):
                after_calls = True
            elif current and line[:1].isdigit():
                if after_calls:
                    after_calls = False
                    continue
                parts = line.split()
                if len(parts) >= 2:
                    cost[current] += int(parts[1])
    return cost


def main():
    if len(sys.argv) == 4 and sys.argv[1] == "--check":
        check(sys.argv[2], sys.argv[3])
        return
    if len(sys.argv) < 4:
        sys.exit(__doc__)
    binary, out, profiles = sys.argv[1], sys.argv[2], sys.argv[3:]
    defined = defined_functions(binary)
    seen, order = set(), []
    for profile in profiles:
        for name, _ in self_cost(profile).most_common():
            if name in defined and name not in seen:
                seen.add(name)
                order.append(name)
    with open(out, "w") as f:
        f.writelines(name + "\n" for name in order)
    print(f"{out}: {len(order)} functions of {len(defined)}", file=sys.stderr)


if __name__ == "__main__":
    main()
