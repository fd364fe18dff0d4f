"""Reading a converted checkpoint back: its manifest, its groups, and each rank's tensors, and
turning every group back into the source tensors it came from (the exact inverse)."""

from __future__ import annotations

import dataclasses
import itertools
import math
import os
import pathlib
from collections import Counter, defaultdict
from typing import Any, Iterator, Mapping

import torch

from layouts.loader import open_pinned
from layouts.manifest import GroupRecord, ManifestError, SourceTensor, TensorRecord, load_manifest
from layouts.safetensors_file import ITEMSIZE, TORCH_DTYPES

from .bf16 import Bf16Group, as_planned
from .errors import PrepError
from .group_records import group_from_record
from .groups import LinearGroup, MoEGroup
from .source import ShardFile

# What reading back holds at once: stacked experts are inverted in blocks of about this much per
# rank, and every source tensor is read, compared and written in blocks of rows of at most this
# much (an embedding is 1.8 GiB). PREP_STREAM_BYTES sets it (tests make it small).
STREAM_BYTES = int(os.environ.get("PREP_STREAM_BYTES") or 32 << 20)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` hold the same bytes (dtype and shape aside: the caller checks
    those). Compared as integers, never as floats: ``torch.equal`` of BF16 calls -0.0 equal to
    0.0, so a changed sign bit passed, and NaN unequal to itself, so identical copies of a tensor
    holding a NaN were called different. 8 bytes at a time where both start 8-aligned in their
    storage (3.6x a byte compare on the 2-core VM: 8.7 against 2.4 GiB/s)."""
    a = a.contiguous().reshape(-1).view(torch.uint8)
    b = b.contiguous().reshape(-1).view(torch.uint8)
    if a.numel() != b.numel():
        return False
    if a.storage_offset() % 8 or b.storage_offset() % 8:  # torch views words only from aligned offsets
        return bool(torch.equal(a, b))
    n = a.numel() // 8 * 8
    return bool(torch.equal(a[:n].view(torch.int64), b[:n].view(torch.int64)) and torch.equal(a[n:], b[n:]))


def row_blocks(shape: tuple[int, ...], itemsize: int, budget: int | None = None) -> Iterator[slice | None]:
    """Slices of dim 0 that cover a tensor of ``shape`` in blocks of at most ``budget`` bytes
    (default :data:`STREAM_BYTES`; one row when a row is larger); None for a 0-d tensor."""
    if not shape:
        yield None
        return
    row = itemsize * math.prod(shape[1:])
    step = max(1, (budget or STREAM_BYTES) // max(1, row))
    for r0 in range(0, shape[0], step):
        yield slice(r0, min(shape[0], r0 + step))


class ConvertedCheckpoint:
    """A converted checkpoint opened for inversion. With ``check_hashes``, every tensor read is
    checked against its manifest hash as its bytes come in (what ``prep revert`` relies on: a
    flipped byte stops it before anything reaches DEST); off where the caller hashed every file
    already (``prep verify``)."""

    def __init__(self, root: str | pathlib.Path, check_hashes: bool = False, streams: int = 1):
        self.root = pathlib.Path(root)
        # Every file is read through the folder's open descriptor (/proc/self/fd/N/NAME), as a rank
        # load reads it (layouts.loader.PinnedFolder): a ``convert --force`` that swaps another folder
        # in meanwhile makes the reads fail and the folder's check say so, never mixes two outputs'
        # files (revert --no-verify then rebuilt a source from both).
        self._folder = open_pinned(self.root)
        self.via = self._folder.via
        self.check_hashes = check_hashes
        # Bytes of a block: :data:`STREAM_BYTES`, shared out where ``streams`` units are inverted
        # at once (``verify --source``), so that what they hold together stays the same.
        self.stream_bytes = max(1, STREAM_BYTES // max(1, streams))
        self._hashing: dict[tuple[str, str], tuple[Any, int]] = {}  # (file, tensor) -> (hasher, bytes fed)
        try:
            self.manifest = load_manifest(self.via)  # a ManifestError keeps its type: the CLI prints it
        except ManifestError as e:
            raise ManifestError(self.shown(str(e))) from None
        self.manifest.read_from(self.root)
        # load_manifest checked the marker's hash against the manifest's bytes.
        self.manifest_sha256 = self.manifest.sha256
        self._files: dict[str, ShardFile] = {}
        # Indexes over the manifest, so that walking every group stays linear in its size.
        self.by_file: dict[str, list[TensorRecord]] = defaultdict(list)
        self._groups: dict[str, list[GroupRecord]] = defaultdict(list)  # group name -> its per-rank records
        self._sources: dict[str, dict[str, None]] = defaultdict(dict)  # group name -> source tensors, in order
        self._passthrough: dict[str, TensorRecord] = {}
        self._want = {(t.file, t.name): t.xxh3_128 for t in self.manifest.tensors}
        self._check_source_sizes()
        for t in self.manifest.tensors:
            self.by_file[t.file].append(t)
            if t.role in ("passthrough", "unread"):  # whole; rank-exact: a copy in each rank's files
                first = self._passthrough.setdefault(t.name, t)
                if first.xxh3_128 != t.xxh3_128:
                    raise PrepError(f"{self.root}: the copies of replicated tensor {t.name} have different hashes "
                                    f"({first.file}, {t.file}); the manifest is damaged: convert again")
        for rec in self.manifest.groups:
            self._groups[rec.name].append(rec)
            self._sources[rec.name].update(dict.fromkeys(self._group(rec).sources()))

    @property
    def source_tensors(self) -> Mapping[str, SourceTensor]:
        """The source checkpoint's tensors as the manifest states them (what inverting rebuilds)."""
        return self.manifest.source.tensors

    def _check_source_sizes(self) -> None:
        """Every source tensor the manifest describes is rebuilt in memory from bytes the files
        hold: one larger than all files together is a damaged or hostile manifest, refused
        before it drives an allocation."""
        from .safetensors_writer import nbytes

        if self.manifest.source is None:  # load_manifest checked its types when it is there
            raise PrepError(f"{self.root}: the manifest has no source tensor table; convert again")
        budget = sum(f.size for f in self.manifest.files.values())
        try:
            for name, meta in self.source_tensors.items():
                if nbytes(meta.dtype, meta.shape) > budget:
                    raise PrepError(f"{self.root}: the manifest's source tensor {name} ({meta.dtype} "
                                    f"{list(meta.shape)}) is larger than all the files together; the manifest "
                                    "is damaged: convert again")
        except ManifestError:  # an entry the table's first reading refuses: it names the entry
            raise
        except (KeyError, ValueError):  # a dtype nbytes does not know
            raise PrepError(f"{self.root}: the manifest's source tensor table is malformed; convert again") from None
        # The table against the tensor records, which the manifest holds beside it: each record's
        # sources are in it, with the record's dtype (prep changes where bytes go, never their type).
        # A table edited and resealed (an entry dropped, a dtype changed) made verify --source an
        # internal error and revert write a tensor under the wrong dtype.
        table = self.source_tensors
        for rec in self.manifest.tensors:
            for src in rec.source_names():
                meta = table.get(src)
                if meta is None:
                    raise PrepError(f"{self.root}: tensor {rec.name} was made from {src}, which the source tensor "
                                    "table does not hold; the folder was modified: convert again")
                if meta.dtype != rec.dtype:
                    raise PrepError(f"{self.root}: tensor {rec.name} is {rec.dtype}, but the source tensor table "
                                    f"says its source {src} was {meta.dtype}; the folder was modified: convert again")

    def file(self, fname: str) -> ShardFile:
        """The opened output file ``fname`` (opened once, through the pinned folder)."""
        f = self._files.get(fname)
        if f is None:
            if not (self.via / fname).is_file():
                self.check_unmoved()
                raise PrepError(f"{self.root / fname}: listed in the manifest but missing; convert again")
            try:
                f = self._files[fname] = ShardFile(self.via / fname)
            except Exception as e:
                self.check_unmoved()
                if e.args and not isinstance(e, OSError):
                    e.args = (self.shown(str(e)),) + e.args[1:]
                raise
        return f

    def shown(self, message: str) -> str:
        """``message`` naming the folder by its path, not the descriptor it is read through."""
        return self._folder.shown(message)

    def check_unmoved(self) -> None:
        """Refuse a folder no longer at its path (replaced or removed since it was opened)."""
        self._folder.check()

    def close(self) -> None:
        folder = getattr(self, "_folder", None)
        if folder is not None:
            folder.close()

    def __del__(self) -> None:
        self.close()

    def read(self, fname: str, name: str) -> torch.Tensor:
        return self.read_rows(fname, name, None)

    def read_rows(self, fname: str, name: str, rows: slice | None) -> torch.Tensor:
        """Tensor ``name`` of output file ``fname``, or a block of its rows (hash-checked)."""
        f = self.file(fname)
        info = f.tensors.get(name)
        if info is None:
            raise PrepError(f"{self.root / fname}: tensor {name} is missing from the file; convert again")
        t = f.read(info, rows)
        if self.check_hashes:
            self._feed(fname, info, rows, t)
        return t

    def _feed(self, fname: str, info, rows: slice | None, t: torch.Tensor) -> None:
        """Hash ``t`` (rows ``rows`` of ``info``) as part of its tensor's bytes; compare with the
        manifest once the last byte is in. Blocks arrive in order; one that does not (never the
        case for the inversion's order) gets the whole tensor hashed with a read of its own."""
        import xxhash

        from layouts.safetensors_file import tensor_bytes

        key = (fname, info.name)
        row_bytes = info.nbytes // info.shape[0] if info.shape and info.shape[0] else info.nbytes
        start = 0 if rows is None else (rows.start or 0) * row_bytes
        h, fed = self._hashing.pop(key, (None, 0))
        if start != fed:
            digest = self.file(fname).hash_tensors([info.name])[info.name]
        else:
            h = h or xxhash.xxh3_128()
            h.update(tensor_bytes(t))
            fed += t.numel() * t.element_size()
            if fed < info.nbytes:
                self._hashing[key] = (h, fed)
                return
            digest = h.hexdigest()
        if digest != self._want[key]:
            raise PrepError(f"{self.root / fname}: tensor {info.name} does not match its manifest hash; the file was "
                            "modified or damaged: convert again (or pass --no-verify to read it anyway)")

    def _group(self, rec: GroupRecord) -> LinearGroup | MoEGroup | Bf16Group:
        """The group that builds and inverts ``rec``'s tensors, in its layout as the manifest
        records it (the version the bytes were written with)."""
        return group_from_record(rec, self.manifest.recorded_layout)

    def invert_group(self, key: str) -> dict[str, torch.Tensor]:
        """Every source tensor the group ``key`` came from, rebuilt from all its ranks, whole."""
        tiles = _Tiles(self.source_tensors)
        for rec in self._groups[key]:
            g = self._group(rec)
            tensors = [self.read(rec.file, name) for name, _, _ in g.outputs()]
            for src_name, (rows, cols), piece in g.invert(tensors):
                tiles.place(src_name, rows, cols, piece, rec.rank)
        for name in tiles.out:
            tiles.check_complete(name)
        return tiles.out

    def iter_source_tensors(self, unit: str) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, tensor) of every source tensor of ``unit``, in :meth:`units` order.

        Stacked experts are inverted a block of experts at a time, on every rank, and each
        source tensor is handed out once its pieces are all in: memory holds a block per rank,
        not a layer (an R1 layer's experts are ~5.5 GB). Blocks are exact where the layout
        transforms experts independently (``MoEGroup.blocks_exact``, what convert's chunked build
        relies on too); other groups are inverted whole."""
        t = self._passthrough.get(unit)
        if t is not None:
            yield unit, self.read(t.file, unit)
            return
        recs = self._groups[unit]
        groups = [self._group(r) for r in recs]
        if all(isinstance(g, Bf16Group) for g in groups):
            if groups[0].stacked:
                yield from self._iter_bf16_experts(unit, recs, groups)
            else:  # a split tensor: its blocks of rows, joined
                for name, blocks in itertools.groupby(self._bf16_row_blocks(unit, recs, groups), key=lambda b: b[0]):
                    yield name, torch.cat([t for _, _, t in blocks])
            return
        if not all(isinstance(g, MoEGroup) and g.blocks_exact(0) and g.blocks_exact(2) for g in groups):
            whole = self.invert_group(unit)
            for name in self._sources[unit]:
                yield name, whole[name]
            return
        names = list(self._sources[unit])
        tiles = _Tiles(self.source_tensors)
        # Under EP the shared expert is whole on every rank: keep its tensors to compare the copies.
        held = Counter(e for g in groups for e in g.experts)
        keep = {n for n in names if held[n.rsplit(".", 2)[0]] > 1} if groups[0].ep > 1 else set()
        steps = [(r, g, e0, e0 + _step(g, self.stream_bytes)) for r, g in zip(recs, groups)
                 for e0 in range(0, len(g.experts), _step(g, self.stream_bytes))]
        if groups[0].ep == 1:  # every rank holds a slice of every expert: go block by block across ranks
            steps.sort(key=lambda s: s[2])

        def place() -> Iterator[None]:
            for rec, g, e0, e1 in steps:
                sub = dataclasses.replace(g, experts=g.experts[e0:e1])
                tensors = [self._expert_rows(rec.file, name, local[1], e0, len(sub.experts))
                           for (name, _, _), local in zip(g.outputs(), g.local_shapes())]
                for src_name, (rows, cols), piece in sub.invert(tensors):
                    tiles.place(src_name, rows, cols, piece, rec.rank)
                yield

        yield from tiles.hand_out(names, keep, place())

    def _iter_bf16_experts(self, unit: str, recs: list[GroupRecord], groups: list[Bf16Group]
                           ) -> Iterator[tuple[str, torch.Tensor]]:
        """The source tensors of stacked BF16 experts, each rank's stored tensor read and taken
        out of its layout a block of whole experts (about STREAM_BYTES) at a time, each expert's
        tensor handed out once whole. A window several ranks hold (the shared expert under EP)
        is kept to compare the later copies with."""
        names = list(self._sources[unit])
        held = Counter((p.source, p.dim, p.start) for g in groups for p in g.placements)
        keep = {key[0] for key, n in held.items() if n > 1}
        steps = []
        split = any(p.dim is not None for g in groups for p in g.placements)  # every rank holds a slice
        for rec, g in zip(recs, groups):
            self._check_bf16(rec, g)
            shape = g.shape
            # An expert is whole once every rank's block is read: the budget counts all of them.
            whole = math.prod(shape[1:]) * ITEMSIZE[g.dtype] * (len(recs) if split else 1)
            step = max(1, self.stream_bytes // max(1, whole))
            steps += [(b0, rec, g, min(shape[0], b0 + step)) for b0 in range(0, shape[0], step)]
        if split:  # block by block across ranks
            steps.sort(key=lambda s: s[0])
        tiles = _Tiles(self.source_tensors)

        def place() -> Iterator[None]:
            for b0, rec, g, b1 in steps:
                block = g.from_layout(self.read_rows(rec.file, g.name, slice(b0, b1)))
                for p in g.placements:
                    if b0 <= p.slot < b1:
                        tiles.place(p.source, p.rows, p.cols, block[p.slot - b0, p.dest_row:p.dest_row + p.out_shape[0]],
                                    rec.rank)
                yield

        yield from tiles.hand_out(names, keep, place())

    def _check_bf16(self, rec: GroupRecord, g: Bf16Group) -> None:
        """A BF16 group record agrees with its stored tensor and the source table (a damaged
        manifest would otherwise cut the wrong windows)."""
        g.check()  # its windows tile the stored tensor
        info = self.file(rec.file).tensors.get(g.name)
        bad = next((p.source for p in g.placements if p.source not in self.source_tensors
                    or as_planned(self.source_tensors[p.source].shape) != p.shape), None)
        if info is None or tuple(info.shape) != g.stored_shape or bad:
            raise PrepError(f"{self.root / rec.file}: {g.name} (rank {rec.rank}) does not match its group record"
                            + (f" (source {bad})" if bad else "") + "; the manifest is damaged: convert again")

    def iter_source_blocks(self, unit: str) -> Iterator[tuple[str, slice | None, torch.Tensor]]:
        """(name, rows, bytes) of every source tensor of ``unit`` in blocks of rows of at most
        :data:`STREAM_BYTES`, in :meth:`units` order and in row order: what ``verify --source``
        compares and ``revert`` writes, so neither holds a tensor whole. A pass-through tensor
        is read a block at a time, a split BF16 tensor (an embedding cut by vocabulary, ``o_proj``
        by columns) is put together a block of source rows at a time from its ranks' windows;
        other groups' tensors come from :meth:`iter_source_tensors` (experts a block at a time; a
        dense linear, a few hundred MiB at most, whole)."""
        t = self._passthrough.get(unit)
        if t is not None:
            info = self.file(t.file).tensors.get(unit)
            if info is None:
                raise PrepError(f"{self.root / t.file}: tensor {unit} is missing from the file; convert again")
            for rows in row_blocks(tuple(info.shape), ITEMSIZE[info.dtype], self.stream_bytes):
                yield unit, rows, self.read_rows(t.file, unit, rows)
            return
        recs = self._groups.get(unit, [])
        groups = [self._group(r) for r in recs]
        if groups and all(isinstance(g, Bf16Group) and not g.stacked for g in groups):
            yield from self._bf16_row_blocks(unit, recs, groups)
            return
        for name, whole in self.iter_source_tensors(unit):
            for rows in row_blocks(tuple(whole.shape), whole.element_size(), self.stream_bytes):
                yield name, rows, whole if rows is None else whole[rows]

    def _bf16_row_blocks(self, unit: str, recs: list[GroupRecord], groups: list[Bf16Group]
                         ) -> Iterator[tuple[str, slice, torch.Tensor]]:
        """Each source tensor of a split, unstacked BF16 unit a block of rows at a time, each
        block filled from the rows of every rank's stored tensor that hold it (windows are
        whole row ranges of the source or whole column ranges). Every element must come from
        some rank, and a window several ranks hold (replicated) must be the same on each."""
        for rec, g in zip(recs, groups):
            self._check_bf16(rec, g)
        for name in self._sources[unit]:
            meta = self.source_tensors[name]
            planned = as_planned(meta.shape)  # a 1-D scale is assembled as its column, handed back 1-D
            for rows in row_blocks(tuple(meta.shape), ITEMSIZE[meta.dtype], self.stream_bytes):
                tiles = _Tiles({name: SourceTensor(meta.dtype, (rows.stop - rows.start, *planned[1:]), meta.file)})
                for rec, g in zip(recs, groups):
                    for local, cols, stored_rows in g.window_rows(name, rows):
                        held = g.stored_rows(lambda r, rec=rec, g=g: self.read_rows(rec.file, g.name, r), stored_rows)
                        tiles.place(name, local, cols, held, rec.rank)
                tiles.check_complete(name)
                t = tiles.pop(name)
                yield name, rows, t.reshape(-1) if len(meta.shape) == 1 else t

    def _expert_rows(self, fname: str, name: str, rows_per_expert: int, e0: int, n: int) -> torch.Tensor:
        """The stored bytes of experts [e0, e0 + n) of the stacked output ``name``: experts lead
        a 3-D tensor; a 2-D one is a scale flattened over experts, ``rows_per_expert`` rows each."""
        info = self.file(fname).tensors.get(name)
        if info is not None and len(info.shape) == 3:
            return self.read_rows(fname, name, slice(e0, e0 + n))
        return self.read_rows(fname, name, slice(e0 * rows_per_expert, (e0 + n) * rows_per_expert))

    def units(self) -> Iterator[tuple[str, list[str]]]:
        """(unit, source tensor names) in order: each group key, then each pass-through tensor."""
        for key in self._groups:
            yield key, list(self._sources[key])
        for name in self._passthrough:
            yield name, [name]




def _step(g: MoEGroup, budget: int = STREAM_BYTES) -> int:
    """Experts per block when inverting: about ``budget`` bytes of whole experts' ``[gate ; up]``
    (source bytes, pads aside). A block is read on every rank before its experts are whole, so
    it is counted in whole experts, not in one rank's slice (which held 8x the budget at tp 8:
    revert peaked at 1.03 GiB on the real dims, 0.63 at tp 1)."""
    return max(1, budget // max(1, 2 * g.inter * g.hidden // 2))  # [gate ; up] of a whole expert


class _Tiles:
    """Source tensors assembled from rank pieces (rectangular windows of 2-D tensors).

    Coverage is the list of windows placed, not a byte mask: a window seen again is a
    replicated copy and must hold the same bytes, a window that partly overlaps one placed is
    an error, and a tensor is whole when its windows add up to it."""

    def __init__(self, meta: dict[str, SourceTensor]):
        self.meta = meta
        self.out: dict[str, torch.Tensor] = {}
        self.placed: dict[str, list[tuple[int, int, int, int]]] = {}
        self.covered: dict[str, int] = {}
        self.handed: set[str] = set()  # popped: whole and gone

    def place(self, name: str, rows: slice, cols: slice, piece: torch.Tensor, rank: int) -> None:
        if name in self.handed:
            raise PrepError(f"{name}: rank {rank} gives a piece of a tensor that was already whole; "
                            "manifest and files disagree")
        if name not in self.out:
            # In the source's own dtype: a piece is copied by value, so a BF16 piece needs BF16.
            self.out[name] = torch.empty(self.meta[name].shape, dtype=TORCH_DTYPES[self.meta[name].dtype])
            self.placed[name], self.covered[name] = [], 0
        full = self.out[name]
        r0, r1, _ = rows.indices(full.shape[0])
        c0, c1, _ = cols.indices(full.shape[1])
        view = full[r0:r1, c0:c1]
        if view.shape != piece.shape:
            raise PrepError(f"{name}: rank {rank} piece {list(piece.shape)} does not fit "
                            f"{list(view.shape)}; manifest and files disagree")
        rect = (r0, r1, c0, c1)
        if rect in self.placed[name]:  # a replicated tensor: every rank must hold the same bytes
            if not same_bytes(view, piece):
                raise PrepError(f"{name}: replicated copies differ between ranks (rank {rank})")
            return
        if any(r0 < b1 and b0 < r1 and c0 < d1 and d0 < c1 for b0, b1, d0, d1 in self.placed[name]):
            raise PrepError(f"{name}: rank {rank} overlaps another rank's piece")
        view.copy_(piece)
        self.placed[name].append(rect)
        self.covered[name] += (r1 - r0) * (c1 - c0)

    def hand_out(self, names: list[str], keep: set[str], steps: Iterator[None]) -> Iterator[tuple[str, torch.Tensor]]:
        """Run ``steps`` (each places some pieces) and hand out each of ``names``, in order, as
        soon as it is whole; those in ``keep`` stay to compare later copies with (replicated)."""
        cursor = 0
        for _ in steps:
            while cursor < len(names) and self.done(names[cursor]):
                name = names[cursor]
                yield name, self.out[name] if name in keep else self.pop(name)
                cursor += 1
        for name in names[cursor:]:
            self.check_complete(name)  # raises: some rank's piece is missing

    def done(self, name: str) -> bool:
        return name in self.out and self.covered[name] == self.out[name].numel()

    def check_complete(self, name: str) -> None:
        total = self.out[name].numel() if name in self.out else 0
        if name not in self.out or self.covered[name] != total:
            raise PrepError(f"{name}: ranks cover {self.covered.get(name, 0)} of {total} bytes; a rank is missing")

    def pop(self, name: str) -> torch.Tensor:
        """Hand a whole tensor out and forget it (a copy arriving later would be an overlap)."""
        del self.placed[name]
        self.covered.pop(name)
        self.handed.add(name)
        return self.out.pop(name)
