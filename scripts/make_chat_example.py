#!/usr/bin/env python3
"""make_chat_example.py: the shipped fine-tuning example: data/chat_example.jsonl and data/chat_tokenizer/.

  python3 scripts/make_chat_example.py [--out data] [--count 600]

Writes OUT/chat_example.jsonl: `--count` conversations ({"messages": [...]}, one to three user/assistant
exchanges each) about the shipped corpus's subjects (sums and differences, the days and months in order,
counting, words spelled backwards), drawn from a fixed seed, so that answers run from one word to long
lists: examples of very different lengths, as real chat data has. And OUT/chat_tokenizer/: a byte-level
BPE (512 tokens, trained on those conversations with the `tokenizers` package) with <|endoftext|>,
<|im_start|> and <|im_end|>, and a ChatML chat template in its tokenizer_config.json, which
scripts/prepare_chat.py applies through transformers. The same command writes the same bytes.
"""
import argparse
import json
import os
import random

DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
          "November", "December"]
WORDS = ["cat", "river", "garden", "window", "planet", "orange", "silver", "market", "pencil", "thunder"]
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def exchange(rng):
    """One (question, answer) pair; the counting and listing kinds give the long answers."""
    kind = rng.choice(["sum", "difference", "day", "month", "count", "spell", "months_from"])
    if kind == "sum":
        a, b = rng.randint(1, 99), rng.randint(1, 99)
        return f"What is {a} plus {b}?", f"{a} plus {b} is {a + b}."
    if kind == "difference":
        a, b = sorted((rng.randint(1, 99), rng.randint(1, 99)), reverse=True)
        return f"What is {a} minus {b}?", f"{a} minus {b} is {a - b}."
    if kind == "day":
        d = rng.randrange(7)
        return f"Which day comes after {DAYS[d]}?", f"{DAYS[(d + 1) % 7]}."
    if kind == "month":
        m = rng.randrange(12)
        return f"Which month comes before {MONTHS[m]}?", f"{MONTHS[m - 1]} comes before {MONTHS[m]}."
    if kind == "count":
        a = rng.randint(1, 20)
        b = a + rng.randint(2, 40)
        return f"Count from {a} to {b}.", ", ".join(str(i) for i in range(a, b + 1)) + "."
    if kind == "spell":
        w = rng.choice(WORDS)
        return f"Spell {w} backwards.", f"{w} backwards is {w[::-1]}."
    m, n = rng.randrange(12), rng.randint(2, 12)
    return (f"List {n} months starting with {MONTHS[m]}.",
            ", ".join(MONTHS[(m + i) % 12] for i in range(n)) + ".")


def conversations(count, seed=0):
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        messages = []
        for _ in range(rng.choice([1, 1, 1, 2, 3])):
            q, a = exchange(rng)
            messages += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
        out.append({"messages": messages})
    return out


def write_tokenizer(folder, rows):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    text = [m["content"] for r in rows for m in r["messages"]]
    tok.train_from_iterator(text, trainers.BpeTrainer(
        vocab_size=512, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    os.makedirs(folder, exist_ok=True)
    tok.save(os.path.join(folder, "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "bos_token": None,
              "pad_token": "<|endoftext|>", "chat_template": CHATML}
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=1)
        f.write("\n")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data"),
                   help="folder for chat_example.jsonl and chat_tokenizer/ (default: the repository's data/)")
    p.add_argument("--count", type=int, default=600, help="conversations (default 600)")
    a = p.parse_args(argv)
    rows = conversations(a.count)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "chat_example.jsonl"), "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    write_tokenizer(os.path.join(a.out, "chat_tokenizer"), rows)
    print(f"{len(rows)} conversations -> {a.out}/chat_example.jsonl; tokenizer -> {a.out}/chat_tokenizer/")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
