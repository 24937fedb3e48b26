#!/usr/bin/env python3
"""test_prepare_chat.py: scripts/prepare_chat.py end to end (ctest entry `prepare_chat`; plain unittest).

A ChatML tokenizer folder is made here (a byte-level BPE with <|im_start|>, <|im_end|> and <|endoftext|>,
the chat template in tokenizer_config.json, <|im_end|> as end-of-sequence token); transformers is the
reference:
  - every kept example's ids equal transformers' apply_chat_template of its messages (or the prompt's ids
    with special tokens, the completion's, and the end-of-sequence id), and the offsets cut the shards
    into exactly those examples, in input order across both splits;
  - the mask, read apart from how the script finds it: its runs of 1 decode to each assistant turn's
    content followed by "<|im_end|>\\n" (the completion followed by "<|im_end|>"; after an empty prompt
    without a BOS, all but the completion's first token), and nothing else is 1, never an example's first token;
  - --too-long drop and truncate, each counted in data.json (a cut example keeps seq_len + 1 tokens; one
    whose first trained token lies past them is dropped and counted apart); the val split's size; the
    trained-token counts equal the masks' sums; a second run writes the same bytes;
  - bad input exits 3 naming FILE:LINE (not JSON, no role, content not text, an empty assistant turn, no
    assistant turn, an empty completion, a template whose renderings are not prefixes, no template) and
    leaves no --out behind; an --out holding a data set exits 2 without --overwrite;
  - the trainer (SUBLINEAR_TRAINER, set by ctest) trains 2 steps on the examples (data.source examples: masks and
    offsets read) and on the same shards' tokens (data.source llmc).
The script runs in this process (its main(), exit status and output), so transformers loads once.
Usage: python tests/test_prepare_chat.py [-v]
"""
import json
import os
import contextlib
import io
import struct
import subprocess
import sys
import tempfile
import unittest
from array import array

sys.dont_write_bytecode = True
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "prepare_chat.py")
os.environ["HF_HUB_OFFLINE"] = "1"

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# A template that renders the number of messages first: a conversation's renderings are not prefixes of each other.
COUNTING = "{{ messages|length }}" + CHATML

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"},
     {"role": "assistant", "content": "Paris is the capital of France."}],
    [{"role": "system", "content": "You answer in one word."},
     {"role": "user", "content": "Colour of the sky?"},
     {"role": "assistant", "content": "Blue."},
     {"role": "user", "content": "And grass?"},
     {"role": "assistant", "content": "Green, naïve café 🙂."}],
    [{"role": "user", "content": "Count to three."}, {"role": "assistant", "content": "One, two, three."}],
    [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "Hi!"}],
]
COMPLETIONS = [{"prompt": "Translate to French: cat =>", "completion": " chat"},
               {"prompt": "2 + 2 =", "completion": " 4"},
               {"prompt": "", "completion": " Hello there."}]  # no BOS: the completion's first token is no target


def make_tokenizer(folder, template):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    text = [m["content"] for c in CONVERSATIONS for m in c] + [v for c in COMPLETIONS for v in c.values()]
    tok.train_from_iterator(text * 4, trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    os.makedirs(folder, exist_ok=True)
    tok.save(os.path.join(folder, "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "bos_token": None,
              "pad_token": "<|endoftext|>"}
    if template is not None:
        config["chat_template"] = template
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump(config, f)
    return folder


def write_jsonl(path, rows):
    with open(path, "w", encoding="utf-8") as f:
        for r in rows:
            f.write((r if isinstance(r, str) else json.dumps(r, ensure_ascii=False)) + "\n")
    return path


sys.path.insert(0, os.path.dirname(SCRIPT))
import prepare_chat  # noqa: E402  (run in this process: transformers is imported once, not once a run)


class Ran:
    def __init__(self, returncode, stdout, stderr):
        self.returncode, self.stdout, self.stderr = returncode, stdout, stderr


def run(*args):
    """prepare_chat.py's main() with `args`: its exit status and what it printed, as a process would give them."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = prepare_chat.main(list(args))
        except SystemExit as e:  # argparse's usage errors
            code = e.code
    return Ran(code, out.getvalue(), err.getvalue())


def read(path, mode="rb"):
    with open(path, mode) as f:
        return f.read()


def data_json(out):
    return json.loads(read(os.path.join(out, "data.json"), "r"))


def shard(path):
    data = read(path)
    header = struct.unpack("<256i", data[:1024])
    width = 2 if header[1] == 1 else 4
    ids = array("H" if width == 2 else "I", data[1024:])
    assert len(ids) == header[2], (len(ids), header[2])
    return list(ids)


def split_files(out, name):
    ids = shard(os.path.join(out, f"{name}.bin"))
    mask = list(read(os.path.join(out, f"{name}.mask.bin")))
    offsets = array("Q", read(os.path.join(out, f"{name}.examples.bin")))
    return ids, mask, list(offsets)


def runs_of_ones(mask):
    runs, start = [], None
    for i, m in enumerate(mask + [0]):
        if m and start is None:
            start = i
        if not m and start is not None:
            runs.append((start, i))
            start = None
    return runs


class PrepareChat(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        from transformers import AutoTokenizer
        cls.tmp = tempfile.TemporaryDirectory()
        cls.chatml = make_tokenizer(os.path.join(cls.tmp.name, "chatml"), CHATML)
        cls.tok = AutoTokenizer.from_pretrained(cls.chatml)

    @classmethod
    def tearDownClass(cls):
        cls.tmp.cleanup()

    def path(self, name):
        return os.path.join(self.tmp.name, name)

    def reference(self, row):
        """(ids, the texts the trained runs must decode to) from transformers alone."""
        if "messages" in row:
            ids = self.tok.apply_chat_template(row["messages"], tokenize=True)
            ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
            return ids, [m["content"] + "<|im_end|>\n" for m in row["messages"] if m["role"] == "assistant"]
        head = self.tok(row["prompt"])["input_ids"]
        tail = self.tok(row["completion"], add_special_tokens=False)["input_ids"] + [self.tok.eos_token_id]
        texts = [row["completion"] + "<|im_end|>"] if head else [self.tok.decode(tail[1:])]  # no one's target: the first
        return list(head) + list(tail), texts

    def examples(self, out):
        """Every example of both splits as (ids, mask), in the order the offsets give, with the split's name."""
        got = []
        for name in ("train", "val"):
            ids, mask, offsets = split_files(out, name)
            self.assertEqual(len(mask), len(ids))
            self.assertEqual(offsets[0], 0)
            self.assertEqual(offsets[-1], len(ids))
            got += [(name, ids[a:b], mask[a:b]) for a, b in zip(offsets, offsets[1:])]
            self.assertTrue(all(mask[a] == 0 for a in offsets[:-1]), f"{name}: an example's first token marked trained")
        return got

    def test_examples_and_masks_match_transformers(self):
        rows = [{"messages": c} for c in CONVERSATIONS] + COMPLETIONS
        src = write_jsonl(self.path("mixed.jsonl"), rows[:3] + [""] + rows[3:])  # a blank line is skipped
        out = self.path("mixed")
        r = run(src, "--tokenizer", self.chatml, "--out", out, "--seq-len", "512", "--val-fraction", "0.34")
        self.assertEqual(r.returncode, 0, r.stderr)
        info = data_json(out)
        got = self.examples(out)
        self.assertEqual(len(got), len(rows))
        self.assertEqual(info["val"]["examples"], round(len(rows) * 0.34))
        # The draw keeps input order within each split: match each split's examples to the rows in order.
        for name in ("train", "val"):
            mine = [(ids, mask) for n, ids, mask in got if n == name]
            want = [self.reference(row) for row in rows]
            it = iter(want)
            for ids, mask in mine:
                ref_ids, texts = next((w for w in it if w[0] == ids), (None, None))
                self.assertIsNotNone(ref_ids, f"{name}: an example that is no row's apply_chat_template ids")
                decoded = [self.tok.decode(ids[a:b]) for a, b in runs_of_ones(mask)]
                self.assertEqual(decoded, texts)
            self.assertEqual(info[name]["trained_tokens"], sum(sum(m) for _, m in mine))
        self.assertEqual(info["examples"], len(rows))
        self.assertEqual(info["dropped_too_long"] + info["truncated"], 0)
        # The same bytes on a second run.
        again = self.path("mixed2")
        self.assertEqual(run(src, "--tokenizer", self.chatml, "--out", again, "--seq-len", "512", "--val-fraction",
                             "0.34").returncode, 0)
        for name in ("train.bin", "val.bin", "train.mask.bin", "val.mask.bin", "train.examples.bin", "val.examples.bin"):
            self.assertEqual(read(os.path.join(out, name)), read(os.path.join(again, name)), name)

    def test_the_trainer_reads_the_examples(self):
        """As docs/data.md says: data.source examples reads the shards with their masks and offsets (the loss
        over the trained tokens only), and data.source llmc the same shards' tokens (every token trained)."""
        trainer = os.environ.get("SUBLINEAR_TRAINER") or os.path.join(ROOT, "build", "trainer")
        if not os.path.isfile(trainer):
            self.fail(f"no trainer binary at {trainer} (set SUBLINEAR_TRAINER)")
        src = write_jsonl(self.path("train.jsonl"), [{"messages": c} for c in CONVERSATIONS] * 3)
        out = self.path("for_trainer")
        self.assertEqual(run(src, "--tokenizer", self.chatml, "--out", out, "--seq-len", "48", "--too-long",
                             "truncate").returncode, 0)
        info = data_json(out)
        for source, says in (("examples", f"(examples 0..{info['train']['examples']} of {info['train']['examples']}, "
                                          f"{info['train']['tokens']} tokens, {info['train']['trained_tokens']} trained)"),
                             ("llmc", f"(llm.c, {info['train']['tokens']} tokens)")):
            run_dir = self.path(f"chat_run_{source}")
            sets = [f"data.source={source}", f"data.path={out}/train.bin", f"data.val_path={out}/val.bin",
                    f"model.vocab_size={info['vocab_size']}", "model.n_layer=1", "model.n_embd=32", "model.n_head=2",
                    "train.seq_len=48", "train.micro_batch=2", "train.grad_accum=1", "train.steps=2",
                    "train.warmup_steps=1", "train.eval_interval=2", "train.eval_batches=1", "logging.progress=false",
                    f"logging.dir={run_dir}"]
            t = subprocess.run([trainer, "--config", os.path.join(ROOT, "configs", "tiny.yaml")] +
                               [a for kv in sets for a in ("--set", kv)], capture_output=True, text=True,
                               env=dict(os.environ, OMP_NUM_THREADS="1"), timeout=120)
            self.assertEqual(t.returncode, 0, t.stdout[-3000:] + t.stderr[-3000:])
            self.assertIn(says, t.stdout + t.stderr)
            summary = json.loads(read(os.path.join(run_dir, "summary.json"), "r"))
            self.assertEqual((summary["steps"], summary["tokens"]), (2, 2 * 2 * 48))
            if source == "examples":  # two rows a step, each one example: its trained tokens, never the padding
                self.assertGreater(summary["trained_tokens"], 0)
                self.assertLess(summary["trained_tokens"], summary["tokens"])
            else:
                self.assertEqual(summary["trained_tokens"], summary["tokens"])

    def test_the_shipped_chat_example_is_reproducible_and_prepares(self):
        """data/chat_example.jsonl and data/chat_tokenizer/ are what scripts/make_chat_example.py writes, byte for
        byte, and prepare_chat turns them into examples of very different lengths with its ChatML template."""
        import make_chat_example
        out = self.path("chat_example")
        with contextlib.redirect_stdout(io.StringIO()):
            self.assertEqual(make_chat_example.main(["--out", out]), 0)
        for name in ("chat_example.jsonl", os.path.join("chat_tokenizer", "tokenizer.json"),
                     os.path.join("chat_tokenizer", "tokenizer_config.json")):
            self.assertEqual(read(os.path.join(out, name)), read(os.path.join(ROOT, "data", name)), name)
        prepared = self.path("chat_example_prepared")
        r = run(os.path.join(ROOT, "data", "chat_example.jsonl"), "--tokenizer", os.path.join(ROOT, "data", "chat_tokenizer"),
                "--seq-len", "256", "--out", prepared)
        self.assertEqual(r.returncode, 0, r.stderr)
        info = data_json(prepared)
        self.assertEqual((info["examples_read"], info["examples"]), (600, 600))
        import numpy as np
        lengths = np.diff(np.fromfile(os.path.join(prepared, "train.examples.bin"), dtype="<u8"))
        self.assertGreater(lengths.max(), 4 * lengths.min())

    def test_too_long_examples_dropped_or_cut_and_counted(self):
        lengths = [len(self.reference({"messages": c})[0]) for c in CONVERSATIONS]
        seq_len = sorted(lengths)[1]  # the shortest two fit in seq_len + 1 tokens, the others do not
        rows = [{"messages": c} for c in CONVERSATIONS]
        src = write_jsonl(self.path("long.jsonl"), rows)
        fits = sum(n <= seq_len + 1 for n in lengths)
        out = self.path("drop")
        r = run(src, "--tokenizer", self.chatml, "--out", out, "--seq-len", str(seq_len), "--val-fraction", "0.4")
        self.assertEqual(r.returncode, 0, r.stderr)
        info = data_json(out)
        self.assertEqual((info["examples"], info["dropped_too_long"], info["truncated"]), (fits, len(rows) - fits, 0))
        self.assertIn(f"{len(rows) - fits} dropped as longer than {seq_len + 1} tokens", r.stdout)
        out = self.path("cut")
        r = run(src, "--tokenizer", self.chatml, "--out", out, "--seq-len", str(seq_len), "--too-long", "truncate",
                "--val-fraction", "0.4")
        self.assertEqual(r.returncode, 0, r.stderr)
        info = data_json(out)
        cut = [(ids, mask) for _, ids, mask in self.examples(out) if len(ids) == seq_len + 1]
        self.assertEqual(info["truncated"] + info["dropped_no_target_left"], len(rows) - fits)
        self.assertEqual(info["examples"], fits + info["truncated"])
        for ids, mask in cut:
            full = next(self.reference(r_)[0] for r_ in rows if self.reference(r_)[0][:seq_len + 1] == ids)
            self.assertEqual(ids, full[:seq_len + 1])
            self.assertTrue(any(mask[1:]))
        # A conversation whose answer starts past seq_len + 1 tokens keeps no trained token: dropped, counted.
        short = [{"messages": CONVERSATIONS[0]}, {"messages": CONVERSATIONS[3]}]
        seq_len = max(len(self.reference(r_)[0]) for r_ in short) - 1  # both short ones fit whole
        late = {"messages": [{"role": "user", "content": "word " * (2 * seq_len)}, {"role": "assistant", "content": "Yes."}]}
        src = write_jsonl(self.path("late.jsonl"), short + [late, late])
        out = self.path("late")
        r = run(src, "--tokenizer", self.chatml, "--out", out, "--seq-len", str(seq_len), "--too-long", "truncate",
                "--val-fraction", "0.5")
        self.assertEqual(r.returncode, 0, r.stderr)
        info = data_json(out)
        self.assertEqual((info["examples"], info["truncated"], info["dropped_no_target_left"]), (2, 0, 2))

    def refused(self, rows, needle, tokenizer=None, code=3):
        src = write_jsonl(self.path("bad.jsonl"), rows)
        out = self.path("bad_out")
        r = run(src, "--tokenizer", tokenizer or self.chatml, "--out", out, "--seq-len", "512")
        self.assertEqual(r.returncode, code, r.stderr)
        self.assertIn(needle, r.stderr)
        self.assertFalse(os.path.exists(out), "an output folder was left behind")

    def test_bad_input_names_the_line_and_writes_nothing(self):
        good = {"messages": CONVERSATIONS[0]}
        src = self.path("bad.jsonl")
        self.refused([good, good, "{not json"], f"{src}:3: not JSON")
        self.refused([good, {"messages": [{"content": "hi"}, {"role": "assistant", "content": "x"}]}],
                     f"{src}:2: message 0: \"role\" is missing")
        self.refused([{"messages": [{"role": "user", "content": 3}, {"role": "assistant", "content": "x"}]}],
                     f"{src}:1: message 0: \"content\" is a int, not a string")
        self.refused([good, {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "  "}]}],
                     f"{src}:2: message 1: an empty assistant turn")
        self.refused([good, {"messages": [{"role": "user", "content": "hi"}]}], f"{src}:2: no assistant turn")
        self.refused([good, {"prompt": "a", "completion": ""}], f"{src}:2: an empty completion")
        self.refused([good, {"text": "plain"}], f"{src}:2: not an example")
        self.refused([good, good], f"{src}:1: the chat template's rendering",
                     tokenizer=make_tokenizer(self.path("counting"), COUNTING))
        self.refused([good, good], f"{src}:1: the tokenizer has no chat template",
                     tokenizer=make_tokenizer(self.path("plain"), None))

    def test_an_existing_data_set_needs_overwrite(self):
        src = write_jsonl(self.path("ok.jsonl"), [{"messages": c} for c in CONVERSATIONS])
        out = self.path("twice")
        self.assertEqual(run(src, "--tokenizer", self.chatml, "--out", out, "--seq-len", "512").returncode, 0)
        r = run(src, "--tokenizer", self.chatml, "--out", out, "--seq-len", "512")
        self.assertEqual(r.returncode, 2)
        self.assertIn("--overwrite", r.stderr)
        self.assertEqual(run(src, "--tokenizer", self.chatml, "--out", out, "--seq-len", "512", "--overwrite").returncode, 0)


if __name__ == "__main__":
    unittest.main()
