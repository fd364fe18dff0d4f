#!/usr/bin/env python3
"""Time to "rank ready": loading one rank from the Quark source the way engines do today, against
``layouts.load_rank`` of the converted checkpoint, in the same run.

    python scripts/bench_load.py --src DIR [--converted DIR] [--tp 1] [--rank 0] [--repeat 3] [--device cpu]

source path (what ATOM/vLLM do at start-up): open every shard with safetensors' ``safe_open``,
read each of the rank's tensors by name (a TP slice of it with ``get_slice``), copy the experts
one by one into the stacked w13/w2 and the merged [q_a;kv_a] / [gate;up] tensors, then shuffle
every MXFP4 weight and scale into the kernels' layout (prep's own shuffles, the same arithmetic
as aiter's); the BF16 tensors are read too.
converted path: ``layouts.load_rank`` (each file mapped once, tensors are views of it, runtime
attributes set from the manifest; on the CPU every page is then touched so the bytes are really
in memory; ``--pread`` reads each file into new memory instead).

Both run with the files in the page cache (each path runs once untimed first), alternating, and
the best of ``--repeat`` is reported, with tensor counts and the ratio (target: >= 2x). Without
``--converted`` the source is converted first (preshuffle + ck, ``--tp``) into a temporary folder.
A checkpoint with DeepSeek-like tensor counts: ``scripts/make_tiny_deepseek.py OUT --layers 30
--experts 256 --hidden 512 --random-bytes`` (45,843 tensors, 1.7 GB).
"""

from __future__ import annotations

import argparse
import pathlib
import shutil
import sys
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
from safetensors import safe_open  # noqa: E402

import layouts as L  # noqa: E402
from prep.convert import convert  # noqa: E402
from prep.deepseek import Target, classify, plan_groups  # noqa: E402
from prep.source import SourceCheckpoint  # noqa: E402


def load_source_like_an_engine(src_dir: pathlib.Path, tp: int, rank: int, device: str) -> tuple[int, int]:
    """Per-tensor reads through safe_open, merge/stack, then shuffle. Returns (tensors read, tensors held)."""
    src = SourceCheckpoint(src_dir)
    cls = classify(src)
    groups = plan_groups(src, cls, Target("preshuffle", "ck", tp))[rank]
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--src", type=pathlib.Path, required=True)
    ap.add_argument("--converted", type=pathlib.Path)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--pread", action="store_true", help="load_rank(mmap=False): read files into new memory")
    args = ap.parse_args()
    tmp = None
    conv = args.converted
    if conv is None:
        tmp = pathlib.Path(tempfile.mkdtemp(prefix="prep-bench-load-", dir=REPO / "out" if (REPO / "out").is_dir() else None))
        conv = tmp / "converted"
        t0 = time.perf_counter()
        convert(str(args.src), conv, Target("preshuffle", "ck", args.tp))
        print(f"converted {args.src} at tp {args.tp} in {time.perf_counter() - t0:.1f} s")
    try:
        tp = L.load_manifest(conv).tp
        times: dict[str, list[float]] = {"source": [], "converted": []}
        counts = {}
        for i in range(args.repeat + 1):  # the first round warms the page cache and is not timed
            t0 = time.perf_counter()
            reads, held = load_source_like_an_engine(args.src, tp, args.rank, args.device)
            if args.device != "cpu":
                torch.cuda.synchronize()
            t1 = time.perf_counter()
            ranked = L.load_rank(conv, args.rank, args.device, mmap=not args.pread)
            if args.device == "cpu":  # touch every page, so a mapped file is really in memory
                for t in ranked.buffers:
                    int(t[::4096].sum())
            else:
                torch.cuda.synchronize()
            t2 = time.perf_counter()
            counts = {"source": (reads, held), "converted": (len(ranked), len(ranked))}
            if i:
                times["source"].append(t1 - t0)
                times["converted"].append(t2 - t1)
            del ranked
        files = L.load_manifest(conv).rank_files(args.rank)
        nbytes = sum((conv / f).stat().st_size for f in files)
        s, c = min(times["source"]), min(times["converted"])
        print(f"rank {args.rank} of tp {tp}, device {args.device}, best of {args.repeat} (page cache warm)")
        print(f"source    : {s:7.3f} s  {counts['source'][0]:6d} tensors read by name, merged into {counts['source'][1]} "
              "and shuffled at load")
        print(f"converted : {c:7.3f} s  {counts['converted'][0]:6d} tensors in {len(files)} files "
              f"({nbytes / 2**30:.2f} GiB, {nbytes / c / 1e9:.2f} GB/s)")
        print(f"ratio     : {s / c:7.2f}x faster to rank ready (target >= 2x)")
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
