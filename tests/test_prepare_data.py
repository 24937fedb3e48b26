#!/usr/bin/env python3
"""test_prepare_data.py: scripts/prepare_data.py end to end (ctest entry `prepare_data`; plain unittest).

  - a byte-level BPE (vocab 512) trained on small documents in a folder (recursive, hidden files skipped):
    the shards decode back to exactly the documents, in order, each after the end-of-text token; the ids
    equal Tokenizer.from_file(out/tokenizer.json).encode(doc).ids; the val shard holds whole documents
    (round(fraction x documents) of them); data.json's counts match the headers; transformers'
    GPT2TokenizerFast and AutoTokenizer load the written tokenizer and give the same ids; a second run
    is byte-identical,
  - --tokenizer with that tokenizer.json (file or folder) reproduces the shards byte for byte,
  - a GPT-2-like tokenizer built with tokenizers' API with 70,000 ids (end-of-text last, id 69,999)
    writes version 2 / uint32 shards whose header counts match their sizes, and the C++ trainer
    (SUBLINEAR_TRAINER, set by ctest) trains 2 steps on them, and refuses them with a vocabulary of 65,536,
  - inputs: globs (recursive '**' too), folders, --delimiter (literal, with escapes) and
    --delimiter-regex, empty documents dropped,
  - bad input: a non-UTF-8 file (exit 3, the file and byte offset named, nothing in --out), an empty
    file (exit 3; --skip-empty skips it), no match, a missing or broken tokenizer, an end-of-text token
    the tokenizer lacks, too few documents (exit 3); bad flags and a too-small --vocab-size (exit 2);
    an --out that holds a data set (exit 2 without --overwrite).
Runs in ~7 s on 2 cores (14 cases; 2 short trainer runs). Usage: SUBLINEAR_TRAINER=build/trainer python tests/test_prepare_data.py [-v]
"""
import json
import os
import struct
import subprocess
import sys
import tempfile
import unittest
from array import array

sys.dont_write_bytecode = True
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "prepare_data.py")
TRAINER = os.environ.get("SUBLINEAR_TRAINER") or os.path.join(ROOT, "build", "trainer")
EOT = "<|endoftext|>"

DOCS = [
    "The cat eats fish. The dog eats meat. Cats eat fish and dogs eat meat.",
    "  Leading spaces, tabs\tand\nnew lines inside one document.\n",
    "Unicode: héllo wörld, naïve café, 日本語のテキスト, emoji 🙂🚀 and a ✓.",
    "7 plus 5 is 12. 3 times 4 is 12. The month after may is june.",
    "On monday the girl went to the park. She saw 3 dogs and 2 cats.",
    "What color is the sky? The sky is blue. What color is the sun? The sun is yellow.",
]


def run(*args, env=None):
    return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, env=env, timeout=60)


def read_shard(path):
    """(version, token ids) of an llm.c shard, checking its header against its size."""
    with open(path, "rb") as f:
        data = f.read()
    magic, version, count = struct.unpack("<3i", data[:12])
    assert magic == 20240520, f"{path}: magic {magic}"
    assert data[12:1024] == bytes(1012), f"{path}: header words 3..255 are not 0"
    width = {1: 2, 2: 4}[version]
    assert len(data) == 1024 + width * count, f"{path}: {len(data)} bytes, header count {count} (version {version})"
    ids = array("H" if width == 2 else "I")
    ids.frombytes(data[1024:])
    if sys.byteorder != "little":
        ids.byteswap()
    return version, list(ids)


def split_docs(ids, eot_id):
    """The documents of a shard: each starts with the end-of-text id."""
    assert ids and ids[0] == eot_id, "a shard starts with the end-of-text token"
    docs = []
    for t in ids:
        if t == eot_id:
            docs.append([])
        else:
            docs[-1].append(t)
    return docs


def interleaving(encoded, train, val):
    """Indices of `encoded` that went to val, when train and val together are `encoded` split into two
    order-keeping subsequences (documents may repeat: every way is tried); None when they are not."""
    if len(train) + len(val) != len(encoded):
        return None
    states = {0: []}  # documents of train used so far -> val indices on one way there
    for k, enc in enumerate(encoded):
        nxt = {}
        for t, v_idx in states.items():
            if t < len(train) and train[t] == enc:
                nxt.setdefault(t + 1, v_idx)
            if k - t < len(val) and val[k - t] == enc:
                nxt.setdefault(t, v_idx + [k])
        states = nxt
    return states.get(len(train))


def read(path, mode="rb"):
    with open(path, mode) as f:
        return f.read()


def write(path, data):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb" if isinstance(data, bytes) else "w", **({} if isinstance(data, bytes) else {"encoding": "utf-8"})) as f:
        f.write(data)


class PrepareData(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmpdir = tempfile.TemporaryDirectory(prefix="prepare_data_test-")
        cls.tmp = cls.tmpdir.name
        # A folder: documents 0-3 at the top, 4-5 in a subfolder; a hidden file (not UTF-8) is skipped.
        cls.folder = os.path.join(cls.tmp, "corpus")
        for i, doc in enumerate(DOCS):
            write(os.path.join(cls.folder, "sub" if i >= 4 else "", f"{i:02d}.txt"), doc)
        write(os.path.join(cls.folder, ".hidden.txt"), b"\xff\xfe not text")
        cls.bpe = os.path.join(cls.tmp, "bpe")
        r = run(cls.folder, "--train-bpe", "--vocab-size", "512", "--val-fraction", "0.34", "--out", cls.bpe)
        assert r.returncode == 0, r.stderr
        cls.bpe_log = r

    @classmethod
    def tearDownClass(cls):
        cls.tmpdir.cleanup()

    def out(self, name):
        return os.path.join(self.tmp, name)

    def tokenizer(self, out):
        from tokenizers import Tokenizer
        return Tokenizer.from_file(os.path.join(out, "tokenizer.json"))

    def check_dataset(self, out, docs, n_val=None):
        """The shards of `out` hold exactly `docs` as whole documents, split between train and val, each
        shard keeping their input order, each document after the end-of-text token, with the ids of
        Tokenizer.from_file(out/tokenizer.json).encode(doc); returns (data.json, val document indices)."""
        info = json.loads(read(os.path.join(out, "data.json")))
        tok = self.tokenizer(out)
        eot_id = tok.token_to_id(info["eot"])
        self.assertEqual(info["eot_id"], eot_id)
        shards, raw = {}, {}
        for split in ("train", "val"):
            version, ids = read_shard(os.path.join(out, f"{split}.bin"))
            self.assertEqual(version, info["version"])
            self.assertEqual(len(ids), info[split]["tokens"])
            self.assertLess(max(ids), info["vocab_size"])
            raw[split], shards[split] = ids, split_docs(ids, eot_id)
            self.assertEqual(len(shards[split]), info[split]["documents"])
        val = interleaving([tok.encode(d).ids for d in docs], shards["train"], shards["val"])
        self.assertIsNotNone(val, "the shards are not the documents' encodings, whole and in order")
        for split in ("train", "val"):  # and they decode back to the text
            want = "".join(info["eot"] + d for i, d in enumerate(docs) if (i in val) == (split == "val"))
            self.assertEqual(tok.decode(raw[split], skip_special_tokens=False), want)
        if n_val is not None:
            self.assertEqual(len(val), n_val)
        self.assertEqual(info["documents"], len(docs))
        self.assertEqual(info["tokens"], info["train"]["tokens"] + info["val"]["tokens"])
        return info, val

    # -------------------------------------------------------------------------------- trained BPE

    def test_trained_bpe_round_trip(self):
        info, val = self.check_dataset(self.bpe, DOCS, n_val=round(len(DOCS) * 0.34))
        self.assertEqual(info["version"], 1)
        self.assertEqual(info["eot"], EOT)
        self.assertEqual([s["path"] for s in info["sources"]],
                         [os.path.join(self.folder, f"{i:02d}.txt") if i < 4 else os.path.join(self.folder, "sub", f"{i:02d}.txt")
                          for i in range(len(DOCS))])
        tok = self.tokenizer(self.bpe)
        self.assertLessEqual(tok.get_vocab_size(), 512)
        self.assertGreater(tok.get_vocab_size(), 256 + 1, "the BPE learned merges")
        self.assertEqual(info["vocab_size"], tok.get_vocab_size())
        # each shard decodes to exactly its documents, in order, each after the end-of-text token
        for split in ("train", "val"):
            _, ids = read_shard(os.path.join(self.bpe, f"{split}.bin"))
            want = "".join(EOT + d for i, d in enumerate(DOCS) if (i in val) == (split == "val"))
            self.assertEqual(tok.decode(ids, skip_special_tokens=False), want)
            self.assertEqual(ids, [i for d in DOCS if (DOCS.index(d) in val) == (split == "val")
                                   for i in [tok.token_to_id(EOT)] + tok.encode(d).ids])
        self.assertIn("tokenizing:", self.bpe_log.stderr)
        self.assertIn("MB/s", self.bpe_log.stderr)

    def test_deterministic(self):
        out = self.out("bpe_again")
        r = run(self.folder, "--train-bpe", "--vocab-size", "512", "--val-fraction", "0.34", "--out", out, "--quiet")
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertNotIn("tokenizing:", r.stderr, "--quiet: no progress")
        for name in ("train.bin", "val.bin", "tokenizer.json"):
            self.assertEqual(read(os.path.join(out, name)), read(os.path.join(self.bpe, name)), name)

    def test_transformers_loads_it(self):
        from transformers import AutoTokenizer, GPT2TokenizerFast
        tok = self.tokenizer(self.bpe)
        for hf in (GPT2TokenizerFast(tokenizer_file=os.path.join(self.bpe, "tokenizer.json")),
                   AutoTokenizer.from_pretrained(self.bpe)):
            self.assertEqual(hf.eos_token, EOT)
            for d in DOCS:
                self.assertEqual(hf(d)["input_ids"], tok.encode(d).ids)
                self.assertEqual(hf.decode(hf(d)["input_ids"]), d)

    def test_given_tokenizer_reproduces_ids(self):
        for i, given in enumerate((os.path.join(self.bpe, "tokenizer.json"), self.bpe)):  # the file, or its folder
            out = self.out(f"given{i}")
            r = run(self.folder, "--tokenizer", given, "--val-fraction", "0.34", "--out", out)
            self.assertEqual(r.returncode, 0, r.stderr)
            for name in ("train.bin", "val.bin", "tokenizer.json", "tokenizer_config.json"):
                self.assertEqual(read(os.path.join(out, name)), read(os.path.join(self.bpe, name)), name)
            self.check_dataset(out, DOCS)

    # ------------------------------------------------------------------------ 70,000 ids: uint32

    def gpt2_like_70k(self):
        """A GPT-2-like byte-level BPE with 70,000 ids: bytes 0-255, unused filler ids, learned merges at
        the top, <|endoftext|> last (69,999), as GPT-2 puts it last."""
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
        small = Tokenizer(models.BPE())
        small.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        small.train_from_iterator(DOCS * 4, trainers.BpeTrainer(vocab_size=400, show_progress=False,
                                                                 initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
        model = json.loads(small.to_str())["model"]
        learned = sorted(model["vocab"].items(), key=lambda kv: kv[1])
        n_bytes = 256
        self.assertEqual(len([t for t, i in learned if i < n_bytes]), n_bytes)
        top = 70000 - 1 - (len(learned) - n_bytes)  # first id of the learned merges
        vocab = {t: i for t, i in learned if i < n_bytes}
        vocab.update({f"<unused{i}>": i for i in range(n_bytes, top)})
        vocab.update({t: top + (i - n_bytes) for t, i in learned if i >= n_bytes})
        merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
        tok = Tokenizer(models.BPE(vocab, merges))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
        tok.add_special_tokens([EOT])
        self.assertEqual(tok.token_to_id(EOT), 69999)
        self.assertEqual(tok.get_vocab_size(), 70000)
        path = self.out("gpt2_70k/tokenizer.json")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tok.save(path)
        return path

    def test_large_vocab_writes_uint32_and_trains(self):
        tok_path = self.gpt2_like_70k()
        docs = DOCS * 3  # enough tokens for a few 16-token windows in val
        for i, d in enumerate(docs):
            write(self.out(f"many/{i:02d}.txt"), d)
        out = self.out("u32")
        r = run(self.out("many"), "--tokenizer", tok_path, "--val-fraction", "0.3", "--out", out)
        self.assertEqual(r.returncode, 0, r.stderr)
        info, _ = self.check_dataset(out, docs, n_val=round(len(docs) * 0.3))
        self.assertEqual((info["version"], info["token_dtype"], info["vocab_size"], info["eot_id"]), (2, "uint32", 70000, 69999))
        ids = read_shard(os.path.join(out, "train.bin"))[1] + read_shard(os.path.join(out, "val.bin"))[1]
        self.assertGreater(sum(t > 65535 for t in ids), len(docs), "ids above uint16 (end-of-text and merges)")
        self.assertEqual(read(os.path.join(out, "tokenizer.json")), read(tok_path))

        if not os.path.isfile(TRAINER):
            self.fail(f"no trainer binary at {TRAINER} (set SUBLINEAR_TRAINER)")
        common = ["--config", os.path.join(ROOT, "configs", "tiny.yaml"),
                  "--set", f"data.path={out}/train.bin", "--set", f"data.val_path={out}/val.bin",
                  "--set", "model.n_layer=1", "--set", "model.n_embd=32", "--set", "model.n_head=2",
                  "--set", "train.seq_len=16", "--set", "train.micro_batch=2", "--set", "train.grad_accum=1",
                  "--set", "train.steps=2", "--set", "train.warmup_steps=1", "--set", "train.eval_interval=2",
                  "--set", "train.eval_batches=1", "--set", "logging.progress=false"]
        env = dict(os.environ, OMP_NUM_THREADS="1")
        t = subprocess.run([TRAINER, *common, "--set", "model.vocab_size=70000", "--set", f"logging.dir={self.out('run_u32')}"],
                           capture_output=True, text=True, env=env, timeout=120)
        self.assertEqual(t.returncode, 0, t.stdout[-3000:] + t.stderr[-3000:])
        self.assertIn(f"(llm.c uint32, {info['train']['tokens']} tokens)", t.stdout + t.stderr)
        summary = json.loads(read(os.path.join(self.out("run_u32"), "summary.json")))
        self.assertEqual(summary["steps"], 2)
        self.assertIsInstance(summary["final_val_loss"], float)  # val.bin read and evaluated
        # the tokenizer beside the shards (70,000 ids) does not match a model of 65,536: exit 2 naming both
        t = subprocess.run([TRAINER, *common, "--set", "model.vocab_size=65536", "--set", f"logging.dir={self.out('run_u16')}"],
                           capture_output=True, text=True, env=env, timeout=120)
        self.assertEqual(t.returncode, 2, t.stdout[-3000:] + t.stderr[-3000:])
        self.assertIn("70000", t.stdout + t.stderr)
        self.assertIn("65536", t.stdout + t.stderr)

    # ------------------------------------------------------------------------------------- inputs

    def test_glob_inputs(self):
        tok = os.path.join(self.bpe, "tokenizer.json")
        extra = self.out("globbed")
        write(os.path.join(extra, "b.txt"), DOCS[1])
        write(os.path.join(extra, "a.txt"), DOCS[0])
        write(os.path.join(extra, "c.md"), DOCS[2])
        write(os.path.join(extra, "deep", "d.txt"), DOCS[3])
        r = run(os.path.join(extra, "*.txt"), "--tokenizer", tok, "--out", self.out("g1"))  # sorted; not c.md, not deep/
        self.assertEqual(r.returncode, 0, r.stderr)
        self.check_dataset(self.out("g1"), [DOCS[0], DOCS[1]], n_val=1)
        r = run(os.path.join(extra, "**", "*.txt"), "--tokenizer", tok, "--out", self.out("g2"))
        self.assertEqual(r.returncode, 0, r.stderr)
        self.check_dataset(self.out("g2"), [DOCS[0], DOCS[1], DOCS[3]], n_val=1)
        # several inputs, in argument order, each file once
        r = run(os.path.join(extra, "c.md"), os.path.join(extra, "*.txt"), os.path.join(extra, "a.txt"),
                "--tokenizer", tok, "--out", self.out("g3"))
        self.assertEqual(r.returncode, 0, r.stderr)
        self.check_dataset(self.out("g3"), [DOCS[2], DOCS[0], DOCS[1]], n_val=1)
        r = run(os.path.join(extra, "*.nothing"), "--tokenizer", tok, "--out", self.out("g4"))
        self.assertEqual(r.returncode, 3, r.stderr)
        self.assertIn("no file matches", r.stderr)
        self.assertFalse(os.path.exists(self.out("g4")))
        r = run(self.out("no_such_folder"), "--tokenizer", tok, "--out", self.out("g5"))
        self.assertEqual(r.returncode, 3, r.stderr)
        self.assertIn("no such file or folder", r.stderr)

    def test_delimiters(self):
        tok = os.path.join(self.bpe, "tokenizer.json")
        write(self.out("delim/eot.txt"), f"{DOCS[0]}{EOT}{DOCS[1]}{EOT}{EOT} \n {EOT}{DOCS[2]}{EOT}")
        r = run(self.out("delim/eot.txt"), "--delimiter", EOT, "--tokenizer", tok, "--out", self.out("d1"))
        self.assertEqual(r.returncode, 0, r.stderr)
        info, _ = self.check_dataset(self.out("d1"), DOCS[:3], n_val=1)  # the empty and blank documents dropped
        self.assertEqual(info["sources"][0]["documents"], 3)
        # '\n\n' given as an escape (as typed in a shell); two files split alike
        write(self.out("delim/p1.txt"), "one line\nsecond line\n\nparagraph two\n\n\n\nparagraph three\n\n")
        write(self.out("delim/p2.txt"), "\n\nparagraph four")
        r = run(self.out("delim/p1.txt"), self.out("delim/p2.txt"), "--delimiter", "\\n\\n", "--tokenizer", tok,
                "--val-fraction", "0.25", "--out", self.out("d2"))
        self.assertEqual(r.returncode, 0, r.stderr)
        self.check_dataset(self.out("d2"), ["one line\nsecond line", "paragraph two", "paragraph three", "paragraph four"], n_val=1)
        # a regex for blank lines, whatever their whitespace
        write(self.out("delim/p3.txt"), "alpha beta\n \t\n\ngamma\n\n\ndelta epsilon\n")
        r = run(self.out("delim/p3.txt"), "--delimiter-regex", r"\n\s*\n", "--tokenizer", tok, "--out", self.out("d3"))
        self.assertEqual(r.returncode, 0, r.stderr)
        self.check_dataset(self.out("d3"), ["alpha beta", "gamma", "delta epsilon\n"], n_val=1)
        # a non-ASCII delimiter with an escape in it stays itself ('§\n', not its Latin-1 mojibake)
        write(self.out("delim/p4.txt"), "first part§\nsecond part§\nthird part")
        r = run(self.out("delim/p4.txt"), "--delimiter", "§\\n", "--tokenizer", tok, "--out", self.out("d4"))
        self.assertEqual(r.returncode, 0, r.stderr)
        self.check_dataset(self.out("d4"), ["first part", "second part", "third part"], n_val=1)

    def test_val_split_whole_documents(self):
        tok = os.path.join(self.bpe, "tokenizer.json")
        many = [f"Document number {i}: " + " ".join(DOCS[i % len(DOCS)].split()) for i in range(40)]
        write(self.out("split/all.txt"), "\n\n".join(many))
        outs = []
        for seed, frac in (("1", "0.1"), ("1", "0.1"), ("2", "0.1"), ("1", "0.19")):  # 7.6 rounds to 8
            out = self.out(f"split_{len(outs)}")
            r = run(self.out("split/all.txt"), "--delimiter", "\\n\\n", "--tokenizer", tok, "--seed", seed,
                    "--val-fraction", frac, "--out", out)
            self.assertEqual(r.returncode, 0, r.stderr)
            info, val = self.check_dataset(out, many, n_val=round(40 * float(frac)))
            self.assertEqual(info["split"]["seed"], int(seed))
            outs.append(val)
        self.assertEqual(outs[0], outs[1], "the same seed draws the same documents")
        self.assertNotEqual(outs[0], outs[2], "another seed draws others")
        self.assertNotEqual(outs[0], list(range(36, 40)), "a draw, not the last documents")

    # --------------------------------------------------------------------------------- bad input

    def test_not_utf8(self):
        write(self.out("bad/good.txt"), DOCS[0])
        write(self.out("bad/latin1.txt"), "Caf\u00e9 au lait".encode("latin-1"))  # é = 0xe9 at byte 3
        out = self.out("bad_out")
        r = run(self.out("bad"), "--train-bpe", "--vocab-size", "300", "--out", out)
        self.assertEqual(r.returncode, 3, r.stderr)
        self.assertIn("latin1.txt", r.stderr)
        self.assertIn("byte offset 3", r.stderr)
        self.assertIn("UTF-8", r.stderr)
        self.assertFalse(os.path.exists(out), "nothing written")
        os.makedirs(out)
        r = run(self.out("bad"), "--tokenizer", self.bpe, "--out", out)
        self.assertEqual(r.returncode, 3, r.stderr)
        self.assertEqual(os.listdir(out), [], "nothing written into an existing folder either")

    def test_empty_file(self):
        write(self.out("empty/a.txt"), DOCS[0])
        write(self.out("empty/b.txt"), DOCS[1])
        write(self.out("empty/c.txt"), b"")
        r = run(self.out("empty"), "--tokenizer", self.bpe, "--out", self.out("e1"))
        self.assertEqual(r.returncode, 3, r.stderr)
        self.assertIn("c.txt is empty", r.stderr)
        self.assertIn("--skip-empty", r.stderr)
        self.assertFalse(os.path.exists(self.out("e1")))
        write(self.out("empty/c.txt"), " \n\t\n")
        r = run(self.out("empty"), "--tokenizer", self.bpe, "--out", self.out("e1"))
        self.assertEqual(r.returncode, 3, r.stderr)
        self.assertIn("only whitespace", r.stderr)
        r = run(self.out("empty"), "--tokenizer", self.bpe, "--out", self.out("e1"), "--skip-empty")
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn("warning", r.stderr)
        self.check_dataset(self.out("e1"), DOCS[:2], n_val=1)

    def test_tokenizer_errors(self):
        write(self.out("tk/a.txt"), DOCS[0])
        write(self.out("tk/b.txt"), DOCS[1])
        cases = [
            (["--tokenizer", self.out("tk/missing.json")], "no such tokenizer file"),
            (["--tokenizer", self.out("tk/a.txt")], "not a tokenizer.json"),
            (["--tokenizer", self.bpe, "--eot", "</s>"], "has no token '</s>'"),
        ]
        for extra, message in cases:
            out = self.out("tk_out")
            r = run(self.out("tk"), *extra, "--out", out)
            self.assertEqual(r.returncode, 3, (extra, r.stderr))
            self.assertIn(message, r.stderr)
            self.assertFalse(os.path.exists(out))
        # another end-of-text token, trained in: </s>
        r = run(self.out("tk"), "--train-bpe", "--vocab-size", "300", "--eot", "</s>", "--out", self.out("tk_s"))
        self.assertEqual(r.returncode, 0, r.stderr)
        info, _ = self.check_dataset(self.out("tk_s"), DOCS[:2], n_val=1)
        self.assertEqual((info["eot"], info["eot_id"]), ("</s>", 0))

    def test_too_few_documents(self):
        write(self.out("one/a.txt"), DOCS[0])
        r = run(self.out("one"), "--tokenizer", self.bpe, "--out", self.out("one_out"))
        self.assertEqual(r.returncode, 3, r.stderr)
        self.assertIn("too few documents", r.stderr)
        self.assertFalse(os.path.exists(self.out("one_out")))
        write(self.out("one/b.txt"), DOCS[1])
        r = run(self.out("one"), "--tokenizer", self.bpe, "--min-tokens", "100000", "--out", self.out("one_out"))
        self.assertEqual(r.returncode, 3, r.stderr)
        self.assertIn("--min-tokens", r.stderr)
        self.assertFalse(os.path.exists(self.out("one_out")))

    def test_usage_errors(self):
        cases = [
            [self.folder, "--out", self.out("u")],                                    # no tokenizer
            [self.folder, "--train-bpe", "--out", self.out("u")],                     # no vocab size
            [self.folder, "--train-bpe", "--vocab-size", "256", "--out", self.out("u")],  # < 256 + 1
            [self.folder, "--tokenizer", self.bpe, "--vocab-size", "512", "--out", self.out("u")],
            [self.folder, "--tokenizer", self.bpe, "--train-bpe", "--vocab-size", "512", "--out", self.out("u")],
            [self.folder, "--tokenizer", self.bpe, "--val-fraction", "1", "--out", self.out("u")],
            [self.folder, "--tokenizer", self.bpe, "--delimiter-regex", "(a)", "--out", self.out("u")],
            [self.folder, "--tokenizer", self.bpe, "--no-such-flag", "--out", self.out("u")],
            [self.folder, "--tokenizer", self.bpe],                                   # no --out
        ]
        for args in cases:
            r = run(*args)
            self.assertEqual(r.returncode, 2, (args, r.stderr))
            self.assertIn("usage:", r.stderr)
            self.assertFalse(os.path.exists(self.out("u")))
        r = run(self.folder, "--train-bpe", "--vocab-size", "256", "--out", self.out("u"))
        self.assertIn("257", r.stderr)
        # an --out holding a data set: refused, then replaced with --overwrite
        before = read(os.path.join(self.bpe, "data.json"))
        r = run(self.folder, "--tokenizer", self.bpe, "--out", self.bpe)
        self.assertEqual(r.returncode, 2, r.stderr)
        self.assertIn("--overwrite", r.stderr)
        self.assertEqual(read(os.path.join(self.bpe, "data.json")), before)
        out = self.out("ow")
        self.assertEqual(run(self.folder, "--tokenizer", self.bpe, "--out", out).returncode, 0)
        r = run(self.folder, "--tokenizer", self.bpe, "--val-fraction", "0.5", "--out", out, "--overwrite")
        self.assertEqual(r.returncode, 0, r.stderr)
        self.check_dataset(out, DOCS, n_val=3)
        self.assertEqual(sorted(os.listdir(out)), ["data.json", "tokenizer.json", "tokenizer_config.json", "train.bin", "val.bin"])

    def test_help(self):
        r = run("--help")
        self.assertEqual(r.returncode, 0)
        for word in ("--train-bpe", "--delimiter", "--val-fraction", "examples:", "--tokenizer"):
            self.assertIn(word, r.stdout)


if __name__ == "__main__":
    unittest.main()
