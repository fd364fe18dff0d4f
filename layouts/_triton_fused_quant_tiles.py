"""The device functions of our fused RMSNorm + MXFP4 quant kernel (:mod:`layouts._triton_fused_quant`):
its numerics and its tiles, each a ``@triton.jit`` function the kernel calls.

* element pairs: bf16 pairs as one int32 (:func:`_unpack`), loaded and stored as pairs;
* the MXFP4 numerics: the E2M1 bytes of pairs (:func:`_e2m1_pairs`), the EVEN scale of a block and
  the byte offset of a scale in the row-major or S32x8 buffer (:func:`_scale_offsets`);
* a tile of ``T`` 32-element blocks of ``BLOCK_M`` rows: its loads issued (:func:`_tile_fetch`),
  its sum of squares (:func:`_tile_sum`), its RMSNorm weights (:func:`_tile_weight`), normalised,
  quantized and stored (:func:`_tile_quant`); a whole row's sum as one flat tile
  (:func:`_row_sumsq`); the second RMSNorm's rows (:func:`_x2_fetch`, :func:`_x2_norm`);
* the same for run-major tiles (whole rows, paired operands: :func:`_run_fetch`, :func:`_run_sum`,
  :func:`_run_tile_quant`), whose scale bytes leave without a layout conversion
  (:func:`_store_block_scales`); the rstd of a sum of squares (:func:`_rstd`).

The kernel module imports them by name: a jitted function calls only what is a global of its
own module.

On a GPU the E2M1 encoding and the bf16 pair stores are inline PTX (``PTX``), which the
interpreter cannot run: there, tl operations take the same steps (see the comment above
:data:`E2M1_RUN_PTX`), so the suite checks the arithmetic and a GPU run checks the transcription.
"""

from __future__ import annotations

import triton
import triton.language as tl

E8M0_PAD = tl.constexpr(0x7F)  # layouts.mxfp4.E8M0_ONE (jitted code may only read constexpr globals)


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
def _store_pairs(row_ptr, pair, mask, even, odd, PAIRED: tl.constexpr, PTX: tl.constexpr):
    if PAIRED:  # an int32 view of a bf16 output
        if PTX:  # both rounded to nearest even by one instruction (two conversions and a permute)
            both = tl.inline_asm_elementwise("cvt.rn.bf16x2.f32 $0, $2, $1;", "=r,r,r", [even, odd],
                                             dtype=tl.int32, is_pure=True, pack=1)
        else:
            lo = even.to(tl.bfloat16).to(tl.uint16, bitcast=True).to(tl.int32)
            hi = odd.to(tl.bfloat16).to(tl.uint16, bitcast=True).to(tl.int32)
            both = lo | (hi << 16)
        tl.store(row_ptr + pair, both, mask=mask)
    else:
        ty = row_ptr.dtype.element_ty
        tl.store(row_ptr + 2 * pair, even.to(ty), mask=mask)
        tl.store(row_ptr + 2 * pair + 1, odd.to(ty), mask=mask)


# The E2M1 encoding (nearest, ties away from zero, saturating at 6; inf and NaN too, since min
# returns the number). E2M1 is 0, 0.5, 1 (step 0.5), then one mantissa bit per octave up to 6.
# Every rounding threshold (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5) is a multiple of 2^21 in float32
# bit space. For a = min(|v|, 6) >= 1 the code counts half-octaves: ((bits(a) + 2^21) >> 22) - 252.
# For a < 1, b = 0.5 + a / 2 (rounded toward zero, so no value crosses a threshold) lies in
# [0.5, 1) with the step-0.5 grid of a mapped onto the half-octaves of that octave, and the same
# formula gives 0, 1, 2. max(a, b) picks the right one (b > a exactly when a < 1), so the code is
# (bits(max(a, b)) - 0x3EE00000) >> 22, and that difference has nothing above bit 24: times 64
# (one multiply-add, wrapping: + 0x48000000 is -64 * 0x3EE00000 mod 2^32) leaves the code in bits
# 28-30, and the value's sign goes in bit 31 (a negative that rounds to zero gives code 8).
#
# On a GPU that is one PTX block for a thread's run of four pairs (pack=4: $1-$4 the even
# values, $5-$8 the odd ones, $0 their four bytes as one register): per value min, the
# round-toward-zero FMA, max, the multiply-add and one LOP3 for the sign; then six byte permutes
# gather the eight nibbles (each the top half of byte 3 of its word) and one shift and LOP3 pair
# them. About 6 instructions a value, where shifting each nibble into place took ~9 (SASS of the
# q_a site at M = 4096, Triton 3.6: 1,202 -> 1,087 a lane, `scripts/bench.py fused-quant --sass`;
# 9.23 -> 8.95 us on an H100). Every float32 pattern, in two slots of a run, gives the earlier
# encoding's bytes and those of the interpreter's steps (scripts/bench.py fused-quant
# --e2m1-exhaustive; docs/BENCHMARKS.md).
_E2M1_VALUE_PTX = ("abs.f32 t{j}, ${k}; min.f32 t{j}, t{j}, 0f40C00000; "
                   "fma.rz.f32 h{j}, t{j}, 0f3F000000, 0f3F000000; max.f32 h{j}, t{j}, h{j}; "
                   "mad.lo.u32 h{j}, h{j}, 64, 0x48000000; lop3.b32 h{j}, h{j}, ${k}, 0x80000000, 0xF8; ")


def _e2m1_block_ptx(first: int, tail: str = "") -> str:
    """The PTX block: values in $first..$first+7 (4 even, then 4 odd), the run's 4 bytes in $0."""
    return ("{ .reg .b32 t<8>, h<8>, e0, e1, o0, o1; "
            + "".join(_E2M1_VALUE_PTX.format(j=j, k=j + first) for j in range(8))
            # E gathers the even values' byte 3 (byte k = pair k), O the odd values'; byte k of the
            # result = O's top half | E's top half >> 4.
            + "prmt.b32 e0, h0, h1, 0x0073; prmt.b32 e1, h2, h3, 0x7300; prmt.b32 e0, e0, e1, 0x7610; "
            "prmt.b32 o0, h4, h5, 0x0073; prmt.b32 o1, h6, h7, 0x7300; prmt.b32 o0, o0, o1, 0x7610; "
            "shr.b32 e0, e0, 4; lop3.b32 $0, o0, e0, 0xF0F0F0F0, 0xE4; " + tail + "}")


E2M1_RUN_PTX = tl.constexpr(_e2m1_block_ptx(1))
# The same block for lane blocks: the run's 4 bytes as one int32 ($0; $1-$3 copies that ptxas
# drops), the values in $4-$11.
E2M1_WORD_PTX = tl.constexpr(_e2m1_block_ptx(4, "mov.b32 $1, $0; mov.b32 $2, $0; mov.b32 $3, $0; "))


@triton.jit
def _split4(x):
    """The 4 elements of the last axis (size 4, in one thread) of a 3-d or 4-d tile as 4 tensors,
    in order (no instruction: each is a register of the thread)."""
    if len(x.shape) == 4:
        a, b = tl.split(tl.reshape(x, (x.shape[0], x.shape[1], x.shape[2], 2, 2)))
    else:
        a, b = tl.split(tl.reshape(x, (x.shape[0], x.shape[1], 2, 2)))
    # a: elements 0 and 2, b: 1 and 3
    x0, x2 = tl.split(a)
    x1, x3 = tl.split(b)
    return x0, x1, x2, x3


@triton.jit
def _e2m1_run_words(ve, vo, PTX: tl.constexpr):
    """The FP4 bytes of a thread's run of 4 pairs (the last axis of [BLOCK_M, L, 4] float32) as one
    little-endian int32 per run ([BLOCK_M, L])."""
    if PTX:
        w = tl.inline_asm_elementwise(E2M1_WORD_PTX, "=r,=r,=r,=r,r,r,r,r,r,r,r,r",
                                      [ve.to(tl.int32, bitcast=True), vo.to(tl.int32, bitcast=True)],
                                      dtype=tl.int32, is_pure=True, pack=4)
        w0, _, _, _ = _split4(w)
        return w0
    q = ((_e2m1_word(ve) >> 28) | ((_e2m1_word(vo) >> 24) & 0xF0)).to(tl.int32)
    b0, b1, b2, b3 = _split4(q)
    return b0 | (b1 << 8) | (b2 << 16) | (b3 << 24)


@triton.jit
def _e2m1_word(v):
    """The interpreter's copy of the PTX block's per-value steps: the E2M1 nibble of float32 ``v``
    in bits 28-31 of a uint32 (the bits below it garbage). The interpreter has no rounding modes,
    so the round-toward-zero ``0.5 + a / 2`` is rounded to nearest, then stepped back one ulp
    where that rounded up: ``a / 2`` is exact; where the sum is below 1, ``f - 0.5`` is exact
    (Sterbenz); where it is not, ``a >= 1`` and max takes ``a``."""
    a = tl.minimum(tl.abs(v), 6.0)
    h = a * 0.5
    f = h + 0.5
    f = tl.where(f - 0.5 > h, (f.to(tl.int32, bitcast=True) - 1).to(tl.float32, bitcast=True), f)
    b = tl.maximum(a, f).to(tl.uint32, bitcast=True)
    return (b * 64 + 0x48000000) | (v.to(tl.uint32, bitcast=True) & 0x80000000)


@triton.jit
def _e2m1_pairs(ve, vo, PTX: tl.constexpr):
    """The FP4 bytes (uint8) of the pairs (``ve`` low nibble, ``vo`` high nibble). The PTX block
    takes four pairs of a thread's registers at a time: with the tile's last axis a thread's run
    of 4 pairs, its four bytes leave as one 32-bit store."""
    if PTX:
        return tl.inline_asm_elementwise(E2M1_RUN_PTX, "=r,r,r,r,r,r,r,r,r",
                                         [ve.to(tl.int32, bitcast=True), vo.to(tl.int32, bitcast=True)],
                                         dtype=tl.uint8, is_pure=True, pack=4)
    return ((_e2m1_word(ve) >> 28) | ((_e2m1_word(vo) >> 24) & 0xF0)).to(tl.uint8)


@triton.jit
def _even_scale(amax):
    """(unbiased exponent e, 2^-e as float32) of blocks with absolute maximum ``amax``: the EVEN
    scale rounds amax to a power of two (+0x200000, keep the exponent) and takes that exponent - 2,
    clamped to [-127, 127]. A zero or denormal amax gives -127 (byte 0), inf/NaN 127, as aiter's
    log2 does. 2^-e is exact: its biased exponent 127 - e is 0 only for e = 127 (2^-127 is
    denormal)."""
    rb = ((amax.to(tl.uint32, bitcast=True) + 0x200000) >> 23).to(tl.int32) & 0xFF
    e = tl.where(rb == 255, 127, tl.minimum(tl.maximum(rb - 129, -127), 127))
    ib = 127 - e
    return e, tl.where(ib == 0, 0x00400000, ib << 23).to(tl.float32, bitcast=True)


@triton.jit
def _rstd(ss, N: tl.constexpr, eps):
    """1 / sqrt(ss / N + eps), each step correctly rounded (``div_rn``, ``sqrt_rn``) as in aiter
    and the torch reference."""
    ms = tl.math.div_rn(ss, tl.full(ss.shape, N, tl.float32))
    return tl.math.div_rn(tl.full(ss.shape, 1.0, tl.float32), tl.math.sqrt_rn(ms + eps))


@triton.jit
def _store_block_scales(e, rows, row_ok, blk, scale_ptr, SCALE_COLS: tl.constexpr, SCALE_COLS_PAD: tl.constexpr,
                        SHUFFLE: tl.constexpr, PAD: tl.constexpr, ASM: tl.constexpr):
    """Store the scale bytes ``e + 127`` of blocks ``blk`` of ``rows`` ([BLOCK_M, T]): in padded
    mode rows past M and columns past SCALE_COLS get 0x7F. With ``ASM`` (NVIDIA, run-major tiles)
    one predicated byte store per element in the layout the block reduction left them in: a
    ``tl.store`` converts that layout (each block's scale sits on the 4 lanes of its runs) through
    shared memory first, two barriers a tile when a row spans two warps; the lanes holding the
    same scale store the same byte to the same address."""
    sc = e + 127
    if PAD:
        sc = tl.where(row_ok[:, None] & (blk < SCALE_COLS)[None, :], sc, E8M0_PAD)
        smask = (blk < SCALE_COLS_PAD)[None, :]  # every row of a main program is < pad256(M)
    else:
        smask = row_ok[:, None] & (blk < SCALE_COLS)[None, :]
    ptrs = scale_ptr + _scale_offsets(rows, blk, SCALE_COLS_PAD, SHUFFLE)
    if ASM:
        tl.inline_asm_elementwise("{ .reg .pred p; setp.ne.b32 p, $3, 0; @p st.global.b8 [$1], $2; mov.b32 $0, 0; }",
                                  "=r,l,r,r", [ptrs, sc, smask.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)
    else:
        tl.store(ptrs, sc.to(tl.uint8), mask=smask)


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
              R_PAIRED: tl.constexpr, STORE: tl.constexpr, PTX: tl.constexpr):
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
            _store_pairs(o_rows, pair, row_ok[:, None, None, None] & col_ok, xe, xo, X_PAIRED, PTX)
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
                SHUFFLE: tl.constexpr, PAD: tl.constexpr, RAW: tl.constexpr, PTX: tl.constexpr):
    """Normalise, quantize and store blocks [B0, B0+T): FP4 codes and their scale bytes."""
    blk, pair, col_ok = _pairs(B0, T, N1, SCALE_COLS)
    if RAW:
        xe, xo = _unpack(a)
    else:
        xe, xo = a, b
    r4 = rstd[:, None, None, None]
    ye = xe * r4 * we  # (x * rstd) * w, rounded twice, as aiter and the reference do
    yo = xo * r4 * wo

    amax = tl.max(tl.max(tl.maximum(tl.abs(ye), tl.abs(yo)), axis=3), axis=2)
    e, inv = _even_scale(amax)
    q = _e2m1_pairs(ye * inv[:, :, None, None], yo * inv[:, :, None, None], PTX)
    tl.store(q_rows + pair, q, mask=row_ok[:, None, None, None] & col_ok)
    _store_block_scales(e, rows, row_ok, blk, scale_ptr, SCALE_COLS, SCALE_COLS_PAD, SHUFFLE, PAD, False)


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
    rstd = _rstd(ss, N2, eps2)
    y = x * rstd[:, None] * w[None, :]
    tl.store(out2_ptr + (rows.to(tl.int64) * N2)[:, None] + cols[None, :], y.to(out2_ptr.dtype.element_ty), mask=m2)


# Run-major tiles (``RUN_TILES``: whole rows, every operand paired). The block-major [1, T, 4, 4]
# tiles above take Triton's default layout, which on more than one warp puts a block's runs on
# different warps: every amax and every sum crossed warps (18 barriers a row at q_a on 2 warps, 17
# at the input norm on 4). In [1, 4, T, 4] (a block's run, the block, the pair in the run) the same
# default puts a block's 4 runs on 4 neighbouring lanes and the warps on blocks, with one encoding
# for every tile of at least one layer (FOLD blocks: the lanes / 4), so each tile's sum folds to
# [BLOCK_M, FOLD] inside its threads and the tiles' (and x2's) sums cross warps once, together.


@triton.jit
def _run_pairs(B0, T: tl.constexpr):
    """Blocks [B0, B0+T) and their pair indices [1, 4, T, 4], run-major."""
    blk = B0 + tl.arange(0, T)
    quad = tl.arange(0, 4)
    return blk, blk[None, None, :, None] * 16 + quad[None, :, None, None] * 4 + quad[None, None, None, :]


@triton.jit
def _add2(a0, b0, a1, b1):
    return a0 + a1, b0 + b1


@triton.jit
def _run_fetch(x_rows, r_rows, B0, T: tl.constexpr, HAS_RES: tl.constexpr):
    """Issue the loads of run-major tile [B0, B0+T) of the rows (int32 bf16 pairs) and of res1's
    (rows that exist: see :func:`_run_fetch_rows`)."""
    _, pair = _run_pairs(B0, T)
    xa = tl.load(x_rows + pair)
    ra = xa
    if HAS_RES:
        ra = tl.load(r_rows + pair)
    return xa, ra


@triton.jit
def _run_sum(xa, ra, o_rows, row_ok, B0, T: tl.constexpr, FOLD: tl.constexpr, HAS_RES: tl.constexpr,
             PTX: tl.constexpr):
    """(even, odd) float32 of a fetched run-major tile (x1 + res1, stored to out_res1 on the way)
    and its sum of squares folded to [BLOCK_M, FOLD]: over a block's runs (4 lanes of a warp) and
    over the tile's layers of FOLD blocks (registers of one thread); what is left crosses warps."""
    e, o = _unpack(xa)
    if HAS_RES:
        re, ro = _unpack(ra)
        e = e + re
        o = o + ro
        _, pair = _run_pairs(B0, T)
        _store_pairs(o_rows, pair, row_ok[:, None, None, None], e, o, True, PTX)
    s = tl.sum(_run_sumsq(e, o), axis=1)  # [BLOCK_M, T]
    if T > FOLD:
        s = tl.sum(tl.reshape(s, (s.shape[0], T // FOLD, FOLD)), axis=1)
    return e, o, s


@triton.jit
def _run_sumsq(e, o):
    """Sum of squares of a thread's run (even ``e`` and odd ``o`` of 4 pairs, the last axis) as one
    FMA chain: 8 instructions a run, where squares summed as a tree take 11."""
    e0, e1, e2, e3 = _split4(e)
    o0, o1, o2, o3 = _split4(o)
    return _sq_chain(e0, o0, e1, o1, e2, o2, e3, o3, e0 * e0)


@triton.jit
def _sq_chain(e0, o0, e1, o1, e2, o2, e3, o3, acc):
    """``acc`` + the squares of a run's values but e0's (the first link: ``acc`` holds e0 * e0, or
    a chain to continue, which then takes e0 first)."""
    acc = tl.fma(o0, o0, acc)
    acc = tl.fma(e1, e1, acc)
    acc = tl.fma(o1, o1, acc)
    acc = tl.fma(e2, e2, acc)
    acc = tl.fma(o2, o2, acc)
    acc = tl.fma(e3, e3, acc)
    return tl.fma(o3, o3, acc)


@triton.jit
def _run_weight(w1_ptr, B0, T: tl.constexpr):
    """The RMSNorm weights of run-major tile [B0, B0+T) as loaded (int32 bf16 pairs)."""
    _, pair = _run_pairs(B0, T)
    return tl.load(w1_ptr + pair)


@triton.jit
def _run_tile_quant(xe, xo, rstd, we, wo, rows, row_ok, q_rows, scale_ptr, B0, T: tl.constexpr,
                    SCALE_COLS_PAD: tl.constexpr, SHUFFLE: tl.constexpr, PAD: tl.constexpr, PTX: tl.constexpr):
    """Normalise, quantize and store a run-major tile of blocks [B0, B0+T) (float32 ``xe``, ``xo``;
    ``we``, ``wo`` its float32 weights, :func:`_run_weight` unpacked; whole blocks, no pad
    columns): FP4 codes, scale bytes."""
    blk, pair = _run_pairs(B0, T)
    r4 = rstd[:, None, None, None]
    ye = xe * r4 * we  # (x * rstd) * w, rounded twice, as aiter and the reference do
    yo = xo * r4 * wo
    e, inv = _even_scale(tl.max(tl.max(tl.maximum(tl.abs(ye), tl.abs(yo)), axis=3), axis=1))
    q = _e2m1_pairs(ye * inv[:, None, :, None], yo * inv[:, None, :, None], PTX)
    tl.store(q_rows + pair, q, mask=row_ok[:, None, None, None])
    # whole blocks: SCALE_COLS == SCALE_COLS_PAD
    _store_block_scales(e, rows, row_ok, blk, scale_ptr, SCALE_COLS_PAD, SCALE_COLS_PAD, SHUFFLE, PAD, PTX)


@triton.jit
def _run_fetch_rows(x1_ptr, res1_ptr, x2_ptr, rows, M, x1_stride, res1_stride, x2_stride, T0: tl.constexpr,
                    T1: tl.constexpr, T2: tl.constexpr, N2: tl.constexpr, HAS_RES: tl.constexpr,
                    HAS_X2: tl.constexpr):
    """Issue every load of row block ``rows``: x1's and res1's run-major tiles and x2's (one tile
    of N2 / 32 blocks). Rows >= M read row M - 1 instead (their results are never stored): an
    unmasked load is one instruction, where a masked one also zeroes its registers first (16 of
    ~1,100 instructions a lane at q_a on one warp). The tiles a shape lacks come back as x1's
    first (unused: the callers test the same constexprs)."""
    rows64 = tl.minimum(rows, M - 1).to(tl.int64)
    x_rows = x1_ptr + (rows64 * x1_stride)[:, None, None, None]
    r_rows = res1_ptr + (rows64 * res1_stride)[:, None, None, None] if HAS_RES else res1_ptr
    xa0, ra0 = _run_fetch(x_rows, r_rows, 0, T0, HAS_RES)
    xa1, ra1, xa2, ra2, x2a = xa0, ra0, xa0, ra0, xa0
    if T1 > 0:
        xa1, ra1 = _run_fetch(x_rows, r_rows, T0, T1, HAS_RES)
    if T2 > 0:
        xa2, ra2 = _run_fetch(x_rows, r_rows, T0 + T1, T2, HAS_RES)
    if HAS_X2:
        _, pair2 = _run_pairs(0, N2 // 32)
        x2a = tl.load(x2_ptr + (rows64 * x2_stride)[:, None, None, None] + pair2)
    return xa0, ra0, xa1, ra1, xa2, ra2, x2a


@triton.jit
def _run_rows(xa0, ra0, xa1, ra1, xa2, ra2, x2a, we0, wo0, we1, wo1, we2, wo2, w2e, w2o,
              w1_ptr, w2_ptr, rows, M, out_res1_ptr, q_ptr, scale_ptr, out2_ptr, eps1, eps2,
              N1: tl.constexpr, N2: tl.constexpr, T0: tl.constexpr, T1: tl.constexpr, T2: tl.constexpr,
              FOLD: tl.constexpr, SCALE_COLS_PAD: tl.constexpr, HAS_RES: tl.constexpr, HAS_X2: tl.constexpr,
              SHUFFLE: tl.constexpr, PAD: tl.constexpr, PTX: tl.constexpr, W_LOADED: tl.constexpr):
    """One row block of run-major tiles, fetched by :func:`_run_fetch_rows`: the sums of squares
    folded to [BLOCK_M, FOLD] inside the threads and added, so that x1's and x2's sums cross warps
    once, together; then each tile's quant, and x2's norm. The weights are the float32 ``we*``,
    ``wo*``, ``w2*`` when ``W_LOADED``, else loaded here, after the sum (fewer registers live while
    the rows' loads are in flight)."""
    row_ok = rows < M
    rows64 = rows.to(tl.int64)
    o_rows = out_res1_ptr + (rows64 * (N1 // 2))[:, None, None, None] if HAS_RES else out_res1_ptr
    q_rows = q_ptr + (rows64 * (N1 // 2))[:, None, None, None]
    X2B: tl.constexpr = N2 // 32  # x2's blocks (a multiple of FOLD)
    e0, o0, ss = _run_sum(xa0, ra0, o_rows, row_ok, 0, T0, FOLD, HAS_RES, PTX)
    if T1 > 0:
        e1, o1, ss1 = _run_sum(xa1, ra1, o_rows, row_ok, T0, T1, FOLD, HAS_RES, PTX)
        ss += ss1
    if T2 > 0:
        e2, o2, ss2 = _run_sum(xa2, ra2, o_rows, row_ok, T0 + T1, T2, FOLD, HAS_RES, PTX)
        ss += ss2
    if HAS_X2:
        x2e, x2o, sq2 = _run_sum(x2a, x2a, o_rows, row_ok, 0, X2B, FOLD, False, PTX)
        ss, s2 = tl.reduce((ss, sq2), 1, _add2)
    else:
        ss = tl.sum(ss, axis=1)
    rstd = _rstd(ss, N1, eps1)
    if not W_LOADED:
        we0, wo0 = _unpack(_run_weight(w1_ptr, 0, T0))
    _run_tile_quant(e0, o0, rstd, we0, wo0, rows, row_ok, q_rows, scale_ptr, 0, T0, SCALE_COLS_PAD, SHUFFLE,
                    PAD, PTX)
    if T1 > 0:
        if not W_LOADED:
            we1, wo1 = _unpack(_run_weight(w1_ptr, T0, T1))
        _run_tile_quant(e1, o1, rstd, we1, wo1, rows, row_ok, q_rows, scale_ptr, T0, T1, SCALE_COLS_PAD,
                        SHUFFLE, PAD, PTX)
    if T2 > 0:
        if not W_LOADED:
            we2, wo2 = _unpack(_run_weight(w1_ptr, T0 + T1, T2))
        _run_tile_quant(e2, o2, rstd, we2, wo2, rows, row_ok, q_rows, scale_ptr, T0 + T1, T2, SCALE_COLS_PAD,
                        SHUFFLE, PAD, PTX)
    if HAS_X2:
        r2 = _rstd(s2, N2, eps2)[:, None, None, None]
        if not W_LOADED:
            w2e, w2o = _unpack(_run_weight(w2_ptr, 0, X2B))
        _, pair2 = _run_pairs(0, X2B)
        # (x * rstd) * w rounded to x1's dtype (bf16: out2 is paired like x2)
        _store_pairs(out2_ptr + (rows64 * (N2 // 2))[:, None, None, None], pair2, row_ok[:, None, None, None],
                     x2e * r2 * w2e, x2o * r2 * w2o, True, PTX)


# Lane blocks (``LANE_BLOCKS``: whole rows of a few 16-block tiles, every operand paired). A
# run-major tile puts a block's 4 runs on 4 lanes, so each block's amax crosses lanes (two
# shuffles) and 4 lanes compute and store its scale. Here each run of a tile is loaded as a tensor
# of its own ([BLOCK_M, L, 4]: row, block, the pair in the run), the same encoding for all four,
# with the lanes on (row, block): a block's 32 values are in one thread, its amax, scale and
# scale store happen once, and every tile of a row (x2's too) has the same encoding, so the
# tiles' sums add in registers and cross lanes once, together.


@triton.jit
def _lb_pairs(B0, L: tl.constexpr, R: tl.constexpr):
    """Blocks [B0, B0+L) and the pair indices [1, L, 4] of their run ``R``."""
    blk = B0 + tl.arange(0, L)
    return blk, blk[None, :, None] * 16 + R * 4 + tl.arange(0, 4)[None, None, :]


@triton.jit
def _lb_fetch(rows_ptr, B0, L: tl.constexpr):
    """Issue the loads of the 4 runs of lane-block tile [B0, B0+L) (int32 bf16 pairs)."""
    _, p0 = _lb_pairs(B0, L, 0)
    _, p1 = _lb_pairs(B0, L, 1)
    _, p2 = _lb_pairs(B0, L, 2)
    _, p3 = _lb_pairs(B0, L, 3)
    return tl.load(rows_ptr + p0), tl.load(rows_ptr + p1), tl.load(rows_ptr + p2), tl.load(rows_ptr + p3)


@triton.jit
def _chain4(e, o, acc):
    """``acc`` + the squares of a thread's run (the last axis of a 3-d tile), as one FMA chain."""
    e0, e1, e2, e3 = _split4(e)
    o0, o1, o2, o3 = _split4(o)
    return _sq_chain(e0, o0, e1, o1, e2, o2, e3, o3, tl.fma(e0, e0, acc))


@triton.jit
def _lb_run_sum(xa, ra, o_rows, row_ok, B0, L: tl.constexpr, R: tl.constexpr, acc, HAS_RES: tl.constexpr,
                PTX: tl.constexpr):
    """(even, odd) float32 of run ``R`` of a fetched tile (x1 + res1, stored to out_res1 on the
    way) and ``acc`` + its squares."""
    e, o = _unpack(xa)
    if HAS_RES:
        re, ro = _unpack(ra)
        e = e + re
        o = o + ro
        _, pair = _lb_pairs(B0, L, R)
        _store_pairs(o_rows, pair, row_ok[:, None, None], e, o, True, PTX)
    return e, o, _chain4(e, o, acc)


@triton.jit
def _lb_sum(x0, x1, x2, x3, r0, r1, r2, r3, o_rows, row_ok, B0, L: tl.constexpr, acc, HAS_RES: tl.constexpr,
            PTX: tl.constexpr):
    """A fetched tile's 4 runs as (even, odd) float32 and ``acc`` ([BLOCK_M, L]) + their squares."""
    e0, o0, acc = _lb_run_sum(x0, r0, o_rows, row_ok, B0, L, 0, acc, HAS_RES, PTX)
    e1, o1, acc = _lb_run_sum(x1, r1, o_rows, row_ok, B0, L, 1, acc, HAS_RES, PTX)
    e2, o2, acc = _lb_run_sum(x2, r2, o_rows, row_ok, B0, L, 2, acc, HAS_RES, PTX)
    e3, o3, acc = _lb_run_sum(x3, r3, o_rows, row_ok, B0, L, 3, acc, HAS_RES, PTX)
    return e0, o0, e1, o1, e2, o2, e3, o3, acc


@triton.jit
def _lb_norm(e, o, r3, w_ptr, B0, L: tl.constexpr, R: tl.constexpr):
    """(x * rstd) * w of run ``R`` (rounded twice, as aiter and the reference do). The weights are
    loaded for every row of the tile (L1 hits): a [1, L, 4] load would take a layout of its own,
    and Triton would convert the rows to it."""
    _, pair = _lb_pairs(B0, L, R)
    we, wo = _unpack(tl.load(w_ptr + (pair + tl.zeros((e.shape[0], 1, 1), tl.int32))))
    return e * r3 * we, o * r3 * wo


@triton.jit
def _absmax4(ye, yo, amax):
    """``amax`` ([BLOCK_M, L]) and the absolute values of a run of normalised pairs, the larger."""
    return tl.maximum(amax, tl.max(tl.maximum(tl.abs(ye), tl.abs(yo)), axis=2))


@triton.jit
def _lb_quant(e0, o0, e1, o1, e2, o2, e3, o3, rstd, w_ptr, rows, row_ok, q_rows, scale_ptr, B0, L: tl.constexpr,
              SCALE_COLS_PAD: tl.constexpr, SHUFFLE: tl.constexpr, PAD: tl.constexpr, PTX: tl.constexpr):
    """Normalise, quantize and store lane-block tile [B0, B0+L): FP4 codes, scale bytes (whole
    blocks, no pad columns)."""
    r3 = rstd[:, None, None]
    ye0, yo0 = _lb_norm(e0, o0, r3, w_ptr, B0, L, 0)
    ye1, yo1 = _lb_norm(e1, o1, r3, w_ptr, B0, L, 1)
    ye2, yo2 = _lb_norm(e2, o2, r3, w_ptr, B0, L, 2)
    ye3, yo3 = _lb_norm(e3, o3, r3, w_ptr, B0, L, 3)
    amax = tl.max(tl.maximum(tl.abs(ye0), tl.abs(yo0)), axis=2)
    amax = _absmax4(ye1, yo1, amax)
    amax = _absmax4(ye2, yo2, amax)
    amax = _absmax4(ye3, yo3, amax)
    e, inv = _even_scale(amax)
    inv3 = inv[:, :, None]
    w0 = _e2m1_run_words(ye0 * inv3, yo0 * inv3, PTX)
    w1 = _e2m1_run_words(ye1 * inv3, yo1 * inv3, PTX)
    w2 = _e2m1_run_words(ye2 * inv3, yo2 * inv3, PTX)
    w3 = _e2m1_run_words(ye3 * inv3, yo3 * inv3, PTX)
    # A block's 16 code bytes (runs 0-3) leave as one 16-byte store: q_rows points at int32 words.
    words = tl.reshape(tl.join(tl.join(w0, w2), tl.join(w1, w3)), (w0.shape[0], L, 4))
    blk = B0 + tl.arange(0, L)
    tl.store(q_rows + blk[None, :, None] * 4 + tl.arange(0, 4)[None, None, :], words, mask=row_ok[:, None, None])
    _store_block_scales(e, rows, row_ok, blk, scale_ptr, SCALE_COLS_PAD, SCALE_COLS_PAD, SHUFFLE, PAD, PTX)


@triton.jit
def _lb_x2_store(e, o, r3, w2_ptr, out2_rows, row_ok, L: tl.constexpr, R: tl.constexpr, PTX: tl.constexpr):
    """x2's run ``R``: (x * rstd) * w rounded to bf16 pairs, stored."""
    ye, yo = _lb_norm(e, o, r3, w2_ptr, 0, L, R)
    _, pair = _lb_pairs(0, L, R)
    _store_pairs(out2_rows, pair, row_ok[:, None, None], ye, yo, True, PTX)


@triton.jit
def _lb_unpack_late(a0, a1, a2, a3, PTX: tl.constexpr):
    """A fetched lane-block tile's 4 runs as (even, odd) float32 again, by :func:`_unpack_late`."""
    e0, o0 = _unpack_late(a0, PTX)
    e1, o1 = _unpack_late(a1, PTX)
    e2, o2 = _unpack_late(a2, PTX)
    e3, o3 = _unpack_late(a3, PTX)
    return e0, o0, e1, o1, e2, o2, e3, o3


@triton.jit
def _lb_row_block(x1_ptr, w1_ptr, res1_ptr, out_res1_ptr, q_ptr, scale_ptr, x2_ptr, w2_ptr, out2_ptr, rows, M,
                  x1_stride, res1_stride, x2_stride, eps1, eps2, N1: tl.constexpr, N2: tl.constexpr,
                  SCALE_COLS_PAD: tl.constexpr, T0: tl.constexpr, T1: tl.constexpr, T2: tl.constexpr,
                  BLOCK_M: tl.constexpr, HAS_RES: tl.constexpr, HAS_X2: tl.constexpr, SHUFFLE: tl.constexpr,
                  PAD: tl.constexpr, PTX: tl.constexpr, LB_UNPACK_LATE: tl.constexpr):
    """Row block ``rows`` as 1-3 lane-block tiles of T0 blocks (and x2 as one more): every load
    first, the tiles' sums added in registers and reduced once (x1's and x2's together), then each
    tile's quant and x2's norm."""
    row_ok = rows < M
    rows64 = rows.to(tl.int64)
    ld64 = tl.minimum(rows, M - 1).to(tl.int64)[:, None, None]  # rows >= M read row M - 1
    x_rows = x1_ptr + ld64 * x1_stride
    r_rows = res1_ptr + ld64 * res1_stride if HAS_RES else res1_ptr
    o_rows = out_res1_ptr + (rows64 * (N1 // 2))[:, None, None] if HAS_RES else out_res1_ptr
    q_rows = q_ptr.to(tl.pointer_type(tl.int32), bitcast=True) + (rows64 * (N1 // 8))[:, None, None]
    L: tl.constexpr = T0
    a00, a01, a02, a03 = _lb_fetch(x_rows, 0, L)
    b00, b01, b02, b03 = a00, a01, a02, a03
    if HAS_RES:
        b00, b01, b02, b03 = _lb_fetch(r_rows, 0, L)
    if T1 > 0:
        a10, a11, a12, a13 = _lb_fetch(x_rows, L, L)
        b10, b11, b12, b13 = a10, a11, a12, a13
        if HAS_RES:
            b10, b11, b12, b13 = _lb_fetch(r_rows, L, L)
    if T2 > 0:
        a20, a21, a22, a23 = _lb_fetch(x_rows, 2 * L, L)
        b20, b21, b22, b23 = a20, a21, a22, a23
        if HAS_RES:
            b20, b21, b22, b23 = _lb_fetch(r_rows, 2 * L, L)
    if HAS_X2:
        c0, c1, c2, c3 = _lb_fetch(x2_ptr + ld64 * x2_stride, 0, L)
    acc = tl.zeros((BLOCK_M, L), tl.float32)
    e00, o00, e01, o01, e02, o02, e03, o03, acc = _lb_sum(a00, a01, a02, a03, b00, b01, b02, b03, o_rows,
                                                           row_ok, 0, L, acc, HAS_RES, PTX)
    if T1 > 0:
        e10, o10, e11, o11, e12, o12, e13, o13, acc = _lb_sum(a10, a11, a12, a13, b10, b11, b12, b13, o_rows,
                                                               row_ok, L, L, acc, HAS_RES, PTX)
    if T2 > 0:
        e20, o20, e21, o21, e22, o22, e23, o23, acc = _lb_sum(a20, a21, a22, a23, b20, b21, b22, b23, o_rows,
                                                               row_ok, 2 * L, L, acc, HAS_RES, PTX)
    if HAS_X2:
        z2 = tl.zeros((BLOCK_M, L), tl.float32)
        f0, g0, f1, g1, f2, g2, f3, g3, acc2 = _lb_sum(c0, c1, c2, c3, c0, c1, c2, c3, o_rows, row_ok, 0, L,
                                                       z2, False, PTX)
        ss, s2 = tl.reduce((acc, acc2), 1, _add2)
    else:
        ss = tl.sum(acc, axis=1)
    rstd = _rstd(ss, N1, eps1)
    if LB_UNPACK_LATE and not HAS_RES:
        # The rows unpacked again for the quant, not kept as float32 since the sum: 128
        # registers instead of 167 at q_a on one warp, ~6 % more instructions.
        e00, o00, e01, o01, e02, o02, e03, o03 = _lb_unpack_late(a00, a01, a02, a03, PTX)
        if T1 > 0:
            e10, o10, e11, o11, e12, o12, e13, o13 = _lb_unpack_late(a10, a11, a12, a13, PTX)
        if T2 > 0:
            e20, o20, e21, o21, e22, o22, e23, o23 = _lb_unpack_late(a20, a21, a22, a23, PTX)
    _lb_quant(e00, o00, e01, o01, e02, o02, e03, o03, rstd, w1_ptr, rows, row_ok, q_rows, scale_ptr, 0, L,
              SCALE_COLS_PAD, SHUFFLE, PAD, PTX)
    if T1 > 0:
        _lb_quant(e10, o10, e11, o11, e12, o12, e13, o13, rstd, w1_ptr, rows, row_ok, q_rows, scale_ptr, L, L,
                  SCALE_COLS_PAD, SHUFFLE, PAD, PTX)
    if T2 > 0:
        _lb_quant(e20, o20, e21, o21, e22, o22, e23, o23, rstd, w1_ptr, rows, row_ok, q_rows, scale_ptr, 2 * L,
                  L, SCALE_COLS_PAD, SHUFFLE, PAD, PTX)
    if HAS_X2:
        r3 = _rstd(s2, N2, eps2)[:, None, None]
        out2_rows = out2_ptr + (rows64 * (N2 // 2))[:, None, None]
        _lb_x2_store(f0, g0, r3, w2_ptr, out2_rows, row_ok, L, 0, PTX)
        _lb_x2_store(f1, g1, r3, w2_ptr, out2_rows, row_ok, L, 1, PTX)
        _lb_x2_store(f2, g2, r3, w2_ptr, out2_rows, row_ok, L, 2, PTX)
        _lb_x2_store(f3, g3, r3, w2_ptr, out2_rows, row_ok, L, 3, PTX)


@triton.jit
def _unpack_late(v, PTX: tl.constexpr):
    """_unpack by byte permutes (a different instruction, so the compiler cannot merge it with the
    sum's unpacking and keep the float32 values alive in between)."""
    if PTX:
        return tl.inline_asm_elementwise("prmt.b32 $0, $2, 0, 0x1044; prmt.b32 $1, $2, 0, 0x3244;", "=r,=r,r", [v],
                                         dtype=(tl.float32, tl.float32), is_pure=True, pack=1)
    return _unpack(v)
