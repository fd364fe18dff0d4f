"""``prep revert``: rebuild the original Quark checkpoint from a converted one (same tensor names,
dtypes, shapes and bytes; shard boundaries may differ). The layout round trip, made checkable."""

from __future__ import annotations

import json
import pathlib
import shutil
from typing import Callable

from .convert import SHARD_BYTES
from .converted import ConvertedCheckpoint
from .errors import PrepError
from .source import INDEX_NAME, SIDE_FILES
from .stwriter import ITEMSIZE, StreamingSafetensorsWriter


def revert(out: str, dest: str | pathlib.Path, force: bool = False,
           progress: Callable[[int], None] | None = None) -> dict:
    ck = ConvertedCheckpoint(out)
    dest = pathlib.Path(dest)
    if dest.exists() and any(dest.iterdir()) and not force:
        raise PrepError(f"{dest}: exists and is not empty; choose another -o or pass --force")
    meta = ck.manifest["source"]["tensors"]

    def nbytes(name: str) -> int:
        n = ITEMSIZE[meta[name]["dtype"]]
        for d in meta[name]["shape"]:
            n *= d
        return n

    units = list(ck.units())
    shards: list[list[tuple[str, list[str]]]] = [[]]
    size = 0
    for unit, names in units:
        n = sum(nbytes(x) for x in names)
        if shards[-1] and size + n > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append((unit, names))
        size += n
    staging = dest.parent / f".{dest.name}.prep-partial"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    weight_map = {}
    for i, chunk in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        entries = [(n, meta[n]["dtype"], tuple(meta[n]["shape"])) for _, names in chunk for n in names]
        with StreamingSafetensorsWriter(staging / fname, entries) as w:
            for unit, names in chunk:
                tensors = ck.source_tensors(unit)
                for n in names:
                    w.add(n, tensors[n].view(_torch_dtype(meta[n]["dtype"])) if tensors[n].dtype != _torch_dtype(meta[n]["dtype"]) else tensors[n])
                    weight_map[n] = fname
                    if progress:
                        progress(nbytes(n))
    total = sum(nbytes(n) for n in weight_map)
    (staging / INDEX_NAME).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    for f in SIDE_FILES:
        if (ck.root / f).is_file():
            shutil.copyfile(ck.root / f, staging / f)
    if dest.exists():
        shutil.rmtree(dest)
    staging.rename(dest)
    return {"dest": str(dest), "tensors": len(weight_map), "files": len(shards), "bytes": total}


def _torch_dtype(s: str):
    import torch

    return {"U8": torch.uint8, "BF16": torch.bfloat16, "F32": torch.float32, "F16": torch.float16,
            "I8": torch.int8, "I32": torch.int32, "I64": torch.int64, "F64": torch.float64, "BOOL": torch.bool}[s]
