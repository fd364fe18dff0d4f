#!/usr/bin/env python
"""Manifest size and parse time of converted checkpoints, against the first one given.

    PYTHONPATH=. .venv/bin/python scripts/bench_manifest.py BASELINE OTHER... [--repeat 7]

Each folder's ``prep-manifest.json`` is read by ``layouts.load_manifest`` (the strict parse every
loader runs first: what warm rank ready mostly is on a small checkpoint), alternating between the
folders, best of ``--repeat``, then warm rank ready of rank 0 (``load_rank`` with the manifest
read and checked, every page touched: ``bench_load.load_and_touch``); times are printed as ratios
against the baseline measured in the same run, since this machine is shared."""

from __future__ import annotations

import argparse
import pathlib
import sys
import time

import layouts as L
from layouts.manifest import MANIFEST_NAME

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from bench_load import load_and_touch  # noqa: E402  (one definition of "rank ready")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("convs", nargs="+", type=pathlib.Path, help="converted folders, the baseline first")
    ap.add_argument("--repeat", type=int, default=7)
    args = ap.parse_args()
    best = {c: float("inf") for c in args.convs}
    ready = dict(best)
    for _ in range(args.repeat):
        for c in args.convs:
            t0 = time.perf_counter()
            L.load_manifest(c)
            best[c] = min(best[c], time.perf_counter() - t0)
    for _ in range(args.repeat):
        for c in args.convs:
            t0 = time.perf_counter()
            load_and_touch(c, 0)
            ready[c] = min(ready[c], time.perf_counter() - t0)
    base = args.convs[0]
    for c in args.convs:
        m = L.load_manifest(c)
        size = (c / MANIFEST_NAME).stat().st_size
        print(f"{str(c):32s} format {m.format_version} tp {m.tp}: {size / 2**20:.2f} MiB "
              f"({size / (base / MANIFEST_NAME).stat().st_size:.2f}x), {len(m.groups)} groups, "
              f"load_manifest {best[c] * 1e3:.1f} ms ({best[c] / best[base]:.2f}x), "
              f"rank 0 ready warm {ready[c] * 1e3:.1f} ms ({ready[c] / ready[base]:.2f}x)")


if __name__ == "__main__":
    main()
