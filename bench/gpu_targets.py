#!/usr/bin/env python3
"""gpu_targets.py: issue 53's targets from the logs of one `bench/gpu.sh figures` (it calls this).

Reads LOGS (a gpu-<date>-figures-logs/ folder): parts.tsv (one line per part: key, result, seconds,
name, note), the trainer's run folders runs/<key>/ (summary.json, or the step records of metrics.jsonl
when the run was cut short), runs/plan_7b.json (`trainer plan`) and the baseline's log baseline.log
(bench/compiled_gpt.py: its last JSON line, or its per-step lines when cut short). Prints markdown:
the targets table (each target with its measured value, its bound and met / not met / skipped /
timed out / failed / not run) and the figures of every run; writes LOGS/targets.json with the same.

Usage: bench/gpu_targets.py LOGS
"""
import json
import os
import statistics
import sys

GIB = 2 ** 30
SKIP_FIRST = 3  # logging.skip_first's default: the warm-up steps a partial run's medians leave out


def read_parts(logs):
    parts = {}
    path = os.path.join(logs, "parts.tsv")
    if os.path.exists(path):
        for line in open(path):
            key, result, secs, name, note = (line.rstrip("\n").split("\t") + [""] * 5)[:5]
            parts[key] = {"result": result, "seconds": secs, "name": name, "note": note}
    return parts


def json_lines(path):
    out = []
    if os.path.exists(path):
        for line in open(path):
            line = line.strip()
            if line.startswith("{"):
                try:
                    out.append(json.loads(line))
                except ValueError:
                    pass
    return out


def trainer_run(logs, key):
    """The figures of runs/<key>: summary.json's, or medians of the step records when it has none."""
    d = os.path.join(logs, "runs", key)
    summary = os.path.join(d, "summary.json")
    if os.path.exists(summary):
        s = json.load(open(summary))
        steps = [r for r in json_lines(os.path.join(d, "metrics.jsonl")) if "event" not in r and "step" in r]
        return {"partial": False, "steps": s.get("steps", 0), "step_ms": s.get("median_step_ms"),
                "tokens_per_s": s.get("median_tokens_per_s"), "mfu": s.get("median_mfu"),
                "predicted_peak": s.get("predicted_peak_bytes"), "allocated_peak": s.get("peak_allocated_bytes"),
                "reserved_peak": s.get("peak_reserved_bytes"), "peak_flops": s.get("model", {}).get("peak_flops"),
                "flops_per_token": s.get("model", {}).get("flops_per_token"),
                "step_ms_each": [r["step_ms"] for r in steps], "exit": s.get("exit_status", {}).get("name")}
    steps = [r for r in json_lines(os.path.join(d, "metrics.jsonl")) if "event" not in r and "step" in r]
    if not steps:
        return None
    timed = steps[min(SKIP_FIRST, len(steps) - 1):]
    med = lambda k: statistics.median(r[k] for r in timed if r.get(k) is not None) if any(
        r.get(k) is not None for r in timed) else None
    return {"partial": True, "steps": len(steps), "step_ms": med("step_ms"), "tokens_per_s": med("tokens_per_s"),
            "mfu": med("mfu"), "predicted_peak": None,
            "allocated_peak": max(r.get("peak_allocated_bytes") or 0 for r in steps),
            "reserved_peak": max(r.get("peak_reserved_bytes") or r.get("reserved_bytes") or 0 for r in steps),
            "peak_flops": None, "flops_per_token": None, "step_ms_each": [r["step_ms"] for r in steps],
            "exit": None}


def baseline_run(logs):
    lines = json_lines(os.path.join(logs, "baseline.log"))
    final = [r for r in lines if "tokens_per_s" in r]
    if final:
        return dict(final[-1], partial=False)
    timed = [r for r in lines if r.get("phase") == "timed"]
    if not timed:
        return None
    med = statistics.median(r["ms"] for r in timed)
    return {"partial": True, "timed_steps": len(timed), "median_step_ms": med,
            "tokens_per_s": timed[0]["tokens"] / med * 1e3, "flops_per_token": timed[0]["flops_per_token"],
            "mfu": None, "peak_allocated_bytes": None}


class Targets:
    def __init__(self, parts):
        self.parts, self.rows = parts, []

    def status_of(self, keys):
        """Why a target has no measurement: the first of its parts that did not pass."""
        for k in keys:
            p = self.parts.get(k)
            if p is None:
                return "not run", "its part was not started (--only, or the budget)"
            if p["result"] != "passed":
                return p["result"], p["note"]
        return "failed", "its part passed but left no figures"

    def add(self, target, bound, keys, measured=None, met=None, note=""):
        """met None with a measurement: a figure without a bound (reported only)."""
        if measured is None:
            result, why = self.status_of(keys)
            self.rows.append({"target": target, "measured": "", "bound": bound, "result": result,
                              "note": why or note})
            return
        result = "measured" if met is None else "met" if met else "not met"
        partial = [k for k in keys if self.parts.get(k, {}).get("result") not in (None, "passed")]
        if partial:
            note = (note + "; " if note else "") + "partial: " + ", ".join(
                f"{k} {self.parts[k]['result']}" for k in partial)
        self.rows.append({"target": target, "measured": measured, "bound": bound, "result": result, "note": note})


def pct(x):
    return f"{100 * x:.1f} %"


def gpt2_targets(t, runs, base, peak):
    none = runs.get("gpt2_none")
    base_mfu = None
    if base and peak:
        base_mfu = base["tokens_per_s"] * base["flops_per_token"] / peak
    if none and base and none.get("tokens_per_s"):
        r = none["tokens_per_s"] / base["tokens_per_s"]
        t.add("GPT-2 124M bf16: trainer tokens/s over the torch.compile baseline's", ">= 1.00x",
              ["gpt2_none", "baseline"], f"{r:.2f}x ({none['tokens_per_s']:.0f} / {base['tokens_per_s']:.0f} tok/s)",
              r >= 1.0, f"baseline MFU {pct(base_mfu)}" if base_mfu is not None else "")
    else:
        t.add("GPT-2 124M bf16: trainer tokens/s over the torch.compile baseline's", ">= 1.00x",
              ["gpt2_none", "baseline"])
    if none and none.get("mfu") is not None:
        t.add("GPT-2 124M bf16: trainer MFU", ">= 40 %", ["gpt2_none"], pct(none["mfu"]), none["mfu"] >= 0.40)
    else:
        t.add("GPT-2 124M bf16: trainer MFU", ">= 40 %", ["gpt2_none"])
    for mode, bound in (("full", 1.3), ("selective", 1.1)):
        other = runs.get(f"gpt2_{mode}")
        name = f"GPT-2 124M: checkpointing {mode}'s step over none's"
        if none and other and none.get("step_ms") and other.get("step_ms"):
            r = other["step_ms"] / none["step_ms"]
            t.add(name, f"<= {bound:.1f}x", ["gpt2_none", f"gpt2_{mode}"],
                  f"{r:.2f}x ({other['step_ms']:.1f} / {none['step_ms']:.1f} ms)", r <= bound)
        else:
            t.add(name, f"<= {bound:.1f}x", ["gpt2_none", f"gpt2_{mode}"])


def memory_target(t, runs):
    """Planner against the caching allocator on the GPT-2 runs: within 5 % (test_device's [cuda] bound)."""
    errs = [(k, (r["predicted_peak"] - r["allocated_peak"]) / r["allocated_peak"]) for k, r in runs.items()
            if k.startswith("gpt2_") and r and r.get("predicted_peak") and r.get("allocated_peak")]
    keys = ["gpt2_none", "gpt2_full", "gpt2_selective"]
    if errs:
        worst = max(errs, key=lambda e: abs(e[1]))
        t.add("GPT-2 124M: planner peak vs allocated peak (worst of the modes run)", "within 5 %", keys,
              f"{100 * worst[1]:+.1f} % ({worst[0]})", abs(worst[1]) <= 0.05)
    else:
        t.add("GPT-2 124M: planner peak vs allocated peak (worst of the modes run)", "within 5 %", keys)


def big_targets(t, runs, plan):
    b1 = runs.get("llama_1b")
    if b1 and b1.get("mfu") is not None:
        t.add("LLaMA 1B (configs/1b_24gb.yaml): MFU", ">= 45 %", ["llama_1b"], pct(b1["mfu"]), b1["mfu"] >= 0.45)
    else:
        t.add("LLaMA 1B (configs/1b_24gb.yaml): MFU", ">= 45 %", ["llama_1b"])
    b7 = runs.get("run_7b")
    done = b7["steps"] if b7 else 0
    if b7:
        t.add("LLaMA 7B, memory.limit 24GB: optimizer steps run", "3", ["run_7b"], str(done), done >= 3)
    else:
        t.add("LLaMA 7B, memory.limit 24GB: optimizer steps run", "3", ["run_7b"])
    planned = plan.get("offload", {}).get("device_peak_bytes") if plan else None
    if b7 and b7.get("allocated_peak"):
        a = b7["allocated_peak"]
        note = f"plan {planned / GIB:.1f} GiB" if planned else "no plan"
        if b7.get("reserved_peak"):
            note += f"; reserved {b7['reserved_peak'] / GIB:.1f} GiB"
        t.add("LLaMA 7B, memory.limit 24GB: device peak (allocated)", "<= 22.4 GiB", ["run_7b", "plan_7b"],
              f"{a / GIB:.2f} GiB", a <= 22.4 * GIB, note)
    else:
        t.add("LLaMA 7B, memory.limit 24GB: device peak (allocated)", "<= 22.4 GiB", ["run_7b"])
    modelled = plan.get("offload", {}).get("step_s") if plan else None
    if b7 and b7.get("step_ms_each") and modelled:
        last = b7["step_ms_each"][-1] / 1e3
        t.add("LLaMA 7B: step time over the planner's modelled step", "reported", ["run_7b", "plan_7b"],
              f"{last / modelled:.2f}x ({last:.1f} s / {modelled:.1f} s)", None,
              "last step; steps: " + ", ".join(f"{ms / 1e3:.1f}" for ms in b7["step_ms_each"]) + " s")
    elif b7 and b7.get("step_ms_each") and plan:
        t.rows.append({"target": "LLaMA 7B: step time over the planner's modelled step", "measured": "",
                       "bound": "reported", "result": "failed", "note": "plan_7b.json has no offload.step_s"})
    else:
        t.add("LLaMA 7B: step time over the planner's modelled step", "reported", ["run_7b", "plan_7b"])


def cases_target(t, parts):
    cases = [p for k, p in parts.items() if k.startswith("case_")]
    if not cases:  # bench/gpu.sh figures: the cases are the other call's
        t.rows.append({"target": "[cuda] test cases", "measured": "", "bound": "all pass", "result": "not run",
                       "note": "not part of this call: bench/gpu.sh cases runs them, in its own report"})
        return
    counts = {}
    for p in cases:
        counts[p["result"]] = counts.get(p["result"], 0) + 1
    ran = [p for p in cases if p["result"] not in ("skipped",)]
    text = ", ".join(f"{n} {r}" for r, n in sorted(counts.items()))
    if not ran:
        t.rows.append({"target": "[cuda] test cases", "measured": text, "bound": "all pass", "result": "skipped",
                       "note": "; ".join(sorted({p["note"] for p in cases if p["note"]}))})
        return
    failed = any(p["result"].startswith("failed") for p in ran)
    cut = any(p["result"] in ("timed out", "not run") for p in ran)
    result = "not met" if failed else "timed out" if cut else "met"  # a case cut short neither passed nor failed
    t.rows.append({"target": "[cuda] test cases", "measured": text, "bound": "all pass", "result": result, "note": ""})


def fmt_bytes(b):
    return f"{b / 2 ** 20:.0f}" if b else ""


def figures(runs, base, peak):
    rows = ["| run | tokens/s | step ms | MFU % | planner peak MiB | allocated peak MiB | planner vs allocated "
            "| reserved peak MiB | steps |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    if base:
        mfu = base.get("mfu") or (base["tokens_per_s"] * base["flops_per_token"] / peak if peak else None)
        warm = (f" after {base['warmup_steps']} warm-up ({base['warmup_s']:.0f} s, compilation included)"
                if "warmup_steps" in base else " (partial)")
        rows.append(f"| GPT-2 124M torch.compile baseline | {base['tokens_per_s']:.0f} | {base['median_step_ms']:.1f} "
                    f"| {format(100 * mfu, '.1f') if mfu is not None else ''} | "
                    f"| {fmt_bytes(base.get('peak_allocated_bytes'))} | | | {base.get('timed_steps', '')} timed{warm} |")
    names = {"gpt2_none": "GPT-2 124M trainer, none", "gpt2_full": "GPT-2 124M trainer, full",
             "gpt2_selective": "GPT-2 124M trainer, selective", "llama_1b": "LLaMA 1B trainer",
             "run_7b": "LLaMA 7B trainer, 24GB"}
    for key, name in names.items():
        r = runs.get(key)
        if not r:
            continue
        f = lambda v, spec: format(v, spec) if v is not None else ""
        vs = (f"{100 * (r['predicted_peak'] - r['allocated_peak']) / r['allocated_peak']:+.1f} %"
              if r.get("predicted_peak") and r.get("allocated_peak") else "")
        rows.append(f"| {name} | {f(r['tokens_per_s'], '.0f')} | {f(r['step_ms'], '.1f')} "
                    f"| {f(r['mfu'] * 100 if r['mfu'] is not None else None, '.1f')} | {fmt_bytes(r['predicted_peak'])} "
                    f"| {fmt_bytes(r['allocated_peak'])} | {vs} | {fmt_bytes(r['reserved_peak'])} "
                    f"| {r['steps']}{' (partial)' if r['partial'] else ''} |")
    return rows


def main(argv):
    if len(argv) != 2 or not os.path.isdir(argv[1]):
        print("usage: bench/gpu_targets.py LOGS (a bench/gpu.sh figures call's logs folder)", file=sys.stderr)
        return 2
    logs = argv[1]
    parts = read_parts(logs)
    runs = {k: trainer_run(logs, k) for k in ("gpt2_none", "gpt2_full", "gpt2_selective", "llama_1b", "run_7b")}
    base = baseline_run(logs)
    plan_path = os.path.join(logs, "runs", "plan_7b.json")
    plan = json.load(open(plan_path)) if os.path.exists(plan_path) else None
    peak = (runs["gpt2_none"] or {}).get("peak_flops")
    t = Targets(parts)
    gpt2_targets(t, runs, base, peak)
    big_targets(t, runs, plan)
    memory_target(t, runs)
    cases_target(t, parts)
    out = ["| target | measured | bound | result | note |", "| --- | --- | --- | --- | --- |"]
    out += [f"| {r['target']} | {r['measured']} | {r['bound']} | {r['result']} | {r['note'].replace('|', '/')} |"
            for r in t.rows]
    out += ["", "Figures (medians over the timed steps; the trainer's runs leave out their first "
            f"{SKIP_FIRST} steps, the 7B run its first; peak {peak / 1e12:.4g} TFLOP/s from the trainer's log):"
            if peak else "Figures (the trainer reported no peak):", ""]
    out += figures(runs, base, peak)
    print("\n".join(out))
    with open(os.path.join(logs, "targets.json"), "w") as f:
        json.dump({"targets": t.rows, "runs": runs, "baseline": base, "plan_7b_step_s":
                   plan.get("offload", {}).get("step_s") if plan else None}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
