#!/usr/bin/env bash
# test.sh: set up and build (scripts/setup.sh), then run the test suite with ctest
# (scripts/run_ctest.sh: after ctest's report, "tests skipped: N (names)" and why each was; a test
# that cannot run on this machine is reported as skipped, never passed silently).
# Extra arguments go to ctest (e.g. -R config). Exit status: ctest's. Cost: setup.sh's cost, plus the
# tests (each has a 300 s limit; the end-to-end test trains a tiny model on the CPU).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$ROOT/scripts/setup.sh"
exec "$ROOT/scripts/run_ctest.sh" "$ROOT/build" --output-on-failure -j 2 "$@"
