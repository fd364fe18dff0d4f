"""The registry: every layout round-trips, refuses shapes it cannot take with the tensor's name
and the broken constraint, and describes itself for the manifest."""

import json

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import layouts as L


def rand_u8(*shape, seed=0):
    return torch.randint(0, 256, shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def test_registry_lists_dense_and_moe_layouts():
    assert L.layout_names("dense") == ["non-shuffle", "preshuffle"]
    assert L.layout_names("moe") == ["ck", "triton", "triton-gfx942"]


@pytest.mark.parametrize("name", L.layout_names())
def test_every_layout_inverts_exactly_and_predicts_its_output_shapes(name):
    layout = L.get_layout(name)
    if layout.kind == "dense":
        w, s = rand_u8(64, 128, seed=1), rand_u8(64, 8, seed=2)
    else:
        w, s = rand_u8(5, 64, 96, seed=3), rand_u8(5, 64, 6, seed=4)
    lw, ls = layout.apply(w, s, "t")
    assert (tuple(lw.shape), tuple(ls.shape)) == layout.output_shapes(w.shape, s.shape)
    bw, bs = layout.invert(lw, ls, w.shape, s.shape)
    assert torch.equal(bw, w) and torch.equal(bs, s)


@pytest.mark.parametrize("name", L.layout_names("moe"))
def test_moe_layouts_transform_each_expert_on_its_own(name):
    # prep convert builds stacked experts in blocks: with 256 rows per expert the blocks' outputs,
    # laid end to end, must be the whole tensor's output byte for byte.
    layout = L.get_layout(name)
    w, s = rand_u8(7, 256, 64, seed=7), rand_u8(7, 256, 4, seed=8)
    whole_w, whole_s = layout.apply(w, s, "t")
    blocks = [layout.apply(w[i:i + 3], s[i:i + 3], "t") for i in range(0, 7, 3)]
    assert torch.equal(torch.cat([b[0] for b in blocks]), whole_w)
    assert torch.equal(torch.cat([b[1] for b in blocks]), whole_s)


def test_preshuffle_layout_is_the_two_primitives():
    w, s = rand_u8(32, 64, seed=5), rand_u8(32, 4, seed=6)
    lw, ls = L.get_layout("preshuffle").apply(w, s)
    assert torch.equal(lw, L.preshuffle_weight(w)) and torch.equal(ls, L.preshuffle_scale(s))


def test_ck_layout_shuffles_the_flattened_expert_scale_and_stores_it_2d():
    w, s = rand_u8(3, 32, 64, seed=7), rand_u8(3, 32, 4, seed=8)
    lw, ls = L.get_layout("ck").apply(w, s)
    assert torch.equal(lw, L.preshuffle_weight(w))
    assert ls.dim() == 2 and torch.equal(ls, L.preshuffle_scale(s.reshape(96, 4)))


def test_triton_moe_layout_keeps_weight_raw_and_swizzles_scale_per_expert():
    w, s = rand_u8(3, 32, 64, seed=9), rand_u8(3, 32, 4, seed=10)
    layout = L.get_layout("triton")
    lw, ls = layout.apply(w, s)
    assert torch.equal(lw, w) and torch.equal(ls, L.preshuffle_scale_per_expert(s))
    assert layout.runtime_attrs["scale_swizzle"] == "CDNA4_SCALE"


def test_runtime_attributes_say_whether_the_weight_is_shuffled():
    assert L.get_layout("preshuffle").runtime_attrs["is_shuffled"] is True
    assert L.get_layout("ck").runtime_attrs["is_shuffled"] is True
    assert L.get_layout("non-shuffle").runtime_attrs["is_shuffled"] is False
    assert L.get_layout("triton").runtime_attrs["is_shuffled"] is False


def test_a_layout_that_cannot_apply_names_the_tensor_and_every_broken_constraint():
    name = "model.layers.3.self_attn.kv_a_proj_with_mqa.weight"
    with pytest.raises(L.LayoutConstraintError) as err:
        L.get_layout("preshuffle").check((24, 100), (24, 7), name)
    msg = str(err.value)
    assert name in msg and "N % 16 == 0 (N = 24)" in msg and "K % 64 == 0 (K = 200)" in msg


def test_moe_layouts_need_stacked_experts():
    with pytest.raises(L.LayoutConstraintError, match="weight is 3-D"):
        L.get_layout("ck").check((64, 128), (64, 8), "experts.w13")
    with pytest.raises(L.LayoutConstraintError, match=r"scale: N % 32 == 0 \(N = 48\)"):
        L.get_layout("triton").check((2, 48, 64), (2, 48, 4), "experts.w2")


def test_non_shuffle_applies_to_any_2d_shape():
    assert L.get_layout("non-shuffle").violations((24, 100), (24, 7)) == []


def test_layout_description_is_json_for_the_manifest():
    desc = L.get_layout("ck").describe()
    assert json.loads(json.dumps(desc)) == desc
    assert desc["scale_transform"] == {"name": "s32x8", "pad_value": 0x00, "flatten_experts": True}
    assert desc["version"] == 2  # version 1 padded S32x8 scales with 0x7F
    assert desc["weight_transform"] == {"name": "w16"}


def test_unknown_layout_lists_the_known_ones():
    with pytest.raises(KeyError, match="known: ck, non-shuffle, preshuffle"):
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
    shape = (4, 256, 64) if layout.kind == "moe" else (256, 64)
    g = torch.Generator().manual_seed(3)
    w = torch.randint(0, 256, shape, dtype=torch.uint8, generator=g)
    s = torch.randint(100, 140, (*shape[:-1], 4), dtype=torch.uint8, generator=g)
    want_w, want_s = layout.apply(w, s)
    n = want_w.numel()
    buf = torch.zeros(n + 16, dtype=torch.uint8)
    out = buf[misalign:misalign + n].view(want_w.shape)
    got_w, got_s = layout.apply(w, s, weight_out=out)
    assert got_w.data_ptr() == out.data_ptr() and torch.equal(out, want_w) and torch.equal(got_s, want_s)
    with pytest.raises(ValueError, match="out must be"):
        layout.apply(w, s, weight_out=torch.empty(n + 1, dtype=torch.uint8))
