#!/usr/bin/env python3
"""Throughput of the layout primitives against a plain `.clone()` of the same bytes, same run.

    python scripts/bench_layouts.py [--repeat 20] [--threads N]

Shapes: a 7168 x 1024-byte packed weight (DeepSeek-V3 expert down_proj, K = 2048) and its
7168 x 64 E8M0 scale. Prints GB/s (bytes read) and the ratio to clone; the machine is noisy,
so only the ratio is meaningful across runs. Target: shuffle >= 0.5x clone on the CPU.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import layouts as L


def time_interleaved(cases, repeat: int, burst: int = 5) -> list[list[float]]:
    """Run the cases round-robin, in short bursts, so drift on a noisy machine hits all alike
    while each case still runs with warm caches (the first call of a burst is not timed)."""
    times = [[] for _ in cases]
    for _ in range(repeat):
        for i, (_, _, fn) in enumerate(cases):
            fn()
            for _ in range(burst):
                t0 = time.perf_counter()
                fn()
                times[i].append(time.perf_counter() - t0)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    g = torch.Generator().manual_seed(0)
    # The flattened CK MoE scale of 257 experts' w13 at TP16 (I padded to 256): out of cache.
    big = torch.randint(0, 256, (257 * 512, 224), dtype=torch.uint8, generator=g)
    bigs = L.preshuffle_scale(big)
    w = torch.randint(0, 256, (7168, 1024), dtype=torch.uint8, generator=g)
    s = torch.randint(0, 256, (7168, 64), dtype=torch.uint8, generator=g)
    ws, ss = L.preshuffle_weight(w), L.preshuffle_scale(s)
    pre = L.get_layout("preshuffle")
    cases = [
        ("weight clone (baseline)", w.numel(), lambda: w.clone()),
        ("preshuffle_weight", w.numel(), lambda: L.preshuffle_weight(w)),
        ("unshuffle_weight", w.numel(), lambda: L.unshuffle_weight(ws)),
        ("scale clone (baseline)", s.numel(), lambda: s.clone()),
        ("preshuffle_scale", s.numel(), lambda: L.preshuffle_scale(s)),
        ("unshuffle_scale", s.numel(), lambda: L.unshuffle_scale(ss, 7168, 64)),
        ("weight+scale clone (baseline)", w.numel() + s.numel(), lambda: (w.clone(), s.clone())),
        ("preshuffle layout (weight+scale)", w.numel() + s.numel(), lambda: pre.apply(w, s)),
        ("257-expert scale clone (baseline)", big.numel(), lambda: big.clone()),
        ("preshuffle_scale 257 experts", big.numel(), lambda: L.preshuffle_scale(big)),
        ("unshuffle_scale 257 experts", big.numel(), lambda: L.unshuffle_scale(bigs, *big.shape)),
    ]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.repeat} interleaved rounds of 5")
    print(f"{'case':36s} {'GB/s':>8s} {'median GB/s':>12s} {'x clone':>8s}")
    base = None
    for (name, nbytes, _), t in zip(cases, time_interleaved(cases, args.repeat)):
        gbs = nbytes / min(t) / 1e9
        if "baseline" in name:
            base = gbs
        print(f"{name:36s} {gbs:8.2f} {nbytes / statistics.median(t) / 1e9:12.2f} {gbs / base:8.2f}")


if __name__ == "__main__":
    main()
