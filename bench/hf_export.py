#!/usr/bin/env python3
"""hf_export.py: what `trainer export` and `model.init_from` cost at the GPT-2 124M shape.

Trains one step of configs/gpt2_124m.yaml (seq 64, micro-batch 1, CPU) with the training state saved
at the end (1.4 GiB: weights + two AdamW moments), then times:
  - `trainer export --run` from that state, fp32 and bf16 (wall time, file size, the peak tracked tensor
    memory export reports, the process's peak RSS);
  - transformers' `AutoModelForCausalLM.from_pretrained` on the export (wall time) and its loss on one
    sequence of the corpus;
  - a trainer run of one step started from the export (`model.init_from`), and its load time.
Prints a markdown table and writes JSON (--out).

Usage: bench/hf_export.py [--trainer build/trainer] [--threads 2] [--dir /tmp/...] [--out bench/hf_export.json]
Cost: ~1-2 minutes on 2 cores. A benchmark, not a test: timings vary with the machine, disk and load.
"""
import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

SHAPE = ["--config", "configs/gpt2_124m.yaml", "--set", "train.seq_len=64", "--set", "train.micro_batch=1",
         "--set", "train.grad_accum=1", "--set", "train.device=cpu", "--set", "train.eval_interval=0",
         "--set", "logging.progress=false", "--set", "logging.overwrite=true", "--set", "train.steps=1"]


def run(cmd, threads):
    """Runs cmd; returns (seconds, stdout+stderr, peak RSS of that process in bytes)."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    t0 = time.time()
    with tempfile.TemporaryFile("w+") as log:
        p = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
        _, status, usage = os.wait4(p.pid, 0)
        p.returncode = os.waitstatus_to_exitcode(status)
        log.seek(0)
        text = log.read()
    dt = time.time() - t0
    if p.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed ({p.returncode}):\n{text[-3000:]}")
    return dt, text, usage.ru_maxrss * 1024


def export(trainer, run_dir, dtype, out, threads):
    dt, text, rss = run([trainer, "export", "--run", run_dir, "--dtype", dtype, "--out", out], threads)
    peak = int(re.search(r"peak_tensor_bytes=(\d+)", text).group(1))
    return {"dtype": dtype, "export_s": round(dt, 2), "file_bytes": os.path.getsize(os.path.join(out, "model.safetensors")),
            "peak_tensor_bytes": peak, "peak_rss_bytes": rss}


def hf_load(out, threads):
    code = f"""
import time, torch, numpy as np
torch.set_num_threads({threads})
from transformers import AutoModelForCausalLM
t0 = time.time()
m = AutoModelForCausalLM.from_pretrained({out!r}, dtype=torch.float32)
t1 = time.time()
tok = np.fromfile('data/corpus_val.bin', dtype=np.uint16)[256:256 + 65].astype('int64')
x = torch.from_numpy(tok)[None]
with torch.no_grad():
    loss = m(input_ids=x, labels=x).loss.item()
print(f"RESULT {{t1 - t0:.3f}} {{loss:.4f}}")
"""
    dt, text, _ = run([sys.executable, "-c", code], threads)
    load_s, loss = re.search(r"RESULT (\S+) (\S+)", text).groups()
    return {"from_pretrained_s": float(load_s), "loss_one_sequence": float(loss)}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trainer", default="build/trainer")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dir", default=None)
    p.add_argument("--out", default="bench/hf_export.json")
    a = p.parse_args()
    base = a.dir or tempfile.mkdtemp(prefix="sublinear-hf-export-")
    run_dir = os.path.join(base, "run")
    shutil.rmtree(run_dir, ignore_errors=True)
    train_s, _, _ = run([a.trainer] + SHAPE + ["--set", f"logging.dir={run_dir}", "--set", f"train.threads={a.threads}"],
                        a.threads)
    rows = [export(a.trainer, run_dir, d, os.path.join(base, d), a.threads) for d in ("fp32", "bf16")]
    rows[0].update(hf_load(os.path.join(base, "fp32"), a.threads))
    init_dir = os.path.join(base, "init")
    init_s, text, _ = run([a.trainer] + SHAPE + ["--set", f"logging.dir={init_dir}", "--set",
                                                 f"model.init_from={os.path.join(base, 'fp32')}", "--set",
                                                 f"train.threads={a.threads}"], a.threads)
    load_ms = float(re.search(r"weights from .* in (\d+) ms", text).group(1))
    result = {"shape": "gpt2-124m", "train_1_step_and_save_s": round(train_s, 1), "exports": rows,
              "init_from_run_s": round(init_s, 1), "init_from_load_ms": load_ms}
    print("| dtype | export s | file | peak tensor memory | peak RSS |")
    print("|---|---|---|---|---|")
    for r in rows:
        rss = f"{r['peak_rss_bytes'] / 2**20:.0f} MiB"
        print(f"| {r['dtype']} | {r['export_s']} | {r['file_bytes'] / 2**20:.0f} MiB | "
              f"{r['peak_tensor_bytes'] / 2**20:.1f} MiB | {rss} |")
    print(f"transformers from_pretrained {rows[0]['from_pretrained_s']} s, loss on one val sequence "
          f"{rows[0]['loss_one_sequence']}; init_from load {load_ms:.0f} ms")
    with open(a.out, "w") as f:
        json.dump(result, f, indent=2)
    if not a.dir:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
