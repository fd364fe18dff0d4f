#!/usr/bin/env python3
"""CPU time of building groups from sources held in memory: the build's own work (each source
window read into place, the pads zeroed, the layout applied), without the disk or the writer.

    PYTHONPATH=TREE python scripts/bench_build.py [--repeat 3]

One thread; DeepSeek-V3 sizes (H 7168, I 2048) for 12 experts of a MoE layer under ck and
triton at TP 1 and 8, and the merged [q_a ; kv_a] linear. Run it with PYTHONPATH naming two
trees in turn (before and after a change, alternated: this machine is noisy) and compare.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

H, I, E = 7168, 2048, 12


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)

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

    cases: dict[str, object] = {f"moe {lay} tp{tp}": MoEGroup("x", 0, tp, experts, I, H, layouts.get_layout(lay))
                                for lay in ("ck", "triton") for tp in (1, 8)}
    cases["linear qkv_a preshuffle"] = LinearGroup(
        "f", 0, 1, (Part("q", 1536, H, "none"), Part("kv", 576, H, "none")), layouts.get_layout("preshuffle"))
    times: dict[str, list[float]] = {k: [] for k in cases}
    for _ in range(args.repeat):
        for k, g in cases.items():
            t0 = time.process_time()
            for _chunk in g.build_chunks(read, 64 << 20):
                pass
            times[k].append(time.process_time() - t0)
    print(f"prep from {pg.__file__}")
    for k, v in times.items():
        print(f"{k:26s} median {statistics.median(v) * 1000:7.1f} ms  min {min(v) * 1000:7.1f} ms")


if __name__ == "__main__":
    main()
