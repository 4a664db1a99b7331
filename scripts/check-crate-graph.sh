#!/usr/bin/env bash
# The crate graph's rules (docs/ARCHITECTURE.md): no server crate links another server crate; the `tether`
# command built without its quickstart feature links neither the test kit (sample apiserver, development issuer)
# nor guard; one TLS crypto provider (no ring in the build for this platform; Cargo.lock lists ring only for
# quinn-proto on wasm targets, which never builds here).
set -euo pipefail
cd "$(dirname "$0")/.."
servers=(tether-relay tether-agent tether-guard)
fail=0
for s in "${servers[@]}"; do
  deps=$(cargo tree -p "$s" -e normal --prefix none 2>/dev/null | grep -o '^tether-[a-z]*' | sort -u)
  for other in "${servers[@]}" tether-testkit tether-cli; do
    if [ "$other" != "$s" ] && grep -qx "$other" <<<"$deps"; then
      echo "crate graph: $s depends on $other" >&2; fail=1
    fi
  done
done
lean=$(cargo tree -p tether-cli --no-default-features -e normal --prefix none 2>/dev/null | grep -o '^tether-[a-z]*' | sort -u)
for banned in tether-testkit tether-guard; do
  if grep -qx "$banned" <<<"$lean"; then
    echo "crate graph: tether-cli without the quickstart feature links $banned" >&2; fail=1
  fi
done
if cargo tree --workspace -i ring 2>/dev/null | grep -q '^ring'; then
  echo "crate graph: ring is in the build (one crypto provider: aws-lc-rs)" >&2; fail=1
fi
[ $fail -eq 0 ] && echo "crate graph: servers independent, lean tether without testkit/guard, no ring"
exit $fail
