"""Per-rank BF16 groups (prep/bf16.py) against tests/atom_sharding.py, the independent statement
of what ATOM's weight loader keeps: on both generated variants, TP 1/2/4/8, with and without
expert parallel, every stored tensor of every rank (the R1-0528 MTP layer's stacked BF16
experts included) equals the ATOM parameter assembled from the source with ATOM's rules, the
inverse gives each source window back byte for byte, the ranks' windows rebuild every split
source tensor, and the tensors left whole are the ones ATOM replicates."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from atom_sharding import held
from layouts import manifest as schema
from layouts.engines import get_engine
from prep.bf16 import Bf16Group, Placement, group_from_record
from prep.bf16_plan import plan_bf16_groups
from prep.errors import PrepError
from prep.source import SourceCheckpoint
from prep.testing import SynthSpec
from checkpoints import write_checkpoint

ATOM_RULES = get_engine("atom").sharding  # the engine whose BF16 splits these tests check

VARIANTS = ("r1-0528", "v2")


@pytest.fixture(scope="module", params=VARIANTS)
def source(request, tmp_path_factory):
    spec = SynthSpec(variant=request.param)
    return SourceCheckpoint(write_checkpoint(spec, tmp_path_factory.mktemp(request.param) / "ckpt"))


def _bf16(src: SourceCheckpoint) -> dict:
    return {n: i for n, i in src.tensors.items() if i.dtype != "U8"}


def _atom_param(src: SourceCheckpoint, group: Bf16Group, tp: int, rank: int, ep: int) -> torch.Tensor:
    """The ATOM parameter the group stands for, assembled from whole source tensors with
    atom_sharding's rules (each held slice copied to its slot and offset); NaN where no source
    landed, so a part prep left out shows."""
    param = torch.full(group.shape, float("nan"), dtype=torch.bfloat16)
    for name in group.sources():
        info = src.tensors[name]
        h = held(src.config, name, tuple(info.shape), tp, rank, ep)
        assert h is not None, f"{name}: stored on rank {rank}, which ATOM does not give it"
        piece = h.take(src.read(name))
        dest = param if h.slot is None else param[h.slot]
        dest.narrow(h.dest_axis, h.dest_offset, piece.shape[h.dest_axis]).copy_(piece)
    return param


def _atom_experts(src: SourceCheckpoint, mlp: str, tp: int, rank: int, ep: int) -> int:
    """How many experts ATOM stacks on the rank: those atom_sharding gives it, the shared one included."""
    names = [n for n in src.tensors if n.startswith(mlp) and n.endswith(".gate_proj.weight")]
    return sum(held(src.config, n, tuple(src.tensors[n].shape), tp, rank, ep) is not None for n in names)


@pytest.mark.parametrize("tp", (1, 2, 4, 8))
@pytest.mark.parametrize("expert_parallel", [False, True])
def test_each_rank_stores_what_atoms_loader_keeps(source, tp, expert_parallel):
    ep = tp if expert_parallel else 1
    per_rank, whole = plan_bf16_groups(_bf16(source), source.config, tp, ep, rules=ATOM_RULES)
    for rank, groups in enumerate(per_rank):
        assert groups, "every rank holds split BF16 tensors (embeddings and heads at least)"
        for g in groups:
            g.check()
            (stored,) = g.build(source.read)
            expected = _atom_param(source, g, tp, rank, ep)
            assert stored.dtype == expected.dtype and torch.equal(stored, expected), (g.name, rank)
            if g.stacked:
                assert stored.shape[0] == _atom_experts(source, g.name.rsplit("experts.", 1)[0], tp, rank, ep)
            # streamed in small row blocks, the file bytes are the same
            blocks = torch.cat([t for _, t in g.build_chunks(source.read, chunk_bytes=1000)])
            assert torch.equal(blocks, stored)
    for name in whole:  # left whole: ATOM keeps the whole tensor on every rank
        info = source.tensors[name]
        assert all(held(source.config, name, tuple(info.shape), tp, r, ep).axis is None for r in range(tp)), name


@pytest.mark.parametrize("tp", (1, 4, 8))
@pytest.mark.parametrize("expert_parallel", [False, True])
def test_inverse_rebuilds_every_split_tensor_bit_for_bit(source, tp, expert_parallel):
    bf16 = _bf16(source)
    per_rank, whole = plan_bf16_groups(bf16, source.config, tp, tp if expert_parallel else 1, rules=ATOM_RULES)
    rebuilt = {n: torch.full(tuple(bf16[n].shape), float("nan"), dtype=torch.bfloat16)
               for groups in per_rank for g in groups for n in g.sources()}
    for groups in per_rank:
        for g in groups:
            g = group_from_record(g.record("f"))  # as revert gets it: from the manifest's record
            for name, (rows, cols), t in g.invert(g.build(source.read)):
                assert torch.equal(t, source.read(name, rows, cols)), name
                rebuilt[name][rows, cols] = t
    for name, t in rebuilt.items():
        assert torch.equal(t, source.read(name)), name
    assert set(rebuilt) | set(whole) == set(bf16)
    assert not set(rebuilt) & set(whole)


@pytest.mark.parametrize("tp", (1, 2, 4, 8))
@pytest.mark.parametrize("expert_parallel", [False, True])
def test_a_record_through_the_manifest_schema_gives_the_same_placements(source, tp, expert_parallel):
    """Every group's record, as JSON through ``layouts.manifest.GroupRecord`` (what convert writes
    and a reader parses), expands back into the very placements the plan made, in order; a
    stacked group is written as its template, a few windows and its expert ranges, not one
    placement per expert."""
    per_rank, _ = plan_bf16_groups(_bf16(source), source.config, tp, tp if expert_parallel else 1,
                                   rules=ATOM_RULES)
    stacks = 0
    for groups in per_rank:
        for g in groups:
            rec = schema.GroupRecord.from_json(json.loads(json.dumps(g.record("f").to_json())))
            back = group_from_record(rec)
            assert back == g, g.name
            written = rec.to_json()
            assert ("stack" in written) == g.stacked and ("placements" in written) != g.stacked
            if g.stacked:
                stacks += 1
                stack = written["stack"]
                assert len(stack["experts"]) == 1 and len(stack["windows"]) in (1, 2)
                assert stack["shared"] == (g.placements[-1].source.split(".mlp.")[1].startswith("shared_experts"))
    assert stacks == (2 * tp if source.config["quantization_config"]["exclude"][0] == "*self_attn*" else 0)


def test_a_stack_whose_experts_differ_in_shape_is_refused_when_recorded():
    """The template says one window for every expert: a group where one expert's window differs
    (a damaged source) stops when recorded, naming the tensor, rather than writing a wrong record."""
    mlp = "model.layers.3.mlp."
    ps = [Placement(f"{mlp}experts.{e}.down_proj.weight", (64, 32), 1, 0, 16, 0, e) for e in range(3)]
    g = Bf16Group(f"{mlp}experts.w2_weight", 0, 2, "BF16", tuple(ps))
    assert group_from_record(g.record("f")) == g and g.record("f").stack.experts == ((0, 3),)
    odd = dataclasses.replace(g, placements=(*ps[:2], dataclasses.replace(ps[2], start=16, stop=32)))
    with pytest.raises(PrepError, match=rf"{mlp}experts.w2_weight \(rank 0\): its experts do not all take the same"):
        odd.record("f")


def test_r1_attention_and_vocab_are_split_and_v2_keeps_its_attention_mxfp4(source):
    per_rank, _ = plan_bf16_groups(_bf16(source), source.config, 4, rules=ATOM_RULES)
    names = {g.name for g in per_rank[0]}
    assert {"model.embed_tokens.weight", "lm_head.weight", "model.layers.3.embed_tokens.weight",
            "model.layers.3.shared_head.head.weight"} <= names
    attn = {n for n in names if ".self_attn." in n}
    if source.config["quantization_config"]["exclude"][0] == "*self_attn*":  # r1-0528
        assert {"model.layers.0.self_attn.fused_qkv_a_proj.weight", "model.layers.3.self_attn.o_proj.weight",
                "model.layers.2.self_attn.kv_b_proj.weight", "model.layers.1.self_attn.q_b_proj.weight"} <= attn
        # the MTP layer's BF16 experts, stacked with the shared one in the last slot; the decoder
        # layers' experts are MXFP4 (prep's MoE groups)
        stacked = {g.name: g for g in per_rank[0] if g.stacked}
        assert set(stacked) == {"model.layers.3.mlp.experts.w13_weight", "model.layers.3.mlp.experts.w2_weight"}
        w13 = stacked["model.layers.3.mlp.experts.w13_weight"]
        assert w13.shape == (9, 2 * 256 // 4, 256)
        assert {p.source for p in w13.placements if p.slot == 8} == {
            "model.layers.3.mlp.shared_experts.gate_proj.weight", "model.layers.3.mlp.shared_experts.up_proj.weight"}
    else:
        assert not attn and not any(g.stacked for g in per_rank[0])


def test_refuses_a_vocabulary_that_does_not_divide(source):
    with pytest.raises(PrepError, match=r"model.embed_tokens.weight: dim 0 of 1024 does not split over tp=3"):
        plan_bf16_groups(_bf16(source), source.config, 3, rules=ATOM_RULES)


def test_refuses_a_stored_tensor_of_the_wrong_shape(source):
    g = plan_bf16_groups(_bf16(source), source.config, 2, rules=ATOM_RULES)[0][0][0]
    (t,) = g.build(source.read)
    with pytest.raises(PrepError, match=rf"{g.name} \(rank 0\): stored shape"):
        list(g.invert([t[:-1]]))


def test_a_rank_file_written_by_prep_writer_holds_the_built_tensors(source, tmp_path):
    """Through prep's own writer, built in its staging memory as convert does (``alloc``), in
    small blocks: the file read back holds exactly what ``build`` gives, with its hashes."""
    from layouts.safetensors_file import TORCH_DTYPES, SafetensorsFile, tensor_hash
    from prep.safetensors_writer import StreamingSafetensorsWriter, nbytes

    groups = plan_bf16_groups(_bf16(source), source.config, 4, 4, rules=ATOM_RULES)[0][1]
    entries = [(g.name, g.dtype, g.shape) for g in groups]
    path = tmp_path / "rank1.safetensors"
    with StreamingSafetensorsWriter(path, entries) as w:
        def room(name, shape, dtype):
            buf = w.reserve(name, nbytes(dtype, shape))
            return None if buf is None else buf.view(TORCH_DTYPES[dtype]).view(shape)

        for g in groups:
            for name, chunk in g.build_chunks(source.read, 4096, alloc=room):
                w.write(name, chunk)
    f = SafetensorsFile(path)
    _, views = f.read_all()
    for g in groups:
        (built,) = g.build(source.read)
        assert torch.equal(views[g.name], built), g.name
        assert w.hashes[g.name] == tensor_hash(built)


def test_without_a_q_lora_kv_a_is_held_whole_and_a_lone_merge_part_is_refused():
    # DeepSeek-V2-Lite has no q LoRA: no q_a_proj, so the engine's fused_qkv_a_proj merge does not
    # exist and kv_a is replicated whole; with a q LoRA a kv_a whose partner is not BF16 is refused.
    from types import SimpleNamespace

    kv_a = "model.layers.0.self_attn.kv_a_proj_with_mqa.weight"
    tensors = {kv_a: SimpleNamespace(dtype="BF16", shape=(96, 64))}
    per_rank, whole = plan_bf16_groups(tensors, {"q_lora_rank": None, "model_type": "deepseek_v2"}, 2,
                                       rules=ATOM_RULES)
    assert whole == [kv_a] and per_rank == [[], []]
    with pytest.raises(PrepError, match="its partner of model.layers.0.self_attn.fused_qkv_a_proj.weight"):
        plan_bf16_groups(tensors, {"q_lora_rank": 32, "model_type": "deepseek_v2"}, 2, rules=ATOM_RULES)


@pytest.fixture(scope="module")
def r1_source(tmp_path_factory):
    return SourceCheckpoint(write_checkpoint(SynthSpec(variant="r1-0528"), tmp_path_factory.mktemp("r1") / "ckpt"))


def test_an_unfused_bf16_shared_expert_is_merged_and_split_as_an_mlp_of_its_own(r1_source):
    # R1-0528's MTP layer: BF16 routed and shared experts. Not stacked with the routed ones, the
    # shared expert is the engine's gate_up_proj (gate rows then up rows, split) and a split down.
    from layouts.engines.vllm import SHARDING

    mlp = "model.layers.3.mlp.shared_experts."
    per_rank, whole = plan_bf16_groups(_bf16(r1_source), r1_source.config, 2, 1, False, rules=SHARDING)
    assert not [n for n in whole if n.startswith(mlp)]
    n = r1_source.tensors[f"{mlp}gate_proj.weight"].shape[0] // 2
    for rank, groups in enumerate(per_rank):
        by_name = {g.name: g for g in groups}
        gate_up = by_name[f"{mlp}gate_up_proj.weight"]
        assert [(p.source, p.dim, p.start, p.dest_row) for p in gate_up.placements] == [
            (f"{mlp}gate_proj.weight", 0, rank * n, 0), (f"{mlp}up_proj.weight", 0, rank * n, n)]
        down = by_name[f"{mlp}down_proj.weight"]
        k = r1_source.tensors[f"{mlp}down_proj.weight"].shape[1] // 2
        assert [(p.dim, p.start, p.stop) for p in down.placements] == [(1, rank * k, (rank + 1) * k)]
        stack = by_name["model.layers.3.mlp.experts.routed_experts.w13_weight"]
        assert not [p for p in stack.placements if "shared" in p.source]  # 8 routed experts only
        assert stack.shape[0] == 8
        # the inverse gives every window back
        for name, (rows, cols), t in gate_up.invert(gate_up.build(r1_source.read)):
            assert (rows.start, rows.stop) == (rank * n, (rank + 1) * n)
            assert torch.equal(t, r1_source.read(name)[rows, cols])


def test_a_bf16_expert_intermediate_the_engines_moe_would_pad_is_refused(r1_source):
    # vLLM's aiter MoE pads a rank's BF16 intermediate to a multiple of 64 (<= 192) or 128; the
    # tiny 256 at TP 8 is 32 a rank, which it would pad from memory prep never writes.
    from layouts.engines.vllm import SHARDING

    assert plan_bf16_groups(_bf16(r1_source), r1_source.config, 4, 1, False, rules=SHARDING)  # 64: fits
    with pytest.raises(PrepError, match=r"experts\.0\.gate_proj\.weight: a rank's intermediate of 32 is padded to a "
                                        r"multiple of 64 .* choose another --tp \(or --ep equal to --tp\)"):
        plan_bf16_groups(_bf16(r1_source), r1_source.config, 8, 1, False, rules=SHARDING)
    assert plan_bf16_groups(_bf16(r1_source), r1_source.config, 8, 8, False, rules=SHARDING)  # EP: whole experts


@pytest.mark.parametrize("ep", [1, 2])
def test_a_bf16_shared_expert_beside_mxfp4_routed_ones_is_an_mlp_of_its_own(r1_source, ep):
    # Only the shared expert BF16 (routed experts quantized): held as gate_up / down split by TP on
    # every rank, with or without expert parallel (which moves routed experts only).
    mlp = "model.layers.3.mlp.shared_experts."
    shared = {n: i for n, i in _bf16(r1_source).items() if n.startswith(mlp)}
    per_rank, whole = plan_bf16_groups(shared, r1_source.config, 2, ep, rules=ATOM_RULES)
    assert not whole
    assert [sorted(g.name for g in groups) for groups in per_rank] == [
        [f"{mlp}down_proj.weight", f"{mlp}gate_up_proj.weight"]] * 2
