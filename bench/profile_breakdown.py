#!/usr/bin/env python3
"""profile_breakdown.py: where a step's time goes, from a Chrome trace of LibTorch's or PyTorch's profiler
(the trainer's logging.profile_step writes <run dir>/profile.json; bench/eager_gpt.py --profile writes
one for the eager reference).

Every op's self time (its duration minus its children's, per thread) is put in one bucket: the
optimizer and logging by the trainer's scopes (sublinear::optimizer_step, sublinear::log_step) or
PyTorch's (Optimizer.step#...), the rest by op name: GEMMs, attention kernels, normalization,
activation, loss, copies/layout, allocation, other elementwise, and autograd/dispatch (the self time
of wrapper ops and autograd nodes). "outside ops" is the profiled span not covered by any op.

Usage: bench/profile_breakdown.py TRACE.json [--label NAME] [--json OUT.json]   (prints a markdown table)
"""
import argparse
import collections
import json
import re

BUCKETS = [  # (bucket, regex on the op name), first match wins
    ("GEMM", r"^aten::(mm|addmm|addmm_|bmm|baddbmm|addbmm|_addmm_activation)$"),
    ("attention", r"flash_attention|scaled_dot_product|_efficient_attention|_math_attention|sublinear::attention|sublinear::causal_attention"),
    ("normalization", r"layer_norm|rms_norm|RmsNorm"),
    ("activation (GELU/SiLU)", r"gelu|silu"),
    ("loss", r"cross_entropy|log_softmax|nll_loss|_softmax_backward_data"),
    ("copies and layout", r"^aten::(copy_|contiguous|clone|cat|_to_copy|to|transpose|view|reshape|split|narrow|"
                          r"as_strided|t|permute|expand|unsqueeze|squeeze|select|slice|stack|_unsafe_view|detach|"
                          r"alias|chunk|unbind|split_with_sizes)$"),
    ("allocation", r"^aten::(empty|empty_strided|empty_like|zeros|zeros_like|ones_like|full|resize_|new_empty|"
                   r"new_zeros|new_empty_strided|fill_|zero_)$"),
    ("autograd and dispatch", r"^autograd::|^aten::(linear|matmul|dropout|scaled_dot_product_attention|"
                              r"embedding|embedding_backward|embedding_dense_backward)$|Backward|^torch::autograd"),
]
SCOPES = [("optimizer", r"^sublinear::optimizer_step$|^Optimizer\.(step|zero_grad)"),
          ("logging and host read", r"^sublinear::(log_step|host_read)$")]


def self_times(events):
    """(name, self_us, scope names of its ancestors) per op, nesting by time on each thread."""
    by_tid = collections.defaultdict(list)
    for e in events:
        by_tid[e["tid"]].append(e)
    out = []
    for evs in by_tid.values():
        evs.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack = []  # [event, child time]
        for e in evs:
            while stack and e["ts"] >= stack[-1][0]["ts"] + stack[-1][0]["dur"] - 1e-3:
                done = stack.pop()
                out.append((done[0]["name"], done[0]["dur"] - done[1], [s[0]["name"] for s in stack]))
            if stack:
                stack[-1][1] += e["dur"]
            stack.append([e, 0.0])
        while stack:
            done = stack.pop()
            out.append((done[0]["name"], done[0]["dur"] - done[1], [s[0]["name"] for s in stack]))
    return out


def bucket_of(name, ancestors):
    for bucket, rx in SCOPES:
        if re.search(rx, name) or any(re.search(rx, a) for a in ancestors):
            return bucket
    for bucket, rx in BUCKETS:
        if re.search(rx, name):
            return bucket
    return "other elementwise"


def breakdown(path):
    with open(path) as f:
        trace = json.load(f)
    ops = [e for e in trace["traceEvents"] if e.get("ph") == "X" and e.get("cat") in ("cpu_op", "user_annotation")
           and not e["name"].startswith("ProfilerStep")]
    span = max(e["ts"] + e["dur"] for e in ops) - min(e["ts"] for e in ops)
    totals = collections.Counter()
    for name, us, anc in self_times(ops):
        totals[bucket_of(name, anc)] += us
    totals["outside ops"] = span - sum(totals.values())
    return span / 1e3, {k: v / 1e3 for k, v in totals.items()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("trace")
    ap.add_argument("--label", default="")
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    span_ms, ms = breakdown(a.trace)
    print(f"{a.label or a.trace}: profiled span {span_ms:.1f} ms\n")
    print("| where | ms | share |\n|---|---|---|")
    for k, v in sorted(ms.items(), key=lambda kv: -kv[1]):
        print(f"| {k} | {v:.1f} | {100 * v / span_ms:.1f} % |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"span_ms": span_ms, "ms": ms}, f, indent=1)


if __name__ == "__main__":
    main()
