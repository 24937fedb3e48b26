#!/usr/bin/env python3
"""dist_cpu.py: data-parallel throughput and per-rank memory on CPU with Gloo.

Runs the trainer once as 1 rank x 1 thread and once per sharding stage as 2 ranks x 1 thread (each rank
gets the single rank's micro-batch: ideal scaling is a 2.00x tokens/s ratio), launched the way torchrun
launches them (RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT), and prints a table: median tokens/s, the
ratio to one rank, median step time, and rank 0's model-state bytes measured by the tracking
allocator between steps, its transient peak (gathered parameters / unreduced gradients) and its step
peak, next to the planner's per-rank prediction.

Each configuration runs --repeat times, interleaved (1 rank, none, zero1, zero2, zero3, then again), and
the table gives the median run's tokens/s with the range over runs: on a small shared machine two ranks
compete with Gloo's threads for the cores and single runs vary by 20 % or more.

Usage: bench/dist_cpu.py [--trainer build/trainer] [--steps 30] [--repeat 3] [--out bench/dist_cpu.json]
       [--set key=value ...]
Cost: ~1 minute per repeat on 2 cores with the default recipe (configs/tiny.yaml shape: L4 d128, T 128, B 16).
A benchmark, not a test: timings vary with the machine and its load; needs 2 idle cores.
"""
import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASE = ["train.grad_accum=1", "train.eval_interval=0", "train.threads=1", "logging.skip_first=3",
        "logging.interval=1000", "logging.progress=false", "logging.peak_tflops=1"]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(trainer, world, sets, run_dir):
    args = [trainer, "--config", os.path.join(ROOT, "configs/tiny.yaml")]
    for s in BASE + sets + [f"logging.dir={run_dir}"]:
        args += ["--set", s]
    port = str(free_port())
    procs = []
    for r in range(world):
        env = dict(os.environ, OMP_NUM_THREADS="1")
        if world > 1:
            env.update(RANK=str(r), WORLD_SIZE=str(world), LOCAL_RANK=str(r), LOCAL_WORLD_SIZE=str(world),
                       MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        procs.append(subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    outs = [p.communicate()[0].decode() for p in procs]
    for r, p in enumerate(procs):
        if p.returncode != 0:
            sys.exit(f"rank {r} exited {p.returncode}:\n{outs[r][-2000:]}")
    with open(os.path.join(run_dir, "summary.json")) as f:
        return json.load(f)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trainer", default=os.path.join(ROOT, "build/trainer"))
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", default="")
    ap.add_argument("--set", action="append", default=[], dest="sets")
    a = ap.parse_args()
    sets = [f"train.steps={a.steps}"] + a.sets
    configs = [("1 rank", 1, [])] + [(f"2 ranks, {st}", 2, [f"parallel.sharding={st}"])
                                     for st in ["none", "zero1", "zero2", "zero3"]]
    runs = {name: [] for name, _, _ in configs}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(a.repeat):
            for name, world, extra in configs:
                runs[name].append(run(a.trainer, world, sets + extra, os.path.join(tmp, f"{len(runs[name])}-{world}-{extra}")))
    median_run = lambda rs: sorted(rs, key=lambda s: s["median_tokens_per_s"])[len(rs) // 2]
    rows = []
    for name, world, _ in configs:
        s = median_run(runs[name])
        rows.append((name, s, s["parallel"]["ranks"][0] if world > 1 else None,
                     [x["median_tokens_per_s"] for x in runs[name]]))
    base = rows[0][1]
    mib = lambda b: f"{b / 2**20:.2f}"
    t0 = base["median_tokens_per_s"]
    print(f"{a.repeat} runs each; tokens/s of the median run (range over runs)")
    print("| run | tokens/s | ratio | ms/step | model states (MiB, measured) | transient peak (MiB) | step peak (MiB) | planner peak (MiB) |")
    print("|---|---|---|---|---|---|---|---|")
    result = []
    for name, s, r, all_tps in rows:
        states = r["model_state_bytes_measured"] if r else base["memory_breakdown"]["params_bytes"] + \
            base["memory_breakdown"]["grads_bytes"] + base["memory_breakdown"]["optimizer_state_bytes"]
        transient = r["transient_peak_bytes"] if r else 0
        peak = r["peak_allocated_bytes"] if r else s["peak_allocated_bytes"]
        print(f"| {name} | {s['median_tokens_per_s']:.0f} ({min(all_tps):.0f}-{max(all_tps):.0f}) | {s['median_tokens_per_s'] / t0:.2f}x | "
              f"{s['median_step_ms']:.1f} | {mib(states)} | {mib(transient)} | {mib(peak)} | {mib(s['predicted_peak_bytes'])} |")
        result.append({"run": name, "tokens_per_s": s["median_tokens_per_s"], "tokens_per_s_runs": all_tps,
                       "ratio": s["median_tokens_per_s"] / t0,
                       "step_ms": s["median_step_ms"], "model_state_bytes": states, "transient_peak_bytes": transient,
                       "peak_bytes": peak, "predicted_peak_bytes": s["predicted_peak_bytes"]})
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
