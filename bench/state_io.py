#!/usr/bin/env python3
"""state_io.py: what saving and resuming the training state costs, for the tiny recipe and a
124M-parameter GPT-2 shape. For each shape: train a few steps saving after every other one
(state.every=2), then resume (--resume auto) for one more step. Prints a table: state size, median
save time, load time (mmap + copy into the model and AdamW; the CRC-32 check is in `resume_s`), the
median step time of the steps right after a save and of the other steps (the first step, a warm-up,
left out): saving happens between steps, so the two should agree. And the whole resume's wall time.

Usage: bench/state_io.py [--trainer build/trainer] [--threads 2] [--dir /tmp/...] [--out bench/state_io.json]
Cost: ~1 minute on 2 cores (the 124M state is 1.4 GiB: weights + two AdamW moments in fp32).
A benchmark, not a test: timings vary with the machine, its disk and its load.
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

SHAPES = {
    "tiny (0.86M params)": ["--config", "configs/tiny.yaml", "--set", "train.micro_batch=16"],
    "gpt2-124m shape": ["--config", "configs/gpt2_124m.yaml", "--set", "train.seq_len=64", "--set",
                        "train.micro_batch=1", "--set", "train.grad_accum=1", "--set", "train.device=cpu"],
}
COMMON = ["--set", "train.steps=9", "--set", "state.every=2", "--set", "train.eval_interval=0", "--set",
          "logging.progress=false", "--set", "logging.skip_first=0", "--set", "logging.overwrite=true"]


def records(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def run(trainer, args, threads):
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    t0 = time.time()
    p = subprocess.run([trainer] + args + ["--set", f"train.threads={threads}"], env=env, capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit(f"trainer failed ({p.returncode}):\n{p.stdout[-2000:]}\n{p.stderr[-2000:]}")
    return time.time() - t0


def measure(trainer, name, args, threads, base):
    run_dir = os.path.join(base, name.split()[0])
    shutil.rmtree(run_dir, ignore_errors=True)
    run(trainer, args + COMMON + ["--set", f"logging.dir={run_dir}"], threads)
    recs = records(run_dir)
    saves = [r for r in recs if r.get("event") == "state_saved"]
    saved_steps = {r["step"] for r in saves}
    steps = [r for r in recs if "event" not in r]
    resume_s = run(trainer, args + COMMON + ["--set", "train.steps=10", "--set", f"logging.dir={run_dir}",
                                             "--resume", "auto"], threads)
    load = [r for r in records(run_dir) if r.get("event") == "resume"][-1]
    return {"shape": name,
            "state_bytes": saves[-1]["bytes"],
            "median_save_ms": statistics.median(r["save_ms"] for r in saves),
            "load_ms": load["load_ms"],
            "median_step_ms_after_a_save": statistics.median(r["step_ms"] for r in steps if r["step"] - 1 in saved_steps),
            "median_step_ms_other_steps": statistics.median(r["step_ms"] for r in steps
                                                            if r["step"] - 1 not in saved_steps and r["step"] > 1),
            "resume_s": resume_s}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trainer", default="build/trainer")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dir", default=None, help="where the runs go (default: a temporary directory)")
    ap.add_argument("--out", default=None, help="also write the rows as JSON here")
    a = ap.parse_args()
    base = a.dir or tempfile.mkdtemp(prefix="sublinear-state-io-")
    rows = [measure(a.trainer, name, args, a.threads, base) for name, args in SHAPES.items()]
    print("| shape | state | save (median) | load | step ms after a save | step ms, other steps | resume wall |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['shape']} | {r['state_bytes'] / 2**20:.1f} MiB | {r['median_save_ms']:.0f} ms | {r['load_ms']:.0f} ms "
              f"| {r['median_step_ms_after_a_save']:.1f} | {r['median_step_ms_other_steps']:.1f} | {r['resume_s']:.1f} s |")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(rows, f, indent=2)
    if not a.dir:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
