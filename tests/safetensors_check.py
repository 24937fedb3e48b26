#!/usr/bin/env python3
"""The reference side of tests/test_safetensors.cpp: reads and writes safetensors files with the
`safetensors` package (an implementation this project did not write).

  safetensors_check.py read FILE OUT   load FILE (load_file and safe_open); write to OUT a JSON
                                       {"tensors": {name: {dtype, shape, sum, first}}, "metadata": {..}}
                                       (sum: float64 sum of all elements; first: up to 4 first values)
  safetensors_check.py write FILE      save_file a fixed set of tensors (see reference_tensors) to FILE
  safetensors_check.py crc FILE        print zlib.crc32 of FILE's bytes
"""
import json
import sys
import zlib

DTYPE_NAMES = {  # torch dtype name -> safetensors name
    "float32": "F32", "float64": "F64", "bfloat16": "BF16", "float16": "F16",
    "int64": "I64", "int32": "I32", "uint8": "U8", "bool": "BOOL",
}


def reference_tensors():
    """Deterministic values; tests/test_safetensors.cpp builds the same ones to compare."""
    import torch
    return {
        "a.f32": torch.arange(12, dtype=torch.float32).reshape(3, 4) / 4,
        "b.bf16": torch.arange(-5, 5, dtype=torch.bfloat16) / 2,
        "c.i64": torch.arange(7, dtype=torch.int64) * 1_000_000_007,
        "d.u8": torch.arange(5, dtype=torch.uint8) * 50,
        "e.f16": torch.arange(6, dtype=torch.float16).reshape(2, 3) / 8,
        "f.bool": torch.tensor([True, False, True]),
        "g.i32": torch.arange(-3, 3, dtype=torch.int32),
        "h.f64": torch.arange(4, dtype=torch.float64).reshape(2, 2, 1) + 0.25,
        "empty": torch.zeros(0, 3),
        "scalar": torch.tensor(3.5),
    }


def describe(t):
    import torch
    flat = t.reshape(-1).to(torch.float64)
    return {
        "dtype": DTYPE_NAMES[str(t.dtype).removeprefix("torch.")],
        "shape": list(t.shape),
        "sum": flat.sum().item(),
        "first": flat[:4].tolist(),
    }


def read(path, out):
    from safetensors import safe_open
    from safetensors.torch import load_file
    tensors = load_file(path)
    with safe_open(path, framework="pt") as f:
        metadata = f.metadata() or {}
        assert sorted(f.keys()) == sorted(tensors), "safe_open and load_file disagree"
    with open(out, "w") as f:
        json.dump({"tensors": {k: describe(v) for k, v in tensors.items()}, "metadata": metadata}, f)


def write(path):
    from safetensors.torch import save_file
    save_file(reference_tensors(), path, metadata={"origin": "safetensors_check.py", "step": "7"})


def main():
    cmd, path = sys.argv[1], sys.argv[2]
    if cmd == "read":
        read(path, sys.argv[3])
    elif cmd == "write":
        write(path)
    elif cmd == "crc":
        with open(path, "rb") as f:
            print(zlib.crc32(f.read()))
    else:
        sys.exit(f"unknown command {cmd}")


if __name__ == "__main__":
    main()
