#!/usr/bin/env bash
# The project's test command (README): fetches the test model if absent, then
# runs every test of the workspace with nextest (plain `cargo test` works too).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/fetch-test-model.sh
if cargo nextest --version >/dev/null 2>&1; then
  cargo nextest run --workspace --locked --no-fail-fast "$@"
else
  cargo test --workspace --locked --no-fail-fast "$@"
fi
