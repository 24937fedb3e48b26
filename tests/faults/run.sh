#!/usr/bin/env bash
# run.sh: the fault harness. Each tests/faults/<name>.patch is a realistic bug in the code of a parallel
# dimension (its first lines say which and where); this script applies it to a scratch copy of the
# tree, rebuilds, runs the test cases named for it in CASES below, and says which caught it.
# Usage: tests/faults/run.sh [--control] [NAME...]   every patch, or those named (NAME or NAME.patch)
#        tests/faults/run.sh --dry-run [NAME...]     the plan: scratch tree, patches, targets, commands
#        tests/faults/run.sh --list | --help
#   --control  runs every named case on the clean copy first: a case that fails without the fault
#              catches nothing (reported as "fails clean", not counted).
# The scratch copy: ${SUBLINEAR_FAULTS_DIR:-<repo>/.faults}/tree, the working tree as it is (HEAD plus
# uncommitted changes and untracked files that git does not ignore), copied file by file where it
# differs (unchanged files keep their times, so a rebuild is incremental); its own git index holds that
# snapshot, restored after each patch. Its build, tree/build, is kept between runs and configured as
# scripts/setup.sh configures build/ (the venv's torch, Ninja, Release) with SUBLINEAR_CUDA_KERNELS=OFF.
# <repo>/.faults/ is ignored through .git/info/exclude (as bench/gpu.sh ignores .gpu/).
# Each case runs from the scratch build folder (as ctest runs it) with OMP_NUM_THREADS=1, the scratch
# trainer and sources (SUBLINEAR_TRAINER, SUBLINEAR_SOURCE_DIR), under `timeout`; logs in .faults/logs/.
# Prints a table "patch | test | caught" and a line per patch.
# Cost: the first run builds the whole scratch copy (a clean build: 10-30 min on 2 cores, less where
# ccache holds the main build's objects; ~0.8 GB); then each patch recompiles one source file and
# relinks its targets (~2-5 min) and runs its cases (~1-5 min each on 2 cores). Not a ctest entry: run
# on demand and weekly (docs/testing.md).
# Environment: SUBLINEAR_FAULTS_DIR (the scratch folder), SUBLINEAR_HOME (the venv's parent, as
# scripts/setup.sh), SUBLINEAR_FAULTS_TIMEOUT (seconds per case, default 300, ctest's), SUBLINEAR_FAULTS_JOBS
# (build jobs, default the core count).
# Exit status: 0 every patch was caught by at least one of its cases; 1 one was not (or no longer
# applies or builds); 2 bad arguments or setup (no venv with torch, a configure or clean build that
# fails, a patch without cases in CASES, a case name that matches no test case).
set -uo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
FAULTS_DIR="${SUBLINEAR_FAULTS_DIR:-$ROOT/.faults}"
TREE="$FAULTS_DIR/tree"
BUILD="$TREE/build"
LOGS="$FAULTS_DIR/logs"
VENV="${SUBLINEAR_HOME:-$HOME/.cache/sublinear}/venv"
CASE_TIMEOUT="${SUBLINEAR_FAULTS_TIMEOUT:-300}"
JOBS="${SUBLINEAR_FAULTS_JOBS:-$(nproc)}"
KILL_GRACE=10

# The cases that should catch each patch, one "binary|Catch2 test spec" a line. A spec is a test case's
# name, `*` allowed at either end; a `,`, `[`, `]` or `\` in it needs a backslash (bench/gpu.sh's
# run_cases escapes them so). Each case runs in its own process.
declare -A CASES=(
  [bucket_one_rank]="test_parallel|world 2 x micro 4 = world 1 x micro 8 = world 1 x 4 x accum 2 after 10 steps
test_parallel|buckets launch during backward*
test_parallel|every sharding stage at world 2 has world 1's loss and grad_norm at every step"
  [shard_off_by_one]="test_parallel|buckets launch during backward*
test_parallel|every sharding stage at world 2 has world 1's loss and grad_norm at every step
test_parallel|zero1/2/3 match DDP with every checkpointing mode*"
  [sequence_wrong_heads]="test_sequence|offloaded checkpointed inputs at degree 2 have degree 1's losses*
test_sequence|LLaMA (RoPE at global positions*
test_sequence|parallel.sequence 2 and 4 have degree 1's loss and grad_norm at every step*"
  [masked_loss_rank_count]="test_hf|examples: micro-batch 1 x accumulation 8*"
  [adapter_slot_off_by_one]="test_recompute|LoRA adapters on every projection*"
)

usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "${BASH_SOURCE[0]}"; }
die() { echo "faults: $1" >&2; exit "${2:-2}"; }
say() { echo "faults: $*"; }

all_patches() { local p; for p in "$HERE"/*.patch; do [[ -f "$p" ]] && basename "$p" .patch; done; }
describe() { head -n 1 "$HERE/$1.patch"; }
cases_of() { printf '%s\n' "${CASES[$1]}"; }
# The build targets of a patch: the trainer and the test executable (build/test_<name> links to it).
targets_of() { { echo trainer; cases_of "$1" | cut -d'|' -f1 | sed 's/^test_.*/sublinear_tests/'; } | awk '!seen[$0]++' | paste -sd ' '; }
slug() { tr -c 'A-Za-z0-9' '_' <<< "$1" | cut -c1-60; }

# parse_args ARGS...: DRY, CONTROL, PATCHES (checked: each has a file and an entry in CASES).
parse_args() {
  DRY=0 CONTROL=0 PATCHES=()
  while (($#)); do
    case "$1" in
      -h | --help) usage; exit 0 ;;
      --list) for p in $(all_patches); do describe "$p"; done; exit 0 ;;
      --dry-run) DRY=1 ;;
      --control) CONTROL=1 ;;
      -*) die "unknown option $1 (see tests/faults/run.sh --help)" ;;
      *) PATCHES+=("$(basename "$1" .patch)") ;;
    esac
    shift
  done
  ((${#PATCHES[@]})) || mapfile -t PATCHES < <(all_patches)
  ((${#PATCHES[@]})) || die "no patches in $HERE"
  local p
  for p in "${PATCHES[@]}"; do
    [[ -f "$HERE/$p.patch" ]] || die "no patch $p (tests/faults/run.sh --list)"
    [[ -n "${CASES[$p]:-}" ]] || die "$p.patch has no cases: add its entry to CASES in tests/faults/run.sh"
  done
}

# The compiles of the scratch copy can hit ccache entries of the main build: ccache rewrites absolute
# paths under CCACHE_BASEDIR as relative to the build folder, and <tree>/build sits in <tree> as build/
# sits in the checkout, so a source compiled with the same flags hashes the same. Set to the common
# parent of the two trees. (Sources compiled with the precompiled header, and the tests, whose
# SUBLINEAR_SOURCE_DIR and SUBLINEAR_TRAINER definitions name the scratch paths, do not hit.)
common_parent() {
  local a="${1%/}/" b="${2%/}/"
  while [[ "$b" != "$a"* ]]; do a="${a%/}" && a="${a%/*}/"; done
  echo "${a%/}"
}
export CCACHE_BASEDIR="${CCACHE_BASEDIR:-$(common_parent "$ROOT" "$TREE")}"

# ---- the scratch copy ----

# exclude_faults_dir: the scratch folder, when inside the checkout, is ignored (.git/info/exclude).
exclude_faults_dir() {
  local rel exclude
  [[ "$FAULTS_DIR/" == "$ROOT/"* ]] || return 0
  rel="${FAULTS_DIR#"$ROOT"/}"
  exclude="$(git -C "$ROOT" rev-parse --git-path info/exclude 2>/dev/null)" || die "not a git checkout: $ROOT"
  [[ "$exclude" = /* ]] || exclude="$ROOT/$exclude"
  mkdir -p "$(dirname "$exclude")"
  grep -qxF "/$rel/" "$exclude" 2>/dev/null || echo "/$rel/" >> "$exclude"
}

# The working tree's files: tracked (less those deleted) and untracked ones git does not ignore, NUL-separated.
tree_files() { git -C "$ROOT" ls-files -z --cached --others --exclude-standard; }

# git on the scratch tree's own repository, never the checkout's (the tree lies inside it).
tgit() { git --git-dir="$TREE/.git" --work-tree="$TREE" -C "$TREE" "$@"; }

# sync_tree: the scratch tree made equal to the working tree, copying only the files that differ, and
# its index set to that snapshot.
sync_tree() {
  local f list copied=0 removed=0
  mkdir -p "$TREE" || return 1
  [[ -d "$TREE/.git" ]] || git -c init.defaultBranch=faults init -q "$TREE" || return 1
  list="$(mktemp)"
  tree_files > "$list" || { rm -f "$list"; return 1; }
  while IFS= read -r -d '' f; do
    [[ -f "$ROOT/$f" ]] || continue
    cmp -s "$ROOT/$f" "$TREE/$f" && continue
    if ! mkdir -p "$TREE/$(dirname "$f")" || ! cp --preserve=mode "$ROOT/$f" "$TREE/$f"; then
      copied=-1
      break
    fi
    copied=$((copied + 1))
  done < "$list"
  ((copied >= 0)) || { rm -f "$list"; return 1; }
  # Files of an earlier snapshot the working tree no longer has.
  while IFS= read -r -d '' f; do
    rm -f "$TREE/$f" && removed=$((removed + 1))
  done < <(comm -z -23 <(tgit ls-files -z | sort -z) <(sort -z "$list"))
  rm -f "$list"
  tgit add -A || return 1
  say "scratch tree $TREE: $copied file(s) copied, $removed removed"
}

# reset_tree: the sources back to the snapshot (a patch's changes undone; build/ is ignored, kept).
reset_tree() {
  tgit checkout -q -- . && tgit clean -fdq
}

# ---- build ----

# The CMake prefix of the venv's torch (as scripts/setup.sh finds it).
torch_prefix() {
  "$VENV/bin/python" -W ignore -c "import torch.utils; print(torch.utils.cmake_prefix_path)" 2>/dev/null
}

# cmake_args PREFIX: CMAKE_ARGS, scripts/setup.sh's configure of the scratch copy, without the CUDA kernels.
cmake_args() {
  CMAKE_ARGS=(-S "$TREE" -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$1" -DSUBLINEAR_CUDA_KERNELS=OFF)
}

# configure: once; later builds re-run CMake themselves when a CMakeLists.txt changed.
configure() {
  [[ -f "$BUILD/build.ninja" ]] && return 0
  local prefix
  prefix="$(torch_prefix)" || die "no torch in $VENV: run scripts/setup.sh first"
  cmake_args "$prefix"
  # The wheel's CMake config looks for a CUDA toolkit and an architecture list (as in scripts/setup.sh).
  [[ -x /usr/local/cuda/bin/nvcc && ":$PATH:" != *":/usr/local/cuda/bin:"* ]] && export PATH="/usr/local/cuda/bin:$PATH"
  export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}"
  say "configuring $BUILD (log: $LOGS/configure.log)"
  cmake "${CMAKE_ARGS[@]}" > "$LOGS/configure.log" 2>&1 || die "configure failed: $LOGS/configure.log"
}

# build LOG TARGET...: builds the targets; 0 when they built.
build() {
  local log="$1" start=$SECONDS
  shift
  say "building $* (log: $log)"
  cmake --build "$BUILD" -j "$JOBS" --target "$@" > "$log" 2>&1 || return 1
  say "built in $((SECONDS - start)) s"
}

# ---- cases ----

# case_names BINARY SPEC: the test cases the spec selects (Catch2 2.x or 3.x), one a line.
case_names() {
  local out
  out="$("$1" "$2" --list-test-names-only 2>&1 < /dev/null)"
  if grep -qi 'unrecognised' <<< "$out"; then "$1" "$2" --list-tests --verbosity quiet < /dev/null; else echo "$out"; fi
}

case_command() {
  printf '(cd %q && OMP_NUM_THREADS=1 SUBLINEAR_TRAINER=%q SUBLINEAR_SOURCE_DIR=%q timeout -k %s %s ./%s %q --warn NoAssertions)' \
    "$BUILD" "$BUILD/trainer" "$TREE" "$KILL_GRACE" "$CASE_TIMEOUT" "$1" "$2"
}

# run_case LOG BINARY SPEC: OUTCOME = passed, failed (exit N), timed out, skipped, or no case matched.
# A binary that does not start is a setup error (exit 2), never a catch. Stdin is /dev/null: the
# callers read their list of cases from theirs.
run_case() {
  local log="$1" bin="$2" spec="$3" start=$SECONDS rc
  "$BUILD/$bin" --help > /dev/null 2>&1 < /dev/null || die "$BUILD/$bin does not start (run it by hand to see why)"
  if ! case_names "$BUILD/$bin" "$spec" | grep -q '[^[:space:]]'; then
    OUTCOME="no case matched"
    return
  fi
  (cd "$BUILD" && OMP_NUM_THREADS=1 SUBLINEAR_TRAINER="$BUILD/trainer" SUBLINEAR_SOURCE_DIR="$TREE" \
    timeout -k "$KILL_GRACE" "$CASE_TIMEOUT" "./$bin" "$spec" --warn NoAssertions) > "$log" 2>&1 < /dev/null
  rc=$?
  case $rc in
    0) OUTCOME="passed" ;;
    77) OUTCOME="skipped" ;;
    124 | 137) OUTCOME="timed out" ;;
    *) OUTCOME="failed (exit $rc)" ;;
  esac
  OUTCOME+=" $((SECONDS - start)) s"
}

# ---- the run ----

declare -A CLEAN_FAILS=()  # "binary|spec" -> 1 where --control saw it fail without a fault
ROWS=()                    # "patch|test|caught" for the table
VERDICTS=()

# control: every case of the patches on the clean copy.
control() {
  local p line bin spec t n=0 targets=()
  for p in "${PATCHES[@]}"; do read -ra t <<< "$(targets_of "$p")"; targets+=("${t[@]}"); done
  mapfile -t targets < <(printf '%s\n' "${targets[@]}" | awk '!seen[$0]++')
  build "$LOGS/clean-build.log" "${targets[@]}" || die "the clean copy does not build: $LOGS/clean-build.log"
  while IFS= read -r line; do
    bin="${line%%|*}" spec="${line#*|}"
    [[ -n "${CLEAN_FAILS[$line]:-}" ]] && continue
    n=$((n + 1))
    run_case "$LOGS/clean-$n-$(slug "$bin $spec").log" "$bin" "$spec"
    say "clean: $bin \"$spec\": $OUTCOME"
    [[ "$OUTCOME" == failed* || "$OUTCOME" == timed* ]] && CLEAN_FAILS[$line]=1
    [[ "$OUTCOME" == "no case matched" ]] && die "$bin \"$spec\" matches no test case: fix CASES"
  done < <(for p in "${PATCHES[@]}"; do cases_of "$p"; done | awk '!seen[$0]++')
}

# run_patch NAME: apply, build, run its cases, record, restore.
run_patch() {
  local name="$1" dir="$LOGS/$1" line bin spec caught=0 n=0 verdict
  mkdir -p "$dir"
  reset_tree || die "cannot restore $TREE"
  say "== $(describe "$name")"
  if ! tgit apply "$HERE/$name.patch" 2> "$dir/apply.log"; then
    ROWS+=("$name|(git apply)|no: the patch does not apply ($dir/apply.log)")
    VERDICTS+=("$name: NOT CAUGHT (does not apply)")
    return
  fi
  # shellcheck disable=SC2046  # target names hold no spaces
  if ! build "$dir/build.log" $(targets_of "$name"); then
    ROWS+=("$name|(build)|no: the patched copy does not build ($dir/build.log)")
    VERDICTS+=("$name: NOT CAUGHT (does not build)")
    reset_tree
    return
  fi
  "$BUILD/trainer" --version > /dev/null 2>&1 < /dev/null || { reset_tree; die "$BUILD/trainer does not start (run it by hand to see why)"; }
  while IFS= read -r line; do
    bin="${line%%|*}" spec="${line#*|}" n=$((n + 1))
    local log cell
    log="$dir/$n-$(slug "$bin $spec").log"
    run_case "$log" "$bin" "$spec"
    [[ "$OUTCOME" == "no case matched" ]] && { reset_tree; die "$bin \"$spec\" matches no test case: fix CASES"; }
    if [[ -n "${CLEAN_FAILS[$line]:-}" ]]; then
      cell="fails clean ($OUTCOME)"
    elif [[ "$OUTCOME" == failed* || "$OUTCOME" == timed* ]]; then
      cell="yes: $OUTCOME ($log)"
      caught=$((caught + 1))
    else
      cell="no: $OUTCOME"
    fi
    say "$bin \"$spec\": $cell"
    ROWS+=("$name|$bin \"$spec\"|$cell")
  done < <(cases_of "$name")
  verdict="caught by $caught of $n"
  ((caught)) || verdict="NOT CAUGHT (0 of $n)"
  VERDICTS+=("$name: $verdict")
  reset_tree || die "cannot restore $TREE"
}

report() {
  local row
  echo
  echo "| patch | test | caught |"
  echo "|---|---|---|"
  for row in "${ROWS[@]}"; do echo "| ${row//|/ | } |"; done
  echo
  printf '%s\n' "${VERDICTS[@]}"
}

dry_run() {
  local p line prefix
  prefix="$(torch_prefix)" || prefix="<no torch in $VENV: run scripts/setup.sh first>"
  say "dry run: nothing is copied, built or run"
  say "scratch tree: $TREE ($(tree_files | tr -cd '\0' | wc -c) files of the working tree, copied where they differ)"
  [[ "$FAULTS_DIR/" == "$ROOT/"* ]] && say "ignored through .git/info/exclude: /${FAULTS_DIR#"$ROOT"/}/"
  if [[ -f "$BUILD/build.ninja" ]]; then say "build: $BUILD (configured)"
  else cmake_args "$prefix" && say "configure: cmake ${CMAKE_ARGS[*]}"; fi
  say "CCACHE_BASEDIR=$CCACHE_BASEDIR; build jobs: $JOBS; case timeout: $CASE_TIMEOUT s"
  ((CONTROL)) && say "--control: every case below runs on the clean copy first"
  for p in "${PATCHES[@]}"; do
    echo
    say "== $(describe "$p")"
    if git -C "$ROOT" apply --check "$HERE/$p.patch" 2>/dev/null; then say "applies to the working tree: yes"
    else say "applies to the working tree: NO"; fi
    say "apply: git --git-dir=$TREE/.git --work-tree=$TREE apply $HERE/$p.patch"
    say "build: cmake --build $BUILD -j $JOBS --target $(targets_of "$p")"
    while IFS= read -r line; do say "test:  $(case_command "${line%%|*}" "${line#*|}")"; done < <(cases_of "$p")
    say "restore: the same git: checkout -- . && clean -fd (build/ is ignored: kept)"
  done
}

main() {
  parse_args "$@"
  if ((DRY)); then dry_run; exit 0; fi
  command -v cmake > /dev/null || die "cmake is needed (scripts/setup.sh)"
  command -v ninja > /dev/null || die "ninja is needed (scripts/setup.sh)"
  exclude_faults_dir
  mkdir -p "$LOGS" || die "cannot create $LOGS"
  sync_tree || die "cannot copy the working tree into $TREE"
  reset_tree || die "cannot restore $TREE"
  configure
  ((CONTROL)) && control
  local p
  for p in "${PATCHES[@]}"; do run_patch "$p"; done
  report
  for p in "${VERDICTS[@]}"; do [[ "$p" == *"NOT CAUGHT"* ]] && exit 1; done
  exit 0
}

main "$@"
