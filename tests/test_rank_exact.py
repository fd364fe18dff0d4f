"""Rank-exact conversions (manifest format 2) end to end: on both generated variants, TP 1/2/4/8,
with and without expert parallel, every rank's loaded non-MXFP4 tensors are exactly the
parameters ATOM's own loader would fill from the source (``tests/atom_sharding.py``, written
from ATOM's layer classes, not from prep), each rank reads only its own files, ``verify
--source`` and ``revert`` are exact, and a format-1 conversion still loads, verifies and reverts."""

from __future__ import annotations

import json
import math

import pytest
import torch

import layouts
from atom_sharding import held
from layouts.engines.atom import atom_mtp_param_name
from layouts.engines import get_engine
from prep.convert import convert
from prep.bf16 import group_from_record
from prep.deepseek import target_for
from prep.revert import revert
from prep.source import SourceCheckpoint
from prep.testing import SynthSpec
from checkpoints import write_checkpoint
from prep.verify import verify

ATOM = get_engine("atom")  # the engine whose profile these tests use

VARIANTS = ("r1-0528", "v2")
SHAPES = [(tp, ep) for tp in (1, 2, 4, 8) for ep in ((1, tp) if tp > 1 else (1,))]


@pytest.fixture(scope="module", params=VARIANTS)
def source(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    # Wider than tall, as R1's o_proj (7168 x 16384) is, and a down_proj with moe_intermediate
    # above hidden: on the tiny preset's square ones an uncut window (tp 1, the BF16 experts
    # under EP) recorded over columns went unseen, and such conversions failed on their own
    # manifest once every file was written.
    spec = SynthSpec(variant=request.param, num_attention_heads=16, moe_intermediate_size=512)
    return root, write_checkpoint(spec, root / "src")


def _atom_name(config: dict, name: str) -> tuple[str, str]:
    """(model, parameter) of ATOM that converted tensor ``name`` fills: the MTP layer's go to the
    draft model under its names."""
    layer = int(name.split(".")[2]) if name.startswith("model.layers.") else -1
    if layer >= config["num_hidden_layers"]:
        return "draft", atom_mtp_param_name(name, layer)
    return "target", name


def _expected(src: SourceCheckpoint, tp: int, rank: int, ep: int, loaded: layouts.RankTensors, aiter_shuffle) -> dict:
    """ATOM's parameters on ``rank``, filled from the source with atom_sharding's rules, shaped
    as the loaded ones; every element must be written exactly once (checked with a count). Then
    what ATOM's ``process_weights_after_loading`` does to them: its unquantized MoE shuffles each
    BF16 expert with aiter's ``shuffle_weight(layout=(16, 16))`` (run here from aiter's own file)."""
    by_param = {_atom_name(src.config, n): n for n, r in loaded.records.items() if r.dtype != "U8"}
    params, counts = {}, {}
    for name, info in src.tensors.items():
        if info.dtype == "U8":  # MXFP4 weights and scales: test_convert's business
            continue
        h = held(src.config, name, tuple(info.shape), tp, rank, ep)
        if h is None:
            continue
        if (h.model, h.param) == ("draft", "model.embed_tokens.weight"):
            continue  # ATOM's drafter replaces it by the target's: stored for revert only, read by no rank
        assert (h.model, h.param) in by_param, f"{name}: ATOM's {h.model} {h.param} is not loaded on rank {rank}"
        stored = by_param[(h.model, h.param)]
        if stored not in params:
            params[stored] = torch.zeros_like(loaded[stored])
            counts[stored] = torch.zeros(loaded[stored].shape, dtype=torch.int32)
        piece = h.take(src.read(name))
        for t in (params[stored], counts[stored]):
            dest = (t if h.slot is None else t[h.slot]).narrow(h.dest_axis, h.dest_offset, piece.shape[h.dest_axis])
            if t is params[stored]:
                dest.copy_(piece)
            else:
                dest += 1
    for stored, c in counts.items():
        assert bool((c == 1).all()), f"{stored} (rank {rank}): not every element written once from the source"
    assert set(params) == set(by_param.values()), f"rank {rank} loads tensors ATOM's loader does not fill"
    for stored, t in params.items():
        if loaded.records[stored].layout is not None:  # stacked BF16 experts, the only BF16 in a layout
            assert t.dim() == 3 and loaded[stored].is_shuffled, stored
            for e in range(t.shape[0]):
                t[e].copy_(aiter_shuffle.shuffle_weight(t[e], layout=(16, 16)))
    return params


@pytest.mark.parametrize("tp,ep", SHAPES)
def test_every_rank_holds_what_atoms_loader_keeps_and_reverts_exactly(source, tmp_path, tp, ep, aiter_shuffle):
    root, src_dir = source
    out = tmp_path / "out"
    # The tiny v2's MXFP4 o_proj at TP 8 has K = 32, too narrow for preshuffle: raw layout there.
    layout = "non-shuffle" if tp == 8 else target_for(ATOM).layout
    convert(str(src_dir), out, target_for(ATOM, layout=layout, tp=tp, ep=ep, rank_exact=True))
    m = layouts.load_manifest(out)
    assert m.format_version == 4 and m.target.rank_exact
    src = SourceCheckpoint(src_dir)
    # The stacked BF16 experts (R1-0528's MTP layer) are recorded as templates, not one placement
    # per expert, and expand into windows of exactly the sources their tensor names.
    stacked = [g for g in m.groups if g.kind == "bf16" and g.stack is not None]
    assert len(stacked) == (2 * tp if any(".experts." in n and i.dtype == "BF16" for n, i in src.tensors.items())
                            else 0)
    for g in stacked:
        (t,) = [t for t in m.tensors if t.group == g.name and t.rank == g.rank]
        assert not g.placements and len(t.sources) <= 4, g.name  # runs of experts compressed
        assert [p.source for p in group_from_record(g).placements if p.dest_row == 0] == \
            [n for n in t.source_names() if not n.endswith("up_proj.weight")], g.name
    for rank in range(tp):
        # A rank reads its own files and nothing else (the common file holds what no rank reads).
        assert m.rank_files(rank) == [n for n, f in m.files.items() if f.rank == rank]
        loaded = layouts.load_rank(out, rank, manifest=m)
        for stored, want in _expected(src, tp, rank, ep, loaded, aiter_shuffle).items():
            got = loaded[stored]
            assert got.dtype == want.dtype and torch.equal(got.view(torch.uint8), want.view(torch.uint8)), stored
    assert {t.role for t in m.tensors if t.rank is None} == {"unread"}
    assert verify(str(out), str(src_dir))["source_tensors_compared"] == len(src.tensors)
    back = tmp_path / "back"
    revert(str(out), back)
    again = SourceCheckpoint(back)
    assert set(again.tensors) == set(src.tensors)
    for name, info in src.tensors.items():
        assert again.tensors[name].dtype == info.dtype
        assert torch.equal(again.read(name).view(torch.uint8), src.read(name).view(torch.uint8)), name


def test_each_rank_reads_one_tp_th_of_the_split_bf16_plus_the_replicated(source, tmp_path):
    """At TP 4 the non-MXFP4 bytes a rank reads are exactly a quarter of the split tensors plus
    every replicated one (format 1: every rank reads all of them), and no rank reads the MTP
    layer's embedding."""
    root, src_dir = source
    convert(str(src_dir), tmp_path / "v1", target_for(ATOM, tp=4, rank_exact=False))
    convert(str(src_dir), tmp_path / "v2", target_for(ATOM, tp=4, rank_exact=True))
    old, new = layouts.load_manifest(tmp_path / "v1"), layouts.load_manifest(tmp_path / "v2")
    src = SourceCheckpoint(src_dir)
    bf16 = {n: t.nbytes for n, t in src.tensors.items() if t.dtype != "U8"}
    unread = {t.name for t in new.tensors if t.role == "unread"}
    assert unread == {n for n in bf16 if n.endswith(".embed_tokens.weight") and n.startswith("model.layers.")}
    whole = {t.name for t in new.tensors if t.rank == 0 and t.role == "passthrough"}
    whole |= {p.source for g in new.groups if g.kind == "bf16" and g.rank == 0 for p in g.placements if p.dim is None}
    split = sum(bf16.values()) - sum(bf16[n] for n in unread | whole)
    for rank in range(4):
        kept = sum(layouts.safetensors_file.ITEMSIZE[t.dtype] * math.prod(t.shape) for t in new.rank_tensors(rank)
                   if t.dtype != "U8")
        assert kept == split // 4 + sum(bf16[n] for n in whole)
        read_new, read_old = (sum(m.files[f].size for f in m.rank_files(rank)) for m in (new, old))
        assert read_new < read_old


def test_a_format_1_conversion_still_loads_verifies_and_reverts(source, tmp_path):
    root, src_dir = source
    out = tmp_path / "v1"
    convert(str(src_dir), out, target_for(ATOM, tp=2, rank_exact=False))
    raw = json.loads((out / layouts.manifest.MANIFEST_NAME).read_text())
    assert raw["format_version"] == 4 and "rank_exact" not in raw["target"]
    m = layouts.load_manifest(out)
    common = [n for n, f in m.files.items() if f.rank is None]
    assert common and all(set(common) <= set(m.rank_files(r)) for r in range(2))  # every rank reads them
    assert layouts.load_rank(out, 1, manifest=m)
    verify(str(out), str(src_dir))
    revert(str(out), tmp_path / "back")
    src, back = SourceCheckpoint(src_dir), SourceCheckpoint(tmp_path / "back")
    assert all(torch.equal(back.read(n).view(torch.uint8), src.read(n).view(torch.uint8)) for n in src.tensors)
