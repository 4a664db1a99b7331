#!/usr/bin/env bash
# Checks that cluster-agent/link-order.txt was written for the release agent this tree builds.
#
#   bash scripts/check-link-order.sh           # fails when the order is stale (CI runs this)
#   bash scripts/check-link-order.sh --write   # records the current build's inputs (scripts/link-order.sh does)
#
# The order names the agent's functions by their mangled symbols. Their hashes come from the crate that
# instantiates them and its `-C metadata`, which cargo derives from the dependency graph and the compiler, not
# from the source. So when the agent's dependency tree changes (a crate added to one the agent uses, a version,
# a feature) or the toolchain does, nearly every name changes, the linker finds few of them, and the idle agent
# grows by about 4 MB (docs/BENCHMARKS.md, twenty-fifth pass) with nothing failing. This records the inputs
# that decide the names (`cluster-agent/link-order.deps`): the compiler's version and a digest of the agent's
# dependency tree, edges and features included, as `cargo build --release -p tether-agent --bin tether-agent`
# resolves it. A change to the agent's own code renames only what it touches; `python3 scripts/link-order.py
# --check BINARY cluster-agent/link-order.txt` reports how much of the order a built binary matches.
set -euo pipefail
shopt -s inherit_errexit
cd "$(dirname "$0")/.."
record=cluster-agent/link-order.deps

current() {
  local tree
  # --prefix depth keeps the edges (a crate that gains a dependency it already had elsewhere in the tree);
  # path dependencies print their absolute path, which differs between checkouts and is dropped.
  tree=$(cargo tree --locked -p tether-agent -e normal,build --target x86_64-unknown-linux-gnu \
    --prefix depth -f '{p} {f}' | sed -E 's/ \(\/[^)]*\)//')
  rustc -V
  echo "dependencies $(printf '%s\n' "$tree" | sha256sum | cut -d' ' -f1)"
}

case "${1:-}" in
  --write)
    {
      echo "# What cluster-agent/link-order.txt was written against (scripts/check-link-order.sh)."
      current
    } > "$record"
    echo "wrote $record"
    ;;
  "")
    want=$(grep -v '^#' "$record" 2>/dev/null || true)
    have=$(current)
    if [ "$want" != "$have" ]; then
      echo "cluster-agent/link-order.txt is stale: it was written for another dependency tree or compiler." >&2
      echo "recorded ($record):" >&2
      printf '%s\n' "${want:-nothing}" | sed 's/^/  /' >&2
      echo "this tree:" >&2
      printf '%s\n' "$have" | sed 's/^/  /' >&2
      echo "The release agent's function names no longer match the order, and an idle agent grows by about" >&2
      echo "4 MB. Run 'bash scripts/link-order.sh' (needs valgrind) and commit both files." >&2
      exit 1
    fi
    echo "link order: written for this dependency tree and compiler"
    ;;
  *)
    echo "usage: $0 [--write]" >&2
    exit 64
    ;;
esac
