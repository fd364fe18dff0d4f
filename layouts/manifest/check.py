"""A parsed manifest's records checked against each other, not only each by itself: files and
ranks, groups and their layouts, a MoE group's sizes against its stacked weights, a stacked BF16
group's template against its tensor."""

from __future__ import annotations

from ..errors import LayoutsError
# The registry's layouts and the dtypes prep writes (both import torch, as the package does first):
# the registry imports nothing of the manifest but the LayoutRecord type, so no import circle.
from ..registry import get_layout
from ..safe_files import plain_name_problem
from ..safetensors_file import TORCH_DTYPES
from .format import ManifestError
from .groups import GroupRecord
from .records import FileRecord, Target, TensorRecord


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


def _check_whole(target: "Target", groups: list["GroupRecord"], records: list["TensorRecord"],
                 files: dict[str, "FileRecord"]) -> None:
    """The manifest's records checked against each other, not only each by itself (an edited and
    resealed manifest passed every check one record at a time): each tensor in a file of its own
    rank (a common file for a common tensor), no tensor twice on a rank, each group's layout one
    the target holds (dense, MoE, BF16 experts, FP8 weights), each tensor in its group's layout, and the runtime
    attributes a registered layout states (``is_shuffled``, the scale swizzle) as it states them:
    an engine sets them on its parameters and its kernels read the bytes by them."""
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
