#!/usr/bin/env python3
"""eager_gpt.py: the PyTorch eager reference the trainer is measured against (bench/vs_eager.py).

The same GPT-2 model, recipe and checkpointing plan as a trainer run, written the way a PyTorch user
writes it: nn.Module blocks (LayerNorm, one fused QKV Linear, F.scaled_dot_product_attention with
is_causal, tanh GELU), tied embeddings, torch.optim.AdamW (decay on matrices only) with its default
implementation, clip_grad_norm_, warm-up + cosine LR, and torch.utils.checkpoint (use_reentrant=False)
for the checkpointed segments. Selective parts checkpoint the named cheap op alone (Megatron's
selective recompute of the attention core; the LayerNorm or GELU for norm and mlp).

Precision (--precision, default: the trainer run's precision.compute / precision.param_dtype):
  fp32         everything fp32.
  bf16         (precision.compute=bf16) the forward and the loss under torch.autocast("cpu",
               dtype=torch.bfloat16), backward outside it, fp32 weights and AdamW: the usual PyTorch
               recipe. torch.utils.checkpoint (use_reentrant=False) replays the forward's CPU autocast
               state in the recompute; the run checks it (every checkpointed call made during backward
               records the autocast state it sees: "recompute_autocast" in the output).
  bf16-params  (precision.compute=bf16 precision.param_dtype=bf16 parallel.sharding=zero1) plain
               PyTorch's nearest equivalent of a bf16 parameter copy with fp32 masters: a bf16 copy of
               the model runs forward (same autocast) and backward, its bf16 gradients accumulate over
               the micro-batches and are copied into the fp32 master model's .grad, clip_grad_norm_ and
               AdamW run on the masters, and the masters are copied back into the bf16 copy.

Input: a trainer's summary.json (its resolved recipe and checkpointing plan), so both run the same
recipe. Output (stdout, one JSON object): step times (ms), median, tokens/s, loss per step, peak RSS.
Only the gpt2 architecture. Same recipe, not the same numbers: the initialization and the data windows
come from torch's generators here and the trainer's own there, so losses agree in distribution (step 1
is ~ln vocab_size for both), not bit for bit.

Usage: bench/eager_gpt.py --summary run/summary.json [--steps 20] [--threads N] [--precision fp32|bf16|bf16-params]
                          [--profile-step N --profile-out trace.json]   (bench/profile_breakdown.py reads it)
"""
import argparse
import contextlib
import copy
import json
import math
import resource
import statistics
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint as _checkpoint

# What the checkpointed functions see when torch.utils.checkpoint reruns them in backward: the CPU
# autocast state of every such call ("recompute_autocast" in the output).
IN_BACKWARD = False
RECOMPUTE_CALLS = {"calls": 0, "autocast_bf16": 0, "autocast_off": 0, "other": 0}


def _watched(fn):
    def run(*xs):
        if IN_BACKWARD:
            RECOMPUTE_CALLS["calls"] += 1
            on, dtype = torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")
            key = "autocast_bf16" if on and dtype == torch.bfloat16 else "autocast_off" if not on else "other"
            RECOMPUTE_CALLS[key] += 1
        return fn(*xs)
    return run


def checkpoint(fn, *xs, use_reentrant=False):
    return _checkpoint(_watched(fn), *xs, use_reentrant=use_reentrant)


class Block(nn.Module):
    def __init__(self, m, parts):
        super().__init__()
        C, H = m["n_embd"], m.get("mlp_hidden") or 4 * m["n_embd"]
        self.n_head = m["n_head"]
        self.ln1 = nn.LayerNorm(C, eps=m["norm_eps"])
        self.qkv = nn.Linear(C, 3 * C)
        self.proj = nn.Linear(C, C)
        self.ln2 = nn.LayerNorm(C, eps=m["norm_eps"])
        self.fc = nn.Linear(C, H)
        self.out = nn.Linear(H, C)
        self.parts = parts  # the selective parts recomputed in backward

    def _cheap(self, part, fn, *xs):
        return checkpoint(fn, *xs, use_reentrant=False) if self.parts.get(part) else fn(*xs)

    def _attend(self, q, k, v):
        B, nh, T, hd = q.shape
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return y.transpose(1, 2).contiguous().view(B, T, nh * hd)

    def forward(self, x):
        B, T, C = x.shape
        qkv = self.qkv(self._cheap("norm", self.ln1, x))
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in qkv.split(C, dim=2))
        x = x + self.proj(self._cheap("attention", self._attend, q, k, v))
        u = self.fc(self._cheap("norm", self.ln2, x))
        return x + self.out(self._cheap("mlp", lambda t: F.gelu(t, approximate="tanh"), u))


class GPT(nn.Module):
    def __init__(self, m, plan):
        super().__init__()
        parts = plan.get("selective", {}) if plan["mode"] == "selective" else {}
        # model.vocab_multiple: the table padded as the trainer pads it; forward drops the padding's logits.
        self.vocab = m["vocab_size"]
        k = m.get("vocab_multiple", 1)
        self.wte = nn.Embedding((self.vocab + k - 1) // k * k, m["n_embd"])
        self.wpe = nn.Embedding(m["max_seq_len"], m["n_embd"])
        self.blocks = nn.ModuleList(Block(m, parts) for _ in range(m["n_layer"]))
        self.lnf = nn.LayerNorm(m["n_embd"], eps=m["norm_eps"])
        # [first, last) block ranges run as one torch.utils.checkpoint segment
        self.segments = [(s["blocks"][0], s["blocks"][1], s["checkpointed"]) for s in plan.get("segments", [])]
        if not self.segments:
            self.segments = [(0, m["n_layer"], False)]
        std = m["init_std"]
        for name, p in self.named_parameters():
            if p.dim() == 2:
                scaled = name.endswith("proj.weight") or name.endswith("out.weight")
                nn.init.normal_(p, 0.0, std / math.sqrt(2 * m["n_layer"]) if scaled else std)
            elif name.endswith("bias"):
                nn.init.zeros_(p)
        with torch.no_grad():
            self.wte.weight[self.vocab:].zero_()

    def _run(self, x, first, last):
        for b in self.blocks[first:last]:
            x = b(x)
        return x

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.size(1), device=idx.device))
        for first, last, ckpt in self.segments:
            x = checkpoint(self._run, x, first, last, use_reentrant=False) if ckpt else self._run(x, first, last)
        return F.linear(self.lnf(x), self.wte.weight)[..., :self.vocab]


def batches(cfg, seed):
    """Random windows of train.seq_len + 1 tokens from the recipe's token file (synthetic: uniform)."""
    t, d, vocab = cfg["train"], cfg["data"], cfg["model"]["vocab_size"]
    if d["source"] == "llmc":
        import numpy as np  # here: bench/compiled_gpt.py imports this module where numpy may be absent

        tokens = torch.from_numpy(np.fromfile(d["path"], dtype=np.uint16, offset=256 * 4).astype(np.int64))
    else:
        tokens = torch.randint(0, vocab, (max(100000, d.get("synthetic_tokens", 0)),),
                               generator=torch.Generator().manual_seed(seed))
    g = torch.Generator().manual_seed(seed)
    B, T = t["micro_batch"], t["seq_len"]
    while True:
        at = torch.randint(0, tokens.numel() - T - 1, (B,), generator=g)
        w = torch.stack([tokens[a:a + T + 1] for a in at.tolist()])
        yield w[:, :-1], w[:, 1:]


def lr_at(t, step):
    if step < t["warmup_steps"]:
        return t["lr"] * (step + 1) / t["warmup_steps"]
    span = t["steps"] - t["warmup_steps"]
    if span <= 1:
        return t["lr"]
    p = min(1.0, max(0.0, (step - t["warmup_steps"]) / (span - 1)))
    return t["min_lr"] + 0.5 * (t["lr"] - t["min_lr"]) * (1 + math.cos(math.pi * p))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--summary", required=True, help="a trainer run's summary.json: recipe and checkpointing plan")
    ap.add_argument("--steps", type=int, default=0, help="optimizer steps (default: the recipe's)")
    ap.add_argument("--threads", type=int, default=0, help="intra-op threads (default: the trainer run's)")
    ap.add_argument("--precision", choices=["fp32", "bf16", "bf16-params"],
                    help="default: the trainer run's (precision.compute, precision.param_dtype); must match it")
    ap.add_argument("--profile-step", type=int, default=0, help="record this step (1-based) with torch.profiler")
    ap.add_argument("--profile-out", default="eager_profile.json", help="where --profile-step's Chrome trace goes")
    a = ap.parse_args()
    with open(a.summary) as f:
        s = json.load(f)
    cfg, plan = s["config"], s["checkpointing"]
    m, t = cfg["model"], cfg["train"]
    pr = cfg["precision"]
    ran = {("fp32", "fp32"): "fp32", ("bf16", "fp32"): "bf16", ("bf16", "bf16"): "bf16-params"}.get(
        (pr["compute"], pr.get("param_dtype", "fp32")))
    if m["arch"] != "gpt2" or ran is None:
        sys.exit(f"eager_gpt.py: only the gpt2 architecture with precision fp32, bf16 or bf16-params (the trainer "
                 f"ran arch {m['arch']}, compute {pr['compute']}, param_dtype {pr.get('param_dtype', 'fp32')})")
    precision = a.precision or ran
    if precision != ran:
        sys.exit(f"eager_gpt.py: --precision {precision}, but the trainer run's is {ran} (compute {pr['compute']}, "
                 f"param_dtype {pr.get('param_dtype', 'fp32')})")
    torch.set_num_threads(a.threads or s["environment"]["threads"])
    torch.manual_seed(t["seed"])
    steps = a.steps or t["steps"]
    t = dict(t, steps=steps)
    model = GPT(m, plan).train()  # fp32: the weights (fp32, bf16) or the masters (bf16-params)
    # the module forward and backward run on: the model itself, or its bf16 copy
    work = copy.deepcopy(model).to(torch.bfloat16) if precision == "bf16-params" else model
    autocast = ((lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if precision != "fp32"
                else contextlib.nullcontext)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": t["weight_decay"]},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=t["lr"], betas=(t["beta1"], t["beta2"]), eps=1e-8)
    data = batches(cfg, t["seed"])
    step_ms, losses = [], []
    global IN_BACKWARD
    for step in range(steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(t, step)
        prof = None
        if step + 1 == a.profile_step:
            prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True)
            prof.__enter__()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=False)
        if work is not model:
            work.zero_grad(set_to_none=False)
        total = 0.0
        for _ in range(t["grad_accum"]):
            x, y = next(data)
            with autocast():
                loss = F.cross_entropy(work(x).view(-1, m["vocab_size"]), y.reshape(-1))
            IN_BACKWARD = True
            (loss / t["grad_accum"]).backward()
            IN_BACKWARD = False
            total += loss.detach()
        if work is not model:  # the bf16 copy's gradients into the fp32 masters
            for p, w in zip(model.parameters(), work.parameters()):
                if p.grad is None:
                    p.grad = torch.empty_like(p)
                p.grad.copy_(w.grad)
        if t["grad_clip"] > 0:
            nn.utils.clip_grad_norm_(model.parameters(), t["grad_clip"])
        opt.step()
        if work is not model:  # the updated masters into the bf16 copy
            with torch.no_grad():
                for p, w in zip(model.parameters(), work.parameters()):
                    w.copy_(p)
        losses.append(float(total) / t["grad_accum"])  # the step's one host read
        step_ms.append((time.perf_counter() - t0) * 1e3)
        if prof is not None:
            prof.__exit__(None, None, None)
            prof.export_chrome_trace(a.profile_out)
    skip = min(cfg["logging"]["skip_first"], steps - 1)
    med = statistics.median(step_ms[skip:])
    tokens = t["micro_batch"] * t["seq_len"] * t["grad_accum"]
    print(json.dumps({"step_ms": step_ms, "median_step_ms": med, "median_tokens_per_s": tokens / med * 1e3,
                      "losses": losses, "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                      "threads": torch.get_num_threads(), "torch_version": torch.__version__,
                      "precision": precision, "recompute_autocast": RECOMPUTE_CALLS}))


if __name__ == "__main__":
    main()
