"""MXFP4 numerics: E2M1 element codes, E8M0 block scales, packing, quantize and dequantize.

Format (OCP MX, as Quark, aiter and Triton store it):

* an E2M1 code is 4 bits, sign (bit 3), exponent (bits 2:1, bias 1), mantissa (bit 0):
  magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6; codes 8..15 are the negatives (8 is -0);
* two codes share a byte: **low nibble = even element, high nibble = odd element**;
* an E8M0 byte ``b`` is the scale ``2**(b - 127)``; 0xFF is NaN;
* a block of 32 consecutive elements along the last dimension shares one scale:
  ``W[n, k] = e2m1(code[n, k]) * 2**(S[n, k // 32] - 127)``.

Quantizing needs two choices, and the real kernels differ in both, so each is named
(:class:`ScaleRule`, :class:`Rounding`) and every quantize call states which it uses:

* ``ScaleRule.EVEN``: aiter's Triton kernels (``_mxfp4_quant_op``, used by the fused
  RMSNorm + quant) and Quark's ``scale_calculation_mode: even``. Round amax to a power of two
  by adding 0x200000 to its float32 bits and clearing the mantissa; the unbiased exponent is
  ``floor(log2(rounded)) - 2`` clamped to [-127, 127]. An all-zero block gets byte 0.
* ``ScaleRule.ROUND_UP``: aiter's HIP quant kernel (``dynamic_per_group_scaled_quant_fp4``):
  amax (at least 1e-10) is rounded to a power of two upwards when its mantissa is >= 0.5, and
  the scale is a quarter of that. Close to ``ceil_pow2(amax / 6)``, except that an amax of
  exactly ``1.5 * 2**p`` rounds up here. An all-zero block gets byte 92 (from the 1e-10 floor).
* ``Rounding.HALF_AWAY``: what aiter's Triton kernel computes with its bit trick (keep two
  mantissa bits, add one, shift): round to nearest, ties away from zero. 0.25 -> 0.5,
  1.25 -> 1.5, 2.5 -> 3, 5 -> 6.
* ``Rounding.HALF_EVEN``: IEEE round to nearest, ties to the even code (0.25 -> 0, 1.25 -> 1,
  2.5 -> 2, 5 -> 4), as hardware conversions do.

Both roundings saturate at +-6. What a negative value that rounds to zero becomes differs too:
aiter's kernel keeps its sign (code 8, -0), Quark's exporter writes +0 (code 0).

A :class:`QuantRecipe` bundles these choices; the named ones are what each real producer does:

* ``AITER_TRITON``: EVEN + HALF_AWAY, keeps -0, all-zero block -> byte 0. The fused
  activation quant; checked byte for byte against aiter's ``_mxfp4_quant_op``.
* ``QUARK``: EVEN + HALF_EVEN, -0 -> +0, scale byte at least 1 (Quark clamps log2 of the scale
  at -126, so an all-zero block gets byte 1). How Quark's exported MXFP4 weights are made;
  checked against ``amd-quark`` 0.13's exporter.
* ``AITER_HIP``: ROUND_UP + HALF_EVEN, keeps -0. aiter's HIP ``dynamic_per_group_scaled_quant_fp4``.
"""

from __future__ import annotations

import dataclasses
import enum

import torch

from .sizes import ceil_div

__all__ = [
    "BLOCK_SIZE", "E8M0_BIAS", "E8M0_NAN", "E8M0_ONE", "FP4_MAX", "E2M1_VALUES", "ScaleRule",
    "Rounding", "QuantRecipe", "AITER_TRITON", "QUARK", "AITER_HIP", "RECIPES", "get_recipe",
    "e2m1_decode", "e2m1_encode", "pack_fp4", "unpack_fp4", "e8m0_decode", "e8m0_encode",
    "as_uint8", "scale_exponent", "quantize", "dequantize",
]

BLOCK_SIZE = 32
"""Elements per MXFP4 block (one E8M0 scale each)."""

E8M0_BIAS = 127
E8M0_NAN = 0xFF
E8M0_ONE = 0x7F
"""The E8M0 byte of scale 1.0; the value ``prep`` writes into scale padding."""

FP4_MAX = 6.0

# Magnitudes of codes 0..7; codes 8..15 are their negatives.
_E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_VALUES = torch.tensor(list(_E2M1_MAGNITUDES) + [-m for m in _E2M1_MAGNITUDES], dtype=torch.float32)
"""float32 value of each E2M1 code 0..15 (index 8 holds -0.0)."""


class ScaleRule(str, enum.Enum):
    """How a block's E8M0 scale is derived from its absolute maximum."""

    EVEN = "even"
    ROUND_UP = "round_up"


class Rounding(str, enum.Enum):
    """How a scaled element is rounded onto the E2M1 grid."""

    HALF_AWAY = "half_away_from_zero"
    HALF_EVEN = "half_to_even"


@dataclasses.dataclass(frozen=True)
class QuantRecipe:
    """Every choice that decides the bytes of an MXFP4 quantization."""

    name: str
    rule: ScaleRule
    rounding: Rounding
    keep_negative_zero: bool
    min_scale_byte: int = 0

    def describe(self) -> dict:
        return {"recipe": self.name, "scale_rule": self.rule.value, "rounding": self.rounding.value,
                "keep_negative_zero": self.keep_negative_zero, "min_scale_byte": self.min_scale_byte}


AITER_TRITON = QuantRecipe("aiter-triton", ScaleRule.EVEN, Rounding.HALF_AWAY, keep_negative_zero=True)
QUARK = QuantRecipe("quark", ScaleRule.EVEN, Rounding.HALF_EVEN, keep_negative_zero=False, min_scale_byte=1)
AITER_HIP = QuantRecipe("aiter-hip", ScaleRule.ROUND_UP, Rounding.HALF_EVEN, keep_negative_zero=True)
RECIPES = {r.name: r for r in (AITER_TRITON, QUARK, AITER_HIP)}


def get_recipe(recipe: "QuantRecipe | str") -> QuantRecipe:
    if isinstance(recipe, QuantRecipe):
        return recipe
    try:
        return RECIPES[recipe]
    except KeyError:
        raise ValueError(f"unknown quant recipe '{recipe}'; known: {', '.join(RECIPES)}") from None

# Decision points between neighbouring magnitudes: (midpoint, code above it is even).
# A magnitude strictly above a midpoint takes the upper code; exactly on it, the tie rule decides.
_MIDPOINTS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """float32 values of E2M1 codes (a uint8 tensor of values 0..15)."""
    return E2M1_VALUES.to(codes.device)[codes.long()]


def e2m1_encode(
    x: torch.Tensor, rounding: Rounding = Rounding.HALF_AWAY, keep_negative_zero: bool = True
) -> torch.Tensor:
    """Round an already-scaled float tensor onto the E2M1 grid; returns uint8 codes 0..15.

    Saturates at +-6 (infinities too). A negative input that rounds to zero gives code 8 (-0)
    when ``keep_negative_zero``, else code 0. NaN encodes as +-6, as aiter's bit trick does.
    """
    rounding = Rounding(rounding)
    x = x.float()
    mag = x.abs()
    code = torch.zeros(x.shape, dtype=torch.uint8, device=x.device)
    for point, upper_is_even in _MIDPOINTS:
        ties_up = rounding is Rounding.HALF_AWAY or upper_is_even
        code += (mag >= point) if ties_up else (mag > point)
    code = torch.where(mag.isnan(), torch.full_like(code, 7), code)
    sign = torch.signbit(x)
    if not keep_negative_zero:
        sign &= code != 0
    return code | (sign.to(torch.uint8) << 3)


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """Pack E2M1 codes ``[..., K]`` (K even) into bytes ``[..., K/2]``, low nibble = even element."""
    if codes.shape[-1] % 2:
        raise ValueError(f"pack_fp4 needs an even last dimension, got shape {tuple(codes.shape)}")
    codes = codes.to(torch.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """Unpack bytes ``[..., Kb]`` into E2M1 codes ``[..., 2*Kb]`` (uint8 0..15)."""
    packed = as_uint8(packed)
    return torch.stack((packed & 0x0F, packed >> 4), dim=-1).flatten(-2)


def e8m0_decode(scale: torch.Tensor) -> torch.Tensor:
    """float32 value ``2**(b - 127)`` of each E8M0 byte; 0xFF decodes to NaN."""
    b = as_uint8(scale).to(torch.int32)
    # Build the float32 bits directly: exponent field b for b >= 1, the subnormal 2^-127 for b == 0.
    bits = torch.where(b == 0, torch.full_like(b, 0x00400000), b << 23)
    bits = torch.where(b == E8M0_NAN, torch.full_like(b, 0x7FC00000), bits)
    return bits.view(torch.float32)


def e8m0_encode(exponent: torch.Tensor) -> torch.Tensor:
    """E8M0 bytes of unbiased integer exponents in [-127, 127]."""
    e = exponent.to(torch.int32)
    if e.numel() and (e.min() < -127 or e.max() > 127):
        raise ValueError("E8M0 exponents must lie in [-127, 127]")
    return (e + E8M0_BIAS).to(torch.uint8)


def as_uint8(t: torch.Tensor) -> torch.Tensor:
    """Reinterpret a 1-byte tensor (uint8, float4_e2m1fn_x2, float8_e8m0fnu, int8) as uint8."""
    if t.element_size() != 1:
        raise TypeError(f"expected a 1-byte dtype (uint8, float4_e2m1fn_x2, float8_e8m0fnu), got {t.dtype}")
    return t if t.dtype == torch.uint8 else t.view(torch.uint8)


def scale_exponent(amax: torch.Tensor, rule: ScaleRule = ScaleRule.EVEN) -> torch.Tensor:
    """Unbiased int32 scale exponent of each block, from its float32 absolute maximum."""
    rule = ScaleRule(rule)
    amax = amax.float()
    if rule is ScaleRule.EVEN:
        bits = amax.view(torch.int32)
        rounded = ((bits + 0x200000) & 0x7F800000).view(torch.float32)
        e = torch.floor(torch.log2(rounded)) - 2
        return e.clamp(-127, 127).to(torch.int32)
    # ROUND_UP: aiter HIP. The floor of 1e-10 keeps all-zero blocks finite.
    bits = torch.maximum(amax, torch.tensor(1e-10, device=amax.device)).view(torch.int32)
    biased = (bits >> 23) & 0xFF
    biased = biased + ((bits & 0x400000) != 0).to(torch.int32)  # mantissa >= 0.5: round up
    return (biased - E8M0_BIAS - 2).clamp(-127, 127)


def quantize(x: torch.Tensor, recipe: QuantRecipe | str = AITER_TRITON) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x [..., K]`` to MXFP4 along its last dimension, as ``recipe`` says.

    Returns ``(packed uint8 [..., K/2], scale uint8 [..., ceil(K/32)])``. K must be even; a
    trailing partial block is quantized as if zero-padded to 32. The default recipe is aiter's
    Triton kernel (the fused activation quant); Quark-made weights use :data:`QUARK`.
    """
    recipe = get_recipe(recipe)
    k = x.shape[-1]
    if k % 2:
        raise ValueError(f"MXFP4 needs an even last dimension, got shape {tuple(x.shape)}")
    nblocks = ceil_div(k, BLOCK_SIZE)
    xf = x.float()
    if nblocks * BLOCK_SIZE != k:
        xf = torch.nn.functional.pad(xf, (0, nblocks * BLOCK_SIZE - k))
    blocks = xf.reshape(*x.shape[:-1], nblocks, BLOCK_SIZE)
    exponent = scale_exponent(blocks.abs().amax(dim=-1), recipe.rule)
    exponent = exponent.clamp(min=recipe.min_scale_byte - E8M0_BIAS)
    # 2^-e exactly, for every e in [-127, 127] (ldexp avoids a rounded exp2).
    inv_scale = torch.ldexp(torch.ones_like(exponent, dtype=torch.float32), -exponent)
    codes = e2m1_encode(blocks * inv_scale.unsqueeze(-1), recipe.rounding, recipe.keep_negative_zero)
    codes = codes.reshape(*x.shape[:-1], nblocks * BLOCK_SIZE)[..., :k]
    return pack_fp4(codes), e8m0_encode(exponent)


def dequantize(packed: torch.Tensor, scale: torch.Tensor, k: int | None = None) -> torch.Tensor:
    """float32 ``[..., K]`` from packed codes ``[..., K/2]`` and E8M0 scales ``[..., ceil(K/32)]``.

    ``k`` trims the result when the scale covers more columns than the weight (padded scales).
    """
    packed = as_uint8(packed)
    full = 2 * packed.shape[-1]
    k = full if k is None else k
    s = e8m0_decode(scale)
    nblocks = ceil_div(k, BLOCK_SIZE)
    if s.shape[:-1] != packed.shape[:-1] or s.shape[-1] < nblocks:
        raise ValueError(
            f"scale shape {tuple(s.shape)} does not cover weight shape {tuple(packed.shape)} "
            f"(expected [..., >= {nblocks}] with the same leading dims)"
        )
    # One lookup per byte gives both of its values (low nibble first): the reference GEMMs
    # dequantize whole models, so this is the hot path of `prep run`.
    values = _byte_values(packed.device)[packed.long()].flatten(-2)
    if full % BLOCK_SIZE == 0 and k == full:
        blocks = values.view(*values.shape[:-1], full // BLOCK_SIZE, BLOCK_SIZE)
        return (blocks * s[..., :nblocks, None]).flatten(-2)
    return values[..., :k] * s[..., :nblocks].repeat_interleave(BLOCK_SIZE, dim=-1)[..., :k]


_BYTE_VALUES: dict[torch.device, torch.Tensor] = {}


def _byte_values(device: torch.device) -> torch.Tensor:
    """``[256, 2]`` float32: the two E2M1 values of each packed byte."""
    t = _BYTE_VALUES.get(device)
    if t is None:
        b = torch.arange(256, dtype=torch.int64)
        t = _BYTE_VALUES[device] = torch.stack((E2M1_VALUES[b & 0x0F], E2M1_VALUES[b >> 4]), dim=-1).to(device)
    return t
