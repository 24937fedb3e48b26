#!/usr/bin/env python3
"""offload.py: step time, device and host memory, and bytes moved per step, for each offload placement on CPU.

On one GPT-2-style CPU recipe (8 layers, d 256, 4 heads, T 256, micro-batch 4 x grad_accum 2, synthetic
data, fp32, checkpointing.mode full) it trains five placements, each against the sharding stage it needs:

  no offload      parallel.sharding zero2
  optimizer       zero2 + offload.optimizer       (fp32 masters + AdamW moments on the host, AdamW on the host)
  + gradients     zero2 + optimizer + gradients   (the gradient shard accumulated on the host)
  + parameters    zero3 + optimizer + gradients + parameters
  + activations   zero3 + all four                (checkpointed blocks' inputs on the host)

Rounds are interleaved (every placement once per round, the order reversed every other round) so the
machine's load hits all placements alike; each figure is the median over rounds (step time: of each run's
median step after logging.skip_first warm-up steps, summary.json median_step_ms). Per placement it
reports the median step time, the measured device peak (summary peak_allocated_bytes) and host peak
(summary host_memory.peak_bytes) next to the planner's predictions (predicted_peak_bytes,
host_memory.predicted_peak_bytes), the bytes moved per step to host / to device (the last step record of
metrics.jsonl) next to `trainer plan`'s offload model (to_*_bytes_per_step, transfer_s at
offload.bandwidth_gbps), and checks that the loss of every step is bitwise the same in every run (offload
moves tensors, it must not change a number; a mismatch prints a WARNING, it does not stop the bench).

It also measures this machine's host copy bandwidth with torch (the project venv's interpreter: a 256 MiB
fp32 tensor copied into a preallocated one, median of repeats, GB/s = 1e9 bytes/s of payload) and prints
it next to offload.bandwidth_gbps (25 GB/s, PCIe 4.0 x16 with pinned memory). On a CPU-only machine the
"device" is simulated (a tracking allocator counts device and host memory in two pools), so a host <->
device transfer is a memcpy within the same RAM: the step times here show the bookkeeping and copy cost
of offload on this CPU, not a PCIe link.

Writes <out>.json (every run, the medians, the bandwidth), <out>.md (table) and <out>.png (step time per
placement; device vs host peak per placement, measured bars and predicted markers). <out> defaults to
bench/results/offload_<cpu> (<cpu> from the trainer's summary.json environment.cpu.cpu_model, e.g.
offload_amd-epyc). --from-json re-renders the table and plot from a saved .json.

Usage: ~/.cache/sublinear/venv/bin/python bench/offload.py [--trainer build/trainer] [--rounds 2] [--steps 6]
                                  [--threads 2] [--out bench/results/offload_<cpu>] [--set key=value ...]
       ~/.cache/sublinear/venv/bin/python bench/offload.py --from-json bench/results/offload_amd-epyc.json
Cost: 5 runs per round. A step takes ~0.65 s on 2 idle cores (AMD EPYC) and up to ~8 s while other jobs
compete for them: the defaults (2 rounds of 6 steps) took 2.5 minutes on a partly loaded machine and stay
under ~9 minutes at the worst load seen. A benchmark, not a test: timings vary with the machine and its
load (on a shared machine use more --rounds and read the fastest-step column too); the memory and byte
figures, and the losses, do not vary.
"""
import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile

sys.dont_write_bytecode = True  # no __pycache__ beside the scripts
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_util import slug, venv_python  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MIB = 2 ** 20
CONFIG = "configs/tiny.yaml"
RECIPE = ["model.n_layer=8", "model.n_embd=256", "model.n_head=4", "model.dropout=0.0", "train.seq_len=256",
          "train.micro_batch=4", "train.grad_accum=2", "data.source=synthetic", "train.device=cpu",
          "checkpointing.mode=full", "precision.compute=fp32"]
COMMON = ["train.eval_interval=0", "logging.save_model=false", "state.at_end=false", "logging.progress=false",
          "logging.interval=1000", "logging.peak_tflops=1"]
PLACEMENTS = [
    ("no offload", ["parallel.sharding=zero2"]),
    ("optimizer", ["parallel.sharding=zero2", "offload.optimizer=true"]),
    ("+ gradients", ["parallel.sharding=zero2", "offload.optimizer=true", "offload.gradients=true"]),
    ("+ parameters", ["parallel.sharding=zero3", "offload.optimizer=true", "offload.gradients=true",
                      "offload.parameters=true"]),
    ("+ activations", ["parallel.sharding=zero3", "offload.optimizer=true", "offload.gradients=true",
                       "offload.parameters=true", "offload.activations=true"]),
]

# Runs in the venv's interpreter (torch): copy a large fp32 tensor into a preallocated one.
COPY_BENCH = r"""
import json, statistics, sys, time, torch
mib, repeats, threads = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
torch.set_num_threads(threads)
n = mib * 2 ** 20 // 4
src = torch.rand(n, dtype=torch.float32)
dst = torch.empty(n, dtype=torch.float32)
dst.copy_(src)  # first touch: page faults of dst, not copy speed
secs = []
for _ in range(repeats):
    t = time.perf_counter()
    dst.copy_(src)
    secs.append(time.perf_counter() - t)
assert torch.equal(dst, src)
gbps = [n * 4 / s / 1e9 for s in secs]
print(json.dumps({"tensor_mib": mib, "repeats": repeats, "threads": threads, "torch_version": torch.__version__,
                  "seconds": secs, "gbps": gbps, "median_gbps": statistics.median(gbps), "max_gbps": max(gbps)}))
"""


def trainer_args(trainer, sets):
    args = [trainer, "--config", CONFIG]
    for s in sets:
        args += ["--set", s]
    return args


def train(a, name, sets, workdir, tag):
    run_dir = os.path.join(workdir, tag)
    all_sets = (RECIPE + COMMON + sets + a.set +
                [f"train.steps={a.steps}", f"train.threads={a.threads}", f"logging.skip_first={a.skip_first}",
                 f"logging.dir={run_dir}", "logging.overwrite=true"])
    env = dict(os.environ, OMP_NUM_THREADS=str(a.threads))
    p = subprocess.run(trainer_args(a.trainer, all_sets), cwd=ROOT, env=env, stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, text=True)
    if p.returncode != 0:
        sys.exit(f"offload.py: trainer failed ({p.returncode}) for '{name}' ({' '.join(sets)}):\n{p.stdout[-3000:]}")
    with open(os.path.join(run_dir, "summary.json")) as f:
        s = json.load(f)
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        steps = [r for r in map(json.loads, f) if "event" not in r]
    if not steps:
        sys.exit(f"offload.py: '{name}' wrote no step records to {run_dir}/metrics.jsonl")
    timed = steps[s.get("warmup_steps_excluded", 0):] or steps
    host = s.get("host_memory") or {}
    last = steps[-1]
    return {"median_step_ms": s["median_step_ms"], "min_step_ms": min(r["step_ms"] for r in timed),
            "peak_allocated_bytes": s["peak_allocated_bytes"], "predicted_peak_bytes": s.get("predicted_peak_bytes"),
            "host_peak_bytes": host.get("peak_bytes", 0), "host_predicted_peak_bytes": host.get("predicted_peak_bytes", 0),
            "to_host_bytes": last.get("offload_to_host_bytes", 0), "to_device_bytes": last.get("offload_to_device_bytes", 0),
            # float.hex: exact, so the bitwise comparison survives the JSON round trip
            "losses": [float(r["loss"]).hex() for r in steps], "final_loss": s.get("final_loss"),
            "wall_s": s.get("wall_s"),
            "cpu": s.get("environment", {}).get("cpu", {}).get("cpu_model") or platform.processor() or "unknown-cpu"}


def plan(a, sets):
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "plan.json")
        args = trainer_args(a.trainer, RECIPE + COMMON + sets + a.set + [f"train.threads={a.threads}"])
        args[1:1] = ["plan"]
        p = subprocess.run(args + ["--out", out], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if p.returncode != 0:
            sys.exit(f"offload.py: trainer plan failed ({p.returncode}) for {' '.join(sets)}:\n{p.stdout[-3000:]}")
        with open(out) as f:
            return json.load(f).get("offload")  # null without offload


def copy_bandwidth(a):
    py = a.python or venv_python()
    p = subprocess.run([py, "-c", COPY_BENCH, str(a.copy_mib), str(a.copy_repeats), str(a.threads)],
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if p.returncode != 0:
        print(f"WARNING: host copy bandwidth not measured ({py} exited {p.returncode}; it needs torch):\n"
              f"{p.stderr[-1500:]}", file=sys.stderr)
        return None
    r = json.loads(p.stdout.strip().splitlines()[-1])
    r["python"] = py.replace(os.path.expanduser("~"), "~")
    return r


def check_losses(runs):
    """Every run's per-step losses against the first run's, bitwise. Returns a list of mismatch texts."""
    ref_name, ref = runs[0]["placement"], runs[0]["losses"]
    bad = []
    for r in runs[1:]:
        if r["losses"] == ref:
            continue
        n = min(len(ref), len(r["losses"]))
        step = next((i for i in range(n) if ref[i] != r["losses"][i]), n)
        if step < n:
            bad.append(f"'{r['placement']}' (round {r['round'] + 1}) differs from '{ref_name}' (round 1) at step {step + 1}: "
                       f"{float.fromhex(r['losses'][step])!r} vs {float.fromhex(ref[step])!r}")
        else:
            bad.append(f"'{r['placement']}' (round {r['round'] + 1}) logged {len(r['losses'])} steps, '{ref_name}' {len(ref)}")
    return bad


def summarize(doc):
    rows = []
    for name, sets in PLACEMENTS:
        rs = [r for r in doc["runs"] if r["placement"] == name]
        if not rs:
            continue
        med = lambda k: statistics.median(r[k] for r in rs)
        last = rs[-1]
        row = {"placement": name, "sets": sets, "runs": len(rs),
               "median_step_ms": med("median_step_ms"),
               "step_ms_min": min(r["median_step_ms"] for r in rs), "step_ms_max": max(r["median_step_ms"] for r in rs),
               "fastest_step_ms": min(r["min_step_ms"] for r in rs),
               "device_peak_bytes": med("peak_allocated_bytes"), "host_peak_bytes": med("host_peak_bytes"),
               "to_host_bytes": last["to_host_bytes"], "to_device_bytes": last["to_device_bytes"],
               "predicted_device_peak_bytes": last["predicted_peak_bytes"],
               "predicted_host_peak_bytes": last["host_predicted_peak_bytes"],
               "plan": doc["plans"].get(name)}
        bw = (doc.get("copy_bandwidth") or {}).get("median_gbps")
        moved = row["to_host_bytes"] + row["to_device_bytes"]
        # What this step's copies cost at the measured memcpy rate (one direction at a time, no overlap).
        row["copy_s_at_measured_bandwidth"] = moved / (bw * 1e9) if bw else None
        rows.append(row)
    base = rows[0]["median_step_ms"] if rows and rows[0]["placement"] == "no offload" else None
    for row in rows:
        row["step_vs_no_offload"] = row["median_step_ms"] / base if base else None
    return rows


def mib(b):
    return "-" if b is None else f"{b / MIB:.1f}"


def table(doc):
    bw = doc.get("copy_bandwidth")
    lines = [f"CPU: {doc['cpu']}; {doc['threads']} threads, fp32, {CONFIG} {' '.join(doc['recipe'])}; "
             f"median of {doc['rounds']} interleaved round(s) of {doc['steps']} steps ({doc['skip_first']} warm-up "
             f"steps excluded; fastest step: over all rounds)", "",
             "| placement | step ms (min-max over rounds) | vs no offload | fastest step ms | device peak MiB (predicted) "
             "| host peak MiB (predicted) | moved per step MiB: to host / to device (planner) "
             "| planner transfer s at bandwidth_gbps (exposed) | planner host AdamW s |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in doc["rows"]:
        p = r["plan"] or {}
        planned = (f" ({mib(p.get('to_host_bytes_per_step'))} / {mib(p.get('to_device_bytes_per_step'))})" if p else "")
        transfer = f"{p['transfer_s']:.4f} ({p['exposed_transfer_s']:.4f})" if p else "-"
        adamw = f"{p['host_adamw_s']:.4f}" if p else "-"
        vs = f"{r['step_vs_no_offload']:.2f}x" if r["step_vs_no_offload"] else "-"
        lines.append(f"| {r['placement']} | {r['median_step_ms']:.0f} ({r['step_ms_min']:.0f}-{r['step_ms_max']:.0f}) "
                     f"| {vs} | {r['fastest_step_ms']:.0f} | {mib(r['device_peak_bytes'])} ({mib(r['predicted_device_peak_bytes'])}) "
                     f"| {mib(r['host_peak_bytes'])} ({mib(r['predicted_host_peak_bytes'])}) "
                     f"| {mib(r['to_host_bytes'])} / {mib(r['to_device_bytes'])}{planned} | {transfer} | {adamw} |")
    lines.append("")
    if bw:
        lines.append(f"Host copy bandwidth (torch {bw['torch_version']}, {bw['threads']} threads, {bw['tensor_mib']} MiB "
                     f"fp32 copy_ into a preallocated tensor, {bw['repeats']} repeats): median {bw['median_gbps']:.1f} GB/s "
                     f"(max {bw['max_gbps']:.1f}); the planner's offload.bandwidth_gbps is {doc['bandwidth_gbps']:g} GB/s "
                     f"(PCIe 4.0 x16, pinned memory).")
    else:
        lines.append("Host copy bandwidth: not measured (no torch).")
    lines.append("This machine has no accelerator: the device is simulated (a tracking allocator counts device and "
                 "host memory in two pools), so each host <-> device transfer is a memcpy within the same RAM, and the "
                 "step times show offload's copy and bookkeeping cost on this CPU, not a PCIe link's.")
    if doc["loss_mismatches"]:
        lines.append("WARNING: losses differ between placements: " + "; ".join(doc["loss_mismatches"]))
    else:
        lines.append(f"Losses: bitwise equal at every step in all {len(doc['runs'])} runs.")
    return "\n".join(lines) + "\n"


def plot(doc, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = doc["rows"]
    names = [r["placement"] for r in rows]
    xs = list(range(len(rows)))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    ms = [r["median_step_ms"] for r in rows]
    ax1.bar(xs, ms, 0.6, color="tab:blue",
            yerr=[[m - r["step_ms_min"] for m, r in zip(ms, rows)], [r["step_ms_max"] - m for m, r in zip(ms, rows)]],
            capsize=3)
    for x, m in zip(xs, ms):
        ax1.text(x, m, f"{m:.0f}", ha="center", va="bottom", fontsize=8)
    ax1.set_xticks(xs, names, rotation=20, ha="right")
    ax1.set_ylabel("median step time (ms)")
    ax1.set_title(f"step time (median of {doc['rounds']} round{'s' if doc['rounds'] != 1 else ''}, min-max)", fontsize=10)
    w = 0.38
    dev = [r["device_peak_bytes"] / MIB for r in rows]
    host = [r["host_peak_bytes"] / MIB for r in rows]
    ax2.bar([x - w / 2 for x in xs], dev, w, label="device peak (measured)", color="tab:orange")
    ax2.bar([x + w / 2 for x in xs], host, w, label="host peak (measured)", color="tab:green")
    ax2.scatter([x - w / 2 for x in xs], [(r["predicted_device_peak_bytes"] or 0) / MIB for r in rows], marker="_",
                s=300, color="black", zorder=3, label="predicted (planner)")
    ax2.scatter([x + w / 2 for x in xs], [(r["predicted_host_peak_bytes"] or 0) / MIB for r in rows], marker="_",
                s=300, color="black", zorder=3)
    ax2.set_xticks(xs, names, rotation=20, ha="right")
    ax2.set_ylabel("MiB")
    ax2.set_title("device vs host peak", fontsize=10)
    ax2.legend(fontsize=8)
    fig.suptitle(f"offload placements on {doc['cpu']} ({doc['threads']} threads, simulated device; "
                 f"8L d256 T256, B 4x2)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_results(doc, out):
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out + ".json", "w") as f:
        json.dump(doc, f, indent=1)
    md = table(doc)
    with open(out + ".md", "w") as f:
        f.write(md)
    try:
        import matplotlib  # noqa: F401
        plot(doc, out + ".png")
    except ImportError:  # not the venv's interpreter: let the venv draw it from the saved JSON
        py = venv_python()
        p = subprocess.run([py, os.path.abspath(__file__), "--from-json", out + ".json", "--out", out, "--quiet"])
        if p.returncode != 0:
            print(f"WARNING: no plot: matplotlib is missing here and {py} failed; run this script with "
                  f"the project venv's python", file=sys.stderr)
    return md


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog="\n".join(__doc__.splitlines()[1:]),
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trainer", default=os.path.join(ROOT, "build", "trainer"), help="trainer binary (default build/trainer)")
    ap.add_argument("--rounds", type=int, default=2, help="interleaved rounds; every placement runs once per round (default 2)")
    ap.add_argument("--steps", type=int, default=6, help="optimizer steps per run (default 6)")
    ap.add_argument("--skip-first", type=int, default=2, help="warm-up steps excluded from each run's median (default 2)")
    ap.add_argument("--threads", type=int, default=2, help="intra-op threads, for the trainer and the copy bench (default 2)")
    ap.add_argument("--copy-mib", type=int, default=256, help="size of the tensor the copy bench copies (default 256)")
    ap.add_argument("--copy-repeats", type=int, default=10, help="copies timed by the copy bench (default 10)")
    ap.add_argument("--python", default="", help="interpreter with torch for the copy bench (default: the project venv's)")
    ap.add_argument("--out", default="", help="output path without extension (default bench/results/offload_<cpu>)")
    ap.add_argument("--set", action="append", default=[], help="extra recipe override for every run (repeatable)")
    ap.add_argument("--from-json", help="re-render the table, .md and plot of a saved .json (into --out or beside it)")
    ap.add_argument("--quiet", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()

    if a.from_json:
        with open(a.from_json) as f:
            doc = json.load(f)
        md = write_results(doc, a.out or os.path.splitext(a.from_json)[0])
        if not a.quiet:
            print(md)
        return
    if not (os.path.isfile(a.trainer) and os.access(a.trainer, os.X_OK)):
        sys.exit(f"offload.py: trainer binary not found or not executable: {a.trainer}\n"
                 f"build it (cmake --build build) or pass --trainer PATH")
    if a.rounds < 1 or a.steps < 1 or a.skip_first < 0:
        sys.exit("offload.py: --rounds and --steps must be >= 1, --skip-first >= 0")
    if a.steps <= a.skip_first:
        print(f"WARNING: --steps {a.steps} <= --skip-first {a.skip_first}: no step is past the warm-up", file=sys.stderr)

    plans = {name: plan(a, sets) for name, sets in PLACEMENTS}
    bandwidth_gbps = next((p["bandwidth_gbps"] for p in plans.values() if p), 25.0)
    bw = copy_bandwidth(a)
    if bw:
        print(f"host copy bandwidth: {bw['median_gbps']:.1f} GB/s (median of {bw['repeats']} copies of {bw['tensor_mib']} MiB, "
              f"{bw['threads']} threads; a memcpy, this machine has no accelerator) vs offload.bandwidth_gbps "
              f"{bandwidth_gbps:g} GB/s (PCIe 4.0 x16)", flush=True)

    runs = []
    with tempfile.TemporaryDirectory() as work:
        for rnd in range(a.rounds):
            order = PLACEMENTS if rnd % 2 == 0 else list(reversed(PLACEMENTS))
            for name, sets in order:
                r = train(a, name, sets, work, f"r{rnd}-{slug(name)}")
                r.update(placement=name, round=rnd)
                runs.append(r)
                print(f"round {rnd + 1}/{a.rounds}: {name:13s} {r['median_step_ms']:7.0f} ms/step, device "
                      f"{mib(r['peak_allocated_bytes'])} MiB, host {mib(r['host_peak_bytes'])} MiB, moved "
                      f"{mib(r['to_host_bytes'])} / {mib(r['to_device_bytes'])} MiB, final loss {r['final_loss']:.6f}",
                      flush=True)

    runs.sort(key=lambda r: (r["round"], [n for n, _ in PLACEMENTS].index(r["placement"])))
    mismatches = check_losses(runs)
    for m in mismatches:
        print(f"WARNING: losses not bitwise equal: {m}", file=sys.stderr)
    cpu = runs[0]["cpu"]
    doc = {"kind": "offload", "cpu": cpu, "machine": platform.machine(), "threads": a.threads, "rounds": a.rounds,
           "steps": a.steps, "skip_first": a.skip_first, "config": CONFIG, "recipe": RECIPE + a.set,
           "bandwidth_gbps": bandwidth_gbps, "copy_bandwidth": bw, "plans": plans,
           "loss_mismatches": mismatches, "losses_bitwise_equal": not mismatches, "runs": runs}
    doc["rows"] = summarize(doc)
    out = a.out or os.path.join(ROOT, "bench", "results", f"offload_{slug(cpu)}")
    md = write_results(doc, out)
    print()
    print(md)
    print(f"wrote {out}.json, {out}.md, {out}.png")


if __name__ == "__main__":
    main()
