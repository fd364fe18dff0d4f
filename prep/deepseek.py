"""DeepSeek-V2/V3/R1 knowledge: which source tensors are MXFP4 GEMM weights of which module kind,
and how a rank's engine holds them (ATOM's DeepSeek loader: merged ``fused_qkv_a_proj`` and
``gate_up_proj``, column/row parallel splits, stacked experts with the shared expert fused in).

Whether a linear is MXFP4 is decided by the tensors present (U8 weight + weight_scale), not only
by the config's exclude list: the MTP layer's ``eh_proj`` may be BF16 although not excluded.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from typing import Any, Iterable, Mapping

from layouts import EngineConfig
from layouts.engines import EngineProfile, ShardingRules, engine_names, get_engine
from layouts.errors import LayoutsError
from layouts.families import Family, architecture_of, family_names, get_family
from layouts.manifest import Target
from layouts.mxfp4 import BLOCK_SIZE
from layouts.registry import Layout, get_layout
from layouts.sizes import ceil_div

from .errors import PrepError
from .bf16 import Bf16Group
from .bf16_plan import block_scale, channel_scale, plan_bf16_groups, plan_outside
from .groups import LinearGroup, MoEGroup, Part
from .config_check import check_complete, config_ints, source_family
from .source import SourceCheckpoint


@dataclasses.dataclass
class Classified:
    """Every source tensor assigned: to a quantized module (by kind) or to pass-through."""

    arch: str
    family: Family  # resolved once, from config.json: what every module is and how TP splits it
    num_layers: int  # decoder layers, MTP excluded
    mtp_layers: list[int]
    modules: dict[str, str]  # MXFP4 module prefix -> kind
    passthrough: list[str]  # tensor names copied unchanged (split and merged per rank where rank-exact)
    fp8: list[str] = dataclasses.field(default_factory=list)  # FP8 per-channel linears (among the passthrough)
    fp8_block: list[str] = dataclasses.field(default_factory=list)  # FP8 128x128-block linears (among the passthrough)
    outside: list[str] = dataclasses.field(default_factory=list)  # outside the language model (a vision tower): copied, read by no rank

    @functools.cached_property
    def by_layer(self) -> dict[str, dict[str, str]]:
        """The modules grouped by layer prefix ("model.layers.N."), in source order (computed
        once: ``prep inspect`` plans 15 targets over the same ~30k modules)."""
        layers: dict[str, dict[str, str]] = {}
        for prefix, kind in modules_in_order(self):
            m = _LAYER.match(prefix)
            layers.setdefault(m.group(1) if m else "", {})[prefix] = kind
        return layers


def arch_of(config: dict[str, Any]) -> str:
    """The architecture a conversion's manifest records for config.json (of a family prep knows:
    :func:`classify` resolves it first)."""
    arch = architecture_of(config)
    if arch is None:
        raise PrepError(f"config.json: architecture {config.get('architectures')} is not one prep records; "
                        f"prep knows {', '.join(a for n in family_names() for a in get_family(n).architectures)}")
    return arch


_NUMBERS = re.compile(r"(\d+)")
_LAYER = re.compile(r"(.*?layers\.\d+\.)")


def classify(src: SourceCheckpoint) -> Classified:
    family = source_family(src.file_config)
    arch = arch_of(src.file_config)
    ints = check_complete(src, family)
    n_layers = ints["num_hidden_layers"]
    mtp = [n_layers + i for i in range(ints["num_nextn_predict_layers"])]
    modules: dict[str, str] = {}
    consumed: set[str] = set()
    fp8: list[str] = []
    fp8_block: list[str] = []
    for name, info in src.tensors.items():
        if name.endswith(".weight_scale_inv"):
            # FP8 per 128x128 block (DeepSeek's own FP8 release): copied, split and merged by whole
            # blocks with its weight as the engine holds them (prep.bf16), processed by the engine
            if block_scale(name, info, src.tensors) is None:
                w = src.tensors.get(name[:-len("_scale_inv")])
                raise PrepError(f"{name}: block scales must be F32 [ceil(N/128), ceil(K/128)] of an F8_E4M3 weight "
                                f"[N, K] (got {info.dtype} {list(info.shape)} for weight "
                                f"{f'{w.dtype} {list(w.shape)}' if w else 'none'}); re-download the checkpoint")
            fp8_block.append(name[:-len(".weight_scale_inv")])
            continue
        if not name.endswith(".weight_scale"):
            continue
        prefix = name[: -len(".weight_scale")]
        w = src.tensors.get(f"{prefix}.weight")
        if w is None:
            raise PrepError(f"{name}: scale without a {prefix}.weight tensor")
        if w.dtype == "F8_E4M3":
            # FP8 per output channel (Quark's per_channel override, e.g. of *self_attn*): the bytes are
            # copied, split and merged as the engine holds them (prep.bf16: any dtype), the scale with
            # its weight's rows
            if channel_scale(name, info, src.tensors) is None:
                raise PrepError(f"{name}: an FP8 weight's scale must be F32 or BF16 [N] or [N, 1], one per output channel "
                                f"(got {info.dtype} {list(info.shape)} for weight {list(w.shape)}); per-tensor and "
                                "block-scaled FP8 are not converted by prep yet")
            fp8.append(prefix)
            continue
        if w.dtype != "U8" or info.dtype != "U8":
            raise PrepError(f"{prefix}.weight: MXFP4 tensors must be U8 (got weight {w.dtype}, scale {info.dtype})")
        want = (w.shape[0], ceil_div(w.shape[1] * 2, BLOCK_SIZE)) if len(w.shape) == 2 else None
        if len(info.shape) != 2 or info.shape != want:
            raise PrepError(f"{prefix}.weight_scale: shape {list(info.shape)} does not match weight "
                            f"{list(w.shape)} (expected [N, ceil(K/32)] for packed [N, K/2])")
        modules[prefix] = family.kind_of(prefix)
        consumed.update((name, f"{prefix}.weight"))
    passthrough = [n for n in src.tensors if n not in consumed]
    outside = [n for n in passthrough if family.wrapper and family.wrapper.is_outside(n)]
    for n in passthrough:
        if src.tensors[n].dtype == "U8":
            raise PrepError(f"{n}: U8 tensor with no weight_scale; not an MXFP4 weight prep understands")
    for n in passthrough:  # an FP8 weight carries its scales: per channel or per block, never none
        if src.tensors[n].dtype == "F8_E4M3" and n.endswith(".weight") and n[:-len(".weight")] not in (*fp8, *fp8_block):
            raise PrepError(f"{n}: an F8_E4M3 weight with no weight_scale or weight_scale_inv; per-tensor FP8 is "
                            "not converted by prep: re-download the checkpoint")
    return Classified(arch, family, n_layers, mtp, modules, passthrough, fp8, fp8_block, outside)


def _dims(src: SourceCheckpoint, prefix: str) -> tuple[int, int]:
    n, kb = src.info(f"{prefix}.weight").shape
    return n, 2 * kb


def plan_groups(src: SourceCheckpoint, cls: Classified, target: Target, engine: EngineProfile
                ) -> list[list[LinearGroup | MoEGroup]]:
    """For each rank, the MXFP4 groups it holds, in source layer order, as ``engine`` (the
    target's, resolved once by the caller) holds them."""
    tp = target.tp
    if tp < 1 or target.ep < 1:
        raise PrepError(f"--tp and --ep must be >= 1 (got tp={tp}, ep={target.ep})")
    why = (engine.layout_refusal(target.layout, target.moe_layout)  # what it reads
           or engine.target_refusal(tp, target.ep, target.moe_layout, target.fuse_shared_expert))  # what it can run
    if why:
        raise PrepError(why)
    if cls.family.name not in engine.families:
        able = [e.name for e in convertible_engines() if cls.family.name in e.families]
        fix = f"convert with --engine {' or '.join(able)}" if able else "no engine's is yet"
        raise PrepError(f"config.json: {cls.family.label} ({cls.family.twist}) is not checked against "
                        f"{engine.display_name}'s own load yet, so prep does not write it for {engine.display_name}; "
                        f"{fix}")
    if cls.fp8_block and not engine.fp8_block_linears:
        able = [e.name for e in convertible_engines() if e.fp8_block_linears]
        raise PrepError(f"{cls.fp8_block[0]}.weight: FP8 with 128x128 block scales is not checked against "
                        f"{engine.display_name}'s own load yet, so prep does not write it for {engine.display_name}; "
                        f"convert with --engine {' or '.join(able)}")
    if cls.fp8 and not engine.fp8_channel_linears:
        able = [e.name for e in convertible_engines() if e.fp8_channel_linears]
        why = engine.fp8_channel_refusal or f"it is not checked against {engine.display_name}'s own load yet"
        raise PrepError(f"{cls.fp8[0]}.weight: FP8 per-channel attention: {why}, so prep does not write it for "
                        f"{engine.display_name}; convert with --engine {' or '.join(able)}")
    rules = engine.sharding
    heads = config_ints(src)["num_attention_heads"] or 1
    if heads % tp:
        raise PrepError(f"config.json: num_attention_heads={heads} does not divide over tp={tp}; "
                        "choose a tp that divides the heads")

    def part(prefix: str, split: str) -> Part:
        n, k = _dims(src, prefix)
        return Part(prefix, n, k, split)

    per_rank: list[list[LinearGroup | MoEGroup]] = [[] for _ in range(tp)]
    lays = get_layout(target.layout), get_layout(target.moe_layout)  # the names resolved once, for every group
    for layer, mods in cls.by_layer.items():
        experts = _layer_experts(layer, mods, target, src)  # the same for every rank: checked once
        for rank in range(tp):
            per_rank[rank] += _layer_groups(layer, mods, rank, target, rules, cls.family, part, experts, lays)
    try:
        for groups in per_rank:
            for g in groups:
                g.check()
    except (PrepError, LayoutsError) as e:
        raise _with_ep_fix(e, src, cls, target, engine) from None
    return per_rank


def _with_ep_fix(e: Exception, src: SourceCheckpoint, cls: Classified, target: Target,
                 engine: EngineProfile) -> Exception:
    """``e`` (a group this target cannot make), with ``--ep`` named where it is the fix that works:
    with expert parallel each rank holds whole experts, so a MoE that does not split over ``--tp``
    (its layout's shape rules, its intermediate) may still convert, if the engine runs it."""
    if target.ep != 1 or target.tp == 1:
        return e
    try:
        plan_groups(src, cls, dataclasses.replace(target, ep=target.tp), engine)
    except (PrepError, LayoutsError):
        return e
    fixed = type(e)(f"{e}; with --ep {target.tp} (whole experts per rank) this converts")
    fixed.converts_with_ep = target.tp  # what `prep inspect` reports, without planning it again
    return fixed


def target_for(engine: EngineProfile, **options: Any) -> Target:
    """The :class:`~layouts.manifest.Target` of a conversion for ``engine`` (chosen by the
    caller: prep's CLI, a test, a script): the layouts its default configuration reads (dense,
    MoE, stacked BF16 experts, FP8), its MoE padding and whether it fuses the shared expert, where
    ``options`` leave them out, so that a plain ``--engine NAME`` writes what that engine reads
    (:class:`PrepError` for an engine prep cannot convert for)."""
    rules = convertible(engine).sharding
    cfg = EngineConfig(profile=engine)
    defaults = {"layout": cfg.expected_dense_layout(), "moe_layout": cfg.expected_moe_layout(),
                "bf16_moe_layout": cfg.expected_bf16_moe_layout(), "fp8_layout": cfg.expected_fp8_layout(),
                "fp8_channel_layouts": engine.fp8_channel_layouts,
                "inter_pad_to": rules.moe_pad_to[0],
                "hidden_pad_to": rules.moe_pad_to[1], "fuse_shared_expert": rules.fuse_shared_expert}
    return Target(**{**defaults, **options, "engine": engine.name})


def convertible_engines() -> list[EngineProfile]:
    """The engines prep writes ranks' files for (those whose profile states sharding rules)."""
    return [e for e in map(get_engine, engine_names()) if e.sharding is not None]


def engine_of(name: str) -> EngineProfile:
    """The profile of engine ``name``, which a conversion is for; refused (naming the engines
    prep can convert for) when it is unknown or has no sharding rules."""
    try:
        engine = get_engine(name)
    except KeyError as e:
        raise PrepError(str(e.args[0])) from None
    return convertible(engine)


def convertible(engine: EngineProfile) -> EngineProfile:
    """``engine``, refused (naming the engines prep can convert for) when it has no sharding rules."""
    if engine.sharding is None:
        able = [e.name for e in convertible_engines()]
        raise PrepError(f"engine {engine.name!r} states no sharding rules, so prep cannot write its ranks' files; "
                        f"convert with --engine {' or '.join(able)}")
    return engine


def modules_in_order(cls: Classified) -> list[tuple[str, str]]:
    def key(item):
        nums = [int(x) if x.isdigit() else x for x in _NUMBERS.split(item[0])]
        return [(0, x) if isinstance(x, int) else (1, x) for x in nums]

    return sorted(cls.modules.items(), key=key)


@dataclasses.dataclass(frozen=True)
class _LayerExperts:
    """A layer's stacked experts, as every rank sees them."""

    srcs: list[str]  # expert prefixes in slot order (routed, then the fused shared one)
    n_routed: int
    fused_shared: bool
    inter: int
    hidden: int


def _layer_experts(layer: str, mods: dict[str, str], target: Target, src: SourceCheckpoint) -> _LayerExperts | None:
    mlp = f"{layer}mlp."
    experts = sorted((p for p, k in mods.items() if k == "routed_expert" and p.endswith(".gate_proj")),
                     key=lambda p: int(p.split(".")[-2]))
    if not experts:
        return None
    srcs = [p[: -len(".gate_proj")] for p in experts]
    shared = f"{mlp}shared_experts"
    fuse = target.fuse_shared_expert and f"{shared}.gate_proj" in mods
    if fuse:
        srcs.append(shared)
    for s in srcs:
        for proj in ("gate_proj", "up_proj", "down_proj"):
            if f"{s}.{proj}" not in mods:
                raise PrepError(f"{s}.{proj}.weight: missing or not MXFP4 while other experts of the layer are")
    inter, hidden = _dims(src, f"{srcs[0]}.gate_proj")
    for s in srcs:
        if _dims(src, f"{s}.gate_proj") != (inter, hidden):
            raise PrepError(f"{s}.gate_proj.weight: shape differs from {srcs[0]}.gate_proj.weight; "
                            "cannot stack (use --no-fuse-shared-expert for a differently sized shared expert)")
    if target.ep > len(experts):
        raise PrepError(f"{mlp}experts: --ep {target.ep} exceeds the {len(experts)} routed experts")
    return _LayerExperts(srcs, len(experts), fuse, inter, hidden)


def _layer_groups(layer, mods, rank, target, rules: ShardingRules, family: Family, part, experts: _LayerExperts | None,
                  lays: tuple[Layout, Layout]) -> list[LinearGroup | MoEGroup]:
    """Rank ``rank``'s groups of one layer, as the engine's ``rules`` hold its modules: merged
    modules (those after the experts only in a layer with stacked experts), the stacked experts
    (the rank's block under expert parallel), then every other MXFP4 linear split by its rule."""
    tp, (lay, moe_lay) = target.tp, lays
    out: list[LinearGroup | MoEGroup] = []
    done: set[str] = set()

    def linear(name: str, parts: list[Part]) -> None:
        out.append(LinearGroup(name, rank, tp, tuple(parts), lay))
        done.update(p.src for p in parts)

    def merges(after_experts: bool) -> None:
        for m in rules.merges:
            srcs = [f"{layer}{p}" for p in m.parts]
            if m.after_experts == after_experts and all(s in mods and s not in done for s in srcs):
                linear(f"{layer}{m.module}", [part(s, m.split) for s in srcs])

    merges(after_experts=False)
    if experts is not None:
        srcs, n_routed = experts.srcs, experts.n_routed
        local, ep_range = srcs, None
        if target.ep > 1:
            # Whole experts (MoE tp = 1), the rank's block of the engine's expert map; the fused
            # shared expert is replicated on every rank after its block.
            start, stop = rules.expert_block(n_routed, target.ep, rank)
            local, ep_range = srcs[start:stop] + srcs[n_routed:], (start, stop)
        out.append(MoEGroup(f"{layer}{rules.experts}", rank, tp, tuple(local), experts.inter, experts.hidden,
                            moe_lay, target.inter_pad_to, target.hidden_pad_to, ep=target.ep,
                            routed=ep_range))
        done.update(f"{s}.{p}" for s in srcs for p in ("gate_proj", "up_proj", "down_proj"))
        merges(after_experts=True)

    for prefix in mods:
        if prefix not in done:
            linear(prefix, [part(prefix, rules.split_of(prefix, family))])
    return out


_MTP_TENSOR = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def mtp_replaced(names: Iterable[str], num_hidden_layers: int, rules: ShardingRules) -> list[str]:
    """The MTP layers' tensors among ``names`` (a layer at or past ``num_hidden_layers``) that the
    engine's draft model replaces by the target model's after loading (``rules.mtp_replaced``:
    ATOM's and vLLM's drafters share the target's embedding, vLLM's its head too), so no rank
    reads them."""
    return [n for n in names if (m := _MTP_TENSOR.match(n)) and int(m.group(1)) >= num_hidden_layers
            and m.group(2) in rules.mtp_replaced]


def split_bf16(tensors: Mapping[str, Any], config: dict[str, Any], num_layers: int, tp: int, ep: int,
               fuse_shared_expert: bool, rules: ShardingRules, family: Family | None = None
               ) -> tuple[list[list[Bf16Group]], list[str], list[str]]:
    """Where each non-MXFP4 tensor of ``tensors`` (name -> its dtype and shape) goes in a
    rank-exact conversion: per rank, the BF16 groups it holds (split as the engine whose sharding
    ``rules`` these are holds them, :mod:`prep.bf16`); the tensors every rank holds whole
    (replicated: norms, router, its bias, ``eh_proj``; a replicated ``fused_qkv_a_proj``'s parts are a group); and the tensors no rank
    reads: those of the MTP layer that the engine's drafter replaces by the target model's after
    loading (:func:`mtp_replaced`; ``docs/rank-exact.md``), kept whole only so that ``revert`` is
    exact; and those outside the language model of a multimodal checkpoint (its vision tower) where
    the engine serves the text only. An engine that holds them gets them split as its
    ``ShardingRules.outside`` rows say, in each rank's groups, or (``loads_outside``) whole from the
    common file, for its own loader (placed by the caller). What ``convert`` writes and
    what ``inspect`` says a format-1 rank keeps."""
    wrapper = family.wrapper if family else None
    outside = [n for n in tensors if wrapper and wrapper.is_outside(n)]  # in source order
    held_outside = bool(rules.outside) or rules.loads_outside  # by the rank's files, or the engine's own loader
    unread = mtp_replaced(tensors, num_layers, rules) + ([] if held_outside else outside)
    gone = {*unread, *outside}
    rest = {n: info for n, info in tensors.items() if n not in gone}
    per_rank, replicated = plan_bf16_groups(rest, config, tp, ep, fuse_shared_expert, rules=rules, family=family)
    if rules.outside and outside:  # as the engine holds them, in each rank's files
        split, whole = plan_outside({n: tensors[n] for n in outside}, rules.outside, tp)
        for groups, more in zip(per_rank, split):
            groups += more
        replicated += whole
    return per_rank, replicated, unread


def _as_channel_layouts(groups: list[Bf16Group], modules: list[str], names: tuple[str, str]) -> list[Bf16Group]:
    """One rank's groups with the FP8 per-channel weights and their scales in the engine's layouts
    (``names``: weight, scale). A weight the layout pads needs its scale padded with it: a whole
    scale (a row-parallel linear's, in every rank's files as the source has it) cannot be, so such
    a linear is refused (DeepSeek's o_proj has the hidden size's rows, a multiple of 128)."""
    weight_layout, scale_layout = get_layout(names[0]), get_layout(names[1])
    weights, scales = {f"{m}.weight" for m in modules}, {f"{m}.weight_scale" for m in modules}
    out, scaled = [], set()
    for g in groups:
        if g.dtype == "F8_E4M3" and all(s in weights for s in g.sources()):
            g = g.with_layout(weight_layout)
        elif all(s in scales for s in g.sources()):
            g = g.with_layout(scale_layout)
            scaled.add(g.name)
        out.append(g)
    for g in out:
        if g.layout is weight_layout and g.stored_shape != g.shape and f"{g.name}_scale" not in scaled:
            raise PrepError(f"{g.name} (rank {g.rank}): the engine pads its {g.shape[0]} rows to "
                            f"{g.stored_shape[0]} with their scales, but its scale is held whole on every rank; "
                            "prep does not convert this checkpoint")
    return out


def plan_bf16(src: SourceCheckpoint, cls: Classified, target: Target, engine: EngineProfile
              ) -> tuple[list[list[Bf16Group]], list[str], list[str]]:
    """:func:`split_bf16` of a source's non-MXFP4 tensors for ``target`` (whose engine is
    ``engine``), the stacked BF16 experts in the target's BF16 MoE layout, every group checked."""
    per_rank, replicated, unread = split_bf16({n: src.tensors[n] for n in cls.passthrough}, src.config,
                                              cls.num_layers, target.tp, target.ep, target.fuse_shared_expert,
                                              engine.sharding, cls.family)
    if target.bf16_moe_layout:
        stacked = get_layout(target.bf16_moe_layout)
        # BF16 experts only: the engine processes FP8 experts (and their scales) at load itself
        per_rank = [[g.with_layout(stacked) if g.stacked and g.dtype == "BF16" else g for g in groups]
                    for groups in per_rank]
    if target.fp8_layout and cls.fp8_block:  # FP8 block-scaled weights as the engine holds them once loaded
        fp8, block = get_layout(target.fp8_layout), {f"{m}.weight" for m in cls.fp8_block}
        per_rank = [[g.with_layout(fp8) if g.dtype == "F8_E4M3" and all(s in block for s in g.sources()) else g
                     for g in groups] for groups in per_rank]
    if target.fp8_channel_layouts and cls.fp8:  # FP8 per-channel linears padded and shuffled as the engine holds them
        per_rank = [_as_channel_layouts(groups, cls.fp8, target.fp8_channel_layouts) for groups in per_rank]
    for groups in per_rank:
        for g in groups:
            g.check()
    return per_rank, replicated, unread
