"""Experts shuffled from the source: read into memory first (what convert does) or straight from a
mapping of the shard (what it could do), in one run, alternated.

Baseline: ``pread + shuffle`` (what convert does). Takes the first ``--experts`` packed MXFP4 expert weights of SRC (in file order, page cache warm:
each shard is read once before) and preshuffles each into one output buffer (as convert's staging
memory takes them):

- ``pread + shuffle``: ``os.preadv`` of the tensor into a buffer, then ``preshuffle_weight`` from it;
- ``pread only``: the read alone;
- ``mapped + shuffle``: ``preshuffle_weight`` reading a view of the shard's read-only mapping,
  no copy first (each page faulted in on first touch).

Prints seconds per pass and GB/s of the tensors' bytes; the ratio of the first to the third is
what reading through a mapping would save on the main thread. It would cost: a shard shrinking
during a conversion kills the process with SIGBUS instead of the one-line "truncated" error,
and mapped pages count in the process's RSS until unmapped.

Example:
    python scripts/bench.py source-reads SRC --experts 4416 --repeat 3
"""

from __future__ import annotations

import argparse
import mmap
import os
import pathlib
import sys
import warnings

import torch

from layouts.shuffle import preshuffle_weight
from prep.source import SourceCheckpoint

from .common.args import add_repeat
from .common.table import Table
from .common.timing import alternate


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("src", type=pathlib.Path)
    ap.add_argument("--experts", type=int, default=1500, help="expert weights to shuffle per pass")
    add_repeat(ap, 3)


def run(args: argparse.Namespace) -> None:
    src = SourceCheckpoint.open(str(args.src))
    infos = sorted((i for n, i in src.tensors.items() if ".experts." in n and n.endswith("proj.weight")
                    and i.dtype == "U8" and len(i.shape) == 2 and i.shape[0] % 16 == 0 and i.shape[1] % 32 == 0),
                   key=lambda i: (i.file, i.offset))[:args.experts]
    if not infos:
        sys.exit(f"{args.src}: no packed MXFP4 expert weights")
    total = sum(i.nbytes for i in infos)
    fds = {f: os.open(args.src / f, os.O_RDONLY) for f in {i.file for i in infos}}
    for fd in fds.values():  # warm: the page cache holds what each pass reads
        while os.read(fd, 64 << 20):
            pass
    largest = max(i.nbytes for i in infos)
    buf = torch.empty(largest, dtype=torch.uint8)
    out = torch.empty(largest, dtype=torch.uint8)

    def pread_shuffle(shuffle: bool = True) -> None:
        for i in infos:
            b = buf[:i.nbytes]
            os.preadv(fds[i.file], [b.numpy()], i.offset)
            if shuffle:
                preshuffle_weight(b.view(i.shape), out=out[:i.nbytes].view(i.shape))

    def mapped_shuffle() -> None:
        maps = {f: mmap.mmap(fd, 0, prot=mmap.PROT_READ) for f, fd in fds.items()}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch: the buffer is read-only (it is only read)
            views = {f: torch.frombuffer(m, dtype=torch.uint8) for f, m in maps.items()}
        for i in infos:
            w = views[i.file][i.offset:i.offset + i.nbytes].view(i.shape)
            preshuffle_weight(w, out=out[:i.nbytes].view(i.shape))
        del views
        for m in maps.values():
            m.close()

    ways = {"pread + shuffle": pread_shuffle, "pread only": lambda: pread_shuffle(False),
            "mapped + shuffle": mapped_shuffle}
    runs = alternate(ways, args.repeat)
    table = Table("pread + shuffle", title=f"{len(infos)} expert weights, {total / 2**30:.2f} GiB, "
                                           f"torch threads {torch.get_num_threads()}, best of {args.repeat}")
    for name, seconds in runs.seconds.items():
        table.add(name, seconds, nbytes=total)
    table.print()
