#!/usr/bin/env python3
"""shape_report.py: the figures docs/architecture.md keeps about the code's shape, counted from the sources.

  strategy null checks   places outside src/parallel that ask whether a data-parallel engine exists
                         (`engine ? ...`, `if (engine)`, `!engine`, `engine && ...`)
  choice comparisons     a string literal naming a recipe choice compared with == or != outside src/config
                         (scripts/check_design.py rule 1 fails on them)
  RunConfig& parameters  function parameters of type RunConfig& outside src/config and src/cli.cpp
  recipe copies          a whole recipe copied to ask "what if" (`auto c = cfg;`, `RunConfig c = ...;`;
                         scripts/check_design.py rule 7 fails on them)
  `Session` fields       data members of `train::Session` (src/train/run.h)
  whole-`Session` takers   functions with a `Session&` parameter (check_design.py rule 5)
  whole-recipe takers    distinct functions with a `RunConfig&` parameter outside src/config and cli.cpp
  longest functions      the longest function bodies in src/, by lines from the opening line to the closing brace

Usage: scripts/shape_report.py [ROOT] [--top N]   (ROOT default: this script's parent's parent)
Prints the figures as Markdown; exits 0.
"""
import pathlib
import re
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import check_design  # noqa: E402  (the choice names and the comparison pattern live there)

RUNCONFIG_PARAM = re.compile(r'RunConfig\s*&')
# A function definition's first line: a return type and name, a parameter list, an opening brace at its end
# (the project's style puts the brace on the signature's last line).
FUNC_START = re.compile(r'^[A-Za-z_][\w:<>,\s\*&~]*\b([\w:~]+)\s*\(')


def source_files(root, skip_config=True):
    for path in check_design.sources(root):
        rel = path.relative_to(root)
        if skip_config and (rel.parts[:2] == ("src", "config") or rel == pathlib.Path("src/cli.cpp")):
            continue
        yield path, rel


def count(root, pattern):
    hits = []
    for path, rel in source_files(root):
        hits += [f"{rel}:{n}" for n, code in check_design.code_lines(path) if pattern.search(code)]
    return hits


def session_fields(root):
    text = (root / "src/train/run.h").read_text()
    m = re.search(r'struct Session \{(.*?)\n\};', text, re.S)
    if not m:
        return 0
    fields = 0
    for line in m.group(1).splitlines():
        code = line.split("//", 1)[0].strip()
        if code.endswith(";") and "(" not in code.split("=")[0] and not code.startswith(("using", "friend")):
            fields += 1
    return fields


def functions(root):
    """(lines, 'file:name') for every function definition in src/*.cpp, by brace matching."""
    found = []
    for path in sorted((root / "src").rglob("*.cpp")):
        lines = path.read_text().splitlines()
        i = 0
        while i < len(lines):
            line = lines[i]
            m = FUNC_START.match(line)
            if m and not line.lstrip().startswith(("if", "for", "while", "switch", "return", "else")) and "=" not in line.split("(")[0]:
                j, depth, opened = i, 0, False
                while j < len(lines):
                    code = re.sub(r'"(\\.|[^"\\])*"|\'(\\.|[^\'\\])*\'', '""', lines[j].split("//", 1)[0])
                    if not opened and code.rstrip().endswith(";") and "{" not in code:
                        break  # a declaration
                    depth += code.count("{") - code.count("}")
                    opened = opened or "{" in code
                    if opened and depth <= 0:
                        found.append((j - i + 1, f"{path.relative_to(root)}:{m.group(1)}"))
                        break
                    j += 1
                i = j + 1 if opened else i + 1
            else:
                i += 1
    return sorted(found, reverse=True)


def main():
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    top = int(sys.argv[sys.argv.index("--top") + 1]) if "--top" in sys.argv else 8
    if "--top" in sys.argv:
        args.remove(str(top))
    root = pathlib.Path(args[0] if args else pathlib.Path(__file__).resolve().parent.parent).resolve()
    rows = [
        ("strategy null checks (outside src/parallel)", len(check_design.engine_null_checks(root))),
        ("choice comparisons (outside src/config)", len(check_design.choice_comparisons(root))),
        ("RunConfig& parameters (outside src/config, cli)", len(count(root, RUNCONFIG_PARAM))),
        ("recipe copies", len(check_design.recipe_copies(root))),
        ("Session fields", session_fields(root)),
        ("functions taking the whole Session", len(check_design.session_takers(root))),
        ("functions taking the whole recipe (outside src/config, cli)", len({f.split(": ")[1].split()[0] for f in check_design.recipe_takers_all(root)})),
    ]
    print("| figure | count |\n| --- | --- |")
    for name, n in rows:
        print(f"| {name} | {n} |")
    print("\n| longest functions | lines |\n| --- | --- |")
    for n, where in functions(root)[:top]:
        print(f"| {where} | {n} |")


if __name__ == "__main__":
    main()
