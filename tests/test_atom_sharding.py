"""Pins tests/atom_sharding.py, the test-side statement of what ATOM's weight loader keeps per rank
of each BF16 tensor: on both generated variants and TP 1/2/4/8 (with and without expert
parallel), every rank's pieces fill the parameters exactly as ATOM allocates them (every element
written once, which is what ATOM's "NOT loaded" check asks), the ranks' pieces of a split tensor
put back together give the source, and the real bytes land where ATOM's layer classes put them
(heads, vocabulary ranges, expert blocks), stated here a second way."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from atom_sharding import Held, expert_block, held
from prep.testing import SynthSpec, build_config, tensor_specs
from checkpoints import write_checkpoint

VARIANTS = ("r1-0528", "v2")
TPS = (1, 2, 4, 8)


def _bf16_specs(spec: SynthSpec) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    return {n: sd for n, sd in tensor_specs(spec).items() if sd[1] != torch.uint8}


def _atom_shape(cfg: dict, param: str, tp: int, ep: int, rank: int) -> tuple[int, ...]:
    """The shape ATOM allocates for ``param`` on a rank, from config.json alone (its layer
    constructors' arithmetic, written independently of atom_sharding.held)."""
    h, v, heads = cfg["hidden_size"], cfg["vocab_size"], cfg["num_attention_heads"]
    nope, rope, vh = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    e, inter = cfg["n_routed_experts"], cfg["moe_intermediate_size"]
    leaf = param.rsplit(".", 2)[-2] if param.endswith(".weight") else param.rsplit(".", 1)[-1]
    if param.endswith(("embed_tokens.weight", "lm_head.weight", "shared_head.head.weight")):
        return (v // tp, h)
    if leaf in ("input_layernorm", "post_attention_layernorm", "norm", "enorm", "hnorm"):
        return (h,)
    table = {
        "q_a_layernorm": (cfg["q_lora_rank"],), "kv_a_layernorm": (cfg["kv_lora_rank"],),
        "gate": (e, h), "e_score_correction_bias": (e,),
        "fused_qkv_a_proj": (cfg["q_lora_rank"] + cfg["kv_lora_rank"] + rope, h),
        "q_b_proj": (heads // tp * (nope + rope), cfg["q_lora_rank"]),
        "kv_b_proj": (heads // tp * (nope + vh), cfg["kv_lora_rank"]),
        "o_proj": (h, heads // tp * vh), "eh_proj": (h, 2 * h),
        "gate_up_proj": (2 * cfg["intermediate_size"] // tp, h), "down_proj": (h, cfg["intermediate_size"] // tp),
    }
    if leaf in table:
        return table[leaf]
    local = (len(expert_block(e, ep, rank)) if ep > 1 else e) + cfg["n_shared_experts"]
    moe_tp = 1 if ep > 1 else tp
    if param.endswith("experts.w13_weight"):
        return (local, 2 * inter // moe_tp, h)
    if param.endswith("experts.w2_weight"):
        return (local, h, inter // moe_tp)
    raise AssertionError(f"no ATOM shape for {param}")


def _region(buf: torch.Tensor, h: Held, source_shape: tuple[int, ...]) -> torch.Tensor:
    """The part of an ATOM parameter ``h`` writes."""
    dest = buf if h.slot is None else buf[h.slot]
    length = h.length if h.axis is not None else source_shape[h.dest_axis] if source_shape else 1
    return dest.narrow(h.dest_axis, h.dest_offset, length)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("tp", TPS)
@pytest.mark.parametrize("expert_parallel", [False, True])
def test_every_parameter_element_is_written_exactly_once(variant, tp, expert_parallel):
    spec = SynthSpec(variant=variant)
    cfg, specs = build_config(spec), _bf16_specs(spec)
    ep = tp if expert_parallel else 1
    for rank in range(tp):
        counts: dict[tuple[str, str], torch.Tensor] = {}
        for name, (shape, _) in specs.items():
            h = held(cfg, name, shape, tp, rank, ep)
            if h is None:
                continue
            key = (h.model, h.param)
            if key not in counts:
                counts[key] = torch.zeros(_atom_shape(cfg, h.param, tp, ep, rank), dtype=torch.int32)
            region = _region(counts[key], h, shape)
            assert region.shape == h.take(torch.empty(shape)).shape, (name, h)
            region += 1
        for (model, param), c in counts.items():
            assert bool((c == 1).all()), f"{model} {param}: elements written {sorted(set(c.flatten().tolist()))} times"
        models = {m for m, _ in counts}
        assert models == {"target", "draft"}  # the MTP layer goes to the draft model only


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("tp", TPS)
@pytest.mark.parametrize("expert_parallel", [False, True])
def test_split_tensors_are_partitioned_over_ranks_and_the_rest_replicated(variant, tp, expert_parallel):
    spec = SynthSpec(variant=variant)
    cfg, ep = build_config(spec), tp if expert_parallel else 1
    for name, (shape, _) in _bf16_specs(spec).items():
        per_rank = [held(cfg, name, shape, tp, r, ep) for r in range(tp)]
        kept = [h for h in per_rank if h is not None]
        if ".mlp.experts." in name and ep > 1:  # a routed expert: whole, on exactly one rank
            assert len(kept) == 1 and kept[0].axis is None, name
            continue
        assert len(kept) == tp, name
        if kept[0].axis is None:
            assert all(h.axis is None for h in kept), name
            continue
        axis = kept[0].axis
        assert [(h.axis, h.start) for h in kept] == [(axis, r * shape[axis] // tp) for r in range(tp)], name
        assert sum(h.length for h in kept) == shape[axis], name


def _load(ckpt: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(ckpt.glob("*.safetensors")):
        with safe_open(str(f), "pt") as sf:
            out.update({k: sf.get_tensor(k) for k in sf.keys() if sf.get_slice(k).get_dtype() != "U8"})
    return out


@pytest.fixture(scope="module", params=VARIANTS)
def checkpoint(request, tmp_path_factory):
    spec = SynthSpec(variant=request.param)
    return spec, _load(write_checkpoint(spec, tmp_path_factory.mktemp(request.param) / "ckpt"))


@pytest.mark.parametrize("tp", (2, 8))
def test_real_bytes_land_where_atoms_layers_put_them(checkpoint, tp):
    spec, tensors = checkpoint
    cfg = build_config(spec)
    heads, q_head = cfg["num_attention_heads"], cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]
    v, layer = cfg["vocab_size"], cfg["num_hidden_layers"] - 1  # the last decoder layer is MoE
    attn = f"model.layers.{layer}.self_attn"
    for rank in range(tp):
        def got(name, ep=1):
            h = held(cfg, name, tuple(tensors[name].shape), tp, rank, ep)
            return None if h is None else h.take(tensors[name])

        lo, hi = rank * v // tp, (rank + 1) * v // tp  # VocabParallelEmbedding's vocab_start/end_idx
        for name in ("model.embed_tokens.weight", "lm_head.weight", f"model.layers.{layer + 1}.embed_tokens.weight",
                     f"model.layers.{layer + 1}.shared_head.head.weight"):
            assert torch.equal(got(name), tensors[name][lo:hi])
        hs = slice(rank * heads // tp, (rank + 1) * heads // tp)  # the rank's heads
        mtp_attn = f"model.layers.{layer + 1}.self_attn"
        for a in ([attn] if spec.variant == "r1-0528" else []) + ([mtp_attn] if spec.variant == "r1-0528" else []):
            qb = tensors[f"{a}.q_b_proj.weight"]
            assert torch.equal(got(f"{a}.q_b_proj.weight"), qb.view(heads, q_head, -1)[hs].reshape(-1, qb.shape[1]))
            o = tensors[f"{a}.o_proj.weight"]
            assert torch.equal(got(f"{a}.o_proj.weight"), o.view(o.shape[0], heads, -1)[:, hs].reshape(o.shape[0], -1))
            assert torch.equal(got(f"{a}.q_a_proj.weight"), tensors[f"{a}.q_a_proj.weight"])
        for name in (f"model.layers.{layer}.mlp.gate.weight", f"model.layers.{layer}.mlp.gate.e_score_correction_bias",
                     "model.norm.weight", f"model.layers.{layer + 1}.eh_proj.weight"):
            assert torch.equal(got(name), tensors[name])
        if spec.variant == "r1-0528":  # the MTP layer's BF16 experts
            mlp, n_routed = f"model.layers.{layer + 1}.mlp", cfg["n_routed_experts"]
            owners = [e for e in range(n_routed) if got(f"{mlp}.experts.{e}.gate_proj.weight", ep=tp) is not None]
            per = n_routed // tp
            assert owners == list(range(rank * per, (rank + 1) * per))  # n_routed divides: no remainder here
            inter = cfg["moe_intermediate_size"] // tp
            up = tensors[f"{mlp}.experts.0.up_proj.weight"]
            assert torch.equal(got(f"{mlp}.experts.0.up_proj.weight"), up[rank * inter:(rank + 1) * inter])


def test_expert_block_gives_the_remainder_to_the_last_rank():
    assert [list(expert_block(10, 4, r)) for r in range(4)] == [[0, 1], [2, 3], [4, 5], [6, 7, 8, 9]]


def test_refuses_what_atom_asserts_against():
    cfg = build_config(SynthSpec())
    with pytest.raises(ValueError, match="does not divide over 3"):
        held(cfg, "lm_head.weight", (1024, 256), 3, 0)  # ATOM pads no vocabulary: it asserts V % tp == 0
    with pytest.raises(ValueError, match="num_attention_heads"):
        held(cfg, "model.layers.0.self_attn.kv_b_proj.weight", (8 * 64, 128), 16, 0)
    with pytest.raises(ValueError, match="ep_size = tp_size"):
        held(cfg, "model.norm.weight", (256,), 4, 0, ep=2)
    with pytest.raises(ValueError, match="not a DeepSeek-V3 tensor"):
        held(cfg, "model.layers.0.self_attn.rotary.inv_freq", (8,), 1, 0)
