#!/usr/bin/env bash
# test_scripts.sh: the sweep scripts end to end on configs/tiny.yaml (short runs, one thread):
# sweep_batch.sh with a memory limit that some sizes exceed, and sweep_interval.sh; each must write
# results.csv, results.json (parsable, with rows) and PNG figures. Registered with ctest; ~30 s.
# Usage: tests/test_scripts.sh [REPO_ROOT]   (env TRAINER may name the trainer binary)
set -uo pipefail
ROOT="${1:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}"
PYTHON="${PYTHON:-${SUBLINEAR_HOME:-$HOME/.cache/sublinear}/venv/bin/python}"
export OMP_NUM_THREADS=1
TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT
passed=0 failed=0
check() {  # check NAME COMMAND...
  if "${@:2}" > "$TMP/check.log" 2>&1; then passed=$((passed + 1)); else
    failed=$((failed + 1)); echo "FAILED: $1"; tail -n 20 "$TMP/check.log"; fi
}
outputs_ok() {  # outputs_ok DIR KIND: CSV, JSON of that kind with rows, and at least one PNG
  [[ -s "$1/results.csv" && -s "$1/results.md" ]] && compgen -G "$1/*.png" > /dev/null &&
    "$PYTHON" -c 'import json,sys; d=json.load(open(sys.argv[1])); assert d["kind"]==sys.argv[2] and d["rows"], d' \
      "$1/results.json" "$2"
}

check "sweep_batch.sh runs" "$ROOT/scripts/sweep_batch.sh" configs/tiny.yaml --modes none,full --steps 2 \
  --max-batch 16 --limit 60MiB --out "$TMP/batch"
check "sweep_batch.sh outputs" outputs_ok "$TMP/batch" batch
# Under 60 MiB full checkpointing fits a larger micro-batch than none, and some size does not fit.
check "sweep_batch.sh finds the limit" "$PYTHON" -c '
import json, sys
d = json.load(open(sys.argv[1]))
assert any(not r["fits"] for r in d["rows"]), "no size failed"
assert d["largest"]["full"] > d["largest"]["none"] >= 1, d["largest"]' "$TMP/batch/results.json"
check "sweep_interval.sh runs" "$ROOT/scripts/sweep_interval.sh" configs/tiny.yaml --steps 2 --out "$TMP/interval"
check "sweep_interval.sh outputs" outputs_ok "$TMP/interval" interval
check "bad arguments exit 2" bash -c '"$1" configs/tiny.yaml --steps zero; [[ $? == 2 ]] && "$2" --bogus; [[ $? == 2 ]]' \
  _ "$ROOT/scripts/sweep_batch.sh" "$ROOT/scripts/sweep_interval.sh"
echo "$passed passed, $failed failed"
((failed == 0))
