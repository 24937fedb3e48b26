#!/usr/bin/env python3
"""The reference side of tests/test_resume.cpp and tests/test_state.cpp: reads saved training states
(<root>/step-NNNNNNNN/{meta.json, rank-NNNNN.safetensors...}) with the `safetensors` package (an
implementation this project did not write), independently of the trainer's own loader.

  state_compare.py check STATE_DIR     verify every file listed in meta.json (size and zlib.crc32 of
                                       the whole file), load every tensor of every rank file (load_file
                                       and safe_open must agree), assemble each param / exp_avg /
                                       exp_avg_sq from its pieces (a whole tensor "<field>/<name>" or
                                       flat ranges "<field>/<name>/<begin>:<end>", from any rank file)
                                       and check the pieces cover every element exactly once; print a
                                       JSON summary on stdout
  state_compare.py compare A B [B2 ...]
                                       assemble both states and require the same parameters and
                                       AdamW moments, bit for bit (whatever the world size and sharding
                                       each was saved at), and the same step, AdamW step, data sampler
                                       positions and loop counters in meta.json; each B against A,
                                       one JSON summary line each (in one process: torch loads once)
  state_compare.py dump STATE_DIR FIELD/PARAM OUT
                                       write the assembled tensor (e.g. param/wte) to OUT as raw
                                       little-endian float32 bytes, flattened

Exit status: 0 when everything holds; 1 with the reasons on stderr otherwise.
"""
import json
import os
import sys
import zlib

FIELDS = ("param", "exp_avg", "exp_avg_sq")


class Bad(Exception):
    pass


def crc32_of(path):
    crc = 0
    with open(path, "rb") as f:
        while True:
            chunk = f.read(1 << 20)
            if not chunk:
                return crc & 0xFFFFFFFF
            crc = zlib.crc32(chunk, crc)


def parse_name(name):
    """'<field>/<param>' -> (field, param, None); '<field>/<param>/<b>:<e>' -> (field, param, (b, e))."""
    field, _, rest = name.partition("/")
    if not rest:
        return field, None, None
    head, _, last = rest.rpartition("/")
    if head and ":" in last:
        b, _, e = last.partition(":")
        if b.isdigit() and e.isdigit():
            return field, head, (int(b), int(e))
    return field, rest, None


def load_state(state_dir):
    """Returns (meta, {(field, param): flat tensor}, info)."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import load_file

    with open(os.path.join(state_dir, "meta.json")) as f:
        meta = json.load(f)
    if meta.get("format") != "sublinear-training-state":
        raise Bad(f"{state_dir}/meta.json: format is {meta.get('format')!r}")
    if len(meta["files"]) != meta["world_size"]:
        raise Bad(f"{state_dir}: {len(meta['files'])} files for world size {meta['world_size']}")
    pieces = {}  # (field, param) -> [(begin, end, flat tensor, file)]
    info = {"step": meta["step"], "world_size": meta["world_size"], "sharding": meta["sharding"],
            "files": [], "tensors": 0, "ranged_tensors": 0, "whole_tensors": 0, "rng": []}
    for entry in meta["files"]:
        path = os.path.join(state_dir, entry["name"])
        size = os.path.getsize(path)
        crc = crc32_of(path)
        if size != entry["bytes"]:
            raise Bad(f"{path}: {size} bytes, meta.json says {entry['bytes']}")
        if crc != entry["crc32"]:
            raise Bad(f"{path}: zlib.crc32 {crc}, meta.json says {entry['crc32']}")
        tensors = load_file(path)
        with safe_open(path, framework="pt") as f:
            keys = sorted(f.keys())
            if keys != sorted(tensors):
                raise Bad(f"{path}: safe_open and load_file disagree on the tensor names")
            for k in keys:
                if not torch.equal(f.get_tensor(k), tensors[k]):
                    raise Bad(f"{path}: safe_open and load_file disagree on {k}")
        info["files"].append({"name": entry["name"], "bytes": size, "crc32": crc, "tensors": len(tensors)})
        info["tensors"] += len(tensors)
        for name, t in tensors.items():
            field, param, rng = parse_name(name)
            if field == "rng":
                info["rng"].append(f"{entry['name']}:{name}")
                continue
            if field not in FIELDS or param is None:
                raise Bad(f"{path}: unexpected tensor name {name!r}")
            if t.dtype != torch.float32:
                raise Bad(f"{path}: {name} is {t.dtype}, expected float32")
            flat = t.reshape(-1)
            if rng is None:
                info["whole_tensors"] += 1
                begin, end = 0, flat.numel()
            else:
                info["ranged_tensors"] += 1
                begin, end = rng
                if end - begin != flat.numel():
                    raise Bad(f"{path}: {name} holds {flat.numel()} elements, its name says {end - begin}")
            pieces.setdefault((field, param), []).append((begin, end, flat, entry["name"]))

    assembled = {}
    for key, parts in pieces.items():
        parts.sort(key=lambda p: (p[0], p[1]))
        numel = max(p[1] for p in parts)
        at = 0
        for begin, end, _, fname in parts:
            if begin != at:
                what = "overlap" if begin < at else "gap"
                raise Bad(f"{state_dir}: {key[0]}/{key[1]}: {what} at element {min(begin, at)} ({fname})")
            at = end
        assembled[key] = torch.cat([p[2] for p in parts]) if len(parts) > 1 else parts[0][2].clone()
        if assembled[key].numel() != numel:
            raise Bad(f"{state_dir}: {key}: assembled {assembled[key].numel()} elements, expected {numel}")
    params = sorted({p for (f, p) in assembled if f == "param"})
    for field in FIELDS[1:]:
        have = sorted({p for (f, p) in assembled if f == field})
        if have and have != params:
            raise Bad(f"{state_dir}: {field} covers {len(have)} parameters, param covers {len(params)}")
    info["params"] = {p: assembled[("param", p)].numel() for p in params}
    info["fields"] = sorted({f for (f, _) in assembled})
    return meta, assembled, info


def check(state_dir):
    _, _, info = load_state(state_dir)
    print(json.dumps(info))


def bits(t):
    import torch
    return t.contiguous().view(torch.int32)


def compare(a_dir, b_dir):
    meta_a, a, info_a = load_state(a_dir)
    meta_b, b, info_b = load_state(b_dir)
    problems = []
    if sorted(a) != sorted(b):
        only_a = sorted(set(a) - set(b))[:5]
        only_b = sorted(set(b) - set(a))[:5]
        problems.append(f"different tensors: only in A {only_a}, only in B {only_b}")
    compared = 0
    for key in sorted(set(a) & set(b)):
        x, y = a[key], b[key]
        if x.numel() != y.numel():
            problems.append(f"{key[0]}/{key[1]}: {x.numel()} vs {y.numel()} elements")
            continue
        differ = (bits(x) != bits(y)).sum().item()
        if differ:
            d = (x.double() - y.double()).abs().max().item()
            problems.append(f"{key[0]}/{key[1]}: {differ} of {x.numel()} elements differ (max |a-b| {d:.3g})")
        compared += x.numel()
    for k in ("step",):
        if meta_a[k] != meta_b[k]:
            problems.append(f"meta.json {k}: {meta_a[k]} vs {meta_b[k]}")
    for k in ("optimizer", "data", "loop", "math"):
        if meta_a.get(k) != meta_b.get(k):
            problems.append(f"meta.json {k}: {json.dumps(meta_a.get(k))} vs {json.dumps(meta_b.get(k))}")
    summary = {"a": {x: info_a[x] for x in ("world_size", "sharding", "ranged_tensors", "whole_tensors")},
               "b": {x: info_b[x] for x in ("world_size", "sharding", "ranged_tensors", "whole_tensors")},
               "tensors_compared": len(set(a) & set(b)), "elements_compared": compared,
               "equal": not problems}
    print(json.dumps(summary))
    if problems:
        more = f"; ... and {len(problems) - 8} more" if len(problems) > 8 else ""
        raise Bad("; ".join(problems[:8]) + more)


def dump(state_dir, name, out):
    import numpy as np
    _, tensors, _ = load_state(state_dir)
    field, _, param = name.partition("/")
    if (field, param) not in tensors:
        raise Bad(f"{state_dir}: no tensor {name}")
    t = tensors[(field, param)].contiguous()
    with open(out, "wb") as f:
        f.write(t.numpy().astype("<f4", copy=False).tobytes())
    print(json.dumps({"name": name, "numel": t.numel()}))


def main(argv):
    try:
        if len(argv) == 3 and argv[1] == "check":
            check(argv[2])
        elif len(argv) >= 4 and argv[1] == "compare":
            for b in argv[3:]:
                compare(argv[2], b)
        elif len(argv) == 5 and argv[1] == "dump":
            dump(argv[2], argv[3], argv[4])
        else:
            print(__doc__, file=sys.stderr)
            return 2
    except Bad as e:
        print(f"state_compare: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
