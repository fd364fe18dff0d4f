"""A group's geometry has one source, its placements: over a group's ranks they tile every source
tensor exactly once (or hold equal replicated copies), each rank's placements plus its pads fill
its local tensors exactly, and building then inverting goes through the same placements byte for
byte (pads zeroed whatever memory the build gets). Groups: a merged dense linear, a row-parallel
linear, MoE under TP (ck and triton, in blocks and whole) and MoE under EP with the shared expert
on every rank. Plus the layouts' own word on whether experts transform a block at a time."""

from __future__ import annotations

import pytest
import torch

import layouts
import prep.groups as pg
from prep.errors import PrepError
from layouts import get_layout
from prep.groups import LinearGroup, MoEGroup, Part


def _linear_merged(tp):  # [q_a ; kv_a], replicated on every rank, preshuffled
    return [LinearGroup("m.fused_qkv_a_proj", r, tp, (Part("m.q_a_proj", 64, 256, "none"),
                                                      Part("m.kv_a_proj", 32, 256, "none")), get_layout("preshuffle"))
            for r in range(tp)]


def _linear_row_parallel(tp):  # o_proj: K split over ranks, raw bytes
    return [LinearGroup("m.o_proj", r, tp, (Part("m.o_proj", 48, 512, "cols"),), get_layout("non-shuffle")) for r in range(tp)]


def _linear_column_parallel_merged(tp):  # [gate ; up] of a dense MLP: N split, then merged
    return [LinearGroup("m.gate_up_proj", r, tp, (Part("m.gate_proj", 64, 128, "rows"),
                                                  Part("m.up_proj", 64, 128, "rows")), get_layout("preshuffle"))
            for r in range(tp)]


def _moe_tp(tp, layout):
    experts = tuple(f"x.experts.{e}" for e in range(3)) + ("x.shared_experts",)
    return [MoEGroup("x.experts", r, tp, experts, inter=128, hidden=96, layout=get_layout(layout)) for r in range(tp)]


def _moe_ep(ep):  # 4 routed experts over 2 ranks, the shared expert whole on both
    per = 4 // ep
    return [MoEGroup("x.experts", r, ep, tuple(f"x.experts.{e}" for e in range(r * per, (r + 1) * per))
                     + ("x.shared_experts",), inter=64, hidden=128, layout=get_layout("ck"), ep=ep,
                     routed=(r * per, (r + 1) * per)) for r in range(ep)]


GROUPS = {
    "linear-merged-tp2": _linear_merged(2),
    "linear-row-parallel-tp4": _linear_row_parallel(4),
    "linear-column-parallel-merged-tp2": _linear_column_parallel_merged(2),
    "moe-ck-tp2": _moe_tp(2, "ck"),
    "moe-triton-tp4": _moe_tp(4, "triton"),
    "moe-ck-ep2": _moe_ep(2),
}


def _source_shapes(g) -> dict[str, tuple[int, int]]:
    """The source tensors' shapes, [N, K/2] and [N, ceil(K/32)], from the group's own parameters."""
    def mxfp4(prefix, n, k):
        return {f"{prefix}.weight": (n, k // 2), f"{prefix}.weight_scale": (n, -(-k // 32))}

    if isinstance(g, LinearGroup):
        return {name: shape for p in g.parts for name, shape in mxfp4(p.src, p.n, p.k).items()}
    shapes = {}
    for e in g.experts:
        shapes |= mxfp4(f"{e}.gate_proj", g.inter, g.hidden) | mxfp4(f"{e}.up_proj", g.inter, g.hidden)
        shapes |= mxfp4(f"{e}.down_proj", g.hidden, g.inter)
    return shapes


def _source(groups) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(11)
    shapes = {n: s for g in groups for n, s in _source_shapes(g).items()}
    # No byte is zero: a piece cut from a pad, or a pad left unzeroed, cannot pass for source bytes.
    return {n: torch.randint(1, 256, s, dtype=torch.uint8, generator=gen) for n, s in sorted(shapes.items())}


def _reader(src):
    def read(name, rows=None, cols=None, out=None):
        t = src[name][rows if rows is not None else slice(None)]
        t = t if cols is None else t[:, cols]
        if out is None:
            return t.contiguous()
        out.copy_(t)
        return out

    return read


def _area(w) -> int:
    return (w[0].stop - w[0].start) * (w[1].stop - w[1].start)


@pytest.mark.parametrize("case", list(GROUPS))
def test_placements_over_the_ranks_tile_each_source_tensor_once_or_in_equal_copies(case):
    groups = GROUPS[case]
    shapes = {n: s for g in groups for n, s in _source_shapes(g).items()}
    windows: dict[str, list[tuple[int, int, int, int]]] = {n: [] for n in shapes}
    for g in groups:
        for p in g.placements():
            windows[p.source].append((p.window[0].start, p.window[0].stop, p.window[1].start, p.window[1].stop))
    assert set(windows) == set(shapes) == {n for g in groups for n in g.sources()}
    for name, shape in shapes.items():
        count = torch.zeros(shape, dtype=torch.int32)
        for r0, r1, c0, c1 in set(windows[name]):  # a window seen on several ranks is a replicated copy
            count[r0:r1, c0:c1] += 1
        assert count.eq(1).all(), f"{name}: distinct windows do not tile it exactly once"
    replicated = {n for n, ws in windows.items() if len(ws) > len(set(ws))}
    if case.startswith("linear-merged"):
        assert replicated == set(shapes)
    elif case.startswith("moe-ck-ep"):
        assert replicated and all(n.startswith("x.shared_experts.") for n in replicated)
    else:
        assert not replicated


@pytest.mark.parametrize("case", list(GROUPS))
def test_each_rank_placements_and_pads_fill_its_local_tensors_exactly(case):
    for g in GROUPS[case]:
        g.check()
        shapes = g.local_shapes()
        filled = [torch.zeros(s, dtype=torch.int32) for s in shapes]
        for p in g.placements():
            assert _area(p.window) == _area(p.dest), p
            p.region(filled[p.output]).add_(1)
        for o, gaps in enumerate(pg._pads(g)):
            for rows, cols in gaps:
                filled[o][..., rows, cols] += 1
        assert all(f.eq(1).all() for f in filled), f"{g.name} rank {g.rank}: placements and pads overlap or leave holes"
        if isinstance(g, LinearGroup):
            assert pg._pads(g) == [[], []]  # a dense linear has no padding
        else:
            assert pg._pads(g)[0], "stacked experts here are padded (I and H to 256)"


def _dirty_builds(case, monkeypatch):
    """(group, source, whole build) per rank, blocks allocated full of garbage (0xAB): the build
    allocates them uninitialised, and garbage must not survive where no placement writes."""
    groups = GROUPS[case]
    src = _source(groups)
    monkeypatch.setattr(pg, "_alloc", lambda shape: torch.full(shape, 0xAB, dtype=torch.uint8))
    return [(g, src, g.build(_reader(src))) for g in groups]


@pytest.mark.parametrize("case", list(GROUPS))
def test_build_then_invert_goes_through_the_placements_byte_for_byte(case, monkeypatch):
    for g, src, built in _dirty_builds(case, monkeypatch):
        assert [tuple(t.shape) for t in built] == [tuple(s) for _, _, s in g.outputs()]
        pieces = list(g.invert(built))
        assert [(n, w) for n, w, _ in pieces] == [(p.source, p.window) for p in g.placements()]
        for name, (rows, cols), piece in pieces:
            assert torch.equal(piece, src[name][rows, cols]), name


@pytest.mark.parametrize("case", ["moe-ck-tp2", "moe-triton-tp4", "moe-ck-ep2"])
def test_experts_built_a_block_at_a_time_equal_the_whole_build(case, monkeypatch):
    for g, src, whole in _dirty_builds(case, monkeypatch):
        w13 = g.local_shapes()[0]
        blocks = pg._whole(g, g.build_chunks(_reader(src), chunk_bytes=w13[1] * w13[2]))  # one expert a block
        assert all(torch.equal(a, b) for a, b in zip(whole, blocks))


def test_inverting_refuses_a_nonzero_pad_byte():
    g = _moe_tp(2, "ck")[0]
    built = g.build(_reader(_source([g])))
    raw = layouts.shuffle.unshuffle_weight(built[0])
    raw[1, g.i_local, 0] = 1  # the first pad row after expert 1's gate rows
    built[0] = layouts.shuffle.preshuffle_weight(raw)
    with pytest.raises(PrepError, match="padding bytes are not zero"):
        list(g.invert(built))


@pytest.mark.parametrize("layout, rows, exact", [
    ("ck", 512, True), ("ck", 256, True), ("ck", 128, False),  # S32x8 over [E*N, K/32] pads rows to 256
    ("triton", 128, True), ("triton", 32, True),  # per-expert scale layout: no band crosses an expert
    ("triton-gfx942", 64, True),  # raw bytes
    ("preshuffle", 256, False), ("non-shuffle", 256, False),  # dense layouts stack no experts
])
def test_the_layout_says_whether_a_block_of_experts_transforms_as_the_whole(layout, rows, exact):
    lay = layouts.get_layout(layout)
    assert lay.experts_transform_independently(rows) is exact
    if lay.kind != "moe":
        return
    e, kb, ks = 4, 64, 4
    gen = torch.Generator().manual_seed(rows)
    w = torch.randint(0, 256, (e, rows, kb), dtype=torch.uint8, generator=gen)
    s = torch.randint(0, 256, (e, rows, ks), dtype=torch.uint8, generator=gen)
    whole = lay.apply(w, s)
    singles = [lay.apply(w[i:i + 1], s[i:i + 1]) for i in range(e)]  # blocks of one expert
    same = all(torch.equal(torch.cat([b[j] for b in singles]), whole[j]) for j in (0, 1))
    assert same is exact  # the claim is the transform's behaviour, both ways
