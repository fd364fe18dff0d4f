"""How each rank holds a checkpoint's non-MXFP4 tensors (rank-exact): split as the engine's
sharding rules and the family's table say, merged where the engine merges them, BF16 experts
stacked, FP8 weights with their per-channel or 128x128 block scales, a multimodal checkpoint's
vision tower as the engine holds it; what every rank holds whole. The groups themselves, and
their bytes, are :mod:`prep.bf16`."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Mapping

from layouts.dequant import FP8_BLOCK
from layouts.engines import COLS as _COLS, QKV as _QKV, ROWS as _ROWS, WHOLE as _WHOLE
from layouts.families import family_of
from layouts.manifest import Placement

from .bf16 import _EXPERT, FP8_SCALE_DTYPES, Bf16Group, as_planned
from .errors import PrepError

if TYPE_CHECKING:
    from layouts.engines import OutsideRow, ShardingRules
    from layouts.families import Family


def plan_bf16_groups(tensors: dict[str, Any], config: dict[str, Any], tp: int, ep: int = 1,
                     fuse_shared_expert: bool = True, *, rules: "ShardingRules",
                     family: "Family | None" = None) -> tuple[list[list[Bf16Group]], list[str]]:
    """For each rank, the BF16 groups it holds, and the names left whole (replicated: every rank
    holds all of them). ``tensors``: the source's non-MXFP4 tensors, name -> info with ``dtype``
    and ``shape``, in source order. Expert parallel (``ep`` = ``tp``) splits the BF16 experts
    only: whole experts in blocks, as for the MXFP4 ones; everything else is split by ``tp``.
    ``rules``: the engine's (its profile's ``sharding``) merged modules, expert map and any
    departure from the TP splits of ``family`` (the checkpoint's model family; default:
    config.json's).

    Refuses (naming the tensor and the fix) a split that does not divide: ATOM pads nothing."""
    family = family or family_of(config)
    per_rank: list[list[Bf16Group]] = [[] for _ in range(tp)]
    whole: list[str] = []
    merged: dict[str, tuple[Any, dict[str, tuple[str, Any]]]] = {}  # engine name -> (its Merge, {part: info})
    # ("...mlp.", the projections' tensor: weight or weight_scale_inv) -> expert (None: shared) -> proj
    experts: dict[tuple[str, str], dict[int | None, dict[str, tuple[str, Any]]]] = {}

    def part(name, info, dim, rank):
        if tp == 1:
            return Placement.whole(name, info.shape)
        if isinstance(info, _BlockScale):  # first: its weight's split says more than its few rows of scales
            info.check_split(name, dim, tp)
        size = info.shape[dim]
        if size % tp:
            raise PrepError(f"{name}: dim {dim} of {size} does not split over tp={tp} (the engine splits it and pads "
                            "nothing); choose a tp that divides it")
        n = size // tp
        return Placement(name, tuple(info.shape), dim, rank * n, (rank + 1) * n)

    # The engine's merged modules; the shared expert's go with the experts below. Without a q LoRA
    # there is no q_a_proj, so no merge naming it: kv_a is then held whole (DeepSeek-V2-Lite).
    q_lora = config.get("q_lora_rank")
    merges = [m for m in rules.merges if not m.after_experts
              and (q_lora is not None or not any(p.endswith("q_a_proj") for p in m.parts))]

    def plain(name: str, info: Any, merges: list) -> None:  # merged, split by its rule, or whole
        module = name[:-len(".weight")] if len(info.shape) == 2 and name.endswith(".weight") else None
        suffix = ".weight"
        channel = channel_scale(name, info, tensors)
        block = block_scale(name, info, tensors)
        if channel is not None:  # an FP8 weight's per-channel scale: held as a column [N, 1], its weight's rows
            module, info, suffix = name[:-len(".weight_scale")], channel, ".weight_scale"
        elif block is not None:  # an FP8 weight's 128x128 block scales: its weight's blocks, under the engine's name
            module, info, suffix = name[:-len(".weight_scale_inv")], block, f".{rules.fp8_block_scale}"
        stored = name if module is None else f"{module}{suffix}"
        if module is not None and (hit := _merge_part(module, merges)):
            layer, merge, key = hit
            merged.setdefault(f"{layer}{merge.module}{suffix}", (merge, {}))[1][key] = (name, info)
        elif module is not None and (split := rules.split_of(module, family)) != _WHOLE \
                and not (channel is not None and split == _COLS):  # a row-parallel layer's channel scale: whole
            dim = 1 if split == _COLS else 0
            for r in range(tp):
                p = part(name, info, dim, r)
                per_rank[r].append(Bf16Group(stored, r, tp, info.dtype, (p,)))
        elif stored != name:  # whole, under the engine's name: in each rank's files
            for r in range(tp):
                per_rank[r].append(Bf16Group.whole(stored, name, info.dtype, info.shape, r, tp))
        else:
            whole.append(name)

    for name, info in tensors.items():
        block = block_scale(name, info, tensors)
        if len(info.shape) == 2 and (m := _EXPERT.match(name)) and (m.group(4) == "weight" or block is not None):
            e = None if m.group(2) is None else int(m.group(2))
            experts.setdefault((m.group(1), m.group(4)), {}).setdefault(e, {})[m.group(3)] = (name, block or info)
        else:
            plain(name, info, merges)
    # A shared expert the engine does not stack with the routed ones is an MLP of its own, held as
    # the engine's merged gate_up after the experts and a split down (as its MXFP4 one would be).
    after = [m for m in rules.merges if m.after_experts]
    for layer in experts.values():
        if None in layer and not (fuse_shared_expert and any(e is not None for e in layer)):
            for name, info in layer.pop(None).values():
                plain(name, info, after)
    for target, (merge, parts) in merged.items():
        if set(parts) != set(merge.parts):
            raise PrepError(f"{parts[next(iter(parts))][0]}: its partner of {target} is missing or not BF16; "
                            "the engine merges the two, so both must be BF16 (re-download the checkpoint)")
        column = merge.split == _ROWS  # MergedColumnParallelLinear; a WHOLE merge is replicated
        for key in merge.parts[:-1]:  # the engine finds a part's block scales at ceil(rows before it / 128)
            name, info = parts[key]
            if isinstance(info, _BlockScale) and not column and info.weight[0] % FP8_BLOCK:
                raise PrepError(f"{name}: its weight's {info.weight[0]} rows are not whole 128-row blocks, so its "
                                f"block scales cannot be stacked with the next part's in {target} as the engine reads "
                                "them; prep does not convert this checkpoint")
        for r in range(tp):
            row, ps = 0, []
            for key in merge.parts:
                name, info = parts[key]
                p = part(name, info, 0, r) if column else Placement.whole(name, info.shape)
                ps.append(dataclasses.replace(p, dest_row=row))
                row += p.out_shape[0]
            per_rank[r].append(Bf16Group(target, r, tp, parts[merge.parts[0]][1].dtype, tuple(ps)))
    for (mlp, tensor), layer in experts.items():
        _plan_experts(mlp, tensor, layer, tp, ep, per_rank, rules)
    return per_rank, whole


def plan_outside(tensors: Mapping[str, Any], rows: "tuple[OutsideRow, ...]", tp: int
                 ) -> tuple[list[list[Bf16Group]], list[str]]:
    """How each rank holds a multimodal checkpoint's tensors outside its language model
    (``tensors``: name -> info), as the engine's ``rows`` say (:class:`OutsideRow`): per rank, the
    groups (a tensor under another name, by input columns, or a fused q | k | v split by thirds;
    a 1-D one, a bias or a norm, stored 1-D as the engine holds it), and the names every rank
    holds whole as the source has them (replicated: any number of dims, a convolution's weight).
    A tensor no row takes is refused naming it."""
    per_rank: list[list[Bf16Group]] = [[] for _ in range(tp)]
    whole: list[str] = []
    for name, info in tensors.items():
        row = next((r for r in rows if r.held_name(name) is not None), None)
        if row is None:
            raise PrepError(f"{name}: outside the language model, and the engine's profile says of no such tensor how "
                            "a rank holds it; prep does not convert this checkpoint for this engine")
        held, shape, flat = row.held_name(name), as_planned(info.shape), len(info.shape) == 1
        if row.split == _WHOLE and held == name:
            whole.append(name)
            continue
        if len(shape) != 2:
            raise PrepError(f"{name}: {len(info.shape)}-D, held by the engine as {held} ({row.split}); prep renames and "
                            "splits 1-D and 2-D tensors only: it does not convert this checkpoint for this engine")
        if row.split == _COLS and (flat or shape[1] % tp):
            raise PrepError(f"{name}: its {shape[1]} input columns do not split over tp={tp} (the engine splits them "
                            "and pads nothing); choose a tp that divides them")
        third = shape[0] // 3
        if row.split == _QKV and (shape[0] % 3 or third % tp):
            raise PrepError(f"{name}: its q, k and v of {third} rows each do not split over tp={tp} (the engine splits "
                            "each by heads and pads nothing); choose a tp that divides the vision tower's heads")
        for r in range(tp):
            if tp == 1 or row.split == _WHOLE:
                per_rank[r].append(Bf16Group.whole(held, name, info.dtype, info.shape, r, tp))
                continue
            if row.split == _COLS:
                n = shape[1] // tp
                ps: tuple[Placement, ...] = (Placement(name, shape, 1, r * n, (r + 1) * n),)
            else:  # q, k and v each by rows, stacked
                n = third // tp
                ps = tuple(Placement(name, shape, 0, k * third + r * n, k * third + (r + 1) * n, dest_row=k * n)
                           for k in range(3))
            per_rank[r].append(Bf16Group(held, r, tp, info.dtype, ps, flat=flat))
    return per_rank, whole


@dataclasses.dataclass(frozen=True)
class _Column:
    """A 1-D tensor planned as the column ``[N, 1]`` it is stored as (same bytes)."""

    dtype: str
    shape: tuple[int, int]


def channel_scale(name: str, info: Any, tensors: Mapping[str, Any]) -> _Column | None:
    """``name``'s info as a column ``[N, 1]`` when it is the per-channel scale of an FP8 linear
    (``X.weight_scale``, F32 or BF16, ``[N]`` or ``[N, 1]``, of an F8_E4M3 ``X.weight`` ``[N, K]``;
    ATOM holds it as ``[N, 1]`` and splits and merges it with the weight's rows), else None. The
    one statement of that rule: ``prep.deepseek.classify`` refuses an FP8 weight's scale it rejects."""
    if not name.endswith(".weight_scale") or info.dtype not in FP8_SCALE_DTYPES:
        return None
    w = tensors.get(name[:-len("_scale")])
    if w is None or w.dtype != "F8_E4M3" or len(w.shape) != 2 or tuple(info.shape) not in ((w.shape[0],),
                                                                                            (w.shape[0], 1)):
        return None
    return _Column(info.dtype, (w.shape[0], 1))




@dataclasses.dataclass(frozen=True)
class _BlockScale:
    """An FP8 linear's block scales ``[ceil(N/128), ceil(K/128)]`` (F32), planned with its
    weight's ``[N, K]``: a rank's part of the weight must be whole blocks."""

    dtype: str
    shape: tuple[int, int]
    weight: tuple[int, int]

    def check_split(self, name: str, dim: int, tp: int) -> None:
        """Refuse a split of the weight's ``dim`` over ``tp`` ranks that cuts a block: the engines
        split the scales by whole blocks (ATOM's loaders narrow them by ``ceil(part / 128)``
        without checking, so a cut block would be read with its neighbour's scale)."""
        size = self.weight[dim]
        if size % (FP8_BLOCK * tp):
            raise PrepError(f"{name}: over tp={tp} a rank holds {size}/{tp} {'rows' if dim == 0 else 'columns'} of "
                            f"its weight, not whole 128x128 blocks of these scales; the engine splits the scales by "
                            "whole blocks: choose a tp (or --ep) that keeps each rank's part a multiple of 128")


def block_scale(name: str, info: Any, tensors: Mapping[str, Any]) -> _BlockScale | None:
    """``name``'s info with its weight's shape when it is the block scales of an FP8 linear
    (``X.weight_scale_inv``, F32 ``[ceil(N/128), ceil(K/128)]``, of an F8_E4M3 ``X.weight``
    ``[N, K]``: DeepSeek's own FP8 release), else None. The one statement of that rule:
    ``prep.deepseek.classify`` refuses a ``weight_scale_inv`` it rejects."""
    if not name.endswith(".weight_scale_inv") or info.dtype != "F32" or len(info.shape) != 2:
        return None
    w = tensors.get(name[:-len("_scale_inv")])
    if w is None or w.dtype != "F8_E4M3" or len(w.shape) != 2:
        return None
    n, k = w.shape
    if tuple(info.shape) != (-(-n // FP8_BLOCK), -(-k // FP8_BLOCK)):
        return None
    return _BlockScale(info.dtype, tuple(info.shape), (n, k))


def _merge_part(module: str, merges: list) -> tuple[str, Any, str] | None:
    """``(layer prefix, merge, part)`` when ``module`` is a part of one of ``merges`` (a part is
    named relative to its layer: ``...layers.3.`` + ``mlp.gate_proj``), else None."""
    for merge in merges:
        for p in merge.parts:
            if module.endswith(f".{p}"):
                return module[:-len(p)], merge, p
    return None


def _plan_experts(mlp: str, tensor: str, layer: dict, tp: int, ep: int, per_rank: list[list[Bf16Group]],
                  rules: "ShardingRules") -> None:
    """One MoE layer's BF16 (or FP8) experts as the engine stacks them: ``w13 [E, 2 I/tp, H]``
    (gate rows, then up rows) and ``w2 [E, H, I/tp]``; under expert parallel whole experts, rank
    r the routed block the engine's expert map gives it (``rules.expert_block``); the
    shared expert, when fused, in the slot after the routed ones on every rank. ``tensor``: the
    projections' ``weight``, or FP8 experts' block scales (``weight_scale_inv``), stacked alike by
    blocks: ``w13_weight_scale [E, 2 I/tp/128, H/128]``."""
    routed = sorted(e for e in layer if e is not None)  # a shared expert is here only if fused
    if not routed:  # a BF16 shared expert beside MXFP4 routed ones: planned as an MLP of its own
        return
    if routed != list(range(len(routed))):
        raise PrepError(f"{mlp}experts: BF16 experts {routed[0]}..{routed[-1]} are not numbered 0..n-1 "
                        "(a missing expert); re-download the checkpoint")
    for e, parts in layer.items():
        if set(parts) != {"gate", "up", "down"}:
            raise PrepError(f"{next(iter(parts.values()))[0]}: expert {e} lacks a BF16 "
                            f"{'/'.join(sorted({'gate', 'up', 'down'} - set(parts)))}_proj; re-download the checkpoint")
    if ep not in (1, tp):
        raise PrepError(f"{mlp}experts: ep={ep} with tp={tp}; expert parallel runs with ep equal to tp")
    if ep > len(routed):
        raise PrepError(f"{mlp}experts: --ep {ep} exceeds the {len(routed)} routed experts")
    shared = None in layer
    size = layer[0]["gate"][1].shape[0]
    inter = size if ep > 1 else size // tp
    dtype = layer[0]["gate"][1].dtype
    if rules.bf16_moe_inter_align is not None and dtype == "BF16" and (ep > 1 or size % tp == 0):
        limit, small, large = rules.bf16_moe_inter_align
        align = small if inter <= limit else large
        if inter % align:
            raise PrepError(f"{layer[0]['gate'][0]}: a rank's intermediate of {inter} is padded to a multiple of "
                            f"{align} by the engine's BF16 MoE, which prep does not write; choose another --tp "
                            "(or --ep equal to --tp)")
    moe_tp = 1 if ep > 1 else tp
    for e in (0, None) if None in layer else (0,):  # every expert has the shapes of expert 0 (checked by _stack)
        for proj, dim in (("gate", 0), ("up", 0), ("down", 1)):
            name, info = layer[e][proj]
            if isinstance(info, _BlockScale):
                info.check_split(name, dim, moe_tp)
    for r in range(tp):
        if ep > 1:
            start, stop = rules.expert_block(len(routed), ep, r)
            local, moe_rank = routed[start:stop], 0
        else:
            local, moe_rank = routed, r
        ids = [*local, None] if shared else local
        w13, w2 = [], []
        for slot, e in enumerate(ids):
            parts = layer[e]
            for i, proj in enumerate(("gate", "up")):
                name, info = parts[proj]
                n = _moe_split(name, info.shape[0], moe_tp)
                w13.append(Placement(name, tuple(info.shape), 0, moe_rank * n, (moe_rank + 1) * n, i * n, slot)
                           if moe_tp > 1 else Placement.whole(name, info.shape, i * n, slot))
            name, info = parts["down"]
            k = _moe_split(name, info.shape[1], moe_tp)
            w2.append(Placement(name, tuple(info.shape), 1, moe_rank * k, (moe_rank + 1) * k, 0, slot)
                      if moe_tp > 1 else Placement.whole(name, info.shape, 0, slot))
        stack = f"{mlp[:-len('mlp.')]}{rules.experts}"  # the engine's experts module ("mlp.experts")
        what = "weight" if tensor == "weight" else rules.fp8_block_scale
        per_rank[r].append(Bf16Group(f"{stack}.w13_{what}", r, tp, dtype, tuple(w13)))
        per_rank[r].append(Bf16Group(f"{stack}.w2_{what}", r, tp, dtype, tuple(w2)))


def _moe_split(name: str, size: int, tp: int) -> int:
    if size % tp:
        raise PrepError(f"{name}: moe intermediate {size} does not split over tp={tp}; choose a tp that divides it "
                        "(or --ep equal to --tp)")
    return size // tp
