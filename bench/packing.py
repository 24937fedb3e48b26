#!/usr/bin/env python3
"""packing.py: trained tokens/s with one padded example a row against packed rows (data.packing), on the
shipped chat example (data/chat_example.jsonl with data/chat_tokenizer/, scripts/make_chat_example.py).

Usage: bench/packing.py [--trainer build/trainer] [--steps 12] [--repeats 3] [--seq-len 256] [--threads 2]
                        [--out FILE.json] [--set key=value ...]  (extra overrides for every run)
Prepares the data once (scripts/prepare_chat.py, --seq-len), then trains a small LLaMA (4 blocks of width
128, vocabulary 512) `--repeats` times each way and prints the median and range over the repeats of the
median tokens/s, trained tokens/s and trained tokens a step, and the planner's predicted peak. The two
ways process the same tokens a step (micro-batch x seq_len); packing fills them with more examples.
Cost: ~2 minutes on 2 cores with the defaults. A benchmark, not a test: timings vary with the machine
and its load (the spread is printed for that).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

from bench_util import cpu_model, venv_python

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = ["model.preset=", "model.arch=llama", "model.n_layer=4", "model.n_embd=128", "model.n_head=4",
         "model.mlp_hidden=320", "model.vocab_size=512", "model.tie_embeddings=false", "model.dropout=0.0"]


def prepare(out, seq_len):
    p = subprocess.run([venv_python(), os.path.join(ROOT, "scripts", "prepare_chat.py"),
                        os.path.join(ROOT, "data", "chat_example.jsonl"), "--tokenizer",
                        os.path.join(ROOT, "data", "chat_tokenizer"), "--seq-len", str(seq_len), "--out", out],
                       capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit(f"prepare_chat failed ({p.returncode}): {p.stderr or p.stdout}")
    return p.stdout.strip()


def train(a, data, packing, run_dir):
    sets = MODEL + [f"data.source=examples", f"data.path={data}/train.bin", f"data.val_path={data}/val.bin",
                    f"data.packing={'true' if packing else 'false'}", f"train.seq_len={a.seq_len}",
                    "train.micro_batch=8", "train.grad_accum=1", f"train.steps={a.steps}", "train.eval_interval=0",
                    "logging.skip_first=2", "logging.progress=false", f"logging.dir={run_dir}"] + a.set
    args = [a.trainer, "--config", os.path.join(ROOT, "configs", "tiny.yaml")]
    for s in sets:
        args += ["--set", s]
    p = subprocess.run(args, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS=str(a.threads)))
    if p.returncode != 0:
        sys.exit(f"trainer failed ({p.returncode}): {p.stderr[-2000:] or p.stdout[-2000:]}")
    with open(os.path.join(run_dir, "summary.json")) as f:
        s = json.load(f)
    return {"tokens_per_s": s["median_tokens_per_s"], "trained_tokens_per_s": s["median_trained_tokens_per_s"],
            "trained_tokens_per_step": s["trained_tokens"] / s["steps"], "predicted_peak_bytes": s["predicted_peak_bytes"],
            "peak_allocated_bytes": s["peak_allocated_bytes"]}


def spread(runs, key):
    v = [r[key] for r in runs]
    return {"median": statistics.median(v), "min": min(v), "max": max(v)}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trainer", default=os.path.join(ROOT, "build", "trainer"))
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", help="write the figures as JSON here")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    a = p.parse_args()
    result = {"cpu": cpu_model(), "seq_len": a.seq_len, "steps": a.steps, "repeats": a.repeats}
    with tempfile.TemporaryDirectory() as d:
        result["data"] = prepare(os.path.join(d, "data"), a.seq_len)
        for name, packing in (("padded", False), ("packed", True)):
            runs = [train(a, os.path.join(d, "data"), packing, os.path.join(d, f"{name}{i}")) for i in range(a.repeats)]
            result[name] = {k: spread(runs, k) for k in runs[0]}
    print(result["data"])
    print(f"{'':8} {'tokens/s':>22} {'trained tokens/s':>22} {'trained/step':>13} {'predicted / peak MiB':>22}")
    for name in ("padded", "packed"):
        r = result[name]
        rate = lambda k: f"{r[k]['median']:8.0f} [{r[k]['min']:.0f}, {r[k]['max']:.0f}]"
        mib = f"{r['predicted_peak_bytes']['median'] / 2**20:.1f} / {r['peak_allocated_bytes']['median'] / 2**20:.1f}"
        print(f"{name:8} {rate('tokens_per_s'):>22} {rate('trained_tokens_per_s'):>22} "
              f"{r['trained_tokens_per_step']['median']:13.0f} {mib:>22}")
    gain = result["packed"]["trained_tokens_per_s"]["median"] / result["padded"]["trained_tokens_per_s"]["median"]
    print(f"packed / padded trained tokens/s: {gain:.2f}x ({result['cpu']}, {a.threads} threads)")
    result["packed_over_padded_trained_tokens_per_s"] = gain
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
