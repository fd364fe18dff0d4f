"""How prep applies ``bf16-preshuffle`` to the BF16 experts it stacks (R1-0528's MTP layer), as the
two helpers a converter and a reader need, checked end to end on a generated R1-0528 checkpoint:
every rank's stored ``w13``/``w2`` equals what ATOM holds after its own loader (the slices
tests/atom_sharding.py gives) and after ``UnquantizedFusedMoEMethod.process_weights_after_loading``
(aiter's ``shuffle_weight`` on each expert, run here from aiter's own file), and inverting the
stored bytes a block of experts at a time gives every source window back.

The helpers are what ``prep.bf16.Bf16Group`` does once it carries a layout name (see the
report / docs/rank-exact.md): the layout comes from the engine profile
(``layouts.get_engine("atom").bf16_moe_layout``), never spelled in prep."""

from __future__ import annotations

import pytest
import torch

import layouts as L
from prep.bf16 import Bf16Group, group_from_record
from prep.bf16_plan import plan_bf16_groups
from prep.source import SourceCheckpoint
from prep.testing import SynthSpec
from checkpoints import write_checkpoint
from test_bf16_groups import ATOM_RULES, _atom_param, _bf16

LAYOUT = L.get_layout(L.get_engine("atom").bf16_moe_layout)


def shuffled_chunks(group: Bf16Group, read, chunk_bytes: int):
    """``group.build_chunks`` with each block of whole experts put in the layout where it lies
    (the block is the writer's staging memory; the transform copies it once)."""
    LAYOUT.check(group.shape, None, group.name)
    assert LAYOUT.experts_transform_independently(group.shape[1])
    for name, block in group.build_chunks(read, chunk_bytes):
        yield name, LAYOUT.weight.forward(block, block)


def unshuffled(stored: torch.Tensor, experts_per_block: int) -> torch.Tensor:
    """The stored stacked tensor back in source order, a block of whole experts at a time."""
    blocks = (stored[e:e + experts_per_block] for e in range(0, stored.shape[0], experts_per_block))
    return torch.cat([LAYOUT.weight.inverse(b, tuple(b.shape)) for b in blocks])


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return SourceCheckpoint(write_checkpoint(SynthSpec(variant="r1-0528"), tmp_path_factory.mktemp("r1") / "ckpt"))


@pytest.mark.parametrize("tp", (1, 2, 4, 8))
@pytest.mark.parametrize("expert_parallel", [False, True])
def test_stored_bf16_experts_are_what_atom_holds_after_processing_and_invert_exactly(
        source, aiter_shuffle, tp, expert_parallel):
    ep = tp if expert_parallel else 1
    per_rank, _ = plan_bf16_groups(_bf16(source), source.config, tp, ep, rules=ATOM_RULES)
    seen = 0
    for rank, groups in enumerate(per_rank):
        for g in (g for g in groups if g.stacked):
            seen += 1
            per_expert = g.shape[1] * g.shape[2] * 2
            stored = torch.cat([t for _, t in shuffled_chunks(g, source.read, chunk_bytes=2 * per_expert + 1)])
            atom = _atom_param(source, g, tp, rank, ep)  # what ATOM's weight loader fills
            for i in range(atom.shape[0]):  # ATOM's shuffle_weights on a 3-D parameter (utils.py:158-162)
                atom[i].copy_(aiter_shuffle.shuffle_weight(atom[i], layout=(16, 16)))
            assert torch.equal(stored.view(torch.int16), atom.view(torch.int16)), (g.name, rank)
            back = unshuffled(stored, experts_per_block=3)
            for name, (rows, cols), t in group_from_record(g.record("f")).invert([back]):
                assert torch.equal(t, source.read(name, rows, cols)), (name, rank)
    assert seen == 2 * tp  # w13 and w2 of the MTP layer on every rank


def test_a_split_the_layout_cannot_take_is_refused_naming_the_tensor(source):
    # moe_intermediate 256 at TP 16 leaves w2 16 columns: aiter's shuffle_weight (and so ATOM)
    # needs 32; prep must refuse before writing rather than store what ATOM cannot shuffle.
    bf16 = {n: i for n, i in _bf16(source).items() if ".mlp.experts." in n or ".mlp.shared_experts." in n}
    per_rank, _ = plan_bf16_groups(bf16, source.config, 16, rules=ATOM_RULES)
    w2 = next(g for g in per_rank[0] if g.name.endswith("experts.w2_weight"))
    with pytest.raises(L.shuffle.LayoutConstraintError, match=rf"^{w2.name}: .*K % 32 == 0 \(K = 16\)"):
        next(shuffled_chunks(w2, source.read, 1 << 20))
