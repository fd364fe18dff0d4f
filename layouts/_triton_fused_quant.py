"""Our Triton kernel for the fused (residual add +) RMSNorm + MXFP4 activation quant.

Written for this project (not derived from aiter's code); the numerics mirror aiter's Triton
kernel (``_fused_rms_mxfp4_quant_kernel``) so that its outputs can be compared byte for byte:

* ``x = x1 + res1`` in float32, ``out_res1 = x`` cast to x1's dtype; the RMSNorm uses the
  float32 sum, not the rounded one (as aiter does);
* ``y = (x * rstd) * w`` in float32 with ``rstd = 1 / sqrt(sum(x*x) / N + eps)``; ``y`` is
  quantized in float32 (aiter does not round it to bf16 first);
* the ``AITER_TRITON`` recipe: EVEN scale, ties away from zero, -0 kept as code 8, an
  all-zero block gets scale byte 0.

The mean, square root and reciprocal use the correctly rounded ``div_rn`` / ``sqrt_rn`` so the
only difference from the torch reference is the float32 summation order of ``sum(x*x)``
(which moves a code across a rounding boundary about once per few hundred thousand codes).

Layout of the work (one launch, no other kernel, no torch.fill):

* programs ``[0, n_split)``: ``BLOCK_M`` rows of x1 each, the whole row in registers. The row's
  32-element blocks are split into <= 3 power-of-two tiles (224 = 128 + 64 + 32 for N1 = 7168,
  48 = 32 + 16 for 1536), each held as ``[BLOCK_M, T, 4, 4]`` element *pairs*: bf16 pairs are
  loaded as one int32 each (the wrapper passes int32 views), which makes the (even, odd) nibble
  packing free and every load and store a 16-byte vector in one register layout. All tiles'
  loads are issued before any is used (one memory latency per program). Without a residual the
  pairs stay packed until quantized (half the registers, so more programs per SM). Scales go
  straight to their S32x8 offsets when ``SHUFFLE``; in padded mode columns >= ceil(N1/32) get 0x7F.
  At decode sizes (``SPLIT > 1``) ``SPLIT`` programs share the rows: each sums the whole rows (as
  one flat tile: one reduction, not one per tile) and quantizes ``TS`` blocks of them, so one
  row's quant runs on several SMs at once. Unsplit programs also normalise the x2 rows of their
  rows (``X2_MAIN``), loaded with x1's.
* programs ``[n_split, n_main)``: scale pad rows up to the next multiple of 32 (0x7F).
* programs ``[n_main, n_main + n_x2)``: ``BLOCK_M2`` rows of the second RMSNorm (x2), only when
  the rows are split (decode sizes: x2 then runs beside the slices, off their critical path).
* the rest: fill whole 32-row bands of scale padding (rows >= pad32(M)) with 0x7F; in both the
  row-major and the S32x8 layouts these bands are one contiguous byte range.

The E2M1 encoding (:func:`_e2m1_offset`) is min/max, one round-toward-zero FMA (inline PTX on a
GPU, emulated exactly in the interpreter) and shifts: all 2^32 float32 inputs give the bytes of
the earlier compare-based encoding (scripts/bench.py fused-quant --e2m1-exhaustive).

Measured on an H200 (scripts/bench.py fused-quant, CUDA graphs, shuffle + padding, 2026-12-04;
docs/BENCHMARKS.md): M = 65536, N1 = 7168 with residual 849 us (3.61 TB/s, 0.86 of the run's
best copy); N1 = 1536 + kv 512: 103 us (3.78 TB/s, 0.90; was 121); M = 1: 2.3-2.6 us (was
2.9-3.0 in the same runs) and 1.8 us (was 1.9).
"""

from __future__ import annotations

import functools
import math
import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

E8M0_PAD = tl.constexpr(0x7F)  # layouts.mxfp4.E8M0_ONE (jitted code may only read constexpr globals)
_FILL_BLOCK = 4096


@triton.jit
def _unpack(v):
    """(even, odd) float32 of an int32 holding two bf16 (little-endian: low half = even). A bf16
    is the top half of a float32, so widening is a shift or a mask."""
    return (v << 16).to(tl.float32, bitcast=True), (v & -65536).to(tl.float32, bitcast=True)


@triton.jit
def _load_pairs(row_ptr, pair, mask, PAIRED: tl.constexpr):
    """(even, odd) float32 elements of element pairs ``pair`` of the rows at ``row_ptr``."""
    if PAIRED:  # row_ptr is an int32 view of bf16 data: one load per pair
        even, odd = _unpack(tl.load(row_ptr + pair, mask=mask, other=0))
    else:
        even = tl.load(row_ptr + 2 * pair, mask=mask, other=0.0).to(tl.float32)
        odd = tl.load(row_ptr + 2 * pair + 1, mask=mask, other=0.0).to(tl.float32)
    return even, odd


@triton.jit
def _store_pairs(row_ptr, pair, mask, even, odd, PAIRED: tl.constexpr):
    if PAIRED:  # an int32 view of a bf16 output
        lo = even.to(tl.bfloat16).to(tl.uint16, bitcast=True).to(tl.int32)
        hi = odd.to(tl.bfloat16).to(tl.uint16, bitcast=True).to(tl.int32)
        tl.store(row_ptr + pair, lo | (hi << 16), mask=mask)
    else:
        ty = row_ptr.dtype.element_ty
        tl.store(row_ptr + 2 * pair, even.to(ty), mask=mask)
        tl.store(row_ptr + 2 * pair + 1, odd.to(ty), mask=mask)


@triton.jit
def _rz_half_plus_half(a, RZ_ASM: tl.constexpr):
    """``0.5 + 0.5 * a`` rounded toward zero, for ``0 <= a <= 6``."""
    if RZ_ASM:  # one FMA on the FP32 pipe
        bits = tl.inline_asm_elementwise("fma.rz.f32 $0, $1, 0f3F000000, 0f3F000000;", "=r,r",
                                         [a.to(tl.int32, bitcast=True)], dtype=tl.int32, is_pure=True, pack=1)
        return bits.to(tl.float32, bitcast=True)
    # The interpreter has no rounding modes: round to nearest, then step back one ulp where that
    # rounded up. 0.5 * a is exact; where the sum is below 1, f - 0.5 is exact (Sterbenz); where
    # it is not, a >= 1 and the caller takes a, not f (both f's are <= a).
    h = a * 0.5
    f = h + 0.5
    return tl.where(f - 0.5 > h, (f.to(tl.int32, bitcast=True) - 1).to(tl.float32, bitcast=True), f)


@triton.jit
def _e2m1_offset(v, RZ_ASM: tl.constexpr):
    """``t`` with ``t >> 22`` = the E2M1 magnitude code (0..7) of float32 ``v``: nearest, ties away
    from zero, saturating at 6 (inf and NaN too: ``minimum`` returns the number).

    E2M1 is 0, 0.5, 1 (step 0.5), then one mantissa bit per octave up to 6. Every rounding
    threshold (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5) is a multiple of 2^21 in float32 bit space.
    For ``a = |v| >= 1`` the code counts half-octaves: ``((bits(a) + 2^21) >> 22) - 252``. For
    ``a < 1``, ``b = 0.5 + a / 2`` (rounded toward zero, so no value crosses a threshold) lies in
    [0.5, 1) with the step-0.5 grid of ``a`` mapped onto the half-octaves of that octave, and the
    same formula gives 0, 1, 2. ``max(a, b)`` picks the right one (b > a exactly when a < 1), so
    the code is ``(bits(max(a, b)) - (252 << 22) + 2^21) >> 22``: two min/max, one FMA, one add
    and a shift, against ~14 integer and select operations of the compare-based encoding."""
    a = tl.minimum(tl.abs(v), 6.0)
    b = tl.maximum(a, _rz_half_plus_half(a, RZ_ASM))
    return b.to(tl.uint32, bitcast=True) - 0x3EE00000


@triton.jit
def _e2m1_pair(ve, vo, RZ_ASM: tl.constexpr):
    """The FP4 byte (uint32, 0..255) of the pair (``ve`` low nibble, ``vo`` high nibble), signs
    kept (a negative that rounds to zero gives code 8). Each nibble's magnitude and sign come
    straight from shifted bits; what else the shifts bring along is masked off."""
    se = ve.to(tl.uint32, bitcast=True) >> 28  # sign at bit 3
    so = vo.to(tl.uint32, bitcast=True) >> 24  # sign at bit 7
    return ((_e2m1_offset(ve, RZ_ASM) >> 22) | (se & 8) | ((_e2m1_offset(vo, RZ_ASM) >> 18) & 0x70)
            | (so & 0x80))


@triton.jit
def _scale_offsets(rows, cols, SCALE_COLS_PAD: tl.constexpr, SHUFFLE: tl.constexpr):
    """Byte offset of scale (row, col) in the output buffer: row-major or S32x8."""
    r = rows[:, None]
    c = cols[None, :]
    if SHUFFLE:
        # r = 32s + 16a + l, c = 8g + 4d + e  ->  s*32*Cp + g*256 + e*64 + l*4 + d*2 + a
        off = ((r >> 5) * (32 * SCALE_COLS_PAD) + (c >> 3) * 256 + (c & 3) * 64
               + (r & 15) * 4 + ((c >> 2) & 1) * 2 + ((r >> 4) & 1))
    else:
        off = r * SCALE_COLS_PAD + c
    return off


@triton.jit
def _pairs(B0, T: tl.constexpr, N1: tl.constexpr, SCALE_COLS: tl.constexpr):
    """Pair indices [1, T, 4, 4] of blocks [B0, B0+T) and which of them exist ([1, T, 1, 1] or
    [1, T, 4, 4]). A block's 16 pairs are 4 runs of 4 (16 bytes of int32 pairs): with a
    [.., 16] axis Triton converts register layouts through shared memory between the 16-byte
    loads and the stores; split like this, every access is one 16-byte vector per thread."""
    blk = B0 + tl.arange(0, T)
    quad = tl.arange(0, 4)
    pair = blk[None, :, None, None] * 16 + quad[None, None, :, None] * 4 + quad[None, None, None, :]
    if N1 % 32 == 0:
        col_ok = (blk < SCALE_COLS)[None, :, None, None]  # whole blocks: loads stay vectorised
    else:
        col_ok = pair < N1 // 2
    return blk, pair, col_ok


@triton.jit
def _tile_fetch(x_rows, r_rows, row_ok, B0, T: tl.constexpr, N1: tl.constexpr,
                SCALE_COLS: tl.constexpr, HAS_RES: tl.constexpr, X_PAIRED: tl.constexpr,
                R_PAIRED: tl.constexpr):
    """Issue the loads of blocks [B0, B0+T) of the program's rows, nothing else: every tile's
    loads go out before any of them is waited on (one memory latency per program, not one per
    tile). Paired bf16 stays packed: (v, v); else (even, odd) float32. Same for res1."""
    blk, pair, col_ok = _pairs(B0, T, N1, SCALE_COLS)
    mask = row_ok[:, None, None, None] & col_ok
    if X_PAIRED:
        xa = tl.load(x_rows + pair, mask=mask, other=0)
        xb = xa
    else:
        xa, xb = _load_pairs(x_rows, pair, mask, False)
    ra, rb = xa, xb
    if HAS_RES:
        if R_PAIRED:
            ra = tl.load(r_rows + pair, mask=mask, other=0)
            rb = ra
        else:
            ra, rb = _load_pairs(r_rows, pair, mask, False)
    return xa, xb, ra, rb


@triton.jit
def _tile_sum(xa, xb, ra, rb, o_rows, row_ok, B0, T: tl.constexpr, N1: tl.constexpr,
              SCALE_COLS: tl.constexpr, HAS_RES: tl.constexpr, X_PAIRED: tl.constexpr,
              R_PAIRED: tl.constexpr, STORE: tl.constexpr):
    """(a, b, sum of squares per row) of a fetched tile; stores out_res1 = x1 + res1 on the way.
    Without a residual, bf16 rows stay packed (a = b = the int32 pairs: half the registers while
    the row waits for its norm); else a, b are the float32 (even, odd) elements (the float32 sum
    x1 + res1 is what gets normalised)."""
    if X_PAIRED:
        xe, xo = _unpack(xa)
    else:
        xe, xo = xa, xb
    a, b = xa, xb
    if HAS_RES:
        if R_PAIRED:
            re, ro = _unpack(ra)
        else:
            re, ro = ra, rb
        xe = xe + re
        xo = xo + ro
        if STORE:
            blk, pair, col_ok = _pairs(B0, T, N1, SCALE_COLS)
            _store_pairs(o_rows, pair, row_ok[:, None, None, None] & col_ok, xe, xo, X_PAIRED)
        a, b = xe, xo
    ss = tl.sum(tl.sum(tl.sum(xe * xe + xo * xo, axis=3), axis=2), axis=1)
    return a, b, ss


@triton.jit
def _tile_weight(w1_ptr, B0, T: tl.constexpr, N1: tl.constexpr, SCALE_COLS: tl.constexpr, W_PAIRED: tl.constexpr):
    """(even, odd) float32 RMSNorm weights of blocks [B0, B0+T) (L2-resident: shared by every row)."""
    blk, pair, col_ok = _pairs(B0, T, N1, SCALE_COLS)
    return _load_pairs(w1_ptr, pair, col_ok, W_PAIRED)


@triton.jit
def _tile_quant(a, b, rstd, we, wo, rows, row_ok, q_rows, scale_ptr, B0, T: tl.constexpr,
                N1: tl.constexpr, SCALE_COLS: tl.constexpr, SCALE_COLS_PAD: tl.constexpr,
                SHUFFLE: tl.constexpr, PAD: tl.constexpr, RAW: tl.constexpr, RZ_ASM: tl.constexpr):
    """Normalise, quantize and store blocks [B0, B0+T): FP4 codes and their scale bytes."""
    blk, pair, col_ok = _pairs(B0, T, N1, SCALE_COLS)
    if RAW:
        xe, xo = _unpack(a)
    else:
        xe, xo = a, b
    r4 = rstd[:, None, None, None]
    ye = xe * r4 * we  # (x * rstd) * w, rounded twice, as aiter and the reference do
    yo = xo * r4 * wo

    # EVEN scale: round amax to a power of two (+0x200000, keep the exponent); the unbiased
    # scale exponent is that exponent - 2, clamped to [-127, 127]. A zero or denormal amax
    # gives -127 (byte 0), inf/NaN 127, as aiter's log2 does.
    amax = tl.max(tl.max(tl.maximum(tl.abs(ye), tl.abs(yo)), axis=3), axis=2)
    rb = ((amax.to(tl.uint32, bitcast=True) + 0x200000) >> 23).to(tl.int32) & 0xFF
    e = tl.where(rb == 255, 127, tl.minimum(tl.maximum(rb - 129, -127), 127))
    # 2^-e exactly; its biased exponent 127 - e is 0 only for e = 127 (2^-127 is denormal).
    ib = 127 - e
    inv = tl.where(ib == 0, 0x00400000, ib << 23).to(tl.float32, bitcast=True)[:, :, None, None]
    q = _e2m1_pair(ye * inv, yo * inv, RZ_ASM).to(tl.uint8)
    tl.store(q_rows + pair, q, mask=row_ok[:, None, None, None] & col_ok)

    sc = e + 127
    if PAD:
        sc = tl.where(row_ok[:, None] & (blk < SCALE_COLS)[None, :], sc, E8M0_PAD)
        smask = (blk < SCALE_COLS_PAD)[None, :]  # every row of a main program is < pad256(M)
    else:
        smask = row_ok[:, None] & (blk < SCALE_COLS)[None, :]
    tl.store(scale_ptr + _scale_offsets(rows, blk, SCALE_COLS_PAD, SHUFFLE), sc.to(tl.uint8), mask=smask)


@triton.jit
def _row_sumsq(x1_ptr, res1_ptr, rows64, row_ok, x1_stride, res1_stride, N1: tl.constexpr,
               NPAIR: tl.constexpr, HAS_RES: tl.constexpr, X_PAIRED: tl.constexpr, R_PAIRED: tl.constexpr):
    """Sum of squares of whole rows (x1 + res1 in float32), read as one flat ``[BLOCK_M, NPAIR]``
    tile of element pairs: one reduction (one cross-warp step) instead of one per tile. The split
    programs use it: at decode sizes the kernel's time is the chain load -> sum -> rstd -> quant."""
    pair = tl.arange(0, NPAIR)[None, :]
    mask = row_ok[:, None] & (pair < N1 // 2)
    xe, xo = _load_pairs(x1_ptr + (rows64 * x1_stride)[:, None], pair, mask, X_PAIRED)
    if HAS_RES:
        re, ro = _load_pairs(res1_ptr + (rows64 * res1_stride)[:, None], pair, mask, R_PAIRED)
        xe = xe + re
        xo = xo + ro
    return tl.sum(xe * xe + xo * xo, axis=1)


@triton.jit
def _x2_fetch(x2_ptr, rows, row_ok, x2_stride, N2: tl.constexpr, BLOCK_N2: tl.constexpr):
    """Issue the loads of x2 rows ``rows`` (as stored: the norm widens them later), and the mask."""
    cols = tl.arange(0, BLOCK_N2)
    m2 = row_ok[:, None] & (cols < N2)[None, :]
    x = tl.load(x2_ptr + (rows.to(tl.int64) * x2_stride)[:, None] + cols[None, :], mask=m2, other=0.0)
    return x, m2


@triton.jit
def _x2_norm(x, m2, rows, w2_ptr, out2_ptr, eps2, N2: tl.constexpr, BLOCK_N2: tl.constexpr):
    """RMSNorm of fetched x2 rows into out2 (x1's dtype, as aiter allocates it)."""
    cols = tl.arange(0, BLOCK_N2)
    x = x.to(tl.float32)
    w = tl.load(w2_ptr + cols, mask=cols < N2, other=0.0).to(tl.float32)
    ss = tl.sum(x * x, axis=1)
    ms = tl.math.div_rn(ss, tl.full(ss.shape, N2, tl.float32))
    rstd = tl.math.div_rn(tl.full(ss.shape, 1.0, tl.float32), tl.math.sqrt_rn(ms + eps2))
    y = x * rstd[:, None] * w[None, :]
    tl.store(out2_ptr + (rows.to(tl.int64) * N2)[:, None] + cols[None, :], y.to(out2_ptr.dtype.element_ty), mask=m2)


@triton.jit
def _fused_rms_mxfp4_kernel(
    x1_ptr, w1_ptr, res1_ptr, out_res1_ptr, q_ptr, scale_ptr,
    x2_ptr, w2_ptr, out2_ptr,
    M, x1_stride, res1_stride, x2_stride,
    eps1, eps2,
    n_split, n_main, n_x2, fill_start, fill_end,
    N1: tl.constexpr, N2: tl.constexpr,
    SCALE_COLS: tl.constexpr, SCALE_COLS_PAD: tl.constexpr, NB_PAD: tl.constexpr,
    T0: tl.constexpr, T1: tl.constexpr, T2: tl.constexpr, SPLIT: tl.constexpr, TS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_M2: tl.constexpr, BLOCK_N2: tl.constexpr,
    HAS_RES: tl.constexpr, HAS_X2: tl.constexpr, SHUFFLE: tl.constexpr, PAD: tl.constexpr,
    X_PAIRED: tl.constexpr, R_PAIRED: tl.constexpr, W_PAIRED: tl.constexpr, RZ_ASM: tl.constexpr,
    X2_MAIN: tl.constexpr, FLAT_SUM: tl.constexpr, NPAIR: tl.constexpr, FILL_BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    if pid < n_split:
        # BLOCK_M rows; with SPLIT > 1, SPLIT programs share them, each quantizing TS blocks.
        row0 = (pid // SPLIT) * BLOCK_M
        rows = row0 + tl.arange(0, BLOCK_M)
        row_ok = rows < M
        rows64 = rows.to(tl.int64)
        # Row strides are in units of the pointer's element (int32 pairs when PAIRED).
        x_rows = x1_ptr + (rows64 * x1_stride)[:, None, None, None]
        r_rows = res1_ptr + (rows64 * res1_stride)[:, None, None, None] if HAS_RES else res1_ptr
        o_rows = out_res1_ptr + (rows64 * (N1 // 2 if X_PAIRED else N1))[:, None, None, None] if HAS_RES \
            else out_res1_ptr
        q_rows = q_ptr + (rows64 * (N1 // 2))[:, None, None, None]
        RAW: tl.constexpr = X_PAIRED and not HAS_RES
        if SPLIT > 1:
            # Small M (latency-bound): every program reads the whole rows for the sum of squares
            # (from L2 after the first), and quantizes only its own TS blocks, so that a row's
            # quant runs on SPLIT multiprocessors at once. Its slice and weights are loaded with
            # the rest, before anything waits.
            bs = (pid % SPLIT) * TS
            xas, xbs, ras, rbs = _tile_fetch(x_rows, r_rows, row_ok, bs, TS, N1, SCALE_COLS, HAS_RES,
                                             X_PAIRED, R_PAIRED)
            wes, wos = _tile_weight(w1_ptr, bs, TS, N1, SCALE_COLS, W_PAIRED)
        if FLAT_SUM:
            ss = _row_sumsq(x1_ptr, res1_ptr, rows64, row_ok, x1_stride, res1_stride, N1, NPAIR, HAS_RES,
                            X_PAIRED, R_PAIRED)
        else:
            # The row's blocks in up to three power-of-two tiles (224 = 128 + 64 + 32,
            # 48 = 32 + 16): no lanes wasted on padding to the next power of two.
            xa0, xb0, ra0, rb0 = _tile_fetch(x_rows, r_rows, row_ok, 0, T0, N1, SCALE_COLS, HAS_RES,
                                             X_PAIRED, R_PAIRED)
            if T1 > 0:
                xa1, xb1, ra1, rb1 = _tile_fetch(x_rows, r_rows, row_ok, T0, T1, N1, SCALE_COLS, HAS_RES,
                                                 X_PAIRED, R_PAIRED)
            if T2 > 0:
                xa2, xb2, ra2, rb2 = _tile_fetch(x_rows, r_rows, row_ok, T0 + T1, T2, N1, SCALE_COLS, HAS_RES,
                                                 X_PAIRED, R_PAIRED)
            if X2_MAIN:
                # The x2 rows of the same rows (SPLIT == 1 only): their loads go out with x1's, and a
                # second launch of programs for x2 (a third of the grid at N1 = 1536) is saved.
                x2v, m2 = _x2_fetch(x2_ptr, rows, row_ok, x2_stride, N2, BLOCK_N2)
            # With SPLIT > 1 these sums store nothing (STORE = False): out_res1 is the slice's.
            STORE: tl.constexpr = HAS_RES and SPLIT == 1
            a0, b0, ss = _tile_sum(xa0, xb0, ra0, rb0, o_rows, row_ok, 0, T0, N1, SCALE_COLS, HAS_RES,
                                   X_PAIRED, R_PAIRED, STORE)
            if T1 > 0:
                a1, b1, ss1 = _tile_sum(xa1, xb1, ra1, rb1, o_rows, row_ok, T0, T1, N1, SCALE_COLS, HAS_RES,
                                        X_PAIRED, R_PAIRED, STORE)
                ss += ss1
            if T2 > 0:
                a2, b2, ss2 = _tile_sum(xa2, xb2, ra2, rb2, o_rows, row_ok, T0 + T1, T2, N1, SCALE_COLS,
                                        HAS_RES, X_PAIRED, R_PAIRED, STORE)
                ss += ss2
        ms = tl.math.div_rn(ss, tl.full(ss.shape, N1, tl.float32))
        rstd = tl.math.div_rn(tl.full(ss.shape, 1.0, tl.float32), tl.math.sqrt_rn(ms + eps1))
        if SPLIT > 1:
            a_s, b_s, _ = _tile_sum(xas, xbs, ras, rbs, o_rows, row_ok, bs, TS, N1, SCALE_COLS, HAS_RES,
                                    X_PAIRED, R_PAIRED, HAS_RES)
            _tile_quant(a_s, b_s, rstd, wes, wos, rows, row_ok, q_rows, scale_ptr, bs, TS, N1,
                        SCALE_COLS, SCALE_COLS_PAD, SHUFFLE, PAD, RAW, RZ_ASM)
        else:
            # The weights are loaded only now: fewer registers live while the rows' loads are in
            # flight (occupancy decides the bytes in flight at large M).
            we, wo = _tile_weight(w1_ptr, 0, T0, N1, SCALE_COLS, W_PAIRED)
            _tile_quant(a0, b0, rstd, we, wo, rows, row_ok, q_rows, scale_ptr, 0, T0, N1,
                        SCALE_COLS, SCALE_COLS_PAD, SHUFFLE, PAD, RAW, RZ_ASM)
            if T1 > 0:
                we, wo = _tile_weight(w1_ptr, T0, T1, N1, SCALE_COLS, W_PAIRED)
                _tile_quant(a1, b1, rstd, we, wo, rows, row_ok, q_rows, scale_ptr, T0, T1, N1,
                            SCALE_COLS, SCALE_COLS_PAD, SHUFFLE, PAD, RAW, RZ_ASM)
            if T2 > 0:
                we, wo = _tile_weight(w1_ptr, T0 + T1, T2, N1, SCALE_COLS, W_PAIRED)
                _tile_quant(a2, b2, rstd, we, wo, rows, row_ok, q_rows, scale_ptr, T0 + T1, T2, N1,
                            SCALE_COLS, SCALE_COLS_PAD, SHUFFLE, PAD, RAW, RZ_ASM)
            if X2_MAIN:
                _x2_norm(x2v, m2, rows, w2_ptr, out2_ptr, eps2, N2, BLOCK_N2)
    elif pid < n_main:
        # A block of scale pad rows inside the last partial 32-row band (padded mode only), after
        # the rows the programs above cover.
        rows = (n_split // SPLIT + pid - n_split) * BLOCK_M + tl.arange(0, BLOCK_M)
        blk = tl.arange(0, NB_PAD)
        pad = tl.full((BLOCK_M, NB_PAD), E8M0_PAD, tl.uint8)
        tl.store(scale_ptr + _scale_offsets(rows, blk, SCALE_COLS_PAD, SHUFFLE), pad,
                 mask=(blk < SCALE_COLS_PAD)[None, :])
    elif pid < n_main + n_x2:
        if HAS_X2:
            rows = (pid - n_main) * BLOCK_M2 + tl.arange(0, BLOCK_M2)
            x2v, m2 = _x2_fetch(x2_ptr, rows, rows < M, x2_stride, N2, BLOCK_N2)
            _x2_norm(x2v, m2, rows, w2_ptr, out2_ptr, eps2, N2, BLOCK_N2)
    else:
        # Whole 32-row bands of scale padding: one contiguous byte range in either layout.
        offs = fill_start + (pid - n_main - n_x2) * FILL_BLOCK + tl.arange(0, FILL_BLOCK)
        tl.store(scale_ptr + offs, tl.full((FILL_BLOCK,), E8M0_PAD, tl.uint8), mask=offs < fill_end)


# triton.jit picked interpreter or compiler when the kernel above was defined (at import).
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"


@functools.lru_cache(maxsize=None)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _pow2_floor(n: int) -> int:
    return 1 << (max(int(n), 1).bit_length() - 1)


def _tiles(nblocks: int) -> tuple[int, int, int]:
    """Split ``nblocks`` scale blocks into <= 3 power-of-two tiles: the two largest powers of two
    that fit, then the rest rounded up to a power of two (exact for 224, 48, 16, ...)."""
    t0 = _pow2_floor(nblocks)
    rest = nblocks - t0
    t1 = _pow2_floor(rest) if rest else 0
    rest -= t1
    t2 = triton.next_power_of_2(rest) if rest else 0
    return t0, t1, t2


class Plan(NamedTuple):
    """A launch plan (see :func:`_plan`). Program ids, in order: ``[0, n_split)`` real rows,
    ``BLOCK_M`` rows per ``split`` programs (each quantizing ``ts`` scale blocks when ``split >
    1``); ``[n_split, n_main)`` blocks of scale pad rows up to the 32-row band; ``n_x2`` blocks of
    x2 rows; then the fill programs for whole pad bands ``[fill_start, fill_end)``."""

    grid: tuple
    rows_pad: int
    cols: int
    cols_pad: int
    tiles: tuple
    bm: int
    bm2: int
    nb2: int
    warps: int
    n_split: int
    n_main: int
    n_x2: int
    fill_start: int
    fill_end: int
    split: int
    ts: int
    x2_main: bool
    flat_sum: bool


@functools.lru_cache(maxsize=4096)
def _plan(m: int, n1: int, n2: int, padded: bool, raw: bool, on_gpu: bool, sms: int,
          block_m: int | None, num_warps: int | None, split: int | None = None,
          x2_main: bool | None = None, flat_sum: bool | None = None) -> Plan:
    """Launch plan for one shape: everything the wrapper needs besides pointers (cached: the
    wrapper is the whole cost of a decode-size call, so it must stay a dict lookup). ``raw``:
    x1 is paired bf16 without a residual (kept packed in registers).

    The numbers come from a sweep on an H200 (scripts/bench.py fused-quant --sweep)."""
    cols = -(-n1 // 32)
    cols_pad = -(-cols // 8) * 8 if padded else cols
    tiles = _tiles(cols_pad)
    nb2 = triton.next_power_of_2(max(n2, 1))
    # Split rows (small M): up to 8 slices of >= 16 blocks (7168: 7 x 32, 1536: 3 x 16).
    ts = max(16, triton.next_power_of_2(-(-cols_pad // 8)))
    slices = -(-cols_pad // ts)
    if not on_gpu:
        # Interpreter: cost is per program and per op, not per element: few, large programs.
        bm, bm2, warps, nsplit = 32, 32, 4, 1
        if block_m is not None:
            bm = block_m
    else:
        # ~1k element pairs per program (N1 = 1536 and 7168: one row), fewer rows when M is small
        # so that every SM gets work. At N1 = 1536 one row on one warp keeps the row's sums inside
        # the warp (no shared-memory round trip) and its registers low (28 one-warp programs per
        # SM): 121 us against 165 us for 4 rows on 2 warps at M = 65536 (H200 sweep, 2026-12-03).
        latency_bound = m < 2 * sms
        bm = _pow2_floor(max(1, min(32, 1024 // (cols_pad * 16))))
        bm = min(bm, _pow2_floor(max(1, m // (2 * sms))))
        if block_m is not None:
            bm = block_m
        # Registers decide occupancy, and occupancy the bytes in flight: aim at ~28 float32
        # pairs per thread when x1 + res1 is held as float32, ~48 when bf16 pairs stay packed.
        # No more threads than the smallest tile has 4-pair runs (Triton would replicate it),
        # except when latency-bound (small M), where more threads per row finish sooner.
        target = 48 if raw else 28
        smallest = min(t for t in tiles if t)
        warps = _pow2_floor(max(1, round(bm * cols_pad * 16 / (32 * target))))
        warps = min(warps, _pow2_floor(max(1, bm * smallest // 8)))
        if latency_bound:
            warps = max(warps, 4)
        warps = max(1, min(warps, 16))
        # When the rows alone cannot fill the SMs, each row's quant is split over `slices`
        # programs (the latency of one row's quant on one SM was most of a decode call).
        nsplit = slices if latency_bound and slices > 1 and -(-m // bm) * slices <= 2 * sms else 1
        if nsplit > 1:
            warps = max(1, min(4, bm * ts * 4 // 32))  # the slice's 4-pair runs, one per thread
        if num_warps is not None:
            warps = num_warps
        # x2 rows: ~32 float32 elements per thread with the same warps.
        bm2 = _pow2_floor(max(1, min(32, warps * 32 * 32 // nb2)))
        bm2 = min(bm2, _pow2_floor(max(1, m // (2 * sms))))
    if split is not None:
        nsplit = split
    if bm & (bm - 1) or not 1 <= bm <= 32:
        raise ValueError(f"block_m must be a power of two in [1, 32], got {bm}")
    if nsplit < 1:
        raise ValueError(f"split must be >= 1, got {nsplit}")
    ts = triton.next_power_of_2(-(-cols_pad // nsplit))  # blocks per slice (the whole row when 1)
    # x2 rows ride in the row programs (same rows) unless the rows are split: then a row's x2
    # runs beside its slices on programs of its own, off the decode critical path.
    if x2_main is None:
        x2_main = nsplit == 1
    x2_main = bool(n2) and x2_main
    if x2_main:
        if nsplit != 1:
            raise ValueError("x2_main needs split == 1")
        bm2 = bm
    # Split programs sum the whole rows as one flat tile (one reduction; see _row_sumsq).
    flat_sum = nsplit > 1 if flat_sum is None else bool(flat_sum) and nsplit > 1
    if padded:
        rows_pad = -(-m // 256) * 256
        main_rows = -(-m // 32) * 32  # BLOCK_M divides 32: main programs end on a band boundary
        fill_start, fill_end = main_rows * cols_pad, rows_pad * cols_pad
    else:
        rows_pad = main_rows = m
        fill_start = fill_end = 0
    real_blocks = -(-m // bm)
    n_split = real_blocks * nsplit
    n_main = n_split + max(0, (main_rows - real_blocks * bm) // bm)
    n_x2 = -(-m // bm2) if n2 and not x2_main else 0
    n_fill = -(-(fill_end - fill_start) // _FILL_BLOCK)
    grid = (n_main + n_x2 + n_fill,)
    return Plan(grid, rows_pad, cols, cols_pad, tiles, bm, bm2, nb2, warps, n_split, n_main, n_x2, fill_start,
                fill_end, nsplit, ts, x2_main, flat_sum)


def _paired(t: torch.Tensor) -> bool:
    # The int32 pair view needs bf16 with 4-byte aligned rows (unit last stride is given).
    return t.dtype == torch.bfloat16 and t.data_ptr() % 4 == 0 and (t.dim() == 1 or t.stride(0) % 2 == 0)


def fused_rms_mxfp4_quant_triton(
    x1: torch.Tensor,
    x1_weight: torch.Tensor,
    x1_epsilon: float,
    x2: torch.Tensor | None = None,
    x2_weight: torch.Tensor | None = None,
    x2_epsilon: float = 0.0,
    res1: torch.Tensor | None = None,
    shuffle: bool = False,
    scale_shuffle_padding: bool = False,
    *,
    block_m: int | None = None,
    num_warps: int | None = None,
    split: int | None = None,
    x2_main: bool | None = None,
    flat_sum: bool | None = None,
):
    """Our Triton back end of :func:`layouts.fused_quant.fused_rms_mxfp4_quant` (same contract).

    ``block_m`` / ``num_warps`` / ``split`` (programs per row block) / ``x2_main`` (x2 rows in
    the row programs) / ``flat_sum`` (split programs sum rows as one flat tile) override the
    launch plan (benchmarks and tests only).
    Inputs must have a unit last stride (the public wrapper makes sure of it).
    """
    m, n1 = x1.shape
    n2 = x2.shape[1] if x2 is not None else 0
    padded = bool(shuffle or scale_shuffle_padding)
    dev = x1.device
    if dev.type == "cpu" and not INTERPRETED:
        raise RuntimeError("prep's Triton fused quant needs GPU tensors (or TRITON_INTERPRET=1 set "
                           "before layouts._triton_fused_quant is imported); use backend='torch' on CPU")
    on_gpu = dev.type != "cpu" and not INTERPRETED
    sms = _num_sms(dev.index if dev.index is not None else torch.cuda.current_device()) if on_gpu else 0
    x_paired = _paired(x1)
    plan = _plan(m, n1, n2, padded, x_paired and res1 is None, on_gpu, sms, block_m, num_warps, split,
                 x2_main, flat_sum)
    grid, rows_pad, cols_pad, tiles = plan.grid, plan.rows_pad, plan.cols_pad, plan.tiles

    q = torch.empty((m, n1 // 2), dtype=torch.uint8, device=dev)
    scale = torch.empty((rows_pad, cols_pad), dtype=torch.uint8, device=dev)
    out_res1 = torch.empty((m, n1), dtype=x1.dtype, device=dev) if res1 is not None else None
    out2 = torch.empty((m, n2), dtype=x1.dtype, device=dev) if x2 is not None else None
    if grid[0] == 0:
        return (q, scale), out2, out_res1

    # bf16 operands go to the kernel as int32 views (one element pair per load, with the
    # alignment Triton needs to vectorise); out_res1 is ours, so it is paired exactly when x1 is.
    r_paired, w_paired = res1 is not None and _paired(res1), _paired(x1_weight)
    x1_arg, x1_stride = (x1.view(torch.int32), x1.stride(0) // 2) if x_paired else (x1, x1.stride(0))
    w1_arg = x1_weight.view(torch.int32) if w_paired else x1_weight
    res1_arg, res1_stride = res1, 0
    if res1 is not None:
        res1_arg, res1_stride = (res1.view(torch.int32), res1.stride(0) // 2) if r_paired else (res1, res1.stride(0))
    out_res1_arg = out_res1.view(torch.int32) if out_res1 is not None and x_paired else out_res1
    _fused_rms_mxfp4_kernel[grid](
        x1_arg, w1_arg, res1_arg, out_res1_arg, q, scale,
        x2, x2_weight, out2,
        m, x1_stride, res1_stride, x2.stride(0) if x2 is not None else 0,
        float(x1_epsilon), float(x2_epsilon),
        plan.n_split, plan.n_main, plan.n_x2, plan.fill_start, plan.fill_end,
        N1=n1, N2=n2, SCALE_COLS=plan.cols, SCALE_COLS_PAD=cols_pad, NB_PAD=triton.next_power_of_2(cols_pad),
        T0=tiles[0], T1=tiles[1], T2=tiles[2], SPLIT=plan.split, TS=plan.ts,
        BLOCK_M=plan.bm, BLOCK_M2=plan.bm2, BLOCK_N2=plan.nb2,
        HAS_RES=res1 is not None, HAS_X2=x2 is not None, SHUFFLE=bool(shuffle), PAD=padded,
        X_PAIRED=x_paired, R_PAIRED=r_paired, W_PAIRED=w_paired, RZ_ASM=on_gpu,
        X2_MAIN=plan.x2_main, FLAT_SUM=plan.flat_sum, NPAIR=triton.next_power_of_2(n1 // 2),
        FILL_BLOCK=_FILL_BLOCK,
        num_warps=plan.warps,
    )
    return (q, scale), out2, out_res1
