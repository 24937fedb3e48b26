#!/usr/bin/env python3
"""state_async.py: what a training-state save costs the step loop, synchronous (state.async: false)
against asynchronous (state.async: true, the default), on the GPT-2 124M shape on the CPU, where the
state (fp32 weights and two AdamW moments, 1.4 GiB) is large against a step.

Each round runs the same steps three ways, interleaved: without saves, saving every `--every` steps
synchronously, and asynchronously. A save's cost to the loop is the extra wall time of the loop
(summary.json's wall_s) over the run without saves, per save. Beside it: what the steps waited for
per save (the `state_saved` events' blocking_ms: the whole save when synchronous; the host snapshot
plus the publication when asynchronous), the snapshot alone and its copy rate, the write (save_ms),
and the median step time of the steps a background write overlaps against the others (on a 2-core
CPU the writer's checksum and write calls share the cores with training).

Usage: bench/state_async.py [--trainer build/trainer] [--threads 2] [--rounds 2] [--steps 23] [--every 6]
                            [--dir DIR] [--out bench/results/state_async_<cpu>.json]
Cost: ~4 minutes on 2 cores with the defaults, and 3 x 1.4 GiB of disk at a time.
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

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_util import cpu_model, slug  # noqa: E402

SHAPE = ["--config", "configs/gpt2_124m.yaml", "--set", "train.seq_len=64", "--set", "train.micro_batch=1",
         "--set", "train.grad_accum=1", "--set", "train.device=cpu", "--set", "train.eval_interval=0",
         "--set", "logging.progress=false", "--set", "logging.skip_first=0", "--set", "logging.overwrite=true",
         "--set", "state.at_end=false", "--set", "state.keep=1"]
WAYS = {"no saves": ["--set", "state.every=0"],
        "synchronous": ["--set", "state.async=false"],
        "asynchronous": ["--set", "state.async=true"]}


def records(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def run_once(trainer, way, steps, every, threads, run_dir):
    shutil.rmtree(run_dir, ignore_errors=True)
    args = SHAPE + ["--set", f"train.steps={steps}", "--set", f"state.every={every}", "--set", f"train.threads={threads}",
                    "--set", f"logging.dir={run_dir}"] + WAYS[way]
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    p = subprocess.run([trainer] + args, env=env, capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit(f"trainer failed ({p.returncode}):\n{p.stdout[-2000:]}\n{p.stderr[-2000:]}")
    with open(os.path.join(run_dir, "summary.json")) as f:
        summary = json.load(f)
    recs = records(run_dir)
    shutil.rmtree(run_dir, ignore_errors=True)
    return summary, recs


def overlapped_steps(recs):
    """Steps that ran while a background write was in flight: after a snapshot, up to its publication."""
    inflight, out = None, set()
    for r in recs:
        if r.get("event") == "state_snapshot":
            inflight = r["step"]
        elif r.get("event") == "state_saved" and r["step"] == inflight:
            inflight = None
        elif "event" not in r and inflight is not None:
            out.add(r["step"])
    return out


def measure(summary, recs, base_wall):
    saves = [r for r in recs if r.get("event") == "state_saved"]
    snaps = [r for r in recs if r.get("event") == "state_snapshot"]
    steps = [r for r in recs if "event" not in r and r["step"] > 1]
    row = {"wall_s": summary["wall_s"], "saves": len(saves),
           "median_step_ms": statistics.median(r["step_ms"] for r in steps)}
    if not saves:
        return row
    over = overlapped_steps(recs)
    row.update({
        "state_bytes": saves[-1]["bytes"],
        "loop_cost_per_save_ms": 1e3 * (summary["wall_s"] - base_wall) / len(saves),
        "median_blocking_ms": statistics.median(r["blocking_ms"] for r in saves),
        "median_save_ms": statistics.median(r["save_ms"] for r in saves),
    })
    if snaps:
        snap_ms = statistics.median(r["snapshot_ms"] for r in snaps)
        row.update({"snapshot_bytes": snaps[-1]["snapshot_bytes"], "median_snapshot_ms": snap_ms,
                    "snapshot_gb_per_s": snaps[-1]["snapshot_bytes"] / (snap_ms * 1e-3) / 1e9,
                    "median_step_ms_write_in_flight": statistics.median(r["step_ms"] for r in steps if r["step"] in over)
                    if any(r["step"] in over for r in steps) else None,
                    "median_step_ms_no_write": statistics.median(r["step_ms"] for r in steps if r["step"] not in over)})
    return row


def median_rows(rows):
    keys = [k for k in rows[0] if all(isinstance(r.get(k), (int, float)) for r in rows)]
    out = {k: statistics.median(r[k] for r in rows) for k in keys}
    out["rounds"] = len(rows)
    return out


def fmt(v, unit="", digits=0):
    return "-" if v is None else f"{v:.{digits}f}{unit}"


def table(result):
    lines = ["| way | saves | loop cost per save | steps waited per save | snapshot | write (save_ms) | "
             "median step | step with a write in flight |", "|---|---|---|---|---|---|---|---|"]
    for way, r in result["ways"].items():
        snap = (f"{r['snapshot_bytes'] / 2**30:.2f} GiB in {r['median_snapshot_ms']:.0f} ms "
                f"({r['snapshot_gb_per_s']:.1f} GB/s)") if "snapshot_bytes" in r else "-"
        lines.append(f"| {way} | {r['saves']:.0f} | {fmt(r.get('loop_cost_per_save_ms'), ' ms')} | "
                     f"{fmt(r.get('median_blocking_ms'), ' ms')} | {snap} | {fmt(r.get('median_save_ms'), ' ms')} | "
                     f"{r['median_step_ms']:.0f} ms | {fmt(r.get('median_step_ms_write_in_flight'), ' ms')} |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trainer", default="build/trainer")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=23)
    ap.add_argument("--every", type=int, default=6)
    ap.add_argument("--dir", default=None, help="where the runs go (default: a temporary directory)")
    ap.add_argument("--out", default=None, help="also write the result as JSON here")
    a = ap.parse_args()
    base = a.dir or tempfile.mkdtemp(prefix="sublinear-state-async-")
    per_way = {w: [] for w in WAYS}
    for rnd in range(a.rounds):
        base_wall = None
        for way in WAYS:
            summary, recs = run_once(a.trainer, way, a.steps, a.every, a.threads, os.path.join(base, slug(way)))
            if way == "no saves":
                base_wall = summary["wall_s"]
            per_way[way].append(measure(summary, recs, base_wall))
            print(f"round {rnd + 1}/{a.rounds}, {way}: loop {summary['wall_s']:.1f} s", file=sys.stderr)
    result = {"cpu": cpu_model(), "threads": a.threads, "steps": a.steps, "every": a.every,
              "shape": "gpt2-124m, seq_len 64, micro_batch 1, fp32, CPU",
              "ways": {w: median_rows(rows) for w, rows in per_way.items()}}
    print(f"{result['shape']}; {a.threads} threads; {result['cpu']}; medians of {a.rounds} rounds")
    print(table(result))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=2)
    if not a.dir:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
