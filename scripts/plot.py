#!/usr/bin/env python3
"""plot.py: draw the results of scripts/sweep_batch.sh or scripts/sweep_interval.sh.

    scripts/plot.py RESULTS.json [--out DIR]

kind "batch" (sweep_batch.sh):
  memory_vs_batch.png      peak tracked memory vs micro-batch, one line per checkpointing mode; sizes
                           that did not fit are marked with x (at the memory limit), and the limit is
                           drawn as a horizontal line when there is one;
  throughput_vs_batch.png  tokens/s vs micro-batch, one line per mode.
kind "budget" (bench/budget_vs_uniform.py):
  step_time_vs_budget.png  median step time vs activation budget: mode budget, and the best uniform
                           mode that fits each budget (labelled with its name); recipes other than l12
                           write step_time_vs_budget_<recipe>.png.
kind "interval" (sweep_interval.sh):
  activation_vs_k.png      measured and predicted activation peak vs interval k (mode none as a
                           reference line);
  step_time_vs_k.png       median step time vs k (mode none as a reference line).

Writes the PNG files into DIR (default: the directory of RESULTS.json) and prints their paths.
Needs matplotlib (Agg backend, no display): run it with the project venv's interpreter,
${SUBLINEAR_HOME:-~/.cache/sublinear}/venv/bin/python scripts/plot.py ..., as the sweep scripts do.
Cost: about a second.
"""
import argparse
import json
import os
import sys

MIB = 2 ** 20


def load(path):
    try:
        with open(path) as f:
            doc = json.load(f)
    except OSError as e:
        sys.exit(f"plot.py: cannot read {path}: {e.strerror}")
    except ValueError as e:
        sys.exit(f"plot.py: {path} is not valid JSON: {e}")
    if not isinstance(doc, dict) or doc.get("kind") not in ("batch", "interval", "budget") or not isinstance(doc.get("rows"), list):
        sys.exit(f"plot.py: {path} is not a sweep result (needs \"kind\": \"batch\", \"interval\" or \"budget\" and \"rows\")")
    return doc


def subtitle(doc):
    parts = [f"recipe {doc.get('config', '?')}" + (f" ({doc['recipe']})" if doc.get("recipe") else "")]
    if doc.get("seq_len"):
        parts.append(f"seq len {doc['seq_len']}")
    if doc.get("micro_batch"):
        parts.append(f"micro-batch {doc['micro_batch']}")
    return ", ".join(parts)


def finish(fig, ax, path, xlabel, ylabel, title, plt):
    """Labels, grid, legend, layout; saves the figure to path and returns path."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=11)
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def log2_batches(ax, batches):
    ax.set_xscale("log", base=2)
    ax.set_xticks(batches)
    ax.set_xticklabels([str(b) for b in batches])


def plot_batch(doc, out, plt):
    rows = doc["rows"]
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    limit = doc.get("limit_bytes")
    batches = sorted({r["micro_batch"] for r in rows})
    paths = []

    # Peak memory vs micro-batch.
    fig, ax = plt.subplots(figsize=(8, 5))
    failed_labelled = False
    top = max([r["peak_bytes"] for r in rows if r.get("peak_bytes")] + [limit or 0]) / MIB
    for i, m in enumerate(modes):
        color = f"C{i}"
        ok = sorted((r["micro_batch"], r["peak_bytes"]) for r in rows
                    if r["mode"] == m and r["fits"] and r.get("peak_bytes") is not None)
        if ok:
            ax.plot([b for b, _ in ok], [p / MIB for _, p in ok], "o-", color=color, label=m)
        bad = sorted(r["micro_batch"] for r in rows if r["mode"] == m and not r["fits"])
        if bad:
            # At the limit line, stacked a little per mode so coinciding sizes stay visible.
            y = ((limit / MIB) if limit else top) * (1 + 0.025 * i)
            ax.plot(bad, [y] * len(bad), "x", color=color, markersize=10, markeredgewidth=2, linestyle="none")
            failed_labelled = True
    if failed_labelled:
        ax.plot([], [], "x", color="black", markersize=10, markeredgewidth=2, linestyle="none",
                label="did not fit (out of memory)")
    if limit:
        ax.axhline(limit / MIB, color="black", linestyle="--", linewidth=1,
                   label=f"memory limit {limit / MIB:,.4g} MiB")
    log2_batches(ax, batches)
    paths.append(finish(fig, ax, os.path.join(out, "memory_vs_batch.png"), "micro-batch (sequences)",
                        "peak allocated memory (MiB)",
                        f"Peak memory vs micro-batch per checkpointing mode\n{subtitle(doc)}", plt))

    # Throughput vs micro-batch.
    fig, ax = plt.subplots(figsize=(8, 5))
    for i, m in enumerate(modes):
        ok = sorted((r["micro_batch"], r["tokens_per_s"]) for r in rows
                    if r["mode"] == m and r["fits"] and r.get("tokens_per_s") is not None)
        if ok:
            ax.plot([b for b, _ in ok], [t for _, t in ok], "o-", color=f"C{i}", label=m)
    log2_batches(ax, batches)
    paths.append(finish(fig, ax, os.path.join(out, "throughput_vs_batch.png"), "micro-batch (sequences)",
                        "throughput (tokens/s, median step)",
                        f"Training throughput vs micro-batch per checkpointing mode\n{subtitle(doc)}", plt))
    return paths


def plot_interval(doc, out, plt):
    rows = doc["rows"]
    ks = sorted((r for r in rows if r.get("k") is not None and r.get("fits", True)), key=lambda r: r["k"])
    ref = next((r for r in rows if r.get("k") is None and r.get("fits", True)), None)
    x = [r["k"] for r in ks]
    paths = []

    fig, ax = plt.subplots(figsize=(8, 5))
    meas = [(r["k"], r["activation_peak_bytes"]) for r in ks if r.get("activation_peak_bytes") is not None]
    pred = [(r["k"], r["predicted_activation_peak_bytes"]) for r in ks
            if r.get("predicted_activation_peak_bytes") is not None]
    if meas:
        ax.plot([k for k, _ in meas], [v / MIB for _, v in meas], "o-", color="C0", label="measured (interval k)")
    if pred:
        ax.plot([k for k, _ in pred], [v / MIB for _, v in pred], "s--", color="C1", label="predicted (analytic model)")
    if ref and ref.get("activation_peak_bytes") is not None:
        ax.axhline(ref["activation_peak_bytes"] / MIB, color="gray", linestyle=":",
                   label=f"no checkpointing, measured ({ref['activation_peak_bytes'] / MIB:,.1f} MiB)")
    ax.set_xticks(x)
    paths.append(finish(fig, ax, os.path.join(out, "activation_vs_k.png"),
                        "interval k (blocks per checkpointed segment)", "activation peak per step (MiB)",
                        f"Activation memory vs checkpoint interval k\n{subtitle(doc)}", plt))

    fig, ax = plt.subplots(figsize=(8, 5))
    st = [(r["k"], r["step_ms"]) for r in ks if r.get("step_ms") is not None]
    if st:
        ax.plot([k for k, _ in st], [v for _, v in st], "o-", color="C2", label="interval k")
    if ref and ref.get("step_ms") is not None:
        ax.axhline(ref["step_ms"], color="gray", linestyle=":",
                   label=f"no checkpointing ({ref['step_ms']:,.1f} ms)")
    ax.set_xticks(x)
    paths.append(finish(fig, ax, os.path.join(out, "step_time_vs_k.png"),
                        "interval k (blocks per checkpointed segment)", "median step time (ms)",
                        f"Step time vs checkpoint interval k\n{subtitle(doc)}", plt))
    return paths


def plot_budget(doc, out, plt):
    rows = sorted(doc["rows"], key=lambda r: r["budget_bytes"])
    fig, ax = plt.subplots(figsize=(8, 5))
    x = [r["budget_bytes"] / MIB for r in rows]
    ax.plot(x, [r["budget_step_ms"] for r in rows], "o-", color="C0", label="mode budget (per-block schedule)")
    best = [(r["budget_bytes"] / MIB, r["best_uniform_step_ms"], r["best_uniform"]) for r in rows if r.get("best_uniform")]
    if best:
        ax.plot([b[0] for b in best], [b[1] for b in best], "s--", color="C1", label="best uniform mode that fits")
        for bx, by, name in best:
            ax.annotate(name, (bx, by), textcoords="offset points", xytext=(0, 6), ha="center", fontsize=7)
    name = "step_time_vs_budget.png" if doc.get("recipe", "l12") == "l12" else f"step_time_vs_budget_{doc['recipe']}.png"
    return [finish(fig, ax, os.path.join(out, name), "activation budget (MiB)",
                   "step time (ms): fastest step of a run, median over rounds", f"Step time vs activation budget\n{subtitle(doc)}", plt)]


def main():
    ap = argparse.ArgumentParser(description="Plot a sweep_batch.sh / sweep_interval.sh results.json.")
    ap.add_argument("results", metavar="RESULTS.json")
    ap.add_argument("--out", metavar="DIR", help="output directory (default: next to RESULTS.json)")
    args = ap.parse_args()
    doc = load(args.results)
    out = args.out or os.path.dirname(os.path.abspath(args.results))
    if not doc["rows"]:
        sys.exit(f"plot.py: {args.results} has no rows")
    try:
        import matplotlib
    except ImportError:
        sys.exit("plot.py: matplotlib is missing; install it into the venv: "
                 "${SUBLINEAR_HOME:-~/.cache/sublinear}/venv/bin/python -m pip install matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    os.makedirs(out, exist_ok=True)
    paths = {"batch": plot_batch, "interval": plot_interval, "budget": plot_budget}[doc["kind"]](doc, out, plt)
    for p in paths:
        print(p)


if __name__ == "__main__":
    main()
