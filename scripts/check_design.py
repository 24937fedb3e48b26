#!/usr/bin/env python3
"""check_design.py: design rules that the compiler cannot see, checked in CI (ctest entry `design`).

1. Named choices are resolved once, by the recipe parser (src/config/choices.h): outside src/config no
   code compares a string with the name of a recipe choice: a checkpointing mode, sharding stage,
   architecture, dtype, backend, device, data source or loss-spike/non-finite action (`mode == "budget"`,
   `arch == "llama"`, `compute != "fp32"`); it compares typed values or asks them
   (`sharding.shards_params()`, `dtype.bytes()`). Names that a file format shares with a choice
   (Hugging Face's model_type "llama") are mapped through a table, not compared.
2. Layers point one way: a file in src/<folder>/ includes headers of its own folder and of the folders
   below it in LAYERS (docs/architecture.md, "Layers"), never of a folder above it; src/cli.cpp and
   src/main.cpp (the top) and src/errors.h (the bottom) sit outside the order. A folder missing from
   LAYERS fails too, so a new folder is placed on purpose.
3. The bottom is torch-free: no file in TORCH_FREE includes a torch, ATen or c10 header, directly or
   through a project header.
4. Parallelism is a strategy chosen once (parallel::make_strategy): outside src/parallel no code asks
   whether a data-parallel engine exists (`engine ? a : b`, `if (engine)`, `!engine`, `engine && ...`).
5. Phases take the parts they use: no function takes the whole run (a `Session&` parameter,
   train/run.h); the end of the run, which reports on every part, is the `Session`'s own
   (`Session::finish`, `Session::summary_json`).
6. The step stays narrow: a function named in MAX_PARAMS takes at most that many parameters.
7. No recipe is copied to ask "what if": outside src/config and src/cli.cpp no code declares a
   `RunConfig` by value (`RunConfig c = ...`) or copies a recipe into an `auto` (`auto c = cfg;`); a
   what-if varies a copy of the memory model's input (memory::Scenario, `s.micro_batch = b`) instead.
10. The build holds the same order: CMakeLists.txt's SUBLINEAR_LAYERS (one static library a folder, each
   seeing only the folders below it) equals LAYERS; and inside a folder no two files include each other
   (a .cpp and its .h are one unit): a base file never includes a derived one (factories sit above both).
11. Lines fit a reader's screen: no line of a source file under src/ (.h, .cpp, .cu, .cuh) is longer than
   MAX_COLUMNS characters.
9. Coordinates come from the process mesh (src/layout/mesh.h): outside src/layout no code divides or
   reduces a rank or a world size by a degree (`rank % sequence`, `world / sequence_`) or defines its own
   `data_world`, `data_rank` or `sequence_rank`; a new parallel dimension adds its coordinate there.
8. The whole recipe is a parameter only where it is read whole or nearly so: outside src/config and
   src/cli.cpp a `RunConfig&` parameter appears only in the functions of RECIPE_READERS; every other
   function takes the sections or values it reads (`TrainConfig&`, a `memory::Scenario`, a
   `parallel::Spec`, ...). A new reader is added to the list on purpose, with its reason.

Usage: scripts/check_design.py [ROOT] [--edges]   (ROOT: the repository, default: this script's
parent's parent; --edges also prints every include edge between folders with its count)
Prints each violation as FILE:LINE: text, then a count per rule; exits 1 when any rule is broken.
"""
import pathlib
import re
import sys

CHOICE_NAMES = [
    "none", "full", "interval", "sqrt", "selective", "budget",  # checkpointing.mode
    "zero1", "zero2", "zero3",  # parallel.sharding (and none)
    "gpt2", "llama",  # model.arch
    "fp32", "bf16", "fp16",  # precision.compute, param_dtype, reduce_dtype
    "auto", "gloo", "nccl",  # parallel.backend
    "cpu", "cuda", "lazy",  # train.device (and auto)
    "abort", "skip", "off", "warn", "stop",  # train.on_nonfinite, train.on_spike
    "on",  # train.cuda_graphs (and off, auto)
    "dynamic",  # precision.loss_scale
    "llmc", "bin", "raw", "text", "synthetic", "uint16", "uint32",  # data.source, data.raw_dtype
]
NAMES = "|".join(CHOICE_NAMES)
# A string literal that is one of the names, on either side of == or !=.
COMPARISON = re.compile(r'(==|!=)\s*"(%s)"|"(%s)"\s*(==|!=)' % (NAMES, NAMES))


# Bottom first. Each folder may include its own headers and those of the folders listed before it.
LAYERS = [
    "layout",     # the process mesh: each rank's coordinates and groups, the batch arithmetic (torch-free)
    "config",     # the recipe: keys, typed choices, validation (torch-free)
    "log",        # formatting, metrics.jsonl, the run directory, atomic files and CRC-32 (torch-free)
    "text",       # tokenizer.json: encoding, decoding, the files beside exported weights (torch-free)
    "device",     # what runs where: device choice, the CPU's instruction set, host staging
    "kernels",    # the fused kernels' loops on raw pointers, torch-free: cpu/ (GEMM tiles, GELU, LayerNorm,
                  # residual adds, attention heads; their instruction set picked per call from
                  # device/cpu_features.h) and cuda/ (the .cu files behind their launch functions)
    "model",      # GPT-2 / LLaMA and their kernels
    "precision",  # autocast and the loss scaler
    "recompute",  # activation checkpointing (recompute): the per-block plan (torch-free) and the engine that runs it
    "memory",     # measured memory: the tracker, the tracking allocator (its limit and host pool), CUDA's limit,
                  # the memory timeline
    "predict",    # memory prediction in one room: the memory model's input (scenario), activations and model
                  # states (footprint), the budget solver, the planner (`trainer plan`, OOM advice)
    "data",       # token files and the loaders
    "optim",      # AdamW and its fused kernel
    "parallel",   # c10d: DDP and ZeRO-1/2/3
    "state",      # training state: save, load, re-shard (of the components that declare it)
    "interop",    # Hugging Face weights in and out; `trainer sample` (a model and its tokenizer from a run or folder)
    "train",      # the run: setup, the loop, the step, reports
]
# Rule 4: a test of a data-parallel engine pointer (the engine is never optional: Single is the strategy
# of one process).
NULL_CHECK = re.compile(r'(!\s*(\w+\.)?engine\b(?!\()|\bengine\s*(\?|&&|\|\|)|if \((\w+\.)?engine\))')
# Rule 5: a parameter of type `Session&` (the whole run).
SESSION_PARAM = re.compile(r'\b(\w+)\s*\(([^()]*\bSession\s*&[^()]*)\)')
# Rule 6: the most parameters a function of this name may take.
MAX_PARAMS = {"train_step": 5}
# Files that include no torch header, directly or through the project headers they include.
TORCH_FREE = ["src/layout/*", "src/config/*", "src/log/*", "src/text/*", "src/kernels/**/*", "src/recompute/plan.*", "src/predict/activations.h", "src/predict/footprint.h", "src/predict/scenario.h"]
# Rule 8: the functions that take the whole recipe, each because it reads most of it.
RECIPE_READERS = {
    "of": "memory::Scenario::of: the memory model's input, and parallel::Spec::of: a strategy's sections, "
          "each read from the recipe once",
    "run": "train/loop.cpp: the whole run", "setup": "train/setup.cpp: every part of the run",
    "train_loop": "steps, logging, eval, saves, the memory limit and the planner's advice on OOM",
    "init_process": "sets world_size and validates the whole recipe against it",
    "find_resume_point": "--resume, state.*, logging.overwrite and every math key (check_recipe)",
    "check_recipe": "compares every math key of the recipe with a saved state's",
    "choose_micro_batch": "train.*, memory.limit, the probe and the planner's advice",
    "find_micro_batch": "the probe builds the model, plan, strategy, optimizer and scaler",
    "micro_batch_fits": "as find_micro_batch", "probe_step": "a fresh model, plan, optimizer and scaler: one real step",
    "build_learner": "model, plan, strategy, optimizer and precision: most sections",
    "open_run_log": "writes the whole resolved recipe (config.json)",
    "graph_eligibility": "train.cuda_graphs: whether a graph may capture reads train, model, checkpointing, precision, parallel, offload, memory and logging",
    "state_parts": "a save's meta.json holds the recipe",
    "plan": "planner::plan reports on the whole recipe (trainer plan)",
}
RECIPE_PARAM = re.compile(r'\b(\w+)\s*\(([^()]*\bRunConfig\s*&[^()]*)\)?')
# Rule 7: a whole recipe copied (by value into a RunConfig, or into an auto from a name that holds one).
RECIPE_COPY = re.compile(r'\b(auto|(config::)?RunConfig)\s+\w+\s*=\s*\*?(\w+(\.|->))*(cfg|recipe)\s*;'
                         r'|\b(config::)?RunConfig\s+\w+\s*(=|\{)')
# Rule 9: a rank or world divided or reduced by a degree, or a coordinate defined, outside src/layout.
COORDINATE = re.compile(r'\b\w*(rank|world)\w*(\(\))?\s*[/%]\s*[\w.]*(sequence|degree|pieces)\w*'
                        r'|\b(int64_t|auto)\s+(data_world|data_rank|sequence_rank)\s*\(')
TORCH = re.compile(r'#include\s*<(torch|ATen|c10)/')
INCLUDE = re.compile(r'#include\s*"([^"]+)"')


def sources(root: pathlib.Path):
    for path in sorted((root / "src").rglob("*")):
        if path.suffix in (".cpp", ".h") and path.is_file():
            yield path


def choice_comparisons(root: pathlib.Path):
    found = []
    for path in sources(root):
        rel = path.relative_to(root)
        if rel.parts[:2] == ("src", "config"):
            continue  # the parser: where names become values
        for n, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("//", 1)[0]
            if COMPARISON.search(code):
                found.append(f"{rel}:{n}: {line.strip()}")
    return found


def code_lines(path: pathlib.Path):
    """(line number, the line without its // comment) for every line of a source file."""
    for n, line in enumerate(path.read_text().splitlines(), 1):
        yield n, line.split("//", 1)[0]


def engine_null_checks(root: pathlib.Path):
    found = []
    for path in sources(root):
        rel = path.relative_to(root)
        if rel.parts[:2] == ("src", "parallel"):
            continue  # the strategies themselves
        found += [f"{rel}:{n}: {code.strip()}" for n, code in code_lines(path) if NULL_CHECK.search(code)]
    return found


def session_takers(root: pathlib.Path):
    found = []
    for path in sources(root):
        rel = path.relative_to(root)
        for n, code in code_lines(path):
            for m in SESSION_PARAM.finditer(code):
                found.append(f"{rel}:{n}: {m.group(1)} takes the whole `Session`: pass it the parts it reads")
    return found


def parameter_count(text: str, start: int) -> int:
    """Parameters of the call or signature whose '(' is at text[start]: top-level commas + 1, 0 when empty."""
    depth, commas, body = 0, 0, []
    for ch in text[start:]:
        depth += ch in "(<{[" 
        depth -= ch in ")>}]"
        if depth == 0:
            break
        if depth == 1 and ch == ",":
            commas += 1
        body.append(ch)
    return commas + 1 if "".join(body[1:]).strip() else 0


def wide_signatures(root: pathlib.Path):
    """Declarations and definitions (a return type before the name) of MAX_PARAMS' functions past their limit."""
    found = []
    for path in sources(root):
        text = "\n".join(code for _, code in code_lines(path))
        for name, most in MAX_PARAMS.items():
            for m in re.finditer(r'\b[\w:<>]+[&*]?\s+%s\s*\(' % name, text):
                if m.group(0).split()[0] in ("return", "=", "else"):
                    continue  # a call
                n = parameter_count(text, m.end() - 1)
                if n > most:
                    line = text.count("\n", 0, m.start()) + 1
                    found.append(f"{path.relative_to(root)}:{line}: {name} takes {n} parameters (at most {most})")
    return found


def beyond_the_parser(root: pathlib.Path):
    """(path relative to root, line number, code) for every line outside src/config (the parser) and
    src/cli.cpp (the command line): where the recipe is made, rules 7 and 8 do not look."""
    for path in sources(root):
        rel = path.relative_to(root)
        if rel.parts[:2] == ("src", "config") or rel == pathlib.PurePath("src/cli.cpp"):
            continue
        for n, code in code_lines(path):
            yield rel, n, code


def recipe_takers_all(root: pathlib.Path):
    """FILE:LINE: name for every function with a RunConfig& parameter outside src/config and cli.cpp."""
    return [f"{rel}:{n}: {m.group(1)}" for rel, n, code in beyond_the_parser(root) for m in RECIPE_PARAM.finditer(code)]


def recipe_takers(root: pathlib.Path):
    """Rule 8: FILE:LINE: name for every function outside RECIPE_READERS with a RunConfig& parameter."""
    return [f"{rel}:{n}: {m.group(1)} takes the whole recipe: pass it the sections it reads (or add it to "
            "RECIPE_READERS with the reason)"
            for rel, n, code in beyond_the_parser(root) for m in RECIPE_PARAM.finditer(code)
            if m.group(1) not in RECIPE_READERS]


def coordinates_outside_mesh(root: pathlib.Path):
    """Rule 9: FILE:LINE: code for every coordinate derived outside src/layout."""
    return [f"{path.relative_to(root)}:{n}: {code.strip()}: ask the process mesh (layout::Mesh) instead"
            for path in sources(root) if path.relative_to(root).parts[:2] != ("src", "layout")
            for n, code in code_lines(path) if COORDINATE.search(code)]


def recipe_copies(root: pathlib.Path):
    """Rule 7: FILE:LINE: code for every recipe copied outside src/config and src/cli.cpp."""
    return [f"{rel}:{n}: {code.strip()}: a recipe copied; vary a memory::Scenario (or pass the part) instead"
            for rel, n, code in beyond_the_parser(root) if RECIPE_COPY.search(code)]


def includes(path: pathlib.Path):
    for line in path.read_text().splitlines():
        m = INCLUDE.match(line.strip())
        if m:
            yield m.group(1)


def folder_of(rel: pathlib.PurePath):
    """src/<folder>/file -> folder; None for files directly in src/."""
    return rel.parts[1] if len(rel.parts) > 2 else None


def folder_edges(root: pathlib.Path):
    """{(from, to): count} over includes of project headers in another folder."""
    edges = {}
    for path in sources(root):
        src = folder_of(path.relative_to(root))
        for inc in includes(path):
            dst = inc.split("/", 1)[0] if "/" in inc else None
            if src and dst and dst != src and (root / "src" / inc).exists():
                edges[(src, dst)] = edges.get((src, dst), 0) + 1
    return edges


def layer_violations(root: pathlib.Path):
    found = []
    rank = {name: i for i, name in enumerate(LAYERS)}
    folders = sorted({folder_of(p.relative_to(root)) for p in sources(root)} - {None})
    for f in folders:
        if f not in rank:
            found.append(f"src/{f}/: folder not in LAYERS (scripts/check_design.py): place it in the order")
    for path in sources(root):
        rel = path.relative_to(root)
        src = folder_of(rel)
        for inc in includes(path):
            dst = inc.split("/", 1)[0] if "/" in inc else None
            if src in rank and dst in rank and rank[dst] > rank[src]:
                found.append(f"{rel}: includes {inc}: {src} is below {dst}")
    return found


def torch_includes(root: pathlib.Path):
    """Files in TORCH_FREE that reach a torch header, with the chain of includes that gets there."""
    found = []
    for pattern in TORCH_FREE:
        for path in sorted(p for p in root.glob(pattern) if p.is_file()):
            seen, todo = set(), [(path, [str(path.relative_to(root))])]
            while todo:
                p, chain = todo.pop()
                if p in seen or not p.exists():
                    continue
                seen.add(p)
                text = p.read_text()
                if TORCH.search(text):
                    found.append(" -> ".join(chain) + ": includes a torch header")
                    break
                for inc in includes(p):
                    todo.append((root / "src" / inc, chain + [inc]))
    return found


def cmake_layers(root: pathlib.Path):
    """The folder order CMakeLists.txt builds its layer libraries in (set(SUBLINEAR_LAYERS ...)); None for
    a tree without a CMakeLists.txt (nothing to compare)."""
    cmake = root / "CMakeLists.txt"
    if not cmake.exists():
        return None
    m = re.search(r'set\(SUBLINEAR_LAYERS([^)]*)\)', cmake.read_text())
    return m.group(1).split() if m else []


def folder_cycles(root: pathlib.Path):
    """Rule 10: FILE units (a .cpp with its .h) of one folder that include each other, as 'a <-> b' lines."""
    found = []
    units = {}
    for path in sources(root):
        rel = path.relative_to(root)
        folder = folder_of(rel)
        if folder is None:
            continue
        unit = str(rel.with_suffix(""))
        for inc in includes(path):
            dst = "src/" + str(pathlib.PurePath(inc).with_suffix(""))
            if inc.split("/", 1)[0] == folder and dst != unit and (root / "src" / inc).exists():
                units.setdefault(unit, set()).add(dst)
    for a, outs in sorted(units.items()):
        for b in sorted(outs):
            if a < b and a in units.get(b, set()):
                found.append(f"{a} <-> {b}: the two include each other; move what one needs of the other "
                             "(a factory, a shared type) to a file above or below both")
    return found


MAX_COLUMNS = 120


def long_lines(root: pathlib.Path):
    """Rule 11: FILE:LINE: length for every line of src/ longer than MAX_COLUMNS."""
    found = []
    for path in sorted((root / "src").rglob("*")):
        if path.suffix in (".cpp", ".h", ".cu", ".cuh") and path.is_file():
            for n, line in enumerate(path.read_text().splitlines(), 1):
                if len(line) > MAX_COLUMNS:
                    found.append(f"{path.relative_to(root)}:{n}: {len(line)} columns (at most {MAX_COLUMNS})")
    return found


def main() -> int:
    args = [a for a in sys.argv[1:] if a != "--edges"]
    root = pathlib.Path(args[0]) if args else pathlib.Path(__file__).resolve().parent.parent
    broken = 0
    comparisons = choice_comparisons(root)
    for c in comparisons:
        print(c)
    print(f"string comparisons with a recipe choice's name outside src/config: {len(comparisons)} (must be 0)")
    broken += bool(comparisons)

    if "--edges" in sys.argv:
        for (a, b), n in sorted(folder_edges(root).items()):
            print(f"edge {a} -> {b}: {n}")
    layers = layer_violations(root)
    for v in layers:
        print(v)
    print(f"includes against the layer order ({' < '.join(LAYERS)}): {len(layers)} (must be 0)")
    broken += bool(layers)

    built = cmake_layers(root)
    differs = built is not None and built != LAYERS
    if differs:
        print(f"CMakeLists.txt SUBLINEAR_LAYERS {built} differs from LAYERS {LAYERS}")
    print(f"layer orders that differ between the build and LAYERS: {int(differs)} (must be 0)")
    broken += differs
    cycles = folder_cycles(root)
    for c in cycles:
        print(c)
    print(f"files of one folder that include each other: {len(cycles)} (must be 0)")
    broken += bool(cycles)

    torch = torch_includes(root)
    for t in torch:
        print(t)
    print(f"torch headers in the torch-free bottom: {len(torch)} (must be 0)")
    broken += bool(torch)

    for rule, found in (("data-parallel engine null checks outside src/parallel", engine_null_checks(root)),
                        ("functions taking the whole `Session`", session_takers(root)),
                        ("signatures wider than MAX_PARAMS allows", wide_signatures(root)),
                        ("recipe copies outside src/config and src/cli.cpp", recipe_copies(root)),
                        ("functions taking the whole recipe beyond RECIPE_READERS", recipe_takers(root)),
                        ("coordinates derived outside the process mesh", coordinates_outside_mesh(root)),
                        (f"lines in src/ longer than {MAX_COLUMNS} columns", long_lines(root))):
        for f in found:
            print(f)
        print(f"{rule}: {len(found)} (must be 0)")
        broken += bool(found)
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
