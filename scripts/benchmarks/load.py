"""Time to "rank ready": loading one rank from the Quark source the way engines do today, against
``layouts.load_rank`` of the converted checkpoint, in the same run.

Baseline: the source path. source path (what ATOM/vLLM do at start-up): open every shard with safetensors' ``safe_open``,
read each of the rank's tensors by name (a TP slice of it with ``get_slice``), copy the experts
one by one into the stacked w13/w2 and the merged [q_a;kv_a] / [gate;up] tensors, then shuffle
every MXFP4 weight and scale into the kernels' layout (prep's own shuffles, the same arithmetic
as aiter's); the BF16 tensors are read too.
converted path: ``layouts.load_rank`` (each file mapped once, tensors are views of it, runtime
attributes set from the manifest; on the CPU every page is then touched so the bytes are really
in memory; ``--pread`` reads each file into new memory instead, ``--direct`` with O_DIRECT).

Both run with the files in the page cache (each path runs once untimed first), alternating, and
the best of ``--repeat`` is reported, with tensor counts and the ratio (target: >= 2x). Without
``--converted`` the source is converted first (preshuffle + ck, ``--tp``) into a temporary folder.

Bytes per rank (``--tp 4 8`` converts at each TP in the same run; ``--ep`` adds expert parallel):
for every rank, the bytes ``load_rank`` reads (the rank's own files, and the common files every
rank reads whole), against the bytes ATOM keeps of them (the rank's MXFP4 tensors, plus the
slice ATOM's weight loader keeps of each BF16 tensor, from ``tests/atom_sharding.py``, the
test-side statement of ATOM's rules) and against 1/TP of the checkpoint; then the time to rank
ready of ``--rank`` for each layout, page cache warm, and with ``--cold`` also after evicting the
checkpoint's files from the page cache (``posix_fadvise(DONTNEED)``; no root needed).
For an R1-0528-shaped checkpoint: ``make_tiny_deepseek.py OUT --preset bench-r1``.
A checkpoint with DeepSeek-like tensor counts: ``scripts/make_tiny_deepseek.py OUT --layers 30
--experts 256 --hidden 512 --random-bytes`` (45,843 tensors, 1.7 GB). ``--rank-exact``: the
same bytes and rank-ready times for a rank-exact conversion against ``--common-bf16`` (the
baseline there), alternated.

Example:
    python scripts/bench.py load --src SRC --tp 4 8 --repeat 3 --cold
"""

from __future__ import annotations

import argparse
import math
import pathlib
import shutil
import tempfile
import time

import torch
from safetensors import safe_open

import layouts as L
from layouts.engines import get_engine
from prep.convert import convert
from prep.deepseek import classify, plan_groups, target_for
from prep.safetensors_writer import nbytes
from prep.source import SourceCheckpoint

from .common.args import add_repeat
from .common.page_cache import evict
from .common.rank_ready import load_and_touch
from .common.table import Table
from .common.timing import alternate
from .common.trees import scratch_root

ATOM = get_engine("atom")  # the engine this benchmark converts for and runs as


def load_source_like_an_engine(src_dir: pathlib.Path, tp: int, rank: int, device: str) -> tuple[int, int]:
    """Per-tensor reads through safe_open, merge/stack, then shuffle. Returns (tensors read, tensors held)."""
    src = SourceCheckpoint(src_dir)
    cls = classify(src)
    groups = plan_groups(src, cls, target_for(ATOM, layout="preshuffle", moe_layout="ck", tp=tp), ATOM)[rank]
    handles = {f: safe_open(str(src_dir / f), "pt") for f in src.files}
    reads = 0

    def read(name, rows=None, cols=None, out=None):
        nonlocal reads
        reads += 1
        sl = handles[src.tensors[name].file].get_slice(name)
        t = sl[rows if rows is not None else slice(None)]
        if cols is not None:
            t = t[:, cols]
        if out is None:
            return t.contiguous()
        out.copy_(t)
        return out

    held = 0
    for g in groups:  # merge / stack, then shuffle, as process_weights_after_loading does
        for t in g.build(read):
            t.to(device)
            held += 1
    for name in cls.passthrough:
        read(name).to(device)
        held += 1
    return reads, held


def atom_keeps(src: SourceCheckpoint, manifest, rank: int) -> tuple[int, int]:
    """(bytes of the rank's own files, bytes ATOM keeps of the BF16 tensors): the second from
    tests/atom_sharding.py (both the target model and the MTP draft model)."""
    from atom_sharding import held  # the test-side statement of ATOM's per-rank slices

    kept = 0
    for name, info in src.tensors.items():
        if info.dtype == "U8":
            continue
        h = held(src.config, name, tuple(info.shape), manifest.tp, rank, manifest.ep)
        if h is not None:
            kept += info.nbytes // info.shape[h.axis] * h.length if h.axis is not None else info.nbytes
    size = {"U8": 1, "BF16": 2, "F32": 4}
    own = sum(math.prod(r.shape) * size[r.dtype] for r in manifest.rank_tensors(rank) if r.rank == rank)
    return own, kept


def bytes_table(src: SourceCheckpoint, conv: pathlib.Path) -> None:
    manifest = L.load_manifest(conv)
    total = sum(i.nbytes for i in src.tensors.values())
    print(f"per-rank bytes, tp {manifest.tp} ep {manifest.ep}: checkpoint {total / 2**30:.3f} GiB, "
          f"1/tp = {total / manifest.tp / 2**30:.3f} GiB")
    print("rank  own files GiB  common GiB  read GiB  read/ckpt  ATOM keeps GiB  read/kept")
    for rank in range(manifest.tp):
        files = manifest.rank_files(rank)
        sizes = {f: (conv / f).stat().st_size for f in files}
        own_files = {r.file for r in manifest.rank_tensors(rank) if r.rank == rank}
        own_b = sum(v for f, v in sizes.items() if f in own_files)
        common_b = sum(v for f, v in sizes.items() if f not in own_files)
        mx, bf = atom_keeps(src, manifest, rank)
        read = own_b + common_b
        print(f"{rank:4d}  {own_b / 2**30:13.3f}  {common_b / 2**30:10.3f}  {read / 2**30:8.3f}  {read / total:9.3f}  "
              f"{(mx + bf) / 2**30:14.3f}  {read / (mx + bf):9.2f}")


def time_rank(src_dir: pathlib.Path, conv: pathlib.Path, rank: int, repeat: int, device: str, pread: bool | str,
              cold: bool) -> None:
    manifest = L.load_manifest(conv)
    files = [conv / f for f in manifest.rank_files(rank)]
    src_files = [src_dir / f for f in SourceCheckpoint(src_dir).files]
    counts = {}

    def source() -> None:
        counts["source"] = load_source_like_an_engine(src_dir, manifest.tp, rank, device)
        if device != "cpu":
            torch.cuda.synchronize()

    def converted() -> None:
        ranked = L.load_rank(conv, rank, device, mmap=not pread, direct=pread == "direct")
        if device == "cpu":  # touch every page, so a mapped file is really in memory
            for t in ranked.buffers:
                int(t[::4096].sum())
        else:
            torch.cuda.synchronize()
        counts["converted"] = len(ranked)

    def evict_first(name: str) -> None:
        if cold:
            evict(src_files if name == "source" else files)

    # Warm, the first round fills the page cache and is not timed; cold, every round is.
    runs = alternate({"source": source, "converted": converted}, repeat + (1 if cold else 0),
                     warmup=0 if cold else 1, before=evict_first)
    size = sum(f.stat().st_size for f in files)
    table = Table("source", title=f"rank {rank} of tp {manifest.tp}, device {device}, "
                                  f"{'cold: files evicted before each load' if cold else 'page cache warm'}")
    table.add("source", runs.seconds["source"],
              tensors=f"{counts['source'][0]} read by name, merged into {counts['source'][1]}, shuffled at load")
    table.add("converted", runs.seconds["converted"], nbytes=size,
              tensors=f"{counts['converted']} in {len(files)} files ({size / 2**30:.2f} GiB)")
    table.print()


def compare_layouts(src: SourceCheckpoint, convs: dict[str, pathlib.Path], rank: int, repeat: int,
                    cold: bool) -> None:
    """Bytes each rank reads and rank ``rank``'s time to rank ready, for each conversion of the
    same source (format 1, ``--common-bf16``, against ``"rank-exact"``), alternating, in the same run."""
    total = sum(i.nbytes for i in src.tensors.values())
    first = L.load_manifest(next(iter(convs.values())))
    print(f"layouts, tp {first.tp} ep {first.ep}: bytes read per rank (checkpoint {total / 2**30:.3f} GiB, "
          f"1/tp {total / first.tp / 2**30:.3f} GiB)")
    # The bound: 1/tp of the checkpoint plus the tensors every rank holds whole (what a
    # rank-exact conversion copies into each rank's files: passthrough, and whole BF16 windows).
    exact = L.load_manifest(convs["rank-exact"])
    replicated = sum(nbytes(t.dtype, t.shape) for t in exact.rank_tensors(0) if t.role == "passthrough")
    replicated += sum(nbytes(src.tensors[p.source].dtype, src.tensors[p.source].shape) for g in exact.groups
                      if g.kind == "bf16" and g.rank == 0 for p in g.placements if p.dim is None)
    bound = total / exact.tp + replicated
    print(f"  bound: 1/tp + replicated ({replicated / 2**20:.1f} MiB) = {bound / 2**30:.3f} GiB (target: read <= 1.05x)")
    for name, conv in convs.items():
        m = L.load_manifest(conv)
        sizes = [sum(m.files[f].size for f in m.rank_files(r)) for r in range(m.tp)]
        disk = sum(f.size for f in m.files.values())
        print(f"  {name:12s}: {max(sizes) / 2**30:.3f} GiB read per rank at most ({max(sizes) / total:.3f} of the "
              f"checkpoint; least {min(sizes) / 2**30:.3f} GiB, {max(sizes) / bound:.3f}x the bound), "
              f"{disk / 2**30:.3f} GiB on disk for all ranks")
    for label, cold_each in (("warm", False), ("cold", True)) if cold else (("warm", False),):
        def evict_first(name: str) -> None:
            if cold_each:
                evict([convs[name] / f for f in L.load_manifest(convs[name]).files])

        # The first round warms the page cache (untimed unless cold).
        runs = alternate({name: (lambda c=conv: load_and_touch(c, rank)) for name, conv in convs.items()},
                         repeat + (1 if cold_each else 0), warmup=0 if cold_each else 1, before=evict_first)
        table = Table(next(iter(convs)), title=f"  rank {rank} load_rank + touch, {label}")
        for name, seconds in runs.seconds.items():
            table.add(name, seconds)
        table.print()


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--src", type=pathlib.Path, required=True)
    ap.add_argument("--converted", type=pathlib.Path, help="an existing conversion (then --tp is its own)")
    ap.add_argument("--tp", type=int, nargs="+", default=[1], help="one or more TP sizes, each converted and measured")
    ap.add_argument("--ep", action="store_true", help="convert with expert parallel (--ep equal to --tp)")
    ap.add_argument("--rank", type=int, default=0)
    add_repeat(ap, 3)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--pread", action="store_true", help="load_rank(mmap=False): read files into new memory")
    ap.add_argument("--direct", action="store_true",
                    help="load_rank(mmap=False, direct=True): read files with O_DIRECT, past the page cache")
    ap.add_argument("--cold", action="store_true", help="also time with the files evicted from the page cache")
    ap.add_argument("--bytes-only", action="store_true", help="the per-rank bytes table only, no timing")
    ap.add_argument("--rank-exact", action="store_true",
                    help="also convert rank-exact (the default layout) and compare it with --common-bf16 (format 1)")
    ap.add_argument("--no-source", action="store_true", help="skip timing the engine-like load from the source")


def run(args: argparse.Namespace) -> None:
    src = SourceCheckpoint(args.src)
    out_root = scratch_root()
    for tp in [None] if args.converted else args.tp:
        tmp = None
        conv = args.converted
        if conv is None:
            tmp = pathlib.Path(tempfile.mkdtemp(prefix="prep-bench-load-", dir=out_root))
            conv = tmp / "converted"
            t0 = time.perf_counter()
            convert(str(args.src), conv, target_for(ATOM, layout="preshuffle", moe_layout="ck", tp=tp,
                                                    ep=tp if args.ep else 1, rank_exact=False))
            print(f"converted {args.src} at tp {tp}{' ep ' + str(tp) if args.ep else ''} "
                  f"in {time.perf_counter() - t0:.1f} s")
        try:
            bytes_table(src, conv)
            if args.rank_exact and tmp is not None:
                exact = tmp / "rank-exact"
                t0 = time.perf_counter()
                convert(str(args.src), exact, target_for(ATOM, layout="preshuffle", moe_layout="ck", tp=tp,
                                                         ep=tp if args.ep else 1))
                print(f"converted rank-exact in {time.perf_counter() - t0:.1f} s")
                compare_layouts(src, {"common-bf16": conv, "rank-exact": exact}, args.rank, args.repeat, args.cold)
            if not args.bytes_only and not args.no_source:
                time_rank(args.src, conv, args.rank, args.repeat, args.device, "direct" if args.direct else args.pread,
                          cold=False)
                if args.cold:
                    time_rank(args.src, conv, args.rank, args.repeat, args.device, "direct" if args.direct else args.pread,
                              cold=True)
        finally:
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)
