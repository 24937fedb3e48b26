#!/usr/bin/env python3
"""vs_eager.py: the trainer against a PyTorch eager implementation of the same model (bench/eager_gpt.py),
side by side, per checkpointing mode, on the same recipe, thread count and precision (--precision):
  fp32         the trainer with precision.compute=fp32; eager all fp32 (the default).
  bf16         the trainer with precision.compute=bf16 (autocast, fp32 weights); eager runs its forward
               and loss under torch.autocast("cpu", dtype=torch.bfloat16), backward outside it, fp32
               weights (torch.utils.checkpoint replays the autocast state in recompute: checked).
  bf16-params  the trainer with precision.compute=bf16 precision.param_dtype=bf16 parallel.sharding=zero1
               (a bf16 parameter copy, fp32 masters in the optimizer's shard); eager: a bf16 copy of the
               model for forward (same autocast) and backward, fp32 masters with AdamW on them.

Each round runs, for every recipe and mode, the trainer and the eager reference one after the other
(the order alternates between rounds), each in its own process, and takes its fastest in-process step
(the first logging.skip_first steps excluded: the step least disturbed by other load on a shared
machine) and its median step. The eager run reads the trainer
run's summary.json, so both have the same resolved recipe and checkpointing plan. Per mode it reports
fastest-step time, tokens/s, the speed ratio (trainer tokens/s / eager tokens/s from the fastest
steps: median and min-max over the rounds; the ratio of each side's fastest step over all rounds; and
the ratio of the median steps), the trainer's tracked peak and both processes' peak RSS; and the
trainer's full/none step-time ratio. It also measures the GEMM peak in the run's compute dtype the way
the trainer does (a 1024 x 1024 x 1024 torch.mm at the thread count, best of 5 timed after a warm-up;
once before the rounds and once after them, the best of the 10 kept) and gives `none`'s achieved
model FLOP/s (the trainer's model.flops_per_token x tokens/s of the fastest steps) as a fraction of it,
for both programs. Beside each round's timed `none` trainer run it measures a@b again, right before and
right after (the best product of a 2 s window each), and gives the trainer's fraction of that round's
own peak (median, min-max over rounds): the two halves of one figure measured minutes apart on a shared
VM can catch different loads. And best against best: the fastest step of all rounds against the highest
a@b figure read anywhere in the run, each the least disturbed of many. Neither removes load that slows
the step and not the in-cache product (shared memory bandwidth).
Where a bf16 a@b is not the trainer's GEMM (no bf16 instructions, below) both are left out. And the
first-step loss of both. The CPU's model and its bf16-relevant flags (/proc/cpuinfo) go in the JSON
and the table header: without avx512_bf16 / amx_bf16 (and without AVX-512 for oneDNN's emulated path)
a bf16 matmul takes ATen's fallback gemm (eager's), while the trainer's linears widen to fp32 GEMMs
(src/model/linear.h), and the bf16 figures describe that CPU only. That gemm's speed depends on the operands' layout (AVX2 EPYC, 2 threads, 1024^3: a@b ~0.85 GFLOP/s,
~100x below fp32; a@b.t() ~19, a.t()@b ~23), so the peak is also measured on those two layouts and as
the widened GEMM, and the fraction given against the fastest too: on such a CPU the a@b figure is no
ceiling. Writes <out>.md (table), <out>.json
(every run) and <out>.png (ratios with their spread); --from-json re-renders them from a saved .json.

Usage: bench/vs_eager.py [--trainer build/trainer] [--rounds 3] [--steps 12] [--threads 2]
                         [--recipes l12,tiny] [--modes none,full,sqrt,selective] [--precision fp32|bf16|bf16-params]
                         [--out bench/results/vs_eager (fp32), vs_eager_bf16, vs_eager_bf16_params]
       bench/vs_eager.py --from-json bench/results/vs_eager.json [--out ...]
Cost: fp32 ~1 minute per round and recipe on 2 cores (l12: ~0.6 s/step). bf16 on an AVX2 CPU (ATen's
fallback gemm): tiny ~5-10 s/step (the trainer ~5, eager ~5-10), l12 ~6x that by its FLOPs, and the
bf16 GEMM peak measurements ~20 s each (two); each round's own peaks ~7 s per round and recipe (two
2 s windows and the interpreter's starts; `none` only). A benchmark,
not a test: run it on an otherwise idle machine; the figures hold for the CPU it ran on (recorded in the JSON).
"""
import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
from bench_util import cpu_model, venv_python  # noqa: E402

# The shape: GPT-2 blocks, 12 layers, d 256, 4 heads, T 256, micro-batch 8, vocab 256.
RECIPES = {
    "l12": ("configs/tiny.yaml", ["model.n_layer=12", "model.n_embd=256", "model.n_head=4", "train.seq_len=256",
                                  "train.micro_batch=8", "train.grad_accum=1"]),
    "tiny": ("configs/tiny.yaml", []),
}
MODES = {
    "none": ["checkpointing.mode=none"],
    "full": ["checkpointing.mode=full"],
    "sqrt": ["checkpointing.mode=sqrt"],
    "selective": ["checkpointing.mode=selective", "checkpointing.recompute=[attention]"],
}
COMMON = ["train.eval_interval=0", "logging.save_model=false", "state.at_end=false", "logging.skip_first=2",
          "logging.progress=false", "logging.interval=1000", "logging.peak_tflops=1"]
# The trainer's settings per --precision (eager_gpt.py reads them back from the run's summary.json).
PRECISIONS = {
    "fp32": ["precision.compute=fp32"],
    "bf16": ["precision.compute=bf16"],
    "bf16-params": ["precision.compute=bf16", "precision.param_dtype=bf16", "parallel.sharding=zero1"],
}
DESCRIBE = {
    "fp32": "fp32",
    "bf16": "bf16 autocast (trainer precision.compute=bf16; eager: forward + loss under torch.autocast(\"cpu\", "
            "bfloat16), backward outside it; fp32 weights and AdamW on both)",
    "bf16-params": "bf16 parameters (trainer precision.compute=bf16 precision.param_dtype=bf16 parallel.sharding=zero1; "
                   "eager: forward + loss under torch.autocast(\"cpu\", bfloat16) on a bf16 copy of the model, backward "
                   "on it, its bf16 gradients copied into fp32 master weights, AdamW on the masters, masters copied back)",
}
# /proc/cpuinfo flags that decide a bf16 matmul's path on x86 (recorded with the figures)
BF16_FLAGS = ["avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "avx512_fp16", "avx_vnni",
              "avx_ne_convert", "amx_tile", "amx_bf16"]


def trainer_run(trainer, recipe, sets, steps, threads, workdir, precision):
    config, extra = RECIPES[recipe]
    run_dir = os.path.join(workdir, "trainer")
    args = [trainer, "--config", config]
    for s in COMMON + PRECISIONS[precision] + extra + sets + [f"train.steps={steps}", f"train.threads={threads}", f"logging.dir={run_dir}",
                                      "logging.overwrite=true"]:
        args += ["--set", s]
    t0 = time.perf_counter()
    rss = measure(args)
    wall = time.perf_counter() - t0
    with open(os.path.join(run_dir, "summary.json")) as f:
        s = json.load(f)
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        steps = [r for r in map(json.loads, f) if "event" not in r]
    step_ms = [r["step_ms"] for r in steps]
    timed = steps[s["warmup_steps_excluded"]:] or steps
    return {"median_step_ms": s["median_step_ms"], "median_tokens_per_s": s["median_tokens_per_s"],
            "min_step_ms": min(step_ms[s["warmup_steps_excluded"]:] or step_ms),
            # step / (step - its measured recompute time), median over steps: the recompute overhead
            # measured inside each step, so a slow phase of the machine scales both alike
            "over_no_recompute": statistics.median(r["step_ms"] / (r["step_ms"] - r.get("recompute_ms", 0.0))
                                                   for r in timed),
            "tracked_peak_bytes": s["peak_allocated_bytes"], "peak_rss_bytes": rss,
            "final_loss": s["final_loss"], "losses": [r["loss"] for r in steps], "summary": os.path.join(run_dir, "summary.json"),
            "flops_per_token": s["model"]["flops_per_token"], "wall_s": wall,
            "cpu": s["environment"].get("cpu", {}).get("cpu_model", platform.processor()),
            "cpu_features": s["environment"].get("cpu", {})}


def eager_run(summary, steps, threads, precision):
    args = [venv_python(), os.path.join(ROOT, "bench", "eager_gpt.py"), "--summary", summary,
            "--steps", str(steps), "--threads", str(threads), "--precision", precision]
    out = {}
    t0 = time.perf_counter()
    rss = measure(args, out)
    r = json.loads(out["stdout"].strip().splitlines()[-1])
    r["wall_s"] = time.perf_counter() - t0
    r["peak_rss_bytes"] = rss
    r["min_step_ms"] = min(r["step_ms"][2:])  # the trainer's logging.skip_first (COMMON)
    return r


GEMM_PEAK = r"""
import json, sys, time, torch
dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[sys.argv[1]]
torch.set_num_threads(int(sys.argv[2]))
n = 1024
g = torch.Generator().manual_seed(1024)  # as src/train/peak_flops.cpp: fp32 randn operands, then the dtype
a, b = torch.randn(n, n, generator=g).to(dtype), torch.randn(n, n, generator=g).to(dtype)
layouts = {"a@b": lambda: torch.mm(a, b), "a@b.t()": lambda: torch.mm(a, b.t()), "a.t()@b": lambda: torch.mm(a.t(), b)}
window = float(sys.argv[3]) if len(sys.argv) > 3 else 0.0
if window > 0:  # a round's own measurement: the trainer's layout only, as many products as fit the window
    layouts = {"a@b": layouts["a@b"]}
elif dtype != torch.float32:  # the trainer's widened GEMM (src/model/linear.h): fp32 GEMM on widened operands, rounded once
    layouts["widened"] = lambda: torch.mm(a.float(), b.float()).to(dtype)
ms = {}
with torch.no_grad():
    for name, mm in layouts.items():  # a@b first: the trainer's measurement
        mm()  # warm-up
        ms[name] = []
        end = time.perf_counter() + window
        while len(ms[name]) < 5 or time.perf_counter() < end:
            t0 = time.perf_counter()
            mm()
            ms[name].append((time.perf_counter() - t0) * 1e3)
rate = {k: 2.0 * n ** 3 / (min(v) * 1e-3) for k, v in ms.items()}
print(json.dumps({"dtype": sys.argv[1], "n": n, "threads": torch.get_num_threads(), "ms": ms["a@b"],
                  "flops": rate["a@b"], "layout_ms": ms, "layout_flops": rate, "torch_version": torch.__version__}))
"""


ROUND_PEAK_WINDOW_S = 2.0  # each of a round's two peak measurements: products back to back for this long


def gemm_peak(dtype, threads, window_s=0.0):
    """The GEMM peak as the trainer measures it at start (logging.peak_tflops=0 off CUDA): an n=1024
    torch.mm(a, b) of contiguous operands in `dtype` at `threads` intra-op threads, warm-up then the best of
    5 (same ATen: the trainer links the venv's torch). Also a@b.t() and a.t()@b the same way: ATen's
    fallback bf16 gemm (no oneDNN bf16 kernel) is ~5-10x faster on those layouts than on a@b, so on such
    a CPU the a@b figure is no ceiling for the model's matmuls; and in bf16 the widened GEMM (fp32 GEMM
    on the operands converted to fp32, the result rounded to bf16), which the trainer's linears and its
    own peak measurement take where the CPU has no bf16 GEMM (src/model/linear.h). window_s > 0: a@b
    alone, the best of as many products as fit in window_s seconds (at least 5), for the measurements
    beside each round's `none` run: a window of seconds, like the steps the fastest is taken from, so a
    burst of load from other tenants at the moment of measuring does not set the round's peak."""
    out = {}
    t0 = time.perf_counter()
    measure([venv_python(), "-c", GEMM_PEAK, dtype, str(threads), str(window_s)], out)
    r = json.loads(out["stdout"].strip().splitlines()[-1])
    r["wall_s"] = time.perf_counter() - t0
    return r


def cpu_flags():
    """The CPU model and its bf16-relevant /proc/cpuinfo flags."""
    flags = set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    break
    except OSError:
        pass
    return {"model": cpu_model(), "flags": {k: k in flags for k in BF16_FLAGS}}


def measure(args, out=None):
    """Runs `args` to its end and returns its peak RSS in bytes (wait4's rusage of that child alone)."""
    p = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    text = p.stdout.read()
    _, status, usage = os.wait4(p.pid, 0)
    code = os.waitstatus_to_exitcode(status)
    if code != 0:
        sys.exit(f"vs_eager: {os.path.basename(args[0])} {' '.join(args[1:4])} ... exited {code}:\n{text[-3000:]}")
    if out is not None:
        out["stdout"] = text
    return usage.ru_maxrss * 1024


def timed_trainer_run(a, recipe, mode, d):
    """The round's timed trainer run; for `none` where a.round_peaks, with the GEMM peak measured right
    before and right after it (a@b, the best product of a 2 s window each), so that `none`'s fraction of
    the peak can be taken per round against a peak read seconds from its steps. That narrows the time
    between the two halves of the figure; it does not remove load that slows the step and not the product."""
    paired = mode == "none" and a.round_peaks
    before = gemm_peak(PEAK_DTYPE[a.precision], a.threads, ROUND_PEAK_WINDOW_S) if paired else None
    tr = trainer_run(a.trainer, recipe, MODES[mode], a.steps, a.threads, d, a.precision)
    if paired:
        after = gemm_peak(PEAK_DTYPE[a.precision], a.threads, ROUND_PEAK_WINDOW_S)
        tr["round_peak"] = {"before": before["flops"], "after": after["flops"],
                            "flops": max(before["flops"], after["flops"])}
    return tr


def one_round(a, rnd, recipe, mode):
    with tempfile.TemporaryDirectory() as d:
        if rnd % 2 == 0:
            tr = timed_trainer_run(a, recipe, mode, d)
            ea = eager_run(tr["summary"], a.steps, a.threads, a.precision)
        else:  # the eager run needs a summary: a 1-step trainer run gives the same recipe and plan
            probe = trainer_run(a.trainer, recipe, MODES[mode], 1, a.threads, os.path.join(d, "probe"), a.precision)
            ea = eager_run(probe["summary"], a.steps, a.threads, a.precision)
            tr = timed_trainer_run(a, recipe, mode, d)
        tr.pop("summary")
        return {"round": rnd, "recipe": recipe, "mode": mode, "trainer": tr,
                "eager": {k: ea[k] for k in ("median_step_ms", "min_step_ms", "median_tokens_per_s", "peak_rss_bytes",
                                             "losses", "wall_s", "precision", "recompute_autocast", "step_ms")},
                # tokens/s ratio from each run's fastest step (the least disturbed by other load), and
                # from its median step
                "ratio": ea["min_step_ms"] / tr["min_step_ms"],
                "median_ratio": tr["median_tokens_per_s"] / ea["median_tokens_per_s"]}


def step_tokens(r):
    """Tokens per optimizer step of a round's trainer run (from its median step and tokens/s)."""
    return r["trainer"]["median_tokens_per_s"] * r["trainer"]["median_step_ms"] / 1e3


def mib(b):
    return f"{b / 2**20:.0f}"


def mode_row(rs, peak, highest):
    """One recipe and mode's figures over its rounds `rs` (the table's row and the JSON summary's)."""
    med = lambda f: statistics.median(f(r) for r in rs)
    ratios = [r["ratio"] for r in rs]
    row = {"trainer_ms": med(lambda r: r["trainer"]["min_step_ms"]),
           "eager_ms": med(lambda r: r["eager"]["min_step_ms"]),
           "median_ratio": med(lambda r: r["median_ratio"]),
           # Each side's fastest step over every round: load on this VM only ever slows a step
           # down, so the least disturbed step of many is the closest to either program's speed.
           "trainer_best_ms": min(r["trainer"]["min_step_ms"] for r in rs),
           "eager_best_ms": min(r["eager"]["min_step_ms"] for r in rs),
           "ratio": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios),
           "tracked": med(lambda r: r["trainer"]["tracked_peak_bytes"]),
           "trainer_rss": med(lambda r: r["trainer"]["peak_rss_bytes"]),
           "eager_rss": med(lambda r: r["eager"]["peak_rss_bytes"])}
    row["best_ratio"] = row["eager_best_ms"] / row["trainer_best_ms"]
    tokens = step_tokens(rs[0])
    row["trainer_tps"], row["eager_tps"] = tokens / row["trainer_ms"] * 1e3, tokens / row["eager_ms"] * 1e3
    if rs[0]["trainer"].get("flops_per_token"):
        peak_fractions(row, rs, peak, highest)
    if "losses" in rs[0]["trainer"]:
        row["first_loss_trainer"] = [r["trainer"]["losses"][0] for r in rs]
        row["first_loss_eager"] = [r["eager"]["losses"][0] for r in rs]
    return row


def ab_is_the_gemm(r):
    """Whether a@b in the run's dtype is the GEMM the trainer's linears take: fp32, or bf16 where oneDNN
    runs it natively (not where the trainer widens and a bf16 a@b takes ATen's fallback gemm)."""
    return (r["eager"].get("precision", "fp32") == "fp32"
            or r["trainer"].get("cpu_features", {}).get("bf16_linear") == "onednn_native")


def peak_fractions(row, rs, peak, highest):
    """Model FLOP/s (recompute not counted) at the fastest steps' tokens/s, and as fractions of the GEMM
    peak: the run-wide one (the median of the rounds' fastest steps against the best of its products);
    where the rounds measured their own peaks (`none`) and a@b is the trainer's GEMM, each round's own
    (its fastest step against the products beside it; median over rounds) and best against best (the
    fastest step of all rounds against `highest`, the highest peak read anywhere in the run)."""
    fpt, tokens = rs[0]["trainer"]["flops_per_token"], step_tokens(rs[0])
    rate = lambda ms: fpt * tokens / (ms * 1e-3)
    row["flops_per_token"] = fpt
    row["trainer_model_flops"], row["eager_model_flops"] = fpt * row["trainer_tps"], fpt * row["eager_tps"]
    if peak:
        row["trainer_of_peak"] = row["trainer_model_flops"] / peak["flops"]
        row["eager_of_peak"] = row["eager_model_flops"] / peak["flops"]
        if peak.get("layout_flops"):
            fastest = max(peak["layout_flops"].values())
            row["trainer_of_fastest_layout"] = row["trainer_model_flops"] / fastest
            row["eager_of_fastest_layout"] = row["eager_model_flops"] / fastest
    paired = [r for r in rs if "round_peak" in r["trainer"]]
    if paired and ab_is_the_gemm(rs[0]):
        fractions = [rate(r["trainer"]["min_step_ms"]) / r["trainer"]["round_peak"]["flops"] for r in paired]
        row["trainer_of_round_peak"] = statistics.median(fractions)
        row["trainer_of_round_peak_min"], row["trainer_of_round_peak_max"] = min(fractions), max(fractions)
        row["round_peaks"] = [r["trainer"]["round_peak"]["flops"] for r in paired]
        row["highest_peak"] = highest
        row["trainer_best_of_highest_peak"] = rate(row["trainer_best_ms"]) / highest


def row_line(recipe, mode, row):
    return (f"| {recipe} | {mode} | {row['trainer_ms']:.1f} | {row['eager_ms']:.1f} | {row['trainer_tps']:.0f} "
            f"| {row['eager_tps']:.0f} | {row['ratio']:.2f}x ({row['ratio_min']:.2f}-{row['ratio_max']:.2f}) "
            f"| {row['best_ratio']:.2f}x | {row['median_ratio']:.2f}x "
            f"| {mib(row['tracked'])} | {mib(row['trainer_rss'])} | {mib(row['eager_rss'])} |")


def full_over_none_line(recipe, runs, summary):
    """The recompute cost: full's step time over none's, three ways."""
    full, none = summary[f"{recipe}/full"], summary[f"{recipe}/none"]
    r, e = full["trainer_ms"] / none["trainer_ms"], full["eager_ms"] / none["eager_ms"]
    best = lambda side: full[side] / none[side]
    inside = [x["trainer"]["over_no_recompute"] for x in runs
              if x["recipe"] == recipe and x["mode"] == "full" and "over_no_recompute" in x["trainer"]]
    summary[f"{recipe}/full_over_none"] = r
    return (f"\n{recipe}: full / none step time: trainer {r:.3f}, eager {e:.3f} (medians of the rounds' "
            f"fastest steps); trainer {best('trainer_best_ms'):.3f}, eager {best('eager_best_ms'):.3f} "
            f"(fastest steps of all rounds)"
            + (f"; trainer {statistics.median(inside):.3f} (full's step / its step less its measured "
               f"recompute time, median over rounds)" if inside else ""))


def flops_line(recipe, row, peak):
    """`none`'s achieved model FLOP/s and its fractions of the GEMM peak (peak_fractions)."""
    line = (f"\n{recipe}: none's achieved model FLOP/s ({row['flops_per_token'] / 1e6:.2f} MFLOP/token x the "
            f"fastest steps' tokens/s, recompute not counted): trainer {row['trainer_model_flops'] / 1e9:.2f} "
            f"GFLOP/s, eager {row['eager_model_flops'] / 1e9:.2f} GFLOP/s")
    if "trainer_of_peak" in row:
        line += (f"; as a fraction of the {peak['dtype']} GEMM peak ({peak['flops'] / 1e9:.2f} GFLOP/s, ATen's a@b, "
                 f"which the trainer measures too unless it widens): trainer {row['trainer_of_peak']:.3f}, "
                 f"eager {row['eager_of_peak']:.3f}")
    if "trainer_of_round_peak" in row:
        line += (f"; of each round's own peak (a@b measured right before and right after its timed `none` run, "
                 f"the best product of two {ROUND_PEAK_WINDOW_S:g} s windows; those peaks "
                 f"{min(row['round_peaks']) / 1e9:.0f}-{max(row['round_peaks']) / 1e9:.0f} GFLOP/s), median over "
                 f"rounds: trainer {row['trainer_of_round_peak']:.3f} "
                 f"({row['trainer_of_round_peak_min']:.3f}-{row['trainer_of_round_peak_max']:.3f})")
    if "trainer_best_of_highest_peak" in row:
        line += (f"; the fastest step of all rounds ({row['trainer_best_ms']:.1f} ms) against the highest a@b peak "
                 f"read in the run ({row['highest_peak'] / 1e9:.2f} GFLOP/s; each the least disturbed of many): "
                 f"trainer {row['trainer_best_of_highest_peak']:.3f}")
    if "trainer_of_fastest_layout" in row:
        name, rate = max(peak["layout_flops"].items(), key=lambda kv: kv[1])
        line += (f"; of the fastest layout ({name}, {rate / 1e9:.2f} GFLOP/s): trainer "
                 f"{row['trainer_of_fastest_layout']:.3f}, eager {row['eager_of_fastest_layout']:.3f}")
    return line


def first_loss_line(recipe, got):
    fmt = lambda xs: "/".join(f"{x:.4f}" for x in xs)
    return (f"\n{recipe}: first-step loss, trainer | eager (per round; ln vocab = 5.5452 for vocab 256; "
            f"same recipe, each program's own init and data draws): "
            + "; ".join(f"{m} {fmt(r['first_loss_trainer'])} | {fmt(r['first_loss_eager'])}" for m, r in got))


def table(runs, recipes, modes, peak=None):
    lines = ["| recipe | mode | trainer ms/step (fastest) | eager ms/step (fastest) | trainer tok/s | eager tok/s | speed ratio (median, min-max) "
             "| ratio of the fastest steps of all rounds | ratio of medians | trainer tracked peak MiB | trainer RSS MiB "
             "| eager RSS MiB |", "|" + "---|" * 12]
    summary = {}
    # the highest a@b figure read anywhere in the run: the run-wide products' best and every round's own
    rounds_own = [r["trainer"]["round_peak"]["flops"] for r in runs if "round_peak" in r["trainer"]]
    highest = max([peak["flops"]] + rounds_own) if peak else None
    for recipe in recipes:
        for mode in modes:
            row = mode_row([r for r in runs if r["recipe"] == recipe and r["mode"] == mode], peak, highest)
            summary[f"{recipe}/{mode}"] = row
            lines.append(row_line(recipe, mode, row))
    for recipe in recipes:
        if f"{recipe}/none" in summary and f"{recipe}/full" in summary:
            lines.append(full_over_none_line(recipe, runs, summary))
    for recipe in recipes:
        row = summary.get(f"{recipe}/none")
        if row and "trainer_model_flops" in row:
            lines.append(flops_line(recipe, row, peak))
    for recipe in recipes:
        got = [(m, summary[f"{recipe}/{m}"]) for m in modes if "first_loss_trainer" in summary[f"{recipe}/{m}"]]
        if got:
            lines.append(first_loss_line(recipe, got))
    return "\n".join(lines) + "\n", summary


def plot(summary, recipes, modes, path, precision="fp32"):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 3.5))
    width = 0.8 / len(recipes)
    for i, recipe in enumerate(recipes):
        rows = [summary[f"{recipe}/{m}"] for m in modes]
        xs = [j + i * width for j in range(len(modes))]
        ax.bar(xs, [r["ratio"] for r in rows], width, label=recipe,
               yerr=[[r["ratio"] - r["ratio_min"] for r in rows], [r["ratio_max"] - r["ratio"] for r in rows]], capsize=3)
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.axhline(1.15, color="tab:red", lw=0.8, ls="--", label="1.15x target")
    ax.set_xticks([j + width * (len(recipes) - 1) / 2 for j in range(len(modes))], modes)
    ax.set_ylabel("trainer tokens/s / eager tokens/s")
    ax.set_title(f"trainer vs PyTorch eager, {precision}", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--trainer", default=os.path.join(ROOT, "build", "trainer"))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--recipes", default="l12,tiny")
    ap.add_argument("--modes", default="none,full,sqrt,selective")
    ap.add_argument("--precision", choices=list(PRECISIONS), default="fp32",
                    help="fp32 | bf16 (autocast) | bf16-params (bf16 parameter copy, fp32 masters; zero1)")
    ap.add_argument("--out", help="output path without extension (default: bench/results/vs_eager for fp32, "
                                  "vs_eager_bf16, vs_eager_bf16_params)")
    ap.add_argument("--from-json", help="re-render the table and plot of a saved run (its .json) into --out")
    a = ap.parse_args()
    if a.from_json:
        with open(a.from_json) as f:
            saved = json.load(f)
        recipes = list(dict.fromkeys(r["recipe"] for r in saved["runs"]))
        modes = list(dict.fromkeys(r["mode"] for r in saved["runs"]))
        a.threads, a.rounds, a.steps = saved["threads"], saved["rounds"], saved["steps"]
        a.precision = saved.get("precision", "fp32")
        a.out = a.out or default_out(a.precision)
        write_results(a, saved["runs"], recipes, modes, saved.get("gemm_peak"), saved.get("cpu_flags"))
        return
    a.out = a.out or default_out(a.precision)
    recipes, modes = a.recipes.split(","), a.modes.split(",")
    for name in recipes + modes:
        if name not in RECIPES and name not in MODES:
            sys.exit(f"vs_eager: unknown recipe or mode '{name}' (recipes: {', '.join(RECIPES)}; modes: {', '.join(MODES)})")
    flags = cpu_flags()
    # Per-round peaks where a@b is the trainer's GEMM: fp32, or a CPU with bf16 instructions (without
    # them a bf16 a@b takes ATen's fallback gemm, seconds per call, and the trainer widens instead).
    # (ONEDNN_MAX_CPU_ISA may cap oneDNN below them; the figures are then left out by ab_is_the_gemm.)
    a.round_peaks = a.precision == "fp32" or flags["flags"]["avx512_bf16"] or flags["flags"]["amx_bf16"]
    peaks = [gemm_peak(PEAK_DTYPE[a.precision], a.threads)]
    print(f"{PEAK_DTYPE[a.precision]} GEMM peak (1024^3, {a.threads} threads, best of 5): "
          + ", ".join(f"{k} {v / 1e9:.2f}" for k, v in peaks[0]["layout_flops"].items())
          + f" GFLOP/s ({peaks[0]['wall_s']:.1f} s)", flush=True)
    runs = []
    for rnd in range(a.rounds):
        for recipe in recipes:
            for mode in modes:
                r = one_round(a, rnd, recipe, mode)
                print(f"round {rnd} {recipe:5s} {mode:10s} trainer {r['trainer']['min_step_ms']:7.1f} ms  "
                      f"eager {r['eager']['min_step_ms']:7.1f} ms  ratio {r['ratio']:.3f} (medians: "
                      f"{r['trainer']['median_step_ms']:.1f} / {r['eager']['median_step_ms']:.1f}; step-1 loss "
                      f"{r['trainer']['losses'][0]:.4f} / {r['eager']['losses'][0]:.4f}; process wall "
                      f"{r['trainer']['wall_s']:.1f} / {r['eager']['wall_s']:.1f} s)", flush=True)
                if "round_peak" in r["trainer"]:
                    rate = r["trainer"]["flops_per_token"] * step_tokens(r) / (r["trainer"]["min_step_ms"] * 1e-3)
                    own = r["trainer"]["round_peak"]["flops"]
                    print(f"        {recipe} none: {rate / 1e9:.1f} GFLOP/s = {rate / own:.3f} "
                          f"of the round's peak ({r['trainer']['round_peak']['before'] / 1e9:.1f} before, "
                          f"{r['trainer']['round_peak']['after'] / 1e9:.1f} after)", flush=True)
                runs.append(r)
    peaks.append(gemm_peak(PEAK_DTYPE[a.precision], a.threads))
    best = max(peaks, key=lambda p: p["flops"])
    layout = {k: max(p["layout_flops"][k] for p in peaks) for k in peaks[0]["layout_flops"]}
    peak = {"dtype": best["dtype"], "n": best["n"], "threads": best["threads"], "flops": best["flops"],
            "layout_flops": layout, "measurements": peaks}
    write_results(a, runs, recipes, modes, peak, flags)


PEAK_DTYPE = {"fp32": "fp32", "bf16": "bf16", "bf16-params": "bf16"}


def default_out(precision):
    name = "vs_eager" if precision == "fp32" else "vs_eager_" + precision.replace("-", "_")
    return os.path.join(ROOT, "bench", "results", name)


def cpu_line(cpu, flags, features, precision):
    """The table header's CPU part: model, bf16-relevant flags and the path a bf16 matmul takes."""
    if not flags:
        return f"CPU: {cpu}"
    has = [k for k, v in flags["flags"].items() if v]
    lacks = [k for k in ("avx512f", "avx512_bf16", "amx_bf16") if not flags["flags"].get(k)]
    line = f"CPU: {cpu} (flags: {' '.join(has) or 'none of ' + ', '.join(BF16_FLAGS)}"
    line += f"; no {', '.join(lacks)})" if lacks else ")"
    path = features.get("bf16_linear") or features.get("bf16_matmul")
    if path:
        line += f"; the trainer's bf16 linear path: {path}"
    if features.get("onednn_max_cpu_isa"):  # set for the whole run: eager, the peaks and the trainer alike
        line += f"; oneDNN capped at {features['onednn_max_cpu_isa']} (ONEDNN_MAX_CPU_ISA, for every process of the run)"
    if precision != "fp32" and path == "widened":
        line += (" (no bf16 instructions for oneDNN on this CPU: the trainer widens its bf16 linears to fp32 GEMMs, while "
                 "eager's bf16 matmuls take ATen's fallback gemm (no AVX-512), far slower than fp32, or oneDNN's emulated "
                 "one (AVX-512 without bf16), about half fp32's speed; the bf16 figures describe that CPU only)")
    elif precision != "fp32" and path == "aten":
        line += (" (no oneDNN bf16 kernel on this CPU: ATen's fallback gemm, far slower than fp32; the bf16 "
                 "figures describe that path only)")
    return line


def write_results(a, runs, recipes, modes, peak=None, flags=None):
    md, summary = table(runs, recipes, modes, peak)
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    cpu = runs[0]["trainer"]["cpu"]
    features = runs[0]["trainer"].get("cpu_features", {})
    header = (f"{cpu_line(cpu, flags, features, a.precision)}\n\n{a.threads} threads, {DESCRIBE[a.precision]}, "
              f"{a.rounds} interleaved rounds of {a.steps} steps")
    if peak:
        header += (f"; {peak['dtype']} GEMM peak {peak['flops'] / 1e9:.2f} GFLOP/s (1024^3 torch.mm at {peak['threads']} "
                   f"threads, best of {sum(len(m['ms']) for m in peak['measurements'])}: 5 before the rounds, 5 after)")
        if peak.get("layout_flops"):
            header += ("; other layouts the same way: " + ", ".join(f"{k} {v / 1e9:.2f}" for k, v in peak["layout_flops"].items())
                       + " GFLOP/s")
    rc = [r["eager"]["recompute_autocast"] for r in runs if r["eager"].get("recompute_autocast", {}).get("calls")]
    if rc and a.precision != "fp32":
        calls, bf16 = sum(x["calls"] for x in rc), sum(x["autocast_bf16"] for x in rc)
        header += (f"; eager recompute under bf16 autocast in {bf16} of {calls} checkpointed calls rerun in backward "
                   f"(torch.utils.checkpoint replays the forward's autocast state)")
    header += "\n\n"
    with open(a.out + ".md", "w") as f:
        f.write(header + md)
    with open(a.out + ".json", "w") as f:
        json.dump({"cpu": cpu, "cpu_flags": flags, "cpu_features": features, "precision": a.precision,
                   "precision_detail": DESCRIBE[a.precision], "trainer_sets": PRECISIONS[a.precision],
                   "threads": a.threads, "rounds": a.rounds, "steps": a.steps, "gemm_peak": peak,
                   "summary": summary, "runs": runs}, f, indent=1)
    plot(summary, recipes, modes, a.out + ".png", a.precision)
    print(header + md)


if __name__ == "__main__":
    main()
