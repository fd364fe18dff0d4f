#!/usr/bin/env python
"""Manifest size and parse time of converted checkpoints, against the first one given.

    PYTHONPATH=. .venv/bin/python scripts/bench_manifest.py BASELINE OTHER... [--repeat 7]
    PYTHONPATH=. .venv/bin/python scripts/bench_manifest.py CONV --as-format-3 [--device cuda]

Each folder's ``prep-manifest.json`` is read by ``layouts.load_manifest`` (the strict parse every
loader runs first: what warm rank ready mostly is on a small checkpoint), alternating between the
folders, best of ``--repeat``, then warm rank ready of rank 0 (``load_rank`` with the manifest
read and checked, every page touched: ``bench_load.load_and_touch``; with ``--device cuda``,
``load_rank(..., "cuda")`` synchronised); times are printed as ratios against the baseline
measured in the same run, since this machine is shared.

``--as-format-3`` makes, for each format-4 folder given, a copy whose files are hard links and
whose manifest holds the source tensor table inside as formats 1-3 did (resealed), and measures it
first, as the baseline: what moving the table out of the manifest gained, on the same bytes."""

from __future__ import annotations

import argparse
import os
import pathlib
import shutil
import sys
import tempfile
import time

import layouts as L
from layouts.manifest import COMPLETE_NAME, MANIFEST_NAME, SOURCE_TABLE_NAME
from prep.testing import as_format_3

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from bench_load import load_and_touch  # noqa: E402  (one definition of "rank ready")


def format_3_copy(conv: pathlib.Path, dst: pathlib.Path) -> pathlib.Path:
    """``conv`` (format 4) at ``dst`` as version 3 wrote it: the table in the manifest, resealed
    (``prep.testing.as_format_3``); the rank files hard links, the three files it rewrites copies."""
    dst.mkdir()
    for p in conv.iterdir():
        if p.name in (MANIFEST_NAME, COMPLETE_NAME, SOURCE_TABLE_NAME):
            shutil.copyfile(p, dst / p.name)
        else:
            os.link(p, dst / p.name)
    as_format_3(dst)
    return dst


def ready_on(device: str):
    if device == "cpu":
        return lambda conv: load_and_touch(conv, 0)
    import torch

    def load(conv: pathlib.Path) -> None:
        tensors = L.load_rank(conv, 0, device)
        torch.cuda.synchronize()
        del tensors

    return load


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("convs", nargs="+", type=pathlib.Path, help="converted folders, the baseline first")
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--as-format-3", action="store_true",
                    help="measure each folder against a hard-linked copy with the source table inside (format 3)")
    ap.add_argument("--device", default="cpu", help="where rank 0 is loaded: cpu (every page touched) or cuda")
    args = ap.parse_args()
    work = None
    convs = args.convs
    if args.as_format_3:
        work = pathlib.Path(tempfile.mkdtemp(prefix=".format3-", dir=convs[0].parent))
        convs = [x for i, c in enumerate(args.convs) for x in (format_3_copy(c, work / f"{i}-{c.name}"), c)]
    try:
        measure(convs, args.repeat, ready_on(args.device), args.device)
    finally:
        if work is not None:
            shutil.rmtree(work)


def measure(convs: list[pathlib.Path], repeat: int, ready_fn, device: str) -> None:
    best = {c: float("inf") for c in convs}
    ready = dict(best)
    ready_fn(convs[0])  # a first load: the CUDA context, the page cache
    for _ in range(repeat):
        for c in convs:
            t0 = time.perf_counter()
            L.load_manifest(c)
            best[c] = min(best[c], time.perf_counter() - t0)
    for _ in range(repeat):
        for c in convs:
            t0 = time.perf_counter()
            ready_fn(c)
            ready[c] = min(ready[c], time.perf_counter() - t0)
    base = convs[0]
    for c in convs:
        m = L.load_manifest(c)
        size = (c / MANIFEST_NAME).stat().st_size
        print(f"{str(c):32s} format {m.format_version} tp {m.tp}: {size / 2**20:.2f} MiB "
              f"({size / (base / MANIFEST_NAME).stat().st_size:.2f}x), {len(m.groups)} groups, "
              f"load_manifest {best[c] * 1e3:.1f} ms ({best[c] / best[base]:.2f}x), "
              f"rank 0 ready warm ({device}) {ready[c] * 1e3:.1f} ms ({ready[c] / ready[base]:.2f}x)", flush=True)


if __name__ == "__main__":
    main()
