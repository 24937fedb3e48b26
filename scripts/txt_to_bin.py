#!/usr/bin/env python3
"""txt_to_bin.py: convert UTF-8 text to an llm.c token shard (data.source: llmc), one token per byte.

Format: a header of 256 little-endian int32 words ([0] magic 20240520, [1] version 1,
[2] number of tokens, the rest 0), then the tokens as little-endian uint16 (id = byte value).

  txt_to_bin.py INPUT.txt OUTPUT.bin [--val-fraction F --val-output VAL.bin]

With --val-fraction, the last F of the bytes go to VAL.bin and the rest to OUTPUT.bin.
Files are written atomically (temp file + rename). Exit 3 when INPUT is missing, 2 on bad usage.
Pure standard library; takes well under a second for a few MB.
"""
import argparse
import os
import struct
import sys
import tempfile
from array import array

MAGIC = 20240520
VERSION = 1
HEADER_WORDS = 256


def write_shard(path, data: bytes) -> None:
    """Write the bytes of `data` as a byte-level token shard at `path`, atomically."""
    header = array("i", [0] * HEADER_WORDS)
    header[0], header[1], header[2] = MAGIC, VERSION, len(data)
    tokens = array("H", list(data))  # uint16, one per byte
    if sys.byteorder != "little":
        header.byteswap()
        tokens.byteswap()
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-", suffix=".bin")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(header.tobytes())
            f.write(tokens.tobytes())
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp creates 0600; give the usual mode
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def split(data: bytes, val_fraction: float):
    """Split into (train, val): val is the last `val_fraction` of the bytes."""
    n_val = int(round(len(data) * val_fraction))
    return data[: len(data) - n_val], data[len(data) - n_val :]


def convert(input_path, output_path, val_fraction=0.0, val_output=None):
    """Convert a UTF-8 text file; returns the token counts written (train, val or None)."""
    with open(input_path, "rb") as f:
        data = f.read()
    data.decode("utf-8")  # reject text that is not UTF-8
    if not val_output:
        write_shard(output_path, data)
        return len(data), None
    train, val = split(data, val_fraction)
    write_shard(output_path, train)
    write_shard(val_output, val)
    return len(train), len(val)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("input", help="UTF-8 text file")
    p.add_argument("output", help="token shard to write (train split with --val-output)")
    p.add_argument("--val-fraction", type=float, default=0.1, help="share of bytes for VAL (default 0.1)")
    p.add_argument("--val-output", help="validation shard to write")
    a = p.parse_args(argv)
    if not 0.0 < a.val_fraction < 1.0:
        p.error("--val-fraction must be in (0, 1)")
    if not os.path.isfile(a.input):
        print(f"txt_to_bin: input file not found: {a.input}", file=sys.stderr)
        return 3
    try:
        n_train, n_val = convert(a.input, a.output, a.val_fraction, a.val_output)
    except UnicodeDecodeError as e:
        print(f"txt_to_bin: {a.input} is not UTF-8: {e}", file=sys.stderr)
        return 1
    print(f"txt_to_bin: {a.output}: {n_train} tokens" + (f"; {a.val_output}: {n_val} tokens" if n_val is not None else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
