#!/usr/bin/env bash
# test.sh: set up and build (scripts/setup.sh), then run the test suite with ctest.
# Extra arguments go to ctest (e.g. -R config). Cost: setup.sh's cost, plus the tests
# (each has a 300 s limit; the end-to-end test trains a tiny model on the CPU).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$ROOT/scripts/setup.sh"
exec ctest --test-dir "$ROOT/build" --output-on-failure -j 2 "$@"
