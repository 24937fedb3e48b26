#!/usr/bin/env python3
"""plot.py: draw the results of scripts/sweep_batch.sh or scripts/sweep_interval.sh.

    scripts/plot.py RESULTS.json [--out DIR]

kind "batch" (sweep_batch.sh):
  memory_vs_batch.png      peak tracked memory vs micro-batch, one line per checkpointing mode; sizes
                           that did not fit are marked with x (at the memory limit), and the limit is
                           drawn as a horizontal line when there is one;
  throughput_vs_batch.png  tokens/s vs micro-batch, one line per mode.
  Every tried micro-batch has an unlabelled tick; labels go to each mode's largest size that fits,
  then the smallest and largest tried, then the powers of two, each only where it stays one digit's
  width clear of the labels placed before it (the bisection tries neighbours such as 30 and 31, whose
  labels would run together). The legend names each mode's largest size that fits.
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


DPI = 120  # figures are drawn and saved at this resolution, so the tick labels placed are the ones saved


def finish(fig, ax, path, xlabel, ylabel, title, plt, tick_priority=None):
    """Labels, grid, legend, layout; with tick_priority, the x tick labels that stay readable
    (readable_xticks); saves the figure to path and returns path."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=11)
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    if tick_priority:
        readable_xticks(fig, ax, tick_priority)
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path


def readable_xticks(fig, ax, priority):
    """Labels the x ticks at the values of `priority` that can be read, most important first: a value is
    labelled when its label's drawn extent stays at least one digit's width clear of every label kept
    before it (closer, "30" and "31" read as "3031"). Measured with the figure's renderer after layout,
    so the kept labels are apart in the saved picture. Returns the labelled values, ascending."""
    candidates = sorted(set(priority))
    ax.set_xticks(candidates)
    ax.set_xticklabels([str(v) for v in candidates])
    fig.canvas.draw()  # places the candidate labels
    renderer = fig.canvas.get_renderer()
    box = {int(lab.get_text()): lab.get_window_extent(renderer)
           for lab in ax.xaxis.get_majorticklabels() if lab.get_text()}
    gap = digit_width(ax, renderer)
    kept = []
    for v in dict.fromkeys(priority):
        b = box.get(v)
        if b is not None and all(b.x0 >= box[k].x1 + gap or box[k].x0 >= b.x1 + gap for k in kept):
            kept.append(v)
    kept.sort()
    ax.set_xticks(kept)
    ax.set_xticklabels([str(v) for v in kept])
    return kept


def digit_width(ax, renderer):
    """Width in pixels of the digit 0 in the x tick labels' font."""
    label = ax.xaxis.get_majorticklabels()[0]
    width, _, _ = renderer.get_text_width_height_descent("0", label.get_fontproperties(), ismath=False)
    return width


def batch_tick_priority(batches, largest):
    """x tick label candidates in order of importance: each mode's largest micro-batch that fits, the
    smallest and largest tried, then the powers of two between them."""
    lo, hi = min(batches), max(batches)
    powers = [2 ** i for i in range(hi.bit_length()) if lo <= 2 ** i <= hi]
    return list(dict.fromkeys([b for b in largest.values() if b is not None] + [lo, hi] + powers))


def log2_batches(ax, batches):
    """A log2 x axis with an unlabelled tick at every tried micro-batch (labels: readable_xticks)."""
    from matplotlib.ticker import FixedLocator, NullFormatter
    ax.set_xscale("log", base=2)
    ax.xaxis.set_minor_locator(FixedLocator(batches))
    ax.xaxis.set_minor_formatter(NullFormatter())


def largest_fits(rows, modes):
    """{mode: largest micro-batch that fits, or None}."""
    out = {}
    for m in modes:
        fit = [r["micro_batch"] for r in rows if r["mode"] == m and r["fits"]]
        out[m] = max(fit) if fit else None
    return out


def mode_label(m, rows, largest):
    """A legend entry: the mode, and where some size failed, its largest size that fits."""
    failed = any(r["mode"] == m and not r["fits"] for r in rows)
    return f"{m} (largest that fits: {largest[m]})" if failed and largest[m] is not None else m


def plot_batch(doc, out, plt):
    rows = doc["rows"]
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    limit = doc.get("limit_bytes")
    batches = sorted({r["micro_batch"] for r in rows})
    largest = largest_fits(rows, modes)
    ticks = batch_tick_priority(batches, largest)
    paths = []

    # Peak memory vs micro-batch.
    fig, ax = plt.subplots(figsize=(8, 5), dpi=DPI)
    failed_labelled = False
    top = max([r["peak_bytes"] for r in rows if r.get("peak_bytes")] + [limit or 0]) / MIB
    for i, m in enumerate(modes):
        color = f"C{i}"
        ok = sorted((r["micro_batch"], r["peak_bytes"]) for r in rows
                    if r["mode"] == m and r["fits"] and r.get("peak_bytes") is not None)
        if ok:
            ax.plot([b for b, _ in ok], [p / MIB for _, p in ok], "o-", color=color, label=mode_label(m, rows, largest))
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
                        f"Peak memory vs micro-batch per checkpointing mode\n{subtitle(doc)}", plt, ticks))

    # Throughput vs micro-batch.
    fig, ax = plt.subplots(figsize=(8, 5), dpi=DPI)
    for i, m in enumerate(modes):
        ok = sorted((r["micro_batch"], r["tokens_per_s"]) for r in rows
                    if r["mode"] == m and r["fits"] and r.get("tokens_per_s") is not None)
        if ok:
            ax.plot([b for b, _ in ok], [t for _, t in ok], "o-", color=f"C{i}", label=mode_label(m, rows, largest))
    log2_batches(ax, batches)
    paths.append(finish(fig, ax, os.path.join(out, "throughput_vs_batch.png"), "micro-batch (sequences)",
                        "throughput (tokens/s, median step)",
                        f"Training throughput vs micro-batch per checkpointing mode\n{subtitle(doc)}", plt, ticks))
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
