"""Manifest size and parse time of converted checkpoints, against the first one given.

Baseline: the first folder (with --as-format-3, each folder's format-3 copy). Each folder's
``prep-manifest.json`` is read by ``layouts.load_manifest`` (the strict parse every loader runs
first: what warm rank ready mostly is on a small checkpoint), alternating between the folders,
best of ``--repeat``; then warm rank ready of rank 0 (``load_rank`` with the manifest read and
checked, every page touched; with ``--device cuda``, ``load_rank(..., "cuda")`` synchronised),
alternating the same way.

``--as-format-3`` makes, for each format-4 folder given, a copy whose files are hard links and
whose manifest holds the source tensor table inside as formats 1-3 did (resealed), and measures it
first, as the baseline: what moving the table out of the manifest gained, on the same bytes.

Example:
    python scripts/bench.py manifest BEFORE AFTER --repeat 7
    python scripts/bench.py manifest CONV --as-format-3 --device cuda --repeat 5
"""

from __future__ import annotations

import argparse
import os
import pathlib
import shutil
import tempfile

import layouts as L
from layouts.manifest import COMPLETE_NAME, MANIFEST_NAME, SOURCE_TABLE_NAME
from prep.testing import as_format_3

from .common.args import add_repeat
from .common.rank_ready import load_and_touch
from .common.table import Table
from .common.timing import alternate


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("convs", nargs="+", type=pathlib.Path, help="converted folders, the baseline first")
    add_repeat(ap, 7)
    ap.add_argument("--as-format-3", action="store_true",
                    help="measure each folder against a hard-linked copy with the source table inside (format 3)")
    ap.add_argument("--device", default="cpu", help="where rank 0 is loaded: cpu (every page touched) or cuda")


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


def run(args: argparse.Namespace) -> None:
    work = None
    folders = {str(c): c for c in args.convs}
    if args.as_format_3:
        work = pathlib.Path(tempfile.mkdtemp(prefix=".format3-", dir=args.convs[0].parent))
        folders = {name: path for i, c in enumerate(args.convs)
                   for name, path in ((f"{c} as format 3", format_3_copy(c, work / f"{i}-{c.name}")), (str(c), c))}
    try:
        measure(folders, args.repeat, ready_on(args.device), args.device)
    finally:
        if work is not None:
            shutil.rmtree(work)


def measure(names: dict[str, pathlib.Path], repeat: int, ready_fn, device: str) -> None:
    """``names``: label -> converted folder, the baseline first."""
    first = next(iter(names.values()))
    ready_fn(first)  # a first load: the CUDA context, the page cache
    parse = alternate({n: (lambda c=c: L.load_manifest(c)) for n, c in names.items()}, repeat)
    ready = alternate({n: (lambda c=c: ready_fn(c)) for n, c in names.items()}, repeat)
    base_size = (first / MANIFEST_NAME).stat().st_size
    table = Table(next(iter(names)), title=f"load_manifest, then rank 0 ready warm ({device}); best of {repeat}")
    for n, c in names.items():
        m = L.load_manifest(c)
        size = (c / MANIFEST_NAME).stat().st_size
        what = f"format {m.format_version} tp {m.tp}: {size / 2**20:.2f} MiB ({size / base_size:.2f}x), {len(m.groups)} groups"
        table.add(n, parse.seconds[n], case="load_manifest", manifest=what)
    for n in names:
        table.add(n, ready.seconds[n], case="rank 0 ready")
    table.print()
