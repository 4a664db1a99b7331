"""DHAT allocations per request.

dhat.py FILE NREQ bytes [MIN_PER_REQ] : sites allocating at least MIN_PER_REQ blocks per request, by bytes per request
dhat.py FILE NREQ sites [DEPTH]       : every site, grouped by its first DEPTH frames outside allocation plumbing
"""
import collections, json, re, sys

d = json.load(open(sys.argv[1]))
n = int(sys.argv[2])
mode = sys.argv[3] if len(sys.argv) > 3 else "bytes"
arg = sys.argv[4] if len(sys.argv) > 4 else None
ft = d["ftbl"]
PLUMBING = re.compile(
    r"^(alloc|core::|std::|hashbrown|<alloc|malloc|realloc|calloc|posix_memalign|__rust|<core::|<T as alloc|"
    r"~unix.rs|~alloc.rs|~raw_vec|~boxed.rs|~vec|finish_grow|grow_|allocate|~mod.rs|~spec_|with_capacity|"
    r"try_with_capacity|~bytes_mut.rs|bytes::bytes_mut|<bytes|~bytes.rs|~string.rs|~borrow|~slice|to_vec|clone|"
    r"~clone|~sync.rs|box_new|new<>|new$|pin<>|try_allocate_in|reserve|into_vec|from_elem|push|from$|from<>|"
    r"into<>|~map.rs|try_reserve|~arc.rs|~rc.rs|from_iter|collect|extend|copy_from_slice|to_owned|~iter)"
)


def name(i):
    m = re.match(r"0x[0-9A-F]+: (.*?) \((.*)\)$", ft[i])
    if not m:
        return ft[i]
    f, loc = m.groups()
    if f == "UnknownInlinedFun":
        f = "~" + loc.split("/")[-1]
    return re.sub(r"<[^<>]*(<[^<>]*(<[^<>]*>[^<>]*)*>[^<>]*)*>", "<>", f)[:90]


def frames(pp, depth):
    return " <- ".join([f for f in (name(i) for i in pp["fs"][1:]) if not PLUMBING.match(f)][:depth])


if mode == "sites":
    agg = collections.defaultdict(lambda: [0, 0])
    for pp in d["pps"]:
        k = frames(pp, int(arg or 3))
        agg[k][0] += pp["tbk"]
        agg[k][1] += pp["tb"]
    rows = sorted(((b / n, by / n, k) for k, (b, by) in agg.items()), reverse=True)
    print(f"total blocks/req {sum(r[0] for r in rows):.1f}")
    for b, by, k in rows:
        if b < 0.04:
            break
        print(f"{b:5.2f}/req {by / b:7.0f} B  {k[:260]}")
else:
    mn = float(arg or 0.5)
    rows = [(pp["tb"] / pp["tbk"], pp["tbk"] / n, pp["tb"] / n, frames(pp, 3)) for pp in d["pps"] if pp["tbk"] / n >= mn]
    print(f"sites >= {mn}/req: blocks/req {sum(r[1] for r in rows):.1f} bytes/req {sum(r[2] for r in rows):.0f}")
    big = [r for r in rows if r[0] > 1024]
    print(f"of which > 1 KiB: blocks/req {sum(r[1] for r in big):.2f} bytes/req {sum(r[2] for r in big):.0f}")
    for avg, bk, b, f in sorted(rows, key=lambda r: -r[2])[:40]:
        print(f"avg {avg:7.0f} B  {bk:5.2f}/req  {b:7.0f} B/req  {f[:200]}")
