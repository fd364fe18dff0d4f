"""The bytes alone: the fused MXFP4 kernel's memory traffic at q_a + kv_a, next to no arithmetic, beside the kernel and a copy.

Below M = 16384 the kernel at q_a + kv_a runs far from a copy of its bytes (H100: 8.5-9.1 us at
M = 4096 against 5.2 us, whatever the row layout, docs/BENCHMARKS.md). This tells how much of
that the bytes take in the kernel's own shape (one row a one-warp program: x1's 1536 and x2's 512
bf16 in, 768 code bytes, 48 scale bytes in the S32x8 layout, x2's 512 bf16 out) and how much the
arithmetic adds. Candidates, each a CUDA graph, medians (baseline: the copy):

* ours      -- the fused kernel, the plan's default;
* runs1w    -- the fused kernel, run-major on one warp a row (an H100's fastest at M = 4096);
* bytes     -- the same loads and stores with a sum and a maximum for arithmetic: one row a
               one-warp program, loads coalesced (16 bytes a thread, neighbours' bytes side by
               side: what run-major and block-major tiles load);
* bytes-lanes -- the same, loaded as lane blocks load (a thread holds a block: four 16-byte loads
               64 bytes apart from its neighbours'), two rows a warp;
* bytes-no-scales -- ``bytes`` without the scale stores (one byte a block, scattered);
* copy      -- the same number of bytes read + written, the faster of torch's ``copy_`` and a
               plain Triton copy kernel.

``bytes`` and ``bytes-lanes`` write the same bytes (checked against torch before timing), so
their difference is the load pattern's. The norm weights (L2 hits in the kernel) are not read.
``--only NAME`` runs one candidate a few times and exits, untimed: a target for Nsight Compute
(``ncu --clock-control none -k regex:_bytes python3 scripts/bench.py fused-quant-bytes --only
bytes-lanes --ms 4096``; ``-k regex:_fused_rms`` for ours, or for the fused kernel with any row
layout of ``fused-quant --tile-orders``: ``--only lanes+u``).

Example:
    python scripts/bench.py fused-quant-bytes --ms 1024,4096,16384
    python scripts/bench.py fused-quant-bytes --cpu-smoke
"""

from __future__ import annotations

import argparse
import functools

import torch
import triton
import triton.language as tl

from layouts._triton_fused_quant_tiles import _scale_offsets
from layouts.shuffle import unshuffle_scale

from .common import cuda_timing
from .common.args import add_cpu_smoke, add_ms, require_compiled_triton
from .common.fused_sites import copy_fns, make_inputs
from .common.table import Table
from .fused_quant import TILE_ORDERS

N1, N2 = 1536, 512  # q_a + kv_a
BLOCKS = N1 // 32  # 48 blocks of 16 int32 pairs
SCALE_COLS_PAD = 48  # N1's 48 scale columns, a whole number of S32x8's 8-column groups (the kernel's)
CANDIDATES = ("ours", "runs1w", "bytes", "bytes-lanes", "bytes-no-scales", "copy")


def add_arguments(ap: argparse.ArgumentParser) -> None:
    add_ms(ap, "1024,4096,16384")
    ap.add_argument("--only", choices=[*CANDIDATES[:-1], *TILE_ORDERS], default=None, metavar="NAME",
                    help="run this candidate (or the fused kernel with a row layout of fused-quant's "
                         "--tile-orders) a few times at each --ms and exit, untimed: a target for ncu")
    add_cpu_smoke(ap)


@triton.jit
def _pairs(B0, L: tl.constexpr, LANES: tl.constexpr, R: tl.constexpr):
    """Pair indices of blocks [B0, B0+L): all 16 of each ([1, L, 16], coalesced) or run R's 4
    ([1, L, 4], lane blocks: a block a thread)."""
    blk = B0 + tl.arange(0, L)
    if LANES:
        p = blk[None, :, None] * 16 + R * 4 + tl.arange(0, 4)[None, None, :]
    else:
        p = blk[None, :, None] * 16 + tl.arange(0, 16)[None, None, :]
    return p


@triton.jit
def _block_words(x_rows, B0, L: tl.constexpr, LANES: tl.constexpr):
    """Blocks [B0, B0+L) of rows (int32 pairs): a word a run (its 4 pairs summed, as a run's 8
    codes make a word; [rows, L, 4]) and each block's largest pair ([rows, L]: a maximum across
    the block's lanes when coalesced, in one thread as lane blocks)."""
    if LANES:
        r0, r1 = tl.load(x_rows + _pairs(B0, L, True, 0)), tl.load(x_rows + _pairs(B0, L, True, 1))
        r2, r3 = tl.load(x_rows + _pairs(B0, L, True, 2)), tl.load(x_rows + _pairs(B0, L, True, 3))
        w0, w1, w2, w3 = tl.sum(r0, axis=2), tl.sum(r1, axis=2), tl.sum(r2, axis=2), tl.sum(r3, axis=2)
        words = tl.reshape(tl.join(tl.join(w0, w2), tl.join(w1, w3)), (w0.shape[0], L, 4))
        big = tl.max(tl.maximum(tl.maximum(r0, r1), tl.maximum(r2, r3)), axis=2)
    else:
        v = tl.load(x_rows + _pairs(B0, L, False, 0))
        words = tl.sum(tl.reshape(v, (v.shape[0], L, 4, 4)), axis=3)
        big = tl.max(v, axis=2)
    return words, big


@triton.jit
def _bytes_rows(x1_ptr, x2_ptr, q_ptr, s_ptr, o2_ptr, M, N1: tl.constexpr, N2: tl.constexpr,
                BLOCK_M: tl.constexpr, LANES: tl.constexpr, SCALES: tl.constexpr, SCP: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < M
    r64 = tl.minimum(rows, M - 1).to(tl.int64)  # rows past M read row M - 1, as the kernel does
    x_rows = (x1_ptr + r64 * (N1 // 2))[:, None, None]
    q_rows = (q_ptr + rows.to(tl.int64) * (N1 // 8))[:, None, None]
    for t in tl.static_range(0, N1 // 512):  # three tiles of 16 blocks, as lane blocks' tiles
        blk = t * 16 + tl.arange(0, 16)
        words, big = _block_words(x_rows, t * 16, 16, LANES)
        tl.store(q_rows + blk[None, :, None] * 4 + tl.arange(0, 4)[None, None, :], words,
                 mask=row_ok[:, None, None])
        if SCALES:
            tl.store(s_ptr + _scale_offsets(rows, blk, SCP, True), ((big >> 23) & 0xFF).to(tl.uint8),
                     mask=row_ok[:, None])
    # x2: read and written back in the same layout (its norm's output has x2's shape)
    x2_rows = (x2_ptr + r64 * (N2 // 2))[:, None, None]
    o2_rows = (o2_ptr + rows.to(tl.int64) * (N2 // 2))[:, None, None]
    for r in tl.static_range(0, 4 if LANES else 1):
        p = _pairs(0, N2 // 32, LANES, r)
        tl.store(o2_rows + p, tl.load(x2_rows + p) ^ 0x5555, mask=row_ok[:, None, None])


def bytes_fn(m: int, device: str, lanes: bool, scales: bool = True):
    """The skeleton on fresh inputs: returns (call, its outputs (q, scale, out2), its inputs (x1, x2))."""
    g = torch.Generator(device=device).manual_seed(m)
    x1 = torch.randint(-2**31, 2**31 - 1, (m, N1 // 2), dtype=torch.int32, device=device, generator=g)
    x2 = torch.randint(-2**31, 2**31 - 1, (m, N2 // 2), dtype=torch.int32, device=device, generator=g)
    q = torch.zeros(m, N1 // 8, dtype=torch.int32, device=device)
    s = torch.zeros(-(-m // 256) * 256 * SCALE_COLS_PAD, dtype=torch.uint8, device=device)
    o2 = torch.zeros(m, N2 // 2, dtype=torch.int32, device=device)
    bm = 2 if lanes else 1  # lane blocks: 16 blocks a row on 32 lanes

    def call():
        _bytes_rows[(-(-m // bm),)](x1, x2, q, s, o2, m, N1=N1, N2=N2, BLOCK_M=bm, LANES=lanes, SCALES=scales,
                                    SCP=SCALE_COLS_PAD, num_warps=1)
    return call, (q, s, o2), (x1, x2)


def expected(x1: torch.Tensor, x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What the skeleton writes, in torch: q's words (a run's 4 pairs summed), the scale bytes
    (row-major, 48 columns: the exponent field of the block's largest pair) and out2's words."""
    def words(x, blocks):
        runs = x.view(-1, blocks, 4, 4).to(torch.int64)  # [rows, block, run, pair]
        w = runs.sum(dim=3)
        w = ((w + 2**31) % 2**32 - 2**31).to(torch.int32)  # int32 wrap-around, as the kernel adds
        return w, x.view(-1, blocks, 16).max(dim=2).values
    q, big = words(x1, BLOCKS)
    return q.reshape(len(x1), -1), ((big >> 23) & 0xFF).to(torch.uint8), x2 ^ 0x5555


def check_skeleton(m: int, device: str) -> None:
    """Both load patterns write exactly the torch answer (same bytes, so a difference in time is
    the pattern's)."""
    for lanes in (False, True):
        call, (q, s, o2), (x1, x2) = bytes_fn(m, device, lanes)
        call()
        want_q, want_s, want_o2 = expected(x1.cpu(), x2.cpu())
        scales = unshuffle_scale(s.cpu().view(-1, SCALE_COLS_PAD), m, BLOCKS)  # prep's own S32x8 inverse
        bad = [n for n, a, b in (("q", q.cpu(), want_q), ("scales", scales, want_s),
                                 ("out2", o2.cpu(), want_o2)) if not torch.equal(a, b)]
        if bad:
            raise SystemExit(f"error: the {'lane-block' if lanes else 'coalesced'} skeleton wrote wrong "
                             f"{', '.join(bad)} at M = {m}")


def op_bytes(m: int) -> int:
    return m * (2 * (N1 + N2) + N1 // 2 + N1 // 32 + 2 * N2)


def run(args: argparse.Namespace) -> None:
    require_compiled_triton(args.cpu_smoke)
    from layouts._triton_fused_quant import fused_rms_mxfp4_quant_triton

    device = "cpu" if args.cpu_smoke else "cuda"
    ms = [3, 5] if args.cpu_smoke else args.ms
    table = Table("copy", title="q_a + kv_a: the fused kernel, its bytes alone, and a copy (CUDA-graph medians)")
    for m in ms:
        check_skeleton(m, device)
        x = make_inputs(m, N1, False, N2, 0, device)
        fused = dict(**x, shuffle=True, scale_shuffle_padding=True)
        fns = {"ours": lambda: fused_rms_mxfp4_quant_triton(**fused),
               "runs1w": lambda: fused_rms_mxfp4_quant_triton(**fused, run_tiles=True, run_warps=1),
               "bytes": bytes_fn(m, device, False)[0], "bytes-lanes": bytes_fn(m, device, True)[0],
               "bytes-no-scales": bytes_fn(m, device, False, scales=False)[0],
               **({} if args.only else {f"copy {k}": f for k, f in copy_fns(op_bytes(m), device).items()})}
        if args.only:
            fn = fns.get(args.only) or functools.partial(fused_rms_mxfp4_quant_triton, **fused,
                                                         **TILE_ORDERS[args.only])
            for _ in range(6):
                fn()
            if not args.cpu_smoke:
                torch.cuda.synchronize()
            print(f"ran {args.only} 6 times at M = {m}")
            continue
        times = {name: [] for name in fns}
        for _ in range(3):  # rounds alternate the candidates
            for name, fn in fns.items():
                times[name].append(cuda_timing.time_graph_us(fn, 100, cpu=args.cpu_smoke) * 1e-6)
        copies = [min(a, b) for a, b in zip(*(v for k, v in times.items() if k.startswith("copy ")))]
        for name, values in [*((k, v) for k, v in times.items() if not k.startswith("copy ")), ("copy", copies)]:
            scales_left_out = m * BLOCKS if name == "bytes-no-scales" else 0
            table.add(name, values, case=f"M={m}", nbytes=op_bytes(m) - scales_left_out)
    if not args.only:
        table.print()
