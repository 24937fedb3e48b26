#!/usr/bin/env python3
"""tensorboard_check.py: a run's TensorBoard event files (logging.tensorboard) against its metrics.jsonl,
read by TensorBoard's own reader (the tensorboard package, the venv of scripts/setup.sh).

Usage: tensorboard_check.py RUN_DIR [--resumed STEP]

Checks, printing one line per failure and exiting 1 on any:
  - every file in RUN_DIR/tensorboard/ is a chain of whole TFRecords whose length and data CRC-32C
    (masked) match, computed here bit by bit (independent of the writer's table and of TensorBoard's);
    its first event is file_version "brain.Event:2";
  - every file's second event is SessionLog START at the first step it writes (1, or STEP + 1);
  - TensorBoard's readers, EventAccumulator and plugin_event_accumulator (what `tensorboard
    --load_fast=false` serves), keeping every point, hold exactly the tags and (step, value) sequences
    that metrics.jsonl gives under docs/logs.md's tag table, each value the float32 rounding of the
    JSON number;
  - --resumed STEP: there are two files, the first holding steps after STEP (what the second's START
    must purge), and the readers show each step once, with the resumed run's values.
"""
import json
import pathlib
import struct
import sys

from tensorboard.backend.event_processing import event_accumulator, plugin_event_accumulator
from tensorboard.compat.proto import event_pb2
from tensorboard.util import tensor_util

# docs/logs.md, "TensorBoard": metrics.jsonl field -> tag.
TRAIN = ["loss", "lr", "grad_norm", "loss_scale", "step_ms", "tokens_per_s", "mfu"]
MEMORY = ["peak_allocated_bytes", "allocated_bytes", "activation_peak_bytes"]


def crc32c(data: bytes) -> int:
    crc = 0xFFFFFFFF
    for b in data:
        crc ^= b
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)
    return crc ^ 0xFFFFFFFF


def masked(data: bytes) -> int:
    c = crc32c(data)
    return (((c >> 15) | (c << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def records(path: pathlib.Path, errors: list):
    raw = path.read_bytes()
    pos, out = 0, []
    while pos < len(raw):
        if pos + 12 > len(raw):
            errors.append(f"{path.name}: {len(raw) - pos} trailing bytes at {pos}: a partial record header")
            break
        header = raw[pos:pos + 8]
        (length,) = struct.unpack("<Q", header)
        (hcrc,) = struct.unpack("<I", raw[pos + 8:pos + 12])
        if hcrc != masked(header):
            errors.append(f"{path.name}: length CRC mismatch at {pos}")
            break
        data = raw[pos + 12:pos + 12 + length]
        if len(data) < length or pos + 16 + length > len(raw):
            errors.append(f"{path.name}: record at {pos} cut short")
            break
        (dcrc,) = struct.unpack("<I", raw[pos + 12 + length:pos + 16 + length])
        if dcrc != masked(data):
            errors.append(f"{path.name}: data CRC mismatch at {pos}")
            break
        ev = event_pb2.Event()
        ev.ParseFromString(data)
        out.append(ev)
        pos += 16 + length
    return out


def f32(x: float) -> float:
    return struct.unpack("<f", struct.pack("<f", x))[0]


def expected(run_dir: pathlib.Path):
    want = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        if "event" in r:
            if r["event"] == "eval":
                want.setdefault("val/loss", []).append((r["step"], f32(r["val_loss"])))
            continue
        for f in TRAIN:
            if isinstance(r.get(f), (int, float)) and not isinstance(r.get(f), bool):
                want.setdefault(f"train/{f}", []).append((r["step"], f32(r[f])))
        for f in MEMORY:
            want.setdefault(f"memory/{f}", []).append((r["step"], f32(r[f])))
        if r.get("host_peak_bytes", 0) != 0:
            want.setdefault("memory/host_peak_bytes", []).append((r["step"], f32(r["host_peak_bytes"])))
    return want


def main() -> int:
    run_dir = pathlib.Path(sys.argv[1])
    resumed = int(sys.argv[sys.argv.index("--resumed") + 1]) if "--resumed" in sys.argv else None
    tb = run_dir / "tensorboard"
    errors = []
    files = sorted(p for p in tb.iterdir() if "tfevents" in p.name)
    per_file = []
    for p in files:
        evs = records(p, errors)
        per_file.append(evs)
        if not evs or evs[0].file_version != "brain.Event:2":
            errors.append(f"{p.name}: first event is not file_version brain.Event:2")
        first_step = resumed + 1 if resumed is not None and p == files[-1] else 1
        if len(evs) < 2 or not evs[1].HasField("session_log") or \
                evs[1].session_log.status != event_pb2.SessionLog.START or evs[1].step != first_step:
            errors.append(f"{p.name}: event 2 is not SessionLog START at step {first_step}: {evs[1:2]}")
    if resumed is None:
        if len(files) != 1:
            errors.append(f"{len(files)} event files, expected 1")
    else:
        if len(files) != 2:
            errors.append(f"{len(files)} event files, expected 2 (the first run's and the resumed run's)")
        else:
            if not any(e.step > resumed and e.HasField("summary") for e in per_file[0]):
                errors.append(f"{files[0].name}: no step after {resumed}: the purge was not exercised")

    want = expected(run_dir)
    # The legacy EventAccumulator and the one `tensorboard --load_fast=false` serves from (scalars as
    # tensors, after its compat layer); they treat START differently (the first one is no restart for
    # the second), so both are checked. Size guidance 0: keep every point.
    legacy = event_accumulator.EventAccumulator(str(tb), size_guidance={event_accumulator.SCALARS: 0})
    legacy.Reload()
    plugin = plugin_event_accumulator.EventAccumulator(str(tb), size_guidance={plugin_event_accumulator.TENSORS: 0})
    plugin.Reload()
    readers = {
        "EventAccumulator": (set(legacy.Tags()["scalars"]), lambda tag: [(s.step, s.value) for s in legacy.Scalars(tag)]),
        "plugin_event_accumulator": (set(plugin.Tags()["tensors"]), lambda tag: [
            (t.step, float(tensor_util.make_ndarray(t.tensor_proto).item())) for t in plugin.Tensors(tag)]),
    }
    for reader, (listed, points) in readers.items():
        # A tag whose every point a restart purged stays listed with no points (e.g. host_peak_bytes,
        # nonzero only while an asynchronous save's snapshot lived in the steps the resume replays).
        got_tags = {tag for tag in listed if points(tag)}
        if got_tags != set(want):
            errors.append(f"{reader}: tags {sorted(got_tags)}, expected {sorted(want)}")
        for tag in sorted(set(want) & got_tags):
            got = points(tag)
            if got != want[tag]:
                errors.append(f"{reader}: {tag}: TensorBoard has {got}, metrics.jsonl gives {want[tag]}")
    for e in errors:
        print("FAIL:", e)
    n = sum(len(v) for v in want.values())
    print(f"{len(files)} event file(s), {len(want)} tags, {n} points checked in 2 readers, {len(errors)} failures")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
