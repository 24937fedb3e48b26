#!/usr/bin/env python3
"""test_check_docs.py: scripts/check_docs.py passes a good tree and fails each kind of bad one
(ctest entry `docs_check`; plain python3 and unittest, no torch).

A small repository is written to a temporary folder: a README with a short front, a feature list,
known limits, a Results table and the exit-code table; docs/measured.md; src/errors.h; a
bench/results file and a script. It passes. Each case then breaks one rule (a 13th Results row, a
201-character cell, a 251-character docs/measured.md row, a 6-line front, a 21-line feature list, no
known limits, a narrative line in a page, a result file, a script's comment and docstring, a missing
or an extra exit code, a second exit-code table) and asserts the check exits 1 naming the file, the
line and the rule. Runs in under a second. Usage: python3 tests/test_check_docs.py [-v]
"""
import pathlib
import subprocess
import sys
import tempfile
import unittest

sys.dont_write_bytecode = True
ROOT = pathlib.Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "check_docs.py"

ERRORS_H = """#pragma once
namespace sl {
enum ExitCode : int {
  kExitOk = 0,
  kExitConfig = 2,  // usage or recipe error
  kExitNonFinite = 6,
  kExitSigint = 130,
  kExitSigterm = 143,
};
}  // namespace sl
"""

FRONT = "A tool that trains models.\nIt runs on CPUs and GPUs.\n"
FEATURES = "".join(f"- feature {k} ([doc](docs/measured.md))\n" for k in range(1, 6))
RESULTS = "| what | figure | command |\n|---|---|---|\n" + "".join(
    f"| figure {k} | {k} ms on AMD EPYC, 2026-11-26, abc1234 | `cmd {k}` |\n" for k in range(1, 4))
EXIT_TABLE = ("| code | meaning |\n|---|---|\n| 0 | success |\n| 2 | recipe error |\n"
              "| 6 | non-finite loss, or a loss spike under `on_spike: stop` |\n| 130 / 143 | SIGINT / SIGTERM |\n")
MEASURED = "# Measured\n\n## AMD EPYC\n\n| what | figure | date, commit | command |\n|---|---|---|---|\n" \
           "| tiny step | 200 ms | 2026-11-26, abc1234 | `trainer` |\n"
SCRIPT_PY = '"""tool.py: does one thing."""\n# a comment about the arithmetic\nx = 1\n'


def readme(front=FRONT, features=FEATURES, limits="- NCCL at world > 1 has not run\n",
           results=RESULTS, exit_table=EXIT_TABLE):
    parts = [f"# tool\n\n{front}\n", f"## Features\n\n{features}\n"]
    if limits is not None:
        parts.append(f"## Known limits\n\n{limits}\n")
    parts.append(f"## Results\n\n{results}\n## Exit codes\n\n{exit_table}\n")
    return "".join(parts)


def write_tree(root: pathlib.Path, files: dict):
    base = {"README.md": readme(), "docs/measured.md": MEASURED, "src/errors.h": ERRORS_H,
            "bench/results/run.md": "Tiny recipe, 200 ms/step on AMD EPYC (2026-11-26, abc1234).\n",
            "bench/results/plot.png": b"\x89PNG\r\n\x1a\n\0\0 session",
            "scripts/tool.py": SCRIPT_PY}
    base.update(files)
    for rel, content in base.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content)


class CheckDocs(unittest.TestCase):
    def run_check(self, **files):
        """Writes the good tree with `files` replaced, returns (rc, output). A key names a path with
        '__' for each '/' and for the last '.': docs__measured__md is docs/measured.md."""
        paths = {"/".join(k.split("__")[:-1]) + "." + k.split("__")[-1]: v for k, v in files.items()}
        with tempfile.TemporaryDirectory() as tmp:
            write_tree(pathlib.Path(tmp), paths)
            p = subprocess.run([sys.executable, str(SCRIPT), tmp], capture_output=True, text=True)
            return p.returncode, p.stdout + p.stderr

    def assert_fails(self, expected, **files):
        rc, out = self.run_check(**files)
        self.assertEqual(rc, 1, out)
        for text in expected:
            self.assertIn(text, out)

    def test_good_tree_passes(self):
        rc, out = self.run_check()
        self.assertEqual(rc, 0, out)

    def test_results_rows(self):
        rows = "| what | figure | command |\n|---|---|---|\n" + "".join(f"| f{k} | {k} | c |\n" for k in range(13))
        self.assert_fails(["README.md:", "results-rows: 13 rows (limit 12)"], README__md=readme(results=rows))
        twelve = "| what | figure | command |\n|---|---|---|\n" + "".join(f"| f{k} | {k} | c |\n" for k in range(12))
        self.assertEqual(self.run_check(README__md=readme(results=twelve))[0], 0)

    def test_results_cell(self):
        cell = "x" * 201
        rows = f"| what | figure | command |\n|---|---|---|\n| a | {cell} | c |\n"
        text = readme(results=rows)
        line = text.splitlines().index(f"| a | {cell} | c |") + 1
        self.assert_fails([f"README.md:{line}: results-cell: column 2 has 201 characters (limit 200)"],
                          README__md=text)
        ok = f"| what | figure | command |\n|---|---|---|\n| a | {'x' * 200} | c |\n"
        self.assertEqual(self.run_check(README__md=readme(results=ok))[0], 0)

    def test_no_results_table(self):
        self.assert_fails(["results-rows: no table"], README__md=readme(results="Figures: see docs.\n"))

    def test_measured_row(self):
        row = "| tiny | " + "y" * 236 + " | c |"  # 9 + 236 + 6 = 251 characters
        self.assertEqual(len(row), 251)
        self.assert_fails(["docs/measured.md:8: measured-row: 251 characters (limit 250)"],
                          docs__measured__md=MEASURED + row + "\n")
        self.assertEqual(self.run_check(docs__measured__md=MEASURED + row.replace("y", "", 1) + "\n")[0], 0)

    def test_front(self):
        self.assert_fails(["README.md:3: front: what it is takes 6 lines (limit 5"],
                          README__md=readme(front="line\n" * 6))
        self.assert_fails(["front: what it is takes 6 lines"],  # one 601-character line counts as 6
                          README__md=readme(front="z" * 601 + "\n"))

    def test_features(self):
        self.assert_fails(["features: the list takes 21 lines (limit 20"],
                          README__md=readme(features="- f\n" * 21))
        self.assert_fails(["features: no \"## Features\" section with a list"],
                          README__md=readme(features="Many features.\n"))

    def test_known_limits(self):
        self.assert_fails(["limits: no \"## Known limits\" section with a list"], README__md=readme(limits=None))

    def test_narrative_in_page(self):
        text = MEASURED + "\nMeasured in the sixth session, lent to us by a friend.\n"
        self.assert_fails(["docs/measured.md:9: narrative: \"sixth session\""], docs__measured__md=text)
        self.assert_fails(["docs/other.md:1: narrative: \"work period\""],
                          docs__other__md="The figure of the second work period.\n")
        self.assert_fails(["README.md:", "narrative: \"lent to three\""],
                          README__md=readme(front="A tool.\nAn H100 lent to three helpers ran it.\n"))
        self.assert_fails(["narrative: \"re-measured\""], docs__other__md="The figure was re-measured.\n")

    def test_narrative_in_results_and_scripts(self):
        self.assert_fails(["bench/results/run.md:1: narrative: \"This session\""],
                          bench__results__run__md="This session's run: 200 ms/step.\n")
        self.assert_fails(["scripts/tool.py:2: narrative: \"earlier session\""],
                          scripts__tool__py='"""tool."""\n# as measured in an earlier session\n')
        self.assert_fails(["bench/tool.py:3: narrative: \"three sessions\""],
                          bench__tool__py='"""tool.py: one line.\n\nfaster over three sessions.\n"""\n')

    def test_narrative_not_in_code(self):
        # Inline code is a name, not prose; a script's string that is not a docstring is not prose.
        rc, out = self.run_check(docs__other__md="The loop owns the `Session` of a run.\n",
                                 scripts__tool__py='"""tool."""\nNAME = "session"\n')
        self.assertEqual(rc, 0, out)

    def test_exit_code_missing(self):
        table = EXIT_TABLE.replace("| 6 | non-finite loss, or a loss spike under `on_spike: stop` |\n", "")
        self.assert_fails(["README.md:", "exit-codes: missing [6]"], README__md=readme(exit_table=table))

    def test_exit_code_extra_and_pair(self):
        self.assert_fails(["exit-codes: [9] documented but not in src/errors.h"],
                          README__md=readme(exit_table=EXIT_TABLE + "| 9 | other |\n"))
        table = EXIT_TABLE.replace("| 130 / 143 |", "| 130 |")
        self.assert_fails(["exit-codes: missing [143]"], README__md=readme(exit_table=table))

    def test_exit_code_table_with_more_columns(self):
        table = EXIT_TABLE.replace("| code | meaning |\n|---|---|", "| code | name | meaning |\n|---|---|---|")
        self.assertEqual(self.run_check(README__md=readme(exit_table=table))[0], 0)
        self.assert_fails(["exit-codes: missing [6]"],
                          README__md=readme(exit_table=table.replace("| 6 |", "| 6x |").replace("6x", "x")))

    def test_no_exit_code_table(self):
        self.assert_fails(["exit-codes: no table with the columns"],
                          README__md=readme(exit_table="See the logs page.\n"))

    def test_exit_code_two_places(self):
        self.assert_fails(["exit-codes: 2 tables", "limit 1: one place"],
                          docs__logs__md="# Logs\n\n" + EXIT_TABLE)

    def test_exit_code_enum_changes(self):
        header = ERRORS_H.replace("  kExitSigint = 130,", "  kExitIo = 7,\n  kExitSigint = 130,")
        self.assert_fails(["exit-codes: missing [7]"], src__errors__h=header)


if __name__ == "__main__":
    unittest.main()
