"""CPU time of building groups from sources held in memory: the build's own work (each source
window read into place, the pads zeroed, the layout applied), without the disk or the writer.

One thread; DeepSeek-V3 sizes (H 7168, I 2048) for 12 experts of a MoE layer under ck and
triton at TP 1 and 8, and the merged [q_a ; kv_a] linear, alternated, CPU seconds of this
process (``time.process_time``). Baseline: none inside one process; run it with ``--tree``
naming two checkouts in turn (before and after a change, alternated: this machine is noisy) and
compare the tables (no ratio column: the baseline is the other run).

Example:
    python scripts/bench.py build --tree /tmp/base --repeat 3; python scripts/bench.py build --repeat 3
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time

import torch

from .common.args import add_repeat
from .common.table import Table
from .common.timing import alternate

H, I, E = 7168, 2048, 12


def add_arguments(ap: argparse.ArgumentParser) -> None:
    add_repeat(ap, 3)
    ap.add_argument("--tree", type=pathlib.Path, help="the checkout of prep to measure (default: this one)")


def run(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    if args.tree:  # first on the path: its prep and layouts are the ones imported below
        sys.path.insert(0, str(args.tree.resolve()))
    import layouts
    import prep.groups as pg
    from prep.groups import LinearGroup, MoEGroup, Part

    gen = torch.Generator().manual_seed(0)
    src: dict[str, torch.Tensor] = {}

    def add(prefix: str, n: int, k: int) -> None:
        src[f"{prefix}.weight"] = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen)
        src[f"{prefix}.weight_scale"] = torch.randint(0, 256, (n, k // 32), dtype=torch.uint8, generator=gen)

    experts = tuple(f"x.{e}" for e in range(E))
    for e in experts:
        add(f"{e}.gate_proj", I, H)
        add(f"{e}.up_proj", I, H)
        add(f"{e}.down_proj", H, I)
    add("q", 1536, H)
    add("kv", 576, H)

    def read(name, rows=None, cols=None, out=None):  # what SourceCheckpoint.read does, from memory
        t = src[name][rows if rows is not None else slice(None)]
        if cols is not None and not (cols.start in (0, None) and cols.stop >= t.shape[-1]):
            t = t[:, cols]
        if out is None:
            return t.contiguous()
        out.copy_(t)
        return out

    groups = {f"moe {lay} tp{tp}": MoEGroup("x", 0, tp, experts, I, H, layouts.get_layout(lay))
              for lay in ("ck", "triton") for tp in (1, 8)}
    groups["linear qkv_a preshuffle"] = LinearGroup(
        "f", 0, 1, (Part("q", 1536, H, "none"), Part("kv", 576, H, "none")), layouts.get_layout("preshuffle"))

    def build(g) -> None:
        for _chunk in g.build_chunks(read, 64 << 20):
            pass

    runs = alternate({k: (lambda g=g: build(g)) for k, g in groups.items()}, args.repeat, clock=time.process_time)
    table = Table(None, title=f"prep from {pg.__file__}", stat="median")
    for name, seconds in runs.seconds.items():
        table.add(name, seconds)
    table.print()
