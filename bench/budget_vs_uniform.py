#!/usr/bin/env python3
"""budget_vs_uniform.py: checkpointing.mode budget against the best uniform mode that fits the same budget.

For one 12-layer recipe on CPU it measures every uniform mode (none; interval k = 1 (full), 2, 3 (sqrt),
4, 6; selective with each of the 7 sets of parts), then runs mode budget at 6 budgets spaced evenly from
full's predicted activation peak to none's. At each budget the best uniform mode is the fastest one whose
measured activation peak is within the budget (its predicted one, from the formula, is up to n*fC
higher than the per-block walk budget mode uses; the measured peak is what a user cares about). Rounds are
interleaved (every mode and budget once per round, the order reversed every other round) and each
figure is the median over rounds of a run's fastest step after the warm-up (this VM's load swings step
times by +-15 %; the fastest step is the least disturbed). Beside the step times it compares the
recompute time each run measured inside its steps (summary median_recompute_ms), added to none's step:
the part of the step a schedule changes, far less noisy than whole steps. Writes <out>.json (kind "budget", rows for
scripts/plot.py), <out>.md (table) and, through scripts/plot.py, step_time_vs_budget.png beside them.

Usage: bench/budget_vs_uniform.py [--trainer build/trainer] [--rounds 3] [--steps 8] [--threads 2]
                                  [--recipe l12|mixed12] [--out bench/results/budget]
  l12:     configs/tiny.yaml with 12 layers (d 128, T 128, micro-batch 16).
  mixed12: the same with blocks of two MLP sizes (model.layer_mlp_hidden): blocks 1, 4, 7, 10 of 16x d
           (2048), the others 2x d (256): a heterogeneous chain, where one choice for every block fits badly.
Cost: 19 runs per round, ~3 minutes per round on 2 cores. A benchmark, not a test.
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
MIB = 2 ** 20

# Blocks of two MLP sizes: every third block (1, 4, 7, 10) 16x d wide, the others 2x d.
MIXED_WIDTHS = "[256, 2048, 256, 256, 2048, 256, 256, 2048, 256, 256, 2048, 256]"
RECIPES = {
    "l12": ("configs/tiny.yaml", ["model.n_layer=12", "train.grad_accum=1"]),
    "mixed12": ("configs/tiny.yaml", ["model.n_layer=12", "train.grad_accum=1", "model.layer_mlp_hidden=" + MIXED_WIDTHS]),
}
COMMON = ["train.eval_interval=0", "logging.save_model=false", "state.at_end=false", "logging.skip_first=2",
          "logging.progress=false", "logging.interval=1000", "logging.peak_tflops=1", "precision.compute=fp32"]
SELECTIVE = ["[attention]", "[mlp]", "[norm]", "[attention, mlp]", "[attention, norm]", "[mlp, norm]",
             "[attention, mlp, norm]"]


def uniform_modes():
    modes = {"none": ["checkpointing.mode=none"]}
    for k in (1, 2, 3, 4, 6):
        name = "full" if k == 1 else "sqrt (k=3)" if k == 3 else f"interval k={k}"
        modes[name] = ["checkpointing.mode=interval", f"checkpointing.interval={k}"]
    for s in SELECTIVE:
        modes[f"selective {s}"] = ["checkpointing.mode=selective", f"checkpointing.recompute={s}"]
    return modes


def run(trainer, recipe, sets, steps, threads, workdir, tag):
    config, extra = RECIPES[recipe]
    run_dir = os.path.join(workdir, tag)
    args = [trainer, "--config", config]
    for s in COMMON + extra + sets + [f"train.steps={steps}", f"train.threads={threads}", f"logging.dir={run_dir}",
                                      "logging.overwrite=true"]:
        args += ["--set", s]
    p = subprocess.run(args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if p.returncode != 0:
        sys.exit(f"budget_vs_uniform.py: trainer failed ({p.returncode}) for {sets}:\n{p.stdout[-3000:]}")
    with open(os.path.join(run_dir, "summary.json")) as f:
        s = json.load(f)
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        steps = [r["step_ms"] for r in map(json.loads, f) if "event" not in r]
    # The fastest step after the warm-up: the one least disturbed by other load on a shared machine.
    return {"step_ms": min(steps[s["warmup_steps_excluded"]:] or steps), "median_step_ms": s["median_step_ms"],
            "recompute_ms": s["median_recompute_ms"], "activation_peak_bytes": s["median_activation_peak_bytes"],
            "predicted_activation_peak_bytes": s["predicted_activation_peak_bytes"], "plan": s["checkpointing"],
            "cpu": s["environment"].get("cpu", {}).get("cpu_model", platform.processor())}


def planned_peak(trainer, recipe, sets):
    config, extra = RECIPES[recipe]
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "plan.json")
        args = [trainer, "plan", "--config", config, "--out", out]
        for s in COMMON + extra + sets:
            args += ["--set", s]
        subprocess.run(args, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
        with open(out) as f:
            return json.load(f)["modes"][0]["activation_peak_bytes"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trainer", default=os.path.join(ROOT, "build", "trainer"))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--recipe", default="l12", choices=sorted(RECIPES))
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "budget"))
    a = ap.parse_args()

    modes = uniform_modes()
    predicted = {name: planned_peak(a.trainer, a.recipe, sets) for name, sets in modes.items()}
    lo, hi = predicted["full"], predicted["none"]
    budgets = [int(lo + (hi - lo) * i / 5) for i in range(6)]
    jobs = [("uniform", name, sets) for name, sets in modes.items()]
    jobs += [("budget", b, ["checkpointing.mode=budget", f"checkpointing.budget={b}B"]) for b in budgets]
    results = {(kind, key): [] for kind, key, _ in jobs}
    with tempfile.TemporaryDirectory() as work:
        for r in range(a.rounds):
            order = jobs if r % 2 == 0 else list(reversed(jobs))
            for kind, key, sets in order:
                res = run(a.trainer, a.recipe, sets, a.steps, a.threads, work, f"{kind}-{len(results[(kind, key)])}")
                results[(kind, key)].append(res)
                print(f"round {r + 1}: {kind} {key}: {res['step_ms']:.1f} ms, "
                      f"activations {res['activation_peak_bytes'] / MIB:.1f} MiB", flush=True)

    def med(kind, key, field="step_ms"):
        return statistics.median(x[field] for x in results[(kind, key)])

    none_ms = med("uniform", "none")
    rows = []
    for b in budgets:
        fitting = [n for n in modes if med("uniform", n, "activation_peak_bytes") <= b]
        best = min(fitting, key=lambda n: med("uniform", n)) if fitting else None
        least = min(fitting, key=lambda n: med("uniform", n, "recompute_ms")) if fitting else None
        last = results[("budget", b)][-1]
        rec = med("budget", b, "recompute_ms")
        rows.append({
            "budget_bytes": b,
            "budget_step_ms": med("budget", b),
            "budget_recompute_ms": rec,
            "budget_activation_peak_bytes": med("budget", b, "activation_peak_bytes"),
            "budget_predicted_peak_bytes": last["predicted_activation_peak_bytes"],
            "budget_schedule": last["plan"]["blocks"],
            "budget_predicted_recompute_ms": last["plan"]["budget"]["recompute_cost"],
            "best_uniform": best,
            "best_uniform_step_ms": med("uniform", best) if best else None,
            "best_uniform_activation_peak_bytes": med("uniform", best, "activation_peak_bytes") if best else None,
            "speedup": med("uniform", best) / med("budget", b) if best else None,
            # The recompute time each run measured inside its steps, on top of none's step: the part of
            # the step the schedule changes, with far less of the machine's noise than whole steps.
            "least_recompute_uniform": least,
            "least_recompute_uniform_ms": med("uniform", least, "recompute_ms") if least else None,
            "speedup_by_recompute": (none_ms + med("uniform", least, "recompute_ms")) / (none_ms + rec) if least else None,
        })
    uniform = [{"mode": n, "step_ms": med("uniform", n), "recompute_ms": med("uniform", n, "recompute_ms"),
                "activation_peak_bytes": med("uniform", n, "activation_peak_bytes"),
                "predicted_activation_peak_bytes": predicted[n]} for n in modes]
    cpu = results[jobs[0][0], jobs[0][1]][0]["cpu"]
    doc = {"kind": "budget", "recipe": a.recipe, "config": RECIPES[a.recipe][0], "sets": RECIPES[a.recipe][1],
           "cpu": cpu, "threads": a.threads, "rounds": a.rounds, "steps": a.steps, "rows": rows, "uniform": uniform}
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out + ".json", "w") as f:
        json.dump(doc, f, indent=1)
    with open(a.out + ".md", "w") as f:
        f.write(markdown(doc))
    print(markdown(doc))
    plot = [sys.executable, os.path.join(ROOT, "scripts", "plot.py"), a.out + ".json"]
    subprocess.run(plot, check=False)


def schedule_text(blocks):
    out, i = [], 0
    while i < len(blocks):
        b = blocks[i]
        if b["choice"] == "recompute":
            s, e = b["segment"]
            out.append(f"R{s}-{e - 1}" if e - s > 1 else f"R{s}")
            i += e - s
            continue
        out.append("K" + ("[" + ",".join(p[0] for p in b["parts"]) + "]" if b["parts"] else ""))
        i += 1
    return " ".join(out)


def markdown(doc):
    lines = [f"CPU: {doc['cpu']}; {doc['threads']} threads, fp32, recipe {doc['recipe']} ({doc['config']} "
             f"{' '.join(doc['sets'])}), fastest step per run, median of {doc['rounds']} interleaved rounds of "
             f"{doc['steps']} steps", "",
             "| budget MiB | budget ms/step (recompute ms) | budget activations MiB (measured / predicted) | "
             "fastest uniform that fits: ms/step (activations MiB) | step-time ratio | least-recompute uniform that "
             "fits: recompute ms | ratio from recompute | schedule (K kept, [a,m,n] parts recomputed, R segment) |",
             "|---|---|---|---|---|---|---|---|"]

    def num(v, scale=1.0, suffix=""):
        return "" if v is None else f"{v / scale:.1f}{suffix}"

    def ratio(v):
        return "" if v is None else f"{v:.2f}x"

    for r in doc["rows"]:
        lines.append(
            f"| {num(r['budget_bytes'], MIB)} | {num(r['budget_step_ms'])} ({num(r['budget_recompute_ms'])}) | "
            f"{num(r['budget_activation_peak_bytes'], MIB)} / {num(r['budget_predicted_peak_bytes'], MIB)} | "
            f"{r['best_uniform'] or 'none fits'}: {num(r['best_uniform_step_ms'])} "
            f"({num(r['best_uniform_activation_peak_bytes'], MIB)}) | {ratio(r['speedup'])} | "
            f"{r['least_recompute_uniform'] or ''}: {num(r['least_recompute_uniform_ms'])} | "
            f"{ratio(r['speedup_by_recompute'])} | {schedule_text(r['budget_schedule'])} |")
    lines += ["", "Uniform modes:", "", "| mode | ms/step | recompute ms | activations MiB (measured / predicted) |",
              "|---|---|---|---|"]
    for u in doc["uniform"]:
        lines.append(f"| {u['mode']} | {u['step_ms']:.1f} | {u['recompute_ms']:.1f} | {u['activation_peak_bytes'] / MIB:.1f} / "
                     f"{u['predicted_activation_peak_bytes'] / MIB:.1f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
