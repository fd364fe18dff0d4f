"""Reading a converted checkpoint back: its manifest, its groups, and each rank's tensors, and
turning every group back into the source tensors it came from (the exact inverse)."""

from __future__ import annotations

import pathlib
from collections import defaultdict
from typing import Any, Iterator

import torch
from safetensors import safe_open

from layouts.manifest import ManifestError, load_manifest

from .errors import PrepError
from .groups import group_from_record


class ConvertedCheckpoint:
    def __init__(self, root: str | pathlib.Path):
        self.root = pathlib.Path(root)
        try:
            self.manifest = load_manifest(self.root)
        except ManifestError as e:
            raise PrepError(str(e)) from None
        self._handles: dict[str, Any] = {}
        self.by_file: dict[str, list[dict]] = defaultdict(list)
        for t in self.manifest["tensors"]:
            self.by_file[t["file"]].append(t)

    def open_file(self, fname: str):
        h = self._handles.get(fname)
        if h is None:
            path = self.root / fname
            if not path.is_file():
                raise PrepError(f"{path}: listed in the manifest but missing; convert again")
            try:
                h = safe_open(str(path), framework="pt")
            except Exception as e:
                raise PrepError(f"{path}: unreadable ({e}); the file is truncated or corrupt: convert again") from None
            self._handles[fname] = h
        return h

    def read(self, fname: str, name: str) -> torch.Tensor:
        return self.open_file(fname).get_tensor(name)

    def group_keys(self) -> list[str]:
        """Logical groups (one per module, all ranks), in manifest order."""
        seen: dict[str, None] = {}
        for rec in self.manifest["groups"]:
            seen.setdefault(rec["name"], None)
        return list(seen)

    def groups_of(self, key: str) -> list[dict]:
        return [r for r in self.manifest["groups"] if r["name"] == key]

    def invert_group(self, key: str) -> dict[str, torch.Tensor]:
        """Every source tensor the group ``key`` came from, rebuilt from all its ranks."""
        src_meta = self.manifest["source"]["tensors"]
        out: dict[str, torch.Tensor] = {}
        covered: dict[str, torch.Tensor] = {}  # which bytes some rank has provided
        for rec in self.groups_of(key):
            g = group_from_record(rec)
            tensors = [self.read(rec["file"], name) for name, _, _ in g.outputs()]
            for src_name, (rows, cols), piece in g.invert(tensors):
                if src_name not in out:
                    shape = src_meta[src_name]["shape"]
                    out[src_name] = torch.empty(shape, dtype=torch.uint8)
                    covered[src_name] = torch.zeros(shape, dtype=torch.bool)
                view, seen = out[src_name][rows, cols], covered[src_name][rows, cols]
                if view.shape != piece.shape:
                    raise PrepError(f"{src_name}: rank {rec['rank']} piece {list(piece.shape)} does not fit "
                                    f"{list(view.shape)}; manifest and files disagree")
                if seen.all():  # a replicated tensor: every rank must hold the same bytes
                    if not torch.equal(view, piece):
                        raise PrepError(f"{src_name}: replicated copies differ between ranks (rank {rec['rank']})")
                    continue
                if seen.any():
                    raise PrepError(f"{src_name}: rank {rec['rank']} overlaps another rank's piece")
                view.copy_(piece)
                seen.fill_(True)
        for name, seen in covered.items():
            if not seen.all():
                raise PrepError(f"{name}: ranks cover {int(seen.sum())} of {seen.numel()} bytes; a rank is missing")
        return out

    def units(self) -> Iterator[tuple[str, list[str]]]:
        """(unit, source tensor names) in order: each group key, then each pass-through tensor."""
        for key in self.group_keys():
            names: dict[str, None] = {}
            for t in self.manifest["tensors"]:
                if t.get("group") == key:
                    names.update(dict.fromkeys(t["sources"]))
            yield key, list(names)
        for t in self.manifest["tensors"]:
            if t["role"] == "passthrough":
                yield t["name"], [t["name"]]

    def source_tensors(self, unit: str) -> dict[str, torch.Tensor]:
        for t in self.manifest["tensors"]:
            if t["role"] == "passthrough" and t["name"] == unit:
                return {unit: self.read(t["file"], unit)}
        return self.invert_group(unit)
