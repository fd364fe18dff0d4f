"""bf16-preshuffle: the layout ATOM's unquantized MoE holds stacked BF16 experts in (R1-0528's MTP
layer). Byte-identical to aiter's own shuffle_weight(layout=(16, 16)) on 16-bit tensors, equal
to its element formula, exactly invertible, transformable a block of experts at a time, refused
with the tensor's name where it cannot apply, and checked against the engine's profile."""

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import layouts as L
from layouts import engines
from layouts import CompatibilityError, EngineConfig, check_compatibility
from test_engine_profiles import ToyProfile
from layouts.manifest import Manifest
from layouts.manifest import LayoutRecord
from layouts.registry import BF16_MOE, recorded_layout
from layouts.transforms import Identity
from layouts.engines import get_engine

ATOM = get_engine("atom")  # the engine whose profile these tests use

LAYOUT = L.get_layout("bf16-preshuffle")


def rand16(*shape, seed=0, dtype=torch.bfloat16):
    """Random 16-bit patterns (NaN and inf payloads included) seen as ``dtype``."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-(2**15), 2**15, shape, dtype=torch.int16, generator=g).view(dtype)


def bits(t):
    return t.contiguous().view(torch.int16)


def same(a, b):
    """Equal bit for bit (torch.equal calls NaN unequal to itself)."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


# R1-0528's MTP experts per rank: w13 [E, 2 I/tp, H], w2 [E, H, I/tp], H 7168, I 2048; a few
# experts each (the permutation never crosses an expert, so the count does not matter).
DEEPSEEK_EXPERTS = {f"{w} tp{tp}": (2, *shape) for tp in (1, 8, 16)
                    for w, shape in (("w13", (2 * 2048 // tp, 7168)), ("w2", (7168, 2048 // tp)))}


# ------------------------------------------------------------------------- against aiter
@pytest.mark.parametrize("name", list(DEEPSEEK_EXPERTS))
def test_matches_aiter_shuffle_weight_on_deepseek_mtp_expert_shapes(aiter_shuffle, name):
    w = rand16(*DEEPSEEK_EXPERTS[name], seed=1)
    want = aiter_shuffle.shuffle_weight(w, layout=(16, 16))
    assert same(L.shuffle.preshuffle_weight_16bit(w), want)
    assert same(LAYOUT.apply(w, None, name)[0], want)


def test_matches_atoms_per_expert_loop(aiter_shuffle):
    # ATOM's shuffle_weights shuffles a 3-D parameter one expert at a time, in place
    # (ROCm/ATOM ffdf3bb5 atom/model_ops/utils.py:158-162); the stacked transform is the same.
    w = rand16(5, 64, 96, seed=2)
    atom = w.clone()
    for i in range(atom.shape[0]):
        atom[i].copy_(aiter_shuffle.shuffle_weight(atom[i], layout=(16, 16)))
    assert same(L.shuffle.preshuffle_weight_16bit(w), atom)


@settings(max_examples=40, deadline=None)
@given(e=st.integers(1, 3), n16=st.integers(1, 8), k32=st.integers(1, 5), f16=st.booleans(),
       seed=st.integers(0, 2**16))
def test_matches_aiter_on_random_shapes_and_both_16_bit_dtypes(aiter_shuffle, e, n16, k32, f16, seed):
    w = rand16(e, 16 * n16, 32 * k32, seed=seed, dtype=torch.float16 if f16 else torch.bfloat16)
    assert same(L.shuffle.preshuffle_weight_16bit(w), aiter_shuffle.shuffle_weight(w, layout=(16, 16)))


def test_aiter_refuses_what_the_layout_refuses(aiter_shuffle):
    # The constraints are aiter's asserts: 16 rows, and a K block of 32 values whatever the dtype.
    for shape in ((2, 24, 64), (2, 32, 48)):
        with pytest.raises(AssertionError):
            aiter_shuffle.shuffle_weight(rand16(*shape), layout=(16, 16))
        assert LAYOUT.violations(shape, None)


# ------------------------------------------------------------------------- the formula
def test_each_value_lands_where_the_formula_says():
    e, n, k = 2, 32, 64
    w = torch.arange(e * n * k, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).view(e, n, k)
    out = bits(L.shuffle.preshuffle_weight_16bit(w)).view(e, -1)
    for x in range(e):
        for r in range(n):
            for c in range(k):
                at = (((r // 16) * (k // 8) + c // 8) * 16 + r % 16) * 8 + c % 8
                assert out[x, at] == bits(w)[x, r, c]


def test_it_is_w16_of_the_tensors_bytes():
    w = rand16(3, 48, 96, seed=3)
    assert torch.equal(L.shuffle.preshuffle_weight_16bit(w).view(torch.uint8), L.shuffle.preshuffle_weight(w.view(torch.uint8)))


# ------------------------------------------------------------------------- inverse and blocks
@settings(max_examples=60, deadline=None)
@given(e=st.integers(1, 4), n16=st.integers(1, 10), k32=st.integers(1, 6), seed=st.integers(0, 2**16))
def test_inverse_is_exact(e, n16, k32, seed):
    w = rand16(e, 16 * n16, 32 * k32, seed=seed)
    stored = LAYOUT.apply(w, None, "t")[0]
    assert same(L.shuffle.unshuffle_weight_16bit(stored), w)
    back, scale = LAYOUT.invert(stored, None, w.shape, None)
    assert same(back, w) and scale is None


@settings(max_examples=30, deadline=None)
@given(e=st.integers(2, 7), per=st.integers(1, 4), n16=st.integers(1, 4), seed=st.integers(0, 2**16))
def test_blocks_of_whole_experts_build_and_invert_as_the_whole(e, per, n16, seed):
    # What lets prep build the stacked tensor, and a reader invert it, a block of experts at a time.
    n = 16 * n16
    assert LAYOUT.experts_transform_independently(n) and LAYOUT.weight.splits_over_experts(n)
    w = rand16(e, n, 64, seed=seed)
    whole = LAYOUT.weight.forward(w)
    blocks = [LAYOUT.weight.forward(w[i:i + per]) for i in range(0, e, per)]
    assert same(torch.cat(blocks), whole)
    back = [LAYOUT.weight.inverse(whole[i:i + per], tuple(w[i:i + per].shape)) for i in range(0, e, per)]
    assert same(torch.cat(back), w)


@pytest.mark.parametrize("misalign", [0, 1, 8])
def test_forward_into_out_and_in_place(misalign):
    # A converter reads the source rows into its output buffer and shuffles them there.
    w = rand16(3, 32, 64, seed=4)
    want = L.shuffle.preshuffle_weight_16bit(w)
    buf = torch.zeros(w.numel() + 16, dtype=torch.bfloat16)
    out = buf[misalign:misalign + w.numel()].view(w.shape)
    assert L.shuffle.preshuffle_weight_16bit(w, out) is out and same(out, want)
    inplace = w.clone()
    assert LAYOUT.weight.forward(inplace, inplace) is inplace and same(inplace, want)
    with pytest.raises(ValueError, match="out must be"):
        L.shuffle.preshuffle_weight_16bit(w, torch.empty(3, 32, 64, dtype=torch.float16))


# ------------------------------------------------------------------------- refusals
def test_a_shape_it_cannot_take_is_refused_naming_the_tensor_and_every_constraint():
    name = "model.layers.61.mlp.experts.w2_weight"
    with pytest.raises(L.shuffle.LayoutConstraintError) as err:
        LAYOUT.check((257, 7160, 16), None, name)  # a K of 16: R1's down_proj at TP 128
    msg = str(err.value)
    assert msg.startswith(name) and "N % 16 == 0 (N = 7160)" in msg and "K % 32 == 0 (K = 16)" in msg
    assert "\n" not in msg
    with pytest.raises(L.shuffle.LayoutConstraintError, match=r"weight is 3-D"):
        LAYOUT.check((7168, 256), None, name)
    with pytest.raises(L.shuffle.LayoutConstraintError, match=rf"^{name}: .*needs no scale \(BF16 weights\)"):
        LAYOUT.check((2, 32, 64), (2, 32, 2), name)
    with pytest.raises(L.shuffle.LayoutConstraintError, match=rf"^{name}: .*needs a weight_scale"):
        L.get_layout("ck").check((2, 32, 64), None, name)


def test_the_primitive_refuses_other_dtypes_and_shapes():
    with pytest.raises(L.shuffle.LayoutConstraintError, match="2-byte dtype"):
        L.shuffle.preshuffle_weight_16bit(torch.zeros(2, 32, 64, dtype=torch.uint8))  # packed MXFP4: W16 proper
    with pytest.raises(L.shuffle.LayoutConstraintError, match="2-byte dtype"):
        L.shuffle.unshuffle_weight_16bit(torch.zeros(2, 32, 64, dtype=torch.float32))
    with pytest.raises(L.shuffle.LayoutConstraintError, match=r"16-bit W16 needs K % 32 == 0 \(K = 48\), got shape \(2, 32, 48\)"):
        L.shuffle.preshuffle_weight_16bit(torch.zeros(2, 32, 48, dtype=torch.bfloat16))


# ------------------------------------------------------------------------- the manifest record
def test_description_is_json_and_a_recorded_one_rebuilds_the_layout():
    desc = LayoutRecord.of(LAYOUT).to_json()
    assert json.loads(json.dumps(desc)) == desc
    assert desc == {"name": "bf16-preshuffle", "version": 1, "kind": BF16_MOE,
                    "weight_transform": {"name": "w16-16bit"}, "scale_transform": {"name": "identity"},
                    "runtime_attrs": {"is_shuffled": True}}
    assert recorded_layout(LayoutRecord.from_json(desc)) == LAYOUT
    assert not LAYOUT.has_scale and L.get_layout("ck").has_scale


# ------------------------------------------------------------------------- the engine profile
def _manifest(engine: EngineConfig, bf16_layouts) -> Manifest:
    """A checkpoint made for ``engine`` whose BF16 experts are in ``bf16_layouts``."""
    return Manifest.from_json({
        "target": {"layout": engine.expected_dense_layout(), "moe_layout": engine.expected_moe_layout(),
                   "tp": engine.tp_size, "ep": engine.ep_size, "engine": engine.engine},
        "tensors": [], "layouts": {n: LayoutRecord.of(layout).to_json() for n, layout in bf16_layouts.items()}})


@pytest.mark.parametrize("env", [{}, {"ATOM_USE_TRITON_MOE": "1"}, {"ATOM_USE_TRITON_MOE": "0"},
                                 {"ATOM_USE_TRITON_GEMM": "1"}, {"ATOM_USE_FP4_NON_SHUFFLE_TRITON_GEMM": "1"}])
@pytest.mark.parametrize("arch", ["gfx942", "gfx950"])
def test_atom_reads_bf16_experts_shuffled_in_every_configuration(env, arch):
    # UnquantizedFusedMoEMethod shuffles whatever the switches (layouts/engines/atom/ cites it).
    engine = EngineConfig.from_env(ATOM, tp_size=2, env=env, gpu_arch=arch)
    assert engine.expected_bf16_moe_layout() == LAYOUT.name
    check_compatibility(_manifest(engine, {LAYOUT.name: LAYOUT}), engine)


@pytest.fixture
def raw_bf16(monkeypatch):
    """A second bf16-moe layout (experts as the source stores them), registered for one test."""
    from layouts import registry

    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    return L.register_layout(L.Layout("bf16-raw-test", 1, BF16_MOE, Identity(), Identity(), {"is_shuffled": False},
                                      "stacked BF16 experts in the source's order"))


def test_bf16_experts_in_another_layout_are_refused_with_the_fix(raw_bf16):
    engine = EngineConfig(tp_size=2, profile=ATOM)
    with pytest.raises(CompatibilityError, match=r"BF16 MoE experts are in the 'bf16-raw-test' layout but the atom "
                                                 r"engine's unquantized MoE reads 'bf16-preshuffle'.*convert"):
        check_compatibility(_manifest(engine, {raw_bf16.name: raw_bf16}), engine)
    check_compatibility(_manifest(engine, {}), engine)  # no BF16 experts in a layout: nothing to check


def test_an_engine_without_a_bf16_moe_layout_refuses_one_and_an_unregistered_one_is_refused(monkeypatch):
    engines.engine_names()  # the built-in profiles are loaded before the copy
    monkeypatch.setattr(engines, "_PROFILES", dict(engines._PROFILES))

    class Toy(ToyProfile):  # test_engine_profiles' toy engine, which names no BF16 MoE layout
        name = "toy-bf16"

    L.register_engine(Toy())
    toy = EngineConfig(tp_size=2, profile=L.get_engine("toy-bf16"))
    with pytest.raises(CompatibilityError, match="toy-bf16 engine's unquantized MoE has no layout for them"):
        check_compatibility(_manifest(toy, {LAYOUT.name: LAYOUT}), toy)

    class Wrong(Toy):
        name = "toy-bf16-wrong"
        bf16_moe_layout = "bf16-nonesuch"

    with pytest.raises(ValueError, match="'bf16-nonesuch', which is not a registered bf16-moe layout"):
        L.register_engine(Wrong())
