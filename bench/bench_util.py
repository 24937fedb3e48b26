"""bench_util.py: helpers the benchmarks share (imported; not a script)."""
import os
import platform
import re
import sys


def venv_python():
    """The project venv's Python (scripts/setup.sh), else this interpreter."""
    home = os.environ.get("SUBLINEAR_HOME", os.path.expanduser("~/.cache/sublinear"))
    p = os.path.join(home, "venv", "bin", "python")
    return p if os.access(p, os.X_OK) else sys.executable


def slug(text):
    """A file-name part from a CPU model or a placement name: lower case, runs of other characters as '-'."""
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "unknown-cpu"


def cpu_model():
    """/proc/cpuinfo's model name (the figures say which CPU they come from)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown-cpu"
