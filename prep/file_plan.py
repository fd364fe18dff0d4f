"""What a conversion writes, before a byte is: every output file (:class:`FileJob`) with its
tensors in order and what produces them. A rank's files hold its MXFP4 groups, its BF16 groups,
its replicated tensors and the engine's constants; the common files what no rank reads (kept for
``revert``) or what the engine's own loader takes whole (a vision tower). Every name and
constraint is checked here, so a bad input fails before ``prep convert`` writes anything."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import layouts
from layouts.engines import Constant, EngineProfile
from layouts.manifest import Target, manifest_hash

from .bf16 import Bf16Group
from .deepseek import Classified, classify, plan_bf16, plan_groups
from .errors import PrepError
from .groups import LinearGroup, MoEGroup
from .safetensors_writer import nbytes
from .source import SourceCheckpoint

SHARD_BYTES = 4 << 30  # split a rank's tensors into files of about this size


@dataclasses.dataclass
class FileJob:
    """One output file: its tensors in order and what produces them."""

    name: str
    rank: int | None
    groups: list[LinearGroup | MoEGroup | Bf16Group]  # the rank's groups (rank files)
    passthrough: list[str]  # source tensor names copied whole (replicated in rank files, or common files)
    entries: list[tuple[str, str, tuple[int, ...]]]
    constants: list[Constant] = dataclasses.field(default_factory=list)  # the engine's, not from the source
    engine_loads: bool = False  # a common file the rank's engine loads whole itself (a vision tower: loads_outside)

    @property
    def nbytes(self) -> int:
        return sum(nbytes(dtype, shape) for _, dtype, shape in self.entries)

    def source_files(self, src: SourceCheckpoint) -> list[str]:
        """The source files this output file reads (whose change means writing it again)."""
        names = [n for g in self.groups for n in g.sources()] + self.passthrough
        return sorted({src.tensors[n].file for n in names})

    def plan_key(self) -> str:
        """What must match for a finished file to be reused by --resume."""
        # The groups' records without their file (this one): the key prep-complete.json has kept
        # since before records were typed, so an output converted then is still reused.
        desc = [{k: v for k, v in g.record(self.name).to_json().items() if k != "file"} for g in self.groups] + self.passthrough + [list(e) for e in self.entries]
        desc += [dataclasses.astuple(c) for c in self.constants]
        return manifest_hash(json.dumps(desc, sort_keys=True).encode())


def shard_names(items: list[tuple[Any, int]], prefix: str) -> list[tuple[str, list[Any]]]:
    """Cut (item, bytes) into consecutive files of about SHARD_BYTES, named prefix-00001...."""
    files: list[list[Any]] = [[]]
    size = 0
    for item, n in items:
        if files[-1] and size + n > SHARD_BYTES:
            files.append([])
            size = 0
        files[-1].append(item)
        size += n
    return [(f"{prefix}-{i + 1:05d}-of-{len(files):05d}.safetensors", chunk) for i, chunk in enumerate(files)]


def plan_files(src: SourceCheckpoint, target: Target, engine: EngineProfile) -> tuple[list[FileJob], dict[str, Any]]:
    """Validate everything and lay out the output files for ``target``, whose engine is ``engine``
    (resolved once, by the caller). Raises PrepError on any bad input.

    Rank-exact (``target.rank_exact``): a rank's files hold its MXFP4 groups, its BF16 groups,
    a copy of every replicated tensor and the engine's constants, so a rank reads exactly its
    own files; the one common file holds only what no rank reads (and the MTP layers, whole,
    for an engine whose model does not hold them). Otherwise (format 1) every non-MXFP4 tensor
    is whole in common files that every rank reads."""
    _check_layout_names(target)
    cls = classify(src)
    rules = engine.sharding
    held, mtp = _without_mtp(src, cls) if not rules.holds_mtp else (cls, [])
    per_rank = plan_groups(src, held, target, engine)
    replicated, common = [], list(held.passthrough)
    if target.rank_exact:
        split, replicated, common = plan_bf16(src, held, target, engine)
        for groups, more in zip(per_rank, split):
            groups += more
    elif mtp or rules.constants:
        raise PrepError(f"--common-bf16: engine {target.engine!r} loads only the tensors of its own model from its "
                        "rank's files; convert without --common-bf16")
    common += mtp
    loaded = held.outside if target.rank_exact and rules.loads_outside else []  # whole, for the engine's own loader
    constants = [c.at_layer(i) for i in range(held.num_layers) for c in rules.constants] if target.rank_exact else []
    if rules.wrapped and src.wrapper is not None and target.rank_exact:
        per_rank, replicated, constants = _wrapped(src, per_rank, replicated, constants)
    jobs: list[FileJob] = []
    for rank, groups in enumerate(per_rank):
        sized = [(g, sum(nbytes(g.dtype, shape) for _, _, shape in g.outputs())) for g in groups]
        sized += [(n, src.tensors[n].nbytes) for n in replicated]
        sized += [(c, nbytes(c.dtype, c.shape)) for c in constants]
        for fname, chunk in shard_names(sized, f"model-tp{target.tp}-rank{rank}"):
            gs = [x for x in chunk if isinstance(x, (LinearGroup, MoEGroup, Bf16Group))]
            names = [x for x in chunk if isinstance(x, str)]
            consts = [x for x in chunk if isinstance(x, Constant)]
            entries = [(n, g.dtype, tuple(shape)) for g in gs for n, _, shape in g.outputs()]
            entries += [(n, src.tensors[n].dtype, src.tensors[n].shape) for n in names]
            entries += [(c.name, c.dtype, c.shape) for c in consts]
            jobs.append(FileJob(fname, rank, gs, names, entries, consts))
    for names, prefix, engine_loads in ((common, "model-common", False), (loaded, "model-outside", True)):
        sized = [(n, src.tensors[n].nbytes) for n in names]
        for fname, chunk in shard_names(sized, prefix) if sized else ():
            entries = [(n, src.tensors[n].dtype, src.tensors[n].shape) for n in chunk]
            jobs.append(FileJob(fname, None, [], chunk, entries, engine_loads=engine_loads))
    info = {"arch": cls.arch, "num_layers": cls.num_layers, "mtp_layers": cls.mtp_layers,
            "modules": cls.modules, "passthrough": cls.passthrough}
    return jobs, info


def _wrapped(src: SourceCheckpoint, per_rank: list[list[Any]], replicated: list[str], constants: list[Constant]
             ) -> tuple[list[list[Any]], list[str], list[Constant]]:
    """A rank's groups, replicated tensors and constants named as an engine whose model holds a
    multimodal checkpoint's language model under the wrapper's prefix reads them from its files
    (``ShardingRules.wrapped``: SGLang's ``sharded_state``): every language-model tensor prefixed,
    a replicated one as a whole group of its own under that name (1-D kept 1-D); the tensors
    outside the language model keep the names the engine's rows gave them."""
    wrapper = src.wrapper
    prefix = wrapper.prefix

    def named(g: Any) -> Any:
        if wrapper.is_outside(g.name):
            return g
        if isinstance(g, Bf16Group) and g.stacked:  # a stack's name says where its experts' sources are
            raise PrepError(f"{g.name}: BF16 experts of a multimodal checkpoint, for an engine that reads them under "
                            f"{prefix!r}; prep does not convert this checkpoint for this engine")
        return dataclasses.replace(g, name=prefix + g.name)

    inside, outside = [], []
    for n in replicated:
        (outside if wrapper.is_outside(n) else inside).append(n)
    tp = len(per_rank)
    whole = [[Bf16Group.whole(prefix + n, n, src.tensors[n].dtype, src.tensors[n].shape, r, tp) for n in inside]
             for r in range(tp)]
    return ([[named(g) for g in groups] + more for groups, more in zip(per_rank, whole)], outside,
            [dataclasses.replace(c, name=prefix + c.name) for c in constants])


def _without_mtp(src: SourceCheckpoint, cls: Classified) -> tuple[Classified, list[str]]:
    """``cls`` without its MTP layers, and those layers' tensors (MXFP4 and not), in source order:
    what an engine whose model does not hold them gets, and the common file keeps whole."""
    prefixes = tuple(f"model.layers.{i}." for i in cls.mtp_layers)
    if not prefixes:
        return cls, []
    held = dataclasses.replace(cls, modules={m: k for m, k in cls.modules.items() if not m.startswith(prefixes)},
                               passthrough=[n for n in cls.passthrough if not n.startswith(prefixes)])
    return held, [n for n in src.tensors if n.startswith(prefixes)]


def _check_layout_names(target: Target) -> None:
    for name, kind, flag in ((target.layout, "dense", "--layout"), (target.moe_layout, "moe", "--moe-layout")):
        if name not in layouts.layout_names(kind):
            raise PrepError(f"{flag} {name!r} is not a {kind} layout; choose one of {', '.join(layouts.layout_names(kind))}")


# ---------------------------------------------------------------------------------- writing
