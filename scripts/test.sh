#!/usr/bin/env bash
# Runs every Tether test on this machine, installing what the tests need first.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-test-deps.sh
cargo test --workspace --all-targets "$@"
