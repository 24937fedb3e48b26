#!/usr/bin/env python3
"""prepare_data.py: tokenize UTF-8 text with a real tokenizer into llm.c token shards (data.source: llmc).

  prepare_data.py INPUT... --out DIR (--tokenizer PATH | --train-bpe --vocab-size N) [options]

INPUT: a text file, a folder (every file below it, recursively, in sorted order; hidden names skipped)
or a glob ("corpus/**/*.txt"; quote it). One document per file, or --delimiter / --delimiter-regex to
split each file into documents; documents that are empty or only whitespace are dropped.
Tokenizer: a Hugging Face tokenizer.json (--tokenizer, e.g. the one beside a GPT-2 checkpoint), or a
byte-level BPE trained here on the same text (--train-bpe --vocab-size N: ByteLevel pre-tokenizer, BPE
model, ByteLevel decoder, the end-of-text token as its special token; transformers' GPT2TokenizerFast
and AutoTokenizer load it).
Writes DIR/train.bin and DIR/val.bin (llm.c shards: 256 little-endian int32 header words, [0] magic
20240520, [1] version, [2] token count; version 1 = uint16 tokens when the vocabulary has at most
65,536 ids, version 2 = uint32 tokens above), each document prefixed with the end-of-text token (as
llm.c does); DIR/tokenizer.json (the tokenizer used, byte for byte); DIR/tokenizer_config.json (for
AutoTokenizer: written for a trained BPE, copied when one sits beside --tokenizer's file); DIR/data.json
(vocabulary size, end-of-text id, token and document counts, sources, header version).
Split: --val-fraction of the documents (rounded, at least 1) go to val.bin, chosen by a seeded draw
(--seed); both shards keep the documents in input order. Deterministic for the same inputs and flags.
Everything is read and checked before anything is written; files are written as temporary files in
DIR and renamed at the end (data.json last), so an error leaves nothing half-written behind.
Tokenizing runs on every core (tokenizers' Rust thread pool; --threads to cap it); progress on stderr.
Exit codes (the project's): 0 ok; 2 bad usage (argparse, --vocab-size below 256 + specials, DIR
already holding a data set without --overwrite); 3 bad input (no file matched, a file not UTF-8 (named,
with the byte offset), an empty file, a missing or unreadable tokenizer, no such end-of-text token, too
few documents or tokens for two splits); 7 an output file could not be written; 130 interrupted.
"""
import argparse
import codecs
import collections
import glob
import json
import os
import random
import re
import sys
import tempfile
import time
from array import array
from concurrent.futures import ThreadPoolExecutor

sys.dont_write_bytecode = True  # no __pycache__ in the repo
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tokens import HEADER_BYTES, MAGIC, VERSION_WIDTH, header  # noqa: E402

EXIT_USAGE, EXIT_DATA, EXIT_IO, EXIT_INTERRUPTED = 2, 3, 7, 130
UINT16_VOCAB = 65536          # version 1 (uint16 tokens) holds ids 0..65535
MAX_SHARD_TOKENS = 2**31 - 1  # the header's count is an int32
BATCH_BYTES = 8 << 20         # text per encode_batch call
BATCH_DOCS = 16384            # documents per encode_batch call
FLUSH_TOKENS = 1 << 22        # tokens buffered per shard before a write
OUTPUTS = ["train.bin", "val.bin", "tokenizer.json", "tokenizer_config.json", "data.json"]

EXAMPLES = """examples:
  # a byte-level BPE of 2,048 tokens trained on the shipped corpus, one document per line
  scripts/prepare_data.py data/corpus.txt --delimiter '\\n' --train-bpe --vocab-size 2048 --out data/bpe2k
  build/trainer --config configs/tiny.yaml --set data.path=data/bpe2k/train.bin \\
      --set data.val_path=data/bpe2k/val.bin --set model.vocab_size=<vocab_size from data.json>

  # GPT-2's own tokenizer (the tokenizer.json of a Hugging Face checkpoint) on a folder of files
  scripts/prepare_data.py books/ --tokenizer gpt2/tokenizer.json --out data/books

  # a glob, documents separated by <|endoftext|>, a tokenizer whose end-of-text token is </s>
  scripts/prepare_data.py 'dumps/*.txt' --delimiter '<|endoftext|>' --tokenizer llama/ --eot '</s>' --out data/d

  # paragraphs (blank lines) as documents, 5 % held out, another draw of the held-out documents
  scripts/prepare_data.py notes/ --delimiter-regex '\\n\\s*\\n' --train-bpe --vocab-size 8192 \\
      --val-fraction 0.05 --seed 7 --out data/notes
"""


class Fail(Exception):
    """An error the user can act on: printed as 'prepare_data: MESSAGE', exit with `code`."""

    def __init__(self, code, message):
        super().__init__(message)
        self.code = code


def note(msg):
    print(f"prepare_data: {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------- inputs

def _walk(folder):
    """Every regular file below `folder`, sorted, hidden files and folders (".name") skipped."""
    found, visited = [], set()
    for root, dirs, files in os.walk(folder, followlinks=True):
        visited.add(os.path.realpath(root))  # a link back up is not walked again
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and os.path.realpath(os.path.join(root, d)) not in visited)
        found += [os.path.join(root, f) for f in sorted(files) if not f.startswith(".")]
    return found


def expand_inputs(args_inputs, out_dir):
    """The input files, in argument order (a folder's and a glob's files sorted), each once."""
    files, seen = [], set()
    out_real = os.path.realpath(out_dir)
    for arg in args_inputs:
        if os.path.isdir(arg):
            matched = _walk(arg)
            if not matched:
                raise Fail(EXIT_DATA, f"{arg}: the folder holds no files")
        elif os.path.isfile(arg):
            matched = [arg]
        elif glob.has_magic(arg):
            matched = []
            for m in sorted(glob.glob(arg, recursive=True)):
                matched += _walk(m) if os.path.isdir(m) else [m] if os.path.isfile(m) else []
            if not matched:
                raise Fail(EXIT_DATA, f"{arg}: no file matches this pattern; check the path (quote the pattern "
                                      f"so that the shell does not expand it, '**' matches folders recursively)")
        elif os.path.exists(arg):
            raise Fail(EXIT_DATA, f"{arg}: not a regular file or folder")
        else:
            raise Fail(EXIT_DATA, f"{arg}: no such file or folder")
        for path in matched:
            real = os.path.realpath(path)
            if real == out_real or real.startswith(out_real + os.sep):
                note(f"warning: {path} is inside --out; left out")
                continue
            if real not in seen:
                seen.add(real)
                files.append(path)
    if not files:
        raise Fail(EXIT_DATA, "no input files (every match lies inside --out)")
    return files


def read_text(path):
    """The file's text, decoded as strict UTF-8; Fail naming the file and the first bad byte's offset."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise Fail(EXIT_DATA, f"{path}: cannot read ({e.strerror}); check its permissions or leave it out")
    try:
        return data.decode("utf-8"), len(data)
    except UnicodeDecodeError as e:
        bad = data[e.start:e.end].hex(" ")
        raise Fail(EXIT_DATA, f"{path}: not UTF-8: byte offset {e.start} (bytes {bad}: {e.reason}); convert the "
                              f"file to UTF-8 (e.g. iconv -f latin1 -t utf-8) or leave it out")


class Documents:
    """Splits each file into documents, drops empty ones, and reads the files again on demand."""

    def __init__(self, files, delimiter, regex, skip_empty):
        self.files, self.delimiter, self.regex, self.skip_empty = files, delimiter, regex, skip_empty
        self.sources = []  # [{"path", "bytes", "documents"}] for the files that hold documents

    def split(self, text):
        parts = self.regex.split(text) if self.regex else text.split(self.delimiter) if self.delimiter else [text]
        return [d for d in parts if d and not d.isspace()]

    def check(self, progress):
        """First pass: every file reads, is UTF-8 and holds a document. Nothing is kept in memory."""
        for path in self.files:
            text, nbytes = read_text(path)
            docs = self.split(text)
            if not docs:
                what = "is empty (0 bytes)" if nbytes == 0 else "holds only whitespace" if not self.regex and not self.delimiter \
                    else f"holds no document after splitting ({nbytes} bytes of delimiters and whitespace)"
                if not self.skip_empty:
                    raise Fail(EXIT_DATA, f"{path} {what}; remove it, or pass --skip-empty to leave such files out")
                note(f"warning: {path} {what}: skipped (--skip-empty)")
                continue
            self.sources.append({"path": path, "bytes": nbytes, "documents": len(docs)})
            progress.read(nbytes, len(docs))
        return sum(s["documents"] for s in self.sources)

    def __iter__(self):
        for source in self.sources:
            docs = self.split(read_text(source["path"])[0])
            if len(docs) != source["documents"]:
                raise Fail(EXIT_DATA, f"{source['path']}: changed while being read ({source['documents']} documents, "
                                      f"now {len(docs)}); run again when nothing writes to it")
            yield from docs


class Progress:
    """One line on stderr: rewritten in place on a terminal, else printed every 10 s."""

    def __init__(self, quiet):
        self.quiet, self.tty = quiet, sys.stderr.isatty()
        self.begin("")

    def begin(self, phase, total_docs=0):
        self.phase, self.total_docs = phase, total_docs
        self.docs = self.tokens = self.nbytes = 0
        self.start = self.last = time.monotonic()
        self.cpu = time.process_time()  # CPU time of every thread: / wall time = cores busy

    def read(self, nbytes, ndocs):
        self.nbytes += nbytes
        self.docs += ndocs
        self.tick()

    def encoded(self, nbytes, ndocs, ntokens):
        self.tokens += ntokens
        self.read(nbytes, ndocs)

    def line(self):
        dt = max(time.monotonic() - self.start, 1e-9)
        docs = f"{self.docs:,}/{self.total_docs:,}" if self.total_docs else f"{self.docs:,}"
        toks = f", {self.tokens:,} tokens" if self.phase == "tokenizing" else ""
        busy = f", {(time.process_time() - self.cpu) / dt:.1f} cores busy" if self.phase == "tokenizing" else ""
        return (f"{self.phase}: {docs} documents{toks}, {self.nbytes / 1e6:.1f} MB in {dt:.1f} s, "
                f"{self.nbytes / 1e6 / dt:.1f} MB/s{busy}")

    def tick(self, force=False):
        now = time.monotonic()
        if self.quiet or not (force or now - self.last >= (0.5 if self.tty else 10.0)):
            return
        self.last = now
        if self.tty:
            print(f"\rprepare_data: {self.line()}\033[K", end="\n" if force else "", file=sys.stderr, flush=True)
        else:
            note(self.line())

    def done(self):
        self.tick(force=True)


# ------------------------------------------------------------------------------------------- tokenizer

def load_tokenizer(path):
    """(Tokenizer, the tokenizer.json bytes, a sibling tokenizer_config.json's bytes or None)."""
    from tokenizers import Tokenizer
    if os.path.isdir(path):
        path = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(path):
        raise Fail(EXIT_DATA, f"{path}: no such tokenizer file; give the tokenizer.json of a Hugging Face checkpoint "
                              f"(or its folder), or train one with --train-bpe --vocab-size N")
    try:
        with open(path, "rb") as f:
            raw = f.read()
        tok = Tokenizer.from_str(raw.decode("utf-8"))
    except OSError as e:
        raise Fail(EXIT_DATA, f"{path}: cannot read the tokenizer ({e.strerror})")
    except Exception as e:  # not UTF-8, or tokenizers' bare Exception on bad JSON
        raise Fail(EXIT_DATA, f"{path}: not a tokenizer.json that tokenizers can load ({str(e).splitlines()[0] if str(e) else type(e).__name__}); "
                              f"give the tokenizer.json file of a Hugging Face checkpoint (not tokenizer_config.json or vocab.json)")
    config = os.path.join(os.path.dirname(path), "tokenizer_config.json")
    config_raw = None
    if os.path.isfile(config):
        with open(config, "rb") as f:
            config_raw = f.read()
    return tok, raw, config_raw


def train_bpe(docs, n_docs, vocab_size, eot, quiet):
    """A byte-level BPE like GPT-2's: ByteLevel pre-tokenizer (GPT-2's regex, no prefix space), BPE
    model, ByteLevel decoder and post-processor, `eot` as its one special token (id 0)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[eot], show_progress=not quiet and sys.stderr.isatty(),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(docs, trainer=trainer, length=n_docs)
    raw = tok.to_str(pretty=True).encode("utf-8")
    config = {"tokenizer_class": "GPT2TokenizerFast", "bos_token": eot, "eos_token": eot, "unk_token": eot,
              "add_prefix_space": False, "clean_up_tokenization_spaces": False}
    return tok, raw, (json.dumps(config, indent=2) + "\n").encode("utf-8")


def vocab_span(tok):
    """The number of ids the tokenizer can produce: highest id + 1 (its vocabulary size when ids are dense)."""
    ids = tok.get_vocab(with_added_tokens=True).values()
    return max(max(ids, default=-1) + 1, tok.get_vocab_size(with_added_tokens=True))


# --------------------------------------------------------------------------------------------- writing

class Shard:
    """An llm.c shard being written to a temporary file in the output folder; header patched at the end."""

    def __init__(self, directory, name, version):
        self.name, self.version = name, version
        self.typecode = "H" if VERSION_WIDTH[version] == 2 else "I"
        assert array(self.typecode).itemsize == VERSION_WIDTH[version]
        fd, self.tmp = tempfile.mkstemp(dir=directory, prefix=f".tmp-{name}-")
        self.file = os.fdopen(fd, "wb")
        self.file.write(bytes(HEADER_BYTES))
        self.buf = array(self.typecode)
        self.count = self.documents = 0

    def add(self, eot_id, ids):
        """Appends one document: `eot_id` before it (None: nothing before it), then its ids."""
        if eot_id is not None:
            self.buf.append(eot_id)
        self.buf.extend(ids)
        self.documents += 1
        if len(self.buf) >= FLUSH_TOKENS:
            self.flush()

    def flush(self):
        self.count += len(self.buf)
        if self.count > MAX_SHARD_TOKENS:
            raise Fail(EXIT_DATA, f"{self.name}: more than {MAX_SHARD_TOKENS:,} tokens, more than the llm.c header's "
                                  f"int32 count holds; prepare the input in parts (several --out folders)")
        if sys.byteorder != "little":
            self.buf.byteswap()
        self.file.write(self.buf.tobytes())
        self.buf = array(self.typecode)

    def finish(self):
        self.flush()
        self.file.seek(0)
        self.file.write(header(self.version, self.count))
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()


def write_temp(directory, name, data, temps):
    """Writes `data` to a new temporary file in `directory` (listed in `temps` first); returns its path."""
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".tmp-{name}-")
    temps.append(tmp)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return tmp


def publish(out, pending, optional=()):
    """Renames each (temporary, name) of `pending` into `out`, in order (data.json last: it marks a whole
    data set), after removing each file of `optional` that a replaced data set has and this one has not."""
    written = {name for _, name in pending}
    for name in optional:
        if name not in written and os.path.exists(os.path.join(out, name)):
            os.unlink(os.path.join(out, name))
    umask = os.umask(0)
    os.umask(umask)
    for tmp, name in pending:
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, os.path.join(out, name))


def discard(shards, temps, out, created):
    """After an error: the shards closed, every temporary removed, and `out` too if this run created it."""
    for shard in shards:
        shard.file.close()
    for tmp in temps:
        if os.path.exists(tmp):
            os.unlink(tmp)
    if created:
        try:
            os.rmdir(out)
        except OSError:
            pass


def batches(docs, chosen_for_val):
    """(texts, is_val flags, bytes) of up to BATCH_BYTES of text / BATCH_DOCS documents, in input order."""
    texts, flags, nbytes = [], [], 0
    for i, doc in enumerate(docs):
        texts.append(doc)
        flags.append(i in chosen_for_val)
        nbytes += len(doc.encode("utf-8"))
        if nbytes >= BATCH_BYTES or len(texts) >= BATCH_DOCS:
            yield texts, flags, nbytes
            texts, flags, nbytes = [], [], 0
    if texts:
        yield texts, flags, nbytes


def encode_all(tok, batches_, shards, eot_id, progress):
    """Encodes batch after batch on tokenizers' thread pool (encode_batch_fast releases the GIL, so the
    next batch is read and the previous one's ids are appended to the shards while it runs)."""
    def consume(item):
        future, flags, nbytes = item
        ntok = 0
        for enc, is_val in zip(future.result(), flags):
            ids = enc.ids
            shards["val" if is_val else "train"].add(eot_id, ids)
            ntok += 1 + len(ids)
        progress.encoded(nbytes, len(flags), ntok)

    with ThreadPoolExecutor(max_workers=1) as pool:
        in_flight = collections.deque()
        try:
            for texts, flags, nbytes in batches_:
                in_flight.append((pool.submit(tok.encode_batch_fast, texts, add_special_tokens=False), flags, nbytes))
                if len(in_flight) > 1:
                    consume(in_flight.popleft())
            while in_flight:
                consume(in_flight.popleft())
        finally:
            for future, _, _ in in_flight:
                future.cancel()


# ------------------------------------------------------------------------------------------------ main

def parse_args(argv):
    p = argparse.ArgumentParser(
        prog="prepare_data.py", description=__doc__.split("\n\n")[0].split(": ", 1)[1] + " See docs/data.md.",
        epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("inputs", nargs="+", metavar="INPUT", help="text file, folder (recursive) or glob pattern (quoted)")
    p.add_argument("--out", required=True, metavar="DIR", help="output folder: train.bin, val.bin, tokenizer.json, data.json")
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--tokenizer", metavar="PATH", help="a Hugging Face tokenizer.json, or the folder holding one")
    which.add_argument("--train-bpe", action="store_true", help="train a byte-level BPE on the input text (needs --vocab-size)")
    p.add_argument("--vocab-size", type=int, metavar="N", help="--train-bpe: vocabulary size, special tokens included (>= 257)")
    p.add_argument("--eot", default="<|endoftext|>", metavar="TOKEN",
                   help="end-of-text token put before every document (default <|endoftext|>; e.g. </s>)")
    split = p.add_mutually_exclusive_group()
    split.add_argument("--delimiter", metavar="STR",
                       help="split each file into documents at this string; backslash escapes are decoded "
                            "('\\n\\n': blank lines, '<|endoftext|>')")
    split.add_argument("--delimiter-regex", metavar="RE", help="split at matches of this Python regex ('\\n\\s*\\n')")
    p.add_argument("--skip-empty", action="store_true",
                   help="leave out files without any document (empty or whitespace only) with a warning, instead of exit 3")
    p.add_argument("--val-fraction", type=float, default=0.1, metavar="F",
                   help="share of the documents for val.bin, 0 < F < 1 (default 0.1; at least one document)")
    p.add_argument("--seed", type=int, default=1337, help="seed of the draw of val.bin's documents (default 1337)")
    p.add_argument("--min-tokens", type=int, default=2, metavar="N",
                   help="each shard must hold at least N tokens, else exit 3 (default 2; the trainer needs seq_len + 1)")
    p.add_argument("--threads", type=int, default=0, metavar="N",
                   help="tokenizer threads (default 0: every core this process may use)")
    p.add_argument("--overwrite", action="store_true", help="replace the data set already in --out")
    p.add_argument("--quiet", action="store_true", help="no progress lines (warnings and errors still print)")
    a = p.parse_args(argv)

    if not 0.0 < a.val_fraction < 1.0:
        p.error(f"--val-fraction must be in (0, 1), got {a.val_fraction}")
    if a.threads < 0:
        p.error("--threads must be >= 0")
    if a.min_tokens < 1:
        p.error("--min-tokens must be >= 1")
    if not a.eot:
        p.error("--eot must not be empty")
    if a.train_bpe:
        if a.vocab_size is None:
            p.error("--train-bpe needs --vocab-size N")
        if a.vocab_size < 256 + 1:
            p.error(f"--vocab-size {a.vocab_size} is too small: a byte-level BPE needs 256 byte tokens + 1 special "
                    f"token ({a.eot}) = 257 at least")
    elif a.vocab_size is not None:
        p.error("--vocab-size is for --train-bpe (a given --tokenizer has its own)")
    a.regex = None
    if a.delimiter is not None:
        try:
            a.delimiter = (codecs.decode(a.delimiter.encode("raw_unicode_escape"), "unicode_escape")  # non-ASCII kept
                           if "\\" in a.delimiter else a.delimiter)
        except UnicodeDecodeError as e:
            p.error(f"--delimiter: bad escape ({e.reason})")
        if not a.delimiter:
            p.error("--delimiter must not be empty")
    if a.delimiter_regex is not None:
        try:
            a.regex = re.compile(a.delimiter_regex)
        except re.error as e:
            p.error(f"--delimiter-regex: {e}")
        if a.regex.groups:
            p.error("--delimiter-regex: use non-capturing groups (?:...); a capturing group would keep the delimiters")
        if a.regex.match(""):
            p.error("--delimiter-regex must not match the empty string")
    check_out(p, a.out, OUTPUTS, a.overwrite)
    return a


def check_out(parser, out, outputs, overwrite):
    """Usage errors (exit 2) for an --out that is not a folder, or holds a data set without --overwrite."""
    if os.path.exists(out) and not os.path.isdir(out):
        parser.error(f"--out {out} exists and is not a folder")
    held = [n for n in outputs if os.path.exists(os.path.join(out, n))]
    if held and not overwrite:
        parser.error(f"--out {out} already holds a data set ({', '.join(held)}); pass --overwrite to replace it, or pick another folder")


def setup_threads(threads):
    """Before tokenizers is imported: its Rust pool (rayon) sizes itself from RAYON_NUM_THREADS."""
    if threads == 0:
        threads = int(os.environ.get("RAYON_NUM_THREADS") or 0) or len(os.sched_getaffinity(0))
    os.environ["RAYON_NUM_THREADS"] = str(threads)
    os.environ["TOKENIZERS_PARALLELISM"] = "true"  # "false" would make encode_batch run on one thread
    return threads


def prepare(a):
    t0 = time.monotonic()
    threads = setup_threads(a.threads)
    import tokenizers
    progress = Progress(a.quiet)

    files = expand_inputs(a.inputs, a.out)
    docs = Documents(files, a.delimiter, a.regex, a.skip_empty)
    progress.begin("reading")
    n_docs = docs.check(progress)
    total_bytes = sum(s["bytes"] for s in docs.sources)
    progress.done()
    if not docs.sources:
        raise Fail(EXIT_DATA, "no documents: every input file was empty and skipped (--skip-empty)")
    n_val = max(1, round(n_docs * a.val_fraction))
    if n_docs - n_val < 1:
        raise Fail(EXIT_DATA, f"too few documents ({n_docs}) for a train and a val split: at least 2 are needed "
                              f"(one each); give more files, or --delimiter to split files into documents")

    if a.train_bpe:
        t = time.monotonic()
        tok, tok_raw, config_raw = train_bpe(docs, n_docs, a.vocab_size, a.eot, a.quiet)
        trained = tok.get_vocab_size(with_added_tokens=True)
        note(f"trained a byte-level BPE: {trained:,} tokens in {time.monotonic() - t:.1f} s" +
             (f" (fewer than --vocab-size {a.vocab_size:,}: no pair of tokens is left to merge inside a word of this text)" if trained < a.vocab_size else ""))
        source = {"trained": "byte-level BPE", "vocab_size_requested": a.vocab_size}
    else:
        tok, tok_raw, config_raw = load_tokenizer(a.tokenizer)
        source = {"path": a.tokenizer}
    eot_id = tok.token_to_id(a.eot)
    if eot_id is None:
        specials = [t.content for _, t in sorted(tok.get_added_tokens_decoder().items()) if t.special]
        raise Fail(EXIT_DATA, f"{a.tokenizer}: the tokenizer has no token {a.eot!r}; name its end-of-text token with "
                              f"--eot (its special tokens: {', '.join(specials[:12]) or 'none'})")
    vocab_size = vocab_span(tok)
    version = 1 if vocab_size <= UINT16_VOCAB else 2

    chosen_for_val = set(random.Random(a.seed).sample(range(n_docs), n_val))
    created = not os.path.isdir(a.out)
    os.makedirs(a.out, exist_ok=True)
    temps, shards = [], {}
    try:
        for name in ("train", "val"):
            shards[name] = Shard(a.out, f"{name}.bin", version)
            temps.append(shards[name].tmp)
        progress.begin("tokenizing", n_docs)
        encode_all(tok, batches(docs, chosen_for_val), shards, eot_id, progress)
        progress.done()
        for name, shard in shards.items():
            shard.finish()
            if shard.count < a.min_tokens:
                raise Fail(EXIT_DATA, f"{name}.bin would hold {shard.count} tokens, fewer than --min-tokens {a.min_tokens}; "
                                      f"give more text, or raise --val-fraction (val) / lower it (train)")
        info = {
            "format": "llm.c token shards",
            "magic": MAGIC,
            "version": version,
            "token_dtype": "uint16" if version == 1 else "uint32",
            "vocab_size": vocab_size,
            "eot": a.eot,
            "eot_id": eot_id,
            "eot_position": "before every document",
            "tokenizer": "tokenizer.json",
            "tokenizer_source": source,
            "tokenizers_version": tokenizers.__version__,
            "documents": n_docs,
            "tokens": sum(s.count for s in shards.values()),
            "bytes": total_bytes,
            "train": {"path": "train.bin", "documents": shards["train"].documents, "tokens": shards["train"].count},
            "val": {"path": "val.bin", "documents": shards["val"].documents, "tokens": shards["val"].count},
            "split": {"rule": "seeded draw of whole documents (Python random.Random(seed).sample), input order kept",
                      "val_fraction": a.val_fraction, "seed": a.seed},
            "delimiter": a.delimiter if a.delimiter is not None else None,
            "delimiter_regex": a.delimiter_regex,
            "sources": docs.sources,
        }
        pending = [(shards["train"].tmp, "train.bin"), (shards["val"].tmp, "val.bin")]
        for name, data in (("tokenizer.json", tok_raw), ("tokenizer_config.json", config_raw),
                           ("data.json", (json.dumps(info, indent=2, ensure_ascii=False) + "\n").encode("utf-8"))):
            if data is not None:
                pending.append((write_temp(a.out, name, data, temps), name))
        publish(a.out, pending, optional=("tokenizer_config.json",))
    except BaseException:
        discard(shards.values(), temps, a.out, created)
        raise

    dt = time.monotonic() - t0
    tr, va = info["train"], info["val"]
    print(f"prepare_data: {a.out}: train.bin {tr['tokens']:,} tokens ({tr['documents']:,} documents), val.bin "
          f"{va['tokens']:,} tokens ({va['documents']:,} documents); vocab_size {vocab_size:,}, eot {a.eot} = {eot_id}, "
          f"version {version} ({info['token_dtype']}); {total_bytes / 1e6:.2f} MB from {len(docs.sources)} file(s) in "
          f"{dt:.1f} s on {threads} thread(s)")
    print(f"prepare_data: train on it: build/trainer --config configs/tiny.yaml --set data.path={a.out}/train.bin "
          f"--set data.val_path={a.out}/val.bin --set model.vocab_size={vocab_size}")
    return info


def exit_status(prepare_fn, a, say=note):
    """Runs prepare_fn(a) and returns the exit code: 0, or a Fail's, an interruption's or a write error's,
    each said with `say`."""
    try:
        prepare_fn(a)
    except Fail as e:
        say(str(e))
        return e.code
    except KeyboardInterrupt:
        say("interrupted; nothing written")
        return EXIT_INTERRUPTED
    except OSError as e:
        say(f"cannot write {e.filename or a.out}: {e.strerror or e}; nothing written (check free space and permissions)")
        return EXIT_IO
    return 0


def main(argv=None):
    return exit_status(prepare, parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
