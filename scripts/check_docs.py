#!/usr/bin/env python3
"""check_docs.py: the user-facing documentation stays short, factual and true (ctest entry `docs`).

Rules (each failure prints FILE:LINE: rule: what, and the limit):
1. results-rows / results-cell: README.md's "Results" section holds a table of at most 12 rows, no
   cell over 200 characters (raw Markdown, links included).
2. measured-row: no table row in docs/measured.md is over 250 characters.
3. front / features / limits: README.md's text between its title and its first "##" heading (what the
   project is) is at most 5 lines; its "Features" section's list at most 20 lines; a "Known limits"
   section with a list exists. A line is counted as ceil(characters / 120), so one long line cannot
   stand in for many.
4. narrative: no line of README.md, docs/*.md, the text files of bench/results/, or the comments and
   docstrings of bench/*.py and scripts/*.py matches a NARRATIVE pattern below (the history of the
   work belongs in git log; a figure names its machine, date, commit and command). Inline code is
   ignored, so code names such as `Session` are not prose.
5. exit-codes: exactly one table in README.md and docs/*.md has a header whose first column is "code"
   and one of whose columns is "meaning"; the codes in its first column ("130 / 143" is two codes)
   are exactly the values of src/errors.h's enum ExitCode.

Usage: scripts/check_docs.py [ROOT]   (ROOT: the repository, default: this script's parent's parent)
Exits 1 when any rule is broken, printing each failure and a count.
"""
import ast
import io
import math
import pathlib
import re
import sys
import tokenize

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from check_links import prose_lines  # noqa: E402  (the fenced-block walk both checks share)

RESULTS_MAX_ROWS = 12
RESULTS_MAX_CELL = 200
MEASURED_MAX_ROW = 250
FRONT_MAX_LINES = 5
FEATURES_MAX_LINES = 20
WRAP = 120  # characters per counted line in rule 3

_ORDINALS = ("first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|this|next|earlier|later|"
             "previous|last|the|a|one|two|three")
NARRATIVE = [
    (re.compile(r"\b(%s) sessions?\b" % _ORDINALS, re.I), "names a session of the work"),
    (re.compile(r"\bsessions?\b", re.I), "names a session of the work"),
    (re.compile(r"\blent to [a-z]+", re.I), "says who was lent a machine"),
    (re.compile(r"\b(a|the) lent\b", re.I), "says a machine was lent"),
    (re.compile(r"\bwork periods?\b", re.I), "names a work period"),
    (re.compile(r"\b(before|after) (the|this|that) (change|fix|rewrite)s?\b", re.I),
     "tells the history of a change"),
    (re.compile(r"\bre-?measured\b", re.I), "tells a figure's history (keep only the latest)"),
    (re.compile(r"\b(earlier|previous|later) sessions?|\bearlier we\b|\bwe (now|then) \b", re.I),
     "tells the history of the work"),
]

INLINE_CODE = re.compile(r"`[^`]*`")
ENUM = re.compile(r"enum\s+ExitCode\b[^{]*\{(.*?)\};", re.S)
ENUM_VALUE = re.compile(r"\b(kExit\w+)\s*=\s*(\d+)")


def split_row(line: str):
    """Cells of a Markdown table row; a '|' inside inline code or escaped as '\\|' is not a border."""
    cells, cur, in_code, i = [], "", False, 0
    body = line.strip()
    if body.startswith("|"):
        body = body[1:]
    if body.endswith("|") and not body.endswith("\\|"):
        body = body[:-1]
    while i < len(body):
        c = body[i]
        if c == "\\" and i + 1 < len(body) and body[i + 1] == "|":
            cur += "\\|"
            i += 2
            continue
        if c == "`":
            in_code = not in_code
        if c == "|" and not in_code:
            cells.append(cur.strip())
            cur = ""
        else:
            cur += c
        i += 1
    cells.append(cur.strip())
    return cells


def is_separator(line: str) -> bool:
    return bool(re.fullmatch(r"\s*\|?\s*:?-{3,}:?\s*(\|\s*:?-{3,}:?\s*)*\|?\s*", line))


def tables(lines):
    """Each table as (header line number, header cells, [(line number, cells), ...]) over (n, line) pairs."""
    out, i = [], 0
    while i < len(lines):
        n, line = lines[i]
        if line.lstrip().startswith("|") and i + 1 < len(lines) and is_separator(lines[i + 1][1]):
            rows, j = [], i + 2
            while j < len(lines) and lines[j][1].lstrip().startswith("|"):
                rows.append((lines[j][0], split_row(lines[j][1])))
                j += 1
            out.append((n, split_row(line), rows))
            i = j
        else:
            i += 1
    return out


def outside_fences(text: str):
    """(line number, line) of a Markdown text outside fenced code blocks, inline code kept."""
    return prose_lines(text, keep_code=True)


def sections(text: str):
    """{heading text: [(line number, line), ...]} of the "##" sections (down to the next "##" or "#")."""
    out, current = {}, None
    for n, line in outside_fences(text):
        m = re.match(r"^(#{1,2})\s+(.*?)\s*$", line)
        if m:
            current = m.group(2).strip() if len(m.group(1)) == 2 else None
            if current is not None:
                out[current] = []
            continue
        if current is not None:
            out[current].append((n, line))
    return out


def counted_lines(lines) -> int:
    return sum(max(1, math.ceil(len(line) / WRAP)) for _, line in lines)


def check_results(root, readme_text):
    found = []
    body = sections(readme_text).get("Results")
    if body is None:
        return ["README.md:1: results-rows: no \"## Results\" section"]
    found_tables = tables(body)
    if not found_tables:
        return [f"README.md:{body[0][0] if body else 1}: results-rows: no table in \"## Results\""]
    header_n, _, rows = found_tables[0]
    if len(rows) > RESULTS_MAX_ROWS:
        found.append(f"README.md:{header_n}: results-rows: {len(rows)} rows (limit {RESULTS_MAX_ROWS})")
    for n, cells in rows:
        for k, cell in enumerate(cells, 1):
            if len(cell) > RESULTS_MAX_CELL:
                found.append(f"README.md:{n}: results-cell: column {k} has {len(cell)} characters "
                             f"(limit {RESULTS_MAX_CELL})")
    return found


def check_measured(root):
    page = root / "docs" / "measured.md"
    if not page.exists():
        return ["docs/measured.md:1: measured-row: no such file"]
    found, text = [], page.read_text()
    lines = text.splitlines()
    for _, _, rows in tables(list(outside_fences(text))):
        for n, _ in rows:
            length = len(lines[n - 1].strip())
            if length > MEASURED_MAX_ROW:
                found.append(f"docs/measured.md:{n}: measured-row: {length} characters "
                             f"(limit {MEASURED_MAX_ROW})")
    return found


def check_front(readme_text):
    found, front = [], []
    for n, line in outside_fences(readme_text):
        if re.match(r"^##\s", line):
            break
        if line.strip() and not re.match(r"^#\s", line):
            front.append((n, line))
    if counted_lines(front) > FRONT_MAX_LINES:
        found.append(f"README.md:{front[0][0]}: front: what it is takes {counted_lines(front)} lines "
                     f"(limit {FRONT_MAX_LINES}; a line counts per {WRAP} characters)")
    secs = sections(readme_text)
    for name, limit in (("Features", FEATURES_MAX_LINES), ("Known limits", None)):
        body = secs.get(name)
        items = [(n, line) for n, line in (body or []) if re.match(r"^\s*([-*+]|\d+\.)\s", line)]
        if not items:
            found.append(f"README.md:1: {name.lower().split()[-1]}: no \"## {name}\" section with a list")
            continue
        listed = [(n, line) for n, line in body if line.strip() and n >= items[0][0]]
        if limit is not None and counted_lines(listed) > limit:
            found.append(f"README.md:{items[0][0]}: features: the list takes {counted_lines(listed)} lines "
                         f"(limit {limit}; a line counts per {WRAP} characters)")
    return found


def python_prose(path: pathlib.Path):
    """(line number, text) of each comment and docstring line of a Python file."""
    source = path.read_text()
    out = []
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            out.append((tok.start[0], tok.string))
    try:
        tree = ast.parse(source)
    except SyntaxError as e:
        return out + [(e.lineno or 1, "")]
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                    and isinstance(body[0].value.value, str):
                first = body[0].value.lineno
                for k, text in enumerate(body[0].value.value.splitlines()):
                    out.append((first + k, text))
    return sorted(out)


def text_lines(path: pathlib.Path):
    """(line number, line) of a text file; nothing for a binary one."""
    data = path.read_bytes()
    if b"\0" in data:
        return []
    try:
        return list(enumerate(data.decode("utf-8").splitlines(), 1))
    except UnicodeDecodeError:
        return []


def narrative_sources(root: pathlib.Path):
    """(path, [(line number, text)]) of every file rule 4 reads."""
    for page in [root / "README.md"] + sorted((root / "docs").glob("*.md")):
        if page.exists():
            yield page, text_lines(page)
    results = root / "bench" / "results"
    if results.is_dir():
        for f in sorted(p for p in results.rglob("*") if p.is_file()):
            yield f, text_lines(f)
    for folder in ("bench", "scripts"):
        for f in sorted((root / folder).glob("*.py")):
            yield f, python_prose(f)


def check_narrative(root):
    found = []
    for path, lines in narrative_sources(root):
        for n, line in lines:
            prose = INLINE_CODE.sub("", line)
            for pattern, what in NARRATIVE:
                m = pattern.search(prose)
                if m:
                    found.append(f"{path.relative_to(root)}:{n}: narrative: \"{m.group(0)}\" {what} "
                                 "(allowed: none; state what is true, a figure with its machine, date, commit and command)")
                    break
    return found


def enum_codes(root):
    header = root / "src" / "errors.h"
    m = ENUM.search(header.read_text()) if header.exists() else None
    if not m:
        return None
    return {int(v) for _, v in ENUM_VALUE.findall(m.group(1))}


def documented_codes(root):
    """[(file, line, {codes})] for each exit-code table (first column "code", a column "meaning") in
    README.md and docs/*.md."""
    out = []
    for page in [root / "README.md"] + sorted((root / "docs").glob("*.md")):
        if not page.exists():
            continue
        for n, header, rows in tables(list(outside_fences(page.read_text()))):
            if not header or header[0].lower() != "code" or "meaning" not in [c.lower() for c in header]:
                continue
            codes = set()
            for _, cells in rows:
                codes |= {int(c) for c in re.findall(r"\d+", cells[0])}
            out.append((page.relative_to(root), n, codes))
    return out


def check_exit_codes(root):
    enum = enum_codes(root)
    if not enum:
        return ["src/errors.h:1: exit-codes: no enum ExitCode with values found"]
    documented = documented_codes(root)
    if not documented:
        return ["README.md:1: exit-codes: no table with the columns \"code\" and \"meaning\" in README.md or docs/*.md"]
    found = []
    if len(documented) > 1:
        where = ", ".join(f"{f}:{n}" for f, n, _ in documented)
        found.append(f"{documented[0][0]}:{documented[0][1]}: exit-codes: {len(documented)} tables "
                     f"({where}; limit 1: one place)")
    for f, n, codes in documented:
        missing, extra = sorted(enum - codes), sorted(codes - enum)
        if missing:
            found.append(f"{f}:{n}: exit-codes: missing {missing}, defined in src/errors.h's enum ExitCode")
        if extra:
            found.append(f"{f}:{n}: exit-codes: {extra} documented but not in src/errors.h's enum ExitCode")
    return found


def main() -> int:
    root = pathlib.Path(sys.argv[1]) if len(sys.argv) > 1 else pathlib.Path(__file__).resolve().parent.parent
    readme = root / "README.md"
    readme_text = readme.read_text() if readme.exists() else ""
    found = (check_results(root, readme_text) + check_measured(root) + check_front(readme_text)
             + check_narrative(root) + check_exit_codes(root))
    for f in found:
        print(f)
    if found:
        print(f"docs: {len(found)} failures")
        return 1
    print("docs: README, docs/measured.md, the narrative patterns and the exit codes all pass")
    return 0


if __name__ == "__main__":
    sys.exit(main())
