"""``prep verify``: is a converted checkpoint what its manifest says, and (with a source) does it
invert to the source's exact bytes? And the hash check ``prep run`` makes of what it reads."""

from __future__ import annotations

import collections
import concurrent.futures as cf
import contextlib
import math
import os
import re
import threading
from typing import Any, Callable

from layouts.manifest import Manifest, TensorRecord
from layouts.registry import recorded_layout

from .converted import ConvertedCheckpoint, same_bytes
from .errors import PrepError
from .group_records import group_from_record
from .prefetch import Prefetch
from .safetensors_writer import nbytes
from .identity import side_file_changed
from .source import SIDE_FILES, SourceCheckpoint

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
# Units (a group's or a pass-through tensor's source tensors) inverted and compared at once by
# ``verify --source``: reads, unshuffles, copies and compares run outside the GIL, and the units
# share the block budget. 18.78 GiB at TP 8 on the 16-core host: 1 / 2 / 4 at once 17.7-18.9 /
# 13.6 / 11.6 s, peak RSS 0.69 / 0.82 / 0.89 GiB; the 2-core VM 1.2x with 2. Two by default: a
# dense linear is inverted whole, so each unit at once adds to what the blocks hold, and R1's
# tensor count adds ~0.12 GiB more; the 1 GiB bound of docs/BENCHMARKS.md stays met.
# PREP_VERIFY_WORKERS sets it.
MAX_VERIFY_WORKERS = 2


def verify_workers() -> int:
    """Units compared at once: PREP_VERIFY_WORKERS, else one per core up to MAX_VERIFY_WORKERS."""
    try:
        return max(1, min(64, int(os.environ["PREP_VERIFY_WORKERS"])))
    except (KeyError, ValueError):
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        return max(1, min(MAX_VERIFY_WORKERS, cores))


def verify(out: str, source: str | None = None, deep: bool = False,
           progress: Callable[[int], None] | None = None, on_total: Callable[[int], None] | None = None) -> dict:
    """Check files, sizes and every tensor's hash; ``deep`` also inverts every group (padding
    checks); ``source`` also compares the inverted bytes with the source checkpoint.
    ``on_total`` gets the bytes the run goes through (hashed, then inverted) and ``progress``
    each step's share as it is done."""
    inverting = deep or source
    workers = verify_workers()  # files hashed at once, then units inverted at once
    ck = ConvertedCheckpoint(out, streams=workers)
    m = ck.manifest
    for fname, meta in m.files.items():
        path = ck.root / fname
        if not path.is_file():
            raise PrepError(f"{path}: missing; convert again")
        if path.stat().st_size != meta.size:
            raise PrepError(f"{path}: size {path.stat().st_size} differs from the manifest's {meta.size}; "
                            "the file is truncated or was replaced")
    # The side files convert copied from the source (config, tokenizer, ...): an engine reads them with
    # the weights, so an edited config.json is as wrong as an edited tensor.
    for fname, recorded in sorted((m.source.files if m.source else {}).items()):
        if fname in SIDE_FILES and (ck.root / fname).is_file():
            problem = side_file_changed(ck.root / fname, recorded)
            if problem:
                raise PrepError(problem)
    if on_total:
        on_total(sum(nbytes(t.dtype, t.shape) for t in m.tensors)
                 + (sum(nbytes(s.dtype, s.shape) for s in ck.source_tensors.values()) if inverting else 0))
    # The hash check engines run too (one sequential pass per file): a mismatch is a ManifestError
    # naming the file, the tensor and its rank.
    checked = m.verify_hashes(progress=progress, workers=workers)
    pads = check_scale_pads(ck)
    compared = 0
    if inverting:
        src = SourceCheckpoint.open(source) if source else None
        units = list(ck.units())
        # The source read ahead unit by unit, in file order (as convert does): the comparison
        # reads it in the groups' order, experts by name, which is not the file's.
        with Prefetch(src, [names for _, names in units]) if src else contextlib.nullcontext() as ahead:
            compared = _compare(ck, src, units, ahead, progress, workers)
    return {"files": len(m.files), "tensors_hashed": checked, "scale_pads_checked": pads,
            "source_tensors_compared": compared}


def _compare(ck: ConvertedCheckpoint, src: SourceCheckpoint | None, units: list[tuple[str, list[str]]],
             ahead: Prefetch | None, progress, workers: int | None = None) -> int:
    """Invert every unit, ``workers`` at once (:func:`verify_workers`); with ``src``, compare each
    block with the source's same rows. Returns the source tensors compared; an error is the
    first unit's in order, whichever thread met it first."""
    workers = min(workers or verify_workers(), max(1, len(units)))
    if workers == 1:
        compared = 0
        for i, (unit, _) in enumerate(units):
            if ahead is not None:
                ahead.at(i)
            compared += _compare_unit(ck, src, unit, progress)
        return compared
    import torch

    for fname in ck.manifest.files:  # opened here, once, before the threads share them
        ck.file(fname)
    lock, stop = threading.Lock(), threading.Event()

    def done(n: int) -> None:
        with lock:
            progress(n)

    # One torch intra-op thread per worker and core share, as convert does.
    torch_threads = torch.get_num_threads()
    torch.set_num_threads(max(1, torch_threads // workers))
    compared = 0
    try:
        with cf.ThreadPoolExecutor(workers, thread_name_prefix="prep-verify") as pool:
            # Every unit queued at once (a queued unit holds nothing; only the ``workers``
            # running ones hold blocks), so no worker waits for a large unit ahead of it to
            # finish; results are taken in order, and the prefetch follows the oldest unfinished.
            pending = collections.deque(pool.submit(_compare_unit, ck, src, unit, done if progress else None, stop)
                                        for unit, _ in units)
            try:
                for i in range(len(units)):
                    if ahead is not None:
                        ahead.at(i)
                    compared += pending.popleft().result()
            finally:  # an error or Ctrl-C: queued units never start, running ones stop at their next block
                stop.set()
                for f in pending:
                    f.cancel()
    finally:
        torch.set_num_threads(torch_threads)
    return compared


def _compare_unit(ck: ConvertedCheckpoint, src: SourceCheckpoint | None, unit: str, progress,
                  stop: threading.Event | None = None) -> int:
    """Invert one unit and, with ``src``, compare it; returns its source tensors compared (or
    stops early, with what it had, once ``stop`` is set)."""
    compared = 0
    # Row blocks of bounded bytes, each compared with the same rows of the source: memory holds
    # a block, not a tensor (experts are inverted a block at a time).
    for name, rows, got in ck.iter_source_blocks(unit):
        if stop is not None and stop.is_set():
            break
        if progress:
            progress(got.numel() * got.element_size())
        if src is None:
            continue
        if rows is None or rows.start == 0:  # a tensor's first block: its shape and dtype
            meta, info = ck.source_tensors[name], src.info(name)
            if (info.dtype, tuple(info.shape)) != (meta.dtype, tuple(meta.shape)):
                raise PrepError(f"{name}: the source's is {info.dtype} {list(info.shape)}, the manifest's "
                                f"{meta.dtype} {list(meta.shape)}; inverted bytes differ from the source")
            compared += 1
        want = src.read(name, rows)
        if want.dtype != got.dtype:
            got = got.view(want.dtype)
        if want.shape != got.shape or not same_bytes(want, got):
            raise PrepError(f"{name}: inverted bytes differ from the source")
    return compared


def check_scale_pads(ck: ConvertedCheckpoint) -> int:
    """Every padded scale's pad bytes (S32x8 rows past N, columns past K/32) hold the byte the
    manifest's layout records (0x00 from layout version 2, 0x7F before): the hashes only say the
    bytes are the ones written, this says they are the ones the manifest claims, which is what
    ``check_compatibility`` decides on. Returns how many scales have a pad."""
    m = ck.manifest
    recorded = {name: recorded_layout(rec) for name, rec in m.layouts.items()}
    padded = 0
    for rec in m.groups:
        if rec.kind == "bf16":  # source bytes, split: no scale, no pad
            continue
        layout = recorded.get(rec.layout)
        if layout is None:
            raise PrepError(f"{ck.root}: group {rec.name} is in layout {rec.layout!r}, which the manifest's layouts "
                            "do not record; the manifest is damaged: convert again")
        g = group_from_record(rec, m.recorded_layout)
        for (name, role, stored), shape in zip(g.outputs(), g.local_shapes()):
            if role != "e8m0_scale" or math.prod(stored) == math.prod(shape):
                continue  # nothing padded
            bad = layout.scale_pad_mismatches(ck.read(rec.file, name), shape)
            if bad:
                raise PrepError(f"{ck.root / rec.file}: {name}: {bad} pad bytes are not "
                                f"0x{layout.scale.pad_value:02X}, the pad its manifest records (layout "
                                f"'{layout.name}' version {layout.version}); the file is not what prep wrote: "
                                "convert again")
            padded += 1
    return padded


def verify_tensors_read(manifest: Manifest, layers_run: int, bar: Any = None) -> int:
    """Check the hash of every tensor a forward over the first ``layers_run`` decoder layers
    reads (those layers, and the tensors of no layer: embedding, final norm, lm_head), before
    it runs: ``prep run --layers 4`` on a TP 8 R1 then hashes 4 layers, not 350 GB, and a layer
    it never runs (the MTP layer, or past ``--layers``) is not what it reports on. ``bar``: a
    progress bar (``total(n)``, then called with the bytes of each file hashed). Returns the
    number of tensors checked; raises the manifest's one-line error naming the first mismatch."""

    def read(t: TensorRecord) -> bool:
        m = _LAYER.match(t.name)
        return m is None or int(m.group(1)) < layers_run

    if bar is not None:
        bar.total(sum(nbytes(t.dtype, t.shape) for t in manifest.tensors if read(t)))
    return manifest.verify_hashes(progress=bar, select=read)
