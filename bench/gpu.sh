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
#                       binaries were built against, runs every [cuda] case of every binary, each under
#                       its own timeout, then the GPU figures (GPT-2 124M bf16: tokens/s, the planner's
#                       peak against the caching allocator's allocated and reserved peaks), and writes
#                       bench/results/gpu-<date>.md with the raw logs beside it (gpu-<date>-logs/). With
#                       $OUT set it copies both there. Without a GPU every part is recorded as skipped.
# Options (run): --budget SECONDS (default 420: the parts stop being started once it is spent, and each
# part's timeout is cut to what is left), --only REGEX (run the parts whose name matches).
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

# run_part NAME TIMEOUT COMMAND...: runs it under `timeout`, logs it, records its result and runtime.
run_part() {
  local name="$1" limit="$2" log rc t0 t1 result note=""
  shift 2
  if [[ -n "$ONLY" && ! "$name" =~ $ONLY ]]; then return; fi
  local left=$((DEADLINE - $(date +%s)))
  if ((left <= 5)); then
    RESULTS+=("$name|not run|0|the budget of ${BUDGET} s was spent"); FAILED=1; return
  fi
  ((limit > left)) && limit=$left
  log="$LOGS/$(slug "$name").log"
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
  RESULTS+=("$name|$result|$secs|${note//|//}")
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
    *) echo 120 ;;
  esac
}

run_cases() {
  local bin name escaped
  for bin in "$WORK"/bin/test_*; do
    while IFS= read -r name; do
      [[ -n "$name" ]] || continue
      escaped="$(printf '%s' "$name" | sed 's/[][,*\\]/\\&/g')"
      run_part "$(basename "$bin"): $name" "$(case_timeout "$name")" env SUBLINEAR_SOURCE_DIR="$ROOT" \
        SUBLINEAR_TRAINER="$WORK/bin/trainer" SUBLINEAR_PYTHON="$PY" "$bin" "$escaped" --warn NoAssertions
    done < <(case_names "$bin")
  done
}

# GPT-2 124M in bf16 (configs/gpt2_124m.yaml: micro-batch 8 x 1024 tokens), 8 steps: tokens/s and the
# peaks, from summary.json and the step records (reserved: the largest reserved_bytes of a step record).
FIGURE_ARGS="--config configs/gpt2_124m.yaml --set train.device=cuda --set precision.compute=bf16 --set train.steps=8 \
--set train.grad_accum=1 --set train.eval_interval=0 --set state.at_end=false --set logging.save_model=false \
--set logging.progress=false --set logging.interval=1"

figure() {  # figure NAME SETS
  local dir
  dir="$WORK/figures/$(slug "$1")"
  if ((CUDA_DEVICES == 0)); then RESULTS+=("figure: $1|skipped|0|no CUDA device here"); return; fi
  run_part "figure: $1" 120 env OMP_NUM_THREADS=1 bash -c "cd '$ROOT' && '$WORK/bin/trainer' $FIGURE_ARGS $2 --set logging.dir='$dir'"
  [[ -s "$dir/summary.json" ]] || return
  cp "$dir/summary.json" "$LOGS/$(slug "figure: $1").summary.json"
  FIGURES+=("$("$PY" - "$dir" "$1" <<'EOF'
import json, sys
d, name = sys.argv[1], sys.argv[2]
s = json.load(open(d + "/summary.json"))
reserved = max((r.get("reserved_bytes", 0) for r in map(json.loads, open(d + "/metrics.jsonl")) if "event" not in r), default=0)
mib = lambda b: f"{b / 2**20:.0f}"
pred, peak = s["predicted_peak_bytes"], s["peak_allocated_bytes"]
print(f"| {name} | {s['median_tokens_per_s']:.0f} | {s['median_step_ms']:.1f} | {100 * s.get('median_mfu', 0):.1f} "
      f"| {mib(pred)} | {mib(peak)} | {100 * (pred - peak) / peak:+.1f} % | {mib(reserved)} |")
EOF
)")
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
    echo "| part | result | seconds | note |"
    echo "| --- | --- | --- | --- |"
    local r
    for r in "${RESULTS[@]}"; do echo "| ${r//|/ | } |"; done
    echo
    echo "GPT-2 124M, bf16 compute, micro-batch 8 x 1024 tokens, medians over steps 4-8 of 8:"
    echo
    echo "| run | tokens/s | step ms | MFU % | planner peak MiB | allocated peak MiB | planner vs allocated | reserved peak MiB |"
    echo "| --- | --- | --- | --- | --- | --- | --- | --- |"
    for r in "${FIGURES[@]}"; do echo "$r"; done
    ((${#FIGURES[@]})) || echo "| (none: no CUDA device, or --only left the figures out) | | | | | | | |"
    echo
    echo "Raw logs: $(basename "$LOGS")/ beside this file (one per part)."
  } > "$md"
}

do_run() {
  BUDGET=420 ONLY=""
  ARGS_TEXT="$*"
  while (($#)); do
    case "$1" in
      --budget) [[ "${2:-}" =~ ^[0-9]+$ ]] || die "--budget needs a number of seconds"; BUDGET=$2; shift 2 ;;
      --only) [[ -n "${2:-}" ]] || die "--only needs a regular expression"; ONLY=$2; shift 2 ;;
      *) die "unknown argument to run: $1 (see bench/gpu.sh --help)" ;;
    esac
  done
  START=$(date +%s) DEADLINE=$((START + BUDGET)) FAILED=0 RESULTS=() FIGURES=()
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
  mkdir -p "$LOGS"
  echo "$version" > "$LOGS/trainer-version.txt"
  run_cases
  figure "none" ""
  figure "checkpointing full" "--set checkpointing.mode=full"
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
  -h|--help|help) usage ;;
  "") usage >&2; exit 2 ;;
  *) die "unknown command: $1 (pack, run or --help)" ;;
esac
