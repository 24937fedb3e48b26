#!/usr/bin/env python3
"""vs_eager.py: the trainer against a PyTorch eager implementation of the same model (bench/eager_gpt.py),
side by side, per checkpointing mode, on the same recipe, thread count and precision (fp32).

Each round runs, for every recipe and mode, the trainer and the eager reference one after the other
(the order alternates between rounds), each in its own process, and takes its fastest in-process step
(the first logging.skip_first steps excluded: the step least disturbed by other load on a shared
machine) and its median step. The eager run reads the trainer
run's summary.json, so both have the same resolved recipe and checkpointing plan. Per mode it reports
fastest-step time, tokens/s, the speed ratio (trainer tokens/s / eager tokens/s from the fastest
steps: median and min-max over the rounds; the ratio of each side's fastest step over all rounds; and
the ratio of the median steps), the trainer's tracked peak and both processes' peak RSS; and the
trainer's full/none step-time ratio. Writes <out>.md (table), <out>.json (every run) and <out>.png
(ratios with their spread); --from-json re-renders them from a saved .json.

Usage: bench/vs_eager.py [--trainer build/trainer] [--rounds 3] [--steps 12] [--threads 2]
                         [--recipes l12,tiny] [--modes none,full,sqrt,selective] [--out bench/results/vs_eager]
       bench/vs_eager.py --from-json bench/results/vs_eager.json [--out ...]
Cost: ~1 minute per round and recipe on 2 cores (l12: ~0.6 s/step). A benchmark, not a test: run it on
an otherwise idle machine; the figures hold for the CPU it ran on (recorded in the JSON).
"""
import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

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
          "logging.progress=false", "logging.interval=1000", "logging.peak_tflops=1", "precision.compute=fp32"]


def trainer_run(trainer, recipe, sets, steps, threads, workdir):
    config, extra = RECIPES[recipe]
    run_dir = os.path.join(workdir, "trainer")
    args = [trainer, "--config", config]
    for s in COMMON + extra + sets + [f"train.steps={steps}", f"train.threads={threads}", f"logging.dir={run_dir}",
                                      "logging.overwrite=true"]:
        args += ["--set", s]
    rss = measure(args)
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
            "final_loss": s["final_loss"], "summary": os.path.join(run_dir, "summary.json"),
            "cpu": s["environment"].get("cpu", {}).get("cpu_model", platform.processor())}


def eager_run(summary, steps, threads):
    args = [sys.executable, os.path.join(ROOT, "bench", "eager_gpt.py"), "--summary", summary,
            "--steps", str(steps), "--threads", str(threads)]
    out = {}
    rss = measure(args, out)
    r = json.loads(out["stdout"].strip().splitlines()[-1])
    r["peak_rss_bytes"] = rss
    r["min_step_ms"] = min(r["step_ms"][2:])  # the trainer's logging.skip_first (COMMON)
    return r


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


def one_round(a, rnd, recipe, mode):
    with tempfile.TemporaryDirectory() as d:
        if rnd % 2 == 0:
            tr = trainer_run(a.trainer, recipe, MODES[mode], a.steps, a.threads, d)
            ea = eager_run(tr["summary"], a.steps, a.threads)
        else:  # the eager run needs a summary: a 1-step trainer run gives the same recipe and plan
            probe = trainer_run(a.trainer, recipe, MODES[mode], 1, a.threads, os.path.join(d, "probe"))
            ea = eager_run(probe["summary"], a.steps, a.threads)
            tr = trainer_run(a.trainer, recipe, MODES[mode], a.steps, a.threads, d)
        tr.pop("summary")
        return {"round": rnd, "recipe": recipe, "mode": mode, "trainer": tr,
                "eager": {k: ea[k] for k in ("median_step_ms", "min_step_ms", "median_tokens_per_s", "peak_rss_bytes",
                                             "losses")},
                # tokens/s ratio from each run's fastest step (the least disturbed by other load), and
                # from its median step
                "ratio": ea["min_step_ms"] / tr["min_step_ms"],
                "median_ratio": tr["median_tokens_per_s"] / ea["median_tokens_per_s"]}


def mib(b):
    return f"{b / 2**20:.0f}"


def table(runs, recipes, modes):
    lines = ["| recipe | mode | trainer ms/step (fastest) | eager ms/step (fastest) | trainer tok/s | eager tok/s | speed ratio (median, min-max) "
             "| ratio of the fastest steps of all rounds | ratio of medians | trainer tracked peak MiB | trainer RSS MiB "
             "| eager RSS MiB |", "|" + "---|" * 12]
    summary = {}
    for recipe in recipes:
        for mode in modes:
            rs = [r for r in runs if r["recipe"] == recipe and r["mode"] == mode]
            med = lambda f: statistics.median(f(r) for r in rs)
            ratios = [r["ratio"] for r in rs]
            tokens = rs[0]["trainer"]["median_tokens_per_s"] * rs[0]["trainer"]["median_step_ms"] / 1e3
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
            row["trainer_tps"], row["eager_tps"] = tokens / row["trainer_ms"] * 1e3, tokens / row["eager_ms"] * 1e3
            summary[f"{recipe}/{mode}"] = row
            lines.append(f"| {recipe} | {mode} | {row['trainer_ms']:.1f} | {row['eager_ms']:.1f} | {row['trainer_tps']:.0f} "
                         f"| {row['eager_tps']:.0f} | {row['ratio']:.2f}x ({row['ratio_min']:.2f}-{row['ratio_max']:.2f}) "
                         f"| {row['best_ratio']:.2f}x | {row['median_ratio']:.2f}x "
                         f"| {mib(row['tracked'])} | {mib(row['trainer_rss'])} | {mib(row['eager_rss'])} |")
    for recipe in recipes:
        if f"{recipe}/none" in summary and f"{recipe}/full" in summary:
            r = summary[f"{recipe}/full"]["trainer_ms"] / summary[f"{recipe}/none"]["trainer_ms"]
            e = summary[f"{recipe}/full"]["eager_ms"] / summary[f"{recipe}/none"]["eager_ms"]
            best = lambda side: summary[f"{recipe}/full"][side] / summary[f"{recipe}/none"][side]
            inside = [x["trainer"]["over_no_recompute"] for x in runs
                      if x["recipe"] == recipe and x["mode"] == "full" and "over_no_recompute" in x["trainer"]]
            lines.append(f"\n{recipe}: full / none step time: trainer {r:.3f}, eager {e:.3f} (medians of the rounds' "
                         f"fastest steps); trainer {best('trainer_best_ms'):.3f}, eager {best('eager_best_ms'):.3f} "
                         f"(fastest steps of all rounds)"
                         + (f"; trainer {statistics.median(inside):.3f} (full's step / its step less its measured "
                            f"recompute time, median over rounds)" if inside else ""))
            summary[f"{recipe}/full_over_none"] = r
    return "\n".join(lines) + "\n", summary


def plot(summary, recipes, modes, path):
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
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "vs_eager"))
    ap.add_argument("--from-json", help="re-render the table and plot of a saved run (its .json) into --out")
    a = ap.parse_args()
    if a.from_json:
        with open(a.from_json) as f:
            saved = json.load(f)
        recipes = list(dict.fromkeys(r["recipe"] for r in saved["runs"]))
        modes = list(dict.fromkeys(r["mode"] for r in saved["runs"]))
        a.threads, a.rounds, a.steps = saved["threads"], saved["rounds"], saved["steps"]
        write_results(a, saved["runs"], recipes, modes)
        return
    recipes, modes = a.recipes.split(","), a.modes.split(",")
    for name in recipes + modes:
        if name not in RECIPES and name not in MODES:
            sys.exit(f"vs_eager: unknown recipe or mode '{name}' (recipes: {', '.join(RECIPES)}; modes: {', '.join(MODES)})")
    runs = []
    for rnd in range(a.rounds):
        for recipe in recipes:
            for mode in modes:
                r = one_round(a, rnd, recipe, mode)
                print(f"round {rnd} {recipe:5s} {mode:10s} trainer {r['trainer']['min_step_ms']:7.1f} ms  "
                      f"eager {r['eager']['min_step_ms']:7.1f} ms  ratio {r['ratio']:.3f} (medians: "
                      f"{r['trainer']['median_step_ms']:.1f} / {r['eager']['median_step_ms']:.1f})", flush=True)
                runs.append(r)
    write_results(a, runs, recipes, modes)


def write_results(a, runs, recipes, modes):
    md, summary = table(runs, recipes, modes)
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    cpu = runs[0]["trainer"]["cpu"]
    header = f"CPU: {cpu}; {a.threads} threads, fp32, {a.rounds} interleaved rounds of {a.steps} steps\n\n"
    with open(a.out + ".md", "w") as f:
        f.write(header + md)
    with open(a.out + ".json", "w") as f:
        json.dump({"cpu": cpu, "threads": a.threads, "rounds": a.rounds, "steps": a.steps, "summary": summary,
                   "runs": runs}, f, indent=1)
    plot(summary, recipes, modes, a.out + ".png")
    print(header + md)


if __name__ == "__main__":
    main()
