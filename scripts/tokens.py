#!/usr/bin/env python3
"""tokens.py: convert token files between llm.c shards and headerless token files (nanoGPT's format).

  tokens.py to-llmc IN OUT [--dtype uint16|uint32]   headerless little-endian tokens -> llm.c shard
  tokens.py to-raw IN OUT                            llm.c shard -> headerless tokens (width from its version)

llm.c shard: a header of 256 little-endian int32 words ([0] magic 20240520, [1] version: 1 = uint16
tokens, 2 = uint32 tokens, [2] token count, the rest 0), then the tokens. Headerless ("raw"): only the
tokens, as nanoGPT's data/*/prepare.py writes them (np.uint16 .tofile()). The trainer reads both
(data.source: llmc | raw); converting is for tools that want the other. Round trips are byte-identical.
Streams in 16 MiB chunks; writes a temporary file beside OUT and renames it (nothing half-written is left).
Exit 3 for a missing, unreadable or malformed input, 2 for bad usage, 1 when OUT cannot be written.
"""
import argparse
import os
import struct
import sys
import tempfile

MAGIC = 20240520
HEADER_WORDS = 256
HEADER_BYTES = 4 * HEADER_WORDS
WIDTH = {"uint16": 2, "uint32": 4}
VERSION_WIDTH = {1: 2, 2: 4}
CHUNK = 16 << 20


class BadInput(Exception):
    pass


def header(version, count):
    return struct.pack("<3i", MAGIC, version, count) + bytes(HEADER_BYTES - 12)


def copy_atomic(src, out_path, prefix, skip, nbytes):
    """Writes prefix + nbytes of src starting at byte skip to out_path, atomically."""
    directory = os.path.dirname(os.path.abspath(out_path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-", suffix=".bin")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(prefix)
            src.seek(skip)
            left = nbytes
            while left:
                block = src.read(min(CHUNK, left))
                if not block:
                    raise BadInput(f"{src.name}: ended early")
                f.write(block)
                left -= len(block)
            f.flush()
            os.fsync(f.fileno())
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, out_path)
    except BaseException:
        os.unlink(tmp)
        raise


def to_llmc(in_path, out_path, dtype):
    width = WIDTH[dtype]
    size = os.path.getsize(in_path)
    with open(in_path, "rb") as src:
        first = src.read(4)
        if len(first) == 4 and struct.unpack("<i", first)[0] == MAGIC:
            raise BadInput(f"{in_path} already has an llm.c header (magic {MAGIC}); nothing to convert")
        if size % width:
            raise BadInput(f"{in_path}: {size} bytes is not a whole number of {width}-byte tokens (--dtype {dtype})")
        count = size // width
        if count > 2**31 - 1:
            raise BadInput(f"{in_path}: {count} tokens do not fit the llm.c header's int32 count")
        copy_atomic(src, out_path, header(1 if width == 2 else 2, count), 0, size)
    return count


def to_raw(in_path, out_path):
    size = os.path.getsize(in_path)
    with open(in_path, "rb") as src:
        head = src.read(HEADER_BYTES)
        if len(head) < HEADER_BYTES:
            raise BadInput(f"{in_path}: {size} bytes is shorter than the {HEADER_BYTES}-byte llm.c header")
        magic, version, count = struct.unpack("<3i", head[:12])
        if magic != MAGIC:
            raise BadInput(f"{in_path}: no llm.c header (first word {magic}, expected {MAGIC}); it may already be raw")
        if version not in VERSION_WIDTH:
            raise BadInput(f"{in_path}: unsupported llm.c version {version} (1: uint16, 2: uint32)")
        nbytes = count * VERSION_WIDTH[version]
        if count < 0 or size != HEADER_BYTES + nbytes:
            raise BadInput(f"{in_path}: {size} bytes, but the header promises {count} tokens = {HEADER_BYTES + nbytes} bytes")
        copy_atomic(src, out_path, b"", HEADER_BYTES, nbytes)
    return count


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    a_llmc = sub.add_parser("to-llmc", help="headerless tokens -> llm.c shard")
    a_llmc.add_argument("input")
    a_llmc.add_argument("output")
    a_llmc.add_argument("--dtype", choices=sorted(WIDTH), default="uint16", help="token width of INPUT (default uint16)")
    a_raw = sub.add_parser("to-raw", help="llm.c shard -> headerless tokens")
    a_raw.add_argument("input")
    a_raw.add_argument("output")
    a = p.parse_args(argv)
    if not os.path.isfile(a.input):
        print(f"tokens.py: input file not found: {a.input}", file=sys.stderr)
        return 3
    try:
        n = to_llmc(a.input, a.output, a.dtype) if a.cmd == "to-llmc" else to_raw(a.input, a.output)
    except BadInput as e:
        print(f"tokens.py: {e}", file=sys.stderr)
        return 3
    except OSError as e:  # unreadable input (3), or OUT cannot be written: no space, no permission (1)
        print(f"tokens.py: {e}", file=sys.stderr)
        return 3 if e.filename == a.input else 1
    print(f"tokens.py: {a.output}: {n} tokens")
    return 0


if __name__ == "__main__":
    sys.exit(main())
