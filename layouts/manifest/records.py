"""The manifest's records of what a conversion was for and what it wrote: its target, the tool,
the layouts, the files and the tensors (a group's records are in :mod:`.groups`, the source's in
:mod:`.source`)."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from .format import MAX_TP, UNRECORDED_ENGINE, ManifestError
from .names import expand_names
from .values import _is_count, _object, _string_list

if TYPE_CHECKING:
    from ..registry import Layout


# ------------------------------------------------------------------ the schema
# Every section of prep-manifest.json is a small typed record in this package (here, groups.py,
# source.py; reading.py the marker's), and nowhere else: convert builds these and writes
# ``Manifest.to_json()``; every reader (engines through load_manifest, prep's verify, revert,
# inspect and reference engine) gets them from ``Manifest.from_json``. ``from_json`` checks types
# and says which key is wrong (Manifest.from_json adds the file and the fix); ``to_json`` writes the
# keys in exactly the order prep has always written them, because the manifest's bytes are hashed
# into the completion marker and must not move when the code does. Keys a record does not know are
# ignored on reading (see docs/manifest.md for the versioning rule). docs/manifest.md describes
# every field.


@dataclasses.dataclass(frozen=True, kw_only=True)
class Target:
    """What the checkpoint was converted for (the ``target`` section): the conversion's options,
    as prep's ``--engine``/``--layout``/``--moe-layout``/``--tp``/``--ep`` and padding set them
    (``prep.deepseek.target_for`` fills in what the engine's profile reads where they are left
    out), and the architecture read from the source's config.json. One type for both: an option
    that changes the bytes is a field here, so the manifest records every one. Engines check it
    against their own configuration before loading a byte (:func:`layouts.check_compatibility`)."""

    layout: str  # registered dense layout of every MXFP4 linear
    moe_layout: str  # registered MoE layout of every stacked expert tensor
    tp: int = 1  # tensor-parallel size: one set of rank files per rank
    ep: int = 1  # expert-parallel size: 1, or equal to tp
    fuse_shared_expert: bool  # shared expert stacked after the routed ones (slot n_routed)
    inter_pad_to: int  # stacked experts' intermediate dimension padded to a multiple of this
    hidden_pad_to: int  # and their hidden dimension
    # Rank-exact (format 2, what prep writes unless --common-bf16): BF16 split per rank as the
    # engine holds it, replicated tensors in every rank's files. Absent (format 1): false, every
    # non-MXFP4 tensor in common files.
    rank_exact: bool = True
    # Rank-exact only: the registered layout of stacked BF16 experts (R1-0528's MTP layer), the one
    # the engine's unquantized MoE reads; None: stored unshuffled (the engine shuffles at load).
    bf16_moe_layout: str | None
    # config.json's model_type, e.g. "deepseek_v3": set by the conversion once it has read the
    # source (a target made before that has "")
    arch: str = ""
    # The engine whose per-rank holding the files follow (merged modules, splits, expert map:
    # its profile's ``sharding``). Absent (manifests before it was recorded): UNRECORDED_ENGINE.
    engine: str
    # Rank-exact only: the registered ``fp8`` layout of FP8 block-scaled weights (DeepSeek's own FP8
    # release), the one the engine holds them in after loading; None (absent): as the source holds
    # them, the engine processing them at load.
    fp8_layout: str | None
    # Rank-exact only: the registered ``fp8`` layouts (weight, scale) of FP8 per-channel linears
    # (Quark's per-channel attention), as the engine holds them once loaded; None: the source's bytes.
    fp8_channel_layouts: tuple[str, str] | None

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
        engine = t.get("engine", UNRECORDED_ENGINE)
        if type(engine) is not str or not 0 < len(engine) <= 64 or not all(c.isalnum() or c in "-_." for c in engine):
            raise ManifestError(f"target.engine is {engine!r}, not an engine name")
        fp8 = t.get("fp8_layout") if rank_exact else None  # format 1 keeps FP8 whole, as the source has it
        if fp8 is not None and type(fp8) is not str:
            raise ManifestError(f"target.fp8_layout is {fp8!r}, not a string")
        channel = t.get("fp8_channel_layouts") if rank_exact else None
        if channel is not None and (type(channel) not in (list, tuple) or len(channel) != 2
                                    or not all(type(n) is str for n in channel)):
            raise ManifestError(f"target.fp8_channel_layouts is {channel!r}, not a [weight, scale] pair of layout names")
        return cls(layout=layout, moe_layout=moe_layout, tp=tp, ep=ep, fuse_shared_expert=fuse, inter_pad_to=pads[0],
                   hidden_pad_to=pads[1], rank_exact=rank_exact, bf16_moe_layout=bf16_moe, arch=arch, engine=engine,
                   fp8_layout=fp8, fp8_channel_layouts=None if channel is None else tuple(channel))

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
class LayoutRecord:
    """A layout as it was when the checkpoint was converted (a ``layouts`` entry): :meth:`of` a
    registered :class:`~layouts.registry.Layout`. A reader whose registry has another version of
    it must not read it."""

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

    @classmethod
    def of(cls, layout: "Layout") -> "LayoutRecord":
        """The record of ``layout`` (its transforms' parameters, its runtime attributes) as a
        conversion writes it. Built here, not by the registry, which imports nothing of the
        manifest (the manifest checks its records against the registry)."""
        return cls(layout.name, layout.version, layout.kind, layout.weight.params, layout.scale.params,
                   dict(layout.runtime_attrs))

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
