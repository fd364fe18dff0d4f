"""The manifest of a converted checkpoint, parsed and checked, with the answers an engine asks for
(its rank's tensors and files, a layout as recorded, the hash check), and :func:`load_manifest`."""

from __future__ import annotations

import dataclasses
import functools
import json
import pathlib
from typing import Any, Callable

from ..registry import Layout, recorded_layout
from ..safe_files import gc_paused, member_problem
from .check import _check_stacks, _check_whole
from .format import (FORMAT, FORMAT_VERSION, MANIFEST_NAME, SOURCE_TABLE_NAME, WRAPPED_VERSION, ManifestError,
                     _format_problem)
from .groups import GroupRecord
from .hashing import check_tensor_files
from .reading import _load_raw
from .records import FileRecord, LayoutRecord, Target, TensorRecord, Tool
from .source import Source, SourceTensors
from .values import _object


@dataclasses.dataclass(repr=False)
class Manifest:
    """A converted checkpoint's manifest (``prep-manifest.json``), checked, with the answers an
    engine asks for. Build it with :meth:`from_json` (or :func:`load_manifest` for a folder);
    :meth:`to_json` gives back the JSON object, keys in the order prep writes them."""

    target: Target
    tensors: list[TensorRecord]
    files: dict[str, FileRecord] = dataclasses.field(default_factory=dict)
    groups: list[GroupRecord] = dataclasses.field(default_factory=list)
    source: Source | None = None
    layouts: dict[str, LayoutRecord] = dataclasses.field(default_factory=dict)  # every layout used, by name
    tool: Tool | None = None
    layouts_version: str | None = None  # the layouts library that converted it
    format: str = FORMAT
    format_version: int = FORMAT_VERSION
    # Not in the JSON: the folder it was read from (None: built in memory), and the sha256 of its
    # bytes as the completion marker states it (set by load_manifest).
    root: pathlib.Path | None = dataclasses.field(default=None, compare=False)
    sha256: str | None = dataclasses.field(default=None, compare=False)

    # The target's answers, as engines ask for them.
    layout = property(lambda self: self.target.layout)
    moe_layout = property(lambda self: self.target.moe_layout)
    tp = property(lambda self: self.target.tp)
    ep = property(lambda self: self.target.ep)
    arch = property(lambda self: self.target.arch)

    @functools.cached_property
    def group_kinds(self) -> frozenset[str]:
        """The kinds of group it holds: "linear" (MXFP4 dense linears), "moe" (MXFP4 experts),
        "bf16" (split source bytes). A checkpoint without MXFP4 experts (DeepSeek's FP8 release)
        has nothing the MoE layout names, whatever MoE back end reads it."""
        return frozenset(g.kind for g in self.groups)

    @functools.cached_property
    def shared_expert_stacked(self) -> bool:
        """Whether the files hold the shared expert stacked after the routed ones: the target's
        ``fuse_shared_expert`` where its experts could be, but never a BF16 shared expert beside
        MXFP4 routed ones (GLM-5-MXFP4's: engines keep those apart, and prep writes them so)."""
        moe = [g for g in self.groups if g.kind == "moe" or (g.kind == "bf16" and g.stack is not None)]
        if not moe:
            return self.target.fuse_shared_expert
        return any(g.stack.shared if g.stack is not None else any("shared_experts" in e for e in g.experts)
                   for g in moe)

    @classmethod
    def from_json(cls, raw: Any, root: pathlib.Path | None = None) -> "Manifest":
        """The manifest of the parsed JSON ``raw`` (of folder ``root``, whose file names are then
        checked too). Raises :class:`ManifestError` naming the file, what is wrong and the fix."""
        where = MANIFEST_NAME if root is None else root / MANIFEST_NAME
        problem = _format_problem(raw, required=False) if isinstance(raw, dict) else None
        if problem:
            raise ManifestError(f"{where}: {problem}")
        try:
            with gc_paused():  # ~10k records for DeepSeek-R1 at TP 8: see gc_paused
                m = cls._parse(raw, root)
        except ManifestError as e:
            raise ManifestError(f"{where}: {e}; the manifest is damaged or not prep's: convert again") from None
        m.root = root
        if root is not None:
            m._check_members(root)
        return m

    @classmethod
    def _parse(cls, raw: Any, root: pathlib.Path | None = None) -> "Manifest":
        if not isinstance(raw, dict):
            raise ManifestError("not a JSON object")
        target = Target.from_json(raw.get("target"))
        tensors = raw.get("tensors")
        if type(tensors) is not list:
            raise ManifestError(f"tensors is {type(tensors).__name__}, not a list")
        if not isinstance(raw.get("files", {}), dict):
            raise ManifestError("files is not an object")
        groups = raw.get("groups", [])
        if type(groups) is not list or not all(isinstance(g, dict) for g in groups):
            raise ManifestError("groups is not a list of objects")
        # Ranks index per-rank lists in every reader: none may be beyond the target's tp.
        files: dict[str, FileRecord] = {}
        for name, f in raw.get("files", {}).items():
            try:
                files[name] = frec = FileRecord.from_json(f)
            except ManifestError as e:
                raise ManifestError(f"files[{name!r}]: {e}") from None
            if frec.rank is not None and frec.rank >= target.tp:
                raise ManifestError(f"files[{name!r}]: file for rank {frec.rank} of tp={target.tp}")
        group_records: list[GroupRecord] = []
        for i, g in enumerate(groups):
            try:
                group_records.append(grec := GroupRecord.from_json(g))
            except ManifestError as e:
                raise ManifestError(f"groups[{i}]: {e}") from None
            if grec.rank >= target.tp:
                raise ManifestError(f"groups[{i}]: group {grec.name} is for rank {grec.rank} of tp={target.tp}")
        records: list[TensorRecord] = []
        for i, t in enumerate(tensors):
            try:
                rec = TensorRecord.from_json(t)
            except ManifestError as e:
                raise ManifestError(f"tensors[{i}]: {e}") from None
            if rec.rank is not None and rec.rank >= target.tp:
                raise ManifestError(f"tensors[{i}]: tensor {rec.name} is for rank {rec.rank} of tp={target.tp}")
            records.append(rec)
        _check_stacks(group_records, records, files)
        _check_whole(target, group_records, records, files)
        layouts_ = {}
        for name, d in _object(raw.get("layouts", {}), "layouts").items():
            try:
                layouts_[name] = LayoutRecord.from_json(d)
            except ManifestError as e:
                raise ManifestError(f"layouts[{name!r}]: {e}") from None
        source = Source.from_json(raw["source"], root) if raw.get("source") is not None else None
        version_ = raw.get("format_version", FORMAT_VERSION)
        if source is not None and (source.wrapper is not None) != (version_ == WRAPPED_VERSION):
            raise ManifestError(f"format_version {version_} with{'' if source.wrapper else 'out'} source.wrapper: "
                                f"a multimodal source's manifest, and only one, is version {WRAPPED_VERSION}; convert again")
        tool = Tool.from_json(raw["tool"]) if raw.get("tool") is not None else None
        version = raw.get("layouts_version")
        if version is not None and type(version) is not str:
            raise ManifestError(f"layouts_version is {version!r}, not a string")
        return cls(target, records, files, group_records, source, layouts_, tool, version,
                   raw.get("format", FORMAT), raw.get("format_version", FORMAT_VERSION))

    def _check_members(self, root: pathlib.Path) -> None:
        """Every file it names, checked once here so that every reader (load_rank, prep verify
        and revert) is covered: a plain name of a regular file inside the folder."""
        names = dict.fromkeys(t.file for t in self.tensors)
        names.update(dict.fromkeys(self.files))
        names.update(dict.fromkeys(g.file for g in self.groups))
        if self.source is not None and self.source.table is not None:
            names[self.source.table.name] = None
        for name in names:
            problem = member_problem(root, name)
            if problem:
                raise ManifestError(f"{root / MANIFEST_NAME}: {problem}; a converted checkpoint's files are regular "
                                    "files in its folder: refusing to read it (convert again)")

    def to_json(self) -> dict[str, Any]:
        """The JSON object, keys in the order prep has always written them (its bytes are hashed)."""
        with gc_paused():
            return self._to_json()

    def read_from(self, root: pathlib.Path) -> None:
        """Name ``root`` the folder this manifest is read from: a loader that read it through
        another path to the same folder (``/proc/self/fd/N``, closed after the load) names the
        folder by its path, and the source table, read on first use, is read from there too (its
        sha256 still has to be the manifest's)."""
        self.root = root
        if self.source is not None and isinstance(self.source.tensors, SourceTensors):
            self.source.tensors.root = root

    def to_files(self) -> dict[str, bytes]:
        """The bytes of every file this manifest is, by name, the manifest last: from format 4
        the source tensor table (``prep-source.json``), which the manifest names and hashes."""
        m, files = self, {}
        if self.format_version >= 4 and self.source is not None:
            source, files[SOURCE_TABLE_NAME] = self.source.with_table_file()
            m = dataclasses.replace(self, source=source)
        # Compact JSON: the C encoder (indent= falls back to pure Python, 10x slower at ~90k tensors).
        files[MANIFEST_NAME] = json.dumps(m.to_json(), separators=(",", ":")).encode()
        return files

    def _to_json(self) -> dict[str, Any]:
        return {
            "format": self.format,
            "format_version": self.format_version,
            "tool": self.tool.to_json() if self.tool else None,
            "layouts_version": self.layouts_version,
            "source": self.source.to_json() if self.source else None,
            "target": self.target.to_json(),
            "layouts": {n: d.to_json() for n, d in self.layouts.items()},
            "files": {n: f.to_json() for n, f in self.files.items()},
            "groups": [g.to_json() for g in self.groups],
            "tensors": [t.to_json() for t in self.tensors],
        }

    def __repr__(self) -> str:
        return (f"Manifest({self.root}: {self.arch}, layout={self.layout}, moe_layout={self.moe_layout}, "
                f"tp={self.tp}, ep={self.ep}, {len(self.tensors)} tensors)")

    def rank_tensors(self, rank: int) -> list[TensorRecord]:
        """What rank ``rank`` loads: its own tensors and the common ones, in file order (not the
        ``unread`` ones, which no engine reads)."""
        if not 0 <= rank < self.tp:
            raise ManifestError(f"{self.root}: rank {rank} is out of range for a checkpoint converted for tp={self.tp}")
        return [t for t in self.tensors if t.rank in (rank, None) and t.role != "unread"]

    def recorded_layout(self, name: str) -> "Layout":
        """Layout ``name`` as this checkpoint was written with it (its ``layouts`` entry: version
        and transform parameters, :func:`layouts.registry.recorded_layout`), which is what its
        bytes must be read as. Raises :class:`ManifestError` for a layout the manifest does not
        record, :class:`LayoutsError` for one this layouts cannot read."""
        rec = self.layouts.get(name)
        if rec is None:
            where = self.root / MANIFEST_NAME if self.root is not None else MANIFEST_NAME
            raise ManifestError(f"{where}: layout {name!r} is used but not recorded in its layouts; the manifest is "
                                "damaged: convert again")
        return recorded_layout(rec)

    def rank_files(self, rank: int) -> list[str]:
        """The files rank ``rank`` reads, each once, in manifest order (its own files first)."""
        return list(dict.fromkeys(t.file for t in self.rank_tensors(rank)))

    def verify_hashes(self, rank: int | None = None, progress: Callable[[int], None] | None = None,
                      select: Callable[[TensorRecord], bool] | None = None, workers: int = 1) -> int:
        """Check every tensor (of ``rank``, or all) against the manifest: present in its file,
        of the dtype and shape stated, and of the same xxh3-128 (needs ``xxhash``; one
        sequential pass per file, ``workers`` files at once, each holding two 64 MiB read
        buffers). ``progress`` gets each file's tensor bytes once it is hashed, in file order.
        ``select`` keeps only the records it is true for (a reader checks what it reads).
        Returns the number of tensors checked; raises naming the first mismatch in file order:
        its file, tensor and rank. The one hash check of every reader (engines, ``prep verify``).
        The whole folder's check (no ``rank``, no ``select``) reads the source tensor table too,
        which revert needs: its file's hash and every entry (format 4)."""
        if rank is None and select is None and self.source is not None:
            next(iter(self.source.tensors), None)  # iterating reads, parses and checks the table
        records = self.tensors if rank is None else self.rank_tensors(rank)
        if select is not None:
            records = [t for t in records if select(t)]
        check_tensor_files(self.root, records, progress, workers)
        return len(records)


def load_manifest(model_dir: str | pathlib.Path, verify_hashes: bool = False) -> Manifest:
    """Parse and check ``prep-manifest.json`` of ``model_dir``: format, version, the completion
    marker, every entry's types and every file name (and, with ``verify_hashes``, every tensor's
    bytes). Raises :class:`ManifestError`, whatever is wrong with the files."""
    root = pathlib.Path(model_dir)
    raw, digest = _load_raw(root)
    manifest = Manifest.from_json(raw, root)
    manifest.sha256 = digest
    if verify_hashes:
        manifest.verify_hashes()
    return manifest
