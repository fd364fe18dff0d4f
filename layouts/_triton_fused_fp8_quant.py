"""Our Triton kernel for the fused (residual add +) RMSNorm + FP8 activation quant.

Written for this project; the numerics are those of :func:`layouts.fused_fp8_quant.
fused_rms_fp8_quant_reference` (aiter's contract, module docstring there):

* ``x = x1 + res1`` in float32 (``out_res1`` is it in x1's dtype), ``y = (x * rstd) * w`` with
  ``rstd = 1 / sqrt(sum(x*x) / N1 + eps)`` through the correctly rounded ``div_rn`` / ``sqrt_rn``,
  so the only difference from the reference is the order in which ``sum(x*x)`` is added up;
* per group: ``scale = max(amax, 1e-10) / FP8_MAX`` and ``1 / scale``, both ``div_rn``;
* the FP8 byte is encoded here (:func:`_fp8_byte`), ties to even, the same bytes as torch's and the
  GPUs' conversions on every device; the interpreter's own float -> FP8 cast rounds some ties
  away from zero. On a CUDA GPU the GPU's own conversion is used instead (``native_cast``):
  the same bytes, measured, and 0.87x the time at decode sizes.

One program holds ``BLOCK_M`` whole rows as a ``[BLOCK_M, NG, G]`` tile (``NG`` groups of ``G``
elements, ``NG`` a power of two; per token ``G`` is a chunk of the row and the amax is taken
over the whole row), and the x2 rows of the same rows beside them: one launch, no other kernel.
"""

from __future__ import annotations

import functools
import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .fp8 import AMAX_FLOOR, fp8_max, fp8_scale_shape


@triton.jit
def _fp8_byte(v, FNUZ: tl.constexpr):
    """The FP8 E4M3 byte (uint32) of float32 ``v``, ``|v| <= FP8_MAX`` or NaN: nearest, ties to
    even. ``FNUZ``: exponent bias 8, no negative zero, NaN 0x80 (MI300's e4m3fnuz); else bias 7,
    -0 kept, NaN 0x7F with the sign (e4m3fn).

    Normal results (``|v| >=`` the smallest normal) keep 3 mantissa bits: add 2^19 - 1 plus the
    lowest kept bit, shift, rebias; a carry into the exponent is the right result. Subnormal ones
    are multiples of the smallest subnormal: ``|v| / 2^-9`` (exact) added to 2^23 rounds to the
    integer code by the float addition itself (8 there is the smallest normal's code)."""
    bits = v.to(tl.uint32, bitcast=True)
    a = bits & 0x7FFFFFFF
    af = a.to(tl.float32, bitcast=True)
    if FNUZ:
        normal = ((a + 0x7FFFF + ((a >> 20) & 1)) >> 20) - (119 << 3)
        sub = (af * 1024.0 + 8388608.0).to(tl.uint32, bitcast=True) - 0x4B000000
        mag = tl.where(a >= (120 << 23), normal, sub)
        code = tl.where(mag == 0, 0, mag | ((bits >> 24) & 0x80))
        code = tl.where(af != af, 0x80, code)
    else:
        normal = ((a + 0x7FFFF + ((a >> 20) & 1)) >> 20) - (120 << 3)
        sub = (af * 512.0 + 8388608.0).to(tl.uint32, bitcast=True) - 0x4B000000
        mag = tl.where(a >= (121 << 23), normal, sub)
        code = tl.where(af != af, 0x7F, mag) | ((bits >> 24) & 0x80)
    return code


@triton.jit
def _fused_rms_fp8_kernel(
    x1_ptr, w1_ptr, res1_ptr, out_res1_ptr, q_ptr, scale_ptr,
    x2_ptr, w2_ptr, out2_ptr,
    M, x1_stride, res1_stride, x2_stride, scale_row_stride, scale_col_stride,
    eps1, eps2,
    N1: tl.constexpr, N2: tl.constexpr, G: tl.constexpr, NG: tl.constexpr, GROUPS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N2: tl.constexpr,
    HAS_RES: tl.constexpr, HAS_X2: tl.constexpr, PER_TOKEN: tl.constexpr, FNUZ: tl.constexpr,
    FP8_MAX: tl.constexpr, AMAX_MIN: tl.constexpr, NATIVE_CAST: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < M
    rows64 = rows.to(tl.int64)
    grp = tl.arange(0, NG)
    cols = grp[None, :, None] * G + tl.arange(0, G)[None, None, :]  # [1, NG, G]
    col_ok = cols < N1
    mask = row_ok[:, None, None] & col_ok
    r3 = rows64[:, None, None]
    x = tl.load(x1_ptr + r3 * x1_stride + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_X2:  # the x2 rows' loads go out with x1's
        c2 = tl.arange(0, BLOCK_N2)
        m2 = row_ok[:, None] & (c2 < N2)[None, :]
        x2 = tl.load(x2_ptr + rows64[:, None] * x2_stride + c2[None, :], mask=m2, other=0.0).to(tl.float32)
    if HAS_RES:
        x += tl.load(res1_ptr + r3 * res1_stride + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_res1_ptr + r3 * N1 + cols, x.to(out_res1_ptr.dtype.element_ty), mask=mask)
    ss = tl.sum(tl.sum(x * x, axis=2), axis=1)
    ms = tl.math.div_rn(ss, tl.full(ss.shape, N1, tl.float32))
    rstd = tl.math.div_rn(tl.full(ss.shape, 1.0, tl.float32), tl.math.sqrt_rn(ms + eps1))
    w = tl.load(w1_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    y = x * rstd[:, None, None] * w

    amax = tl.max(tl.abs(y), axis=2)  # [BLOCK_M, NG]
    if PER_TOKEN:
        amax = tl.max(amax, axis=1)[:, None]  # [BLOCK_M, 1]
    amax = tl.maximum(amax, AMAX_MIN)
    scale = tl.math.div_rn(amax, tl.full(amax.shape, FP8_MAX, tl.float32))
    recip = tl.math.div_rn(tl.full(amax.shape, 1.0, tl.float32), scale)
    v = tl.minimum(tl.maximum(y * recip[:, :, None], -FP8_MAX), FP8_MAX)
    if NATIVE_CAST:  # the GPU's own conversion: nearest, ties to even, as _fp8_byte
        code = v.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    else:
        code = _fp8_byte(v, FNUZ).to(tl.uint8)
    tl.store(q_ptr + r3 * N1 + cols, code, mask=mask)
    if PER_TOKEN:
        tl.store(scale_ptr + rows64[:, None] * scale_row_stride, scale, mask=row_ok[:, None])
    else:
        s_off = rows64[:, None] * scale_row_stride + grp[None, :] * scale_col_stride
        tl.store(scale_ptr + s_off, scale, mask=row_ok[:, None] & (grp < GROUPS)[None, :])

    if HAS_X2:
        ss2 = tl.sum(x2 * x2, axis=1)
        ms2 = tl.math.div_rn(ss2, tl.full(ss2.shape, N2, tl.float32))
        rstd2 = tl.math.div_rn(tl.full(ss2.shape, 1.0, tl.float32), tl.math.sqrt_rn(ms2 + eps2))
        w2 = tl.load(w2_ptr + c2, mask=c2 < N2, other=0.0).to(tl.float32)
        y2 = x2 * rstd2[:, None] * w2[None, :]
        tl.store(out2_ptr + rows64[:, None] * N2 + c2[None, :], y2.to(out2_ptr.dtype.element_ty), mask=m2)


# triton.jit picked interpreter or compiler when the kernel above was defined (at import).
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"


class Plan(NamedTuple):
    g: int  # elements per group in the tile (per token: a chunk of the row)
    ng: int  # groups per row in the tile, a power of two
    bm: int  # rows per program
    warps: int


@functools.lru_cache(maxsize=4096)
def _plan(m: int, n1: int, group_size: int | None, on_gpu: bool, block_m: int | None,
          num_warps: int | None) -> Plan:
    """Launch plan for one shape (cached: at decode sizes the wrapper is much of a call's cost).
    On a GPU one row per program; 16 warps for a row of 4k elements or more (DeepSeek's input
    norm, 7168), for a shorter row (q_a, 1536, with kv_a's 512 beside it) 4 warps up to M = 4096
    and 1 above, where more programs in flight beat more threads per row. Measured on an H100
    (docs/BENCHMARKS.md, every (rows, warps) pair swept): at q_a's site the earlier plan (4 rows,
    16 warps) ran at 0.53-0.54 of a copy from M = 16384, this one at 0.92-0.99; at the input
    norm's site 1 row and 16 warps was already best. The interpreter's cost is per program and
    per operation, so it gets few large programs."""
    g = group_size if group_size is not None else min(128, triton.next_power_of_2(max(n1, 1)))
    ng = triton.next_power_of_2(max(1, -(-n1 // g)))
    if on_gpu:
        bm = 1
        warps = 16 if ng * g >= 4096 else (4 if m < 4096 else 1)
    else:
        bm, warps = 32, 4
    if block_m is not None:
        bm = block_m
    if num_warps is not None:
        warps = num_warps
    if bm < 1 or bm & (bm - 1):
        raise ValueError(f"block_m must be a power of two >= 1, got {bm}")
    return Plan(g, ng, bm, warps)


def _gpu_converts(nvidia: bool, dtype: torch.dtype) -> bool:
    """Whether the GPU's own FP8 conversion can encode ``dtype`` (NVIDIA's, e4m3fn only)."""
    return nvidia and dtype == torch.float8_e4m3fn


def _native(asked: bool | None, dev: torch.device, dtype: torch.dtype) -> bool:
    """Whether the FP8 bytes come from the GPU's own conversion (``native_cast``)."""
    if INTERPRETED or dev.type != "cuda" or not _gpu_converts(bool(torch.version.cuda), dtype):
        return False
    # On by default: on an H100 the same bytes at every shape of both DeepSeek sites, and 0.87x the
    # time at M = 1 and 4096 (3.56 -> 3.08 us at the input norm), 0.99-1.00x from M = 16384
    # (scripts/bench.py fused-fp8-quant --ab-cast, docs/BENCHMARKS.md)
    return True if asked is None else bool(asked)


@functools.lru_cache(maxsize=4096)
def _constants(plan: Plan, n1: int, n2: int, groups: int, has_res: bool, per_token: bool, dtype: torch.dtype,
               native_cast: bool) -> dict:
    """The kernel's constexpr arguments (the launch and :func:`compile_offline`). Cached like the
    plan, the wrapper being most of a decode-size call; callers only unpack or copy it."""
    return dict(N1=n1, N2=n2, G=plan.g, NG=plan.ng, GROUPS=groups, BLOCK_M=plan.bm,
                BLOCK_N2=triton.next_power_of_2(max(n2, 1)), HAS_RES=has_res, HAS_X2=bool(n2),
                PER_TOKEN=per_token, FNUZ=dtype == torch.float8_e4m3fnuz, FP8_MAX=fp8_max(dtype),
                AMAX_MIN=AMAX_FLOOR, NATIVE_CAST=native_cast)


def compile_offline(target, m: int, n1: int, n2: int = 0, has_res: bool = False, *,
                    group_size: int | None = 128, transpose_scale: bool = True,
                    dtype: torch.dtype = torch.float8_e4m3fn):
    """Compile the kernel, without a GPU, for ``target`` (a ``GPUTarget``) as a launch of an ``[m,
    n1]`` bf16 call would compile it (residual if ``has_res``, x2 of width ``n2``, the GPU plan;
    the GPU's own FP8 conversion where a CUDA launch takes it: NVIDIA, e4m3fn). The suite checks
    that this compiles for sm_90 and gfx942; see :mod:`layouts._triton_offline`."""
    from ._triton_offline import compile_like_launch

    plan = _plan(m, n1, group_size, True, None, None)
    rows, groups = fp8_scale_shape(m, n1, group_size)
    s_row, s_col = (1, m) if transpose_scale else (groups, 1)
    native = _gpu_converts(target.backend == "cuda", dtype)  # the launch's default (_native)
    args = {"x1_ptr": "*bf16", "w1_ptr": "*bf16", "res1_ptr": "*bf16" if has_res else None,
            "out_res1_ptr": "*bf16" if has_res else None, "q_ptr": "*u8", "scale_ptr": "*fp32",
            "x2_ptr": "*bf16" if n2 else None, "w2_ptr": "*bf16" if n2 else None,
            "out2_ptr": "*bf16" if n2 else None, "M": m, "x1_stride": n1, "res1_stride": n1 if has_res else 0,
            "x2_stride": n2, "scale_row_stride": s_row, "scale_col_stride": s_col, "eps1": 1e-6, "eps2": 1e-6}
    consts = _constants(plan, n1, n2, groups, has_res, group_size is None, dtype, native)
    return compile_like_launch(_fused_rms_fp8_kernel, target, args, consts, plan.warps)


def fused_rms_fp8_quant_triton(
    x1: torch.Tensor,
    x1_weight: torch.Tensor,
    x1_epsilon: float,
    x2: torch.Tensor | None = None,
    x2_weight: torch.Tensor | None = None,
    x2_epsilon: float = 0.0,
    res1: torch.Tensor | None = None,
    *,
    group_size: int | None = 128,
    dtype: torch.dtype = torch.float8_e4m3fn,
    transpose_scale: bool = False,
    block_m: int | None = None,
    num_warps: int | None = None,
    native_cast: bool | None = None,
):
    """Our Triton back end of :func:`layouts.fused_fp8_quant.fused_rms_fp8_quant` (same contract;
    inputs with a unit last stride). ``block_m`` / ``num_warps`` override the launch plan
    (benchmarks and tests only). ``native_cast``: encode the FP8 bytes with the GPU's own
    conversion instead of :func:`_fp8_byte`, on a CUDA GPU for e4m3fn (its conversion rounds to
    nearest even as ``_fp8_byte`` does; never interpreted, where the cast rounds some ties away
    from zero). On by default there: measured the same bytes and faster (below)."""
    m, n1 = x1.shape
    n2 = x2.shape[1] if x2 is not None else 0
    dev = x1.device
    if dev.type == "cpu" and not INTERPRETED:
        raise RuntimeError("prep's Triton fused FP8 quant needs GPU tensors (or TRITON_INTERPRET=1 set "
                           "before layouts._triton_fused_fp8_quant is imported); use backend='torch' on CPU")
    plan = _plan(m, n1, group_size, dev.type != "cpu" and not INTERPRETED, block_m, num_warps)
    rows, groups = fp8_scale_shape(m, n1, group_size)
    q = torch.empty((m, n1), dtype=dtype, device=dev)
    # transposed: the [G, M] buffer, written with swapped strides, presented as [M, G]
    buf = torch.empty((groups, rows) if transpose_scale else (rows, groups), dtype=torch.float32, device=dev)
    s_row, s_col = (1, m) if transpose_scale else (groups, 1)
    out_res1 = torch.empty((m, n1), dtype=x1.dtype, device=dev) if res1 is not None else None
    out2 = torch.empty((m, n2), dtype=x1.dtype, device=dev) if x2 is not None else None
    scale = buf.view(rows, groups)
    if m == 0:
        return (q, scale), out2, out_res1
    _fused_rms_fp8_kernel[(triton.cdiv(m, plan.bm),)](
        x1, x1_weight, res1, out_res1, q.view(torch.uint8), buf,
        x2, x2_weight, out2,
        m, x1.stride(0), res1.stride(0) if res1 is not None else 0, x2.stride(0) if x2 is not None else 0,
        s_row, s_col, float(x1_epsilon), float(x2_epsilon),
        **_constants(plan, n1, n2, groups, res1 is not None, group_size is None, dtype,
                     _native(native_cast, dev, dtype)),
        num_warps=plan.warps,
    )
    return (q, scale), out2, out_res1
