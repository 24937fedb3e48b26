#!/usr/bin/env bash
# gpu.sh: the one prepared command for a lent GPU machine (one that has the working tree and a CUDA
# build of torch 2.11 but not this project's build). A loan takes two calls of the device tool, each
# with carry [".gpu"] and within its 600 s: `bench/gpu.sh cases`, then `bench/gpu.sh figures`.
#   bench/gpu.sh pack   here, after building: copies build/trainer, the test binaries that hold [cuda]
#                       cases and the shared libraries they need that torch and CUDA do not bring
#                       (yaml-cpp, spdlog, fmt, ICU, protobuf-lite, zlib; libcudart as a fallback),
#                       stripped, into .gpu/pack.tar.xz (.gpu/ is ignored through .git/info/exclude),
#                       and prints its size. It refuses (exit 2) a build whose `trainer --version` does
#                       not say "CUDA kernels: yes" (the fused CUDA kernels, built where CMake finds a
#                       CUDA compiler), unless SUBLINEAR_PACK_WITHOUT_KERNELS=1.
#   bench/gpu.sh cases [--budget SECONDS] [--only REGEX]   there, call 1: unpacks the pack, finds the
#                       torch libraries of the Python that holds torch, checks that torch is the version
#                       the binaries were built against and, with a CUDA device here, that the trainer
#                       has the fused CUDA kernels; then runs every [cuda] case of every packed test
#                       binary, one at a time, each under its own fixed timeout (CASE_TIMEOUTS: 150 s
#                       for the heavy cases named there, 120 s for the others). A case starts only when
#                       its timeout and 10 s to stop it fit in what is left of the budget (default 540 s,
#                       counted from the call's start); the others are recorded as not run. It writes
#                       bench/results/gpu-<date>.md: each case's result, seconds and timeout, the cases
#                       that skipped (exit 77) while a CUDA device was here listed apart with their
#                       reasons (a [cuda] case skips only for what the machine lacks, such as a second
#                       GPU: each needs a look), with each case's log beside it (gpu-<date>-logs/).
#   bench/gpu.sh figures [--budget SECONDS] [--only REGEX]   there, call 2: the same checks, then
#                       measures issue 53's targets, one part each, most important first, each under its
#                       share of the budget (default 480 s) cut to what is left: GPT-2 124M bf16
#                       (configs/gpt2_124m.yaml, 8 x 1024 tokens x 8 micro-batches) in the trainer; the
#                       same under torch.compile (bench/compiled_gpt.py, the image's torch); the trainer
#                       with checkpointing full and selective; configs/1b_24gb.yaml; the pinned copy
#                       rates and overlap (bench/offload_bw.py: the values of offload.bandwidth_gbps and
#                       offload.overlap, which the 7B parts then use); `trainer plan` and 3 steps of
#                       configs/7b_24gb.yaml under memory.limit 24GB. It writes
#                       bench/results/gpu-<date>-figures.md: the targets (bench/gpu_targets.py: measured,
#                       bound, met / not met / skipped / timed out), the figures (tokens/s, MFU, the
#                       planner's peak against the caching allocator's), each part's result, with the raw
#                       logs and run folders beside it (gpu-<date>-figures-logs/). A part cut short by
#                       its timeout leaves the steps it ran, and the targets use them (marked partial).
#                       Without a GPU every part is recorded as skipped (and the cases skip themselves).
#   bench/gpu.sh schedule [--budget SECONDS]   prints both calls' plans: the cases' timeout rule and
#                       each part's timeout, under that budget (default: each call's own).
# Both calls rewrite their report after each case or part and, with $OUT set, copy it and their logs
# (gpu-<date>[-figures]-logs.tar.gz) there, so that a call cut short still returns what it ran. A
# report's name gains the time after the date (gpu-<date>-<HHMM>...) when that day's exists.
# --only REGEX: run only the cases (named "<binary>: <case name>") or the parts whose name matches.
# Environment: BUILD_DIR (pack; default build), SUBLINEAR_PACK_WITHOUT_KERNELS (pack: 1 packs a build
# without the fused CUDA kernels, for a machine without a GPU), SUBLINEAR_PYTHON (the Python that holds
# torch; default the setup venv's if present, else python3).
# Exit status: 0 every case or part passed or was skipped (a case skipped while a CUDA device was here
# still counts as skipped; the report lists it apart); 1 one failed, timed out or did not start within
# the budget; 2 bad arguments or setup (no pack, torch of another version, a library not found, a build
# without the fused CUDA kernels on a machine with a CUDA device: then nothing runs).
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PACK_DIR="$ROOT/.gpu"
PACK="$PACK_DIR/pack.tar.xz"
CASES_BUDGET=540    # call 1's default: within the device tool's 600 s a call, with room for the report
FIGURES_BUDGET=480  # call 2's default: the parts' shares were sized on it
KILL_GRACE=10       # seconds `timeout` gives a case or part to die after SIGTERM before SIGKILL

usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "${BASH_SOURCE[0]}"; }
die() { echo "gpu.sh: $1" >&2; exit "${2:-2}"; }

python_with_torch() {
  local venv="${SUBLINEAR_HOME:-$HOME/.cache/sublinear}/venv/bin/python"
  if [[ -n "${SUBLINEAR_PYTHON:-}" ]]; then echo "$SUBLINEAR_PYTHON"
  elif [[ -x "$venv" ]]; then echo "$venv"
  else echo python3; fi
}

# has_kernels VERSION_TEXT: whether `trainer --version` says the fused CUDA kernels are built in.
has_kernels() { grep -qxF 'CUDA kernels: yes' <<< "$1"; }
kernels_line() { grep -m1 '^CUDA kernels:' <<< "$1" || echo 'no "CUDA kernels:" line'; }
REBUILD="rebuild where CMake finds a CUDA compiler (nvcc on PATH or CMAKE_CUDA_COMPILER;"
REBUILD+=" -DSUBLINEAR_CUDA_KERNELS=ON, the default) and pack again"

# ---- pack ----

# The test binaries that hold a [cuda] case, from the sources: test_<name> for tests/test_<name>.cpp.
cuda_tests() {
  grep -l '"\[cuda\]"' "$ROOT"/tests/test_*.cpp 2>/dev/null | sed 's|.*/tests/\(test_[a-z0-9_]*\)\.cpp|\1|' | sort
}

# The libraries a binary loads that neither torch's lib folder nor the base system provides.
carried_libs() {
  ldd "$1" | awk '/=> \// {print $3}' | grep -v -E '/torch/lib/|/libc\.so|/libm\.so|/libpthread|/libdl\.so|/librt\.so|/libutil\.so|/ld-linux|/libgcc_s|/libstdc\+\+'
}

# check_pack_kernels VERSION_TEXT: the fused CUDA kernels are what a GPU run is for; a build without
# them is packed only with SUBLINEAR_PACK_WITHOUT_KERNELS=1 (cases and figures refuse it on a GPU).
check_pack_kernels() {
  has_kernels "$1" && return 0
  if [[ "${SUBLINEAR_PACK_WITHOUT_KERNELS:-}" == 1 ]]; then
    echo "gpu.sh: packing a build without the fused CUDA kernels ($(kernels_line "$1")) as" \
      "SUBLINEAR_PACK_WITHOUT_KERNELS=1 asks: cases and figures refuse it where a CUDA device is" >&2
    return 0
  fi
  die "the build lacks the fused CUDA kernels (trainer --version: $(kernels_line "$1")): $REBUILD, or set \
SUBLINEAR_PACK_WITHOUT_KERNELS=1 to pack it for a machine without a GPU"
}

do_pack() {
  local build="${BUILD_DIR:-$ROOT/build}" stage bin lib version t
  [[ -x "$build/trainer" ]] || die "no $build/trainer: build first (scripts/setup.sh, or cmake --build build)"
  version="$("$build/trainer" --version)" || die "$build/trainer --version failed"
  check_pack_kernels "$version"
  local bins=("$build/trainer")
  for t in $(cuda_tests); do
    [[ -x "$build/$t" ]] || die "no $build/$t: build it first (cmake --build build --target sublinear_tests)"
    bins+=("$build/$t")
  done
  local exclude
  exclude="$(git -C "$ROOT" rev-parse --git-path info/exclude 2>/dev/null)" || die "not a git checkout: $ROOT"
  [[ "$exclude" = /* ]] || exclude="$ROOT/$exclude"
  mkdir -p "$(dirname "$exclude")"
  grep -qxF '/.gpu/' "$exclude" 2>/dev/null || echo '/.gpu/' >> "$exclude"
  stage="$(mktemp -d)"
  mkdir -p "$stage/bin" "$stage/lib"
  # test_<name> is a link to the one test executable (tests/main.cpp): packed once, linked by name.
  local real
  for bin in "${bins[@]}"; do
    real="$(readlink -f "$bin")"
    if [[ ! -e "$stage/bin/$(basename "$real")" ]]; then
      strip --strip-unneeded -o "$stage/bin/$(basename "$real")" "$real" || die "strip $real failed"
      for lib in $(carried_libs "$real"); do cp -Ln "$lib" "$stage/lib/" 2>/dev/null; done
    fi
    [[ "$(basename "$real")" == "$(basename "$bin")" ]] || ln -s "$(basename "$real")" "$stage/bin/$(basename "$bin")"
  done
  { echo "commit $(git -C "$ROOT" rev-parse HEAD)$(git -C "$ROOT" diff --quiet HEAD 2>/dev/null || echo ' (with uncommitted changes)')"
    echo "packed $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(uname -n)"
    echo "$version"
  } > "$stage/MANIFEST"
  rm -rf "$PACK_DIR" && mkdir -p "$PACK_DIR"
  tar -C "$stage" -cJf "$PACK" MANIFEST bin lib || die "tar failed"
  echo "packed into $PACK:"
  (cd "$stage" && find bin lib -type f -o -type l | sort | sed 's/^/  /')
  echo "unpacked $(du -sh "$stage" | cut -f1); $PACK: $(du -h "$PACK" | cut -f1)"
  local tree
  tree=$(git -C "$ROOT" ls-files -z --cached --others --exclude-standard | (cd "$ROOT" && du -cb --files0-from=- 2>/dev/null) | tail -1 | cut -f1)
  echo "the working tree that travels: $((tree / 1024 / 1024)) MiB + the pack $(( $(stat -c %s "$PACK") / 1024 / 1024 )) MiB (limit 64 MiB)"
  rm -rf "$stage"
}

# ---- there: what both calls do first ----

# parse_options COMMAND DEFAULT_BUDGET ARGS...: BUDGET, ONLY and ARGS_TEXT (for the report).
parse_options() {
  local command="$1"
  BUDGET=$2 ONLY=""
  shift 2
  ARGS_TEXT="$*"
  while (($#)); do
    case "$1" in
      --budget) [[ "${2:-}" =~ ^[0-9]+$ ]] || die "--budget needs a number of seconds"; BUDGET=$2; shift 2 ;;
      --only) [[ -n "${2:-}" ]] || die "--only needs a regular expression"; ONLY=$2; shift 2 ;;
      *) die "unknown argument to $command: $1 (see bench/gpu.sh --help)" ;;
    esac
  done
}

unpack() {
  [[ -s "$PACK" ]] || die "no $PACK: run 'bench/gpu.sh pack' on the build machine and carry .gpu"
  WORK="$(mktemp -d)"
  # tar needs the xz program for -J; Python's tarfile module has its own.
  tar -C "$WORK" -xJf "$PACK" 2>/dev/null ||
    "$PY" -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])' "$PACK" "$WORK" ||
    die "unpacking $PACK failed"
}

# TORCH_DIR, TORCH_RELEASE (2.11.0) and TORCH_VERSION (for the report), from one import of torch.
torch_facts() {
  local facts
  facts="$("$PY" -c 'import os, torch
print(os.path.dirname(torch.__file__)); print(torch.__version__.split("+")[0]); print(torch.__version__, "CUDA", torch.version.cuda)' 2>/dev/null)" ||
    die "$PY cannot import torch: set SUBLINEAR_PYTHON to the Python that holds torch 2.11"
  { read -r TORCH_DIR; read -r TORCH_RELEASE; read -r TORCH_VERSION; } <<< "$facts"
}

# LD_LIBRARY_PATH: torch's lib folder and the NVIDIA wheels' beside it (cuDNN, cuBLAS, NCCL, the CUDA
# runtime), then the pack's libraries.
library_path() {
  local dirs="$TORCH_DIR/lib" d
  for d in $(find "$(dirname "$TORCH_DIR")/nvidia" -maxdepth 3 -type d -name lib 2>/dev/null | sort); do dirs="$dirs:$d"; done
  export LD_LIBRARY_PATH="$dirs:$WORK/lib"
}

# The image's torch must be the LibTorch the binaries were built against (they link it by soname).
check_torch() {
  local built
  built="$(sed -n 's/^LibTorch \([0-9.]*\).*/\1/p' "$WORK/MANIFEST")"
  [[ -n "$built" && "$built" == "$TORCH_RELEASE" ]] ||
    die "torch here is $TORCH_RELEASE, the binaries were built against LibTorch $built"
}

# With a CUDA device here the packed trainer must have the fused CUDA kernels: without them the cases
# and the figures would test and time ATen's kernels in their place.
check_kernels() {
  ((CUDA_DEVICES > 0)) || return 0
  has_kernels "$VERSION" ||
    die "the packed build lacks the fused CUDA kernels (trainer --version: $(kernels_line "$VERSION")): \
$REBUILD; nothing was run"
}

# open_results SUFFIX: REPORT, bench/results/gpu-<date>SUFFIX.md (gpu-<date>-<HHMM>SUFFIX.md when that
# exists), and LOGS beside it (…-logs/, with parts.tsv and the trainer's --version).
open_results() {
  local results="$ROOT/bench/results" stamp
  stamp="gpu-$(date -u +%Y-%m-%d)"
  [[ -e "$results/$stamp$1.md" ]] && stamp="$stamp-$(date -u +%H%M)"
  REPORT="$results/$stamp$1.md" LOGS="$results/$stamp$1-logs"
  mkdir -p "$LOGS/runs" || die "cannot write $LOGS"
  : > "$LOGS/parts.tsv"
  echo "$VERSION" > "$LOGS/trainer-version.txt"
}

# prepare COMMAND REPORT_SUFFIX: the pack unpacked, torch's libraries found and checked, the trainer's
# --version (VERSION, CUDA_DEVICES), the kernels checked, the report's place; the budget counts from here.
prepare() {
  START=$(date +%s) FAILED=0 FINISHED=0 RESULTS=()
  DEADLINE=$((START + BUDGET)) COMMAND="$1"
  PY="$(python_with_torch)"
  unpack
  trap 'rm -rf "$WORK"' EXIT
  torch_facts
  library_path
  check_torch
  VERSION="$("$WORK/bin/trainer" --version 2>&1)" || { echo "$VERSION"; ldd "$WORK/bin/trainer" | grep 'not found'; die "the packed trainer does not start here"; }
  CUDA_DEVICES="$(echo "$VERSION" | sed -n 's/.*devices here \([0-9]*\).*/\1/p')"
  CUDA_DEVICES="${CUDA_DEVICES:-0}"
  check_kernels
  open_results "$2"
}

# NAME of a part -> a file name.
slug() { echo "$1" | tr -c 'A-Za-z0-9\n' '_' | tr -s '_' | cut -c1-80; }

# record KEY NAME RESULT SECONDS NOTE [TIMEOUT]: one case's or part's line in the report and in parts.tsv.
record() {
  RESULTS+=("$2|$3|$4|${6:-}|${5//|//}")
  printf '%s\t%s\t%s\t%s\t%s\n' "$1" "$3" "$4" "${2//$'\t'/ }" "${5//$'\t'/ }" >> "$LOGS/parts.tsv"
}

# run_part KEY NAME TIMEOUT COMMAND...: runs it in $WORK under `timeout TIMEOUT` (KILL_GRACE more to die
# after SIGTERM), logs it to KEY.log, records its result and runtime, and publishes the report so far.
run_part() {
  local key="$1" name="$2" limit="$3" log rc t0 t1 result note=""
  shift 3
  log="$LOGS/$key.log"
  echo "== $name (timeout ${limit} s)"
  t0=$(date +%s%N)
  (cd "$WORK" && timeout -k "$KILL_GRACE" "$limit" "$@") > "$log" 2>&1
  rc=$?
  t1=$(date +%s%N)
  # Paths relative to the checkout (the binaries name their sources by the build machine's paths).
  sed -i -E -e "s#$WORK/#<work>/#g" -e 's#/[^ :"]*/(tests|src|configs|bench|scripts)/#\1/#g' "$log"

  local secs
  secs="$(awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.1f", (b - a) / 1e9 }')"
  case $rc in
    0) result=passed ;;
    77) result=skipped; note="$(sed -n 's/^SKIPPED (exit 77): //p' "$log" | sort -u | paste -sd ';')" ;;
    124|137) result="timed out"; FAILED=1 ;;
    *) result="failed (exit $rc)"; FAILED=1 ;;
  esac
  [[ $rc == 0 || $rc == 77 ]] || note="$(grep -m1 -E 'FAILED|error|Error' "$log" | cut -c1-160)"
  record "$key" "$name" "$result" "$secs" "$note" "$limit"
  echo "   $result ($secs s)"
  publish
}

# publish: rewrites the report (REPORT_WRITER's output) and, with $OUT set, copies it and the logs
# there: after every case or part, so that a call cut short by the device tool still returns its results.
publish() {
  "$REPORT_WRITER" > "$REPORT.tmp" && mv "$REPORT.tmp" "$REPORT"
  [[ -n "${OUT:-}" ]] || return 0
  local logs
  logs="$(basename "$LOGS")"
  cp "$REPORT" "$OUT/" &&
    tar -C "$(dirname "$LOGS")" -czf "$OUT/$logs.tar.gz.tmp" "$logs" && mv "$OUT/$logs.tar.gz.tmp" "$OUT/$logs.tar.gz"
}

# finish: the report's last version, printed; the call's exit status.
finish() {
  FINISHED=1
  publish
  cat "$REPORT"
  return "$FAILED"
}

# report_header: the machine, the binaries, the command and its budget.
report_header() {
  local gpu driver wall
  gpu="$(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null | head -1)"
  driver="$(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null | head -1)"
  wall="wall time $(( $(date +%s) - START )) s"
  ((FINISHED)) || wall="$wall so far (written while the call ran)"
  echo "# GPU run: bench/gpu.sh $COMMAND"
  echo
  echo "- GPU: ${gpu:-none (nvidia-smi found no GPU)}; driver ${driver:-none}; CUDA devices the trainer sees: $CUDA_DEVICES"
  echo "- host: $(uname -n), $(nproc) CPUs; torch here: $TORCH_VERSION"
  echo "- binaries: $(sed -n 1p "$WORK/MANIFEST"); $(sed -n 2p "$WORK/MANIFEST")"
  echo "- $(sed -n 's/^sublinear trainer/trainer/p' "$WORK/MANIFEST"); $(kernels_line "$VERSION")"
  echo "- date: $(date -u -d "@$START" +%Y-%m-%dT%H:%M:%SZ); command: \`bench/gpu.sh $COMMAND${ARGS_TEXT:+ $ARGS_TEXT}\` (budget ${BUDGET} s); $wall"
}

# results_table: every recorded case or part, in the order run.
results_table() {
  local r
  echo "| $1 | result | seconds | timeout s | note |"
  echo "| --- | --- | --- | --- | --- |"
  for r in "${RESULTS[@]}"; do echo "| ${r//|/ | } |"; done
}

# ---- cases (call 1) ----

# Catch2 2.x: --list-test-names-only (its exit status is the number listed); 3.x: --list-tests
# --verbosity quiet (2.x's option is unknown there).
case_names() {
  local out
  out="$("$1" "[cuda]" --list-test-names-only 2>&1)"
  if grep -qi 'unrecognised' <<< "$out"; then "$1" "[cuda]" --list-tests --verbosity quiet; else echo "$out"; fi
}

# Each case's timeout in seconds, fixed: the first entry whose text its name holds, else
# CASE_TIMEOUT_DEFAULT.
CASE_TIMEOUTS=(
  "150 predicted peaks"                # test_device's planner case: GPT-2 124M seven times
  "150 every checkpointing mode"       # test_gpu's dropout case: every mode, fp32 and bf16
  "150 captured micro-batch replayed"  # test_train's train.cuda_graphs case: 9 tiny runs
)
CASE_TIMEOUT_DEFAULT=120
case_timeout() {
  local entry
  for entry in "${CASE_TIMEOUTS[@]}"; do
    [[ "$1" == *"${entry#* }"* ]] && { echo "${entry%% *}"; return; }
  done
  echo "$CASE_TIMEOUT_DEFAULT"
}

# run_case KEY NAME COMMAND...: a case under its own timeout, started only when that timeout and
# KILL_GRACE fit in what is left of the budget; otherwise recorded as not run (never cut shorter).
run_case() {
  local key="$1" name="$2" limit left
  shift 2
  limit="$(case_timeout "$name")" left=$((DEADLINE - $(date +%s)))
  if ((limit + KILL_GRACE > left)); then
    record "$key" "$name" "not run" 0 "its timeout and ${KILL_GRACE} s to stop it did not fit in the ${left} s left of ${BUDGET} s" "$limit"
    FAILED=1
    return
  fi
  run_part "$key" "$name" "$limit" "$@"
}

run_cases() {
  local bin name escaped found=0 n=0
  for bin in "$WORK"/bin/test_*; do
    [[ -x "$bin" ]] || continue
    found=1
    while IFS= read -r name; do
      [[ -n "$name" ]] || continue
      [[ -z "$ONLY" || "$(basename "$bin"): $name" =~ $ONLY ]] || continue
      n=$((n + 1))
      escaped="$(printf '%s' "$name" | sed 's/[][,*\\]/\\&/g')"
      run_case "case_$(printf '%02d' "$n")_$(slug "$(basename "$bin")_$name")" "$(basename "$bin"): $name" \
        env SUBLINEAR_SOURCE_DIR="$ROOT" SUBLINEAR_TRAINER="$WORK/bin/trainer" SUBLINEAR_PYTHON="$PY" \
        "$bin" "$escaped" --warn NoAssertions
    done < <(case_names "$bin")
  done
  ((found)) || record case_none "[cuda] test cases" skipped 0 "the pack holds no test binaries"
}

# cases_report: the counts, the cases skipped while a CUDA device was here (apart), every case.
cases_report() {
  report_header
  echo
  echo "## [cuda] test cases"
  echo
  if ((${#RESULTS[@]} == 0)); then
    echo "No case ran${ONLY:+ (none matched --only)}."
  else
    printf '%s\n' "${RESULTS[@]}" | cut -d'|' -f2 | sort | uniq -c |
      awk '{ n = $1; $1 = ""; sub(/^ /, ""); printf "%s%d %s", (NR > 1 ? ", " : ""), n, $0 } END { print " (timeouts fixed per case; a case starts only when its timeout fits in what is left)" }'
  fi
  local r skipped=()
  for r in "${RESULTS[@]}"; do [[ "$(cut -d'|' -f2 <<< "$r")" == skipped ]] && skipped+=("$r"); done
  if ((CUDA_DEVICES > 0 && ${#skipped[@]} > 0)); then
    echo
    echo "### Skipped with a CUDA device here (${#skipped[@]})"
    echo
    echo "A [cuda] case skips only for what this machine lacks (a second GPU for NCCL at world 2): each needs a look."
    echo
    for r in "${skipped[@]}"; do echo "- $(cut -d'|' -f1 <<< "$r"): $(cut -d'|' -f5- <<< "$r")"; done
  fi
  echo
  results_table case
  echo
  echo "Raw logs: $(basename "$LOGS")/ beside this file (one per case, in the order run)."
}

do_cases() {
  parse_options cases "$CASES_BUDGET" "$@"
  REPORT_WRITER=cases_report
  prepare cases ""
  run_cases
  finish
}

# ---- figures (call 2): the target parts ----

# The parts that measure issue 53's targets, in the order they run (most important first):
# KEY, its share of the budget in per cent, its name. What the shares leave (7 %) is for unpacking,
# bench/gpu_targets.py and the report.
PARTS=(
  "gpt2_none 8 GPT-2 124M bf16: the trainer, checkpointing none"
  "baseline 26 GPT-2 124M bf16: torch.compile baseline (bench/compiled_gpt.py)"
  "gpt2_full 6 GPT-2 124M bf16: the trainer, checkpointing full"
  "gpt2_selective 6 GPT-2 124M bf16: the trainer, checkpointing selective [attention, mlp, norm]"
  "llama_1b 11 LLaMA 1B (configs/1b_24gb.yaml): the trainer, 8 steps of 4 micro-batches"
  "offload_bw 3 host <-> device copies: pinned rates and the share a GEMM hides (bench/offload_bw.py)"
  "plan_7b 3 LLaMA 7B (configs/7b_24gb.yaml, memory.limit 24GB): trainer plan"
  "run_7b 30 LLaMA 7B (configs/7b_24gb.yaml, memory.limit 24GB): the trainer, 3 steps"
)
part_field() {  # part_field KEY 2|3: the share or the name of a part
  local p key share name
  for p in "${PARTS[@]}"; do
    read -r key share name <<< "$p"
    [[ "$key" == "$1" ]] || continue
    if [[ "$2" == 2 ]]; then echo "$share"; else echo "$name"; fi
    return
  done
  die "no part $1" 3
}
part_timeout() { echo $((BUDGET * $(part_field "$1" 2) / 100)); }

# figure_part KEY COMMAND...: a part under its share of the budget, cut to what is left; recorded as
# not run when 5 s or less are left.
figure_part() {
  local key="$1" name limit left
  shift
  name="$(part_field "$key" 3)" limit="$(part_timeout "$key")" left=$((DEADLINE - $(date +%s)))
  if ((left <= 5)); then record "$key" "$name" "not run" 0 "the budget of ${BUDGET} s was spent" "$limit"; FAILED=1; return; fi
  ((limit > left)) && limit=$left
  run_part "$key" "$name" "$limit" "$@"
}

# needs_cuda KEY: records the part as skipped without a CUDA device; false then, or when --only leaves it out.
needs_cuda() {
  local name
  name="$(part_field "$1" 3)"
  [[ -z "$ONLY" || "$name" =~ $ONLY ]] || return 1
  ((CUDA_DEVICES > 0)) && return 0
  record "$1" "$name" skipped 0 "no CUDA device here" "$(part_timeout "$1")"
  return 1
}

# trainer_part KEY CONFIG [--set ...]: a trainer run in the checkout, its run folder runs/KEY in the logs.
trainer_part() {
  local key="$1" config="$2"
  shift 2
  needs_cuda "$key" || return 0
  figure_part "$key" bash -c 'cd "$0" && exec "$@"' "$ROOT" \
    "$WORK/bin/trainer" --config "$config" --set state.at_end=false --set state.on_signal=false \
    --set logging.save_model=false --set logging.progress=false --set logging.interval=1 --set train.eval_interval=0 \
    --set logging.dir="$LOGS/runs/$key" "$@"
}

# The trainer's own peak (summary.json of the GPT-2 run: its datasheet for this GPU), in TFLOP/s.
trainer_peak_tflops() {
  local s="$LOGS/runs/gpt2_none/summary.json"
  [[ -s "$s" ]] && "$PY" -c 'import json, sys; print(json.load(open(sys.argv[1]))["model"]["peak_flops"] / 1e12)' "$s" 2>/dev/null
}

# GPT-2 124M as configs/gpt2_124m.yaml has it (8 x 1024 tokens, 8 micro-batches), bf16, 8 steps (the
# medians leave out the first 3, logging.skip_first).
GPT2=(configs/gpt2_124m.yaml --set train.device=cuda --set precision.compute=bf16 --set train.steps=8)

run_targets() {
  local peak sets=()
  OMP_NUM_THREADS=1 trainer_part gpt2_none "${GPT2[@]}" --set checkpointing.mode=none
  peak="$(trainer_peak_tflops)"
  if needs_cuda baseline; then
    figure_part baseline "$PY" "$ROOT/bench/compiled_gpt.py" \
      --device cuda --n-layer 12 --n-head 12 --n-embd 768 --vocab 50257 --seq-len 1024 --micro-batch 8 \
      --grad-accum 8 --warmup 3 --steps 10 ${peak:+--peak-tflops "$peak"} --out "$LOGS/runs/baseline.json"
  fi
  OMP_NUM_THREADS=1 trainer_part gpt2_full "${GPT2[@]}" --set checkpointing.mode=full
  OMP_NUM_THREADS=1 trainer_part gpt2_selective "${GPT2[@]}" --set checkpointing.mode=selective \
    --set 'checkpointing.recompute=[attention, mlp, norm]'
  trainer_part llama_1b configs/1b_24gb.yaml --set train.steps=8 --set train.grad_accum=4
  # The 7B plan and run priced at this GPU's peak (the recipe names an RTX 4090's), as the trainer reports it,
  # and at its measured copy rate and overlap (offload.bandwidth_gbps, offload.overlap) when offload_bw ran.
  [[ -n "$peak" ]] && sets=(--set logging.peak_tflops="$peak")
  if needs_cuda offload_bw; then
    figure_part offload_bw "$PY" "$ROOT/bench/offload_bw.py" --out "$LOGS/runs/offload_bw.json"
    [[ -s "$LOGS/runs/offload_bw.json" ]] && sets+=($("$PY" -c 'import json, sys
r = json.load(open(sys.argv[1]))
print("--set offload.bandwidth_gbps=%.1f --set offload.overlap=%.2f" % (r["bandwidth_gbps"], r["overlap"]))' \
      "$LOGS/runs/offload_bw.json" 2>/dev/null))
  fi
  if needs_cuda plan_7b; then
    figure_part plan_7b bash -c 'cd "$0" && exec "$@"' "$ROOT" \
      "$WORK/bin/trainer" plan --config configs/7b_24gb.yaml --set memory.limit=24GB "${sets[@]}" \
      --out "$LOGS/runs/plan_7b.json"
  fi
  trainer_part run_7b configs/7b_24gb.yaml --set memory.limit=24GB --set train.steps=3 --set logging.skip_first=1 \
    "${sets[@]}"
}

# figures_report: the targets (bench/gpu_targets.py), the figures, every part.
figures_report() {
  report_header
  echo
  echo "## Targets (issue 53)"
  echo
  "$PY" "$ROOT/bench/gpu_targets.py" "$LOGS" || echo "(bench/gpu_targets.py failed: the parts below and the logs have the figures)"
  echo
  echo "## Parts"
  echo
  results_table part
  echo
  echo "Raw logs: $(basename "$LOGS")/ beside this file (one per part; the trainer's run folders in runs/)."
}

do_figures() {
  parse_options figures "$FIGURES_BUDGET" "$@"
  REPORT_WRITER=figures_report
  prepare figures -figures
  run_targets
  finish
}

# ---- schedule ----

cases_plan() {  # cases_plan BUDGET
  local entry
  echo "call 1: bench/gpu.sh cases --budget $1"
  printf '%9s  %s\n' "timeout" "case"
  for entry in "${CASE_TIMEOUTS[@]}"; do printf '%7d s  %s\n' "${entry%% *}" "a case whose name holds \"${entry#* }\""; done
  printf '%7d s  %s\n' "$CASE_TIMEOUT_DEFAULT" "every other [cuda] case"
  echo "  every [cuda] case of every packed test binary, one at a time; a case starts only when its timeout"
  echo "  and ${KILL_GRACE} s to stop it fit in what is left of the $1 s (from the call's start), else: not run"
}

figures_plan() {  # figures_plan BUDGET
  local p key share name sum=0 t
  BUDGET=$1
  echo "call 2: bench/gpu.sh figures --budget $1"
  printf '%9s  %s\n' "timeout" "part"
  for p in "${PARTS[@]}"; do
    read -r key share name <<< "$p"
    t="$(part_timeout "$key")"
    printf '%7d s  %s: %s\n' "$t" "$key" "$name"
    sum=$((sum + t))
  done
  printf '%7d s  %s\n' "$(($1 - sum))" "left: unpacking, bench/gpu_targets.py and the report"
}

do_schedule() {
  local budget=""
  while (($#)); do
    case "$1" in
      --budget) [[ "${2:-}" =~ ^[0-9]+$ ]] || die "--budget needs a number of seconds"; budget=$2; shift 2 ;;
      *) die "unknown argument to schedule: $1 (see bench/gpu.sh --help)" ;;
    esac
  done
  cases_plan "${budget:-$CASES_BUDGET}"
  echo
  figures_plan "${budget:-$FIGURES_BUDGET}"
}

case "${1:-}" in
  pack) shift; (($# == 0)) || die "pack takes no arguments"; do_pack ;;
  cases) shift; do_cases "$@" ;;
  figures) shift; do_figures "$@" ;;
  schedule) shift; do_schedule "$@" ;;
  run) die "run is two calls now: bench/gpu.sh cases, then bench/gpu.sh figures (see bench/gpu.sh --help)" ;;
  -h|--help|help) usage ;;
  "") usage >&2; exit 2 ;;
  *) die "unknown command: $1 (pack, cases, figures, schedule or --help)" ;;
esac
