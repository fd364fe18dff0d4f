"""``prep convert``: stream a Quark MXFP4 DeepSeek checkpoint into per-rank, kernel-layout files
plus a manifest.

Order of work, so that bad input leaves nothing behind: resolve and validate the source, check
that OUT may be written (:mod:`prep.outdir`: never the source, never a folder with files prep did
not write), plan every output tensor and check every constraint, and only then write, under an
exclusive lock, into a staging folder beside OUT. Each output file is written under a temporary
name, renamed when whole, and described by a small record (its tensors' hashes and the identity
of the source files it read) that ``--resume`` re-verifies and reuses. The manifest and then the
completion marker are written last, and staging is swapped in for OUT atomically.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import dataclasses
import json
import os
import pathlib
import threading
from typing import Any, Callable

import torch

import layouts
from layouts import manifest as schema
from layouts.manifest import COMPLETE_NAME, FILE_NAME_KEY, MANIFEST_NAME, Target, compress_names, manifest_hash
from layouts.safetensors_file import TORCH_DTYPES, TensorInfo

from . import __version__
from .deepseek import engine_of
from .file_plan import FileJob, plan_files
from .directio import ALIGN, STAGING_BYTES, STAGING_SPARE
from .groups import Alloc
from .identity import changed_files, file_identity
from .fileops import copy_regular, kill_point, write_json
from .outdir import OutputFolder
from .ownership import sealed_run
from .source import ShardFile, SourceCheckpoint
from .safetensors_writer import StreamingSafetensorsWriter, nbytes
from .prefetch import Prefetch
from .siblings import build_together

# Tensors are built, transformed and written in blocks of about this size (whole experts, or
# rows of a pass-through tensor), so peak memory does not grow with the largest tensor.
CHUNK_BYTES = 32 << 20


def keep_freed_memory() -> None:
    """Make glibc keep freed blocks for reuse instead of returning them to the OS at once.

    Conversion allocates and frees the same few block-sized buffers thousands of times; by
    default glibc maps each one fresh and unmaps it on free, so every block pays page faults on
    first touch (measured: 1.3 s of a 5.8 s bench conversion). Process-wide, so only the CLI
    calls it; memory stays bounded by the blocks in flight, which no longer grow with the model.
    """
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc: nothing to tune
        return
    m_trim_threshold, m_mmap_threshold = -1, -3
    libc.mallopt(m_mmap_threshold, 1 << 30)
    libc.mallopt(m_trim_threshold, (1 << 31) - 1)


class _Cancelled(Exception):
    """Another worker failed (or the user interrupted): stop this file where it is."""


def _file_sets(jobs: list[FileJob]) -> list[list[FileJob]]:
    """The files written together: the TP ranks' files at the same place in each rank's
    sequence (same groups, each the rank's part, and the same replicated tensors), whose source
    bytes are then read once for all of them (:mod:`prep.siblings`); any other file alone."""
    sets: dict[Any, list[FileJob]] = {}
    nth: dict[int, int] = {}  # how many files of each rank came before
    for job in jobs:
        if job.rank is None:
            key: tuple = (job.name,)
        else:
            nth[job.rank] = nth.get(job.rank, -1) + 1
            key = (nth[job.rank], tuple(g.key for g in job.groups), tuple(job.passthrough), tuple(job.constants))
        sets.setdefault(key, []).append(job)
    return list(sets.values())


# Writes in flight per output file. On the H200 host's disk (virtio), four 40 MiB O_DIRECT
# writes at once moved 1.46x one at a time, and convert at TP 4 ran 1.18x faster with 4 than
# with 1 (10.25 -> 8.68 s); on the 2-core VM 1.2x in single runs (6.53 -> 5.30 s), even within
# bench.py convert's noise; it costs three more staging blocks per file, +150-200 MiB peak
# (docs/BENCHMARKS.md, "Rank files to the GPU"). Revert and the others keep directio's one.
WRITE_DEPTH = 4

# Threads over sets when --workers is not given: one per four cores (each keeps a core busy
# building and shares the rest with its files' writer and hash threads), no more than
# MEMORY_BUDGET holds beside the fixed cost (python, torch and prep imported: ~230 MiB), and
# no more than there are sets. Several workers share the writes in flight (WRITE_DEPTH in all
# per file place), so each keeps fewer staging blocks.
MEMORY_BUDGET = 3 << 29  # 1.5 GiB: the peak convert is held to (docs/BENCHMARKS.md)
FIXED_BYTES = 256 << 20


def _depth(workers: int) -> int:
    """Writes in flight per output file when ``workers`` sets are written at once."""
    return max(1, WRITE_DEPTH // workers)


def _set_bytes(n_files: int, depth: int) -> int:
    """What one worker holds while it writes a set of ``n_files`` files: each file's staging
    blocks (its writes in flight and two more) and the blocks being built (a source stack, a
    rank's window, a column window's shared rows)."""
    return n_files * (_staging_bytes(n_files) or STAGING_BYTES) * (depth + STAGING_SPARE) + 3 * CHUNK_BYTES


def auto_workers(sets: list[list[FileJob]], cores: int | None = None, budget: int = MEMORY_BUDGET) -> int:
    """How many sets to write at once when the user did not say (see MEMORY_BUDGET)."""
    if cores is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    widest = max((len(s) for s in sets), default=1)
    workers = max(1, min(len(sets), cores // 4))
    while workers > 1 and FIXED_BYTES + workers * _set_bytes(widest, _depth(workers)) > budget:
        workers -= 1
    return workers


def _staging_bytes(n_files: int) -> int | None:
    """Each file's staging memory when ``n_files`` are written at once: room for its share of a
    chunk (plus a carried tail), at least 8 MiB (large O_DIRECT writes); one file: the default."""
    if n_files <= 1:
        return None
    return max(8 << 20, -(-(CHUNK_BYTES // n_files + ALIGN) // ALIGN) * ALIGN)


def _write_files(src: SourceCheckpoint, jobs: list[FileJob], out: OutputFolder, idents: dict[str, dict[str, Any]],
                 progress: Callable[[int], None] | None = None,
                 cancel: threading.Event | None = None, depth: int = WRITE_DEPTH) -> list[dict[str, Any]]:
    """Write a set of output files (see :func:`_file_sets`) into staging, each with its record
    (``depth`` writes in flight per file); with ``cancel``, give up (leaving no file) as soon as
    it is set. Returns the records."""
    def check() -> None:
        if cancel is not None and cancel.is_set():
            raise _Cancelled(jobs[0].name)

    finals = [out.staging / job.name for job in jobs]
    tmps = [final.with_name(final.name + ".tmp") for final in finals]
    try:
        hashes = _write_into(src, jobs, tmps, check, progress, depth)
    except BaseException:
        for tmp in tmps:
            tmp.unlink(missing_ok=True)  # what a resumed run can use is whole files only
        raise
    records = []
    for job, tmp, final, h in zip(jobs, tmps, finals, hashes):
        tmp.rename(final)
        record = {"file": job.name, "plan_key": job.plan_key(), "size": final.stat().st_size, "hashes": h,
                  "sources": {f: idents[f] for f in job.source_files(src)}}
        write_json(out.records / (job.name + ".json"), record)
        kill_point("file-written")
        records.append(record)
    return records


def _write_into(src: SourceCheckpoint, jobs: list[FileJob], tmps: list[pathlib.Path], check: Callable[[], None],
                progress: Callable[[int], None] | None, depth: int = WRITE_DEPTH) -> list[dict[str, str]]:
    """Stream the files' tensors into ``tmps``, group by group for all of them at once; returns
    each file's hashes."""
    staging = _staging_bytes(len(jobs))
    with contextlib.ExitStack() as stack:
        # Each file names itself in its header (FILE_NAME_KEY): a loader then refuses a rank file renamed
        # into another's place (two ranks' files swapped hold the same tensor names).
        writers = [stack.enter_context(StreamingSafetensorsWriter(tmp, job.entries, staging_bytes=staging,
                                                                  write_depth=depth,
                                                                  metadata={"format": "pt", FILE_NAME_KEY: job.name}))
                   for job, tmp in zip(jobs, tmps)]

        def room_in(w: StreamingSafetensorsWriter) -> Alloc:
            def room(name: str, shape: tuple[int, ...], dtype: str = "U8") -> torch.Tensor | None:
                """Where to build the next chunk of ``name``: the writer's staging memory (written
                with no further copy), or None to build it elsewhere."""
                buf = w.reserve(name, nbytes(dtype, shape))
                t = TORCH_DTYPES[dtype]
                if buf is None or buf.data_ptr() % t.itemsize:
                    return None
                return buf.view(t).view(shape)
            return room

        rooms = [room_in(w) for w in writers]
        # The source bytes of the next group read in file order while this one is built.
        groups = [[n for job in jobs for n in job.groups[i].sources()] for i in range(len(jobs[0].groups))]
        ahead = stack.enter_context(Prefetch(src, groups + [jobs[0].passthrough]))
        for i in range(len(jobs[0].groups)):
            ahead.at(i)
            for f, name, chunk in build_together([job.groups[i] for job in jobs], src.read, src.cuts_columns, CHUNK_BYTES, rooms):
                writers[f].write(name, chunk)
                if progress:
                    progress(chunk.numel() * chunk.element_size())
                check()
        ahead.at(len(jobs[0].groups))
        for name in jobs[0].passthrough:  # replicated in every file of the set: read once
            info = src.info(name)
            for rows, shape in _row_blocks(info):
                t = src.read(name, rows, out=rooms[0](name, shape, info.dtype))
                # The other files first: once written, the first file's staging memory is reused.
                for w, room in zip(writers[1:], rooms[1:]):
                    buf = room(name, shape, info.dtype)
                    w.write(name, t if buf is None else buf.copy_(t))
                writers[0].write(name, t)
                if progress:
                    progress(t.numel() * t.element_size() * len(writers))
                check()
        for c in jobs[0].constants:  # the same in every file of the set
            t = c.tensor()
            for w in writers:
                w.write(c.name, t)
    return [w.hashes for w in writers]


def _row_blocks(info: TensorInfo) -> list[tuple[slice | None, tuple[int, ...]]]:
    """(rows, shape) of each block of whole rows a pass-through tensor is copied in (the
    embedding is 1.8 GiB of BF16); rows None: the whole tensor at once."""
    rows = info.shape[0] if len(info.shape) >= 2 and info.nbytes else 0
    step = max(1, CHUNK_BYTES // max(1, info.nbytes // rows)) if rows else 0
    if not rows or step >= rows:
        return [(None, tuple(info.shape))]
    return [(slice(r, min(rows, r + step)), (min(rows, r + step) - r, *info.shape[1:])) for r in range(0, rows, step)]


def _reusable(job: FileJob, out: OutputFolder, src: SourceCheckpoint,
              idents: dict[str, dict[str, Any]]) -> tuple[dict[str, Any] | None, str]:
    """A finished file of an interrupted run, if it was built by the same plan from source
    files that did not change since, and its bytes verify. Returns (record or None, why not)."""
    final, rec_path = out.staging / job.name, out.records / (job.name + ".json")
    if not (final.is_file() and rec_path.is_file()):
        return None, "unfinished"
    try:
        record = json.loads(rec_path.read_text())
        if record.get("plan_key") != job.plan_key():
            return None, "planned differently"
        changed = changed_files(record.get("sources") or {"?": None}, idents)
        if changed or set(record["sources"]) != set(job.source_files(src)):
            return None, f"source file {changed[0] if changed else '?'} changed"
        if record.get("size") != final.stat().st_size:
            return None, "damaged"
        hashes = ShardFile(final).hash_tensors([name for name, _, _ in job.entries])
        if any(hashes[name] != record["hashes"].get(name) for name, _, _ in job.entries):
            return None, "damaged"
        return record, ""
    except Exception:  # any doubt about a leftover file means it is written again
        return None, "damaged"


def convert(
    src_spec: str,
    out: str | pathlib.Path,
    target: Target,
    *,
    force: bool = False,
    resume: bool = False,
    workers: int | None = None,
    revision: str | None = None,
    progress: Callable[[int], None] | None = None,
    on_total: Callable[[int], None] | None = None,
    notify: Callable[[str], None] | None = None,
    on_start: Callable[[], None] | None = None,
    space_check: bool = True,
) -> dict[str, Any]:
    """Convert ``src_spec`` into ``out``. Returns a summary (files, tensors, bytes, reused, and the
    ``workers`` that wrote: ``workers`` output file sets at once, None for :func:`auto_workers`).

    ``out`` is refused, before anything is read or written, when it is or holds or lies in the
    source, or holds files prep did not write (see :mod:`prep.outdir`); ``force`` replaces a
    previous output of prep, atomically, once the new one is complete. ``notify`` receives
    one-line notes (a discarded or recovered earlier run, files redone on resume); ``on_start`` is
    called once the source is open and OUT passed its checks, free space included (``space_check``:
    refuse an output its filesystem cannot hold, before a byte is written)."""
    src = SourceCheckpoint.open(src_spec, revision)
    folder = OutputFolder(out, inputs=[src.root], force=force)
    folder.check(resuming=resume)
    engine = engine_of(target.engine)  # the one resolution of the target's engine name
    jobs, info = plan_files(src, target, engine)
    for line in engine.source_notes(src.config) if notify else ():
        notify(line)
    total = sum(j.nbytes for j in jobs)
    # The run's options, as the state file holds them (a pair of layout names as a list), for
    # --resume to compare: the target less its arch, which the source decides, not an option
    options = {k: v for k, v in dataclasses.asdict(target).items() if k != "arch"}
    state = {"kind": "convert", "tool": f"prep {__version__}",
             "options": json.loads(json.dumps({**options, "revision": revision}))}
    idents = {f: file_identity(src.root / f) for f in src.files}
    key = run_key(state, jobs, src, idents)
    with folder.locked():
        folder.recover()
        for line in folder.notes if notify else ():
            notify(line)
        folder.notes.clear()
        if resume and _already_made(folder, key):
            folder.discard()  # whatever an interrupted run left: OUT is what it would have made
            if notify:
                notify(f"{folder.given} is already complete (made from this source with these options; its hashes "
                       "checked): nothing to do")
            return {**_summary(folder.given, jobs, src, reused=len(jobs), total=total), "workers": 0}
        folder.check()  # after recovery: what is at OUT now
        folder.check_space(total + src.side_bytes(), skip=not space_check)
        if on_start:
            on_start()
        kept, note = folder.begin(state, resume)
        if kept == "swapped":  # the interrupted run had put an output at OUT, and not this one's
            _, note = folder.begin(state, resume=False)
        if note and notify:
            notify(note)
        with folder.discarded_on_error(keep_on_interrupt=True, needed=f" ({total / 2**30:.2f} GiB needed in all)"):
            records, workers = _write_all(src, jobs, folder, resume, workers, progress, on_total, total, notify,
                                          idents)
            for p in src.side_files():
                copy_regular(p, folder.staging / p.name)
            files = build_manifest(src, target, jobs, records, info).to_files()
            raw = files.pop(MANIFEST_NAME)
            for name, table in files.items():  # the source table: the manifest names and hashes it
                (folder.staging / name).write_bytes(table)
            kill_point("source-table-written")
            (folder.staging / MANIFEST_NAME).write_bytes(raw)
            write_json(folder.staging / COMPLETE_NAME,
                       schema.Completion(manifest_hash(raw), f"prep {__version__}", run=key).to_json())
            kill_point("marker-written")
            folder.commit()
    for line in folder.notes if notify else ():
        notify(line)
    return {**_summary(folder.given, jobs, src, sum(1 for r in records.values() if r.get("reused")), total),
            "workers": workers}


def _summary(out: str, jobs: list[FileJob], src: SourceCheckpoint, reused: int, total: int) -> dict[str, Any]:
    # the layouts the files hold tensors in (a checkpoint without MXFP4 holds none of the dense/MoE ones)
    held = sorted({g.layout.name for j in jobs for g in j.groups if g.layout})
    return {"out": out, "files": len(jobs), "reused_files": reused, "bytes": total,
            "tensors": sum(len(j.entries) for j in jobs), "source_tensors": len(src.tensors), "layouts_held": held}


def run_key(state: dict[str, Any], jobs: list[FileJob], src: SourceCheckpoint,
            idents: dict[str, dict[str, Any]]) -> str:
    """What one output is made from and how: the run's options and tool, every file's plan and
    the identity of every source file and side file. The completion marker keeps it, so that a
    ``--resume`` finding OUT finished (the run completed, or was killed in its last clean-up,
    after which nothing else is left to say so) accepts OUT instead of converting again."""
    desc = {"state": state, "jobs": [[j.name, j.plan_key()] for j in jobs], "sources": idents,
            "side": {p.name: file_identity(p) for p in src.side_files()}}
    return manifest_hash(json.dumps(desc, sort_keys=True).encode())


def _already_made(folder: OutputFolder, key: str) -> bool:
    """Whether OUT is a finished output made by a run of key ``key`` whose bytes still verify."""
    if sealed_run(folder.path) != key:
        return False
    try:
        layouts.manifest.load_manifest(folder.path).verify_hashes()
    except (OSError, layouts.ManifestError):
        return False
    return True


def _write_all(src: SourceCheckpoint, jobs: list[FileJob], folder: OutputFolder, resume: bool, workers: int | None,
               progress: Callable[[int], None] | None, on_total: Callable[[int], None] | None, total: int,
               notify: Callable[[str], None] | None, idents: dict[str, dict[str, Any]]
               ) -> tuple[dict[str, dict[str, Any]], int]:
    """Write every file not reusable from an interrupted run (``workers`` sets at once; None:
    :func:`auto_workers`); returns each file's record and the workers used."""
    if on_total:
        on_total(total)
    records: dict[str, dict[str, Any]] = {}
    todo, redone = [], []
    for job in jobs:
        rec, why = _reusable(job, folder, src, idents) if resume else (None, "")
        if rec is not None:
            records[job.name] = {**rec, "reused": True}
            if progress:
                progress(job.nbytes)
        else:
            todo.append(job)
            if why and why != "unfinished":
                redone.append(f"{job.name} ({why})")
    if redone and notify:
        notify(f"--resume: writing {len(redone)} finished file(s) again: {redone[0]}"
               + (f" and {len(redone) - 1} more" if len(redone) > 1 else ""))
    sets = _file_sets(todo)
    workers = workers or auto_workers(sets)
    depth = _depth(workers)
    if workers <= 1:
        for fs in sets:
            for job, rec in zip(fs, _write_files(src, fs, folder, idents, progress, depth=depth)):
                records[job.name] = rec
        return records, workers
    # Threads, not processes: reading, shuffling, hashing and writing all run outside the GIL
    # (preadv, torch copies, xxhash, pwrite), and threads share the opened source, where each
    # process had to import torch and parse every header again. One torch intra-op thread per
    # worker and core share, not a full pool each.
    torch_threads = torch.get_num_threads()
    torch.set_num_threads(max(1, torch_threads // workers))
    cancel = threading.Event()
    lock = threading.Lock()

    def done(n: int) -> None:
        with lock:
            progress(n)

    try:
        with cf.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="convert") as pool:
            futures = {pool.submit(_write_files, src, fs, folder, idents, done if progress else None, cancel, depth): fs
                       for fs in sets}
            try:
                for fut in cf.as_completed(futures):
                    for job, rec in zip(futures[fut], fut.result()):
                        records[job.name] = rec
            except BaseException:
                cancel.set()  # files in progress stop at their next chunk, queued ones never start
                for f in futures:
                    f.cancel()
                raise
    finally:
        torch.set_num_threads(torch_threads)
    return records, workers


def recorded_target(target: Target, arch: str, used_layouts: set[str]) -> Target:
    """``target`` as the manifest records it: with the source's ``arch``; the layouts of BF16
    experts and FP8 weights only where the format has them (rank-exact) and, the FP8 ones, only
    where used (a checkpoint without FP8 weights records none, as before they existed)."""
    exact = target.rank_exact
    channel = target.fp8_channel_layouts
    return dataclasses.replace(
        target, arch=arch, bf16_moe_layout=target.bf16_moe_layout if exact else None,
        fp8_layout=target.fp8_layout if exact and target.fp8_layout in used_layouts else None,
        fp8_channel_layouts=channel if exact and channel and channel[0] in used_layouts else None)


def build_manifest(src: SourceCheckpoint, target: Target, jobs: list[FileJob],
                   records: dict[str, dict[str, Any]], info: dict[str, Any]) -> schema.Manifest:
    """The manifest of a finished conversion, as the typed records of :mod:`layouts.manifest`
    (write ``.to_json()``): every output file, group and tensor, with the hashes in ``records``."""
    tensors = []
    groups = []
    used_layouts = {target.layout, target.moe_layout}
    used_layouts |= {g.layout.name for j in jobs for g in j.groups if g.layout}
    for job in jobs:
        hashes = records[job.name]["hashes"]
        for g in job.groups:  # every group kind answers the same: its dtype, attributes, outputs
            groups.append(g.record(job.name))
            transforms, attrs = tuple(g.transforms()), g.runtime_attrs()
            for (name, role, shape), sources in zip(g.outputs(), g.output_sources()):
                tensors.append(schema.TensorRecord(name, g.rank, job.name, g.dtype, tuple(shape), role,
                                                   g.layout.name if g.layout else None,
                                                   g.key, dict(attrs), hashes[name], tuple(compress_names(sources)),
                                                   transforms))
        # A whole tensor in a common file is read by every rank (format 1, and a vision tower the
        # engine loads itself) or, rank-exact, by none.
        role = "unread" if job.rank is None and target.rank_exact and not job.engine_loads else "passthrough"
        for name in job.passthrough:
            ti = src.tensors[name]
            tensors.append(schema.TensorRecord(name, job.rank, job.name, ti.dtype, tuple(ti.shape), role,
                                               None, None, {}, hashes[name], (name,), ()))
        for c in job.constants:  # from no source tensor: what the engine initialises them to
            tensors.append(schema.TensorRecord(c.name, job.rank, job.name, c.dtype, c.shape, "constant", None, None,
                                               {}, hashes[c.name], (), ({"op": "fill", "value": c.value},)))
    return schema.Manifest(
        tool=schema.Tool("prep", __version__),
        layouts_version=layouts.__version__,
        source=schema.Source(
            origin=dict(src.origin),
            files=src.file_records(),
            tensors={n: schema.SourceTensor(t.dtype, tuple(t.shape), t.file) for n, t in src.tensors.items()},
            wrapper=src.wrapper),
        target=recorded_target(target, info["arch"], used_layouts),
        layouts={n: schema.LayoutRecord.of(layouts.get_layout(n)) for n in sorted(used_layouts)},
        files={j.name: schema.FileRecord(j.rank, records[j.name]["size"], len(j.entries)) for j in jobs},
        groups=groups,
        tensors=tensors,
        format_version=schema.WRAPPED_VERSION if src.wrapper else schema.FORMAT_VERSION,
    )
