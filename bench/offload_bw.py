#!/usr/bin/env python3
"""offload_bw.py: this GPU's host <-> device copy rates and how much of a copy a GEMM hides.

The planner and mode budget price offload's copies with two recipe keys (src/config/config.h,
OffloadConfig: their defaults; configs/7b_24gb.yaml sets both in its offload section):
  offload.bandwidth_gbps  the copy rate per direction, GB/s (1e9 bytes/s of payload)
  offload.overlap         the share of a streamed copy hidden behind compute, in [0, 1]
This measures both as the trainer copies (src/device/host.cpp: page-locked host blocks, non-blocking
copies on a side stream, the compute on the current stream) with the image's torch:
  - pinned H2D and D2H of --mib MiB (and pageable, for comparison): the median of --repeats copies,
    each timed by CUDA events on the copy's stream;
  - overlap: a bf16 GEMM chain on the current stream sized to about twice one H2D (and one D2H), run
    alone (t_c), the copy alone (t_x), then both, the copy on a side stream (t_both):
        hidden = (t_c + t_x - t_both) / t_x, clipped to [0, 1]
    (the share of the copy's time the GEMMs absorbed, the planner's meaning of overlap); each a median
    of --repeats, wall time of the whole (both streams) by events on the current stream after the side
    stream joined it.
It prints the values to write into offload.bandwidth_gbps (the slower direction, pinned) and
offload.overlap (the smaller of the two directions' hidden shares), and with --out writes them as JSON
(bench/gpu.sh passes them to the 7B plan and run). Without a CUDA device it exits 77 (skipped).
"""
import argparse
import json
import statistics
import sys


def timed(torch, stream, fn):
    """fn() queued on `stream`, its time in ms by two events on that stream."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(stream):
        start.record(stream)
        fn()
        end.record(stream)
    end.synchronize()
    return start.elapsed_time(end)


def median_ms(torch, stream, fn, repeats):
    timed(torch, stream, fn)  # warm-up
    return statistics.median(timed(torch, stream, fn) for _ in range(repeats))


def copy_rates(torch, nbytes, repeats):
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    side = torch.cuda.Stream()
    out = {}
    for pinned in (True, False):
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
        kind = "pinned" if pinned else "pageable"
        h2d = median_ms(torch, side, lambda: dev.copy_(host, non_blocking=pinned), repeats)
        d2h = median_ms(torch, side, lambda: host.copy_(dev, non_blocking=pinned), repeats)
        out[kind] = {"h2d_gbps": nbytes / h2d / 1e6, "d2h_gbps": nbytes / d2h / 1e6, "h2d_ms": h2d, "d2h_ms": d2h}
    return out


def hidden_share(torch, nbytes, repeats, to_device):
    """The share of one pinned copy's time a GEMM chain on the current stream hides."""
    main, side = torch.cuda.current_stream(), torch.cuda.Stream()
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    copy = (lambda: dev.copy_(host, non_blocking=True)) if to_device else (lambda: host.copy_(dev, non_blocking=True))
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    t_x = median_ms(torch, side, copy, repeats)
    t_gemm = median_ms(torch, main, lambda: torch.mm(a, b), repeats)
    n_gemm = max(1, round(2.0 * t_x / t_gemm))

    def gemms():
        for _ in range(n_gemm):
            torch.mm(a, b)

    t_c = median_ms(torch, main, gemms, repeats)

    def both():
        ready = torch.cuda.Event()
        ready.record(main)
        side.wait_event(ready)  # the copy starts with the GEMMs, as the trainer's side stream does
        with torch.cuda.stream(side):
            copy()
        gemms()
        main.wait_stream(side)  # the end event on the current stream sees both finished

    t_both = median_ms(torch, main, both, repeats)
    hidden = min(1.0, max(0.0, (t_c + t_x - t_both) / t_x))
    return {"copy_ms": t_x, "gemms": n_gemm, "gemm_ms": t_c, "both_ms": t_both, "hidden": hidden}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=256, help="bytes per copy, MiB (default 256)")
    ap.add_argument("--repeats", type=int, default=10, help="timed repeats per figure (default 10)")
    ap.add_argument("--out", help="write the figures as JSON here")
    args = ap.parse_args()
    if args.mib < 1 or args.repeats < 1:
        print("offload_bw.py: --mib and --repeats must be at least 1", file=sys.stderr)
        return 2
    import torch

    if not torch.cuda.is_available():
        print("offload_bw.py: no CUDA device here (skipped)")
        return 77
    nbytes = args.mib << 20
    rates = copy_rates(torch, nbytes, args.repeats)
    h2d = hidden_share(torch, nbytes, args.repeats, to_device=True)
    d2h = hidden_share(torch, nbytes, args.repeats, to_device=False)
    result = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "bytes": nbytes,
        "rates": rates,
        "overlap_h2d": h2d,
        "overlap_d2h": d2h,
        "bandwidth_gbps": min(rates["pinned"]["h2d_gbps"], rates["pinned"]["d2h_gbps"]),
        "overlap": min(h2d["hidden"], d2h["hidden"]),
    }
    for kind, r in rates.items():
        print(f"{kind:8s} H2D {r['h2d_gbps']:7.1f} GB/s   D2H {r['d2h_gbps']:7.1f} GB/s   ({args.mib} MiB)")
    for name, o in (("H2D", h2d), ("D2H", d2h)):
        print(f"{name} beside {o['gemms']} bf16 GEMMs 4096^3: copy {o['copy_ms']:.2f} ms, GEMMs {o['gemm_ms']:.2f} ms, "
              f"both {o['both_ms']:.2f} ms: {100 * o['hidden']:.0f} % of the copy hidden")
    print("write back (src/config/config.h OffloadConfig defaults; configs/7b_24gb.yaml's offload section):")
    print(f"  offload.bandwidth_gbps: {result['bandwidth_gbps']:.1f}")
    print(f"  offload.overlap: {result['overlap']:.2f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
