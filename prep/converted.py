"""Reading a converted checkpoint back: its manifest, its groups, and each rank's tensors, and
turning every group back into the source tensors it came from (the exact inverse)."""

from __future__ import annotations

import pathlib
from collections import defaultdict
from typing import Iterator

import torch

from layouts.manifest import ManifestError, load_manifest

from .errors import PrepError
from .groups import group_from_record
from .source import ShardFile


class ConvertedCheckpoint:
    def __init__(self, root: str | pathlib.Path):
        self.root = pathlib.Path(root)
        try:
            self.manifest = load_manifest(self.root).raw
        except ManifestError as e:
            raise PrepError(str(e)) from None
        self._files: dict[str, ShardFile] = {}
        # Indexes over the manifest, so that walking every group stays linear in its size.
        self.by_file: dict[str, list[dict]] = defaultdict(list)
        self._groups: dict[str, list[dict]] = defaultdict(list)  # group name -> its per-rank records
        self._sources: dict[str, dict[str, None]] = defaultdict(dict)  # group name -> source tensors, in order
        self._passthrough: dict[str, dict] = {}
        for t in self.manifest["tensors"]:
            self.by_file[t["file"]].append(t)
            if t["role"] == "passthrough":
                self._passthrough[t["name"]] = t
        for rec in self.manifest["groups"]:
            self._groups[rec["name"]].append(rec)
            self._sources[rec["name"]].update(dict.fromkeys(group_from_record(rec).sources()))

    def file(self, fname: str) -> ShardFile:
        """The opened output file ``fname`` (opened once)."""
        f = self._files.get(fname)
        if f is None:
            path = self.root / fname
            if not path.is_file():
                raise PrepError(f"{path}: listed in the manifest but missing; convert again")
            f = self._files[fname] = ShardFile(path)
        return f

    def read(self, fname: str, name: str) -> torch.Tensor:
        return self.file(fname).get(name)

    def invert_group(self, key: str) -> dict[str, torch.Tensor]:
        """Every source tensor the group ``key`` came from, rebuilt from all its ranks.

        Each rank gives rectangular windows of the (2-D) source tensors. Coverage is kept as
        the list of windows placed, not as a byte mask: a window seen again is a replicated
        copy and must hold the same bytes, a window that partly overlaps one placed is an
        error, and at the end the windows must add up to the whole tensor."""
        src_meta = self.manifest["source"]["tensors"]
        out: dict[str, torch.Tensor] = {}
        placed: dict[str, list[tuple[int, int, int, int]]] = {}
        for rec in self._groups[key]:
            g = group_from_record(rec)
            tensors = [self.read(rec["file"], name) for name, _, _ in g.outputs()]
            for src_name, (rows, cols), piece in g.invert(tensors):
                if src_name not in out:
                    out[src_name] = torch.empty(src_meta[src_name]["shape"], dtype=torch.uint8)
                    placed[src_name] = []
                full = out[src_name]
                r0, r1, _ = rows.indices(full.shape[0])
                c0, c1, _ = cols.indices(full.shape[1])
                rect = (r0, r1, c0, c1)
                view = full[r0:r1, c0:c1]
                if view.shape != piece.shape:
                    raise PrepError(f"{src_name}: rank {rec['rank']} piece {list(piece.shape)} does not fit "
                                    f"{list(view.shape)}; manifest and files disagree")
                if rect in placed[src_name]:  # a replicated tensor: every rank must hold the same bytes
                    if not torch.equal(view, piece):
                        raise PrepError(f"{src_name}: replicated copies differ between ranks (rank {rec['rank']})")
                    continue
                if any(r0 < b1 and b0 < r1 and c0 < d1 and d0 < c1 for b0, b1, d0, d1 in placed[src_name]):
                    raise PrepError(f"{src_name}: rank {rec['rank']} overlaps another rank's piece")
                view.copy_(piece)
                placed[src_name].append(rect)
        for name, rects in placed.items():
            covered, total = sum((r1 - r0) * (c1 - c0) for r0, r1, c0, c1 in rects), out[name].numel()
            if covered != total:
                raise PrepError(f"{name}: ranks cover {covered} of {total} bytes; a rank is missing")
        return out

    def units(self) -> Iterator[tuple[str, list[str]]]:
        """(unit, source tensor names) in order: each group key, then each pass-through tensor."""
        for key in self._groups:
            yield key, list(self._sources[key])
        for name in self._passthrough:
            yield name, [name]

    def source_tensors(self, unit: str) -> dict[str, torch.Tensor]:
        t = self._passthrough.get(unit)
        if t is not None:
            return {unit: self.read(t["file"], unit)}
        return self.invert_group(unit)
