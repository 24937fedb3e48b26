#!/usr/bin/env bash
# sweep_batch.sh: find the largest train.micro_batch that fits, per checkpointing mode.
#
#   scripts/sweep_batch.sh CONFIG [--limit SIZE] [--modes none,full,sqrt,selective] [--steps N]
#                          [--max-batch N] [--out DIR] [--no-plot] [-- extra trainer args]
#
# For each mode it doubles train.micro_batch from 1 while the runs succeed, and after the first
# out-of-memory run (trainer exit code 4) bisects between the last size that fit and the first that
# did not. Every trial is a short real training run (grad_accum 1, eval off, N steps) in its own run
# directory OUT/runs/<mode>-b<batch> (its console output in OUT/runs/<mode>-b<batch>.log).
# It writes OUT/results.csv, OUT/results.json ("kind": "batch") and OUT/results.md (a table of
# mode, micro-batch, fits, tokens/s, samples/s and peak MiB, then the largest batch per mode), prints
# the table, and draws OUT/*.png with scripts/plot.py (skip with --no-plot).
#
# Cost: per mode about log2(max batch) trials without a limit, plus about log2(gap) more after the
# first failure; each trial is one trainer start (~0.5 s) plus N steps at that batch. On configs/tiny.yaml
# on 2 cores, one thread: a few seconds for --max-batch 4; minutes for the default --max-batch 1024,
# whose biggest trials (mode none) hold several GB of tracked CPU memory. Use --limit to cap it.
#
# --limit SIZE is passed to the trainer as --set memory.limit=SIZE (B, KiB, MiB, GiB, TiB, KB, MB, GB, TB; 0 = no
#   limit). Without it only real out-of-memory failures stop the doubling, so --max-batch bounds it.
# --modes: comma-separated; each is none, full, sqrt, selective (recomputes attention, mlp and norm),
#   selective:PART+PART (PART in attention, mlp, norm) or interval:K (K blocks per segment).
# Trials run from the repository root (recipes name data files relative to it). CONFIG is taken
# relative to the current directory when it exists there, else relative to the repository root;
# --out relative to the current directory.
# Environment: TRAINER (default <repo>/build/trainer); LAUNCHER, a command prefix put in front of the
# trainer (e.g. LAUNCHER="torchrun --no-python --nproc-per-node 2"); PYTHON (default the project venv's
# interpreter, ${SUBLINEAR_HOME:-~/.cache/sublinear}/venv/bin/python, which has matplotlib).
# Exit status: 0 done; 1 a trial failed with a code other than 0 or 4 (its log path is printed), or a
# tool failed; 2 usage error; 130/143 interrupted.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PROG="sweep_batch.sh"

usage() {
  cat <<EOF
usage: scripts/$PROG CONFIG [--limit SIZE] [--modes none,full,sqrt,selective] [--steps N]
                      [--max-batch N] [--out DIR] [--no-plot] [-- extra trainer args]
  CONFIG        YAML recipe, e.g. configs/tiny.yaml
  --limit SIZE  memory limit per run (memory.limit), e.g. 512MiB, 4GiB; 0 = none (default none)
  --modes LIST  checkpointing modes to sweep (default none,full,sqrt,selective); also
                selective:attention+mlp+norm (any of the parts) and interval:K
  --steps N     training steps per trial (default 3; the first is excluded from the medians; use
                at least 2: the optimizer states are allocated during step 1)
  --max-batch N largest micro-batch to try (default 1024)
  --out DIR     output directory, must be new or empty (default runs/sweep_batch-<timestamp>)
  --no-plot     do not run scripts/plot.py
  -- ARGS       passed to every trainer run (e.g. -- --set train.seq_len=256)
env: TRAINER (trainer binary), LAUNCHER (command prefix), PYTHON (interpreter with matplotlib)
EOF
}
# shellcheck source=sweep_lib.sh
source "$ROOT/scripts/sweep_lib.sh"

# ---- arguments ----
CONFIG="" LIMIT="" MODES="none,full,sqrt,selective" STEPS=3 MAX_BATCH=1024 OUT="" PLOT=1
EXTRA=()
while (($#)); do
  case "$1" in
    -h|--help) usage; exit 0 ;;
    --limit|--modes|--steps|--max-batch|--out)
      (($# >= 2)) || die_usage "$1 needs a value"
      case "$1" in
        --limit) LIMIT="$2" ;;
        --modes) MODES="$2" ;;
        --steps) STEPS="$2" ;;
        --max-batch) MAX_BATCH="$2" ;;
        --out) OUT="$2" ;;
      esac
      shift 2 ;;
    --limit=*) LIMIT="${1#*=}"; shift ;;
    --modes=*) MODES="${1#*=}"; shift ;;
    --steps=*) STEPS="${1#*=}"; shift ;;
    --max-batch=*) MAX_BATCH="${1#*=}"; shift ;;
    --out=*) OUT="${1#*=}"; shift ;;
    --no-plot) PLOT=0; shift ;;
    --) shift; EXTRA=("$@"); break ;;
    -*) die_usage "unknown option: $1" ;;
    *) [[ -z "$CONFIG" ]] || die_usage "unexpected argument: $1 (CONFIG is already $CONFIG)"
       CONFIG="$1"; shift ;;
  esac
done
[[ -n "$CONFIG" ]] || die_usage "missing CONFIG"
CONFIG_PATH="$(resolve_path "$CONFIG")"
[[ -f "$CONFIG_PATH" ]] || die_usage "config not found: $CONFIG"
is_posint "$STEPS" || die_usage "--steps must be a positive integer, got '$STEPS'"
is_posint "$MAX_BATCH" || die_usage "--max-batch must be a positive integer, got '$MAX_BATCH'"
if [[ -n "$LIMIT" ]]; then
  [[ "$LIMIT" =~ ^[0-9]+(\.[0-9]+)?[[:space:]]*(B|KiB|MiB|GiB|TiB|KB|MB|GB|TB)?$ ]] ||
    die_usage "--limit must be a size like 512MiB, 4GiB or 0, got '$LIMIT'"
  [[ ! "$LIMIT" =~ ^0+(\.0+)?[[:space:]]*[A-Za-z]*$ ]] || LIMIT=""   # 0 = no limit
fi

# Modes: validate and turn each into trainer overrides.
MODE_LIST=()
IFS=',' read -ra _modes <<< "$MODES"
for m in "${_modes[@]}"; do
  case "$m" in
    none|full|sqrt|selective) ;;
    interval:*) is_posint "${m#interval:}" || die_usage "interval mode needs a block count: interval:K, got '$m'" ;;
    selective:*)
      IFS='+' read -ra _parts <<< "${m#selective:}"
      ((${#_parts[@]})) || die_usage "selective mode needs parts: selective:attention+mlp+norm"
      for p in "${_parts[@]}"; do
        [[ "$p" == attention || "$p" == mlp || "$p" == norm ]] ||
          die_usage "unknown selective part '$p' in '$m' (use attention, mlp, norm)"
      done ;;
    *) die_usage "unknown mode '$m' (use none, full, sqrt, selective, selective:PARTS, interval:K)" ;;
  esac
  for seen in "${MODE_LIST[@]}"; do [[ "$seen" != "$m" ]] || die_usage "mode '$m' given twice"; done
  MODE_LIST+=("$m")
done
((${#MODE_LIST[@]})) || die_usage "--modes is empty"

mode_sets() {  # prints the trainer arguments for one mode spec, one per line
  local m="$1" mode="$1" interval=0 recompute="[]"
  case "$m" in
    selective) recompute="[attention,mlp,norm]" ;;
    selective:*) mode=selective; recompute="[${m#selective:}]"; recompute="${recompute//+/,}" ;;
    interval:*) mode=interval; interval="${m#interval:}" ;;
  esac
  printf '%s\n' --set "checkpointing.mode=$mode" --set "checkpointing.interval=$interval" \
    --set "checkpointing.segments=0" --set "checkpointing.recompute=$recompute"
}

TRAINER="${TRAINER:-$ROOT/build/trainer}"
[[ -x "$TRAINER" ]] || die "trainer not found or not executable: $TRAINER (build it with scripts/setup.sh)"
PYTHON="${PYTHON:-${SUBLINEAR_HOME:-$HOME/.cache/sublinear}/venv/bin/python}"
if [[ ! -x "$PYTHON" ]]; then
  command -v python3 >/dev/null || die "no Python: $PYTHON is missing and python3 is not on PATH"
  echo "$PROG: $PYTHON not found, using python3 (plots need matplotlib)" >&2
  PYTHON=python3
fi
LAUNCH=()
[[ -n "${LAUNCHER:-}" ]] && read -ra LAUNCH <<< "$LAUNCHER"

if [[ -n "$LIMIT" ]] && ! grep -Eq '^[[:space:]]+limit[[:space:]]' <<< "$("$TRAINER" --help-config 2>/dev/null)"; then  # not a pipe: grep -q quitting early would SIGPIPE the trainer under pipefail
  die_usage "--limit needs the trainer's memory.limit key, which $TRAINER does not have (rebuild it)"
fi

if [[ -z "$OUT" ]]; then OUT="$ROOT/runs/sweep_batch-$(date +%Y%m%d-%H%M%S)"; else OUT="$(abs_path "$OUT")"; fi
if [[ -e "$OUT" ]]; then
  [[ -d "$OUT" ]] || die_usage "--out exists and is not a directory: $OUT"
  [[ -z "$(ls -A "$OUT")" ]] || die_usage "--out must be new or empty: $OUT"
fi
mkdir -p "$OUT/runs"
ROWS="$OUT/rows.jsonl"
: > "$ROWS"

# ---- Python helpers (stdlib only) ----
PYHELP="$(cat <<'PY'
import csv, json, math, os, re, sys

UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
         "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}

def size_bytes(text):
    if not text:
        return None
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*", text)
    if not m or m.group(2) not in UNITS:
        raise SystemExit(f"bad size: {text}")
    n = int(float(m.group(1)) * UNITS[m.group(2)])
    return n or None

def mib(b):
    return "—" if b is None else f"{b / 2**20:.1f}"

def num(v, fmt):
    return "—" if v is None else format(v, fmt)

def oom_text(r):
    where = r.get("oom_phase")
    if where and r.get("oom_step"):
        where += f", step {r['oom_step']}"
    return "out of memory" + (f" in {where}" if where else "")

def cmd_row(rows_path, mode, batch, rc, run_dir, trial):
    rc = int(rc)
    s = {}
    try:
        with open(os.path.join(run_dir, "summary.json")) as f:
            s = json.load(f)
    except (OSError, ValueError):
        pass
    ok = rc == 0
    if ok and "median_step_ms" not in s:
        sys.exit(f"exit code 0 but no summary.json with medians in {run_dir}")
    row = {
        "trial": int(trial), "mode": mode, "micro_batch": int(batch), "fits": ok, "exit_code": rc,
        "step_ms": s.get("median_step_ms") if ok else None,
        "tokens_per_s": s.get("median_tokens_per_s") if ok else None,
        "samples_per_s": s.get("median_samples_per_s") if ok else None,
        "peak_bytes": s.get("peak_allocated_bytes") if ok else None,
        "activation_peak_bytes": s.get("median_activation_peak_bytes") if ok else None,
        "predicted_activation_peak_bytes": s.get("predicted_activation_peak_bytes"),
        "oom_phase": None, "oom_step": None,
        "limit_bytes": s.get("memory_limit_bytes"),
        "run_dir": os.path.basename(run_dir),
    }
    oom = s.get("oom") or {}
    if not ok:
        # No summary when the model states alone do not fit (the trainer stops before the run dir).
        row["oom_phase"] = oom.get("phase") or ("model build" if not s else None)
        row["oom_step"] = oom.get("step")
    with open(rows_path, "a") as f:
        f.write(json.dumps(row) + "\n")
    if ok:
        print(f"[{mode}] micro_batch {batch}: fits, {num(row['step_ms'], '.1f')} ms/step, "
              f"{num(row['tokens_per_s'], '.0f')} tok/s, peak {mib(row['peak_bytes'])} MiB", flush=True)
    else:
        print(f"[{mode}] micro_batch {batch}: does not fit (exit {rc}, {oom_text(row)})", flush=True)

FIELDS = ["mode", "micro_batch", "fits", "step_ms", "tokens_per_s", "samples_per_s", "peak_bytes",
          "predicted_activation_peak_bytes", "activation_peak_bytes", "exit_code", "oom_phase", "oom_step",
          "trial", "run_dir"]

def cmd_finish(out, config, limit, modes, steps, max_batch, launcher, *extra):
    modes = modes.split(",")
    with open(os.path.join(out, "rows.jsonl")) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    rows.sort(key=lambda r: (modes.index(r["mode"]), r["micro_batch"]))
    # The trainer's own reading of the limit wins over ours (they use the same units).
    limit_bytes = next((r["limit_bytes"] for r in rows if r.get("limit_bytes")), None) or size_bytes(limit)
    largest = {}
    for m in modes:
        fit = [r["micro_batch"] for r in rows if r["mode"] == m and r["fits"]]
        largest[m] = max(fit) if fit else None
    seq_len = None
    for r in rows:  # read the resolved recipe of one run for the header
        try:
            with open(os.path.join(out, "runs", r["run_dir"], "summary.json")) as f:
                seq_len = json.load(f)["config"]["train"]["seq_len"]
            break
        except (OSError, ValueError, KeyError):
            continue
    doc = {"kind": "batch", "config": config, "limit_bytes": limit_bytes,
           "limit": limit or None, "steps": int(steps), "max_batch": int(max_batch),
           "seq_len": seq_len, "launcher": launcher or None, "extra_args": list(extra),
           "rows": rows, "largest": largest}
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(doc, f, indent=2)
        f.write("\n")
    with open(os.path.join(out, "results.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({k: ("" if r.get(k) is None else str(r[k]).lower() if isinstance(r[k], bool) else r[k])
                        for k in FIELDS})
    lim = f"{limit} ({limit_bytes} bytes)" if limit_bytes else "none"
    lines = [f"# Largest micro-batch per checkpointing mode",
             "",
             f"Recipe `{config}`, memory limit {lim}, sequence length {seq_len if seq_len is not None else '?'}, "
             f"{steps} steps per trial (grad_accum 1); medians exclude the first step.",
             "",
             "| mode | micro-batch | fits | throughput (tokens/s) | effective throughput (samples/s) | peak memory (MiB) |",
             "|---|---:|---|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['mode']} | {r['micro_batch']} | {'yes' if r['fits'] else 'no (' + oom_text(r) + ')'} | "
                     f"{num(r['tokens_per_s'], ',.0f')} | {num(r['samples_per_s'], ',.1f')} | {mib(r['peak_bytes'])} |")
    lines.append("")
    for m in modes:
        b = largest[m]
        tried = [r for r in rows if r["mode"] == m]
        failed = [r["micro_batch"] for r in tried if not r["fits"]]
        if b is None:
            lines.append(f"- **{m}**: nothing fits (micro-batch 1 exceeds the limit)")
            continue
        best = next(r for r in tried if r["micro_batch"] == b)
        note = (f"; {min(failed)} does not" if failed else
                f"; reached --max-batch {max_batch}, larger sizes were not tried")
        lines.append(f"- **{m}**: largest micro-batch that fits: **{b}** "
                     f"({num(best['samples_per_s'], ',.1f')} samples/s, peak {mib(best['peak_bytes'])} MiB{note})")
    text = "\n".join(lines) + "\n"
    with open(os.path.join(out, "results.md"), "w") as f:
        f.write(text)
    os.remove(os.path.join(out, "rows.jsonl"))
    print(text, end="")

cmd = sys.argv[1]
if cmd == "row":
    cmd_row(*sys.argv[2:])
elif cmd == "finish":
    cmd_finish(*sys.argv[2:])
else:
    raise SystemExit(f"unknown helper command {cmd}")
PY
)"
py() { "$PYTHON" -c "$PYHELP" "$@"; }

SKIP_FIRST=$(( STEPS > 1 ? 1 : 0 ))
TRIAL=0
# run_trial MODE BATCH: runs one trial; returns 0 when it fit, 1 when out of memory; exits otherwise.
run_trial() {
  local m="$1" b="$2" name run_dir log rc=0
  name="${m//:/-}-b$b"
  run_dir="$OUT/runs/$name"
  log="$run_dir.log"
  local -a cmd=("${LAUNCH[@]}" "$TRAINER" --config "$CONFIG_PATH" "${EXTRA[@]}")
  mapfile -t _sets < <(mode_sets "$m")
  cmd+=("${_sets[@]}"
        --set "train.micro_batch=$b" --set train.grad_accum=1 --set "train.steps=$STEPS"
        --set train.eval_interval=0 --set "logging.dir=$run_dir" --set logging.overwrite=true --set logging.progress=false
        --set "logging.skip_first=$SKIP_FIRST")
  [[ -z "$LIMIT" ]] || cmd+=(--set "memory.limit=$LIMIT")
  TRIAL=$((TRIAL + 1))
  (cd "$ROOT" && "${cmd[@]}") > "$log" 2>&1 || rc=$?
  case "$rc" in
    0|4) py row "$ROWS" "$m" "$b" "$rc" "$run_dir" "$TRIAL" ||
           die "trial $m micro_batch $b: exit $rc but no usable $run_dir/summary.json; log: $log"
         return $(( rc == 0 ? 0 : 1 )) ;;
    130|143) echo "$PROG: interrupted (trainer exit $rc); log: $log" >&2; exit "$rc" ;;
    *) echo "$PROG: trial $m micro_batch $b failed with exit code $rc; log: $log" >&2
       tail -n 5 "$log" >&2 || true
       exit 1 ;;
  esac
}

echo "$PROG: $CONFIG, modes ${MODE_LIST[*]}, limit ${LIMIT:-none}, $STEPS steps per trial, max batch $MAX_BATCH -> $OUT"
for m in "${MODE_LIST[@]}"; do
  ok=0 bad=0 b=1
  # Doubling (the last step is clamped to --max-batch).
  while :; do
    if run_trial "$m" "$b"; then ok=$b; else bad=$b; break; fi
    (( b < MAX_BATCH )) || break
    b=$(( 2 * b > MAX_BATCH ? MAX_BATCH : 2 * b ))
  done
  # Bisection between the last fit and the first failure.
  if (( bad > 0 )); then
    while (( bad - ok > 1 )); do
      mid=$(( (ok + bad) / 2 ))
      if run_trial "$m" "$mid"; then ok=$mid; else bad=$mid; fi
    done
  fi
done

echo
py finish "$OUT" "$CONFIG" "$LIMIT" "$(IFS=,; echo "${MODE_LIST[*]}")" "$STEPS" "$MAX_BATCH" "${LAUNCHER:-}" "${EXTRA[@]}"
if (( PLOT )); then
  "$PYTHON" "$ROOT/scripts/plot.py" "$OUT/results.json" || die "plot.py failed (results are in $OUT)"
fi
echo "results: $OUT/results.md $OUT/results.csv $OUT/results.json"
