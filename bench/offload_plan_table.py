#!/usr/bin/env python3
"""What each offload placement buys a 7B fine-tune on one 24 GB GPU, from `trainer plan` (no GPU needed).

For configs/7b_24gb.yaml (LLaMA-2-7B shape, bf16 compute copy, full checkpointing, micro-batch 4 x 4)
it asks the planner for five placements: no offload, + optimizer, + gradients, + parameters (zero3),
+ activations, and prints a Markdown table of device peak, host memory, bytes moved per step and the
modelled step time on the recipe's hardware (offload.bandwidth_gbps, offload.overlap, offload.host_gbps,
logging.peak_tflops at budget::kModelledMfu). docs/offload.md holds its output.

    python3 bench/offload_plan_table.py [--trainer build/trainer] [--config configs/7b_24gb.yaml] [--memory 24GB]
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

GIB = 1024 ** 3

PLACEMENTS = [
    ("no offload", ["parallel.sharding=zero2", "offload.optimizer=false", "offload.gradients=false"]),
    ("optimizer (masters + moments, AdamW on host)", ["parallel.sharding=zero2", "offload.optimizer=true", "offload.gradients=false"]),
    ("+ gradients", ["parallel.sharding=zero2", "offload.optimizer=true", "offload.gradients=true"]),
    ("+ parameters (zero3)", ["parallel.sharding=zero3", "offload.optimizer=true", "offload.gradients=true", "offload.parameters=true"]),
    ("+ activations", ["parallel.sharding=zero3", "offload.optimizer=true", "offload.gradients=true", "offload.parameters=true",
                       "offload.activations=true"]),
]


def plan(trainer, config, memory, sets):
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "plan.json")
        cmd = [trainer, "plan", "--config", config, "--memory", memory, "--out", out]
        for s in sets:
            cmd += ["--set", s]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            sys.exit(f"{' '.join(cmd)} failed ({r.returncode}):\n{r.stderr}{r.stdout}")
        with open(out) as f:
            return json.load(f)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trainer", default="build/trainer")
    ap.add_argument("--config", default="configs/7b_24gb.yaml")
    ap.add_argument("--memory", default="24GB")
    args = ap.parse_args()
    if not os.path.exists(args.trainer):
        sys.exit(f"no trainer at {args.trainer}: build it first (README Quick start)")
    rows = []
    compute_s = None
    for name, sets in PLACEMENTS:
        j = plan(args.trainer, args.config, args.memory, sets)
        o = j.get("offload")
        device = j["modes"][0]["peak_bytes"]
        if o:
            compute_s = o["compute_s"]
            rows.append((name, device, o["host_peak_bytes"], o["to_host_bytes_per_step"], o["to_device_bytes_per_step"],
                         o["step_s"], o["exposed_transfer_s"], o["host_adamw_s"]))
        else:
            rows.append((name, device, 0, 0, 0, None, 0.0, 0.0))
    limit = j["memory_bytes"]
    print(f"`python3 bench/offload_plan_table.py` ({args.config}, per step of {j['micro_batch']} x {j['grad_accum']} x "
          f"{j['seq_len']} tokens; fits = device peak <= {limit / GIB:.1f} GiB)\n")
    print("| placement | device peak GiB | fits | host GiB | to host GiB/step | to device GiB/step | "
          "exposed transfer s | host AdamW s | modelled step s |")
    print("|---|---:|:-:|---:|---:|---:|---:|---:|---:|")
    for name, device, host, th, td, step, exposed, adam in rows:
        step = compute_s if step is None else step  # no offload: compute alone
        print(f"| {name} | {device / GIB:.1f} | {'yes' if device <= limit else 'no'} | {host / GIB:.1f} | {th / GIB:.1f} | "
              f"{td / GIB:.1f} | {exposed:.2f} | {adam:.2f} | {step:.1f} |")


if __name__ == "__main__":
    main()
