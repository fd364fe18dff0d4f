"""The ``source`` section: the source checkpoint's files and tensors, the tensor table read from
``prep-source.json`` (format 4) on first use."""

from __future__ import annotations

import dataclasses
import json
import pathlib
import re
from collections.abc import Mapping
from typing import Any, Iterator

from ..families import Wrapper
from ..safe_files import gc_paused, member_problem
from .format import SOURCE_TABLE_FORMAT, SOURCE_TABLE_NAME, ManifestError
from .hashing import manifest_hash
from .reading import _read_json
from .values import _is_count, _object


@dataclasses.dataclass(frozen=True)
class SourceFile:
    """One file of the source checkpoint as it was when converted (``source.files`` entry)."""

    size: int  # bytes
    xxh3_128: str | None = None  # the whole file's hash, only where prep was asked to hash files

    @classmethod
    def from_json(cls, f: Any) -> "SourceFile":
        f = _object(f, "entry")
        size, digest = f.get("size"), f.get("xxh3_128")
        if not _is_count(size):
            raise ManifestError(f"size is {size!r}, not a non-negative integer")
        if digest is not None and type(digest) is not str:
            raise ManifestError(f"xxh3_128 is {digest!r}, not a string")
        return cls(size, digest)

    def to_json(self) -> dict[str, Any]:
        return {"size": self.size} if self.xxh3_128 is None else {"size": self.size, "xxh3_128": self.xxh3_128}


@dataclasses.dataclass(frozen=True)
class SourceTensor:
    """One tensor of the source checkpoint (``source.tensors`` entry): what revert rebuilds."""

    dtype: str  # safetensors dtype string
    shape: tuple[int, ...]
    file: str  # the source shard that held it

    @classmethod
    def from_json(cls, t: Any) -> "SourceTensor":
        # Written plainly (no helper calls, no generator): R1 has ~92k source tensors, and every
        # engine's load_manifest reads them.
        if type(t) is not dict:
            raise ManifestError(f"entry is {type(t).__name__}, not an object")
        dtype, shape, file = t.get("dtype"), t.get("shape"), t.get("file")
        if type(dtype) is not str or type(file) is not str:
            raise ManifestError("dtype and file must be strings")
        if type(shape) is not list:
            raise ManifestError(f"shape is {shape!r}, not a list of non-negative integers")
        for d in shape:
            if type(d) is not int or d < 0:
                raise ManifestError(f"shape is {shape!r}, not a list of non-negative integers")
        return cls(dtype, tuple(shape), file)

    def to_json(self) -> dict[str, Any]:
        return {"dtype": self.dtype, "shape": list(self.shape), "file": self.file}


@dataclasses.dataclass(frozen=True)
class SourceTableRef:
    """Where the source tensor table is (``source.tensors_file``, format 4): a file of the folder
    beside the manifest, its sha256 (the manifest, sealed by the completion marker, vouches for
    the table through it) and its number of entries."""

    name: str
    sha256: str
    count: int

    @classmethod
    def from_json(cls, r: Any) -> "SourceTableRef":
        r = _object(r, "source.tensors_file")
        name, digest, count = r.get("name"), r.get("sha256"), r.get("count")
        if name != SOURCE_TABLE_NAME:  # prep's own name only: the folder's file list is prep's to know
            raise ManifestError(f"source.tensors_file.name is {name!r}, not {SOURCE_TABLE_NAME!r}")
        if type(digest) is not str or not re.fullmatch(r"[0-9a-f]{64}", digest):
            raise ManifestError(f"source.tensors_file.sha256 is {digest!r}, not a sha256 in hex")
        if not _is_count(count):
            raise ManifestError(f"source.tensors_file.count is {count!r}, not a non-negative integer")
        return cls(name, digest, count)

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "sha256": self.sha256, "count": self.count}


def source_table_json(tensors: Mapping[str, SourceTensor]) -> bytes:
    """The bytes of ``prep-source.json`` for ``tensors``: compact JSON, in source order."""
    with gc_paused():
        table = {n: t.to_json() for n, t in tensors.items()}
    return json.dumps({"format": SOURCE_TABLE_FORMAT, "tensors": table}, separators=(",", ":")).encode()


class SourceTensors(Mapping):
    """``source.tensors``: every source tensor, each entry parsed and checked on first use, read
    from ``prep-source.json`` (format 4) or held in the manifest itself (formats 1-3).

    No engine loading a rank reads it, and it is most of the manifest: at R1-0528's 90,910
    source tensors building its records took ~170 ms of every ``load_manifest`` (537 ms in all
    at TP 8, where warm rank ready was 573 ms), and parsing its JSON 69% of the rest, hence its
    own file. ``prep verify``, ``revert`` and ``compare`` read it, and get a ``ManifestError``
    naming the file or the entry on first use."""

    def __init__(self, raw: dict[str, Any] | None = None, *, root: pathlib.Path | None = None,
                 ref: SourceTableRef | None = None):
        self._raw = raw
        # The folder the table is read from, on first use (a loader that read the manifest
        # through /proc/self/fd/N names the folder by its path again: Manifest.read_from).
        self.root, self._ref = root, ref
        self._parsed: dict[str, SourceTensor] = {}
        self._loaded = ref is None and raw is None

    @classmethod
    def held(cls, tensors: Mapping[str, SourceTensor], ref: SourceTableRef) -> "SourceTensors":
        """``tensors`` as they are, written to the file ``ref`` (a manifest being written)."""
        t = cls(root=None, ref=ref)
        t._parsed, t._loaded = dict(tensors), True
        return t

    @property
    def ref(self) -> SourceTableRef | None:
        """The table's file (format 4), or None where the manifest holds the table."""
        return self._ref

    def _read_file(self) -> dict[str, Any]:
        ref = self._ref
        if self.root is None:
            raise ManifestError(f"source.tensors is in {ref.name} beside the manifest, and this manifest was read "
                                "without its folder: load it with load_manifest(folder)")
        path = self.root / ref.name
        damaged = "the folder was modified: convert again"
        problem = member_problem(self.root, ref.name)
        if problem:
            raise ManifestError(f"{self.root}: {problem}; {damaged}")
        raw, obj = _read_json(path, f"{path}: missing (the manifest names it for the source tensors, which revert and "
                                    "verify --source read); convert again", damaged)
        if manifest_hash(raw) != ref.sha256:
            raise ManifestError(f"{path}: its sha256 differs from the manifest's; {damaged}")
        if obj.get("format") != SOURCE_TABLE_FORMAT:
            raise ManifestError(f"{path}: format {obj.get('format')!r} is not {SOURCE_TABLE_FORMAT!r}; {damaged}")
        tensors = _object(obj.get("tensors"), f"{path}: tensors")
        if len(tensors) != ref.count:
            raise ManifestError(f"{path}: {len(tensors)} tensors where the manifest counts {ref.count}; {damaged}")
        return tensors

    def _all(self) -> dict[str, SourceTensor]:
        if not self._loaded:
            raw = self._raw if self._raw is not None else self._read_file()
            where = "" if self._ref is None else f"{self.root / self._ref.name}: "
            with gc_paused():
                for name, entry in raw.items():
                    try:
                        self._parsed[name] = SourceTensor.from_json(entry)
                    except ManifestError as e:
                        self._parsed.clear()
                        raise ManifestError(f"{where}source.tensors[{name!r}]: {e}") from None
            self._raw, self._loaded = None, True
        return self._parsed

    def __getitem__(self, name: str) -> SourceTensor:
        return self._all()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._all())

    def __len__(self) -> int:
        if self._loaded:
            return len(self._parsed)
        return len(self._raw) if self._raw is not None else self._ref.count


@dataclasses.dataclass(frozen=True)
class Source:
    """Where the checkpoint came from and what it held (the ``source`` section): enough to
    rebuild it exactly (``prep revert``) and to tell whether a folder is still that source."""

    # "kind" and where: {"kind": "directory", "path"} or {"kind": "hf", "repo_id", "revision", "snapshot"}
    origin: dict[str, Any]
    files: dict[str, SourceFile]  # every shard and side file, by name
    tensors: Mapping[str, SourceTensor]  # every source tensor, by name, in source order
    # A multimodal source (format 5): its tensors are named here as its language model's family
    # names them, and the source names them wrapper.source_name(name) (what revert writes)
    wrapper: Wrapper | None = None

    def source_name(self, name: str) -> str:
        """The source's own name of tensor ``name`` (a key of :attr:`tensors`)."""
        return self.wrapper.source_name(name) if self.wrapper else name

    @classmethod
    def from_json(cls, s: Any, root: pathlib.Path | None = None) -> "Source":
        """``root``: the folder whose ``prep-source.json`` holds the tensors (format 4)."""
        s = _object(s, "source")
        origin = {k: v for k, v in s.items() if k not in ("files", "tensors", "tensors_file", "wrapper")}
        if type(origin.get("kind")) is not str:
            raise ManifestError(f"source.kind is {origin.get('kind')!r}, not a string")
        files = {}
        for name, entry in _object(s.get("files"), "source.files").items():
            try:
                files[name] = SourceFile.from_json(entry)
            except ManifestError as e:
                raise ManifestError(f"source.files[{name!r}]: {e}") from None
        if "tensors_file" in s:
            tensors = SourceTensors(root=root, ref=SourceTableRef.from_json(s["tensors_file"]))
        else:
            tensors = SourceTensors(_object(s.get("tensors"), "source.tensors"))
        wrapper = None
        if s.get("wrapper") is not None:
            try:
                wrapper = Wrapper.from_json(s["wrapper"])
            except ValueError as e:
                raise ManifestError(f"source.wrapper: {e}") from None
        return cls(origin, files, tensors, wrapper)

    @property
    def table(self) -> SourceTableRef | None:
        """The file holding the tensors (format 4), or None where they are in the manifest."""
        return self.tensors.ref if isinstance(self.tensors, SourceTensors) else None

    def with_table_file(self) -> tuple["Source", bytes]:
        """This source with its tensors moved to ``prep-source.json``, and that file's bytes
        (format 4: the converter writes them beside the manifest)."""
        raw = source_table_json(self.tensors)
        ref = SourceTableRef(SOURCE_TABLE_NAME, manifest_hash(raw), len(self.tensors))
        return dataclasses.replace(self, tensors=SourceTensors.held(self.tensors, ref)), raw

    def to_json(self) -> dict[str, Any]:
        out = {**self.origin, "files": {n: f.to_json() for n, f in self.files.items()}}
        table = self.table
        if table is not None:
            out["tensors_file"] = table.to_json()
        else:
            out["tensors"] = {n: t.to_json() for n, t in self.tensors.items()}
        if self.wrapper is not None:
            out["wrapper"] = self.wrapper.to_json()
        return out
