#!/usr/bin/env bash
# sweep_interval.sh: activation memory and step time of interval checkpointing for every k = 1..L.
#
#   scripts/sweep_interval.sh CONFIG [--steps N] [--out DIR] [--no-plot] [-- extra trainer args]
#
# Runs the recipe once with checkpointing.mode=none (the reference; its resolved recipe gives the
# depth L = model.n_layer), then with checkpointing.mode=interval and checkpointing.interval=k for
# k = 1..L. Each run is a short real training run (the recipe's micro_batch, grad_accum 1, eval off,
# N steps) in its own run directory OUT/runs/<none|k<k>> (console output in OUT/runs/<name>.log).
# Per run it records the measured median_activation_peak_bytes, predicted_activation_peak_bytes
# (the analytic model), peak_allocated_bytes and median_step_ms, and writes OUT/results.csv,
# OUT/results.json ("kind": "interval") and OUT/results.md, prints the table, and draws OUT/*.png
# with scripts/plot.py (skip with --no-plot).
#
# Cost: L + 1 trainer runs, each one start (~0.5 s) plus N steps of the recipe at its micro-batch.
# configs/tiny.yaml (L = 4, micro-batch 16) with 3 steps: about 10 s on 2 cores, one thread.
#
# A run that ends out of memory (exit code 4, e.g. with -- --set memory.limit=...) is recorded as not
# fitting and the sweep goes on. Trials run from the repository root (recipes name data files
# relative to it). CONFIG is taken relative to the current directory when it exists there, else
# relative to the repository root; --out relative to the current directory.
# Environment: TRAINER (default <repo>/build/trainer); LAUNCHER, a command prefix put in front of the
# trainer (e.g. LAUNCHER="torchrun --no-python --nproc-per-node 2"); PYTHON (default the project venv's
# interpreter, ${SUBLINEAR_HOME:-~/.cache/sublinear}/venv/bin/python, which has matplotlib).
# Exit status: 0 done; 1 a run failed with a code other than 0 or 4 (its log path is printed), or a
# tool failed; 2 usage error; 130/143 interrupted.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PROG="sweep_interval.sh"

usage() {
  cat <<EOF
usage: scripts/$PROG CONFIG [--steps N] [--out DIR] [--no-plot] [-- extra trainer args]
  CONFIG        YAML recipe, e.g. configs/tiny.yaml
  --steps N     training steps per run (default 3; the first is excluded from the medians)
  --out DIR     output directory, must be new or empty (default runs/sweep_interval-<timestamp>)
  --no-plot     do not run scripts/plot.py
  -- ARGS       passed to every trainer run (e.g. -- --set train.micro_batch=4)
env: TRAINER (trainer binary), LAUNCHER (command prefix), PYTHON (interpreter with matplotlib)
EOF
}
# shellcheck source=sweep_lib.sh
source "$ROOT/scripts/sweep_lib.sh"

# ---- arguments ----
CONFIG="" STEPS=3 OUT="" PLOT=1
EXTRA=()
while (($#)); do
  case "$1" in
    -h|--help) usage; exit 0 ;;
    --steps|--out)
      (($# >= 2)) || die_usage "$1 needs a value"
      if [[ "$1" == --steps ]]; then STEPS="$2"; else OUT="$2"; fi
      shift 2 ;;
    --steps=*) STEPS="${1#*=}"; shift ;;
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

if [[ -z "$OUT" ]]; then OUT="$ROOT/runs/sweep_interval-$(date +%Y%m%d-%H%M%S)"; else OUT="$(abs_path "$OUT")"; fi
if [[ -e "$OUT" ]]; then
  [[ -d "$OUT" ]] || die_usage "--out exists and is not a directory: $OUT"
  [[ -z "$(ls -A "$OUT")" ]] || die_usage "--out must be new or empty: $OUT"
fi
mkdir -p "$OUT/runs"
ROWS="$OUT/rows.jsonl"
: > "$ROWS"

# ---- Python helpers (stdlib only) ----
PYHELP="$(cat <<'PY'
import csv, json, os, sys

def mib(b):
    return "—" if b is None else f"{b / 2**20:.1f}"

def num(v, fmt):
    return "—" if v is None else format(v, fmt)

def load(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}

def cmd_nlayer(run_dir):
    # config.json holds the resolved recipe (written at start, so also after an in-loop OOM).
    cfg = load(os.path.join(run_dir, "config.json")) or load(os.path.join(run_dir, "summary.json")).get("config", {})
    n = cfg.get("model", {}).get("n_layer")
    if not isinstance(n, int) or n < 1:
        raise SystemExit(f"cannot read model.n_layer from {run_dir}/config.json")
    print(n)

def cmd_row(rows_path, mode, k, rc, run_dir):
    rc = int(rc)
    s = load(os.path.join(run_dir, "summary.json"))
    ok = rc == 0
    if ok and "median_step_ms" not in s:
        sys.exit(f"exit code 0 but no summary.json with medians in {run_dir}")
    ck = s.get("checkpointing") or {}
    segs = ck.get("segments") or []
    row = {
        "mode": mode, "k": int(k) if k else None, "fits": ok, "exit_code": rc,
        "activation_peak_bytes": s.get("median_activation_peak_bytes") if ok else None,
        "predicted_activation_peak_bytes": s.get("predicted_activation_peak_bytes"),
        "peak_bytes": s.get("peak_allocated_bytes") if ok else None,
        "step_ms": s.get("median_step_ms") if ok else None,
        "tokens_per_s": s.get("median_tokens_per_s") if ok else None,
        "recompute_ms": s.get("median_recompute_ms") if ok else None,
        "segments": len(segs) if segs else None,
        "checkpointed_segments": sum(1 for g in segs if g.get("checkpointed")) if segs else None,
        "micro_batch": (s.get("config") or {}).get("train", {}).get("micro_batch"),
        "run_dir": os.path.basename(run_dir),
    }
    with open(rows_path, "a") as f:
        f.write(json.dumps(row) + "\n")
    name = "none" if not k else f"interval k={k}"
    if ok:
        print(f"[{name}] activation peak {mib(row['activation_peak_bytes'])} MiB (predicted "
              f"{mib(row['predicted_activation_peak_bytes'])}), peak {mib(row['peak_bytes'])} MiB, "
              f"{num(row['step_ms'], '.1f')} ms/step", flush=True)
    else:
        print(f"[{name}] does not fit (exit {rc}, out of memory)", flush=True)

FIELDS = ["mode", "k", "fits", "activation_peak_bytes", "predicted_activation_peak_bytes", "peak_bytes",
          "step_ms", "tokens_per_s", "recompute_ms", "segments", "checkpointed_segments", "micro_batch",
          "exit_code", "run_dir"]

def cmd_finish(out, config, steps, n_layer, launcher, *extra):
    with open(os.path.join(out, "rows.jsonl")) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    rows.sort(key=lambda r: -1 if r["k"] is None else r["k"])
    ref = next((r for r in rows if r["k"] is None), None)
    seq_len = micro_batch = None
    for r in rows:
        cfg = load(os.path.join(out, "runs", r["run_dir"], "config.json"))
        if cfg:
            seq_len, micro_batch = cfg["train"]["seq_len"], cfg["train"]["micro_batch"]
            break
    doc = {"kind": "interval", "config": config, "limit_bytes": None, "steps": int(steps),
           "n_layer": int(n_layer), "seq_len": seq_len, "micro_batch": micro_batch,
           "launcher": launcher or None, "extra_args": list(extra), "rows": rows}
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(doc, f, indent=2)
        f.write("\n")
    with open(os.path.join(out, "results.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({k: ("" if r.get(k) is None else str(r[k]).lower() if isinstance(r[k], bool) else r[k])
                        for k in FIELDS})

    def ratio(v, base):
        return "—" if v is None or not base else f"{v / base:.2f}x"

    def of_none(v, base, extra=""):
        parts = ([f"{ratio(v, base)} of none"] if v is not None and base else []) + ([extra] if extra else [])
        return f" ({'; '.join(parts)})" if parts else ""

    def err(meas, pred):
        return "—" if meas is None or pred is None or not meas else f"{(pred - meas) / meas * 100:+.1f}%"

    base_act = ref["activation_peak_bytes"] if ref else None
    base_ms = ref["step_ms"] if ref else None
    lines = ["# Activation memory and step time vs checkpoint interval k", "",
             f"Recipe `{config}` (L = {n_layer} blocks), micro-batch {micro_batch}, sequence length {seq_len}, "
             f"{steps} steps per run (grad_accum 1); medians exclude the first step. `predicted` is the "
             "analytic model (`predicted_activation_peak_bytes`).", "",
             "| run | checkpointed segments | activation peak (MiB) | predicted (MiB) | predicted − measured "
             "| vs none | peak allocated (MiB) | step (ms) | vs none |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        name = "none" if r["k"] is None else f"interval k={r['k']}"
        segs = ("—" if r["segments"] is None else f"{r['checkpointed_segments']} of {r['segments']}")
        if not r["fits"]:
            lines.append(f"| {name} | {segs} | out of memory | {mib(r['predicted_activation_peak_bytes'])} "
                         "| — | — | — | — | — |")
            continue
        lines.append(f"| {name} | {segs} | {mib(r['activation_peak_bytes'])} | "
                     f"{mib(r['predicted_activation_peak_bytes'])} | "
                     f"{err(r['activation_peak_bytes'], r['predicted_activation_peak_bytes'])} | "
                     f"{ratio(r['activation_peak_bytes'], base_act)} | {mib(r['peak_bytes'])} | "
                     f"{num(r['step_ms'], '.1f')} | {ratio(r['step_ms'], base_ms)} |")
    fit = [r for r in rows if r["k"] is not None and r["fits"]]
    lines.append("")
    if fit:
        lo = min(fit, key=lambda r: r["activation_peak_bytes"])
        lines.append(f"- smallest measured activation peak: **k = {lo['k']}**, "
                     f"{mib(lo['activation_peak_bytes'])} MiB{of_none(lo['activation_peak_bytes'], base_act)}")
        # Runs that checkpoint something (with skip_last, k >= L keeps its only segment: same as none).
        ck = [r for r in fit if r["checkpointed_segments"]]
        if ck:
            fast = min(ck, key=lambda r: r["step_ms"])
            lines.append(f"- fastest run that checkpoints: **k = {fast['k']}**, {num(fast['step_ms'], '.1f')} ms/step"
                         f"{of_none(fast['step_ms'], base_ms, 'step times of runs this short are noisy')}")
        kept = [r["k"] for r in fit if r["checkpointed_segments"] == 0]
        if kept:
            lines.append(f"- k = {', '.join(map(str, kept))}: no segment checkpointed (the last segment is kept, "
                         "`checkpointing.skip_last`), so memory and time match none")
    else:
        lines.append("- no interval run fit")
    text = "\n".join(lines) + "\n"
    with open(os.path.join(out, "results.md"), "w") as f:
        f.write(text)
    os.remove(os.path.join(out, "rows.jsonl"))
    print(text, end="")

cmd = sys.argv[1]
{"row": cmd_row, "finish": cmd_finish, "nlayer": cmd_nlayer}[cmd](*sys.argv[2:])
PY
)"
py() { "$PYTHON" -c "$PYHELP" "$@"; }

SKIP_FIRST=$(( STEPS > 1 ? 1 : 0 ))
# run_one NAME K: K empty = mode none. Returns 0 when it fit, 1 when out of memory; exits otherwise.
run_one() {
  local name="$1" k="$2" run_dir log rc=0
  run_dir="$OUT/runs/$name"
  log="$run_dir.log"
  local -a cmd=("${LAUNCH[@]}" "$TRAINER" --config "$CONFIG_PATH" "${EXTRA[@]}")
  if [[ -z "$k" ]]; then
    cmd+=(--set checkpointing.mode=none --set checkpointing.interval=0)
  else
    cmd+=(--set checkpointing.mode=interval --set "checkpointing.interval=$k")
  fi
  cmd+=(--set checkpointing.segments=0 --set "checkpointing.recompute=[]"
        --set train.grad_accum=1 --set "train.steps=$STEPS" --set train.eval_interval=0
        --set "logging.dir=$run_dir" --set logging.overwrite=true --set logging.progress=false --set "logging.skip_first=$SKIP_FIRST")
  (cd "$ROOT" && "${cmd[@]}") > "$log" 2>&1 || rc=$?
  case "$rc" in
    0|4) py row "$ROWS" "$([[ -z "$k" ]] && echo none || echo interval)" "$k" "$rc" "$run_dir" ||
           die "run $name: exit $rc but no usable $run_dir/summary.json; log: $log"
         return $(( rc == 0 ? 0 : 1 )) ;;
    130|143) echo "$PROG: interrupted (trainer exit $rc); log: $log" >&2; exit "$rc" ;;
    *) echo "$PROG: run $name failed with exit code $rc; log: $log" >&2
       tail -n 5 "$log" >&2 || true
       exit 1 ;;
  esac
}

echo "$PROG: $CONFIG, $STEPS steps per run -> $OUT"
run_one none "" || true
L="$(py nlayer "$OUT/runs/none")" || die "cannot read model.n_layer (the reference run did not start; see $OUT/runs/none.log)"
echo "$PROG: L = $L blocks: interval k = 1..$L"
for ((k = 1; k <= L; k++)); do
  run_one "k$k" "$k" || true
done

echo
py finish "$OUT" "$CONFIG" "$STEPS" "$L" "${LAUNCHER:-}" "${EXTRA[@]}"
if (( PLOT )); then
  "$PYTHON" "$ROOT/scripts/plot.py" "$OUT/results.json" || die "plot.py failed (results are in $OUT)"
fi
echo "results: $OUT/results.md $OUT/results.csv $OUT/results.json"
