"""``prep revert``: rebuild the original Quark checkpoint from a converted one (same tensor names,
dtypes, shapes and bytes; shard boundaries may differ). The layout round trip, made checkable."""

from __future__ import annotations

import json
import pathlib
import shutil
from typing import Callable

from .convert import shard_names
from .converted import ConvertedCheckpoint
from .errors import PrepError
from .source import INDEX_NAME, SIDE_FILES
from .stwriter import TORCH_DTYPES, StreamingSafetensorsWriter, nbytes


def revert(out: str, dest: str | pathlib.Path, force: bool = False,
           progress: Callable[[int], None] | None = None) -> dict:
    ck = ConvertedCheckpoint(out)
    dest = pathlib.Path(dest)
    if dest.exists() and any(dest.iterdir()) and not force:
        raise PrepError(f"{dest}: exists and is not empty; choose another -o or pass --force")
    meta = ck.manifest["source"]["tensors"]

    def size(name: str) -> int:
        return nbytes(meta[name]["dtype"], meta[name]["shape"])

    units = [((unit, names), sum(size(n) for n in names)) for unit, names in ck.units()]
    shards = shard_names(units, "model")
    staging = dest.parent / f".{dest.name}.prep-partial"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    weight_map = {}
    for fname, chunk in shards:
        entries = [(n, meta[n]["dtype"], tuple(meta[n]["shape"])) for _, names in chunk for n in names]
        with StreamingSafetensorsWriter(staging / fname, entries) as w:
            for unit, names in chunk:
                for n, t in ck.iter_source_tensors(unit):  # in ``names`` order, experts a block at a time
                    w.add(n, t.view(TORCH_DTYPES[meta[n]["dtype"]]))
                    weight_map[n] = fname
                    if progress:
                        progress(size(n))
    total = sum(size(n) for n in weight_map)
    (staging / INDEX_NAME).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    for f in SIDE_FILES:
        if (ck.root / f).is_file():
            shutil.copyfile(ck.root / f, staging / f)
    if dest.exists():
        shutil.rmtree(dest)
    staging.rename(dest)
    return {"dest": str(dest), "tensors": len(weight_map), "files": len(shards), "bytes": total}

