"""Device memory and time of installing one rank into an engine's models: the ATOM adapter as it is
(files read one at a time, each tensor copied into the parameter ATOM allocated) against the way it
was before (``load_rank`` of the whole rank to the device, then each parameter pointed at its view),
in the same run, on the same model.

Baseline: the way before (``before``), alternated with the adapter as it is (``now``). The model is ATOM's DeepSeek for one rank as ATOM allocates it before loading (``tests/atom_like.py``:
shapes from config.json, every parameter), made on the GPU; the checkpoint is generated
(``prep.testing``) and converted (rank-exact, preshuffle + ck) with rank files cut at
``--shard-mib`` (prep cuts them at 4 GiB; smaller here so that a rank of a small checkpoint spans
several files, as a real one does). Reported per way: the peak of ``torch.cuda.max_memory_allocated``
above the model's own parameters, as a multiple of the rank's bytes, and the time; the files are
in the page cache (one untimed run of each first). ``--device cpu`` runs the same steps with the
times only (a smoke run: device memory is what this measures).

Example:
    python3 scripts/bench.py install --preset bench-r1 --layers 4 --variant v2 --tp 2 --shard-mib 256
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import tempfile
import time

import torch

import layouts as L
import prep.convert
import prep.file_plan
from atom_like import atom_like_model  # tests/: ATOM's DeepSeek as ATOM allocates it
from layouts.engines.atom import install_converted_weights
from layouts.engines.atom.adapter import _as_param_dtype
from layouts.engines import get_engine
from prep.deepseek import target_for
from prep.testing import PRESETS, write_checkpoint

from .common.args import add_repeat
from .common.table import GiB, Table
from .common.timing import Timed, alternate

ATOM = get_engine("atom")  # the engine this benchmark converts for and runs as


DEVICE = "cuda"


def before(model, out, engine):
    """The adapter before: the whole rank on the device, each parameter pointed at its view."""
    tensors = L.load_rank(out, engine.rank, DEVICE)
    params = dict(model.named_parameters())
    for name, t in tensors.items():
        if name in params:
            p = params[name]
            p.data = t if p.dtype == t.dtype else (_as_param_dtype(t, p) if p.dtype.itemsize == 1 else t.to(p.dtype))
    return tensors


def now(model, out, engine):
    return install_converted_weights(model, out, engine)


def measure(way, cfg, tp, out, engine, mxfp4_attention):
    gpu = DEVICE == "cuda"
    if gpu:
        torch.cuda.empty_cache()
    torch.set_default_device(DEVICE)
    model = atom_like_model(cfg, tp=tp, mxfp4_attention=mxfp4_attention, full=True)
    torch.set_default_device(None)
    if gpu:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    kept = way(model, out, engine)
    if gpu:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated() - base if gpu else float("nan")
    after = torch.cuda.memory_allocated() - base if gpu else float("nan")
    del kept, model
    return Timed(seconds, {"peak": peak, "after": after})


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--preset", default="bench-r1", choices=sorted(PRESETS))
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--variant", default="r1-0528", choices=["r1-0528", "v2"])
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--shard-mib", type=int, default=512)
    add_repeat(ap, 3)
    ap.add_argument("--work", help="folder for the checkpoint and its conversion (default: temporary)")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])


def run(args: argparse.Namespace) -> None:
    global DEVICE
    DEVICE = args.device
    if DEVICE == "cuda" and not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device (or --device cpu for a smoke run)")
    work = pathlib.Path(args.work or tempfile.mkdtemp(prefix="bench-install-"))
    spec = dataclasses.replace(PRESETS[args.preset], variant=args.variant, num_hidden_layers=args.layers,
                               first_k_dense_replace=min(PRESETS[args.preset].first_k_dense_replace, args.layers))
    src, out = work / "src", work / "out"
    if not (src / "config.json").is_file():
        write_checkpoint(spec, src)
    if not (out / "prep-complete.json").is_file():
        prep.file_plan.SHARD_BYTES = args.shard_mib << 20
        prep.convert.convert(str(src), out, target_for(ATOM, layout="preshuffle", moe_layout="ck", tp=args.tp))
    cfg = json.loads((src / "config.json").read_text())
    manifest = L.load_manifest(out)
    engine = L.EngineConfig("asm", "ck", args.tp, rank=0, profile=ATOM)
    rank_bytes = sum(manifest.files[f].size for f in manifest.rank_files(0))
    files = len(manifest.rank_files(0))
    largest = max(manifest.files[f].size for f in manifest.rank_files(0))
    print(f"{torch.cuda.get_device_name() if DEVICE == 'cuda' else 'CPU'}: rank 0 of {out} (TP {args.tp}): {rank_bytes / 2**30:.3f} GiB in {files} "
          f"files, the largest {largest / 2**30:.3f} GiB")
    mxfp4_attention = args.variant == "v2"
    # The first round is untimed: page cache, allocator, CUDA context.
    runs = alternate({way.__name__: (lambda w=way: measure(w, cfg, args.tp, out, engine, mxfp4_attention))
                      for way in (before, now)}, args.repeat, warmup=1)
    table = Table("before", title="install rank 0 into the model; peak: torch.cuda.max_memory_allocated above the "
                                  "model's own parameters")
    for name, seconds in runs.seconds.items():
        peak = max(i["peak"] for i in runs.info[name])
        table.add(name, seconds, peak=f"{peak / GiB:.3f} GiB = {peak / rank_bytes:.2f}x the rank's bytes",
                  held_after=f"{runs.info[name][-1]['after'] / GiB:.3f} GiB")
    table.print()
