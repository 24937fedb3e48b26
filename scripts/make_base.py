#!/usr/bin/env python3
"""make_base.py: a small LLaMA base model made locally with transformers, for the fine-tuning walk-through.

  python3 scripts/make_base.py --tokenizer DIR --out DIR [--layers 2] [--width 128] [--heads 4]
                               [--mlp 352] [--context 512] [--seed 0]

Builds LlamaForCausalLM from a config (nothing is downloaded): the tokenizer's vocabulary size, the
given layers, width, heads, SwiGLU width and context, untied embeddings, transformers' own random init
drawn from --seed, and save_pretrained(OUT) (config.json + model.safetensors, fp32), with the
tokenizer's files copied beside them, so that `model.init_from: OUT` starts a run from it and
AutoTokenizer / AutoModelForCausalLM load it. The same command writes the same bytes.
Exit codes: 0 ok; 2 bad usage (argparse, OUT already holding a model); 3 a tokenizer directory without
tokenizer.json.
"""
import argparse
import json
import os
import shutil
import sys


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokenizer", required=True, help="directory with tokenizer.json (and tokenizer_config.json)")
    p.add_argument("--out", required=True)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--mlp", type=int, default=352)
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    tok_file = os.path.join(a.tokenizer, "tokenizer.json")
    if not os.path.isfile(tok_file):
        print(f"make_base.py: {a.tokenizer} has no tokenizer.json; give the directory a tokenizer was saved to",
              file=sys.stderr)
        return 3
    if os.path.exists(os.path.join(a.out, "model.safetensors")):
        print(f"make_base.py: {a.out} already holds a model; choose another --out or remove it", file=sys.stderr)
        return 2

    import torch
    from tokenizers import Tokenizer
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()

    vocab = Tokenizer.from_file(tok_file).get_vocab_size()
    config = LlamaConfig(vocab_size=vocab, hidden_size=a.width, intermediate_size=a.mlp, num_hidden_layers=a.layers,
                         num_attention_heads=a.heads, num_key_value_heads=a.heads, max_position_embeddings=a.context,
                         rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=None, eos_token_id=None)
    torch.manual_seed(a.seed)
    model = LlamaForCausalLM(config)
    os.makedirs(a.out, exist_ok=True)
    model.save_pretrained(a.out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if os.path.isfile(os.path.join(a.tokenizer, name)):
            shutil.copyfile(os.path.join(a.tokenizer, name), os.path.join(a.out, name))
    params = sum(t.numel() for t in model.parameters())
    print(json.dumps({"out": a.out, "vocab_size": vocab, "layers": a.layers, "width": a.width, "heads": a.heads,
                      "mlp": a.mlp, "context": a.context, "params": params}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
