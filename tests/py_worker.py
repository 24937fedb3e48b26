#!/usr/bin/env python3
"""py_worker.py: runs the tests' Python references (tests/*.py) one request at a time in one interpreter,
so that a test process imports torch and transformers once (~4 s and ~9 s of CPU a start on a 2-core
AMD EPYC) instead of once a call (tests/test_util.h, test::python).

Protocol, one JSON object a line: a request on stdin, {"argv": [SCRIPT, ARG...]}; its reply on the
worker's original stdout, {"code": EXIT STATUS, "output": what the script printed, stdout and stderr
together}. Each request runs SCRIPT as __main__ (runpy) with its own sys.argv, as a fresh interpreter
would run it; torch's global switches a script may leave changed (grad mode, default dtype) are put back
before the next. File descriptor 1 is pointed at 2 first, so that nothing a library writes below Python
(C++ warnings) can land in the replies. Ends at the end of stdin (the test process exiting)."""
import contextlib
import io
import json
import os
import runpy
import sys
import traceback


def exit_code(e):
    if e.code is None:
        return 0
    if isinstance(e.code, int):
        return e.code
    print(e.code, file=sys.stderr)  # sys.exit("message"): printed, status 1, as the interpreter does
    return 1


def run(argv):
    out = io.StringIO()
    sys.argv = list(argv)
    sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))  # as `python SCRIPT` puts its folder first
    code = 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            runpy.run_path(argv[0], run_name="__main__")
        except SystemExit as e:
            code = exit_code(e)
        except BaseException:  # noqa: BLE001 -- the traceback is the reply, as an interpreter would print it
            traceback.print_exc()
            code = 1
    if "torch" in sys.modules:
        torch = sys.modules["torch"]
        torch.set_grad_enabled(True)
        torch.set_default_dtype(torch.float32)
    return {"code": code, "output": out.getvalue()}


def main():
    replies = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.__stdout__ = io.TextIOWrapper(os.fdopen(1, "wb", closefd=False), write_through=True)
    for line in sys.stdin:
        if line.strip():
            replies.write(json.dumps(run(json.loads(line)["argv"])) + "\n")
            replies.flush()


if __name__ == "__main__":
    main()
