"""The manifest a converted checkpoint carries (``prep-manifest.json``) and its completion marker.

The converter writes it; engines read it (through this module, torch-free JSON) to learn what
every tensor is: layout, rank, runtime attributes, hash. The marker ``prep-complete.json`` is
written last, after every file is in place, and holds the manifest's own hash: a folder without
it, or whose manifest hash differs, is not a finished conversion.

The schema lives here once, as typed records (:class:`Manifest`, :class:`Target`,
:class:`FileRecord`, :class:`GroupRecord`, :class:`TensorRecord`, ...), each with ``from_json``
and ``to_json``; ``FORMAT`` and ``FORMAT_VERSION`` say which format this module reads and
writes. The format, field by field, and its versioning rule: docs/manifest.md.
"""

from __future__ import annotations

import dataclasses
import functools
import pathlib
import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator

from ..errors import LayoutsError
from ..safe_files import (MAX_JSON_BYTES, FileTooLargeError, gc_paused, member_problem, plain_name_problem,
                         read_regular, strict_json)

if TYPE_CHECKING:
    from ..registry import Layout

MANIFEST_NAME = "prep-manifest.json"
COMPLETE_NAME = "prep-complete.json"
FILE_NAME_KEY = "prep_file"  # in each written file's safetensors metadata: the name prep wrote it under
# The source's tensor table (every source tensor's dtype, shape and shard), from version 4 a file
# of its own that the manifest names and hashes: only verify, revert and inspect read it, and at
# R1-0528's 90,910 tensors it was 61% of the manifest's JSON and 69% of parsing it, which every
# rank load paid (docs/BENCHMARKS.md).
SOURCE_TABLE_NAME = "prep-source.json"
SOURCE_TABLE_FORMAT = "prep-source-tensors"
FORMAT = "prep-manifest"
# Bumped when a reader of the previous version would misread a checkpoint of the new one (a field
# that changes meaning, goes away or must be understood to read the bytes); readers refuse any
# version but their own. docs/manifest.md states the rule in full.
FORMAT_VERSION = 4
# Versions this module reads. 1: every non-MXFP4 tensor whole in common files every rank reads.
# 2 (rank-exact): split BF16 tensors (role "bf16_shard", group kind "bf16"), replicated tensors in
# every rank's files, and role "unread" for what no rank reads (kept for revert). 3: a conversion
# for an engine other than ATOM (target.engine, which an older reader would take for ATOM's);
# 4: the source tensor table in SOURCE_TABLE_NAME, named and hashed by source.tensors_file (a
# reader before it finds no source.tensors and calls the manifest damaged). prep writes 4.
READ_VERSIONS = (1, 2, 3, 4)
MAX_TP = 1 << 16  # no engine runs more ranks: a larger tp is a damaged manifest


class ManifestError(LayoutsError):
    """A converted checkpoint's manifest is missing, unfinished, or not one we can read."""


_LAST_INDEX = re.compile(r"^(.*\.)(\d+)(\..+)$")  # the last numeric path component: experts.<i>.
_RANGE = re.compile(r"\{(\d+)\.\.(\d+)\}")


def compress_names(names: Iterable[str]) -> list[str]:
    """Runs of names that differ only in their last numeric component, by consecutive integers,
    as one ``prefix{a..b}suffix`` pattern (``experts.{0..255}.gate_proj.weight``). Exact:
    :func:`expand_names` gives back the same list. A stacked MoE tensor's 257 sources stay one
    line, which keeps a TP 8 manifest of DeepSeek-R1 in megabytes rather than hundreds."""
    out: list[str] = []
    run: list[Any] | None = None  # [prefix, start, stop, suffix]

    def flush() -> None:
        if run is not None:
            p, a, b, sfx = run
            out.append(f"{p}{a}{sfx}" if b == a + 1 else f"{p}{{{a}..{b - 1}}}{sfx}")

    for name in names:
        m = _LAST_INDEX.match(name)
        if m and run is not None and (run[0], run[3]) == (m.group(1), m.group(3)) and run[2] == int(m.group(2)) \
                and m.group(2) == str(int(m.group(2))):
            run[2] += 1
            continue
        flush()
        run = [m.group(1), int(m.group(2)), int(m.group(2)) + 1, m.group(3)] \
            if m and m.group(2) == str(int(m.group(2))) else None
        if run is None:
            out.append(name)
    flush()
    return out


def expand_names(patterns: Iterable[str]) -> list[str]:
    """The inverse of :func:`compress_names`."""
    out: list[str] = []
    for p in patterns:
        m = _RANGE.search(p)
        if m is None:
            out.append(p)
        else:
            out += [f"{p[:m.start()]}{i}{p[m.end():]}" for i in range(int(m.group(1)), int(m.group(2)) + 1)]
    return out


def manifest_hash(raw: bytes) -> str:
    import hashlib

    return hashlib.sha256(raw).hexdigest()


# ------------------------------------------------------------------ the schema
# Every section of prep-manifest.json is a small typed record here, and nowhere else: convert
# builds these and writes ``Manifest.to_json()``; every reader (engines through load_manifest,
# prep's verify, revert, inspect and reference engine) gets them from ``Manifest.from_json``.
# ``from_json`` checks types and says which key is wrong (Manifest.from_json adds the file and
# the fix); ``to_json`` writes the keys in exactly the order prep has always written them,
# because the manifest's bytes are hashed into the completion marker and must not move when the
# code does. Keys a record does not know are ignored on reading (see docs/manifest.md for the
# versioning rule). docs/manifest.md describes every field.


def _is_count(value: Any, low: int = 0) -> bool:
    """An integer >= ``low``; type(): True and 1.0 are not counts."""
    return type(value) is int and value >= low


def _object(value: Any, what: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ManifestError(f"{what} is {type(value).__name__}, not an object")
    return value


def _string_list(value: Any, what: str) -> tuple[str, ...]:
    if type(value) is not list or not all(type(v) is str for v in value):
        raise ManifestError(f"{what} is not a list of strings")
    return tuple(value)


@dataclasses.dataclass(frozen=True)
class Target:
    """What the checkpoint was converted for (the ``target`` section): the conversion options,
    as prep's ``--layout``/``--moe-layout``/``--tp``/``--ep`` and padding set them, and the
    architecture read from the source's config.json. Engines check it against their own
    configuration before loading a byte (:func:`layouts.check_compatibility`)."""

    layout: str  # registered dense layout of every MXFP4 linear
    moe_layout: str  # registered MoE layout of every stacked expert tensor
    tp: int  # tensor-parallel size: one set of rank files per rank
    ep: int = 1  # expert-parallel size: 1, or equal to tp
    fuse_shared_expert: bool = True  # shared expert stacked after the routed ones (slot n_routed)
    inter_pad_to: int = 256  # stacked experts' intermediate dimension padded to a multiple of this
    hidden_pad_to: int = 256  # and their hidden dimension
    # Rank-exact (format 2): BF16 split per rank as the engine holds it, replicated tensors in
    # every rank's files. Absent (format 1): false, every non-MXFP4 tensor in common files.
    rank_exact: bool = False
    # Rank-exact only: the registered layout of stacked BF16 experts (R1-0528's MTP layer), the one
    # the engine's unquantized MoE reads; None: stored unshuffled (the engine shuffles at load).
    bf16_moe_layout: str | None = None
    arch: str = ""  # config.json model_type, e.g. "deepseek_v3"
    # The engine whose per-rank holding the files follow (merged modules, splits, expert map:
    # its profile's ``sharding``). Absent (manifests before it was recorded): "atom".
    engine: str = "atom"
    # Rank-exact only: the registered ``fp8`` layout of FP8 block-scaled weights (DeepSeek's own FP8
    # release), the one the engine holds them in after loading; None (absent): as the source holds
    # them, the engine processing them at load.
    fp8_layout: str | None = None
    # Rank-exact only: the registered ``fp8`` layouts (weight, scale) of FP8 per-channel linears
    # (Quark's per-channel attention), as the engine holds them once loaded; None: the source's bytes.
    fp8_channel_layouts: tuple[str, str] | None = None

    @classmethod
    def from_options(cls, options: dict[str, Any], arch: str) -> "Target":
        """The target of a conversion run with ``options`` (prep's own option record, e.g.
        ``dataclasses.asdict(prep.deepseek.Target(...))``). An option this record has no field
        for is refused, not dropped: an option that changes the bytes must be in the manifest,
        or a reader could not tell two conversions apart."""
        known = {f.name for f in dataclasses.fields(cls)} - {"arch"}
        unknown = [k for k in options if k not in known]
        if unknown:
            raise ManifestError(f"conversion option {unknown[0]!r} has no field in the manifest's target; add it to "
                                "layouts.manifest.Target and docs/manifest.md")
        return cls.from_json({**options, "arch": arch})

    @classmethod
    def from_json(cls, t: Any) -> "Target":
        if not isinstance(t, dict):
            raise ManifestError(f"target is {t!r}, not an object")
        layout, moe_layout, arch = t.get("layout"), t.get("moe_layout"), t.get("arch", "")
        for key, value in (("layout", layout), ("moe_layout", moe_layout), ("arch", arch)):
            if type(value) is not str:
                raise ManifestError(f"target.{key} is {value!r}, not a string")
        # tp drives loops over ranks (engines, prep inspect): an integer in a sane range.
        tp, ep = t.get("tp"), t.get("ep", 1)
        if type(tp) is not int or not 1 <= tp <= MAX_TP:
            raise ManifestError(f"target.tp is {tp!r}, not an integer in [1, {MAX_TP}]")
        if type(ep) is not int or not 1 <= ep <= tp:
            raise ManifestError(f"target.ep is {ep!r}, not an integer in [1, tp={tp}]")
        fuse = t.get("fuse_shared_expert", True)
        if type(fuse) is not bool:
            raise ManifestError(f"target.fuse_shared_expert is {fuse!r}, not true or false")
        pads = t.get("inter_pad_to", 256), t.get("hidden_pad_to", 256)
        for key, value in zip(("inter_pad_to", "hidden_pad_to"), pads):
            if not _is_count(value, 1):
                raise ManifestError(f"target.{key} is {value!r}, not a positive integer")
        rank_exact = t.get("rank_exact", False)
        if type(rank_exact) is not bool:
            raise ManifestError(f"target.rank_exact is {rank_exact!r}, not true or false")
        bf16_moe = t.get("bf16_moe_layout") if rank_exact else None  # format 1 stacks no BF16 experts
        if bf16_moe is not None and type(bf16_moe) is not str:
            raise ManifestError(f"target.bf16_moe_layout is {bf16_moe!r}, not a string")
        engine = t.get("engine", "atom")
        if type(engine) is not str or not 0 < len(engine) <= 64 or not all(c.isalnum() or c in "-_." for c in engine):
            raise ManifestError(f"target.engine is {engine!r}, not an engine name")
        fp8 = t.get("fp8_layout") if rank_exact else None  # format 1 keeps FP8 whole, as the source has it
        if fp8 is not None and type(fp8) is not str:
            raise ManifestError(f"target.fp8_layout is {fp8!r}, not a string")
        channel = t.get("fp8_channel_layouts") if rank_exact else None
        if channel is not None and (type(channel) not in (list, tuple) or len(channel) != 2
                                    or not all(type(n) is str for n in channel)):
            raise ManifestError(f"target.fp8_channel_layouts is {channel!r}, not a [weight, scale] pair of layout names")
        return cls(layout, moe_layout, tp, ep, fuse, *pads, rank_exact, bf16_moe, arch, engine, fp8,
                   None if channel is None else tuple(channel))

    def to_json(self) -> dict[str, Any]:
        return {"layout": self.layout, "moe_layout": self.moe_layout, "tp": self.tp, "ep": self.ep,
                "fuse_shared_expert": self.fuse_shared_expert, "inter_pad_to": self.inter_pad_to,
                "hidden_pad_to": self.hidden_pad_to, **({"rank_exact": True} if self.rank_exact else {}),
                **({"bf16_moe_layout": self.bf16_moe_layout} if self.bf16_moe_layout else {}), "arch": self.arch,
                "engine": self.engine, **({"fp8_layout": self.fp8_layout} if self.fp8_layout else {}),
                **({"fp8_channel_layouts": list(self.fp8_channel_layouts)} if self.fp8_channel_layouts else {})}


@dataclasses.dataclass(frozen=True)
class Tool:
    """Who wrote the manifest (the ``tool`` section)."""

    name: str  # "prep"
    version: str  # prep's version

    @classmethod
    def from_json(cls, t: Any) -> "Tool":
        t = _object(t, "tool")
        if type(t.get("name")) is not str or type(t.get("version")) is not str:
            raise ManifestError("tool needs a string name and version")
        return cls(t["name"], t["version"])

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "version": self.version}


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
    import json

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

    @classmethod
    def from_json(cls, s: Any, root: pathlib.Path | None = None) -> "Source":
        """``root``: the folder whose ``prep-source.json`` holds the tensors (format 4)."""
        s = _object(s, "source")
        origin = {k: v for k, v in s.items() if k not in ("files", "tensors", "tensors_file")}
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
        return cls(origin, files, tensors)

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
        return out


@dataclasses.dataclass(frozen=True)
class LayoutRecord:
    """A layout as it was when the checkpoint was converted (a ``layouts`` entry): the registry's
    ``Layout.describe()``. A reader whose registry has another version of it must not read it."""

    name: str
    version: int
    kind: str  # "dense" or "moe"
    weight_transform: dict[str, Any]  # {"name": "w16" | "identity", ...parameters}
    scale_transform: dict[str, Any]  # {"name": "s32x8" | "s32x8-per-expert" | "identity", ...parameters}
    runtime_attrs: dict[str, Any]  # attributes every tensor of this layout carries

    @classmethod
    def from_json(cls, d: Any) -> "LayoutRecord":
        d = _object(d, "entry")
        name, version, kind = d.get("name"), d.get("version"), d.get("kind")
        if type(name) is not str or type(kind) is not str or not _is_count(version):
            raise ManifestError("needs a string name and kind and an integer version")
        parts = [_object(d.get(k), k) for k in ("weight_transform", "scale_transform", "runtime_attrs")]
        return cls(name, version, kind, *parts)

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "version": self.version, "kind": self.kind,
                "weight_transform": self.weight_transform, "scale_transform": self.scale_transform,
                "runtime_attrs": self.runtime_attrs}


@dataclasses.dataclass(frozen=True)
class FileRecord:
    """One output file (a ``files`` entry, keyed by its name)."""

    rank: int | None  # the rank that reads it; None: a common file every rank reads
    size: int  # bytes
    tensors: int  # how many tensors it holds

    @classmethod
    def from_json(cls, f: Any) -> "FileRecord":
        f = _object(f, "entry")
        rank, size, tensors = f.get("rank"), f.get("size"), f.get("tensors")
        if rank is not None and not _is_count(rank):
            raise ManifestError(f"rank is {rank!r}, not a non-negative integer or null")
        if not _is_count(size) or not _is_count(tensors):
            raise ManifestError(f"size {size!r} and tensors {tensors!r} must be non-negative integers")
        return cls(rank, size, tensors)

    def to_json(self) -> dict[str, Any]:
        return {"rank": self.rank, "size": self.size, "tensors": self.tensors}


@dataclasses.dataclass(frozen=True)
class PartRecord:
    """One source linear of a dense group (a ``parts`` entry): prep's ``groups.Part``."""

    src: str  # source module prefix (``...q_a_proj``)
    n: int  # logical rows
    k: int  # logical columns (values, not bytes)
    split: str  # "rows", "cols" or "none": how tensor parallelism cuts it

    @classmethod
    def from_json(cls, p: Any) -> "PartRecord":
        p = _object(p, "part")
        src, n, k, split = p.get("src"), p.get("n"), p.get("k"), p.get("split")
        if type(src) is not str or split not in ("rows", "cols", "none") or not _is_count(n) or not _is_count(k):
            raise ManifestError(f"part {src!r} needs a string src, integers n and k, split rows, cols or none")
        return cls(src, n, k, split)

    def to_json(self) -> dict[str, Any]:
        return {"src": self.src, "n": self.n, "k": self.k, "split": self.split}


def _window_problem(shape: Any, dim: Any, start: Any, stop: Any, row: Any) -> bool:
    """Whether a source window is malformed: ``shape`` [rows, cols], ``dim`` null, 0 or 1, and
    ``[start, stop)`` inside that dim, landing at an integer ``dest_row`` (a placement's and a
    stack window's fields)."""
    ok = (type(shape) is list and len(shape) == 2 and all(_is_count(d) for d in shape) and dim in (None, 0, 1)
          and type(dim) is not bool and _is_count(start) and _is_count(stop) and _is_count(row))
    return not ok or start > stop or stop > shape[0 if dim is None else dim]


@dataclasses.dataclass(frozen=True)
class Placement:
    """One window of one source tensor and where it lands in a group's local tensors: the one
    placement type of every group (prep's MXFP4 linears and experts compute theirs from the
    group's parameters; a BF16 group's are its manifest's ``placements`` entries, which this is).

    ``shape`` is the source tensor's stored ``[rows, cols]`` (columns count stored units: bytes
    of a packed MXFP4 weight, entries of a scale), ``dim`` the dim the window cuts (null: whole),
    ``[start, stop)`` its range. It lands in local tensor ``output`` (``outputs()`` order; 0 for a
    BF16 group, which has one), ``dest_row`` rows in (merged tensors stack their parts along
    rows) and from column 0, in stacked expert ``slot`` (None: not stacked)."""

    source: str
    shape: tuple[int, int]
    dim: int | None
    start: int
    stop: int
    dest_row: int = 0
    slot: int | None = None
    output: int = 0  # not in the manifest: a BF16 group has one output

    @classmethod
    def from_json(cls, p: Any) -> "Placement":
        p = _object(p, "placement")
        source, shape, dim, start, stop, row, slot = (p.get(k) for k in ("source", "shape", "dim", "start", "stop",
                                                                          "dest_row", "slot"))
        if type(source) is not str or _window_problem(shape, dim, start, stop, row) or not (slot is None
                                                                                              or _is_count(slot)):
            raise ManifestError(f"placement of {source!r} needs a string source, a [rows, cols] shape, dim null, 0 "
                                "or 1, a window [start, stop) inside that dim, an integer dest_row and slot")
        return cls(source, tuple(shape), dim, start, stop, row, slot)

    @classmethod
    def of_window(cls, source: str, shape: tuple[int, int], rows: slice, cols: slice, dest_row: int = 0,
                  slot: int | None = None, output: int = 0) -> "Placement":
        """The placement of window ``(rows, cols)`` of a ``shape`` source tensor, which cuts one
        dim at most (every engine's TP split cuts one)."""
        whole_rows, whole_cols = (rows.start, rows.stop) == (0, shape[0]), (cols.start, cols.stop) == (0, shape[1])
        if whole_rows and whole_cols:
            return cls(source, tuple(shape), None, 0, shape[0], dest_row, slot, output)
        if whole_cols or whole_rows:
            dim, cut = (0, rows) if whole_cols else (1, cols)
            return cls(source, tuple(shape), dim, cut.start, cut.stop, dest_row, slot, output)
        raise ValueError(f"{source}: window {rows}, {cols} of {shape} cuts both dims")

    @property
    def rows(self) -> slice:
        """The source rows the window takes."""
        return slice(self.start, self.stop) if self.dim == 0 else slice(0, self.shape[0])

    @property
    def cols(self) -> slice:
        """The source columns the window takes (a column window fills the stored tensor's width)."""
        return slice(self.start, self.stop) if self.dim == 1 else slice(0, self.shape[1])

    @property
    def out_shape(self) -> tuple[int, int]:
        return self.rows.stop - self.rows.start, self.cols.stop - self.cols.start

    @property
    def window(self) -> tuple[slice, slice]:
        """``(rows, cols)`` of the source tensor."""
        return self.rows, self.cols

    @property
    def dest(self) -> tuple[slice, slice]:
        """``(rows, cols)`` of the local tensor (of its expert ``slot``) the window fills."""
        rows, cols = self.out_shape
        return slice(self.dest_row, self.dest_row + rows), slice(0, cols)

    @property
    def expert(self) -> int | None:
        return self.slot

    def region(self, local: Any) -> Any:
        """The view of ``local`` (output ``output``'s local tensor: for stacked experts, the
        stack of the group that yielded this placement, experts leading) that it fills."""
        return local[self.dest] if self.slot is None else local[self.slot][self.dest]

    @classmethod
    def whole(cls, source: str, shape: tuple[int, ...], dest_row: int = 0, slot: int | None = None
              ) -> "Placement":
        """The whole tensor, as an uncut window is recorded: rows [0, shape[0]) (its columns are the
        tensor's too: a [0, cols) range would not fit a tensor wider than tall)."""
        return cls(source, tuple(shape), None, 0, shape[0], dest_row, slot)

    def to_json(self) -> dict[str, Any]:
        return {"source": self.source, "shape": list(self.shape), "dim": self.dim, "start": self.start,
                "stop": self.stop, "dest_row": self.dest_row, "slot": self.slot}


STACK_PROJECTIONS = ("gate", "up", "down")  # an expert's source tensors: ``...{proj}_proj.{tensor}``
# Which tensor of each projection a stack holds: its weight, or the 128x128 block scales of an FP8
# block-quantized one (DeepSeek's own FP8 release names them ``weight_scale_inv``)
STACK_TENSORS = ("weight", "weight_scale_inv")


@dataclasses.dataclass(frozen=True)
class WindowRecord:
    """The window every expert of a stacked BF16 group takes of one projection (a ``windows``
    entry): a :class:`Placement` without its source and slot, which the expert gives."""

    proj: str  # "gate", "up" or "down"
    shape: tuple[int, int]
    dim: int | None
    start: int
    stop: int
    dest_row: int = 0

    @classmethod
    def from_json(cls, w: Any) -> "WindowRecord":
        w = _object(w, "window")
        proj, shape, dim, start, stop, row = (w.get(k) for k in ("proj", "shape", "dim", "start", "stop", "dest_row"))
        if proj not in STACK_PROJECTIONS or _window_problem(shape, dim, start, stop, row):
            raise ManifestError(f"window of {proj!r} needs a proj {', '.join(STACK_PROJECTIONS)}, a [rows, cols] "
                                "shape, dim null, 0 or 1, a window [start, stop) inside that dim and an integer "
                                "dest_row")
        return cls(proj, tuple(shape), dim, start, stop, row)

    @property
    def out_shape(self) -> tuple[int, int]:
        rows, cols = self.shape
        return (self.stop - self.start if self.dim == 0 else rows), (self.stop - self.start if self.dim == 1 else cols)

    def to_json(self) -> dict[str, Any]:
        return {"proj": self.proj, "shape": list(self.shape), "dim": self.dim, "start": self.start,
                "stop": self.stop, "dest_row": self.dest_row}


@dataclasses.dataclass(frozen=True)
class StackRecord:
    """A stacked BF16 expert group (the R1-0528 MTP layer's ``w13``/``w2``) by its template (a
    ``stack`` entry): the routed expert ids it holds, as ascending ``[start, stop)`` ranges, in
    slot order, the fused shared expert in the slot after them, and the window each expert takes
    of each projection. prep's ``bf16.group_from_record`` expands it into one placement per
    expert and window, the ones the conversion built (a few hundred bytes instead of 257 x 3
    placements per rank)."""

    experts: tuple[tuple[int, int], ...]
    shared: bool
    windows: tuple[WindowRecord, ...]
    tensor: str = "weight"  # of each projection (STACK_TENSORS); written only when not "weight"

    @classmethod
    def from_json(cls, s: Any) -> "StackRecord":
        s = _object(s, "stack")
        experts, shared, windows = s.get("experts"), s.get("shared"), s.get("windows")
        tensor = s.get("tensor", "weight")
        if tensor not in STACK_TENSORS:
            raise ManifestError(f"stack: tensor is {tensor!r}, not one of {', '.join(STACK_TENSORS)}")
        ranges = experts if type(experts) is list and experts else [None]
        if not all(type(r) is list and len(r) == 2 and _is_count(r[0]) and _is_count(r[1], r[0] + 1) for r in ranges):
            raise ManifestError(f"stack: experts is {experts!r}, not a non-empty list of [start, stop) ranges")
        if any(a[1] >= b[0] for a, b in zip(ranges, ranges[1:])):
            raise ManifestError(f"stack: expert ranges {experts!r} overlap, touch or are out of order")
        if type(shared) is not bool:
            raise ManifestError(f"stack: shared is {shared!r}, not true or false")
        if type(windows) is not list or not windows:
            raise ManifestError("stack: windows is not a non-empty list")
        wins = tuple(WindowRecord.from_json(w) for w in windows)
        if len({w.proj for w in wins}) != len(wins):
            raise ManifestError(f"stack: windows name a projection twice: {[w.proj for w in wins]}")
        return cls(tuple(tuple(r) for r in ranges), shared, wins, tensor)

    @property
    def slots(self) -> int:
        return sum(b - a for a, b in self.experts) + self.shared

    @property
    def stored_shape(self) -> tuple[int, int, int]:
        """[slots, rows, cols] of the stored tensor its windows fill."""
        return (self.slots, max(w.dest_row + w.out_shape[0] for w in self.windows),
                max(w.out_shape[1] for w in self.windows))

    def to_json(self) -> dict[str, Any]:
        out = {"experts": [list(r) for r in self.experts], "shared": self.shared,
               "windows": [w.to_json() for w in self.windows]}
        return out if self.tensor == "weight" else {**out, "tensor": self.tensor}


_GROUP_KINDS = ("linear", "moe", "bf16")


@dataclasses.dataclass(frozen=True)
class GroupRecord:
    """What one rank holds of one engine module, with every parameter needed to invert it (a
    ``groups`` entry): a dense linear (``kind`` "linear": its ``parts``) or one MoE layer's
    stacked experts (``kind`` "moe": the fields after ``parts``) or, rank-exact, one split BF16
    tensor (``kind`` "bf16": its ``dtype`` and ``placements``; ``layout`` null unless the bytes
    are in a registered layout). prep's ``group_from_record`` turns ``to_json()`` back into the
    group that builds and inverts the bytes."""

    kind: str  # "linear", "moe" or "bf16"
    name: str  # engine module prefix: ``...fused_qkv_a_proj``, ``...mlp.experts``
    rank: int
    tp: int
    layout: str | None  # null only for a bf16 group stored as the source holds it
    file: str  # the output file that holds its tensors
    parts: tuple[PartRecord, ...] = ()  # linear: the source linears stacked along rows, in order
    experts: tuple[str, ...] = ()  # moe: source expert prefixes, in slot order (shared expert last)
    inter: int = 0  # moe: per-expert intermediate size
    hidden: int = 0  # moe: hidden size
    inter_pad_to: int = 256
    hidden_pad_to: int = 256
    ep: int = 1
    routed: tuple[int, int] | None = None  # moe with ep > 1: global routed expert ids [start, stop)
    dtype: str = ""  # bf16: the stored (and source) safetensors dtype
    placements: tuple[Placement, ...] = ()  # bf16: source windows, in order
    stack: StackRecord | None = None  # bf16 stacked experts: their template, instead of placements

    @classmethod
    def from_json(cls, g: Any) -> "GroupRecord":
        g = _object(g, "entry")
        kind, name, rank, tp, layout, file = (g.get(k) for k in ("kind", "name", "rank", "tp", "layout", "file"))
        if kind not in _GROUP_KINDS:
            raise ManifestError(f"kind is {kind!r}, not one of {', '.join(_GROUP_KINDS)}")
        if type(name) is not str or type(file) is not str or not (type(layout) is str
                                                                  or (layout is None and kind == "bf16")):
            raise ManifestError(f"group {name!r}: name, layout and file must be strings")
        if not _is_count(rank) or not _is_count(tp, 1):
            raise ManifestError(f"group {name}: rank {rank!r} and tp {tp!r} must be integers (tp >= 1)")
        if kind == "bf16":
            dtype, placements, stack = g.get("dtype"), g.get("placements"), g.get("stack")
            if type(dtype) is not str:
                raise ManifestError(f"group {name}: dtype is {dtype!r}, not a string")
            if stack is not None and placements is None:
                try:
                    return cls(kind, name, rank, tp, layout, file, dtype=dtype, stack=StackRecord.from_json(stack))
                except ManifestError as e:
                    raise ManifestError(f"group {name}: {e}") from None
            if stack is not None or type(placements) is not list or not placements:
                raise ManifestError(f"group {name}: a bf16 group needs either a non-empty placements list or a stack")
            return cls(kind, name, rank, tp, layout, file, dtype=dtype,
                       placements=tuple(Placement.from_json(p) for p in placements))
        if kind == "linear":
            parts = g.get("parts")
            if type(parts) is not list or not parts:
                raise ManifestError(f"group {name}: parts is not a non-empty list")
            return cls(kind, name, rank, tp, layout, file, parts=tuple(PartRecord.from_json(p) for p in parts))
        experts = _string_list(g.get("experts"), f"group {name}: experts")
        inter, hidden, ip, hp, ep, routed = (g.get("inter"), g.get("hidden"), g.get("inter_pad_to"),
                                             g.get("hidden_pad_to"), g.get("ep", 1), g.get("routed"))
        if not all(_is_count(v, 1) for v in (inter, hidden, ip, hp, ep)):
            raise ManifestError(f"group {name}: inter, hidden, inter_pad_to, hidden_pad_to and ep must be "
                                "positive integers")
        if routed is not None and (type(routed) is not list or len(routed) != 2
                                   or not all(_is_count(v) for v in routed)):
            raise ManifestError(f"group {name}: routed is {routed!r}, not null or [start, stop]")
        return cls(kind, name, rank, tp, layout, file, (), experts, inter, hidden, ip, hp, ep,
                   tuple(routed) if routed else None)

    def to_json(self) -> dict[str, Any]:
        head = {"kind": self.kind, "name": self.name, "rank": self.rank, "tp": self.tp, "layout": self.layout}
        if self.kind == "linear":
            return {**head, "parts": [p.to_json() for p in self.parts], "file": self.file}
        if self.kind == "bf16" and self.stack is not None:
            return {**head, "dtype": self.dtype, "stack": self.stack.to_json(), "file": self.file}
        if self.kind == "bf16":
            return {**head, "dtype": self.dtype, "placements": [p.to_json() for p in self.placements],
                    "file": self.file}
        return {**head, "experts": list(self.experts), "inter": self.inter, "hidden": self.hidden,
                "inter_pad_to": self.inter_pad_to, "hidden_pad_to": self.hidden_pad_to, "ep": self.ep,
                "routed": list(self.routed) if self.routed else None, "file": self.file}


@dataclasses.dataclass(frozen=True)
class TensorRecord:
    """One tensor of a converted checkpoint, as the manifest states it (a ``tensors`` entry)."""

    name: str
    rank: int | None  # None: a common (pass-through) tensor every rank reads
    file: str
    dtype: str  # safetensors dtype string
    shape: tuple[int, ...]
    # "mxfp4_weight", "e8m0_scale", "bf16_shard" (a split BF16 tensor), "passthrough" (a source
    # tensor whole: rank null = every rank reads it) or "unread" (whole, read by no rank: kept for revert)
    role: str
    layout: str | None  # registered layout name (MXFP4 tensors)
    group: str | None  # engine module the tensor belongs to
    runtime_attrs: dict[str, Any]  # attributes the engine must set on the parameter
    xxh3_128: str
    # Source tensor names its bytes come from, runs of experts compressed (``compress_names``).
    sources: tuple[str, ...] = ()
    transforms: tuple[dict[str, Any], ...] = ()  # what was done to them, in order ({"op": ...})

    @classmethod
    def from_json(cls, t: dict[str, Any]) -> "TensorRecord":
        """The record of one ``tensors`` entry, its types checked (:class:`ManifestError` saying
        which key is wrong): an engine sets these as attributes and reads files and shapes from
        them, so a wrong type must stop here, not as an AttributeError deep in a loader."""
        if not isinstance(t, dict):
            raise ManifestError(f"entry is {type(t).__name__}, not an object")
        try:
            name, rank, file, dtype, shape, role, digest = (t["name"], t["rank"], t["file"], t["dtype"], t["shape"],
                                                            t["role"], t["xxh3_128"])
        except KeyError as e:
            raise ManifestError(f"entry {t.get('name')!r} lacks the key {e.args[0]!r}") from None
        layout, group, attrs = t.get("layout"), t.get("group"), t.get("runtime_attrs")
        if type(name) is not str or not name.isprintable():
            raise ManifestError(f"entry name {name!r} is not a string of printable characters")
        for key, value, optional in (("file", file, False), ("dtype", dtype, False), ("role", role, False),
                                     ("xxh3_128", digest, False), ("layout", layout, True), ("group", group, True)):
            if type(value) is not str and not (optional and value is None):
                raise ManifestError(f"tensor {name}: {key} is {value!r}, not a string")
        if rank is not None and (type(rank) is not int or rank < 0):  # type(): True and 1.0 are not ranks
            raise ManifestError(f"tensor {name}: rank is {rank!r}, not a non-negative integer or null")
        if type(shape) is not list or not all(type(d) is int and d >= 0 for d in shape):
            raise ManifestError(f"tensor {name}: shape is {shape!r}, not a list of non-negative integers")
        if attrs is not None and not isinstance(attrs, dict):
            raise ManifestError(f"tensor {name}: runtime_attrs is {attrs!r}, not an object")
        sources = _string_list(t.get("sources", []), f"tensor {name}: sources")
        transforms = t.get("transforms", [])
        if type(transforms) is not list or not all(isinstance(x, dict) for x in transforms):
            raise ManifestError(f"tensor {name}: transforms is not a list of objects")
        return cls(name, rank, file, dtype, tuple(shape), role, layout, group, dict(attrs or {}), digest,
                   sources, tuple(transforms))

    def to_json(self) -> dict[str, Any]:
        # An MXFP4 tensor carries group, layout and runtime_attrs; a pass-through one none of them.
        if self.group is None and self.layout is None and not self.runtime_attrs:
            return {"name": self.name, "rank": self.rank, "file": self.file, "dtype": self.dtype,
                    "shape": list(self.shape), "role": self.role, "sources": list(self.sources),
                    "transforms": list(self.transforms), "xxh3_128": self.xxh3_128}
        return {"name": self.name, "rank": self.rank, "file": self.file, "dtype": self.dtype, "shape": list(self.shape),
                "role": self.role, "group": self.group, "layout": self.layout,
                "runtime_attrs": dict(self.runtime_attrs),
                "sources": list(self.sources), "transforms": list(self.transforms), "xxh3_128": self.xxh3_128}

    def source_names(self) -> list[str]:
        """Every source tensor this tensor's bytes come from, runs expanded."""
        return expand_names(self.sources)


def _check_stacks(groups: list[GroupRecord], tensors: list[TensorRecord], files: dict[str, FileRecord]) -> None:
    """A stacked BF16 group's template must fill exactly the tensor recorded for it, and that
    tensor fit its file: the expert ranges are what a reader expands into placements, so their
    count is bounded by bytes really written, not by whatever a damaged record says."""
    stored = {(t.name, t.rank): t for t in tensors if t.role == "bf16_shard"}
    for i, g in enumerate(groups):
        if g.stack is None:
            continue
        shape, t = g.stack.stored_shape, stored.get((g.name, g.rank))
        size = files[t.file].size if t is not None and t.file in files else 0
        if t is None or t.shape != shape or shape[0] * shape[1] * shape[2] > size:
            have = "no bf16_shard tensor" if t is None else f"its tensor is {list(t.shape)} in a {size}-byte file"
            raise ManifestError(f"groups[{i}]: the stack of {g.name} (rank {g.rank}) fills a {list(shape)} tensor but "
                                f"{have}; the manifest is damaged: convert again")


def _rank_label(rank: int | None) -> str:
    """Whose tensor it is, for a message."""
    return "common" if rank is None else f"rank {rank}"


def _format_problem(raw: dict[str, Any], required: bool) -> str | None:
    """Why ``raw`` is not a manifest this module reads (None when it is). ``required``: the keys
    must be there (a file on disk); a manifest built in memory may leave them out."""
    fmt = raw.get("format", None if required else FORMAT)
    version = raw.get("format_version", None if required else FORMAT_VERSION)
    if fmt != FORMAT:
        return f"format {fmt!r} is not {FORMAT!r}; not a checkpoint converted by prep"
    if version not in READ_VERSIONS:  # see docs/manifest.md: another version may mean other bytes
        return (f"format_version {version} is not supported (this layouts reads "
                f"{', '.join(map(str, READ_VERSIONS))}); upgrade prep/layouts")
    return None


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
        import json

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
        from ..registry import recorded_layout  # the registry imports nothing of the manifest

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
        import threading

        from ..safetensors_file import SafetensorsFile, SafetensorsFileError

        if rank is None and select is None and self.source is not None:
            next(iter(self.source.tensors), None)  # iterating reads, parses and checks the table
        records = self.tensors if rank is None else self.rank_tensors(rank)
        if select is not None:
            records = [t for t in records if select(t)]
        by_file: dict[str, list[TensorRecord]] = {}
        for t in records:
            by_file.setdefault(t.file, []).append(t)
        stop = threading.Event()

        def check_file(fname: str, ts: list[TensorRecord]) -> int:
            path = self.root / fname
            try:
                f = SafetensorsFile(path)
            except (FileNotFoundError, SafetensorsFileError) as e:
                raise ManifestError(f"{path}: listed in the manifest but "
                                    f"{'missing' if isinstance(e, FileNotFoundError) else 'unreadable'}; convert again") from None
            for t in ts:
                info = f.tensors.get(t.name)
                if info is None:
                    raise ManifestError(f"{path}: tensor {t.name} is missing from the file; convert again")
                if info.dtype != t.dtype or tuple(info.shape) != t.shape:
                    raise ManifestError(f"{path}: tensor {t.name} ({_rank_label(t.rank)}) is {info.dtype} "
                                        f"{list(info.shape)} but the manifest says {t.dtype} {list(t.shape)}; "
                                        "convert again")
            hashes = f.hash_tensors([t.name for t in ts], stop)
            for t in ts:
                if stop.is_set():
                    return 0  # another file's error (or Ctrl-C) ended the check
                if hashes[t.name] != t.xxh3_128:
                    raise ManifestError(f"{path}: tensor {t.name} does not match its manifest hash "
                                        f"({_rank_label(t.rank)}: its content hash differs); the file was modified "
                                        "or damaged: convert again")
            return sum(f.tensors[t.name].nbytes for t in ts)

        if workers <= 1 or len(by_file) <= 1:
            for fname, ts in by_file.items():
                n = check_file(fname, ts)
                if progress:
                    progress(n)
            return len(records)
        import concurrent.futures as cf

        with cf.ThreadPoolExecutor(min(workers, len(by_file)), thread_name_prefix="prep-hash") as pool:
            futures = [pool.submit(check_file, fname, ts) for fname, ts in by_file.items()]
            try:
                for fut in futures:  # in file order: the first damaged file is the one named
                    n = fut.result()
                    if progress:
                        progress(n)
            finally:  # an error or Ctrl-C: queued files never start, running ones stop at their next block
                stop.set()
                for fut in futures:
                    fut.cancel()
        return len(records)


@dataclasses.dataclass(frozen=True)
class Completion:
    """The completion marker ``prep-complete.json``, written after every other file: a folder
    without it, or whose manifest's sha256 differs, is not a finished conversion."""

    manifest_sha256: str  # sha256 of prep-manifest.json's bytes
    tool: str  # "prep <version>"
    # What the output was made from and how (a hash of options, plan and source identities): a
    # ``--resume`` finding a finished output with its own key has nothing to do.
    run: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {"manifest_sha256": self.manifest_sha256, "tool": self.tool,
                **({"run": self.run} if self.run is not None else {})}


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


def _check_whole(target: "Target", groups: list["GroupRecord"], records: list["TensorRecord"],
                 files: dict[str, "FileRecord"]) -> None:
    """The manifest's records checked against each other, not only each by itself (an edited and
    resealed manifest passed every check one record at a time): each tensor in a file of its own
    rank (a common file for a common tensor), no tensor twice on a rank, each group's layout one
    the target holds (dense, MoE, BF16 experts, FP8 weights), each tensor in its group's layout, and the runtime
    attributes a registered layout states (``is_shuffled``, the scale swizzle) as it states them:
    an engine sets them on its parameters and its kernels read the bytes by them."""
    from ..registry import get_layout  # the registry imports nothing of the manifest
    from ..safetensors_file import TORCH_DTYPES  # imports torch; this module stays torch-free until here

    allowed = {"linear": {target.layout}, "moe": {target.moe_layout},
               "bf16": {None, target.bf16_moe_layout, target.fp8_layout, *(target.fp8_channel_layouts or ())}}
    group_layout: dict[tuple[str, int], str | None] = {}
    for g in groups:
        if g.kind in allowed and g.layout not in allowed[g.kind]:
            raise ManifestError(f"group {g.name} (rank {g.rank}) is in layout {g.layout!r}, which a "
                                f"{target.layout}/{target.moe_layout} target does not hold for a {g.kind} group")
        group_layout[(g.name, g.rank)] = g.layout
    by_key: dict[tuple[str, int | None], TensorRecord] = {}
    for rec in records:
        key = (rec.name, rec.rank)
        if key in by_key:
            raise ManifestError(f"tensor {rec.name} is recorded twice for rank {rec.rank}")
        by_key[key] = rec
        if rec.dtype not in TORCH_DTYPES:
            raise ManifestError(f"tensor {rec.name}: dtype {rec.dtype!r} is not a safetensors dtype prep writes "
                                f"({', '.join(TORCH_DTYPES)})")
        f = files.get(rec.file)
        if files and f is None:
            problem = plain_name_problem(rec.file)  # an escaping name is the thing to name, listed or not
            raise ManifestError(f"tensor {rec.name}: {problem}" if problem else
                                f"tensor {rec.name} is in {rec.file}, which the manifest's files do not list")
        if f is not None and f.rank != rec.rank:
            raise ManifestError(f"tensor {rec.name} is for rank {rec.rank} but its file {rec.file} is "
                                f"{'common' if f.rank is None else f'rank {f.rank}'}'s")
        if rec.group is not None and (rec.group, rec.rank) in group_layout \
                and group_layout[(rec.group, rec.rank)] != rec.layout:
            raise ManifestError(f"tensor {rec.name} is in layout {rec.layout!r} but its group {rec.group} in "
                                f"{group_layout[(rec.group, rec.rank)]!r}")
        if rec.layout is not None:
            try:
                layout = get_layout(rec.layout)
            except (KeyError, LayoutsError):
                continue  # an unknown layout is refused where a reader needs it, with its own fix
            for k, v in layout.runtime_attrs.items():
                if rec.runtime_attrs.get(k, v) != v:
                    raise ManifestError(f"tensor {rec.name}: runtime attribute {k} is {rec.runtime_attrs[k]!r}, but "
                                        f"its layout {rec.layout!r} states {v!r}; an engine would read its bytes "
                                        "as another layout")
    for g in groups:
        if g.kind == "moe":
            _check_moe_shapes(g, by_key.get((f"{g.name}.w13_weight", g.rank)), by_key.get((f"{g.name}.w2_weight", g.rank)))


def _check_moe_shapes(g: "GroupRecord", w13: "TensorRecord | None", w2: "TensorRecord | None") -> None:
    """A MoE group's sizes against its stacked weights' shapes: every reader sizes its reads by the
    group's numbers (an ``inter`` of 1e12 made verify, revert and run fail deep inside as internal
    errors). ``w13`` [slots, 2 * I, H / 2] and ``w2`` [slots, H, I / 2] (bytes of MXFP4), I the rank's
    intermediate padded, H the hidden padded."""
    if w13 is None or w2 is None:
        return  # a group whose tensors are not listed: every reader refuses it where it looks for them
    if len(w13.shape) != 3 or len(w2.shape) != 3:
        raise ManifestError(f"group {g.name} (rank {g.rank}): its stacked w13_weight {list(w13.shape)} and w2_weight "
                            f"{list(w2.shape)} are not both 3-D")
    inter = -(-g.inter // (g.tp if g.ep == 1 else 1))  # the TP split of the intermediate, without expert parallel
    i_pad, h_pad = -(-inter // g.inter_pad_to) * g.inter_pad_to, -(-g.hidden // g.hidden_pad_to) * g.hidden_pad_to
    packed = 2 if w13.dtype == "U8" else 1  # MXFP4: two values a byte
    want13, want2 = (len(g.experts), 2 * i_pad, h_pad // packed), (len(g.experts), h_pad, i_pad // packed)
    if tuple(w13.shape) != want13 or tuple(w2.shape) != want2:
        raise ManifestError(f"group {g.name} (rank {g.rank}): {len(g.experts)} experts, inter {g.inter}, hidden "
                            f"{g.hidden} (padded to {g.inter_pad_to}/{g.hidden_pad_to}, tp {g.tp}, ep {g.ep}) make "
                            f"w13 {list(want13)} and w2 {list(want2)}, but they are {list(w13.shape)} and "
                            f"{list(w2.shape)}")


def _read_json(path: pathlib.Path, missing: str, what: str) -> tuple[bytes, Any]:
    """(bytes, parsed) of ``path``; :class:`ManifestError` with ``missing`` when it is absent and
    naming the file and the fix when it is not a readable JSON object."""
    try:
        raw = read_regular(path, MAX_JSON_BYTES)
    except FileNotFoundError:
        raise ManifestError(missing) from None
    except OSError as e:
        raise ManifestError(f"{path}: unreadable ({e.strerror or e}); {what}") from None
    except FileTooLargeError as e:
        raise ManifestError(f"{path}: {e}; {what}") from None
    try:
        obj = strict_json(raw)
    except ValueError as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise ManifestError(f"{path}: not valid UTF-8 JSON ({str(e).splitlines()[0]}); {what}") from None
    if not isinstance(obj, dict):
        raise ManifestError(f"{path}: a JSON {type(obj).__name__}, not an object; {what}")
    return raw, obj


def _load_raw(root: pathlib.Path) -> tuple[dict[str, Any], str]:
    """(parsed manifest, its sha256) of folder ``root``, once the completion marker vouches for
    its bytes and its format and version are ours."""
    mpath, cpath = root / MANIFEST_NAME, root / COMPLETE_NAME
    damaged = "the folder was modified or is not a conversion by prep: convert again"
    for name in (MANIFEST_NAME, COMPLETE_NAME):  # prep writes both as regular files inside the folder
        problem = member_problem(root, name)
        if problem:
            raise ManifestError(f"{root}: {problem}; {damaged}")
    raw, manifest = _read_json(mpath, f"{root}: no {MANIFEST_NAME}; not a checkpoint converted by prep", damaged)
    _, marker = _read_json(cpath, f"{root}: no {COMPLETE_NAME}; the conversion did not finish: convert again (--resume)",
                           damaged)
    digest = manifest_hash(raw)
    if marker.get("manifest_sha256") != digest:
        raise ManifestError(f"{cpath}: manifest hash differs from the completion marker; the folder was modified")
    problem = _format_problem(manifest, required=True)
    if problem:
        raise ManifestError(f"{mpath}: {problem}")
    return manifest, digest
