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

* programs ``[0, n_split)`` with ``RUN_TILES`` (``run_tiles=True``; whole rows, every operand
  paired bf16: both DeepSeek sites from a few hundred rows; the GPU plan's default on NVIDIA,
  see :func:`_run_tiles_default`): one row each, its blocks in the same <= 3 tiles but
  *run-major* (``[1, 4, T, 4]``: a block's run, the block, the pair in the run), on as many warps
  as the smallest tile's runs fill (q_a + kv_a on 2, the input norm on 4). Triton's layout of that
  shape keeps a block's 4 runs on 4 neighbouring lanes and spreads the warps over blocks, so the
  amax of a block never leaves its warp, and the sums of squares (x1's and x2's, x2 loaded as a
  tile of the same shape) cross warps once, together: 2 barriers a row, where the block-major
  tiles below put a block's runs on different warps (17 at the input norm) and kept q_a on one
  warp for that reason. Persistent (``persist``: N programs a multiprocessor, each looping over
  row blocks pid, pid + n_split, ...): each row block's loads are issued one block before it is
  worked on, in registers, with the weights unpacked once a program; or, with ``stages``, by
  Triton's pipeliner (``cp.async`` into shared memory, ``stages - 1`` blocks ahead), the weights
  held only with ``w_early``. Lane blocks (below) can be persistent the same way.
* programs ``[0, n_split)`` otherwise: ``BLOCK_M`` rows of x1 each, the whole row in registers. The row's
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

The device functions the kernel calls (element pairs, the E2M1 encoding, scale offsets, the tiles'
fetch, sum and quant, the x2 norm) are in :mod:`layouts._triton_fused_quant_tiles`; this module
holds the kernel, its launch plan (:func:`_plan`) and the Python entry.

Measured (scripts/bench.py fused-quant, CUDA graphs, shuffle + padding; docs/BENCHMARKS.md), of
the run's best copy at M = 4096 / 16384 / 65536: on an H100 (2026-12-07) the input norm 0.93 /
0.99 / 1.00 and q_a + kv_a 0.90 / 0.88-0.90 / 1.00; on an H200 (2026-12-07) 0.89 / 0.98 / 1.00 and
0.69 / 0.75 / 0.85, where q_a is bound by its instructions (665 a lane), not by memory. M = 1:
2.0-2.5 us.
"""

from __future__ import annotations

import functools
import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ._triton_fused_quant_tiles import (
    E8M0_PAD,
    _lb_row_block,
    _run_fetch_rows,
    _run_rows,
    _run_weight,
    _row_sumsq,
    _rstd,
    _scale_offsets,
    _tile_fetch,
    _tile_quant,
    _tile_sum,
    _tile_weight,
    _unpack,
    _x2_fetch,
    _x2_norm,
)

_FILL_BLOCK = 4096


@triton.jit
def _fused_rms_mxfp4_kernel(
    x1_ptr, w1_ptr, res1_ptr, out_res1_ptr, q_ptr, scale_ptr,
    x2_ptr, w2_ptr, out2_ptr,
    M, x1_stride, res1_stride, x2_stride,
    eps1, eps2,
    n_split, n_blocks, n_main, n_x2, fill_start, fill_end,
    N1: tl.constexpr, N2: tl.constexpr,
    SCALE_COLS: tl.constexpr, SCALE_COLS_PAD: tl.constexpr, NB_PAD: tl.constexpr,
    T0: tl.constexpr, T1: tl.constexpr, T2: tl.constexpr, SPLIT: tl.constexpr, TS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_M2: tl.constexpr, BLOCK_N2: tl.constexpr,
    HAS_RES: tl.constexpr, HAS_X2: tl.constexpr, SHUFFLE: tl.constexpr, PAD: tl.constexpr,
    X_PAIRED: tl.constexpr, R_PAIRED: tl.constexpr, W_PAIRED: tl.constexpr, PTX: tl.constexpr,
    X2_MAIN: tl.constexpr, FLAT_SUM: tl.constexpr, NPAIR: tl.constexpr, FILL_BLOCK: tl.constexpr,
    RUN_TILES: tl.constexpr, FOLD: tl.constexpr, W_EARLY: tl.constexpr, PERSIST: tl.constexpr,
    LANE_BLOCKS: tl.constexpr, LB_UNPACK_LATE: tl.constexpr, STAGES: tl.constexpr,
):
    pid = tl.program_id(0)
    if LANE_BLOCKS and pid < n_split:
        # BLOCK_M whole rows as lane-block tiles (_lb_row_block). Persistent (PERSIST): row blocks
        # pid, pid + n_split, ... < n_blocks, Triton's pipeliner prefetching STAGES - 1 ahead.
        if PERSIST:
            for blk in tl.range(pid, n_blocks, n_split, num_stages=STAGES if STAGES > 0 else 1):
                _lb_row_block(x1_ptr, w1_ptr, res1_ptr, out_res1_ptr, q_ptr, scale_ptr, x2_ptr, w2_ptr, out2_ptr,
                              blk * BLOCK_M + tl.arange(0, BLOCK_M), M, x1_stride, res1_stride, x2_stride,
                              eps1, eps2, N1, N2, SCALE_COLS_PAD, T0, T1, T2, BLOCK_M, HAS_RES, HAS_X2, SHUFFLE,
                              PAD, PTX, LB_UNPACK_LATE)
        else:
            _lb_row_block(x1_ptr, w1_ptr, res1_ptr, out_res1_ptr, q_ptr, scale_ptr, x2_ptr, w2_ptr, out2_ptr,
                          pid * BLOCK_M + tl.arange(0, BLOCK_M), M, x1_stride, res1_stride, x2_stride,
                          eps1, eps2, N1, N2, SCALE_COLS_PAD, T0, T1, T2, BLOCK_M, HAS_RES, HAS_X2, SHUFFLE, PAD,
                          PTX, LB_UNPACK_LATE)
    elif RUN_TILES and pid < n_split:
        # BLOCK_M whole rows as run-major tiles (T0 + T1 + T2 blocks, each a multiple of FOLD, the
        # blocks one layer of the program's lanes holds) and x2 (when HAS_X2, FOLD blocks wide) as
        # one more: every load first, then the rows' sums, norm and quant (_run_rows). Persistent
        # (PERSIST): each program takes row blocks pid, pid + n_split, ... < n_blocks, the next
        # block's loads issued before this one is worked on (see the two loops below).
        rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
        if not (PERSIST and STAGES > 0):  # the pipelined loop fetches its own blocks
            xa0, ra0, xa1, ra1, xa2, ra2, x2a = _run_fetch_rows(x1_ptr, res1_ptr, x2_ptr, rows, M, x1_stride,
                                                               res1_stride, x2_stride, T0, T1, T2, N2, HAS_RES,
                                                               HAS_X2)
        we0, wo0, we1, wo1, we2, wo2, w2e, w2o = rows, rows, rows, rows, rows, rows, rows, rows  # unused
        if W_EARLY or (PERSIST and STAGES == 0):
            # The weights' loads go out with the rows' (L2 hits, but each load after the norm is
            # one more round trip on the row's critical path); persistent programs hold them
            # (pipelined ones only with W_EARLY: held, the input norm's program takes 168
            # registers a thread, 128 without, sm_90).
            we0, wo0 = _unpack(_run_weight(w1_ptr, 0, T0))
            if T1 > 0:
                we1, wo1 = _unpack(_run_weight(w1_ptr, T0, T1))
            if T2 > 0:
                we2, wo2 = _unpack(_run_weight(w1_ptr, T0 + T1, T2))
            if HAS_X2:
                w2e, w2o = _unpack(_run_weight(w2_ptr, 0, N2 // 32))
        if PERSIST:
            if STAGES > 0:
                # One row block an iteration; Triton's pipeliner prefetches the next STAGES - 1
                # blocks' tiles into shared memory (cp.async), not into registers. The weights are
                # held (W_EARLY) or loaded each block after its sum.
                for blk_j in tl.range(pid, n_blocks, n_split, num_stages=STAGES):
                    rows = blk_j * BLOCK_M + tl.arange(0, BLOCK_M)
                    xc0, rc0, xc1, rc1, xc2, rc2, x2c = _run_fetch_rows(
                        x1_ptr, res1_ptr, x2_ptr, rows, M, x1_stride, res1_stride, x2_stride,
                        T0, T1, T2, N2, HAS_RES, HAS_X2)
                    _run_rows(xc0, rc0, xc1, rc1, xc2, rc2, x2c, we0, wo0, we1, wo1, we2, wo2, w2e, w2o,
                              w1_ptr, w2_ptr, rows, M, out_res1_ptr, q_ptr, scale_ptr, out2_ptr, eps1, eps2,
                              N1, N2, T0, T1, T2, FOLD, SCALE_COLS_PAD, HAS_RES, HAS_X2, SHUFFLE, PAD, PTX,
                              W_EARLY)
            else:
                # Two row blocks an iteration, each fetched one block ahead of its use: block A
                # (carried from the last iteration) is worked on while B's loads are in flight, then
                # A's next while B is. Swapping one carried set of tiles instead cost a move a
                # register (~45 instructions a lane a row at q_a on one warp).
                step = n_split * BLOCK_M
                for blk_i in range(pid, n_blocks, 2 * n_split):
                    rows = blk_i * BLOCK_M + tl.arange(0, BLOCK_M)
                    xb0, rb0, xb1, rb1, xb2, rb2, x2b = _run_fetch_rows(
                        x1_ptr, res1_ptr, x2_ptr, rows + step, M, x1_stride, res1_stride, x2_stride,
                        T0, T1, T2, N2, HAS_RES, HAS_X2)
                    _run_rows(xa0, ra0, xa1, ra1, xa2, ra2, x2a, we0, wo0, we1, wo1, we2, wo2, w2e, w2o,
                              w1_ptr, w2_ptr, rows, M, out_res1_ptr, q_ptr, scale_ptr, out2_ptr, eps1, eps2,
                              N1, N2, T0, T1, T2, FOLD, SCALE_COLS_PAD, HAS_RES, HAS_X2, SHUFFLE, PAD, PTX, True)
                    xa0, ra0, xa1, ra1, xa2, ra2, x2a = _run_fetch_rows(
                        x1_ptr, res1_ptr, x2_ptr, rows + 2 * step, M, x1_stride, res1_stride, x2_stride,
                        T0, T1, T2, N2, HAS_RES, HAS_X2)
                    if blk_i + n_split < n_blocks:
                        _run_rows(xb0, rb0, xb1, rb1, xb2, rb2, x2b, we0, wo0, we1, wo1, we2, wo2, w2e, w2o,
                                  w1_ptr, w2_ptr, rows + step, M, out_res1_ptr, q_ptr, scale_ptr, out2_ptr, eps1,
                                  eps2, N1, N2, T0, T1, T2, FOLD, SCALE_COLS_PAD, HAS_RES, HAS_X2, SHUFFLE, PAD, PTX,
                                  True)
        else:
            _run_rows(xa0, ra0, xa1, ra1, xa2, ra2, x2a, we0, wo0, we1, wo1, we2, wo2, w2e, w2o,
                      w1_ptr, w2_ptr, rows, M, out_res1_ptr, q_ptr, scale_ptr, out2_ptr, eps1, eps2,
                      N1, N2, T0, T1, T2, FOLD, SCALE_COLS_PAD, HAS_RES, HAS_X2, SHUFFLE, PAD, PTX, W_EARLY)
    elif pid < n_split:
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
                                   X_PAIRED, R_PAIRED, STORE, PTX)
            if T1 > 0:
                a1, b1, ss1 = _tile_sum(xa1, xb1, ra1, rb1, o_rows, row_ok, T0, T1, N1, SCALE_COLS, HAS_RES,
                                        X_PAIRED, R_PAIRED, STORE, PTX)
                ss += ss1
            if T2 > 0:
                a2, b2, ss2 = _tile_sum(xa2, xb2, ra2, rb2, o_rows, row_ok, T0 + T1, T2, N1, SCALE_COLS,
                                        HAS_RES, X_PAIRED, R_PAIRED, STORE, PTX)
                ss += ss2
        rstd = _rstd(ss, N1, eps1)
        if SPLIT > 1:
            a_s, b_s, _ = _tile_sum(xas, xbs, ras, rbs, o_rows, row_ok, bs, TS, N1, SCALE_COLS, HAS_RES,
                                    X_PAIRED, R_PAIRED, HAS_RES, PTX)
            _tile_quant(a_s, b_s, rstd, wes, wos, rows, row_ok, q_rows, scale_ptr, bs, TS, N1,
                        SCALE_COLS, SCALE_COLS_PAD, SHUFFLE, PAD, RAW, PTX)
        else:
            # The weights are loaded only now: fewer registers live while the rows' loads are in
            # flight (occupancy decides the bytes in flight at large M).
            we, wo = _tile_weight(w1_ptr, 0, T0, N1, SCALE_COLS, W_PAIRED)
            _tile_quant(a0, b0, rstd, we, wo, rows, row_ok, q_rows, scale_ptr, 0, T0, N1,
                        SCALE_COLS, SCALE_COLS_PAD, SHUFFLE, PAD, RAW, PTX)
            if T1 > 0:
                we, wo = _tile_weight(w1_ptr, T0, T1, N1, SCALE_COLS, W_PAIRED)
                _tile_quant(a1, b1, rstd, we, wo, rows, row_ok, q_rows, scale_ptr, T0, T1, N1,
                            SCALE_COLS, SCALE_COLS_PAD, SHUFFLE, PAD, RAW, PTX)
            if T2 > 0:
                we, wo = _tile_weight(w1_ptr, T0 + T1, T2, N1, SCALE_COLS, W_PAIRED)
                _tile_quant(a2, b2, rstd, we, wo, rows, row_ok, q_rows, scale_ptr, T0 + T1, T2, N1,
                            SCALE_COLS, SCALE_COLS_PAD, SHUFFLE, PAD, RAW, PTX)
            if X2_MAIN:
                _x2_norm(x2v, m2, rows, w2_ptr, out2_ptr, eps2, N2, BLOCK_N2)
    elif pid < n_main:
        # A block of scale pad rows inside the last partial 32-row band (padded mode only), after
        # the rows the programs above cover.
        rows = (n_blocks + pid - n_split) * BLOCK_M + tl.arange(0, BLOCK_M)
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
# Inline PTX (the E2M1 encoding, bf16 pair stores) only where Triton compiles for NVIDIA; a ROCm
# build of torch without aiter runs the same steps as tl operations, as the interpreter does.
_NVIDIA = torch.version.hip is None


def _run_tiles_default(lanes: int) -> bool:
    """Whether the GPU plan takes run-major tiles where they fit and the caller did not say
    (``run_tiles=None``): where a GPU timed them. On the H100 (2026-12-07, docs/BENCHMARKS.md: both
    row layouts forced, in one process) the input norm was 15 / 6 / 2 % faster run-major at M = 256 /
    1024 / 4096, even at 16384 and 0.5-0.8 % slower at 65536; q_a + kv_a 1-2 % slower at 256 (3.46
    against 3.40 us), 0.1-1.4 % faster at 1024 and 4096, even from 16384 (both sites run at the
    copy's rate from 16384). So: on 32-lane warps. No AMD GPU has timed them: block-major there.
    Not yet A/B'd on an H200: there q_a + kv_a ran 3-7 % slower at M = 16384 / 65536 than an earlier
    H200 run's block-major kernel (across runs; the input norm 14-16 % faster)."""
    return lanes == 32


_LANE_TILE = 16  # blocks in a lane-block tile


def _lane_blocks_fit(n1: int, n2: int, cols: int, cols_pad: int, all_paired: bool) -> bool:
    """Whether rows of this shape take lane blocks: paired bf16, whole blocks without pad columns, in
    1-3 tiles, and an x2 (if any) of one tile."""
    return (all_paired and n1 % 32 == 0 and cols == cols_pad and cols % _LANE_TILE == 0
            and cols <= 3 * _LANE_TILE and n2 in (0, 32 * _LANE_TILE))


def _lane_blocks_default(lanes: int) -> bool:
    """Whether the GPU plan takes lane blocks where they fit (rows of q_a's size, not split) and the
    caller did not say. Not yet: no GPU has timed them (docs/BENCHMARKS.md, ninth session: 849
    warp instructions a row at q_a against run-major's 1,282)."""
    return False


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
    run_tiles: bool
    fold: int
    w_early: bool
    n_blocks: int
    persist: bool
    lane_blocks: bool
    unpack_late: bool
    stages: int = 0

    @property
    def x2_paired(self) -> bool:
        """x2, its weights and out2 go to the kernel as int32 pairs, like x1 (run-major tiles and
        lane blocks)."""
        return self.run_tiles or self.lane_blocks


@functools.lru_cache(maxsize=4096)
def _plan(m: int, n1: int, n2: int, padded: bool, raw: bool, on_gpu: bool, sms: int,
          block_m: int | None, num_warps: int | None, split: int | None = None,
          x2_main: bool | None = None, flat_sum: bool | None = None, all_paired: bool = False,
          run_tiles: bool | None = None, lanes: int = 32, run_warps: int | None = None,
          w_early: bool | None = None, persist: int | None = None, lane_blocks: bool | None = None,
          unpack_late: bool | None = None, stages: int | None = None) -> Plan:
    """Launch plan for one shape: everything the wrapper needs besides pointers (cached: the
    wrapper is the whole cost of a decode-size call, so it must stay a dict lookup). ``raw``:
    x1 is paired bf16 without a residual (kept packed in registers); ``all_paired``: every
    operand (x1, res1, x2 and the weights) is paired bf16; ``lanes``: the GPU's warp size.

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
    if lane_blocks is None and on_gpu and nsplit == 1 and run_tiles is None and num_warps is None \
            and block_m is None:
        lane_blocks = _lane_blocks_fit(n1, n2, cols, cols_pad, all_paired) and _lane_blocks_default(lanes)
    if lane_blocks:
        nsplit = 1
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
    # Whole rows, every operand paired bf16, no pad columns: run-major tiles (see
    # _triton_fused_quant_tiles) on as many warps as the smallest tile's runs fill (q_a + kv_a:
    # 32 + 16 blocks on 2 warps, x2 one more 16-block tile; the input norm: 128 + 64 + 32 on 4).
    # The default where they fit: _run_tiles_default (timed on the H100).
    fold = min(t for t in tiles if t) if cols == cols_pad else 0
    if run_warps is not None:
        if run_warps < 1 or run_warps & (run_warps - 1):
            raise ValueError(f"run_warps must be a power of two >= 1, got {run_warps}")
        fold = run_warps * lanes // 4 if cols == cols_pad else 0
    if run_tiles is None and num_warps is not None:
        run_tiles = False  # warps given (a sweep's plan): block-major tiles
    fits = (on_gpu or run_tiles is not None) and all_paired and n1 % 32 == 0 and fold * 4 >= lanes \
        and all(t % fold == 0 for t in tiles) and nsplit == 1 \
        and (n2 in (0, 32 * fold) or (run_warps is not None and n2 % (32 * fold) == 0
                                        and (n2 // 32) & (n2 // 32 - 1) == 0))
    if run_tiles and not fits:
        raise ValueError(f"run_tiles needs whole rows of paired bf16 blocks and an x2 of one tile's width, got "
                         f"N1 = {n1}, N2 = {n2}")
    run_tiles = fits and _run_tiles_default(lanes) and not lane_blocks if run_tiles is None else bool(run_tiles)
    if run_tiles:
        warps, x2_main = fold * 4 // lanes, bool(n2)
        bm = 1 if on_gpu and block_m is None else bm
        bm2 = bm
    else:
        fold = 0
    w_early = run_tiles and bool(w_early)  # not yet timed on a GPU: off unless asked
    if lane_blocks:
        # Lane blocks (see _triton_fused_quant_tiles): 16-block tiles, BLOCK_M rows filling the
        # program's lanes once (q_a + kv_a on one warp: 2 rows, 3 tiles and x2's one).
        lb = _LANE_TILE
        if run_tiles:
            raise ValueError("lane_blocks and run_tiles are two row layouts: pass one")
        if not _lane_blocks_fit(n1, n2, cols, cols_pad, all_paired):
            raise ValueError(f"lane_blocks needs whole rows of paired bf16 in 1-3 tiles of {lb} blocks and an x2 "
                             f"of one, got N1 = {n1}, N2 = {n2}")
        warps = run_warps or 1
        bm = bm2 = warps * lanes // lb
        if bm > 32:  # BLOCK_M divides 32: the row programs end on a 32-row band (see below)
            raise ValueError(f"lane_blocks takes at most {32 * lb // lanes} warps a program, got {warps}")
        tiles = (lb, lb if cols >= 2 * lb else 0, lb if cols >= 3 * lb else 0)
        x2_main = bool(n2)
    if stages is not None and (persist is None or stages < 1):
        raise ValueError(f"stages needs persist and >= 1 stage, got stages={stages}, persist={persist}")
    if persist is not None and (not (run_tiles or lane_blocks) or persist < 1):
        raise ValueError(f"persist needs run-major tiles or lane blocks and >= 1 program per multiprocessor, "
                         f"got {persist}")
    if padded:
        rows_pad = -(-m // 256) * 256
        main_rows = -(-m // 32) * 32  # BLOCK_M divides 32: main programs end on a band boundary
        fill_start, fill_end = main_rows * cols_pad, rows_pad * cols_pad
    else:
        rows_pad = main_rows = m
        fill_start = fill_end = 0
    real_blocks = -(-m // bm)
    n_split = real_blocks * nsplit
    if persist:
        # Persistent row programs: `persist` a multiprocessor (the interpreter: 2 "multiprocessors",
        # so that the suite's programs loop), each looping over row blocks.
        n_split = min(real_blocks, max(sms, 2 if not on_gpu else 1) * persist)
    n_main = n_split + max(0, (main_rows - real_blocks * bm) // bm)
    n_x2 = -(-m // bm2) if n2 and not x2_main else 0
    n_fill = -(-(fill_end - fill_start) // _FILL_BLOCK)
    grid = (n_main + n_x2 + n_fill,)
    return Plan(grid, rows_pad, cols, cols_pad, tiles, bm, bm2, nb2, warps, n_split, n_main, n_x2, fill_start,
                fill_end, nsplit, ts, x2_main, flat_sum, run_tiles, fold, w_early, real_blocks, bool(persist),
                bool(lane_blocks), bool(lane_blocks and unpack_late), stages or 0)


@functools.lru_cache(maxsize=4096)
def _constants(plan: Plan, n1: int, n2: int, has_res: bool, has_x2: bool, shuffle: bool, padded: bool,
               x_paired: bool, r_paired: bool, w_paired: bool, ptx: bool) -> dict:
    """The kernel's constexpr arguments for one launch plan (the launch and :func:`compile_offline`).
    Cached like the plan, the wrapper being most of a decode-size call; callers only unpack or
    copy it."""
    return dict(
        N1=n1, N2=n2, SCALE_COLS=plan.cols, SCALE_COLS_PAD=plan.cols_pad,
        NB_PAD=triton.next_power_of_2(plan.cols_pad), T0=plan.tiles[0], T1=plan.tiles[1], T2=plan.tiles[2],
        SPLIT=plan.split, TS=plan.ts, BLOCK_M=plan.bm, BLOCK_M2=plan.bm2, BLOCK_N2=plan.nb2,
        HAS_RES=has_res, HAS_X2=has_x2, SHUFFLE=shuffle, PAD=padded,
        X_PAIRED=x_paired, R_PAIRED=r_paired, W_PAIRED=w_paired, PTX=ptx,
        X2_MAIN=plan.x2_main, FLAT_SUM=plan.flat_sum, NPAIR=triton.next_power_of_2(n1 // 2),
        FILL_BLOCK=_FILL_BLOCK, RUN_TILES=plan.run_tiles, FOLD=plan.fold, W_EARLY=plan.w_early,
        PERSIST=plan.persist, LANE_BLOCKS=plan.lane_blocks, LB_UNPACK_LATE=plan.unpack_late,
        STAGES=plan.stages,
    )


def compile_offline(target, m: int, n1: int, n2: int = 0, has_res: bool = False, *, sms: int = 132,
                    shuffle: bool = True, padded: bool = True, run_tiles: bool | None = None,
                    run_warps: int | None = None, w_early: bool | None = None, persist: int | None = None,
                    lane_blocks: bool | None = None, unpack_late: bool | None = None, stages: int | None = None):
    """Compile the kernel, without a GPU, for ``target`` (a ``triton.backends.compiler.GPUTarget``:
    ``GPUTarget("cuda", 90, 32)``, ``GPUTarget("hip", "gfx942", 64)``) as a launch of an ``[m,
    n1]`` bf16 call would compile it (paired, 16-byte aligned, residual if ``has_res``, x2 of width
    ``n2``; the GPU launch plan for ``sms`` multiprocessors; Triton's specialisation of integer
    arguments: 1 is a constant, multiples of 16 are marked so). Inline PTX exactly where the target
    is NVIDIA's, as at run time. Returns Triton's compiled kernel (``.asm["sass" / "ptx" /
    "amdgcn" / "cubin" ...]``): the suite checks that both targets compile; the SASS counts in
    docs/BENCHMARKS.md come from it (``scripts/bench.py fused-quant --sass``). ``run_tiles`` as in
    the plan (``True``: run-major tiles, ``False``: block-major)."""
    from ._triton_offline import compile_like_launch

    plan = _plan(m, n1, n2, padded, not has_res, True, sms, None, None, all_paired=True, run_tiles=run_tiles,
                 lanes=target.warp_size, run_warps=run_warps, w_early=w_early, persist=persist,
                 lane_blocks=lane_blocks, unpack_late=unpack_late, stages=stages)
    consts = _constants(plan, n1, n2, has_res, bool(n2), shuffle, padded, True, has_res, True,
                        target.backend == "cuda")
    x2_ty = "*i32" if plan.x2_paired else "*bf16"
    # The launch's arguments as the wrapper passes them: bf16 as int32 pairs, absent tensors None.
    args = {"x1_ptr": "*i32", "w1_ptr": "*i32", "res1_ptr": "*i32" if has_res else None,
            "out_res1_ptr": "*i32" if has_res else None, "q_ptr": "*u8", "scale_ptr": "*u8",
            "x2_ptr": x2_ty if n2 else None, "w2_ptr": x2_ty if n2 else None, "out2_ptr": x2_ty if n2 else None,
            "M": m, "x1_stride": n1 // 2, "res1_stride": n1 // 2 if has_res else 0,
            "x2_stride": n2 // 2 if plan.x2_paired else n2, "eps1": 1e-6, "eps2": 1e-6,
            "n_split": plan.n_split, "n_blocks": plan.n_blocks, "n_main": plan.n_main, "n_x2": plan.n_x2,
            "fill_start": plan.fill_start, "fill_end": plan.fill_end}
    return compile_like_launch(_fused_rms_mxfp4_kernel, target, args, consts, plan.warps)


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
    run_tiles: bool | None = None,
    run_warps: int | None = None,
    w_early: bool | None = None,
    persist: int | None = None,
    lane_blocks: bool | None = None,
    unpack_late: bool | None = None,
    stages: int | None = None,
):
    """Our Triton back end of :func:`layouts.fused_quant.fused_rms_mxfp4_quant` (same contract).

    ``block_m`` / ``num_warps`` / ``split`` (programs per row block) / ``x2_main`` (x2 rows in
    the row programs) / ``flat_sum`` (split programs sum rows as one flat tile) / ``run_tiles`` (whole rows as
    run-major tiles) / ``run_warps`` (warps a row of run-major tiles takes: fewer hold more of the
    row per thread) / ``w_early`` (run-major: the norm weights loaded with the rows, not after the
    sum; held across row blocks by pipelined persistent programs) / ``persist`` (run-major or lane
    blocks: that many row programs a multiprocessor, each looping over row blocks, the next block
    prefetched; ``stages``: one row block an iteration, Triton's pipeliner prefetching ``stages -
    1`` blocks into shared memory) /
    ``lane_blocks`` (each block's 32 values in one thread: q_a-sized rows; ``unpack_late``: without
    a residual, the rows unpacked again for the quant) override the launch plan (benchmarks and
    tests only).
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
    r_paired, w_paired = res1 is not None and _paired(res1), _paired(x1_weight)
    all_paired = (x_paired and w_paired and (res1 is None or r_paired)
                  and (x2 is None or (_paired(x2) and _paired(x2_weight))))
    plan = _plan(m, n1, n2, padded, x_paired and res1 is None, on_gpu, sms, block_m, num_warps, split,
                 x2_main, flat_sum, all_paired, run_tiles, 32 if _NVIDIA else 64, run_warps, w_early, persist,
                 lane_blocks, unpack_late, stages)
    grid, rows_pad, cols_pad = plan.grid, plan.rows_pad, plan.cols_pad

    q = torch.empty((m, n1 // 2), dtype=torch.uint8, device=dev)
    scale = torch.empty((rows_pad, cols_pad), dtype=torch.uint8, device=dev)
    out_res1 = torch.empty((m, n1), dtype=x1.dtype, device=dev) if res1 is not None else None
    out2 = torch.empty((m, n2), dtype=x1.dtype, device=dev) if x2 is not None else None
    if grid[0] == 0:
        return (q, scale), out2, out_res1

    # bf16 operands go to the kernel as int32 views (one element pair per load, with the
    # alignment Triton needs to vectorise); out_res1 is ours, so it is paired exactly when x1 is.
    x1_arg, x1_stride = (x1.view(torch.int32), x1.stride(0) // 2) if x_paired else (x1, x1.stride(0))
    w1_arg = x1_weight.view(torch.int32) if w_paired else x1_weight
    res1_arg, res1_stride = res1, 0
    if res1 is not None:
        res1_arg, res1_stride = (res1.view(torch.int32), res1.stride(0) // 2) if r_paired else (res1, res1.stride(0))
    out_res1_arg = out_res1.view(torch.int32) if out_res1 is not None and x_paired else out_res1
    x2_arg, w2_arg, out2_arg, x2_stride = x2, x2_weight, out2, x2.stride(0) if x2 is not None else 0
    if plan.x2_paired and x2 is not None:
        x2_arg, w2_arg, out2_arg = x2.view(torch.int32), x2_weight.view(torch.int32), out2.view(torch.int32)
        x2_stride //= 2
    _fused_rms_mxfp4_kernel[grid](
        x1_arg, w1_arg, res1_arg, out_res1_arg, q, scale,
        x2_arg, w2_arg, out2_arg,
        m, x1_stride, res1_stride, x2_stride,
        float(x1_epsilon), float(x2_epsilon),
        plan.n_split, plan.n_blocks, plan.n_main, plan.n_x2, plan.fill_start, plan.fill_end,
        **_constants(plan, n1, n2, res1 is not None, x2 is not None, bool(shuffle), padded, x_paired, r_paired,
                     w_paired, on_gpu and _NVIDIA),
        num_warps=plan.warps,
    )
    return (q, scale), out2, out_res1
