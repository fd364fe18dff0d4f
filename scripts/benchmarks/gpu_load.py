"""One rank of a converted checkpoint to the GPU, against the bandwidths that bound it, in one run.

Baselines: the pinned host-to-device copy (RAM-backed), ``dd iflag=direct`` of the same files
(disk, cold), eight ``dd`` at once (eight ranks).

1. Pinned host-to-device copy bandwidth (1 GiB, best of --repeat): the ceiling of any loader.
2. RAM-backed: the rank's files copied to ``--shm`` (tmpfs), so storage is out of the way; then,
   alternating, best of --repeat: ``load_rank(..., "cuda")`` (layouts.device_load: reads into
   pinned staging blocks overlapped with the copies), the same with ``direct=True``, the previous
   way (each file mapped, copied through two pinned blocks: ``loader.to_device``), and
   fastsafetensors (``fastsafe_open(..., nogds=True)``) on the same files. ``--sweep`` times the
   staged reader's block size and reader count too.
3. Disk, cold (files evicted with ``posix_fadvise(DONTNEED)`` before each load): ``dd
   iflag=direct bs=16M`` of the same files, then ``load_rank`` with ``direct=True`` and without,
   and fastsafetensors.
4. ``--eight CONV8`` (a conversion at TP 8): eight processes each loading one rank at once, cold,
   against eight ``dd iflag=direct`` at once over the same files. ``--eight-cpu`` adds the same
   loads into host memory; ``--no-gpu`` runs only those (on a machine without a GPU:
   ``--no-gpu --eight CONV8``).

Each figure is GB/s of the rank's bytes (its files' sizes) and its ratio to the row it is
compared with. Everything is checked: the loaded tensors' bytes equal a CPU load of the same rank.

Example:
    python3 scripts/bench.py gpu-load --converted CONV --eight CONV8 --readers 4 16 --repeat 2
    python3 scripts/bench.py gpu-load --no-gpu --eight CONV8 --repeat 2
"""

from __future__ import annotations

import argparse
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time

import torch

import layouts as L
from layouts import device_load
from layouts.loader import to_device
from layouts.safetensors_file import SafetensorsFile, map_all

from .common import page_cache
from .common.args import add_repeat
from .common.table import Table
from .common.timing import Timed, alternate
from .common.trees import REPO


def evict(files) -> None:
    """The files out of the page cache: posix_fadvise, and as root the whole cache dropped too."""
    page_cache.evict(files)
    page_cache.drop_all()


def rank_files(conv: pathlib.Path, rank: int) -> list[pathlib.Path]:
    m = L.load_manifest(conv)
    return [conv / f for f in m.rank_files(rank)]


def pinned_h2d(repeat: int) -> float:
    n = 1 << 30
    src = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    src.fill_(1)
    dst = torch.empty(n, dtype=torch.uint8, device="cuda")
    best = 1e9
    for _ in range(repeat + 1):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return n / best / 1e9


def load_staged(conv: pathlib.Path, rank: int, direct: bool) -> list[torch.Tensor]:
    r = L.load_rank(conv, rank, "cuda", direct=direct)
    torch.cuda.synchronize()
    return r.buffers


def load_mapped(files: list[pathlib.Path]) -> list[torch.Tensor]:
    """The loader before device_load: each file mapped and copied through two pinned blocks."""
    out = []
    for p in files:
        buf, _ = map_all(SafetensorsFile(p))
        out.append(to_device(buf, torch.device("cuda")))
    torch.cuda.synchronize()
    return out


def load_registered(files: list[pathlib.Path]) -> list[torch.Tensor]:
    """No CPU copy at all: each (page-cached) file mapped, the mapping registered with CUDA
    (``cudaHostRegister``, read-only) and copied by the DMA engine straight from the page cache."""
    import mmap
    import warnings

    cudart = torch.cuda.cudart()
    out = []
    for p in files:
        sf = SafetensorsFile(p)
        size = os.fstat(sf.fd).st_size
        m = mmap.mmap(sf.fd, size, prot=mmap.PROT_READ, flags=mmap.MAP_SHARED)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a read-only buffer: only the DMA engine reads it
            host = torch.frombuffer(m, dtype=torch.uint8)
        err = cudart.cudaHostRegister(host.data_ptr(), size, 8)  # cudaHostRegisterReadOnly
        if int(err) != 0:
            raise RuntimeError(f"cudaHostRegister: {err}")
        try:
            dst = torch.empty(sf.data_size, dtype=torch.uint8, device="cuda")
            dst.copy_(host[sf.data_offset:], non_blocking=True)
            torch.cuda.synchronize()
        finally:
            cudart.cudaHostUnregister(host.data_ptr())
        out.append(dst)
    return out


def host_copy(threads: int, repeat: int, nbytes: int = 4 << 30) -> float:
    """GB/s of a plain memory-to-memory copy (pinned to pinned, ``threads`` threads each a slice):
    what any loader that copies the page cache into staging with the CPU can reach at most."""
    import concurrent.futures as cf

    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).fill_(1)
    dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).fill_(0)
    step = -(-nbytes // threads)
    best = 1e9
    with cf.ThreadPoolExecutor(threads) as pool:
        for _ in range(repeat + 1):
            t0 = time.perf_counter()
            list(pool.map(lambda i: dst[i:i + step].copy_(src[i:i + step]), range(0, nbytes, step)))
            best = min(best, time.perf_counter() - t0)
    return nbytes / best / 1e9


def load_blocks(files: list[pathlib.Path], readers: int, block: int, direct: bool) -> list[torch.Tensor]:
    out = []
    for p in files:
        buf, _ = device_load.read_to_device(SafetensorsFile(p), torch.device("cuda"), direct=direct, readers=readers,
                                            block=block)
        out.append(buf)
    torch.cuda.synchronize()
    return out


def load_fst(files: list[pathlib.Path]) -> int:
    from fastsafetensors import fastsafe_open

    n = 0
    with fastsafe_open([str(p) for p in files], framework="pt", device="cuda:0", nogds=True) as f:
        for k in f.keys():
            n += f.get_tensor(k).numel()
    torch.cuda.synchronize()
    return n


def settle(_name: str = "") -> None:
    """Before each load: the last one's blocks back to the device, its copies finished."""
    torch.cuda.empty_cache()
    torch.cuda.synchronize()


def check_bytes(conv: pathlib.Path, rank: int, gpu: list[torch.Tensor]) -> None:
    cpu = L.load_rank(conv, rank, mmap=False)
    assert len(cpu.buffers) == len(gpu)
    for a, b in zip(cpu.buffers, gpu):
        assert torch.equal(a, b.cpu()), "GPU load differs from the CPU load"


def dd(files: list[pathlib.Path]) -> None:
    for p in files:
        subprocess.run(["dd", f"if={p}", "of=/dev/null", "bs=16M", "iflag=direct"], check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def ram_backed(conv: pathlib.Path, rank: int, repeat: int, shm: pathlib.Path, sweep: bool, fst: bool, h2d: float,
               readers_sweep=()):
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="prep-gpu-load-", dir=shm))
    try:
        dst = tmp / "conv"
        dst.mkdir()
        m = L.load_manifest(conv)
        names = set(m.rank_files(rank)) | {L.manifest.MANIFEST_NAME, L.manifest.COMPLETE_NAME}
        for n in names:
            shutil.copy(conv / n, dst / n)
        files = rank_files(dst, rank)
        nbytes = sum(p.stat().st_size for p in files)
        print(f"RAM-backed ({shm}): rank {rank}, {len(files)} files, {nbytes / 2**30:.2f} GiB; best of {repeat}, "
              "alternating", flush=True)
        check_bytes(dst, rank, load_staged(dst, rank, False))
        ways = {"load_rank (staged, through the page cache)": lambda: load_staged(dst, rank, False),
                "load_rank direct=True": lambda: load_staged(dst, rank, True),
                "before: mapped + 2 pinned blocks": lambda: load_mapped(files),
                "mapped + cudaHostRegister (no CPU copy)": lambda: load_registered(files)}
        if fst:
            ways["fastsafetensors nogds"] = lambda: load_fst(files)
        for readers in readers_sweep:
            ways[f"staged readers {readers} block 16 MiB"] = lambda r=readers: load_blocks(files, r, 16 << 20, False)
        if sweep:
            for readers in (1, 2, 4, 8, 16, 32):
                for block in (4 << 20, 16 << 20, 64 << 20):
                    ways[f"staged readers {readers} block {block >> 20} MiB"] = (
                        lambda r=readers, b=block: load_blocks(files, r, b, False))
        runs = alternate(ways, repeat, warmup=1, before=settle, drop_failed=True)
        table = Table("pinned H2D", title=f"  pinned host-to-device copy: {h2d:.2f} GB/s (its time for these bytes "
                                          "is the baseline)")
        table.add("pinned H2D", nbytes / (h2d * 1e9), nbytes=nbytes)
        for k, v in runs.seconds.items():
            if v:
                table.add(k, v, nbytes=nbytes)
        table.print()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def disk_cold(conv: pathlib.Path, rank: int, repeat: int, fst: bool, readers_sweep=()) -> None:
    files = rank_files(conv, rank)
    nbytes = sum(p.stat().st_size for p in files)
    print(f"disk, cold (evicted before each): rank {rank}, {nbytes / 2**30:.2f} GiB; best of {repeat}", flush=True)
    ways = {"dd iflag=direct bs=16M": lambda: dd(files),
            "load_rank direct=True": lambda: load_staged(conv, rank, True),
            "load_rank (staged, page cache)": lambda: load_staged(conv, rank, False),
            "before: mapped + 2 pinned blocks": lambda: load_mapped(files)}
    if fst:
        ways["fastsafetensors nogds"] = lambda: load_fst(files)
    for r in readers_sweep:
        ways[f"staged direct, readers {r}"] = lambda r=r: load_blocks(files, r, 16 << 20, True)
    runs = alternate(ways, repeat, before=lambda _: (evict(files), settle()), drop_failed=True)
    table = Table("dd iflag=direct bs=16M")
    for k, v in runs.seconds.items():
        if v:
            table.add(k, v, nbytes=nbytes)
    table.print()


CHILD = """
import sys, time, pathlib, torch
sys.path.insert(0, {repo!r})
import layouts as L
cuda = {cuda!r}
if cuda:
    torch.cuda.init(); torch.empty(1, device="cuda")
conv, rank = pathlib.Path({conv!r}), int(sys.argv[1])
print("ready", flush=True); sys.stdin.readline()
t0 = time.perf_counter()
if cuda:
    r = L.load_rank(conv, rank, "cuda", direct=True); torch.cuda.synchronize()
else:
    r = L.load_rank(conv, rank, mmap=False, direct=True)
print(time.perf_counter() - t0, flush=True)
"""


def eight(conv: pathlib.Path, repeat: int, readers=(None,), cpu: bool = False) -> None:
    m = L.load_manifest(conv)
    per_rank = [rank_files(conv, r) for r in range(m.tp)]
    allfiles = sorted({p for fs in per_rank for p in fs})
    nbytes = sum(sum(p.stat().st_size for p in fs) for fs in per_rank)
    print(f"{m.tp} ranks at once, cold: {nbytes / 2**30:.2f} GiB read in all (common files once per rank); "
          f"best of {repeat}", flush=True)

    def dd_all() -> None:
        procs = [subprocess.Popen(["sh", "-c", " ; ".join(f"dd if={p} of=/dev/null bs=16M iflag=direct 2>/dev/null"
                                                            for p in fs)]) for fs in per_rank]
        for p in procs:
            p.wait()

    def load_all(readers_each) -> Timed:
        """Every rank's load_rank at once, each in a process of its own, timed from the moment all
        are started and ready (their imports and CUDA contexts left out) to the last one done."""
        code = CHILD.format(repo=str(REPO), conv=str(conv), cuda=readers_each != "cpu")
        env = dict(os.environ, **({"PREP_LOAD_READERS": str(readers_each)}
                                  if readers_each not in (None, "cpu") else {}))
        procs = [subprocess.Popen([sys.executable, "-c", code, str(r)], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True, env=env) for r in range(m.tp)]
        for p in procs:
            assert p.stdout.readline().strip() == "ready"
        t0 = time.perf_counter()
        for p in procs:
            p.stdin.write("go\n")
            p.stdin.flush()
        for p in procs:
            p.stdout.readline()
            p.wait()
        return Timed(time.perf_counter() - t0)

    ways = {f"{m.tp} x dd iflag=direct": dd_all}
    # cpu: the same reads into host memory: what eight processes sharing one GPU cost
    for readers_each in [*readers, *(["cpu"] if cpu else [])]:
        what = "to host memory (no GPU)" if readers_each == "cpu" else f"readers {readers_each or 'default'}"
        ways[f"{m.tp} x load_rank direct=True, {what}"] = lambda r=readers_each: load_all(r)
    runs = alternate(ways, repeat, before=lambda _: evict(allfiles))
    table = Table(f"{m.tp} x dd iflag=direct")
    for k, v in runs.seconds.items():
        table.add(k, v, nbytes=nbytes)
    table.print()


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--converted", type=pathlib.Path, help="a conversion whose --rank is loaded (not with --no-gpu)")
    ap.add_argument("--rank", type=int, default=0)
    add_repeat(ap, 3)
    ap.add_argument("--shm", type=pathlib.Path, default=pathlib.Path("/dev/shm"))
    ap.add_argument("--eight", type=pathlib.Path, help="a TP 8 conversion: its eight ranks loaded at once, cold")
    ap.add_argument("--eight-cpu", action="store_true",
                    help="with --eight: also the eight loads into host memory (is the GPU shared by 8 the limit?)")
    ap.add_argument("--sweep", action="store_true", help="the staged reader's block size and reader count")
    ap.add_argument("--fastsafetensors", action="store_true", help="fastsafetensors on the same files")
    ap.add_argument("--no-disk", action="store_true")
    ap.add_argument("--readers", type=int, nargs="*", default=[],
                    help="also time these reader counts: RAM-backed and cold, one rank, and eight ranks at once "
                         "(PREP_LOAD_READERS)")
    ap.add_argument("--no-gpu", action="store_true",
                    help="only the eight loads into host memory against eight dd's (with --eight; no GPU needed)")


def run(args: argparse.Namespace) -> None:
    if args.no_gpu:
        if not args.eight:
            raise SystemExit("--no-gpu times the eight ranks' loads into host memory: give --eight CONV8")
        eight(args.eight, args.repeat, (), cpu=True)
        return
    if not args.converted:
        raise SystemExit("--converted is required (unless --no-gpu)")
    h2d = pinned_h2d(args.repeat)
    torch.set_num_threads(1)  # each copy one thread: the threads below are the parallelism
    for t in (1, 4, 8, 16):
        print(f"host memory copy, {t} threads: {host_copy(t, args.repeat):.2f} GB/s "
              f"(pinned host-to-device {h2d:.2f} GB/s)", flush=True)
    torch.set_num_threads(os.cpu_count() or 1)
    ram_backed(args.converted, args.rank, args.repeat, args.shm, args.sweep, args.fastsafetensors, h2d,
               args.readers)
    if not args.no_disk:
        disk_cold(args.converted, args.rank, args.repeat, args.fastsafetensors, args.readers)
    if args.eight:
        eight(args.eight, args.repeat, [None, *args.readers], cpu=args.eight_cpu)
