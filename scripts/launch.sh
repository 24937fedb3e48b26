#!/usr/bin/env bash
# launch.sh: runs build/trainer under torchrun (the launcher that ships with the torch wheel), one
# process per GPU, or per CPU rank with Gloo. Options before `--` go to torchrun, after it to the trainer.
#
#   scripts/launch.sh -n 2 -- --config configs/tiny.yaml --set parallel.sharding=zero2
#   scripts/launch.sh -n 8 --nnodes 2 --node-rank 0 --rdzv-endpoint host0:29500 -- --config configs/7b_ckpt.yaml
#
# One machine (no --nnodes): torchrun --standalone picks a free port. Multi-node: give torchrun's
# usual --nnodes/--node-rank/--rdzv-endpoint (or --master-addr/--master-port) on every node.
# Elastic restarts: --max-restarts N (any torchrun option passes through) restarts every rank when one
# dies, up to N times; with the trainer's --resume auto each restart continues from the newest state:
#   scripts/launch.sh -n 2 --max-restarts 3 -- --config configs/tiny.yaml --set state.every=50 \
#       --set logging.dir=runs/tiny-elastic --resume auto
# (name logging.dir: a restart before the first save then starts over in the same directory).
# Exit status: 0 when every rank exited 0 (with --max-restarts: in the last attempt); otherwise
# torchrun's (1) — each rank's own exit code is in torchrun's report and rank 0's in <run_dir>/summary.json.
set -euo pipefail
PROG=launch.sh
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

usage() {
  cat <<EOF
usage: scripts/launch.sh [-n NPROC] [torchrun options...] -- TRAINER ARGUMENTS...
  -n, --nproc-per-node N   processes on this machine (default: the GPU count, or 2 without GPUs)
  --max-restarts N         torchrun restarts every rank up to N times when one fails; give the trainer
                           --resume auto so that each restart continues from the newest saved state
  any other option before -- goes to torchrun as it is (--nnodes, --rdzv-endpoint, --monitor-interval...)
  environment: TORCHRUN (default: the sublinear venv's torchrun, then PATH), TRAINER (default: build/trainer)
EOF
}
die_usage() { echo "$PROG: $*" >&2; usage >&2; exit 2; }

NPROC=""
TORCHRUN_ARGS=()
MULTINODE=0
while [[ $# -gt 0 ]]; do
  case "$1" in
    -n|--nproc-per-node|--nproc_per_node)
      [[ $# -ge 2 ]] || die_usage "$1 needs a value"
      NPROC="$2"; shift 2 ;;
    --nnodes|--nnodes=*) MULTINODE=1; TORCHRUN_ARGS+=("$1"); shift ;;
    -h|--help) usage; exit 0 ;;
    --) shift; break ;;
    *) TORCHRUN_ARGS+=("$1"); shift ;;
  esac
done
[[ $# -gt 0 ]] || die_usage "no trainer arguments after --; e.g. -- --config configs/tiny.yaml"
if [[ -z "$NPROC" ]]; then
  NPROC=2
  if command -v nvidia-smi >/dev/null 2>&1; then
    gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
    (( gpus > 0 )) && NPROC=$gpus
  fi
fi
[[ "$NPROC" =~ ^[1-9][0-9]*$ ]] || die_usage "--nproc-per-node '$NPROC' is not a positive integer"

VENV="${SUBLINEAR_HOME:-$HOME/.cache/sublinear}/venv"
TORCHRUN="${TORCHRUN:-}"
if [[ -z "$TORCHRUN" ]]; then
  if [[ -x "$VENV/bin/torchrun" ]]; then TORCHRUN="$VENV/bin/torchrun"
  elif command -v torchrun >/dev/null 2>&1; then TORCHRUN="$(command -v torchrun)"
  else echo "$PROG: torchrun not found: run scripts/setup.sh (it installs the torch wheel) or set TORCHRUN" >&2; exit 2
  fi
fi
TRAINER="${TRAINER:-$ROOT/build/trainer}"
[[ -x "$TRAINER" ]] || { echo "$PROG: $TRAINER is not built: run scripts/setup.sh" >&2; exit 2; }

STANDALONE=()
(( MULTINODE )) || STANDALONE=(--standalone)
# One intra-op thread per rank unless the caller chose (torchrun would set 1 and warn).
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
exec "$TORCHRUN" "${STANDALONE[@]}" --nproc-per-node "$NPROC" "${TORCHRUN_ARGS[@]}" --no-python "$TRAINER" "$@"
