#!/usr/bin/env bash
# run_ctest.sh: runs ctest on a build directory, then says which tests did not run: the last lines
# are "tests skipped: N (name, ...)" (N = 0 when every test ran) and, for each skipped test, the
# reason it printed (its "SKIPPED (exit 77): ..." lines, tests/catch.h). A test that cannot run here
# (a disk-full case without root, a CPU path this CPU lacks) exits 77, which ctest reports as
# "Skipped" (SKIP_RETURN_CODE, CMakeLists.txt): counted here, never passed silently.
# Usage: scripts/run_ctest.sh BUILD_DIR [ctest arguments...]
# Exit status: ctest's (0 when nothing failed; skipped tests do not fail the run).
set -uo pipefail
BUILD="${1:?usage: scripts/run_ctest.sh BUILD_DIR [ctest arguments...]}"
shift
OUT="$(mktemp)"
trap 'rm -f "$OUT"' EXIT

ctest --test-dir "$BUILD" "$@" | tee "$OUT"
rc=${PIPESTATUS[0]}

# ctest lists them after "The following tests did not run:", one "<spaces>17 - NAME (Skipped)" a line.
mapfile -t not_run < <(awk '/^The following tests did not run:/ { f = 1; next }
  f && /^[[:space:]]+[0-9]+ - / { sub(/^[[:space:]]+[0-9]+ - /, ""); print; next }
  { f = 0 }' "$OUT")

# The "SKIPPED (exit 77): why" lines test NAME printed, from ctest's log of this run.
reasons() {
  awk -v name="$1" 'match($0, /^[0-9]+\/[0-9]+ Test: /) { f = substr($0, RLENGTH + 1) == name; next }
    /^<end of output>$/ { f = 0 }
    f && /^SKIPPED \(exit [0-9]+\): / { sub(/^SKIPPED \(exit [0-9]+\): /, ""); print }' \
    "$BUILD/Testing/Temporary/LastTest.log" 2>/dev/null
}

names=()
for entry in "${not_run[@]}"; do
  name="${entry% (*}"
  kind="${entry##* (}"
  kind="${kind%)}"
  [[ "$kind" == "Skipped" ]] && names+=("$name") || names+=("$name: $kind")
done
list=""
if ((${#names[@]})); then
  list="$(printf ', %s' "${names[@]}")"
  list=" (${list:2})"
fi
echo "tests skipped: ${#names[@]}$list"
for entry in "${not_run[@]}"; do
  name="${entry% (*}"
  while IFS= read -r why; do echo "  $name: $why"; done < <(reasons "$name")
done
exit "$rc"
