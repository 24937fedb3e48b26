#!/usr/bin/env bash
# sweep_interval.sh: activation memory and step time for checkpoint interval k = 1 .. L, measured
# against the planner's analytic prediction, with mode none as the reference.
#
#   scripts/sweep_interval.sh CONFIG [--steps N] [--out DIR] [--no-plot] [-- extra trainer args]
#
# One short real run per k (checkpointing.mode: interval, checkpointing.interval: k, skip_last as the
# recipe says) plus one with mode none, each in OUT/runs/<name> (console output in OUT/runs/<name>.log).
# Writes OUT/results.csv, OUT/results.json ("kind": "interval") and OUT/results.md, prints the table and
# draws OUT/activation_vs_k.png and OUT/step_time_vs_k.png with scripts/plot.py (skip with --no-plot).
# Cost: L + 1 trainer runs of N steps each; on configs/tiny.yaml (L = 4) with --steps 2 about 5 s.
# Environment: TRAINER (default <repo>/build/trainer), LAUNCHER (command prefix, e.g.
# "torchrun --no-python --nproc-per-node 2"), PYTHON (default the project venv's interpreter).
# Exit status: 0 done; 1 a run failed (its log path is printed); 2 usage error.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PROG="sweep_interval.sh"
usage() {
  cat <<EOF
usage: scripts/$PROG CONFIG [--steps N] [--out DIR] [--no-plot] [-- extra trainer args]
  CONFIG     YAML recipe, e.g. configs/tiny.yaml
  --steps N  training steps per run (default 3; the first is excluded from the medians)
  --out DIR  output directory, must be new or empty (default runs/sweep_interval-<timestamp>)
  --no-plot  do not run scripts/plot.py
env: TRAINER (trainer binary), LAUNCHER (command prefix), PYTHON (interpreter with matplotlib)
EOF
}
die_usage() { echo "$PROG: $*" >&2; usage >&2; exit 2; }

CONFIG="" STEPS=3 OUT="" PLOT=1 EXTRA=()
while (($#)); do
  case "$1" in
    -h|--help) usage; exit 0 ;;
    --steps|--out) (($# >= 2)) || die_usage "$1 needs a value"
                   if [[ "$1" == --steps ]]; then STEPS="$2"; else OUT="$2"; fi; shift 2 ;;
    --no-plot) PLOT=0; shift ;;
    --) shift; EXTRA=("$@"); break ;;
    -*) die_usage "unknown option: $1" ;;
    *) [[ -z "$CONFIG" ]] || die_usage "unexpected argument: $1"; CONFIG="$1"; shift ;;
  esac
done
[[ -n "$CONFIG" ]] || die_usage "missing CONFIG"
[[ "$CONFIG" == /* || -e "$CONFIG" ]] && CONFIG_PATH="$(realpath "$CONFIG")" || CONFIG_PATH="$ROOT/$CONFIG"
[[ -f "$CONFIG_PATH" ]] || die_usage "config not found: $CONFIG"
[[ "$STEPS" =~ ^[1-9][0-9]{0,5}$ ]] || die_usage "--steps must be a positive integer, got '$STEPS'"
TRAINER="${TRAINER:-$ROOT/build/trainer}"
[[ -x "$TRAINER" ]] || { echo "$PROG: trainer not found: $TRAINER (build it with scripts/setup.sh)" >&2; exit 1; }
PYTHON="${PYTHON:-${SUBLINEAR_HOME:-$HOME/.cache/sublinear}/venv/bin/python}"
[[ -x "$PYTHON" ]] || PYTHON=python3
LAUNCH=()
[[ -n "${LAUNCHER:-}" ]] && read -ra LAUNCH <<< "$LAUNCHER"
[[ -n "$OUT" ]] || OUT="$ROOT/runs/sweep_interval-$(date +%Y%m%d-%H%M%S)"
mkdir -p "$OUT"
OUT="$(realpath "$OUT")"
[[ -z "$(ls -A "$OUT")" ]] || die_usage "--out must be new or empty: $OUT"
mkdir -p "$OUT/runs"

# run NAME ARGS...: one trainer run into OUT/runs/NAME; exits on failure with the log path.
run() {
  local name="$1" rc=0
  shift
  (cd "$ROOT" && "${LAUNCH[@]}" "$TRAINER" --config "$CONFIG_PATH" "${EXTRA[@]}" "$@" \
     --set "train.steps=$STEPS" --set train.eval_interval=0 --set logging.progress=false \
     --set "logging.skip_first=$(( STEPS > 1 ? 1 : 0 ))" --set "logging.dir=$OUT/runs/$name") \
    > "$OUT/runs/$name.log" 2>&1 || rc=$?
  if (( rc != 0 )); then
    echo "$PROG: run $name failed with exit code $rc; log: $OUT/runs/$name.log" >&2
    tail -n 5 "$OUT/runs/$name.log" >&2 || true
    exit 1
  fi
  echo "$PROG: $name done"
}

echo "$PROG: $CONFIG, $STEPS steps per run -> $OUT"
run none --set checkpointing.mode=none
L="$("$PYTHON" -c 'import json,sys; print(json.load(open(sys.argv[1]))["config"]["model"]["n_layer"])' \
      "$OUT/runs/none/summary.json")"
for ((k = 1; k <= L; ++k)); do
  run "k$k" --set checkpointing.mode=interval --set "checkpointing.interval=$k" --set checkpointing.segments=0
done

"$PYTHON" - "$OUT" "$CONFIG" "$STEPS" "$L" <<'PY'
import csv, json, os, sys
out, config, steps, L = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
rows = []
for name, k in [("none", None)] + [(f"k{k}", k) for k in range(1, L + 1)]:
    with open(os.path.join(out, "runs", name, "summary.json")) as f:
        s = json.load(f)
    rows.append({"k": k, "mode": "none" if k is None else "interval", "fits": True,
                 "activation_peak_bytes": s["median_activation_peak_bytes"],
                 "predicted_activation_peak_bytes": s["predicted_activation_peak_bytes"],
                 "peak_bytes": s["peak_allocated_bytes"], "step_ms": s["median_step_ms"],
                 "tokens_per_s": s["median_tokens_per_s"], "run_dir": name})
seq_len = s["config"]["train"]["seq_len"]
with open(os.path.join(out, "results.json"), "w") as f:
    json.dump({"kind": "interval", "config": config, "steps": steps, "n_layer": L, "seq_len": seq_len,
               "rows": rows}, f, indent=2)
fields = list(rows[0].keys())
with open(os.path.join(out, "results.csv"), "w", newline="") as f:
    w = csv.DictWriter(f, fieldnames=fields)
    w.writeheader()
    w.writerows(rows)
mib = lambda b: f"{b / 2**20:.1f}"
none = rows[0]
lines = [f"# Checkpoint interval sweep", "", f"Recipe `{config}`, {L} layers, sequence length {seq_len}, "
         f"{steps} steps per run; medians exclude the first step.", "",
         "| k | activation peak (MiB) | predicted (MiB) | error | vs none | step ms | vs none |",
         "|---|---:|---:|---:|---:|---:|---:|"]
for r in rows:
    err = (r["predicted_activation_peak_bytes"] - r["activation_peak_bytes"]) / r["activation_peak_bytes"]
    lines.append(f"| {'none' if r['k'] is None else r['k']} | {mib(r['activation_peak_bytes'])} | "
                 f"{mib(r['predicted_activation_peak_bytes'])} | {100 * err:+.1f}% | "
                 f"{100 * r['activation_peak_bytes'] / none['activation_peak_bytes']:.0f}% | {r['step_ms']:.1f} | "
                 f"{r['step_ms'] / none['step_ms']:.2f}x |")
text = "\n".join(lines) + "\n"
open(os.path.join(out, "results.md"), "w").write(text)
print(text, end="")
PY
if ((PLOT)); then "$PYTHON" "$ROOT/scripts/plot.py" "$OUT/results.json"; fi
echo "results: $OUT/results.md $OUT/results.csv $OUT/results.json"
