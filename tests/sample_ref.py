#!/usr/bin/env python3
"""sample_ref.py: the references tests/test_sample.cpp checks `trainer sample` and the tokenizer against.

  sample_ref.py tokenizer OUT.json --style gpt2|llama3 --vocab N TEXT...   train a byte-level BPE with
        Hugging Face `tokenizers` (gpt2: the ByteLevel pre-tokenizer's own regex; llama3: a Split regex
        then ByteLevel without one, as LLaMA 3's tokenizer.json has it) on the TEXT files
  sample_ref.py encode TOKENIZER.json TEXT        print {"ids": [...], "decoded": "..."} (no special tokens added)
  sample_ref.py generate FOLDER IDS N             greedy transformers generate() on an exported folder:
        AutoModelForCausalLM and AutoTokenizer both load it; prints {"ids": [...new...], "vocab": ...}
"""
import argparse
import json
import sys

sys.dont_write_bytecode = True

LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")


def train_tokenizer(args):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE(ignore_merges=args.style == "llama3"))  # LLaMA 3's tokenizer.json sets it
    if args.style == "gpt2":
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=args.vocab, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train(args.text, trainer)
    tok.save(args.out)


def encode(args):
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(args.tokenizer)
    with open(args.text, encoding="utf-8") as f:
        text = f.read()
    ids = tok.encode(text, add_special_tokens=False).ids
    print(json.dumps({"ids": ids, "decoded": tok.decode(ids, skip_special_tokens=False)}))


def generate(args):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(args.folder)
    model = AutoModelForCausalLM.from_pretrained(args.folder, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # the C++ side runs with --ignore-eot
    model.generation_config.pad_token_id = 0
    ids = torch.tensor([json.loads(args.ids)], dtype=torch.long)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=args.n,
                             min_new_tokens=args.n)
    new = out[0, ids.shape[1]:].tolist()
    print(json.dumps({"ids": new, "vocab": len(tokenizer), "decoded": tokenizer.decode(new)}))


def main():
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("tokenizer")
    t.add_argument("out")
    t.add_argument("--style", choices=["gpt2", "llama3"], default="gpt2")
    t.add_argument("--vocab", type=int, default=512)
    t.add_argument("text", nargs="+")
    e = sub.add_parser("encode")
    e.add_argument("tokenizer")
    e.add_argument("text")
    g = sub.add_parser("generate")
    g.add_argument("folder")
    g.add_argument("ids")
    g.add_argument("n", type=int)
    args = p.parse_args()
    {"tokenizer": train_tokenizer, "encode": encode, "generate": generate}[args.cmd](args)


if __name__ == "__main__":
    main()
