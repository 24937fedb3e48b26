#!/usr/bin/env python3
"""check_links.py: every relative link in README.md and docs/*.md resolves (ctest entry `links`).

A link [text](target) that is not http(s) or mailto must name a file that exists, relative to the
page; a #anchor must match a heading of the target page under GitHub's slug rules (lowercase; only
letters, digits, spaces, hyphens and underscores kept; spaces to hyphens; repeats get -1, -2, ...).
Links inside fenced code blocks and inline code are not links.

Usage: scripts/check_links.py [ROOT]   (ROOT: the repository, default: this script's parent's parent)
Prints each broken link as FILE:LINE: target (reason); exits 1 when any is broken.
"""
import pathlib
import re
import sys

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


def prose_lines(text: str, keep_code: bool = False):
    """(line number, line) outside fenced code blocks; inline code removed unless keep_code."""
    fenced = False
    for n, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if not fenced:
            yield n, line if keep_code else re.sub(r"`[^`]*`", "", line)


def slug(heading: str) -> str:
    s = heading.strip().lower()
    s = re.sub(r"[^\w\- ]", "", s)
    return s.replace(" ", "-")


def anchors(page: pathlib.Path):
    seen, out = {}, set()
    for _, line in prose_lines(page.read_text(), keep_code=True):
        m = HEADING.match(line)
        if not m:
            continue
        base = slug(m.group(2))
        k = seen.get(base, 0)
        out.add(base if k == 0 else f"{base}-{k}")
        seen[base] = k + 1
    return out


def broken_links(root: pathlib.Path):
    pages = [root / "README.md"] + sorted((root / "docs").glob("*.md"))
    found, checked = [], 0
    for page in pages:
        for n, line in prose_lines(page.read_text()):
            for target in LINK.findall(line):
                if re.match(r"^(https?:|mailto:)", target):
                    continue
                checked += 1
                path, _, anchor = target.partition("#")
                dest = (page.parent / path).resolve() if path else page
                where = f"{page.relative_to(root)}:{n}: {target}"
                if not dest.exists():
                    found.append(f"{where} (no such file)")
                elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                    found.append(f"{where} (no heading with this anchor in {dest.name})")
    return found, checked


def main() -> int:
    root = pathlib.Path(sys.argv[1]) if len(sys.argv) > 1 else pathlib.Path(__file__).resolve().parent.parent
    found, checked = broken_links(root)
    for f in found:
        print(f)
    if found:
        print(f"links: {len(found)} of {checked} broken")
        return 1
    print(f"links: {checked} checked, all resolve")
    return 0


if __name__ == "__main__":
    sys.exit(main())
