#!/usr/bin/env python3
"""test_fine_tuning.py: docs/fine-tuning.md's walk-through, command by command, as a user runs it.

Reads the first ```sh block of docs/fine-tuning.md and runs it with bash in a scratch directory that
holds links to the checkout's build/ (SUBLINEAR_TRAINER's folder), configs/, scripts/ and data/, with the
block's PY= line pointing at this interpreter (the venv). Asserts: bash exits 0 (set -e: every command
did); the run's held-out loss fell between its two evaluations (steps 20 and 40); the exported adapter
directory holds adapter_config.json (naming runs/chat-base) and adapter_model.safetensors; trainer
sample printed generated text. A doc whose block goes missing fails here.
"""
import json
import os
import re
import subprocess
import sys
import tempfile
import unittest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def walkthrough():
    with open(os.path.join(ROOT, "docs", "fine-tuning.md"), encoding="utf-8") as f:
        text = f.read()
    m = re.search(r"```sh\n(.*?)```", text, re.S)
    if not m:
        raise AssertionError("docs/fine-tuning.md has no ```sh block")
    return m.group(1)


class FineTuningWalkthrough(unittest.TestCase):
    def test_every_command_runs(self):
        trainer = os.environ.get("SUBLINEAR_TRAINER") or os.path.join(ROOT, "build", "trainer")
        self.assertTrue(os.path.isfile(trainer), f"no trainer binary at {trainer} (set SUBLINEAR_TRAINER)")
        script = walkthrough()
        self.assertIn("PY=", script)
        script = re.sub(r"^PY=.*$", f"PY={sys.executable}", script, count=1, flags=re.M)
        with tempfile.TemporaryDirectory(prefix="sublinear-fine-tuning-") as d:
            os.symlink(os.path.dirname(os.path.abspath(trainer)), os.path.join(d, "build"))
            for name in ("configs", "scripts", "data"):
                os.symlink(os.path.join(ROOT, name), os.path.join(d, name))
            env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
            r = subprocess.run(["bash", "-e", "-c", script], cwd=d, env=env, capture_output=True, text=True,
                               timeout=600)
            self.assertEqual(r.returncode, 0, r.stdout[-4000:] + r.stderr[-4000:])
            evals = []
            with open(os.path.join(d, "runs", "chat-lora", "metrics.jsonl")) as f:
                for line in f:
                    rec = json.loads(line)
                    if rec.get("event") == "eval":
                        evals.append(rec["val_loss"])
            self.assertGreaterEqual(len(evals), 2, "expected evaluations at steps 20 and 40")
            self.assertLess(evals[-1], evals[0])
            adapter = os.path.join(d, "runs", "chat-adapter")
            with open(os.path.join(adapter, "adapter_config.json")) as f:
                config = json.load(f)
            self.assertEqual(config["base_model_name_or_path"], "runs/chat-base")
            self.assertEqual(config["peft_type"], "LORA")
            self.assertTrue(os.path.isfile(os.path.join(adapter, "adapter_model.safetensors")))
            self.assertIn("sample:", r.stdout + r.stderr)


if __name__ == "__main__":
    unittest.main()
