#!/usr/bin/env python
"""Where the replicated tensors should live: copied into every rank's files, or one shared file.

    python3 scripts/bench_replicated.py WORK [--tp 8] [--rank-gib 2] [--replicated-share 0.052]
        [--repeat 3]

A rank-exact checkpoint gives each rank its own files; the tensors every rank holds whole
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
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import pathlib
import statistics
import time

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


def evict(paths) -> None:
    """Drop these files' pages from the page cache, so the next read comes from the disk (no
    root needed; scripts/bench_load.py uses it too)."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("work", type=pathlib.Path)
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--rank-gib", type=float, default=2.0, help="each rank's own bytes")
    ap.add_argument("--replicated-share", type=float, default=0.052,
                    help="replicated bytes as a share of a rank's own (R1-0528 at TP 8: 2.3 of 44 GB)")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
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
    cold: dict[str, list[float]] = {k: [] for k in layouts}
    warm: dict[str, list[float]] = {k: [] for k in layouts}
    for _ in range(args.repeat):
        for name, files in layouts.items():
            evict(every)
            cold[name].append(host_ready(files))
            warm[name].append(host_ready(files))
    base = "per-rank copies"
    print(f"{'layout':<18} {'cold best':>10} {'cold median':>12} {'warm best':>10}  ratio (cold best, to copies)")
    for name in layouts:
        print(f"{name:<18} {min(cold[name]):9.3f}s {statistics.median(cold[name]):11.3f}s {min(warm[name]):9.3f}s  "
              f"{min(cold[base]) / min(cold[name]):.3f}x")


if __name__ == "__main__":
    main()
