#!/usr/bin/env python3
"""test_plots.py: the pictures a user reads can be read.

- scripts/plot.py's batch plots (what scripts/sweep_batch.sh draws): no two x tick labels overlap or
  run together, measured from matplotlib's own text extents (the figure's renderer and each label's
  get_window_extent), for the tried sizes the sweep's doubling and bisection produce and for crowded
  ones (many close sizes, a largest size that fits beside a power of two, several modes' largest sizes
  side by side); every label is a power of two, a mode's largest size that fits or an end of the range;
  every tried size keeps an (unlabelled) tick; each mode's largest size that fits is in the legend.
- scripts/plot_timeline.py's panel titles for each checkpointing mode's plan as the trainer writes it
  into memory_timeline.json (Plan::describe: none, full, interval, sqrt, selective, budget): no bracket
  cut open, the plan's words in order, "…" only where words were left out, "(step N)" last; drawn side
  by side, no title overlaps another or leaves the figure.

Runs with the project venv's interpreter (matplotlib, numpy): ~/.cache/sublinear/venv/bin/python
tests/test_plots.py. No trainer runs; about 5 s. Exit status 0 when every case passes.
"""
import contextlib
import importlib.util
import io
import os
import sys
import tempfile
import unittest

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MIB = 2 ** 20


def load_script(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "scripts", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


plot = load_script("plot")
plot_timeline = load_script("plot_timeline")


# ---- sweep data shapes ----

def tried_sizes(largest, max_batch):
    """The micro-batches scripts/sweep_batch.sh tries for a mode whose largest size that fits is `largest`
    (0: nothing fits): doubling from 1 (the last step clamped to max_batch) until a size fails, then
    bisection between the last size that fit and the first that did not. [(size, fits)] in trial order."""
    out, ok, bad, b = [], 0, 0, 1
    while True:
        out.append((b, b <= largest))
        if b <= largest:
            ok = b
        else:
            bad = b
            break
        if b >= max_batch:
            break
        b = min(2 * b, max_batch)
    while bad and bad - ok > 1:
        mid = (ok + bad) // 2
        out.append((mid, mid <= largest))
        ok, bad = (mid, bad) if mid <= largest else (ok, mid)
    return out


def row(mode, b, fits, limit):
    """A results.json row; a size that fits peaks below the limit, growing with the batch."""
    return {"mode": mode, "micro_batch": b, "fits": fits, "exit_code": 0 if fits else 4,
            "peak_bytes": int(limit * b / (b + 1)) if fits else None,
            "tokens_per_s": 1000.0 * b / (b + 3) if fits else None,
            "samples_per_s": 10.0 * b / (b + 3) if fits else None,
            "step_ms": 5.0 + b if fits else None}


def sweep_doc(largest, max_batch=1024, limit=64 * MIB):
    """A results.json ("kind": "batch") as the sweep writes it for {mode: largest size that fits}."""
    rows = [row(m, b, fits, limit) for m, big in largest.items() for b, fits in tried_sizes(big, max_batch)]
    return {"kind": "batch", "config": "configs/tiny.yaml", "limit_bytes": limit, "seq_len": 128, "rows": rows}


def dense_doc(sizes, largest, limit=64 * MIB):
    """A results.json in which every size in `sizes` was tried in one mode (a crowded axis)."""
    return {"kind": "batch", "config": "configs/tiny.yaml", "limit_bytes": limit, "seq_len": 128,
            "rows": [row("none", b, b <= largest, limit) for b in sizes]}


# ---- measuring the drawn plots ----

class Recorder:
    """Stands in for matplotlib.pyplot in plot.py: keeps the figures it makes open for measuring."""

    def __init__(self):
        self.figures = []

    def subplots(self, *args, **kwargs):
        fig, ax = plt.subplots(*args, **kwargs)
        self.figures.append((fig, ax))
        return fig, ax

    def close(self, fig):
        pass


def drawn_figures(doc):
    """plot.plot_batch on doc (into a temporary directory): [(file name, figure, axes)], drawn."""
    rec = Recorder()
    with tempfile.TemporaryDirectory() as out:
        paths = plot.plot_batch(doc, out, rec)
        for p in paths:
            assert os.path.getsize(p) > 0, p
    for fig, _ in rec.figures:
        fig.canvas.draw()
    return [(os.path.basename(p), fig, ax) for p, (fig, ax) in zip(paths, rec.figures)]


def tick_labels(fig, ax):
    """[(text, extent)] of the x tick labels drawn (major and minor, non-empty, inside the view), by x."""
    renderer = fig.canvas.get_renderer()
    labels = ax.xaxis.get_majorticklabels() + ax.xaxis.get_minorticklabels()
    return sorted(((lab.get_text(), lab.get_window_extent(renderer)) for lab in labels
                   if lab.get_visible() and lab.get_text()), key=lambda tb: tb[1].x0)


def digit_width(fig, ax):
    """Pixels of the digit 0 in the tick labels' font: labels closer than that read as one number
    ("30" and "31" as "3031"), so that is the least gap between two labels."""
    font = ax.xaxis.get_majorticklabels()[0].get_fontproperties()
    width, _, _ = fig.canvas.get_renderer().get_text_width_height_descent("0", font, ismath=False)
    return width


def is_power_of_two(n):
    return n > 0 and n & (n - 1) == 0


class BatchTicks(unittest.TestCase):
    def check_readable(self, doc):
        rows = doc["rows"]
        tried = sorted({r["micro_batch"] for r in rows})
        largest = {}
        for r in rows:
            if r["fits"]:
                largest[r["mode"]] = max(largest.get(r["mode"], 0), r["micro_batch"])
        allowed = {b for b in tried if is_power_of_two(b)} | set(largest.values()) | {tried[0], tried[-1]}
        for name, fig, ax in drawn_figures(doc):
            with self.subTest(plot=name, tried=tried):
                labels = tick_labels(fig, ax)
                texts = [t for t, _ in labels]
                gap = digit_width(fig, ax)
                self.assertGreater(gap, 0)
                for (ta, a), (tb, b) in zip(labels, labels[1:]):
                    self.assertGreaterEqual(b.x0 - a.x1, gap,
                                            f"tick labels {ta!r} and {tb!r} overlap or run together in {texts}")
                self.assertTrue({int(t) for t in texts} <= allowed, f"labels {texts}, allowed {sorted(allowed)}")
                self.assertGreaterEqual(len(texts), min(2, len(tried)), f"too few labels to read the scale: {texts}")
                ticks = set(ax.xaxis.get_majorticklocs()) | set(ax.xaxis.get_minorticklocs())
                self.assertTrue(set(tried) <= ticks, f"tried sizes without a tick: {sorted(set(tried) - ticks)}")
                legend = [t.get_text() for t in ax.get_legend().get_texts()]
                for m, b in largest.items():
                    if any(r["mode"] == m and not r["fits"] for r in rows):
                        self.assertIn(f"{m} (largest that fits: {b})", legend)
            plt.close(fig)

    def test_sweep_bisection_shape(self):
        # The largest sizes of scripts/sweep_batch.sh configs/tiny.yaml --limit 64MiB (none, full, sqrt,
        # selective): the bisections try 10, 11, 12; 17, 18, 19, 20; 24, 28, 30, 31 beside 16 and 32.
        self.check_readable(sweep_doc({"none": 11, "full": 30, "sqrt": 19, "selective": 17}))

    def test_largest_beside_a_power_of_two(self):
        self.check_readable(sweep_doc({"a": 31, "b": 33, "c": 63, "d": 65, "e": 127, "f": 129}))

    def test_largest_at_the_ends(self):
        # 1023 beside the last size tried (1024); a mode where even 1 does not fit; one that fits all.
        self.check_readable(sweep_doc({"a": 1023, "b": 0, "c": 1024}, max_batch=1024))

    def test_many_close_sizes(self):
        self.check_readable(dense_doc(list(range(1, 65)), largest=47))
        self.check_readable(sweep_doc({f"m{k}": k for k in range(28, 36)}))

    def test_small_sweep_labels_every_size(self):
        # --max-batch 4 with nothing failing (tests/test_scripts.sh's sweep): 1, 2, 4 are far apart and
        # all labelled, and matplotlib's own log-axis labels do not come back.
        doc = sweep_doc({"none": 4, "full": 4}, max_batch=4)
        for name, fig, ax in drawn_figures(doc):
            self.assertEqual([t for t, _ in tick_labels(fig, ax)], ["1", "2", "4"], name)
            plt.close(fig)
        self.check_readable(doc)


# ---- memory timeline titles ----

def describe_segments(mode, k, n, keep_last=True):
    """Plan::describe for full / interval / sqrt on n blocks, segments of k, the last one kept
    (checkpointing.skip_last, the default) or not: "sqrt k=2: 1 of 2 segments checkpointed: [0..2) [2..4) kept"."""
    segs = [(b, min(b + k, n)) for b in range(0, n, k)]
    words = [f"[{a}..{b})" for a, b in segs]
    if keep_last:
        words[-1] += " kept"
    return f"{mode} k={k}: {len(segs) - keep_last} of {len(segs)} segments checkpointed: " + " ".join(words)


def plan_descriptions():
    """{name: memory_timeline.json's "checkpointing"} for each mode as Plan::describe writes it: those of
    configs/tiny.yaml (4 blocks; budget 40MiB, interval 3, selective [attention, mlp, norm]) and longer
    ones of 12 blocks (GPT-2 small)."""
    budget12 = ", ".join(["[0..3) recomputed, input offloaded", "[3..6) recomputed"] + [f"{b} kept" for b in range(6, 9)]
                         + ["9 kept [attention, mlp, norm]", "10 kept [mlp, norm]", "11 kept [attention]"])
    return {
        "none": "none",
        "full, 4 blocks": describe_segments("full", 1, 4),
        "full, 12 blocks, none kept": describe_segments("full", 1, 12, keep_last=False),
        "interval k=3, 4 blocks": describe_segments("interval", 3, 4),
        "interval k=3, 12 blocks": describe_segments("interval", 3, 12),
        "sqrt, 4 blocks": describe_segments("sqrt", 2, 4),
        "sqrt, 4 blocks, none kept": describe_segments("sqrt", 2, 4, keep_last=False),
        "sqrt, 12 blocks": describe_segments("sqrt", 3, 12),
        "selective": "selective [attention, mlp, norm] in every block",
        "selective, one part": "selective [mlp] in every block",
        "budget, 4 blocks": "budget 40.0 MiB: [0..1) recomputed, 1 kept [attention, mlp, norm], 2 kept [mlp, norm], "
                            "3 kept [mlp, norm]",
        "budget, 12 blocks": f"budget 1.50 GiB: {budget12}",
    }


def bracket_depths(line):
    """The bracket depth after each character ("[" and "(" open, "]" and ")" close)."""
    depth, out = 0, []
    for ch in line:
        depth += (ch in "[(") - (ch in "])")
        out.append(depth)
    return out


def synthetic_timeline(description, step, blocks=4):
    """A memory_timeline.json in the trainer's layout: weights alive at the start, each block's
    activations made in the forward and freed in its backward, an optimizer temporary."""
    units = ["embeddings"] + [f"block {b}" for b in range(blocks)] + ["head"]
    labels = [{"name": "weights", "kind": "weights", "unit": None}] + [
        {"name": f"activations/block {b}", "kind": "activations", "unit": f"block {b}"} for b in range(blocks)] + [
        {"name": "optimizer_temp", "kind": "optimizer_temp", "unit": None}]
    phases = [{"name": "forward", "kind": "forward", "unit": None}] + [
        {"name": f"backward block {b}", "kind": "backward", "unit": f"block {b}"} for b in reversed(range(blocks))] + [
        {"name": "optimizer", "kind": "optimizer", "unit": None}]
    events, seq = [], 0
    for b in range(blocks):
        events.append([seq, seq * 10, b + 1, MIB, "device", b + 1, 0])
        seq += 1
    for i, b in enumerate(reversed(range(blocks))):
        events.append([seq, seq * 10, b + 1, -MIB, "device", b + 1, i + 1])
        seq += 1
    events += [[seq, seq * 10, blocks + 1, MIB // 2, "device", blocks + 1, blocks + 1],
               [seq + 1, seq * 10 + 10, blocks + 1, -MIB // 2, "device", blocks + 1, blocks + 1]]
    weights = 2 * MIB
    return {"version": 1, "step": step, "units": units, "labels": labels, "phases": phases,
            "checkpointing": description,
            "start": {"device_bytes": weights, "host_bytes": 0},
            "peak": {"device_bytes": weights + blocks * MIB},
            "live_at_start_fields": ["block", "bytes", "pool", "label"], "live_at_start": [[0, weights, "device", 0]],
            "event_fields": ["seq", "t_us", "block", "bytes", "pool", "label", "phase"], "events": events}


class TimelineTitles(unittest.TestCase):
    def test_title_of_each_mode(self):
        step = 2
        suffix = f"(step {step})"
        for name, description in plan_descriptions().items():
            with self.subTest(mode=name):
                title = plot_timeline.panel_title(description, step)
                lines = title.split("\n")
                self.assertLessEqual(len(lines), plot_timeline.TITLE_LINES, title)
                for line in lines:
                    depths = bracket_depths(line)
                    self.assertTrue(all(d >= 0 for d in depths) and depths[-1] == 0,
                                    f"bracket cut open in title line {line!r}")
                    self.assertLessEqual(len(line), plot_timeline.TITLE_WIDTH, f"title line too long: {line!r}")
                flat = " ".join(lines)
                self.assertTrue(flat.endswith(suffix), title)
                shown = flat[:-len(suffix)].rstrip()
                if shown.endswith("…"):
                    shown = shown[:-1].rstrip()
                    self.assertTrue(description.startswith(shown + " "), f"{title!r} is not a start of {description!r}")
                    self.assertLess(len(shown), len(description))
                else:
                    self.assertEqual(shown, description)

    def test_sqrt_title_has_no_stray_bracket(self):
        # A title cut at 48 characters would read "... [0..2) [ (step 2)".
        title = plot_timeline.panel_title(describe_segments("sqrt", 2, 4, keep_last=False), 2)
        self.assertNotIn("[ ", title.replace("\n", " "))
        self.assertIn("[0..2)", title)
        self.assertIn("[2..4)", title)

    def test_titles_fit_their_panels(self):
        descriptions = list(plan_descriptions().values())
        timelines = [synthetic_timeline(d, 2) for d in descriptions]
        with contextlib.redirect_stdout(io.StringIO()):  # its per-panel event counts
            fig = plot_timeline.draw_figure(timelines, [f"t{i}.json" for i in range(len(timelines))])
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        titles = [ax.title.get_window_extent(renderer) for ax in fig.axes if ax.get_title()]
        self.assertEqual(len(titles), len(descriptions))
        width = fig.bbox.width
        for i, (a, b) in enumerate(zip(titles, titles[1:])):
            self.assertLess(a.x1, b.x0, f"titles {i} and {i + 1} overlap: {descriptions[i]!r}, {descriptions[i + 1]!r}")
        self.assertGreaterEqual(titles[0].x0, 0)
        self.assertLessEqual(titles[-1].x1, width)
        plt.close(fig)


if __name__ == "__main__":
    unittest.main(verbosity=2)
