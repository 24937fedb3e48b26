#!/usr/bin/env python3
"""plot_timeline.py: draw memory_timeline.json (logging.memory_timeline) as a stacked area plot.

    scripts/plot_timeline.py memory_timeline.json [more.json ...] -o out.png [--time] [--titles A,B,...]

Each input is one step of one run: device-pool bytes alive after every allocation and free (x: the
event's sequence number, or with --time its microseconds since the step started), stacked by label
(weights, gradients, optimizer state, input, each block's activations, loss, recompute transients and
backward temporaries per block, optimizer temporaries, gathered parameters, communication buffers,
offload copies, other). A label kind has one colour; its blocks are shades of it (block 0 darkest).
The step's phases (forward, the backward of each unit, optimizer) are bands along the x axis, named
where they are wide enough; the peak is marked with a line and its value. The host pool, when the run
offloads, is a dashed line. Several inputs are drawn side by side on one y axis (the docs' picture of
none / full / sqrt / budget). The peak drawn is recomputed from the events and checked equal to the
file's (which equals the step's peak_allocated_bytes in metrics.jsonl); a mismatch exits 1.

Needs matplotlib and numpy (Agg backend, no display): run it with the project venv's interpreter,
${SUBLINEAR_HOME:-~/.cache/sublinear}/venv/bin/python scripts/plot_timeline.py ...
Cost: about a second per 100k events.
"""
import argparse
import colorsys
import json
import sys

MIB = 2 ** 20
DPI = 110  # figures are laid out and saved at this resolution
# Bottom of the stack first: what lives all step, then what the step makes, in the order it comes.
KIND_ORDER = ["weights", "buffers", "gradients", "optimizer_state", "input", "activations", "loss", "recompute",
              "backward", "gathered_params", "comm", "offload", "optimizer_temp", "eval", "other"]
KIND_COLOUR = {"weights": "#4c72b0", "buffers": "#64b5cd", "gradients": "#dd8452", "optimizer_state": "#8172b3",
               "input": "#937860", "activations": "#55a868", "loss": "#c44e52", "recompute": "#e0b43c",
               "backward": "#da8bc3", "gathered_params": "#8c8c8c", "comm": "#17becf", "offload": "#bcbd22",
               "optimizer_temp": "#a05195", "eval": "#7f7f7f", "other": "#cccccc"}


def shade(colour, i, n):
    """The i-th of n shades of a colour: darker first, lighter last."""
    r, g, b = (int(colour[k:k + 2], 16) / 255 for k in (1, 3, 5))
    h, l, s = colorsys.rgb_to_hls(r, g, b)
    l = 0.30 + 0.45 * (i / max(1, n - 1)) if n > 1 else l
    return colorsys.hls_to_rgb(h, l, s)


def series(t, np):
    """(x, {label id: bytes alive after each event}, host total, replayed peak, peak index) of one timeline.
    Index 0 of every array is the start of the step, index i + 1 follows event i."""
    n = len(t["events"])
    fields = t["event_fields"]
    col = {name: fields.index(name) for name in ("seq", "t_us", "bytes", "pool", "label")}
    ev = t["events"]
    labels = np.array([e[col["label"]] for e in ev], dtype=np.int64)
    nbytes = np.array([e[col["bytes"]] for e in ev], dtype=np.int64)
    host = np.array([e[col["pool"]] == "host" for e in ev], dtype=bool)
    start = {}
    for block, size, pool, label in t["live_at_start"]:
        if pool == "device":
            start[label] = start.get(label, 0) + size
    per_label = {}
    for label in range(len(t["labels"])):
        step = np.where((labels == label) & ~host, nbytes, 0)
        if start.get(label, 0) == 0 and not step.any():
            continue
        per_label[label] = start.get(label, 0) + np.concatenate([[0], np.cumsum(step)])
    total = t["start"]["device_bytes"] + np.concatenate([[0], np.cumsum(np.where(host, 0, nbytes))])
    host_total = t["start"]["host_bytes"] + np.concatenate([[0], np.cumsum(np.where(host, nbytes, 0))])
    x_ev = np.array([e[col["seq"]] for e in ev] if n else [], dtype=np.float64)
    x_t = np.array([e[col["t_us"]] for e in ev] if n else [], dtype=np.float64)
    peak_at = int(np.argmax(total))
    return (np.concatenate([[-1], x_ev]), np.concatenate([[0], x_t])), per_label, total, host_total, peak_at


def stack_order(t):
    """Label ids bottom to top: by kind (KIND_ORDER), then by unit in model order."""
    units = {name: i for i, name in enumerate(t["units"])}
    def key(i):
        lab = t["labels"][i]
        kind = KIND_ORDER.index(lab["kind"]) if lab["kind"] in KIND_ORDER else len(KIND_ORDER)
        return kind, units.get(lab["unit"], -1)
    return sorted(range(len(t["labels"])), key=key)


def colours(t):
    """A colour per label id: the kind's colour, shaded per unit within a kind."""
    by_kind = {}
    for i in stack_order(t):
        by_kind.setdefault(t["labels"][i]["kind"], []).append(i)
    out = {}
    for kind, ids in by_kind.items():
        base = KIND_COLOUR.get(kind, "#cccccc")
        for j, i in enumerate(ids):
            out[i] = shade(base, j, len(ids)) if len(ids) > 1 else base
    return out


def phase_runs(t):
    """[(first event, last event, phase name, phase kind)] for each run of events in one phase."""
    col = t["event_fields"].index("phase")
    runs = []
    for i, e in enumerate(t["events"]):
        p = e[col]
        if runs and runs[-1][2] == p:
            runs[-1][1] = i
        else:
            runs.append([i, i, p])
    return [(a, b, t["phases"][p]["name"], t["phases"][p]["kind"]) for a, b, p in runs]


PHASE_SHADE = {"forward": "#e8f0fb", "backward": "#fbeee6", "optimizer": "#efe8f6", "eval": "#eeeeee", "setup": "#ffffff"}


def draw_phases(ax, t, x, top):
    """Phase bands (shaded by kind), a thin line between units, and names where they fit."""
    runs = phase_runs(t)
    if not runs:
        return
    width = x[-1] - x[0] if len(x) > 1 else 1.0
    for a, b, name, kind in runs:
        left, right = x[a + 1], x[b + 2] if b + 2 < len(x) else x[-1]
        ax.axvspan(left, right, color=PHASE_SHADE.get(kind, "#ffffff"), zorder=0, lw=0)
        ax.axvline(left, color="#999999", lw=0.3, zorder=1)
        if (right - left) / width > 0.035:
            short = name.replace("backward ", "bwd ").replace("block ", "b").replace("embeddings", "emb")
            ax.text((left + right) / 2, top * 0.995, short, rotation=90, ha="center", va="top", fontsize=6,
                    color="#444444", zorder=5)


def draw_one(ax, t, path, use_time, np, title, top):
    """One timeline on `ax` (y up to `top` MiB); returns (legend handles by kind, peak bytes)."""
    xs, per_label, total, host_total, peak_at = series(t, np)
    x = xs[1] if use_time else xs[0]
    peak = int(total[peak_at])
    if peak != t["peak"]["device_bytes"]:
        sys.exit(f"plot_timeline.py: {path}: replayed peak {peak} != the file's {t['peak']['device_bytes']}")
    order = [i for i in stack_order(t) if i in per_label]
    col = colours(t)
    ys = [per_label[i] / MIB for i in order]
    ax.stackplot(x, ys, colors=[col[i] for i in order], step="post", lw=0, zorder=2)
    ax.set_ylim(0, top)
    draw_phases(ax, t, x, top)
    if host_total.max() > 0:
        ax.step(x, host_total / MIB, where="post", color="black", ls="--", lw=0.8, label="host pool", zorder=3)
    ax.axhline(peak / MIB, color="#b22222", lw=0.8, ls=":", zorder=4)
    ax.plot([x[peak_at]], [peak / MIB], marker="v", color="#b22222", zorder=4)
    ax.annotate(f"peak {peak / MIB:.1f} MiB", (x[peak_at], peak / MIB), textcoords="offset points", xytext=(0, -12),
                ha="center", fontsize=8, color="#b22222", zorder=6,
                bbox=dict(boxstyle="round,pad=0.15", fc="white", ec="none", alpha=0.8))
    ax.set_title(title, fontsize=9)
    ax.set_xlabel("time in the step (µs)" if use_time else "allocation / free event")
    ax.set_xlim(x[0], x[-1])
    handles = {}
    for i in order:
        kind = t["labels"][i]["kind"]
        handles.setdefault(kind, KIND_COLOUR.get(kind, "#cccccc"))
    return handles, peak


TITLE_WIDTH = 48  # characters per title line: a 4.2-inch panel holds about 55 at 9 pt (DejaVu Sans, ~5.4 pt a character)
TITLE_LINES = 2


def words_outside_brackets(text):
    """Splits text at the spaces that are not inside brackets, so "[0..2)", "(step 2)" and
    "[attention, mlp]" stay whole ("[" and "(" open, "]" and ")" close)."""
    words, depth, word = [], 0, ""
    for ch in text:
        depth += ch in "[("
        depth = max(0, depth - (ch in "])"))
        if ch == " " and depth == 0:
            words.append(word)
            word = ""
        else:
            word += ch
    words.append(word)
    return [w for w in words if w]


def panel_title(description, step, width=TITLE_WIDTH, lines=TITLE_LINES):
    """A panel's title: the timeline's checkpointing plan ("sqrt k=2: 2 of 2 segments checkpointed:
    [0..2) [2..4)", the trainer's Plan::describe) and "(step N)", wrapped at the spaces outside brackets
    into at most `lines` lines of `width` characters. Where the plan does not fit, its last words give way
    to "…" (whole words: never a bracket cut open); a single word wider than a line keeps its line."""
    suffix = f"(step {step})"
    out, cut = [[]], False
    for w in words_outside_brackets(description):
        if out[-1] and len(" ".join(out[-1] + [w])) > width:
            if len(out) == lines:
                cut = True
                break
            out.append([])
        out[-1].append(w)
    if not cut and len(" ".join(out[-1] + [suffix])) <= width:
        out[-1].append(suffix)
    elif not cut and len(out) < lines:
        out.append([suffix])
    else:
        while len(out[-1]) > 1 and len(" ".join(out[-1] + ["…", suffix])) > width:
            out[-1].pop()
        out[-1] += ["…", suffix]
    return "\n".join(" ".join(line) for line in out if line)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("inputs", nargs="+", help="memory_timeline.json files, drawn left to right")
    ap.add_argument("-o", "--out", required=True, help="the PNG to write")
    ap.add_argument("--time", action="store_true", help="x axis in microseconds instead of event numbers")
    ap.add_argument("--titles", help="comma-separated panel titles (default: each file's checkpointing plan)")
    args = ap.parse_args()
    import matplotlib
    matplotlib.use("Agg")

    timelines = []
    for path in args.inputs:
        with open(path) as f:
            timelines.append(json.load(f))
    titles = args.titles.split(",") if args.titles else None
    fig = draw_figure(timelines, args.inputs, titles, args.time)
    fig.savefig(args.out, dpi=DPI)
    print(args.out)


def draw_figure(timelines, paths, titles=None, use_time=False):
    """The panels of `timelines` side by side (titles: default panel_title of each), laid out; prints
    each one's event count and peak. Returns the figure."""
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.patches import Patch

    titles = titles or [panel_title(t.get("checkpointing", ""), t["step"]) for t in timelines]
    fig, axes = plt.subplots(1, len(timelines), figsize=(4.2 * len(timelines) + 1.8, 4.6), sharey=True, squeeze=False,
                             dpi=DPI)
    kinds = {}
    top = max(t["peak"]["device_bytes"] for t in timelines) / MIB * 1.3  # room for the phase names
    for ax, t, path, title in zip(axes[0], timelines, paths, titles):
        handles, peak = draw_one(ax, t, path, use_time, np, title, top)
        kinds.update(handles)
        print(f"{path}: {len(t['events'])} events, peak {peak} bytes ({peak / MIB:.2f} MiB)")
    axes[0][0].set_ylabel("device memory (MiB)")
    legend = [Patch(color=kinds[k], label=k) for k in KIND_ORDER if k in kinds]
    fig.legend(handles=legend, loc="center right", fontsize=8, title="label (blocks: shades)", title_fontsize=8)
    fig.tight_layout(rect=(0, 0, 1 - 1.6 / fig.get_figwidth(), 1))
    return fig


if __name__ == "__main__":
    main()
