"""Where the replicated tensors should live: copied into every rank's files, or one shared file.

Baseline: per-rank copies (what prep writes). A rank-exact checkpoint gives each rank its own files; the tensors every rank holds whole
(norms, routers, R1-0528's BF16 ``fused_qkv_a_proj``, the MTP ``eh_proj``: ~2.3 GB at R1's dims,
5.2% of a TP 8 rank's ~44 GB) can be copied into each rank's files (what prep writes) or written
once into a file all ranks read. This times the two I/O patterns themselves, with no prep code:
``--tp`` processes start together, each reads its own file of ``--rank-gib`` and then the
replicated bytes (its own copy, or the shared file) in 16 MiB preads, and the host is ready when
the last one is done. Each trial starts cold: every file's pages are dropped from the page cache
first (``posix_fadvise(DONTNEED)``, checked by timing a warm trial too). The two layouts alternate;
times are printed with their ratio to the per-rank copies measured in the same run. Standard
library only, so it runs where prep is not installed. WORK needs (tp + 1) x replicated + tp x rank
bytes of disk.

Example:
    python3 scripts/bench.py replicated /tmp/rep --tp 8 --rank-gib 2 --repeat 3
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import pathlib
import time

from .common.args import add_repeat
from .common.page_cache import evict
from .common.table import Table
from .common.timing import Timed, alternate

BLOCK = 16 << 20
GiB = 1 << 30


def write_file(path: pathlib.Path, size: int) -> None:
    """``size`` bytes that are not zeros (a sparse or compressible file would not be read from disk)."""
    if path.is_file() and path.stat().st_size == size:
        return
    chunk = os.urandom(BLOCK)
    with open(path, "wb") as f:
        left = size
        while left:
            n = min(left, BLOCK)
            f.write(chunk[:n])
            left -= n
        f.flush()
        os.fsync(f.fileno())


def read_all(paths: list[str], start: mp.Event, done: mp.Queue) -> None:
    buf = bytearray(BLOCK)
    view = memoryview(buf)
    start.wait()
    t0 = time.perf_counter()
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            offset = 0
            while n := os.preadv(fd, [view], offset):
                offset += n
        finally:
            os.close(fd)
    done.put(time.perf_counter() - t0)


def host_ready(files_per_rank: list[list[pathlib.Path]]) -> float:
    """Seconds until every rank has read its files, all ranks started together."""
    start, done = mp.Event(), mp.Queue()
    procs = [mp.Process(target=read_all, args=([str(p) for p in files], start, done)) for files in files_per_rank]
    for p in procs:
        p.start()
    time.sleep(0.2)  # all started and waiting
    start.set()
    times = [done.get() for _ in procs]
    for p in procs:
        p.join()
    return max(times)


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("work", type=pathlib.Path)
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--rank-gib", type=float, default=2.0, help="each rank's own bytes")
    ap.add_argument("--replicated-share", type=float, default=0.052,
                    help="replicated bytes as a share of a rank's own (R1-0528 at TP 8: 2.3 of 44 GB)")
    add_repeat(ap, 3)


def run(args: argparse.Namespace) -> None:
    args.work.mkdir(parents=True, exist_ok=True)
    own_size = int(args.rank_gib * GiB)
    rep_size = int(own_size * args.replicated_share)
    own = [args.work / f"rank{r}.bin" for r in range(args.tp)]
    copies = [args.work / f"replicated-rank{r}.bin" for r in range(args.tp)]
    shared = args.work / "replicated-shared.bin"
    for p in own:
        write_file(p, own_size)
    for p in [*copies, shared]:
        write_file(p, rep_size)
    layouts = {"per-rank copies": [[own[r], copies[r]] for r in range(args.tp)],
               "one shared file": [[own[r], shared] for r in range(args.tp)]}
    every = [*own, *copies, shared]
    print(f"tp {args.tp}: {own_size / GiB:.2f} GiB per rank + {rep_size / GiB:.3f} GiB replicated "
          f"({args.replicated_share:.1%}); bytes from disk, cold: copies {args.tp * (own_size + rep_size) / GiB:.2f} "
          f"GiB, shared {(args.tp * own_size + rep_size) / GiB:.2f} GiB")

    def cold_then_warm(files) -> Timed:
        """A cold trial (every file evicted first), then the same warm: the check that the
        eviction took (a warm trial as slow as the cold one would say it did not)."""
        evict(every)
        return Timed(host_ready(files), {"warm": host_ready(files)})

    runs = alternate({name: (lambda f=files: cold_then_warm(f)) for name, files in layouts.items()}, args.repeat)
    table = Table("per-rank copies", title="host ready: every rank's files read, cold")
    for name in layouts:
        table.add(name, runs.seconds[name], warm_best=f"{min(i['warm'] for i in runs.info[name]):.3f} s")
    table.print()
