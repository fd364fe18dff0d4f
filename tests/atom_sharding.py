"""What ATOM's own weight loader keeps, on one rank, of each non-MXFP4 tensor of a DeepSeek-V3/R1
checkpoint (the BF16 weights and norms, the F32 router bias).

Written for the tests from ATOM's layer classes (ROCm/ATOM at ffdf3bb5), not from prep's code,
so that a test comparing a converted rank with it checks prep against the engine and not against
itself. ``docs/rank-exact.md`` cites the ATOM file and line behind each rule; in short:

- ``VocabParallelEmbedding`` / ``ParallelLMHead`` (``embed_tokens``, ``lm_head``, the MTP layer's
  ``embed_tokens`` and ``shared_head.head``): rows ``[r * V/tp, (r+1) * V/tp)``; ATOM asserts
  ``V % tp == 0`` and pads nothing.
- ``ColumnParallelLinear`` (``q_b_proj`` / ``q_proj``, ``kv_b_proj``): rows ``[r * N/tp, ...)``.
- ``RowParallelLinear`` (``o_proj``, a BF16 dense ``down_proj``): columns ``[r * K/tp, ...)``.
- ``MergedColumnParallelLinear`` (a BF16 dense ``gate_proj`` / ``up_proj`` into ``gate_up_proj``):
  each part's ``chunk(tp)[r]``, the gate part first.
- ``MergedReplicatedLinear`` (``q_a_proj`` / ``kv_a_proj_with_mqa`` into ``fused_qkv_a_proj``):
  the whole tensor, ``q_a`` in rows ``[0, q_lora_rank)``, ``kv_a`` after it.
- ``ReplicatedLinear`` (``mlp.gate``, the MTP ``eh_proj``), ``RMSNorm`` weights and
  ``e_score_correction_bias`` (``default_weight_loader``): the whole tensor on every rank.
- ``FusedMoE`` experts in BF16 (the R1-0528 MTP layer): ``gate_proj`` -> ``w13`` first half,
  ``up_proj`` -> second half, each rows ``[r * I/tp, ...)``; ``down_proj`` -> ``w2`` columns
  ``[r * I/tp, ...)``. Under expert parallel (ATOM: ep_size = tp_size, MoE tp = 1) whole experts,
  contiguous blocks of ``E // ep`` (the remainder to the last rank), the shared expert fused as
  slot ``E`` (tp) or after the rank's block (ep) on every rank.
- The MTP layer (``model.layers.{num_hidden_layers + i}``) is skipped by the target model and
  loaded by ``DeepSeekMTP``: its ``embed_tokens`` becomes the draft's ``model.embed_tokens``, its
  ``enorm``/``hnorm``/``eh_proj``/``shared_head`` stay its own, the rest goes to ``.mtp_block.``.
  (ATOM's drafter then swaps the draft's embedding for the target's; :func:`held` states what
  the loader writes, before that swap.)
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import torch

ATOM_COMMIT = "ffdf3bb5ddf8a15a64d521a2eeb3bc7438f9ac21"

_REPLICATED_NORMS = ("input_layernorm", "post_attention_layernorm", "self_attn.q_a_layernorm",
                     "self_attn.kv_a_layernorm")
_MTP_OWN = ("embed_tokens", "enorm", "hnorm", "eh_proj", "shared_head")  # names the draft keeps per layer
_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight$")
_SHARED = re.compile(r"mlp\.shared_experts\.(gate|up|down)_proj\.weight$")


@dataclasses.dataclass(frozen=True)
class Held:
    """The part of one source tensor one rank's ATOM model holds, and where it lands.

    ``axis`` is None for a whole tensor; else the rank keeps ``source.narrow(axis, start, length)``.
    ``param`` is the ATOM parameter it is copied into, in ``model`` ("target":
    ``DeepseekV3ForCausalLM``; "draft": ``DeepSeekMTP``); ``dest_axis``/``dest_offset`` say where
    inside that parameter (merged and stacked parameters), ``slot`` the expert slot for experts.
    """

    name: str
    model: str
    param: str
    rule: str
    axis: int | None
    start: int
    length: int
    dest_axis: int = 0
    dest_offset: int = 0
    slot: int | None = None

    def take(self, source: torch.Tensor) -> torch.Tensor:
        return source if self.axis is None else source.narrow(self.axis, self.start, self.length)


def _split(n: int, parts: int, what: str) -> int:
    if n % parts:  # ATOM's divide() / its asserts: no padding, a refusal
        raise ValueError(f"{what}: {n} does not divide over {parts} ranks (ATOM asserts it)")
    return n // parts


def expert_block(n_routed: int, ep: int, rank: int) -> range:
    """The routed experts rank ``rank`` owns under expert parallel: ATOM's ``determine_expert_map``
    (contiguous blocks of ``n_routed // ep``, every remaining expert to the last rank)."""
    per = n_routed // ep
    return range(rank * per, n_routed if rank == ep - 1 else (rank + 1) * per)


def held(config: dict[str, Any], name: str, shape: tuple[int, ...], tp: int, rank: int, ep: int = 1,
         fuse_shared_expert: bool = True) -> Held | None:
    """What rank ``rank`` of ``tp`` holds of non-MXFP4 source tensor ``name`` (of ``shape``), or
    None when the rank holds none of it (a routed expert another rank owns under expert parallel).

    ``ep`` is 1 or ``tp`` (ATOM runs expert parallel with ep_size = tp_size). ``fuse_shared_expert``:
    whether the shared expert goes into the routed experts' stacked tensor (ATOM does when both
    have the same quantization, as in DeepSeek's MXFP4 checkpoints). Unknown names raise."""
    if ep not in (1, tp):
        raise ValueError(f"ep={ep} with tp={tp}: ATOM runs expert parallel with ep_size = tp_size")
    if not 0 <= rank < tp:
        raise ValueError(f"rank {rank} outside tp={tp}")
    n_layers = config["num_hidden_layers"]
    n_mtp = config.get("num_nextn_predict_layers") or 0

    def whole(model: str, param: str, rule: str = "replicated", offset: int = 0) -> Held:
        return Held(name, model, param, rule, None, 0, shape[0] if shape else 1, 0, offset)

    def part(axis: int, model: str, param: str, rule: str, parts: int = tp, r: int = rank, offset: int = 0,
             slot: int | None = None) -> Held:
        n = _split(shape[axis], parts, f"{name} dim {axis}")
        # One part is the whole tensor: reported as such (axis None), as a replicated one is.
        return Held(name, model, param, rule, axis if parts > 1 else None, r * n, n, axis, offset, slot)

    def rows(model: str, param: str, rule: str, offset: int = 0) -> Held:
        return part(0, model, param, rule, offset=offset)

    def cols(model: str, param: str, rule: str) -> Held:
        return part(1, model, param, rule)

    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        return rows("target", name, "vocab")
    if name == "model.norm.weight":
        return whole("target", name)
    m = _LAYER.match(name)
    if not m:
        raise ValueError(f"{name}: not a DeepSeek-V3 tensor ATOM loads")
    layer, rest = int(m.group(1)), m.group(2)
    if layer < n_layers:
        model, prefix = "target", f"model.layers.{layer}."
    elif layer < n_layers + n_mtp:
        model = "draft"
        own = next((w for w in _MTP_OWN if w in rest), None)
        if own == "embed_tokens":  # the draft's model-level embedding (rewrite_spec_layer_name)
            return rows(model, "model.embed_tokens.weight", "vocab")
        if own == "shared_head" and rest == "shared_head.head.weight":
            return rows(model, name, "vocab")
        if own is not None:  # enorm, hnorm, eh_proj (ReplicatedLinear), shared_head.norm
            if rest not in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight"):
                raise ValueError(f"{name}: not a DeepSeek MTP tensor ATOM loads")
            return whole(model, name)
        prefix = f"model.layers.{layer}.mtp_block."
    else:
        raise ValueError(f"{name}: layer {layer} is neither a decoder layer (< {n_layers}) nor an MTP layer")

    heads = config["num_attention_heads"]
    attn = rest.startswith("self_attn.")
    if attn:
        _split(heads, tp, "num_attention_heads")  # DeepseekV2MLAAttention asserts it
    if rest in (f"{n}.weight" for n in _REPLICATED_NORMS) or rest in ("mlp.gate.weight",
                                                                       "mlp.gate.e_score_correction_bias"):
        return whole(model, prefix + rest)
    if rest == "self_attn.q_a_proj.weight":
        return whole(model, prefix + "self_attn.fused_qkv_a_proj.weight", "merged_replicated")
    if rest == "self_attn.kv_a_proj_with_mqa.weight":
        if config.get("q_lora_rank") is None:
            return whole(model, prefix + rest)
        return whole(model, prefix + "self_attn.fused_qkv_a_proj.weight", "merged_replicated",
                     offset=config["q_lora_rank"])
    if rest in ("self_attn.q_b_proj.weight", "self_attn.q_proj.weight", "self_attn.kv_b_proj.weight"):
        return rows(model, prefix + rest, "column")
    if rest == "self_attn.o_proj.weight":
        return cols(model, prefix + rest, "row")
    if rest in ("mlp.gate_proj.weight", "mlp.up_proj.weight"):  # dense MLP, MergedColumnParallelLinear
        part = _split(shape[0], tp, f"{name} dim 0")
        return rows(model, prefix + "mlp.gate_up_proj.weight", "merged_column",
                    offset=0 if rest.startswith("mlp.gate_proj") else part)
    if rest == "mlp.down_proj.weight":
        return cols(model, prefix + rest, "row")

    n_routed = config["n_routed_experts"]
    e = _EXPERT.match(rest)
    s = _SHARED.match(rest)
    if s and not fuse_shared_expert:  # a standalone DeepseekV2MLP
        proj = s.group(1)
        if proj == "down":
            return cols(model, prefix + rest, "row")
        part = _split(shape[0], tp, f"{name} dim 0")
        return rows(model, prefix + "mlp.shared_experts.gate_up_proj.weight", "merged_column",
                    offset=0 if proj == "gate" else part)
    if e or s:
        proj = e.group(2) if e else s.group(1)
        if ep > 1:  # whole experts; MoE tp = 1
            block = expert_block(n_routed, ep, rank)
            if e:
                expert = int(e.group(1))
                if expert not in block:
                    return None
                slot = expert - block.start
            else:
                slot = len(block)  # the fused shared expert follows the rank's block on every rank
            moe_tp, moe_rank = 1, 0
        else:
            slot = int(e.group(1)) if e else n_routed
            moe_tp, moe_rank = tp, rank
        param = prefix + ("mlp.experts.w2_weight" if proj == "down" else "mlp.experts.w13_weight")
        if proj == "down":  # w2: the intermediate (input) dim split
            return part(1, model, param, "expert_w2", moe_tp, moe_rank, slot=slot)
        n = _split(shape[0], moe_tp, f"{name} dim 0")  # w13: gate in the first half, up in the second
        return part(0, model, param, "expert_w13", moe_tp, moe_rank, 0 if proj == "gate" else n, slot)
    raise ValueError(f"{name}: not a DeepSeek-V3 tensor ATOM loads")
