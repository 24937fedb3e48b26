#!/usr/bin/env python3
"""hf_parity.py: the Hugging Face side of tests/test_hf.cpp (transformers and safetensors from PyPI).

  hf_parity.py make ARCH DIR [--shard-size N]
      Builds GPT2LMHeadModel (ARCH gpt2) or LlamaForCausalLM (ARCH llama) from a config with random
      weights (nothing is downloaded; every parameter is perturbed, so biases and norm weights matter),
      save_pretrained(DIR) (sharded when --shard-size is given), and writes DIR/ref.safetensors with
      `tokens` (2, 48) int64, the model's fp32 `logits` on them (eager attention) and `loss` (next-token
      cross-entropy, labels = tokens, as transformers shifts them).
  hf_parity.py logits DIR TOKENS OUT
      Loads DIR with from_pretrained (fp32), runs the `tokens` of the safetensors file TOKENS and writes
      `logits` and `loss` to OUT.
  hf_parity.py masked DIR SHARD OUT
      The masked loss of an examples data set (data.source: examples; SHARD.bin with SHARD.mask.bin and
      SHARD.examples.bin beside it, read here with numpy) under DIR's model: every example a row of one
      batch, right-padded, labels = the tokens where the mask is 1 and -100 elsewhere, as transformers'
      causal-LM loss takes them (it shifts them itself). Writes `loss` (the mean over every trained token
      of the batch) and `mean_of_means` (the mean of the examples' own means: what a mean of per-micro-batch
      means gives at micro-batch 1) to OUT.
  hf_parity.py peft BASE ADAPTER TOKENS OUT
      Loads the base DIR with from_pretrained, PEFT's PeftModel.from_pretrained(base, ADAPTER) over it, and
      writes its `logits` and `loss` on TOKENS' tokens and `merged_logits`, those of merge_and_unload().
  hf_parity.py bad KIND SRC OUT
      Writes a broken copy of the checkpoint SRC (model.safetensors) to OUT (a file, no config.json):
      KIND = missing (first block's q/c_attn weight gone), extra (an unknown tensor added),
      shape (a norm weight one element longer), dtype (a norm weight as int64), header (garbage header).
The shapes (GPT2: the `tiny` preset, L4 d128 h4 vocab 256 ctx 256; LLaMA: L2 d64 h4 MLP 160 ctx 64,
RoPE theta 1000) are the ones tests/test_hf.cpp gives the trainer.
"""
import argparse
import os
import sys

import torch
from safetensors.torch import load_file, save_file

ARCHS = {
    "gpt2": dict(vocab_size=256, n_positions=256, n_embd=128, n_layer=4, n_head=4, layer_norm_epsilon=1e-5,
                 activation_function="gelu_new", tie_word_embeddings=True, bos_token_id=None, eos_token_id=None),
    "llama": dict(vocab_size=256, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=4, max_position_embeddings=64, rms_norm_eps=1e-5,
                  rope_parameters={"rope_type": "default", "rope_theta": 1000.0}, tie_word_embeddings=False,
                  bos_token_id=None, eos_token_id=None),
}


def build(arch):
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM
    if arch == "gpt2":
        return GPT2LMHeadModel(GPT2Config(**ARCHS[arch], attn_implementation="eager"))
    return LlamaForCausalLM(LlamaConfig(**ARCHS[arch], attn_implementation="eager"))


def perturb(model, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g) * 0.05
            p.copy_(1.0 + noise if name.endswith("norm.weight") or ".ln_" in name and name.endswith("weight") else noise)


def forward(model, tokens):
    model.eval()
    with torch.no_grad():
        out = model(input_ids=tokens, labels=tokens)
    return out.logits.float().contiguous(), out.loss.float().reshape(1)


def make(a):
    torch.manual_seed(0)
    model = build(a.arch)
    perturb(model)
    kwargs = {"max_shard_size": a.shard_size} if a.shard_size else {}
    model.save_pretrained(a.dir, **kwargs)
    tokens = torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(1))
    logits, loss = forward(model, tokens)
    save_file({"tokens": tokens, "logits": logits, "loss": loss}, os.path.join(a.dir, "ref.safetensors"))
    print(f"{a.arch}: {sum(p.numel() for p in model.parameters())} parameters, loss {loss.item():.6f}")


def logits(a):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(a.dir, dtype=torch.float32, attn_implementation="eager")
    tokens = load_file(a.tokens)["tokens"]
    lg, loss = forward(model, tokens)
    save_file({"logits": lg, "loss": loss}, a.out)
    print(f"loss {loss.item():.6f}")


def peft_logits(a):
    """PEFT's LoRA over the transformers base: the logits of PeftModel.from_pretrained(base, adapter), and of
    its merge_and_unload() (PEFT's own folding of B A into the weights)."""
    import warnings
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    base = AutoModelForCausalLM.from_pretrained(a.base, dtype=torch.float32, attn_implementation="eager")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # GPT-2's Conv1D: PEFT notes fan_in_fan_out, which the adapter sets
        model = PeftModel.from_pretrained(base, a.adapter)
    tokens = load_file(a.tokens)["tokens"]
    lg, loss = forward(model, tokens)
    merged, _ = forward(model.merge_and_unload(), tokens)
    save_file({"logits": lg, "loss": loss, "merged_logits": merged}, a.out)
    print(f"peft loss {loss.item():.6f}")


def read_examples(shard):
    import numpy as np
    stem = shard[:-len(".bin")]
    header = np.fromfile(shard, dtype="<i4", count=256)
    assert header[0] == 20240520 and header[1] == 1, "not an llm.c uint16 shard"
    tokens = np.fromfile(shard, dtype="<u2", offset=256 * 4).astype(np.int64)
    mask = np.fromfile(stem + ".mask.bin", dtype=np.uint8)
    offsets = np.fromfile(stem + ".examples.bin", dtype="<u8").astype(np.int64)
    assert len(tokens) == header[2] == len(mask) == offsets[-1]
    return [(tokens[s:e], mask[s:e]) for s, e in zip(offsets[:-1], offsets[1:])]


def masked(a):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(a.dir, dtype=torch.float32, attn_implementation="eager")
    model.eval()
    examples = read_examples(a.shard)
    width = max(len(t) for t, _ in examples)
    ids = torch.zeros(len(examples), width, dtype=torch.int64)
    labels = torch.full((len(examples), width), -100, dtype=torch.int64)
    attention = torch.zeros(len(examples), width, dtype=torch.int64)
    for i, (t, m) in enumerate(examples):
        t, m = torch.from_numpy(t), torch.from_numpy(m).bool()
        ids[i, :len(t)] = t
        labels[i, :len(t)] = torch.where(m, t, torch.full_like(t, -100))
        attention[i, :len(t)] = 1
    with torch.no_grad():
        loss = model(input_ids=ids, attention_mask=attention, labels=labels).loss.double()
        means = [model(input_ids=ids[i:i + 1, :len(t)], labels=labels[i:i + 1, :len(t)]).loss.double()
                 for i, (t, _) in enumerate(examples)]
    mean_of_means = torch.stack(means).mean()
    save_file({"loss": loss.reshape(1), "mean_of_means": mean_of_means.reshape(1)}, a.out)
    print(f"{len(examples)} examples: loss {loss.item():.6f}, mean of means {mean_of_means.item():.6f}")


def bad(a):
    t = load_file(a.src)
    first = sorted(t)[0]
    norm = next(k for k in sorted(t) if k.endswith("ln_1.weight") or k.endswith("input_layernorm.weight"))
    if a.kind == "header":
        with open(a.out, "wb") as f:
            f.write((200).to_bytes(8, "little") + b"{not json" + b" " * 191)
        return
    if a.kind == "missing":
        victim = next(k for k in sorted(t) if k.endswith("c_attn.weight") or k.endswith("q_proj.weight"))
        print(victim)
        del t[victim]
    elif a.kind == "extra":
        t["transformer.h.0.mlp.c_gate.weight"] = torch.zeros(4)
    elif a.kind == "shape":
        t[norm] = torch.ones(t[norm].numel() + 1)
    elif a.kind == "dtype":
        t[norm] = torch.ones(t[norm].numel(), dtype=torch.int64)
    else:
        sys.exit(f"unknown kind {a.kind}")
    save_file(t, a.out, metadata={"format": "pt"})
    print(first)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("make")
    m.add_argument("arch", choices=sorted(ARCHS))
    m.add_argument("dir")
    m.add_argument("--shard-size")
    lg = sub.add_parser("logits")
    lg.add_argument("dir")
    lg.add_argument("tokens")
    lg.add_argument("out")
    mk = sub.add_parser("masked")
    mk.add_argument("dir")
    mk.add_argument("shard")
    mk.add_argument("out")
    pf = sub.add_parser("peft")
    pf.add_argument("base")
    pf.add_argument("adapter")
    pf.add_argument("tokens")
    pf.add_argument("out")
    b = sub.add_parser("bad")
    b.add_argument("kind")
    b.add_argument("src")
    b.add_argument("out")
    a = p.parse_args()
    {"make": make, "logits": logits, "masked": masked, "peft": peft_logits, "bad": bad}[a.cmd](a)


if __name__ == "__main__":
    main()
