#!/usr/bin/env python3
"""prepare_chat.py: turn instruction and chat data (JSONL) into token shards with a loss mask and example boundaries.

  prepare_chat.py INPUT.jsonl... --tokenizer DIR --out DIR --seq-len N [options]

INPUT: JSONL files, one example a line (blank lines skipped), either
  {"messages": [{"role": "system" | "user" | "assistant" | ..., "content": "..."}, ...]}
    rendered with the chat template of the tokenizer in DIR (tokenizer.json with tokenizer_config.json's
    "chat_template" or a chat_template.jinja beside it: transformers' apply_chat_template); the trained
    tokens are each assistant turn's, from after the template's generation prompt to the end of the turn
    (its end-of-turn token included), found as the tokens that rendering messages[:i + 1] adds to
    rendering messages[:i] with the generation prompt;
  or {"prompt": "...", "completion": "..."}: the prompt's tokens (with the tokenizer's own special
    tokens, e.g. a BOS) then the completion's and the end-of-sequence token; the completion and the
    end-of-sequence token are trained.
An example of more than N + 1 tokens (a row of the trainer's train.seq_len N holds N inputs and their N
targets) is dropped (--too-long drop, the default) or cut to N + 1 tokens (--too-long truncate; one
that keeps no trained token is dropped); both are counted in data.json and printed.
Writes, in DIR: train.bin and val.bin (llm.c token shards, as prepare_data.py writes: version 1 = uint16
tokens up to 65,536 ids, version 2 = uint32; the examples one after another, nothing put between them),
train.mask.bin and val.mask.bin (one byte a token of the shard beside it: 1 where that token is a
trained target, else 0), train.examples.bin and val.examples.bin (little-endian uint64 offsets into the
shard: example k is tokens [offset k, offset k + 1); the first is 0, the last the shard's token count),
the tokenizer's files (copied) and data.json (counts: examples, tokens, trained tokens, dropped and
truncated examples, per split). Split: --val-fraction of the kept examples (at least 1) go to val, a
seeded draw (--seed), input order kept in both.
Everything is read, checked and tokenized before anything is written; the files are written as
temporaries in DIR and renamed at the end (data.json last), so an error leaves nothing half-written.
Exit codes: 0 ok; 2 bad usage (argparse; DIR already holding a data set without --overwrite); 3 bad input
(a line that is not JSON or not an example, with FILE:LINE: a missing or non-string role, content,
prompt or completion; an empty assistant turn or completion; a conversation without an assistant turn;
a tokenizer without a chat template for "messages", or without an end-of-sequence token for
"prompt"/"completion"; a chat template whose renderings are not prefixes of each other; too few
examples for two splits); 7 an output file could not be written; 130 interrupted.
"""
import argparse
import json
import os
import random
import sys
import time
from array import array

sys.dont_write_bytecode = True  # no __pycache__ in the repo
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from prepare_data import (EXIT_DATA, UINT16_VOCAB, Fail, Shard, check_out, discard, exit_status, publish,  # noqa: E402
                          vocab_span, write_temp)

SPLITS = ("train", "val")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
OUTPUTS = [f"{s}{ext}" for s in SPLITS for ext in (".bin", ".mask.bin", ".examples.bin")] + list(TOKENIZER_FILES) + ["data.json"]


def note(msg):
    print(f"prepare_chat: {msg}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------------- tokenizer

def load_tokenizer(folder):
    """transformers' tokenizer of a checkpoint folder (local files only)."""
    if not os.path.isfile(os.path.join(folder, "tokenizer.json")):
        raise Fail(EXIT_DATA, f"{folder}: no tokenizer.json; give the folder of a Hugging Face checkpoint's tokenizer "
                              f"(tokenizer.json, tokenizer_config.json with its chat_template)")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer
    try:
        return AutoTokenizer.from_pretrained(folder)
    except Exception as e:  # noqa: BLE001 -- any failure to load is the folder's
        raise Fail(EXIT_DATA, f"{folder}: transformers cannot load this tokenizer ({str(e).splitlines()[0] if str(e) else type(e).__name__})")


def encode(tok, text):
    """The ids of `text` as apply_chat_template tokenizes a rendering: no special tokens added."""
    return list(tok(text, add_special_tokens=False)["input_ids"])


# ------------------------------------------------------------------------------------------- examples

def _field(obj, key, where):
    value = obj.get(key)
    if not isinstance(value, str):
        got = "missing" if key not in obj else f"a {type(value).__name__}, not a string"
        raise Fail(EXIT_DATA, f"{where}: \"{key}\" is {got}; every example needs it as text")
    return value


def chat_example(tok, messages, where):
    """(ids, mask) of a conversation: each assistant turn's tokens trained."""
    if not isinstance(messages, list) or not messages:
        raise Fail(EXIT_DATA, f"{where}: \"messages\" must be a non-empty list of {{\"role\", \"content\"}} objects")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise Fail(EXIT_DATA, f"{where}: message {i} is not an object with \"role\" and \"content\"")
        role, content = _field(m, "role", f"{where}: message {i}"), _field(m, "content", f"{where}: message {i}")
        if role == "assistant" and not content.strip():
            raise Fail(EXIT_DATA, f"{where}: message {i}: an empty assistant turn (nothing to train); fill it or drop the line")
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if not turns:
        raise Fail(EXIT_DATA, f"{where}: no assistant turn, so no token to train; drop the line or add the answer")
    if not tok.chat_template:
        raise Fail(EXIT_DATA, f"{where}: the tokenizer has no chat template (tokenizer_config.json \"chat_template\" or "
                              f"chat_template.jinja) to render \"messages\"; use a chat model's tokenizer, or "
                              f"{{\"prompt\", \"completion\"}} lines")

    def render(msgs, generation_prompt):
        return encode(tok, tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=generation_prompt))

    ids = render(messages, False)
    mask = bytearray(len(ids))
    for i in turns:
        before, through = render(messages[:i], True), render(messages[: i + 1], False)
        if through[: len(before)] != before or ids[: len(through)] != through:
            raise Fail(EXIT_DATA, f"{where}: the chat template's rendering of the first {i} messages (with the generation "
                                  f"prompt) is not a prefix of the rendering with message {i}, so the assistant's tokens "
                                  f"cannot be told apart; this template is not supported")
        mask[len(before): len(through)] = b"\x01" * (len(through) - len(before))
    return ids, mask


def completion_example(tok, obj, where):
    """(ids, mask) of a prompt and its completion: the completion and the end-of-sequence token trained."""
    prompt, completion = _field(obj, "prompt", where), _field(obj, "completion", where)
    if not completion.strip():
        raise Fail(EXIT_DATA, f"{where}: an empty completion (nothing to train); fill it or drop the line")
    if tok.eos_token_id is None:
        raise Fail(EXIT_DATA, f"{where}: the tokenizer names no end-of-sequence token (eos_token in "
                              f"tokenizer_config.json) to end a completion with")
    head = list(tok(prompt, add_special_tokens=True)["input_ids"])
    tail = encode(tok, completion) + [tok.eos_token_id]
    return head + tail, bytearray(len(head)) + b"\x01" * len(tail)


def read_examples(paths, tok):
    """Every example of every file, in order: [(ids, mask, "FILE:LINE")]."""
    out = []
    for path in paths:
        try:
            with open(path, encoding="utf-8") as f:
                lines = f.readlines()
        except FileNotFoundError:
            raise Fail(EXIT_DATA, f"{path}: no such file")
        except (OSError, UnicodeDecodeError) as e:
            raise Fail(EXIT_DATA, f"{path}: cannot read it as UTF-8 text ({e}); give JSONL files")
        for n, line in enumerate(lines, 1):
            if not line.strip():
                continue
            where = f"{path}:{n}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise Fail(EXIT_DATA, f"{where}: not JSON ({e.msg} at column {e.colno}); each line must be one JSON object")
            if not isinstance(obj, dict) or not ("messages" in obj or "prompt" in obj or "completion" in obj):
                raise Fail(EXIT_DATA, f"{where}: not an example: give {{\"messages\": [...]}} or {{\"prompt\", \"completion\"}}")
            ids, mask = (chat_example(tok, obj["messages"], where) if "messages" in obj
                         else completion_example(tok, obj, where))
            mask[0] = 0  # an example's first token is no one's target (an empty prompt without a BOS)
            out.append((ids, mask, where))
    return out


def fit(examples, seq_len, too_long):
    """The examples that fit a row of seq_len (seq_len + 1 tokens), the others dropped or cut; counts."""
    kept, counts = [], {"dropped_too_long": 0, "truncated": 0, "dropped_no_target_left": 0}
    limit = seq_len + 1
    for ids, mask, where in examples:
        if len(ids) > limit:
            if too_long == "drop":
                counts["dropped_too_long"] += 1
                continue
            ids, mask = ids[:limit], mask[:limit]
            if not any(mask):
                counts["dropped_no_target_left"] += 1
                continue
            counts["truncated"] += 1
        kept.append((ids, mask, where))
    return kept, counts


# --------------------------------------------------------------------------------------------- writing

class Split:
    """One split's three files being made: the token shard (a temporary), the mask and the offsets in memory."""

    def __init__(self, out, name, version, temps):
        self.name = name
        self.shard = Shard(out, f"{name}.bin", version)
        temps.append(self.shard.tmp)
        self.mask = bytearray()
        self.offsets = array("Q", [0])
        self.examples = self.trained = 0

    def add(self, ids, mask):
        self.shard.add(None, ids)
        self.mask += mask
        self.offsets.append(self.offsets[-1] + len(ids))
        self.examples += 1
        self.trained += sum(mask)

    def finish(self, out, temps):
        """[(temporary, final name)] of the split's files, written and synced."""
        self.shard.finish()
        offsets = array("Q", self.offsets)
        if sys.byteorder != "little":
            offsets.byteswap()
        return [(self.shard.tmp, f"{self.name}.bin"),
                (write_temp(out, f"{self.name}.mask.bin", bytes(self.mask), temps), f"{self.name}.mask.bin"),
                (write_temp(out, f"{self.name}.examples.bin", offsets.tobytes(), temps), f"{self.name}.examples.bin")]

    def summary(self):
        return {"path": f"{self.name}.bin", "mask": f"{self.name}.mask.bin", "examples_path": f"{self.name}.examples.bin",
                "examples": self.examples, "tokens": self.shard.count, "trained_tokens": self.trained}


def tokenizer_files(folder, out, temps):
    """[(temporary, final name)] of the tokenizer's files, copied."""
    pending = []
    for name in TOKENIZER_FILES:
        src = os.path.join(folder, name)
        if os.path.isfile(src):
            with open(src, "rb") as f:
                pending.append((write_temp(out, name, f.read(), temps), name))
    return pending


def write_data_set(a, tok, kept, counts, n_read):
    n_val = max(1, round(len(kept) * a.val_fraction))
    if len(kept) - n_val < 1:
        raise Fail(EXIT_DATA, f"too few examples ({len(kept)} kept of {n_read}) for a train and a val split: at least 2 "
                              f"are needed; give more lines, or a larger --seq-len / --too-long truncate")
    chosen_for_val = set(random.Random(a.seed).sample(range(len(kept)), n_val))
    vocab_size = vocab_span(tok.backend_tokenizer)
    version = 1 if vocab_size <= UINT16_VOCAB else 2
    created = not os.path.isdir(a.out)
    os.makedirs(a.out, exist_ok=True)
    temps, splits = [], {}
    try:
        for name in SPLITS:
            splits[name] = Split(a.out, name, version, temps)
        for k, (ids, mask, _) in enumerate(kept):
            splits["val" if k in chosen_for_val else "train"].add(ids, mask)
        pending = [p for s in splits.values() for p in s.finish(a.out, temps)] + tokenizer_files(a.tokenizer, a.out, temps)
        info = {
            "format": "llm.c token shards with a loss mask and example offsets",
            "version": version, "token_dtype": "uint16" if version == 1 else "uint32", "vocab_size": vocab_size,
            "mask": "one byte a token: 1 = the token is a trained target", "offsets": "little-endian uint64, examples + 1",
            "seq_len": a.seq_len, "too_long": a.too_long, "examples_read": n_read, "examples": len(kept), **counts,
            "train": splits["train"].summary(), "val": splits["val"].summary(),
            "split": {"rule": "seeded draw of whole examples (Python random.Random(seed).sample), input order kept",
                      "val_fraction": a.val_fraction, "seed": a.seed},
            "tokenizer": a.tokenizer, "sources": a.inputs,
        }
        pending.append((write_temp(a.out, "data.json", (json.dumps(info, indent=2, ensure_ascii=False) + "\n").encode(), temps),
                        "data.json"))
        publish(a.out, pending, optional=TOKENIZER_FILES)
    except BaseException:
        discard([s.shard for s in splits.values()], temps, a.out, created)
        raise
    return info


# ------------------------------------------------------------------------------------------------ main

def parse_args(argv):
    p = argparse.ArgumentParser(prog="prepare_chat.py", description=__doc__.split("\n\n")[0].split(": ", 1)[1] +
                                " See docs/data.md.", formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("inputs", nargs="+", metavar="INPUT", help="JSONL file: {\"messages\"} or {\"prompt\", \"completion\"} lines")
    p.add_argument("--tokenizer", required=True, metavar="DIR", help="a checkpoint's tokenizer folder (tokenizer.json, "
                                                                    "tokenizer_config.json with its chat template)")
    p.add_argument("--out", required=True, metavar="DIR", help="output folder")
    p.add_argument("--seq-len", type=int, required=True, metavar="N", help="the recipe's train.seq_len: an example fits "
                                                                          "in N + 1 tokens")
    p.add_argument("--too-long", choices=("drop", "truncate"), default="drop",
                   help="an example longer than N + 1 tokens: dropped (default) or cut to N + 1; counted either way")
    p.add_argument("--val-fraction", type=float, default=0.1, metavar="F", help="share of the examples for val (default 0.1)")
    p.add_argument("--seed", type=int, default=1337, help="seed of the draw of val's examples (default 1337)")
    p.add_argument("--overwrite", action="store_true", help="replace the data set already in --out")
    a = p.parse_args(argv)
    if a.seq_len < 1:
        p.error("--seq-len must be >= 1")
    if not 0.0 < a.val_fraction < 1.0:
        p.error(f"--val-fraction must be in (0, 1), got {a.val_fraction}")
    check_out(p, a.out, OUTPUTS, a.overwrite)
    return a


def prepare(a):
    t0 = time.monotonic()
    tok = load_tokenizer(a.tokenizer)
    examples = read_examples(a.inputs, tok)
    if not examples:
        raise Fail(EXIT_DATA, f"no examples: {', '.join(a.inputs)} hold(s) only blank lines")
    kept, counts = fit(examples, a.seq_len, a.too_long)
    info = write_data_set(a, tok, kept, counts, len(examples))
    tr, va = info["train"], info["val"]
    print(f"prepare_chat: {a.out}: {len(examples):,} examples read, {info['examples']:,} kept ({counts['dropped_too_long']:,} "
          f"dropped as longer than {a.seq_len + 1} tokens, {counts['truncated']:,} truncated, "
          f"{counts['dropped_no_target_left']:,} dropped with no trained token left); train {tr['examples']:,} examples, "
          f"{tr['tokens']:,} tokens ({tr['trained_tokens']:,} trained); val {va['examples']:,} examples, {va['tokens']:,} "
          f"tokens ({va['trained_tokens']:,} trained); vocab_size {info['vocab_size']:,}; {time.monotonic() - t0:.1f} s")
    return info


def main(argv=None):
    return exit_status(prepare, parse_args(argv), note)


if __name__ == "__main__":
    sys.exit(main())
