#!/usr/bin/env bash
# gpu.sh: the one prepared command for a lent GPU machine (one that has the working tree and a CUDA
# build of torch 2.11 but not this project's build).
#   bench/gpu.sh pack   here, after building: copies build/trainer, the test binaries that hold [cuda]
#                       cases and the shared libraries they need that torch and CUDA do not bring
#                       (yaml-cpp, spdlog, fmt, ICU, protobuf-lite, zlib; libcudart as a fallback),
#                       stripped, into .gpu/pack.tar.xz (.gpu/ is ignored through .git/info/exclude),
#                       and prints its size.
#   bench/gpu.sh run    there (the device tool with carry [".gpu"]): unpacks the pack, finds the torch
#                       libraries of the Python that holds torch, checks that torch is the version the
#                       binaries were built against, then measures issue 53's targets, one part each,
#                       most important first (bench/gpu.sh schedule lists them with their timeouts):
#                       GPT-2 124M bf16 (configs/gpt2_124m.yaml, 8 x 1024 tokens x 8 micro-batches) in
#                       the trainer; the same under torch.compile (bench/compiled_gpt.py, the image's
#                       torch); the trainer with checkpointing full and selective; configs/1b_24gb.yaml;
#                       the pinned copy rates and overlap (bench/offload_bw.py: the values of
#                       offload.bandwidth_gbps and offload.overlap, which the 7B parts then use);
#                       `trainer plan` and 3 steps of configs/7b_24gb.yaml under memory.limit 24GB; then
#                       every [cuda] case of every binary in what is left of the budget. It writes
#                       bench/results/gpu-<date>.md: the targets (bench/gpu_targets.py: measured, bound,
#                       met / not met / skipped / timed out), the figures (tokens/s, MFU, the planner's
#                       peak against the caching allocator's), each part's result, with the raw logs
#                       and run folders beside it (gpu-<date>-logs/). A part cut short by its timeout
#                       leaves the steps it ran, and the targets use them (marked partial). With $OUT
#                       set it copies both there. Without a GPU every part is recorded as skipped.
#   bench/gpu.sh schedule [--budget SECONDS]   prints each part's timeout under that budget.
# Options (run): --budget SECONDS (default 480: each part's timeout is its share of the budget, cut to
# what is left; the [cuda] cases share what the parts before them left), --only REGEX (run the parts
# whose name matches).
# Environment: BUILD_DIR (pack; default build), SUBLINEAR_PYTHON (the Python that holds torch; default
# the setup venv's if present, else python3).
# Exit status: 0 every part passed or was skipped; 1 a part failed or timed out; 2 bad arguments or
# setup (no pack, torch of another version, a library not found).
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PACK_DIR="$ROOT/.gpu"
PACK="$PACK_DIR/pack.tar.xz"

usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "${BASH_SOURCE[0]}"; }
die() { echo "gpu.sh: $1" >&2; exit "${2:-2}"; }

python_with_torch() {
  local venv="${SUBLINEAR_HOME:-$HOME/.cache/sublinear}/venv/bin/python"
  if [[ -n "${SUBLINEAR_PYTHON:-}" ]]; then echo "$SUBLINEAR_PYTHON"
  elif [[ -x "$venv" ]]; then echo "$venv"
  else echo python3; fi
}

# ---- pack ----

# The test binaries that hold a [cuda] case, from the sources: test_<name> for tests/test_<name>.cpp.
cuda_tests() {
  grep -l '"\[cuda\]"' "$ROOT"/tests/test_*.cpp | sed 's|.*/tests/\(test_[a-z0-9_]*\)\.cpp|\1|' | sort
}

# The libraries a binary loads that neither torch's lib folder nor the base system provides.
carried_libs() {
  ldd "$1" | awk '/=> \// {print $3}' | grep -v -E '/torch/lib/|/libc\.so|/libm\.so|/libpthread|/libdl\.so|/librt\.so|/libutil\.so|/ld-linux|/libgcc_s|/libstdc\+\+'
}

do_pack() {
  local build="${BUILD_DIR:-$ROOT/build}" stage bin lib
  [[ -x "$build/trainer" ]] || die "no $build/trainer: build first (scripts/setup.sh, or cmake --build build)"
  local exclude
  exclude="$(git -C "$ROOT" rev-parse --git-path info/exclude)" || die "not a git checkout: $ROOT"
  [[ "$exclude" = /* ]] || exclude="$ROOT/$exclude"
  mkdir -p "$(dirname "$exclude")"
  grep -qxF '/.gpu/' "$exclude" 2>/dev/null || echo '/.gpu/' >> "$exclude"
  stage="$(mktemp -d)"
  mkdir -p "$stage/bin" "$stage/lib"
  local bins=("$build/trainer")
  for t in $(cuda_tests); do
    [[ -x "$build/$t" ]] || die "no $build/$t: build it first (cmake --build build --target $t)"
    bins+=("$build/$t")
  done
  for bin in "${bins[@]}"; do
    strip --strip-unneeded -o "$stage/bin/$(basename "$bin")" "$bin" || die "strip $bin failed"
    for lib in $(carried_libs "$bin"); do cp -Ln "$lib" "$stage/lib/" 2>/dev/null; done
  done
  { echo "commit $(git -C "$ROOT" rev-parse HEAD)$(git -C "$ROOT" diff --quiet HEAD 2>/dev/null || echo ' (with uncommitted changes)')"
    echo "packed $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(uname -n)"
    "$build/trainer" --version
  } > "$stage/MANIFEST"
  rm -rf "$PACK_DIR" && mkdir -p "$PACK_DIR"
  tar -C "$stage" -cJf "$PACK" MANIFEST bin lib || die "tar failed"
  echo "packed into $PACK:"
  (cd "$stage" && find bin lib -type f | sort | sed 's/^/  /')
  echo "unpacked $(du -sh "$stage" | cut -f1); $PACK: $(du -h "$PACK" | cut -f1)"
  local tree
  tree=$(git -C "$ROOT" ls-files -z --cached --others --exclude-standard | (cd "$ROOT" && du -cb --files0-from=- 2>/dev/null) | tail -1 | cut -f1)
  echo "the working tree that travels: $((tree / 1024 / 1024)) MiB + the pack $(( $(stat -c %s "$PACK") / 1024 / 1024 )) MiB (limit 64 MiB)"
  rm -rf "$stage"
}

# ---- run ----

unpack() {
  [[ -s "$PACK" ]] || die "no $PACK: run 'bench/gpu.sh pack' on the build machine and carry .gpu"
  WORK="$(mktemp -d)"
  # tar needs the xz program for -J; Python's tarfile module has its own.
  tar -C "$WORK" -xJf "$PACK" 2>/dev/null ||
    "$PY" -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])' "$PACK" "$WORK" ||
    die "unpacking $PACK failed"
}

# LD_LIBRARY_PATH: torch's lib folder and the NVIDIA wheels' beside it (cuDNN, cuBLAS, NCCL, the CUDA
# runtime), then the pack's libraries.
library_path() {
  local torch_dir
  torch_dir="$("$PY" -c 'import torch, os; print(os.path.dirname(torch.__file__))' 2>/dev/null)" ||
    die "$PY cannot import torch: set SUBLINEAR_PYTHON to the Python that holds torch 2.11"
  local dirs="$torch_dir/lib" d
  for d in $(find "$(dirname "$torch_dir")/nvidia" -maxdepth 3 -type d -name lib 2>/dev/null | sort); do dirs="$dirs:$d"; done
  echo "$dirs:$WORK/lib"
}

# The image's torch must be the LibTorch the binaries were built against (they link it by soname).
check_torch() {
  local built have
  built="$(sed -n 's/^LibTorch \([0-9.]*\).*/\1/p' "$WORK/MANIFEST")"
  have="$("$PY" -c 'import torch; print(torch.__version__.split("+")[0])')"
  [[ -n "$built" && "$built" == "$have" ]] || die "torch here is $have, the binaries were built against LibTorch $built"
  TORCH_VERSION="$("$PY" -c 'import torch; print(torch.__version__, "CUDA", torch.version.cuda)')"
}

# NAME of a part -> a file name.
slug() { echo "$1" | tr -c 'A-Za-z0-9\n' '_' | tr -s '_' | cut -c1-80; }

# The parts that measure issue 53's targets, in the order they run (most important first):
# KEY, its share of the budget in per cent, its name. The [cuda] cases come after them and share what
# is left (at least the 100 - the sum of these shares per cent of the budget).
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

do_schedule() {
  BUDGET=480
  while (($#)); do
    case "$1" in
      --budget) [[ "${2:-}" =~ ^[0-9]+$ ]] || die "--budget needs a number of seconds"; BUDGET=$2; shift 2 ;;
      *) die "unknown argument to schedule: $1 (see bench/gpu.sh --help)" ;;
    esac
  done
  local p key share name sum=0
  printf '%8s  %s\n' "timeout" "part (--budget $BUDGET)"
  for p in "${PARTS[@]}"; do
    read -r key share name <<< "$p"
    printf '%6d s  %s: %s\n' "$(part_timeout "$key")" "$key" "$name"
    sum=$((sum + $(part_timeout "$key")))
  done
  printf '%6d s  %s\n' "$((BUDGET - sum))" "cases: every [cuda] case, each within what is left (at least this)"
}

# record KEY NAME RESULT SECONDS NOTE: one part's line in the report and in parts.tsv.
record() {
  RESULTS+=("$2|$3|$4|${5//|//}")
  printf '%s\t%s\t%s\t%s\t%s\n' "$1" "$3" "$4" "${2//$'\t'/ }" "${5//$'\t'/ }" >> "$LOGS/parts.tsv"
}

# run_part KEY NAME TIMEOUT COMMAND...: runs it in $WORK under `timeout`, logs it to KEY.log, records
# its result and runtime.
run_part() {
  local key="$1" name="$2" limit="$3" log rc t0 t1 result note=""
  shift 3
  if [[ -n "$ONLY" && ! "$name" =~ $ONLY ]]; then return; fi
  local left=$((DEADLINE - $(date +%s)))
  if ((left <= 5)); then record "$key" "$name" "not run" 0 "the budget of ${BUDGET} s was spent"; FAILED=1; return; fi
  ((limit > left)) && limit=$left
  log="$LOGS/$key.log"
  echo "== $name (timeout ${limit} s)"
  t0=$(date +%s%N)
  (cd "$WORK" && timeout -k 10 "$limit" "$@") > "$log" 2>&1
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
  record "$key" "$name" "$result" "$secs" "$note"
  echo "   $result ($secs s)"
}

# Catch2 2.x: --list-test-names-only (its exit status is the number listed); 3.x: --list-tests
# --verbosity quiet (2.x's option is unknown there).
case_names() {
  local out
  out="$("$1" "[cuda]" --list-test-names-only 2>&1)"
  if grep -qi 'unrecognised' <<< "$out"; then "$1" "[cuda]" --list-tests --verbosity quiet; else echo "$out"; fi
}

# Per-case timeouts in seconds (the test_device planner case runs GPT-2 124M seven times).
case_timeout() {
  case "$1" in
    *"predicted peaks"*) echo 150 ;;
    *"every checkpointing mode"*) echo 150 ;;
    *"captured micro-batch replayed"*) echo 150 ;;  # test_train's train.cuda_graphs case: 9 tiny runs
    *) echo 120 ;;
  esac
}

run_cases() {
  local bin name escaped found=0
  for bin in "$WORK"/bin/test_*; do
    [[ -x "$bin" ]] || continue
    found=1
    while IFS= read -r name; do
      [[ -n "$name" ]] || continue
      escaped="$(printf '%s' "$name" | sed 's/[][,*\\]/\\&/g')"
      run_part "case_$(slug "$(basename "$bin")_$name")" "$(basename "$bin"): $name" "$(case_timeout "$name")" \
        env SUBLINEAR_SOURCE_DIR="$ROOT" SUBLINEAR_TRAINER="$WORK/bin/trainer" SUBLINEAR_PYTHON="$PY" \
        "$bin" "$escaped" --warn NoAssertions
    done < <(case_names "$bin")
  done
  ((found)) || record case_none "[cuda] test cases" skipped 0 "the pack holds no test binaries"
}

# ---- the target parts ----

# needs_cuda KEY: records the part as skipped (and fails) without a CUDA device or when --only leaves it out.
needs_cuda() {
  local name
  name="$(part_field "$1" 3)"
  [[ -z "$ONLY" || "$name" =~ $ONLY ]] || return 1
  ((CUDA_DEVICES > 0)) && return 0
  record "$1" "$name" skipped 0 "no CUDA device here"
  return 1
}

# trainer_part KEY CONFIG [--set ...]: a trainer run in the checkout, its run folder runs/KEY in the logs.
trainer_part() {
  local key="$1" config="$2"
  shift 2
  needs_cuda "$key" || return 0
  run_part "$key" "$(part_field "$key" 3)" "$(part_timeout "$key")" bash -c 'cd "$0" && exec "$@"' "$ROOT" \
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
    run_part baseline "$(part_field baseline 3)" "$(part_timeout baseline)" "$PY" "$ROOT/bench/compiled_gpt.py" \
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
    run_part offload_bw "$(part_field offload_bw 3)" "$(part_timeout offload_bw)" "$PY" "$ROOT/bench/offload_bw.py" \
      --out "$LOGS/runs/offload_bw.json"
    [[ -s "$LOGS/runs/offload_bw.json" ]] && sets+=($("$PY" -c 'import json, sys
r = json.load(open(sys.argv[1]))
print("--set offload.bandwidth_gbps=%.1f --set offload.overlap=%.2f" % (r["bandwidth_gbps"], r["overlap"]))' \
      "$LOGS/runs/offload_bw.json" 2>/dev/null))
  fi
  if needs_cuda plan_7b; then
    run_part plan_7b "$(part_field plan_7b 3)" "$(part_timeout plan_7b)" bash -c 'cd "$0" && exec "$@"' "$ROOT" \
      "$WORK/bin/trainer" plan --config configs/7b_24gb.yaml --set memory.limit=24GB "${sets[@]}" \
      --out "$LOGS/runs/plan_7b.json"
  fi
  trainer_part run_7b configs/7b_24gb.yaml --set memory.limit=24GB --set train.steps=3 --set logging.skip_first=1 \
    "${sets[@]}"
}

write_report() {
  local md="$1" gpu driver
  gpu="$(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null | head -1)"
  driver="$(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null | head -1)"
  {
    echo "# GPU run: bench/gpu.sh run"
    echo
    echo "- GPU: ${gpu:-none (nvidia-smi found no GPU)}; driver ${driver:-none}"
    echo "- host: $(uname -n), $(nproc) CPUs; torch here: $TORCH_VERSION"
    echo "- binaries: $(sed -n 1p "$WORK/MANIFEST"); $(sed -n 2p "$WORK/MANIFEST")"
    echo "- $(sed -n 's/^sublinear trainer/trainer/p' "$WORK/MANIFEST")"
    echo "- date: $(date -u +%Y-%m-%dT%H:%M:%SZ); command: \`bench/gpu.sh run $ARGS_TEXT\` (budget ${BUDGET} s); wall time $(( $(date +%s) - START )) s"
    echo
    echo "## Targets (issue 53)"
    echo
    "$PY" "$ROOT/bench/gpu_targets.py" "$LOGS" || echo "(bench/gpu_targets.py failed: the parts below and the logs have the figures)"
    echo
    echo "## Parts"
    echo
    echo "| part | result | seconds | note |"
    echo "| --- | --- | --- | --- |"
    local r
    for r in "${RESULTS[@]}"; do echo "| ${r//|/ | } |"; done
    echo
    echo "Raw logs: $(basename "$LOGS")/ beside this file (one per part; the trainer's run folders in runs/)."
  } > "$md"
}

do_run() {
  BUDGET=480 ONLY=""
  ARGS_TEXT="$*"
  while (($#)); do
    case "$1" in
      --budget) [[ "${2:-}" =~ ^[0-9]+$ ]] || die "--budget needs a number of seconds"; BUDGET=$2; shift 2 ;;
      --only) [[ -n "${2:-}" ]] || die "--only needs a regular expression"; ONLY=$2; shift 2 ;;
      *) die "unknown argument to run: $1 (see bench/gpu.sh --help)" ;;
    esac
  done
  START=$(date +%s) DEADLINE=$((START + BUDGET)) FAILED=0 RESULTS=()
  PY="$(python_with_torch)"
  unpack
  trap 'rm -rf "$WORK"' EXIT
  export LD_LIBRARY_PATH
  LD_LIBRARY_PATH="$(library_path)" || exit 2
  check_torch
  local version
  version="$("$WORK/bin/trainer" --version 2>&1)" || { echo "$version"; ldd "$WORK/bin/trainer" | grep 'not found'; die "the packed trainer does not start here"; }
  CUDA_DEVICES="$(echo "$version" | sed -n 's/.*devices here \([0-9]*\).*/\1/p')"
  CUDA_DEVICES="${CUDA_DEVICES:-0}"
  local stamp results="$ROOT/bench/results"
  stamp="$(date -u +%Y-%m-%d)"
  [[ -e "$results/gpu-$stamp.md" ]] && stamp="$(date -u +%Y-%m-%d-%H%M)"
  LOGS="$results/gpu-$stamp-logs"
  mkdir -p "$LOGS/runs"
  : > "$LOGS/parts.tsv"
  echo "$version" > "$LOGS/trainer-version.txt"
  run_targets
  run_cases
  write_report "$results/gpu-$stamp.md"
  cat "$results/gpu-$stamp.md"
  if [[ -n "${OUT:-}" ]]; then
    cp "$results/gpu-$stamp.md" "$OUT/" && tar -C "$results" -czf "$OUT/gpu-$stamp-logs.tar.gz" "gpu-$stamp-logs"
  fi
  return "$FAILED"
}

case "${1:-}" in
  pack) shift; (($# == 0)) || die "pack takes no arguments"; do_pack ;;
  run) shift; do_run "$@" ;;
  schedule) shift; do_schedule "$@" ;;
  -h|--help|help) usage ;;
  "") usage >&2; exit 2 ;;
  *) die "unknown command: $1 (pack, run, schedule or --help)" ;;
esac
