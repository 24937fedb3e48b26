#!/usr/bin/env python3
"""recompute_modes.py: run the trainer once per checkpointing mode on one fixed CPU recipe and print a
table: median step time, tokens/s, activation peak (peak - model states), recompute share of the
step, and the loss after the last step (identical across modes: the gradients are exact).

Usage: bench/recompute_modes.py [--trainer build/trainer] [--steps 8] [--threads 1] [--out bench/results.json]
       [--set key=value ...]   (extra overrides applied to every mode)
Cost: ~5 minutes on one core with the default recipe (12 layers, d 256, T 256, B 8, 8 steps).
A benchmark, not a test: timings vary with the machine and its load.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

BASE = ["model.n_layer=12", "model.n_embd=256", "model.n_head=8", "model.dropout=0.0",
        "train.seq_len=256", "train.micro_batch=8", "train.grad_accum=1", "train.eval_interval=0",
        "logging.skip_first=2", "logging.interval=1000", "logging.progress=false"]

MODES = [
    ("none", ["checkpointing.mode=none"]),
    ("full", ["checkpointing.mode=full"]),
    ("full, skip_last=false", ["checkpointing.mode=full", "checkpointing.skip_last=false"]),
    ("interval k=2", ["checkpointing.mode=interval", "checkpointing.interval=2"]),
    ("interval k=4", ["checkpointing.mode=interval", "checkpointing.interval=4"]),
    ("interval k=6", ["checkpointing.mode=interval", "checkpointing.interval=6"]),
    ("sqrt (k=3)", ["checkpointing.mode=sqrt"]),
    ("selective [attention, mlp, norm]", ["checkpointing.mode=selective", "checkpointing.recompute=[attention,mlp,norm]"]),
    ("selective [attention]", ["checkpointing.mode=selective", "checkpointing.recompute=[attention]"]),
    ("selective [mlp]", ["checkpointing.mode=selective", "checkpointing.recompute=[mlp]"]),
    ("selective [norm]", ["checkpointing.mode=selective", "checkpointing.recompute=[norm]"]),
]


def run(trainer, root, sets, threads):
    with tempfile.TemporaryDirectory() as d:
        args = [trainer, "--config", "configs/tiny.yaml"]
        for s in sets + [f"logging.dir={d}/run"]:
            args += ["--set", s]
        env = dict(os.environ, OMP_NUM_THREADS=str(threads))
        p = subprocess.run(args, cwd=root, capture_output=True, text=True, env=env)
        if p.returncode != 0:
            sys.exit(f"trainer failed ({p.returncode}): {p.stderr or p.stdout}")
        with open(f"{d}/run/summary.json") as f:
            return json.load(f)


def main():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    ap = argparse.ArgumentParser()
    ap.add_argument("--trainer", default=os.path.join(root, "build", "trainer"))
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--out", default="")
    ap.add_argument("--threads", type=int, default=1, help="intra-op threads (1 gives the steadiest timings)")
    ap.add_argument("--set", action="append", default=[])
    ap.add_argument("--modes", default="", help="semicolon-separated subset of mode names")
    a = ap.parse_args()
    base = BASE + [f"train.steps={a.steps}"] + a.set
    wanted = [m.strip() for m in a.modes.split(";") if m.strip()]
    rows, ref = [], None
    for name, sets in MODES:
        if wanted and name not in wanted:
            continue
        s = run(a.trainer, root, base + sets, a.threads)
        row = {"mode": name, "median_step_ms": s["median_step_ms"], "tokens_per_s": s["median_tokens_per_s"],
               "activation_peak_bytes": s["median_activation_peak_bytes"],
               "predicted_activation_peak_bytes": s["predicted_activation_peak_bytes"],
               "recompute_share": s["median_recompute_ms"] / s["median_step_ms"], "final_loss": s["final_loss"]}
        ref = ref or row
        row["time_vs_none"] = row["median_step_ms"] / ref["median_step_ms"]
        row["activation_vs_none"] = row["activation_peak_bytes"] / ref["activation_peak_bytes"]
        rows.append(row)
        print(f"| {name} | {row['median_step_ms']:.0f} | {row['time_vs_none']:.2f}x | {row['tokens_per_s']:.0f} | "
              f"{row['activation_peak_bytes'] / 2**20:.1f} MiB | {row['predicted_activation_peak_bytes'] / 2**20:.1f} MiB | "
              f"{100 * row['activation_vs_none']:.0f}% | "
              f"{100 * row['recompute_share']:.0f}% | {row['final_loss']:.6f} |", flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"recipe": base, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    print("| mode | step ms | vs none | tok/s | activation peak | formula | vs none | recompute share | final loss |")
    print("|---|---|---|---|---|---|---|---|---|")
    main()
