#!/usr/bin/env python3
"""sample.py: tokens/s of `trainer sample` with and without the KV cache, at the GPT-2 124M shape.

Makes (once, then reuses) a Hugging Face folder of a randomly initialised GPT-2 124M: transformers'
GPT2Config() defaults (12 layers, d 768, 12 heads, 1024 positions, vocabulary 50257, tied head), weights
from torch.manual_seed(--seed), save_pretrained(safe_serialization=True) in fp32 (475 MiB), and a
tokenizer.json of exactly 50257 ids built offline with Hugging Face `tokenizers`: a byte-level BPE
trained on data/corpus.txt (a few hundred merges), unused added tokens up to id 50255, and
<|endoftext|> as id 50256. The folder lives outside the tree (default
$SUBLINEAR_HOME/bench/gpt2-124m-random, ~/.cache/sublinear/...) and is rebuilt only when its recipe
changes (a stamp file records it).

Then, in --rounds interleaved rounds (the order reversed every other round, so the machine's load hits
every variant alike), it runs, each in its own process at --threads intra-op threads (OMP_NUM_THREADS,
and torch.set_num_threads on the transformers side):
  - `trainer sample --weights F --prompt P --max-new-tokens N --temperature 0 --ignore-eot --json`
    (KV cache: each new token runs one position's forward over the cached keys and values);
  - the same with --no-cache (each new token runs the whole sequence's forward);
  - for reference, transformers' `model.generate(do_sample=False, use_cache=True, max_new_tokens=N)`
    on the same folder and prompt ids (eos disabled, like --ignore-eot), timed around generate() alone.
Per variant it reports the median over rounds of tokens/s (new tokens / seconds, prompt included: the
trainer's own tokens_per_s), the seconds, the prompt's time (its forward and the first token), and the
mean time of each later token; the cache's speed-up over no cache (median of the per-round ratios);
and checks that every run produced the same ids (greedy: the cache must not change a token; a mismatch
prints a WARNING, it does not stop the bench). The transformers reference also records the time of each
token (a logits processor's timestamps), so its per-token latency over the sequence is in the JSON.

Writes <out>.json (every run, the medians, the CPU, the load average around each run) and prints a
markdown table; <out> defaults to bench/results/sample_<cpu> (<cpu> from /proc/cpuinfo's model name,
e.g. sample_amd-epyc). --from-json re-prints the table of a saved .json.

Usage: ~/.cache/sublinear/venv/bin/python bench/sample.py [--trainer build/trainer] [--rounds 3]
                 [--new-tokens 256] [--threads 2] [--prompt TEXT] [--model-dir DIR] [--no-hf] [--out PATH]
       bench/sample.py --from-json bench/results/sample_amd-epyc.json
Develop with --rounds 1 --new-tokens 32 (~20 s idle). Cost of the defaults on 2 idle cores (AMD EPYC): a
round is ~1.7 minutes (no cache ~70 s of it, KV cache and transformers ~11 s each, plus start-up and
loading); --rounds 3 took 6 minutes; building the model folder the first time ~8 s more.
A benchmark, not a test: run it on an otherwise idle machine; the figures hold for the CPU and thread count
it ran on (recorded in the JSON).
"""
import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

sys.dont_write_bytecode = True  # no __pycache__ beside the scripts
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_util import cpu_model, slug, venv_python  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPT = "The small cat sees the dog in the garden."
VOCAB = 50257
# Bump when the folder's recipe changes: a folder with another stamp is rebuilt.
RECIPE_VERSION = 1

# Runs in the venv's interpreter: the GPT-2 124M folder (random weights) and its 50257-id tokenizer.
BUILD_FOLDER = r"""
import json, os, sys
folder, corpus, seed, vocab = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import GPT2Config, GPT2LMHeadModel

tok = Tokenizer(models.BPE())
tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
tok.decoder = decoders.ByteLevel()
tok.train([corpus], trainers.BpeTrainer(vocab_size=vocab - 1, min_frequency=1, show_progress=False,
                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
learned = tok.get_vocab_size()
# Unused ids up to vocab - 2 (the corpus is too small for 50k merges), then <|endoftext|> = vocab - 1.
tok.add_tokens([AddedToken(f"<|unused{i}|>", special=True) for i in range(vocab - 1 - learned)])
tok.add_special_tokens([AddedToken("<|endoftext|>", special=True)])
assert tok.get_vocab_size() == vocab, tok.get_vocab_size()
assert tok.token_to_id("<|endoftext|>") == vocab - 1

torch.manual_seed(seed)
cfg = GPT2Config()
assert cfg.vocab_size == vocab, cfg.vocab_size
model = GPT2LMHeadModel(cfg).to(torch.float32).eval()
model.save_pretrained(folder, safe_serialization=True)
tok.save(os.path.join(folder, "tokenizer.json"))
print(json.dumps({"learned_bpe_tokens": learned, "vocab": tok.get_vocab_size(),
                  "params": sum(p.numel() for p in model.parameters()),
                  "torch": torch.__version__, "transformers": __import__("transformers").__version__,
                  "tokenizers": __import__("tokenizers").__version__}))
"""

# Runs in the venv's interpreter: transformers' greedy generate with its KV cache, timed around generate().
HF_GENERATE = r"""
import copy, json, sys, time
folder, ids, new_tokens, threads = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
import torch
torch.set_num_threads(threads)
from transformers import AutoModelForCausalLM, LogitsProcessor, LogitsProcessorList
t_load = time.perf_counter()
model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
load_s = time.perf_counter() - t_load
stamps = []

class Stamp(LogitsProcessor):  # called once per new token, on that token's logits
    def __call__(self, input_ids, scores):
        stamps.append(time.perf_counter())
        return scores

gc = copy.deepcopy(model.generation_config)
gc.eos_token_id = None  # keep going past <|endoftext|>, like trainer sample --ignore-eot
gc.pad_token_id = model.config.vocab_size - 1
gc.do_sample, gc.max_new_tokens, gc.use_cache = False, new_tokens, True
x = torch.tensor([ids], dtype=torch.long)
with torch.inference_mode():
    t0 = time.perf_counter()
    out = model.generate(x, attention_mask=torch.ones_like(x), generation_config=gc,
                         logits_processor=LogitsProcessorList([Stamp()]))
    seconds = time.perf_counter() - t0
new = out[0, len(ids):].tolist()
print(json.dumps({"ids": new, "seconds": seconds, "prompt_seconds": stamps[0] - t0 if stamps else None,
                  "token_seconds": [b - a for a, b in zip([t0] + stamps[:-1], stamps)],
                  "tokens_per_s": len(new) / seconds, "load_s": load_s, "threads": torch.get_num_threads(),
                  "torch": torch.__version__, "transformers": __import__("transformers").__version__}))
"""

VARIANTS = [
    ("trainer, KV cache", "cache"),
    ("trainer, no cache", "nocache"),
    ("transformers generate, use_cache=True", "hf"),
]


def git_head():
    p = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, stdout=subprocess.PIPE,
                       stderr=subprocess.DEVNULL, text=True)
    return p.stdout.strip() if p.returncode == 0 else None


def run(args, threads, what):
    """Runs args with OMP_NUM_THREADS=threads; returns (its last JSON line of stdout, wall s, 1-minute load average before/after)."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    load_before = os.getloadavg()[0]
    t0 = time.perf_counter()
    p = subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = p.communicate()
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        sys.exit(f"sample.py: {what} failed ({p.returncode}):\n{' '.join(args)}\n{(out + err)[-3000:]}")
    lines = [l for l in out.strip().splitlines() if l.startswith("{")]
    if not lines:
        sys.exit(f"sample.py: {what} printed no JSON:\n{(out + err)[-3000:]}")
    return json.loads(lines[-1]), wall, {"before": load_before, "after": os.getloadavg()[0]}


def ensure_folder(a):
    """The model folder: reused when its stamp matches this recipe, else (re)built. Returns its stamp."""
    want = {"recipe_version": RECIPE_VERSION, "seed": a.seed, "vocab": VOCAB, "config": "GPT2Config()",
            "corpus": "data/corpus.txt"}  # relative to the repository (no machine's path in the results)
    stamp_path = os.path.join(a.model_dir, "bench_sample_stamp.json")
    files = ["config.json", "model.safetensors", "tokenizer.json"]
    try:
        with open(stamp_path) as f:
            stamp = json.load(f)
        if {k: stamp.get(k) for k in want} == want and all(os.path.isfile(os.path.join(a.model_dir, n)) for n in files):
            return stamp
    except (OSError, ValueError):
        pass
    print(f"building the GPT-2 124M folder (random weights, seed {a.seed}) in {a.model_dir} ...", flush=True)
    os.makedirs(a.model_dir, exist_ok=True)
    if os.path.exists(stamp_path):
        os.remove(stamp_path)
    t0 = time.perf_counter()
    p = subprocess.run([a.python, "-c", BUILD_FOLDER, a.model_dir, os.path.join(ROOT, want["corpus"]), str(a.seed), str(VOCAB)],
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if p.returncode != 0:
        sys.exit(f"sample.py: building the model folder with {a.python} failed ({p.returncode}; it needs torch, "
                 f"transformers and tokenizers: the project venv):\n{p.stderr[-3000:]}")
    stamp = dict(want, **json.loads(p.stdout.strip().splitlines()[-1]), build_s=round(time.perf_counter() - t0, 1))
    with open(stamp_path, "w") as f:
        json.dump(stamp, f, indent=1)
    print(f"  {stamp['params'] / 1e6:.1f}M parameters, tokenizer {stamp['learned_bpe_tokens']} learned BPE tokens "
          f"+ unused up to {VOCAB - 2} + <|endoftext|> = {stamp['vocab']} ids ({stamp['build_s']} s)", flush=True)
    return stamp


def trainer_sample(a, cache):
    args = [a.trainer, "sample", "--weights", a.model_dir, "--prompt", a.prompt, "--max-new-tokens", str(a.new_tokens),
            "--temperature", "0", "--ignore-eot", "--json", "--device", "cpu"]
    if not cache:
        args.append("--no-cache")
    j, wall, load = run(args, a.threads, "trainer sample" + ("" if cache else " --no-cache"))
    return {"ids": j["ids"], "prompt_ids": j["prompt_ids"], "seconds": j["seconds"],
            "prompt_seconds": j["prompt_seconds"], "tokens_per_s": j["tokens_per_s"], "kv_cache": j["kv_cache"],
            "process_wall_s": wall, "load": load}


def hf_generate(a, prompt_ids):
    j, wall, load = run([a.python, "-c", HF_GENERATE, a.model_dir, json.dumps(prompt_ids), str(a.new_tokens),
                              str(a.threads)], a.threads, "transformers generate")
    j.update(process_wall_s=wall, load=load)
    return j


def later_token_ms(r):
    """Mean time of each token after the first (the prompt's forward and the first token excluded)."""
    n = len(r["ids"])
    return 1e3 * (r["seconds"] - r["prompt_seconds"]) / (n - 1) if n > 1 and r.get("prompt_seconds") is not None else None


def check_ids(runs):
    """Every run's ids against the first KV-cache run's. Returns a list of mismatch texts."""
    ref = next(r for r in runs if r["variant"] == "cache")
    bad = []
    for r in runs:
        if r is ref or r["ids"] == ref["ids"]:
            continue
        n = min(len(r["ids"]), len(ref["ids"]))
        at = next((i for i in range(n) if r["ids"][i] != ref["ids"][i]), n)
        bad.append(f"{r['name']} (round {r['round'] + 1}) differs from the KV cache (round {ref['round'] + 1}) at new "
                   f"token {at}" + (f": {r['ids'][at]} vs {ref['ids'][at]}" if at < n else
                                     f": {len(r['ids'])} vs {len(ref['ids'])} tokens"))
    return bad


def summarize(doc):
    rows = []
    for name, key in VARIANTS:
        rs = [r for r in doc["runs"] if r["variant"] == key]
        if not rs:
            continue
        tps = [r["tokens_per_s"] for r in rs]
        later = [x for x in map(later_token_ms, rs) if x is not None]
        rows.append({"name": name, "variant": key, "runs": len(rs), "median_tokens_per_s": statistics.median(tps),
                     "tokens_per_s_min": min(tps), "tokens_per_s_max": max(tps),
                     "median_seconds": statistics.median(r["seconds"] for r in rs),
                     "median_prompt_ms": statistics.median(1e3 * r["prompt_seconds"] for r in rs),
                     "median_later_token_ms": statistics.median(later) if later else None,
                     "median_process_wall_s": statistics.median(r["process_wall_s"] for r in rs)})
    by = {r["variant"]: r for r in rows}
    # The cache's speed-up: per round (the two runs shared that round's load), then the median.
    ratios = []
    for rnd in range(doc["rounds"]):
        c = [r for r in doc["runs"] if r["round"] == rnd and r["variant"] == "cache"]
        n = [r for r in doc["runs"] if r["round"] == rnd and r["variant"] == "nocache"]
        if c and n:
            ratios.append(c[0]["tokens_per_s"] / n[0]["tokens_per_s"])
    base = by.get("nocache")
    for row in rows:
        row["vs_no_cache"] = row["median_tokens_per_s"] / base["median_tokens_per_s"] if base else None
    doc["cache_speedup_per_round"] = ratios
    doc["cache_speedup"] = statistics.median(ratios) if ratios else None
    return rows


def table(doc):
    s = doc["stamp"]
    lines = [f"CPU: {doc['cpu']}; {doc['threads']} threads (OMP_NUM_THREADS; torch.set_num_threads for transformers); "
             f"fp32; GPT-2 124M shape (GPT2Config(): 12 layers, d 768, 12 heads, vocabulary {s['vocab']}; random weights, "
             f"seed {s['seed']}); prompt \"{doc['prompt']}\" ({len(doc['prompt_ids'])} tokens), {doc['new_tokens']} new "
             f"tokens, greedy; median of {doc['rounds']} interleaved round(s) (tokens/s: min-max over rounds)", "",
             "| run | tokens/s | vs no cache | seconds | prompt + first token ms | ms per later token |",
             "|---|---|---|---|---|---|"]
    for r in doc["rows"]:
        vs = f"{r['vs_no_cache']:.2f}x" if r["vs_no_cache"] else "-"
        later = f"{r['median_later_token_ms']:.1f}" if r["median_later_token_ms"] is not None else "-"
        lines.append(f"| {r['name']} | {r['median_tokens_per_s']:.2f} ({r['tokens_per_s_min']:.2f}-{r['tokens_per_s_max']:.2f}) "
                     f"| {vs} | {r['median_seconds']:.2f} | {r['median_prompt_ms']:.0f} | {later} |")
    lines.append("")
    if doc.get("cache_speedup"):
        lines.append(f"KV cache over no cache: {doc['cache_speedup']:.2f}x (median of the per-round ratios: "
                     + ", ".join(f"{x:.2f}" for x in doc["cache_speedup_per_round"]) + ").")
    if doc["id_mismatches"]:
        lines.append("WARNING: ids differ: " + "; ".join(doc["id_mismatches"]))
    else:
        lines.append(f"Ids: the same {doc['new_tokens']} tokens in all {len(doc['runs'])} runs "
                     f"(trainer with and without the cache{', and transformers' if any(r['variant'] == 'hf' for r in doc['runs']) else ''}).")
    loads = [x for r in doc["runs"] for x in (r["load"]["before"], r["load"]["after"])]
    lines.append(f"1-minute load average just before / after each run: {min(loads):.2f}-{max(loads):.2f} on "
                 f"{doc.get('cpus') or os.cpu_count()} CPUs (this bench's own runs add up to ~{doc['threads']}).")
    return "\n".join(lines) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog="\n".join(__doc__.splitlines()[1:]),
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trainer", default=os.path.join(ROOT, "build", "trainer"), help="trainer binary (default build/trainer)")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds; every variant runs once per round (default 3)")
    ap.add_argument("--new-tokens", type=int, default=256, help="tokens to generate per run (default 256)")
    ap.add_argument("--threads", type=int, default=2, help="intra-op threads for every run (default 2)")
    ap.add_argument("--prompt", default=PROMPT, help=f"the prompt (default \"{PROMPT}\")")
    ap.add_argument("--seed", type=int, default=1337, help="torch.manual_seed of the random weights (default 1337)")
    home = os.environ.get("SUBLINEAR_HOME", os.path.expanduser("~/.cache/sublinear"))
    ap.add_argument("--model-dir", default=os.path.join(home, "bench", "gpt2-124m-random"),
                    help="where the model folder is made and reused (default $SUBLINEAR_HOME/bench/gpt2-124m-random)")
    ap.add_argument("--python", default="", help="interpreter with torch, transformers, tokenizers (default: the project venv's)")
    ap.add_argument("--no-hf", action="store_true", help="skip the transformers reference")
    ap.add_argument("--out", default="", help="output path without extension (default bench/results/sample_<cpu>)")
    ap.add_argument("--from-json", help="re-print the table of a saved .json")
    a = ap.parse_args()

    if a.from_json:
        with open(a.from_json) as f:
            print(table(json.load(f)))
        return
    a.python = a.python or venv_python()
    if not (os.path.isfile(a.trainer) and os.access(a.trainer, os.X_OK)):
        sys.exit(f"sample.py: trainer binary not found or not executable: {a.trainer}\n"
                 f"build it (cmake --build build --target trainer) or pass --trainer PATH")
    if a.rounds < 1 or a.new_tokens < 1 or a.threads < 1:
        sys.exit("sample.py: --rounds, --new-tokens and --threads must be >= 1")
    t_start = time.perf_counter()
    stamp = ensure_folder(a)

    variants = [v for v in VARIANTS if not (a.no_hf and v[1] == "hf")]
    runs, prompt_ids = [], None
    for rnd in range(a.rounds):
        order = variants if rnd % 2 == 0 else list(reversed(variants))
        for name, key in order:
            if key == "hf":
                if prompt_ids is None:  # the trainer's encoding of the prompt, so both continue the same ids
                    prompt_ids = trainer_sample(argparse.Namespace(**dict(vars(a), new_tokens=1)), True)["prompt_ids"]
                r = hf_generate(a, prompt_ids)
            else:
                r = trainer_sample(a, key == "cache")
                prompt_ids = r["prompt_ids"]
            r.update(name=name, variant=key, round=rnd)
            runs.append(r)
            later = later_token_ms(r)
            print(f"round {rnd + 1}/{a.rounds}: {name:38s} {r['tokens_per_s']:7.2f} tokens/s, {r['seconds']:7.2f} s, "
                  f"prompt + first token {1e3 * r['prompt_seconds']:5.0f} ms, later tokens "
                  f"{'-' if later is None else f'{later:.1f}'} ms each (load {r['load']['before']:.2f})", flush=True)

    mismatches = check_ids(runs)
    for m in mismatches:
        print(f"WARNING: ids differ: {m}", file=sys.stderr)
    cpu = cpu_model()
    hf = next((r for r in runs if r["variant"] == "hf"), {})
    doc = {"kind": "sample", "cpu": cpu, "cpus": os.cpu_count(), "machine": platform.machine(), "threads": a.threads,
           "rounds": a.rounds, "new_tokens": a.new_tokens, "prompt": a.prompt, "prompt_ids": prompt_ids,
           "trainer": os.path.relpath(a.trainer, ROOT), "git_head": git_head(), "model_dir": a.model_dir.replace(os.path.expanduser("~"), "~"), "stamp": stamp,
           "torch": hf.get("torch", stamp.get("torch")), "transformers": hf.get("transformers", stamp.get("transformers")),
           "command": "bench/sample.py " + " ".join(sys.argv[1:]),
           "id_mismatches": mismatches, "ids_equal": not mismatches, "runs": runs}
    doc["rows"] = summarize(doc)
    doc["total_s"] = round(time.perf_counter() - t_start, 1)
    out = a.out or os.path.join(ROOT, "bench", "results", f"sample_{slug(cpu)}")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out + ".json", "w") as f:
        json.dump(doc, f, indent=1)
    print()
    print(table(doc))
    print(f"wrote {out}.json ({doc['total_s']:.0f} s in all)")


if __name__ == "__main__":
    main()
