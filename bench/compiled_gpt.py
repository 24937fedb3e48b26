#!/usr/bin/env python3
"""compiled_gpt.py: the torch.compile baseline the trainer's GPU speed is measured against (bench/gpu.sh).

GPT-2 of a given shape written the way a nanoGPT-style PyTorch user trains it: the eager reference's
model (bench/eager_gpt.py: pre-norm blocks, one fused QKV Linear, F.scaled_dot_product_attention with
is_causal, tanh GELU, tied embeddings) with the loss inside the module, the whole under torch.compile;
the vocabulary padded to a multiple of --pad-vocab (50,257 -> 50,304 for GPT-2; the targets stay below
the model's vocabulary), bf16 autocast, TF32 matmuls for what stays fp32, torch.optim.AdamW(fused=True)
with decay on matrices only, clip_grad_norm_ 1.0, gradient accumulation over --grad-accum
micro-batches. Tokens are uniform random ids (the speed does not depend on them), --grad-accum
micro-batches drawn once in pinned host memory and copied to the device each micro-batch
(non_blocking), as a data loader would.

Timing: --warmup steps first (the compilation happens in them: their seconds are reported as
warmup_s and excluded), then --steps timed steps, each ended by its loss's one host read (on CUDA
after torch.cuda.synchronize()). tokens_per_s = tokens per step / the median timed step.

FLOPs per token count the model as the trainer counts it (summary.json's model.flops_per_token):
6 N + 12 L T C with N the parameters without the position embedding and without the padded rows of
the vocabulary (the model's FLOPs, not the padding's), L layers, T = --seq-len, C = --n-embd. MFU =
tokens_per_s x flops_per_token / the peak (--peak-tflops; absent: mfu is null and bench/gpu.sh computes
it against the trainer's own reported peak).

Output: a JSON line per step as it ends ({"phase": "warmup" or "timed", "step", "ms", "loss", ...}), then
one JSON object with the figures (the last line; also written to --out if given).

Usage: bench/compiled_gpt.py [--device cuda|cpu] [--no-compile] [--precision bf16|fp32]
         [--n-layer 12 --n-head 12 --n-embd 768 --vocab 50257 --seq-len 1024]
         [--micro-batch 8 --grad-accum 8] [--warmup 3 --steps 10] [--peak-tflops T] [--out FILE]
"""
import argparse
import contextlib
import json
import os
import statistics
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from eager_gpt import GPT  # noqa: E402  (the same model the CPU comparison runs)


class WithLoss(nn.Module):
    """The model and its loss in one module, so torch.compile sees (and fuses) the loss too."""

    def __init__(self, gpt, vocab_padded):
        super().__init__()
        self.gpt, self.vocab_padded = gpt, vocab_padded

    def forward(self, idx, targets):
        logits = self.gpt(idx)
        return F.cross_entropy(logits.view(-1, self.vocab_padded), targets.view(-1))


def padded(vocab, multiple):
    return (vocab + multiple - 1) // multiple * multiple if multiple > 0 else vocab


def flops_per_token(gpt, a, vocab_padded):
    """6 N + 12 L T C, N without the position embedding and the padded vocabulary rows."""
    total = sum(p.numel() for p in gpt.parameters())
    n = total - gpt.wpe.weight.numel() - (vocab_padded - a.vocab) * a.n_embd
    return n, 6 * n + 12 * a.n_layer * a.seq_len * a.n_embd


def build(a, device):
    vocab_padded = padded(a.vocab, a.pad_vocab)
    shape = {"n_layer": a.n_layer, "n_head": a.n_head, "n_embd": a.n_embd, "vocab_size": vocab_padded,
             "max_seq_len": a.seq_len, "mlp_hidden": 0, "norm_eps": 1e-5, "init_std": 0.02}
    gpt = GPT(shape, {"mode": "none"}).to(device).train()
    decay = [p for p in gpt.parameters() if p.dim() >= 2]
    no_decay = [p for p in gpt.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=6e-4, betas=(0.9, 0.95), eps=1e-8, fused=True)
    model = WithLoss(gpt, vocab_padded)
    return gpt, (torch.compile(model) if a.compile else model), opt, vocab_padded


def micro_batches(a, device):
    g = torch.Generator().manual_seed(a.seed)
    out = []
    for _ in range(a.grad_accum):
        w = torch.randint(0, a.vocab, (a.micro_batch, a.seq_len + 1), generator=g)
        x, y = w[:, :-1].contiguous(), w[:, 1:].contiguous()
        if device.type == "cuda":
            x, y = x.pin_memory(), y.pin_memory()
        out.append((x, y))
    return out


def train_step(a, model, gpt, opt, batches, device, autocast):
    total = torch.zeros((), device=device)
    for x, y in batches:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with autocast():
            loss = model(x, y)
        (loss / a.grad_accum).backward()
        total += loss.detach()
    nn.utils.clip_grad_norm_(gpt.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return total.item() / a.grad_accum  # the step's one host read


def parse_args(argv):
    ap = argparse.ArgumentParser(description="GPT-2 under torch.compile, nanoGPT-style: tokens/s, step ms, MFU "
                                 "(the baseline of bench/gpu.sh).")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True,
                    help="torch.compile the model and its loss (default on)")
    ap.add_argument("--precision", default="bf16", choices=["bf16", "fp32"],
                    help="bf16: autocast to bfloat16 over fp32 weights (default); fp32: no autocast")
    ap.add_argument("--n-layer", type=int, default=12)
    ap.add_argument("--n-head", type=int, default=12)
    ap.add_argument("--n-embd", type=int, default=768)
    ap.add_argument("--vocab", type=int, default=50257, help="the model's vocabulary (targets are below it)")
    ap.add_argument("--pad-vocab", type=int, default=128, help="pad the embedding to a multiple of this (0: none)")
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--grad-accum", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps first (compilation happens in them)")
    ap.add_argument("--steps", type=int, default=10, help="timed steps after the warm-up")
    ap.add_argument("--peak-tflops", type=float, default=0.0, help="the device's dense peak for MFU (0: mfu null)")
    ap.add_argument("--threads", type=int, default=0, help="CPU intra-op threads (0: torch's default)")
    ap.add_argument("--seed", type=int, default=1337)
    ap.add_argument("--out", help="also write the JSON here")
    a = ap.parse_args(argv)
    for name in ("n_layer", "n_head", "n_embd", "vocab", "seq_len", "micro_batch", "grad_accum", "steps"):
        if getattr(a, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    if a.n_embd % a.n_head:
        ap.error(f"--n-embd {a.n_embd} is not a multiple of --n-head {a.n_head}")
    if a.warmup < 0 or a.pad_vocab < 0 or a.peak_tflops < 0:
        ap.error("--warmup, --pad-vocab and --peak-tflops must be >= 0")
    return a


def main(argv=None):
    a = parse_args(argv)
    if a.device == "cuda" and not torch.cuda.is_available():
        print("compiled_gpt.py: --device cuda, but torch sees no CUDA device (use --device cpu)", file=sys.stderr)
        return 2
    if a.threads:
        torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    device = torch.device(a.device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    gpt, model, opt, vocab_padded = build(a, device)
    n, fpt = flops_per_token(gpt, a, vocab_padded)
    autocast = ((lambda: torch.autocast(device.type, dtype=torch.bfloat16)) if a.precision == "bf16"
                else contextlib.nullcontext)
    batches = micro_batches(a, device)
    warmup_s, step_ms, losses = 0.0, [], []
    for step in range(a.warmup + a.steps):
        t0 = time.perf_counter()
        loss = train_step(a, model, gpt, opt, batches, device, autocast)
        ms = (time.perf_counter() - t0) * 1e3
        timed = step >= a.warmup
        if timed:
            step_ms.append(ms), losses.append(loss)
        else:
            warmup_s += ms / 1e3
        # a progress line per step: what a run cut short by a timeout leaves (bench/gpu_targets.py reads it)
        print(json.dumps({"phase": "timed" if timed else "warmup", "step": step + 1, "ms": ms, "loss": loss,
                          "tokens": a.micro_batch * a.seq_len * a.grad_accum, "flops_per_token": fpt}), flush=True)
    med = statistics.median(step_ms)
    tokens = a.micro_batch * a.seq_len * a.grad_accum
    tps = tokens / med * 1e3
    peak = a.peak_tflops * 1e12
    result = {
        "device": str(device), "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch_version": torch.__version__, "compiled": a.compile, "precision": a.precision,
        "optimizer": "torch.optim.AdamW(fused=True)",
        "shape": {"n_layer": a.n_layer, "n_head": a.n_head, "n_embd": a.n_embd, "vocab": a.vocab,
                  "vocab_padded": vocab_padded, "seq_len": a.seq_len},
        "micro_batch": a.micro_batch, "grad_accum": a.grad_accum, "tokens_per_step": tokens,
        "params": sum(p.numel() for p in gpt.parameters()), "matmul_params": n, "flops_per_token": fpt,
        "warmup_steps": a.warmup, "warmup_s": warmup_s, "timed_steps": a.steps, "step_ms": step_ms,
        "median_step_ms": med, "tokens_per_s": tps,
        "peak_flops": peak or None, "mfu": tps * fpt / peak if peak else None,
        "losses": losses,
        "peak_allocated_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
    }
    text = json.dumps(result)
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
