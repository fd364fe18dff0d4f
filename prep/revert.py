"""``prep revert``: rebuild the original Quark checkpoint from a converted one (same tensor names,
dtypes, shapes and bytes; shard boundaries may differ). The layout round trip, made checkable.

It trusts nothing it reads: every tensor is checked against its manifest hash as its bytes come
in (``verify=False`` skips that), and DEST is written like convert's OUT (:mod:`prep.outdir`):
never inside the input, never over files prep did not write, staged beside DEST and swapped in
only when whole. Any error or Ctrl-C removes the staged copy."""

from __future__ import annotations

import json
import pathlib
from typing import Callable

from layouts.safe_files import member_problem
from layouts.safetensors_file import file_xxh3

from . import __version__
from .file_plan import shard_names
from .converted import ConvertedCheckpoint
from .errors import PrepError
from .identity import side_file_changed
from .fileops import copy_regular, write_json
from .outdir import OutputFolder
from .ownership import REVERT_MARKER
from .source import INDEX_NAME, SIDE_FILES
from .safetensors_writer import TORCH_DTYPES, StreamingSafetensorsWriter, nbytes


def revert(out: str, dest: str | pathlib.Path, force: bool = False, verify: bool = True,
           progress: Callable[[int], None] | None = None, on_total: Callable[[int], None] | None = None) -> dict:
    """Rebuild the source into ``dest``; ``on_total`` gets the bytes to write, ``progress`` each
    tensor's bytes once written."""
    ck = ConvertedCheckpoint(out, check_hashes=verify)
    folder = OutputFolder(dest, inputs=[ck.root], force=force)
    folder.check()
    meta = ck.source_tensors

    def size(name: str) -> int:
        return nbytes(meta[name].dtype, meta[name].shape)

    units = [((unit, names), sum(size(n) for n in names)) for unit, names in ck.units()]
    shards = shard_names(units, "model")
    if on_total:
        on_total(sum(n for _, n in units))
    with folder.locked():
        folder.recover()
        folder.check()  # after recovery: what is at DEST now
        folder.begin({"kind": "revert", "tool": f"prep {__version__}", "options": {}}, resume=False)
        with folder.discarded_on_error(keep_on_interrupt=False):
            weight_map = _write(ck, folder.staging, shards, meta, progress)
            total = sum(n for _, n in units)
            (folder.staging / INDEX_NAME).write_text(
                json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
            written, hashes = [fname for fname, _ in shards] + [INDEX_NAME], {}
            for f in SIDE_FILES:
                recorded = ck.manifest.source.files.get(f)  # convert copied the source's side files as they were
                if recorded is not None and (ck.via / f).is_file():
                    problem = member_problem(ck.via, f)
                    if problem:  # e.g. a symlink out of the folder: never copy what it points at
                        raise PrepError(f"{ck.root}: {problem}; replace it with the file itself")
                    if (ck.via / f).stat().st_size != recorded.size:  # refused by size, unread (a sparse 1 TiB one)
                        raise PrepError(ck.shown(side_file_changed(ck.via / f, recorded)))
                    # Copied through the pinned folder, then the copy is checked: the bytes checked are the bytes
                    # written, whatever replaced the file between the size check and the read.
                    copy_regular(ck.via / f, folder.staging / f, limit=recorded.size)
                    problem = side_file_changed(folder.staging / f, recorded)
                    if problem:
                        raise PrepError(problem.replace(str(folder.staging / f), str(ck.root / f)))
                    written.append(f)
                    # what was written: the hash the check just matched, or (a manifest of an older prep
                    # records none) the copy's, read back
                    hashes[f] = recorded.xxh3_128 or file_xxh3(folder.staging / f)
            # Written last: says which files are prep's (what a later --force may replace: the side
            # files only while they hold these bytes).
            write_json(folder.staging / REVERT_MARKER, {
                "id": f"revert:{ck.manifest_sha256}", "tool": f"prep {__version__}", "files": sorted(written),
                "side_files": hashes})
            folder.commit()
    return {"dest": str(dest), "tensors": len(weight_map), "files": len(shards), "bytes": total,
            "notes": folder.notes}


def _write(ck: ConvertedCheckpoint, staging: pathlib.Path, shards, meta, progress) -> dict[str, str]:
    """Every source tensor, under the source's own name (a multimodal source's language model
    tensors are recorded under its family's names)."""
    weight_map = {}
    named = ck.manifest.source.source_name
    for fname, chunk in shards:
        entries = [(named(n), meta[n].dtype, meta[n].shape) for _, names in chunk for n in names]
        with StreamingSafetensorsWriter(staging / fname, entries) as w:
            for unit, names in chunk:
                # In ``names`` order, each tensor in blocks of rows (experts inverted a block at a
                # time): memory holds a block, whatever the tensor's size.
                for n, rows, t in ck.iter_source_blocks(unit):
                    t = t.view(TORCH_DTYPES[meta[n].dtype])
                    shape = meta[n].shape
                    want = tuple(shape) if rows is None else (rows.stop - rows.start, *shape[1:])
                    if tuple(t.shape) != want:
                        raise PrepError(f"{n}: rebuilt rows {rows} are {list(t.shape)}, the manifest says "
                                        f"{list(want)}; manifest and files disagree")
                    w.write(named(n), t)
                    weight_map[named(n)] = fname
                    if progress:
                        progress(t.numel() * t.element_size())
    return weight_map
