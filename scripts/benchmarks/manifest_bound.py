"""What a manifest near the size bound costs to read: time and peak memory of ``load_manifest`` and
of ``load_rank`` (the engine's first step) on copies of one conversion whose manifest is padded to
each size, each in a fresh process, as ratios against the first size.

Baseline: the first size of ``--mib``. Each size once, in order (a fresh process each). The padding is entries of a source tensor table (what a manifest held most of before format 4
moved the table out: R1-0528's at TP 8 was 20 MB, 12 MB of it the 90,910 source tensors), small
objects as a real table's are;
the copy is resealed (completion marker) so that it loads. The manifest's size bound is
``layouts.safe_files.MAX_JSON_BYTES``; a real checkpoint's manifest must stay well under it, and
what a hostile one just under it costs is what this prints.

Example:
    python scripts/bench.py manifest-bound CONVERTED --mib 20 96 255
"""

from __future__ import annotations

import argparse
import hashlib
import json
import pathlib
import shutil
import subprocess
import sys
import tempfile

from .common.table import GiB, Table
from .common.timing import Timed
from .common.trees import REPO

CHILD = """
import resource, sys, time
sys.path.insert(0, sys.argv[2])
import layouts
t0 = time.perf_counter()
m = layouts.load_manifest(sys.argv[1])
t1 = time.perf_counter()
layouts.load_rank(sys.argv[1], 0, manifest=m)
t2 = time.perf_counter()
print(t1 - t0, t2 - t0, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
"""


def padded_copy(src: pathlib.Path, dst: pathlib.Path, mib: int) -> int:
    shutil.copytree(src, dst)
    m = json.loads((dst / "prep-manifest.json").read_text())
    # From format 4 the real table is in prep-source.json; padding of the same kind goes where
    # versions 1-3 held it (source.tensors), which a reader parses with the rest of the manifest.
    table = m["source"].setdefault("tensors", {})
    entry = {"dtype": "U8", "shape": [7168, 8], "file": "model-00001-of-00163.safetensors"}
    raw = json.dumps(m, separators=(",", ":")).encode()
    one = len(json.dumps({"model.layers.0.mlp.experts.0.up_proj.weight_scale_pad_000000": entry},
                         separators=(",", ":"))) - 1
    for i in range(max(0, (mib << 20) - len(raw)) // one):
        table[f"model.layers.0.mlp.experts.0.up_proj.weight_scale_pad_{i:06d}"] = entry
    raw = json.dumps(m, separators=(",", ":")).encode()
    (dst / "prep-manifest.json").write_bytes(raw)
    marker = json.loads((dst / "prep-complete.json").read_text())
    marker["manifest_sha256"] = hashlib.sha256(raw).hexdigest()
    (dst / "prep-complete.json").write_text(json.dumps(marker))
    return len(raw)


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("converted", type=pathlib.Path)
    ap.add_argument("--mib", type=int, nargs="+", default=[20, 96, 256], help="manifest sizes, the baseline first")


def load_in_child(folder: pathlib.Path) -> Timed:
    """``load_manifest`` then ``load_rank(0)`` in a fresh process: the seconds to the rank, with
    the manifest's seconds and the process's peak RSS."""
    r = subprocess.run([sys.executable, "-c", CHILD, str(folder), str(REPO)], capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError(r.stderr.strip().splitlines()[-1])
    t_manifest, t_rank, rss = map(float, r.stdout.split())
    return Timed(t_rank, {"manifest_s": t_manifest, "rss": rss})


def run(args: argparse.Namespace) -> None:
    work = pathlib.Path(tempfile.mkdtemp(prefix="manifest-bound-"))
    table = Table(f"{args.mib[0]} MiB", title="load_rank(0) in a fresh process, the manifest padded to each size")
    base_rss = None
    try:
        for mib in args.mib:
            folder = work / f"m{mib}"
            size = padded_copy(args.converted, folder, mib)
            try:
                got = load_in_child(folder)
            except RuntimeError as e:
                print(f"{mib} MiB: {e}")
                continue
            base_rss = base_rss or got.info["rss"]
            table.add(f"{mib} MiB", got.seconds, manifest=f"{size / 2**20:.1f} MiB",
                      load_manifest=f"{got.info['manifest_s']:.2f} s",
                      peak_rss=f"{got.info['rss'] / GiB:.2f} GiB ({got.info['rss'] / base_rss:.1f}x)")
            shutil.rmtree(folder)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    table.print()
