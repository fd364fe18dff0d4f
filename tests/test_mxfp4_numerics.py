"""MXFP4 numerics: the code tables, packing, both scale rules and both roundings, checked
against an independent float64 reference and against aiter's own kernel and decoders."""

import math

import pytest
import torch

import layouts as L
from layouts.mxfp4 import Rounding, ScaleRule

GRID = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


# ---------------------------------------------------------------- independent float64 reference
def ref_scale_exponent(amax: float, rule: ScaleRule) -> int:
    """The scale rules written from their definitions, in plain Python floats."""
    if rule is ScaleRule.EVEN:
        if amax == 0:
            return -127
        m, e = math.frexp(amax)  # amax = m * 2**e, m in [0.5, 1)
        p = e - 1  # amax in [2**p, 2**(p+1))
        if amax / 2.0**p >= 1.75:  # adding 0x200000 to the bits carries into the exponent
            p += 1
        return max(-127, min(127, p - 2))
    amax = max(amax, float(torch.tensor(1e-10, dtype=torch.float32)))
    m, e = math.frexp(amax)
    p = e - 1
    if amax / 2.0**p >= 1.5:  # mantissa bit 22 set: round the power of two up
        p += 1
    return max(-127, min(127, p - 2))


def ref_round(v: float, rounding: Rounding) -> float:
    """Nearest grid magnitude; ties by the rounding's rule; saturating at 6."""
    a = abs(v)
    if a >= 6:
        return 6.0
    lo = max(g for g in GRID if g <= a)
    hi = min(g for g in GRID if g >= a)
    if a - lo < hi - a:
        return lo
    if a - lo > hi - a:
        return hi
    if rounding is Rounding.HALF_AWAY:
        return hi
    return lo if GRID.index(lo) % 2 == 0 else hi


def ref_quant_dequant(x: torch.Tensor, rule: ScaleRule, rounding: Rounding) -> torch.Tensor:
    out = torch.empty(x.shape, dtype=torch.float64)
    rows = x.double().reshape(-1, x.shape[-1])
    flat = out.view(-1, x.shape[-1])
    for r in range(rows.shape[0]):
        for b0 in range(0, rows.shape[1], 32):
            block = rows[r, b0:b0 + 32].tolist()
            e = ref_scale_exponent(max(abs(v) for v in block), rule)
            for i, v in enumerate(block):
                q = math.copysign(ref_round(v * 2.0**-e, rounding), v)
                flat[r, b0 + i] = q * 2.0**e
    return out


def wide_range_tensor(rows: int, cols: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g) * torch.exp2(torch.randint(-20, 20, (rows, cols), generator=g).float())
    x[0, :32] = 0.0  # an all-zero block
    x[1, 5] = -1e-30  # a tiny negative that rounds to -0
    return x


# ------------------------------------------------------------------------------------ tests
def test_e2m1_code_table_matches_format():
    codes = torch.arange(16, dtype=torch.uint8)
    values = L.mxfp4.e2m1_decode(codes)
    assert values[:8].tolist() == GRID
    assert values[8:].tolist() == [-g for g in GRID]
    assert torch.signbit(values[8])  # code 8 is -0


def test_pack_puts_even_element_in_low_nibble():
    codes = torch.tensor([[1, 2, 15, 8]], dtype=torch.uint8)
    packed = L.mxfp4.pack_fp4(codes)
    assert packed.tolist() == [[0x21, 0x8F]]
    assert torch.equal(L.mxfp4.unpack_fp4(packed), codes)


def test_e8m0_decode_special_bytes():
    v = L.mxfp4.e8m0_decode(torch.tensor([0x7F, 0x80, 0x00, 0xFE, 0xFF], dtype=torch.uint8))
    assert v[0] == 1.0 and v[1] == 2.0
    assert v[2] == 2.0**-127 and v[3] == 2.0**127
    assert torch.isnan(v[4])


@pytest.mark.parametrize("rounding", list(Rounding))
def test_e2m1_encode_rounds_every_tie_by_its_rule(rounding):
    ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    x = torch.tensor(ties + [-t for t in ties])
    got = L.mxfp4.e2m1_decode(L.mxfp4.e2m1_encode(x, rounding))
    want = [math.copysign(ref_round(v, rounding), v) for v in x.tolist()]
    assert got.tolist() == want


def test_e2m1_encode_saturates_and_keeps_negative_zero():
    x = torch.tensor([7.0, -100.0, float("inf"), -0.1, -0.0, 0.1])
    codes = L.mxfp4.e2m1_encode(x)
    assert codes.tolist() == [7, 15, 7, 8, 8, 0]


@pytest.mark.parametrize("rule", list(ScaleRule))
@pytest.mark.parametrize("rounding", list(Rounding))
def test_quantize_matches_float64_reference(rule, rounding):
    x = wide_range_tensor(6, 96, seed=1)
    recipe = L.mxfp4.QuantRecipe("test", rule, rounding, keep_negative_zero=True)
    packed, scale = L.mxfp4.quantize(x, recipe)
    got = L.mxfp4.dequantize(packed, scale).double()
    want = ref_quant_dequant(x, rule, rounding)
    assert torch.equal(torch.signbit(got), torch.signbit(want))
    assert torch.equal(got, want)


def test_quark_recipe_writes_positive_zero_and_scale_byte_at_least_one():
    x = torch.zeros(2, 32)
    x[1, :4] = torch.tensor([6.0, -0.2, -0.0, 1.25])
    packed, scale = L.mxfp4.quantize(x, L.mxfp4.QUARK)
    assert scale.tolist() == [[1], [127]]
    assert L.mxfp4.unpack_fp4(packed)[1, :4].tolist() == [7, 0, 0, 2]  # -0.2 and -0.0 -> +0; 1.25 -> 1.0 (tie to even)
    packed, scale = L.mxfp4.quantize(x, L.mxfp4.AITER_TRITON)
    assert scale.tolist() == [[0], [127]]
    assert L.mxfp4.unpack_fp4(packed)[1, :4].tolist() == [7, 8, 8, 3]


def test_scale_rules_differ_exactly_at_one_and_a_half_times_a_power_of_two():
    amax = torch.tensor([1.5, 1.4999, 1.75, 0.0])
    even = L.mxfp4.e8m0_encode(L.mxfp4.scale_exponent(amax, ScaleRule.EVEN)).tolist()
    up = L.mxfp4.e8m0_encode(L.mxfp4.scale_exponent(amax, ScaleRule.ROUND_UP)).tolist()
    assert even == [125, 125, 126, 0]
    assert up == [126, 125, 126, 92]  # all-zero block: aiter HIP's 1e-10 floor gives byte 92


def test_quantize_pads_a_partial_last_block():
    x = wide_range_tensor(3, 48, seed=2)
    packed, scale = L.mxfp4.quantize(x)
    assert packed.shape == (3, 24) and scale.shape == (3, 2)
    padded = torch.nn.functional.pad(x, (0, 16))
    p2, s2 = L.mxfp4.quantize(padded)
    assert torch.equal(packed, p2[:, :24]) and torch.equal(scale, s2)


def test_quantize_is_idempotent_on_its_own_output():
    x = wide_range_tensor(4, 128, seed=3)
    packed, scale = L.mxfp4.quantize(x)
    again = L.mxfp4.quantize(L.mxfp4.dequantize(packed, scale))
    assert torch.equal(again[0], packed) and torch.equal(again[1], scale)


def test_quantize_accepts_bf16_and_leading_dims():
    x = wide_range_tensor(8, 64, seed=4).bfloat16().view(2, 4, 64)
    packed, scale = L.mxfp4.quantize(x)
    p2, s2 = L.mxfp4.quantize(x.float().view(8, 64))
    assert torch.equal(packed.view(8, 32), p2) and torch.equal(scale.view(8, 2), s2)


def test_dequantize_rejects_mismatched_scale():
    with pytest.raises(ValueError, match="does not cover"):
        L.mxfp4.dequantize(torch.zeros(4, 32, dtype=torch.uint8), torch.zeros(4, 1, dtype=torch.uint8))


def test_quantize_matches_aiter_triton_kernel_bytes(aiter_triton_quant):
    x = wide_range_tensor(37, 160, seed=5)
    # Every tie, at scale 1 (a 6.0 in the block pins the exponent to 0), both signs.
    ties = torch.tensor([6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.5, 0.1, -0.1, -0.0] + [0.0] * 20)
    x[2, :32], x[3, :32] = ties, -ties
    want_q, want_s = aiter_triton_quant(x)
    q, s = L.mxfp4.quantize(x, L.mxfp4.AITER_TRITON)
    assert torch.equal(s, want_s)
    assert torch.equal(q, want_q)


def test_dequantize_matches_aiter_decoders(aiter_fp4_utils):
    g = torch.Generator().manual_seed(6)
    packed = torch.randint(0, 256, (16, 64), dtype=torch.uint8, generator=g)
    scale = torch.randint(1, 255, (16, 4), dtype=torch.uint8, generator=g)
    codes_f32 = aiter_fp4_utils.mxfp4_to_f32(packed.clone())
    scales_f32 = aiter_fp4_utils.e8m0_to_f32(scale.clone())
    want = codes_f32 * scales_f32.repeat_interleave(32, dim=-1)
    got = L.mxfp4.dequantize(packed, scale)
    assert torch.equal(got, want)
    assert torch.equal(L.mxfp4.e8m0_decode(torch.arange(255, dtype=torch.uint8)),
                       aiter_fp4_utils.e8m0_to_f32(torch.arange(255, dtype=torch.uint8)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quark_recipe_matches_quark_exporter_bytes(quark_mxfp4, dtype):
    x = wide_range_tensor(64, 256, seed=7)
    x[4, :32] = torch.tensor([6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.5, 0.1, -0.1, -0.0] + [0.0] * 20)
    x = x.to(dtype)
    want_q, want_s = quark_mxfp4(x)
    q, s = L.mxfp4.quantize(x, L.mxfp4.QUARK)
    assert torch.equal(s, want_s)
    assert torch.equal(q, want_q)
