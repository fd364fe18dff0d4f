"""The registry: every layout round-trips, refuses shapes it cannot take with the tensor's name
and the broken constraint, and describes itself for the manifest."""

import json

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import layouts as L
from layouts.manifest import LayoutRecord


def rand_u8(*shape, seed=0):
    return torch.randint(0, 256, shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def sample(layout, shape):
    """Random source bytes ``(weight, scale)`` of a weight of ``shape`` ([.., N, K/2] packed MXFP4)
    for ``layout``: BF16 experts (the same bits as 16-bit values, [.., N, K/4]) and FP8 weights
    (one byte each, [.., N, K/2]) have no scale of the layout's."""
    w = rand_u8(*shape, seed=sum(shape))
    if isinstance(layout.weight, L.transforms.PadRowsOnes):  # a per-channel scale [N, 1]
        return torch.rand(shape[-2], 1, generator=torch.Generator().manual_seed(1)), None
    if not layout.has_scale:
        return w.view(torch.float8_e4m3fn if layout.kind == L.registry.FP8 else torch.bfloat16), None
    return w, torch.randint(100, 140, (*shape[:-1], shape[-1] // 16), dtype=torch.uint8)


def test_registry_lists_dense_moe_and_bf16_moe_layouts():
    assert L.layout_names("dense") == ["non-shuffle", "non-shuffle-t", "preshuffle", "preshuffle-unpadded"]
    assert L.layout_names("moe") == ["ck", "ck-3d", "triton", "triton-gfx942"]
    assert L.layout_names("bf16-moe") == ["bf16-preshuffle"]
    assert L.layout_names("fp8") == ["fp8-channel-preshuffle", "fp8-channel-scale", "fp8-preshuffle"]


@pytest.mark.parametrize("name", L.layout_names())
def test_every_layout_inverts_exactly_and_predicts_its_output_shapes(name):
    layout = L.get_layout(name)
    w, s = sample(layout, (64, 128) if layout.kind == "dense" else (4, 64, 256))
    lw, ls = layout.apply(w, s, "t")
    assert (tuple(lw.shape), ls if ls is None else tuple(ls.shape)) == layout.output_shapes(
        w.shape, None if s is None else s.shape)
    bw, bs = layout.invert(lw, ls, w.shape, None if s is None else s.shape)
    assert torch.equal(bw.view(torch.uint8), w.view(torch.uint8))
    assert (bs is None and s is None) or torch.equal(bs, s)


@pytest.mark.parametrize("name", L.layout_names("moe") + L.layout_names("bf16-moe")
                         + [n for n in L.layout_names("fp8") if n != "fp8-channel-scale"])  # that one: a linear's
def test_moe_layouts_transform_each_expert_on_its_own(name):
    # prep convert builds stacked experts in blocks: with 256 rows per expert the blocks' outputs,
    # laid end to end, must be the whole tensor's output byte for byte.
    layout = L.get_layout(name)
    assert layout.experts_transform_independently(256)
    w, s = sample(layout, (7, 256, 256))
    whole_w, whole_s = layout.apply(w, s, "t")
    blocks = [layout.apply(w[i:i + 3], None if s is None else s[i:i + 3], "t") for i in range(0, 7, 3)]
    assert torch.equal(torch.cat([b[0] for b in blocks]).view(torch.uint8), whole_w.view(torch.uint8))  # NaN bits
    assert s is None or torch.equal(torch.cat([b[1] for b in blocks]), whole_s)


def test_the_unpadded_preshuffle_is_the_padded_ones_bytes_cut_to_the_scales_rows():
    # vLLM's aiter linear swizzles the scale for the ASM GEMM without e8m0_shuffle's row pad: every
    # 32-row band is shuffled on its own, so the unpadded bytes are the padded ones' first N rows.
    w, s = rand_u8(96, 64, seed=7), rand_u8(96, 8, seed=8)
    uw, us = L.get_layout("preshuffle-unpadded").apply(w, s)
    pw, ps = L.get_layout("preshuffle").apply(w, s)
    assert torch.equal(uw, pw) and tuple(us.shape) == (96, 8) and torch.equal(us, ps[:96])
    with pytest.raises(L.shuffle.LayoutConstraintError,
                       match=r"needs scale: N % 32 == 0 \(N = 80\); scale: K/32 % 8 == 0 \(K/32 = 4\)"):
        L.get_layout("preshuffle-unpadded").apply(rand_u8(80, 32, seed=1), rand_u8(80, 4, seed=2))


def test_preshuffle_layout_is_the_two_primitives():
    w, s = rand_u8(32, 64, seed=5), rand_u8(32, 4, seed=6)
    lw, ls = L.get_layout("preshuffle").apply(w, s)
    assert torch.equal(lw, L.shuffle.preshuffle_weight(w)) and torch.equal(ls, L.shuffle.preshuffle_scale(s))


def test_ck_layout_shuffles_the_flattened_expert_scale_and_stores_it_2d():
    w, s = rand_u8(3, 32, 64, seed=7), rand_u8(3, 32, 4, seed=8)
    lw, ls = L.get_layout("ck").apply(w, s)
    assert torch.equal(lw, L.shuffle.preshuffle_weight(w))
    assert ls.dim() == 2 and torch.equal(ls, L.shuffle.preshuffle_scale(s.reshape(96, 4)))


def test_ck_3d_holds_cks_bytes_with_the_scale_3d_and_refuses_shapes_that_would_need_a_pad():
    # SGLang views aiter's e8m0_shuffle of the flattened [E*N, K/32] back as [E, N, K/32]: the same
    # bytes as ck, possible only where the shuffle pads no row or column.
    w, s = rand_u8(4, 64, 128, seed=11), rand_u8(4, 64, 8, seed=12)
    ck, ck3 = L.get_layout("ck").apply(w, s), L.get_layout("ck-3d").apply(w, s)
    assert torch.equal(ck3[0], ck[0]) and ck3[1].shape == (4, 64, 8) and torch.equal(ck3[1].reshape(256, 8), ck[1])
    with pytest.raises(L.shuffle.LayoutConstraintError, match=r"E\*N % 256 == 0 \(E\*N = 96\); scale: K/32 % 8 == 0 \(K/32 = 4\)"):
        L.get_layout("ck-3d").check((3, 32, 64), (3, 32, 4), "experts.w13")


def test_non_shuffle_t_keeps_the_weight_raw_and_holds_the_scale_transposed():
    w, s = rand_u8(64, 128, seed=13), rand_u8(64, 8, seed=14)
    lw, ls = L.get_layout("non-shuffle-t").apply(w, s)
    assert torch.equal(lw, w) and ls.shape == (8, 64) and ls.is_contiguous() and torch.equal(ls, s.t())


def test_triton_moe_layout_keeps_weight_raw_and_swizzles_scale_per_expert():
    w, s = rand_u8(3, 32, 64, seed=9), rand_u8(3, 32, 4, seed=10)
    layout = L.get_layout("triton")
    lw, ls = layout.apply(w, s)
    assert torch.equal(lw, w) and torch.equal(ls, L.shuffle.preshuffle_scale_per_expert(s))
    assert layout.runtime_attrs["scale_swizzle"] == "CDNA4_SCALE"


def test_runtime_attributes_say_whether_the_weight_is_shuffled():
    assert L.get_layout("preshuffle").runtime_attrs["is_shuffled"] is True
    assert L.get_layout("ck").runtime_attrs["is_shuffled"] is True
    assert L.get_layout("non-shuffle").runtime_attrs["is_shuffled"] is False
    assert L.get_layout("triton").runtime_attrs["is_shuffled"] is False
    assert L.get_layout("bf16-preshuffle").runtime_attrs["is_shuffled"] is True  # aiter's fused_moe reads it


def test_a_layout_that_cannot_apply_names_the_tensor_and_every_broken_constraint():
    name = "model.layers.3.self_attn.kv_a_proj_with_mqa.weight"
    with pytest.raises(L.shuffle.LayoutConstraintError) as err:
        L.get_layout("preshuffle").check((24, 100), (24, 7), name)
    msg = str(err.value)
    assert name in msg and "N % 16 == 0 (N = 24)" in msg and "K % 64 == 0 (K = 200)" in msg


def test_moe_layouts_need_stacked_experts():
    with pytest.raises(L.shuffle.LayoutConstraintError, match="weight is 3-D"):
        L.get_layout("ck").check((64, 128), (64, 8), "experts.w13")
    with pytest.raises(L.shuffle.LayoutConstraintError, match=r"scale: N % 32 == 0 \(N = 48\)"):
        L.get_layout("triton").check((2, 48, 64), (2, 48, 4), "experts.w2")


def test_non_shuffle_applies_to_any_2d_shape():
    assert L.get_layout("non-shuffle").violations((24, 100), (24, 7)) == []


def test_layout_description_is_json_for_the_manifest():
    desc = LayoutRecord.of(L.get_layout("ck")).to_json()
    assert json.loads(json.dumps(desc)) == desc
    assert desc["scale_transform"] == {"name": "s32x8", "pad_value": 0x00, "flatten_experts": True}
    assert desc["version"] == 2  # version 1 padded S32x8 scales with 0x7F
    assert desc["weight_transform"] == {"name": "w16"}


def test_unknown_layout_lists_the_known_ones():
    with pytest.raises(KeyError, match="known: bf16-preshuffle, ck, ck-3d, fp8-channel-preshuffle, fp8-channel-scale, fp8-preshuffle, non-shuffle, non-shuffle-t, preshuffle"):
        L.get_layout("shuffled")


def test_registering_a_name_twice_is_refused():
    with pytest.raises(ValueError, match="already registered"):
        L.register_layout(L.get_layout("preshuffle"))


@given(st.lists(st.sampled_from(["m.layers.{}.mlp.experts.{}.gate_proj.weight", "m.layers.{}.norm.weight", "x.0{}.y{}"]),
                min_size=0, max_size=6),
       st.lists(st.integers(0, 12), min_size=12, max_size=12))
def test_compressed_source_names_expand_to_exactly_the_original_list(templates, nums):
    names = []
    for i, t in enumerate(templates):
        for j in range(nums[i] % 4 + 1):  # runs of consecutive indices, sometimes broken
            names.append(t.format(nums[i], nums[(i + j) % 12] if j % 3 else j))
    packed = L.manifest.compress_names(names)
    assert L.manifest.expand_names(packed) == names and len(packed) <= len(names)


@pytest.mark.parametrize("name", L.layout_names())
@pytest.mark.parametrize("misalign", [0, 1])
def test_forward_into_out_writes_the_same_bytes(name, misalign):
    # Converters build straight into their output buffers; any alignment of that buffer.
    layout = L.get_layout(name)
    w, s = sample(layout, (256, 128) if layout.kind == "dense" else (4, 256, 256))  # K/32 = 8: no layout pads
    want_w, want_s = layout.apply(w, s)
    n = want_w.numel()
    buf = torch.zeros(n + 16, dtype=w.dtype)
    out = buf[misalign:misalign + n].view(want_w.shape)
    got_w, got_s = layout.apply(w, s, weight_out=out)
    assert got_w.data_ptr() == out.data_ptr() and torch.equal(out.view(torch.uint8), want_w.view(torch.uint8))
    assert (got_s is None and want_s is None) or torch.equal(got_s, want_s)
    with pytest.raises(ValueError, match="out must be"):
        layout.apply(w, s, weight_out=torch.empty(n + 1, dtype=w.dtype))


def test_docs_table_of_registered_layouts_is_the_registry():
    # docs/layouts.md's table is what a user reads to choose a layout: every registered layout in
    # it once, with the version and kind the registry gives (a new layout, or a version bump,
    # that skipped the docs fails here).
    import pathlib
    import re

    text = (pathlib.Path(__file__).resolve().parent.parent / "docs" / "layouts.md").read_text()
    table = text.split("## The registered layouts", 1)[1].split("\n\n", 2)[1]
    rows = re.findall(r"^\| `([\w-]+)` \| (\d+) \| ([\w-]+) \|", table, flags=re.M)
    documented = {name: (int(version), kind) for name, version, kind in rows}
    assert len(rows) == len(documented), "a layout is listed twice in docs/layouts.md"
    registry = {n: (L.get_layout(n).version, L.get_layout(n).kind) for n in L.layout_names()}
    assert documented == registry


def test_the_readmes_list_of_registered_layouts_is_the_registry():
    import pathlib
    import re

    text = (pathlib.Path(__file__).resolve().parent.parent / "README.md").read_text()
    said = text.split("Registered layouts (", 1)[1].split("Each is a name", 1)[0]
    assert set(re.findall(r"`([\w-]+)`", said)) == set(L.layout_names())
