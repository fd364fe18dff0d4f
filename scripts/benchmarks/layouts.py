"""Throughput of the layout primitives against a plain ``.clone()`` of the same bytes.

Baseline: ``.clone()`` of the same tensor, one per group of rows (weight, scale, weight + scale,
the 257-expert scale), interleaved with the primitives: each round runs every case once untimed
(warm caches) then 5 times timed. Shapes: a 7168 x 1024-byte packed weight (DeepSeek-V3 expert
down_proj, K = 2048), its 7168 x 64 E8M0 scale, and the flattened CK MoE scale of 257 experts'
w13 at TP 16 (131584 x 224: out of cache). GB/s counts the bytes read. Target: shuffle >= 0.5x
clone on the CPU.

Example:
    python scripts/bench.py layouts --threads 1
"""

from __future__ import annotations

import argparse

import torch

import layouts as L

from .common.args import add_repeat
from .common.table import Table
from .common.timing import alternate


def add_arguments(ap: argparse.ArgumentParser) -> None:
    add_repeat(ap, 20, "interleaved rounds of 5 timed calls each")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")


def run(args: argparse.Namespace) -> None:
    if args.threads:
        torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    big = torch.randint(0, 256, (257 * 512, 224), dtype=torch.uint8, generator=g)
    bigs = L.shuffle.preshuffle_scale(big)
    w = torch.randint(0, 256, (7168, 1024), dtype=torch.uint8, generator=g)
    s = torch.randint(0, 256, (7168, 64), dtype=torch.uint8, generator=g)
    ws, ss = L.shuffle.preshuffle_weight(w), L.shuffle.preshuffle_scale(s)
    pre = L.get_layout("preshuffle")
    cases = {  # case: (bytes read, {candidate: call}); the first candidate of each is its clone
        "weight 7168x1024": (w.numel(), {"clone": lambda: w.clone(), "preshuffle_weight": lambda: L.shuffle.preshuffle_weight(w),
                                         "unshuffle_weight": lambda: L.shuffle.unshuffle_weight(ws)}),
        "scale 7168x64": (s.numel(), {"clone": lambda: s.clone(), "preshuffle_scale": lambda: L.shuffle.preshuffle_scale(s),
                                      "unshuffle_scale": lambda: L.shuffle.unshuffle_scale(ss, 7168, 64)}),
        "weight+scale": (w.numel() + s.numel(), {"clone": lambda: (w.clone(), s.clone()),
                                                 "preshuffle layout": lambda: pre.apply(w, s)}),
        "257-expert scale": (big.numel(), {"clone": lambda: big.clone(),
                                           "preshuffle_scale": lambda: L.shuffle.preshuffle_scale(big),
                                           "unshuffle_scale": lambda: L.shuffle.unshuffle_scale(bigs, *big.shape)}),
    }
    flat = {(case, name): fn for case, (_, fns) in cases.items() for name, fn in fns.items()}
    runs = alternate(flat, args.repeat, burst=5, warm_each=True)
    table = Table("clone", title=f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
                                 f"{args.repeat} interleaved rounds of 5")
    for (case, name), seconds in runs.seconds.items():
        table.add(name, seconds, case=case, nbytes=cases[case][0])
    table.print()
