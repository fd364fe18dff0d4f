"""The fused (residual add +) RMSNorm + MXFP4 activation quant (``layouts.fused_quant``).

What is pinned here, on the CPU (our Triton kernel and aiter's run under TRITON_INTERPRET=1):

* our Triton kernel against our torch reference over M x N1 x {x2, res1} x {shuffle, padding};
* the reference against aiter's own ``fused_rms_mxfp4_quant`` (its wrapper and kernel);
* the reference's quant against ``layouts.mxfp4.quantize(rmsnorm(x), AITER_TRITON)`` and its
  shuffled scale against ``layouts.shuffle.preshuffle_scale``;
* both DeepSeek call sites, with the flags ``select_activation_quant`` gives each GEMM path;
* back-end selection.

Exactness and the one bound: scale bytes must be equal (pad bytes too, where both sides define
them; aiter leaves its pad uninitialised, so comparisons with aiter mask the pad). FP4 codes may
differ where the float32 sum of squares is accumulated in another order: rstd moves by an ulp
and an element right on a rounding boundary changes code (facts page, section 8: seen once in
272,896; on an H200, 78 of 1.4e9 codes at M = 65536). We allow at most ``2 + n // 100_000``
differing codes out of n, each exactly one grid step with the same sign. (The same ulp can in
principle move a block's amax across the EVEN rounding point and change its scale byte; that is
rarer still: none in these fixed-seed cases, none in 4.4e7 blocks on the GPU, and the GPU bench
allows ``2 + blocks // 10_000_000`` such bytes.) bf16 outputs may differ by one bf16 step: out2
because rstd may move by an ulp, out_res1 only because the Triton interpreter truncates fp32 ->
bf16 casts (compiled kernels round to nearest even; the GPU bench checks out_res1 exactly).
"""

from __future__ import annotations

import itertools
import logging
import sys

import pytest
import torch

import layouts
from layouts import fused_quant as FQ
from layouts.mxfp4 import AITER_TRITON, unpack_fp4
from layouts.selection import select_activation_quant
from layouts.shuffle import preshuffle_scale, unshuffle_scale
from layouts.engines import get_engine

ATOM = get_engine("atom")  # the engine whose profile these tests use

EPS = 1e-6
N2_KV = 512  # DeepSeek kv_lora_rank: the kv_a_layernorm width


# ---------------------------------------------------------------------------------- helpers
def make_inputs(m: int, n1: int, *, x2: bool = False, res: bool = False, seed: int = 0,
                dtype: torch.dtype = torch.bfloat16, n2: int = N2_KV):
    """Activation-like data: per-row magnitudes over several octaves, a few outlier channels
    (DeepSeek's hidden states have them), weights around 1 with some negative entries."""
    g = torch.Generator().manual_seed(seed)

    def act(rows: int, cols: int) -> torch.Tensor:
        row_scale = torch.exp(torch.randn(rows, 1, generator=g) * 1.5)
        x = torch.randn(rows, cols, generator=g) * row_scale
        outliers = torch.randint(0, cols, (max(1, cols // 512),), generator=g)
        x[:, outliers] *= 20
        return x.to(dtype)

    def weight(cols: int) -> torch.Tensor:
        return (1 + 0.4 * torch.randn(cols, generator=g)).to(dtype)

    args = dict(x1=act(m, n1), x1_weight=weight(n1), x1_epsilon=EPS)
    if x2:
        args.update(x2=act(m, n2), x2_weight=weight(n2), x2_epsilon=EPS)
    if res:
        args.update(res1=act(m, n1))
    return args


def max_code_diffs(n: int) -> int:
    """The bound on FP4 codes that may differ from float32 summation order (module docstring)."""
    return 2 + n // 100_000


def assert_codes_close(q: torch.Tensor, want: torch.Tensor, what: str = "q") -> None:
    assert q.dtype == torch.uint8 and q.shape == want.shape, (what, q.dtype, q.shape, want.shape)
    if torch.equal(q, want):
        return
    a, b = unpack_fp4(q).to(torch.int16), unpack_fp4(want).to(torch.int16)
    diff = a != b
    n = int(diff.sum())
    assert n <= max_code_diffs(a.numel()), f"{what}: {n} of {a.numel()} FP4 codes differ"
    if n:
        da, db = a[diff], b[diff]
        assert torch.equal(da & 8, db & 8), f"{what}: a differing code changed sign"
        assert bool(((da & 7) - (db & 7)).abs().eq(1).all()), f"{what}: a code differs by more than one step"


def bf16_steps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Distance in units in the last place between two bf16/fp16 tensors of the same sign pattern."""
    ia, ib = a.view(torch.int16).to(torch.int32), b.view(torch.int16).to(torch.int32)
    # Map the sign-magnitude bit patterns onto a monotone integer line (+0 and -0 both to 0).
    ia = torch.where(ia < 0, -(ia & 0x7FFF), ia)
    ib = torch.where(ib < 0, -(ib & 0x7FFF), ib)
    return (ia - ib).abs()


def assert_one_step(got: torch.Tensor | None, want: torch.Tensor | None, what: str) -> None:
    if want is None:
        assert got is None, what
        return
    assert got.dtype == want.dtype and got.shape == want.shape, (what, got.dtype, got.shape, want.shape)
    if torch.equal(got, want):
        return
    if got.dtype == torch.float32:
        assert torch.allclose(got, want, rtol=2 ** -20, atol=0), what  # rstd may move by an ulp
        return
    assert got.numel() == 0 or int(bf16_steps(got, want).max()) <= 1, f"{what}: more than one step apart"


def assert_res_close(got: torch.Tensor | None, want: torch.Tensor | None, args: dict) -> None:
    """out_res1 equal to the rounded-to-nearest-even sum, or (interpreted Triton: its fp32 ->
    bf16 cast truncates) to the truncated sum; nothing else."""
    assert_one_step(got, want, "out_res1")
    if want is None or got.dtype != torch.bfloat16:
        if want is not None:
            assert torch.equal(got, want), "out_res1"
        return
    total = args["x1"].float() + args["res1"].float()
    truncated = (total.view(torch.int32) & -0x10000).view(torch.float32).to(torch.bfloat16)
    ok = (got.view(torch.int16) == want.view(torch.int16)) | (got.view(torch.int16) == truncated.view(torch.int16))
    assert bool(ok.all()), "out_res1 is neither the rounded nor the truncated float32 sum"


def assert_matches_reference(out, want, args: dict, *, scale_pad: bool = True) -> None:
    """``out`` and ``want`` are fused-op results; scale bytes exact (pad too unless told)."""
    (q, s), out2, res = out
    (wq, ws), wout2, wres = want
    assert s.dtype == torch.uint8 and s.shape == ws.shape, (s.dtype, s.shape, ws.shape)
    if scale_pad:
        assert torch.equal(s, ws), "scale bytes differ"
    assert_codes_close(q, wq)
    assert_one_step(out2, wout2, "out2")
    assert_res_close(res, wres, args)


def valid_scale(s: torch.Tensor, m: int, n1: int, shuffle: bool) -> torch.Tensor:
    """The row-major ``[m, ceil(n1/32)]`` scale inside any fused-op scale buffer (pad dropped)."""
    cols = -(-n1 // 32)
    if shuffle:
        return unshuffle_scale(s, m, cols)
    return s[:m, :cols]


def run(args: dict, shuffle: bool, padding: bool, backend: str):
    return FQ.fused_rms_mxfp4_quant(**args, shuffle=shuffle, scale_shuffle_padding=padding, backend=backend)


def reference(args: dict, shuffle: bool, padding: bool):
    return FQ.fused_rms_mxfp4_quant_reference(**args, shuffle=shuffle, scale_shuffle_padding=padding)


FLAGS = [(False, False), (False, True), (True, False), (True, True)]
FLAG_IDS = ["plain", "padded", "shuffle", "shuffle+padded"]
EXTRAS = [(False, False), (True, False), (False, True), (True, True)]
EXTRA_IDS = ["x1", "x1+x2", "x1+res", "x1+x2+res"]


# -------------------------------------------------------- our Triton kernel vs torch reference
# Rows (M: one, around a 32-row tile, several tiles), widths (N: q_a/kv_a norms and the hidden
# size), inputs (x2, residual) and output flags (shuffle, padding): every pair of values of any
# two of these factors in one case at least (20 cases, each interpreted; the full product was 240
# and a quarter of the suite's time). Pinned by test_kernel_cases_cover_every_pair_of_factor_values.
KERNEL_MS, KERNEL_NS = [1, 31, 32, 33, 300], [512, 1536, 7168]
KERNEL_CASES = [(m, KERNEL_NS[(i + 2 * j) % 3], j, (i + j) % 4) for i, m in enumerate(KERNEL_MS) for j in range(4)]


def test_kernel_cases_cover_every_pair_of_factor_values():
    levels = [KERNEL_MS, KERNEL_NS, range(len(EXTRAS)), range(len(FLAGS))]
    for a, b in itertools.combinations(range(4), 2):
        assert {(c[a], c[b]) for c in KERNEL_CASES} == set(itertools.product(levels[a], levels[b])), (a, b)


@pytest.mark.parametrize("m, n1, extras, flags", KERNEL_CASES,
                         ids=[f"{m}-{n}-{EXTRA_IDS[e]}-{FLAG_IDS[f]}" for m, n, e, f in KERNEL_CASES])
def test_triton_kernel_matches_torch_reference(m, n1, extras, flags):
    (with_x2, with_res), (shuffle, padding) = EXTRAS[extras], FLAGS[flags]
    args = make_inputs(m, n1, x2=with_x2, res=with_res, seed=m * 7 + n1)
    out = run(args, shuffle, padding, "triton")
    want = reference(args, shuffle, padding)
    assert out[0][1].shape == FQ.fused_scale_shape(m, n1, shuffle, padding)
    assert_matches_reference(out, want, args)


@pytest.mark.parametrize("x2_main", [True, False], ids=["x2-in-row-programs", "x2-own-programs"])
@pytest.mark.parametrize("block_m", [1, 8])
def test_triton_kernel_result_does_not_depend_on_rows_per_program(block_m, x2_main):
    # The launch plan picks BLOCK_M per shape (1 on the GPU for small M, 32 in the interpreter),
    # and whether x2 rows ride in the row programs; every choice must write the same bytes, pad
    # programs included.
    from layouts._triton_fused_quant import fused_rms_mxfp4_quant_triton

    args = make_inputs(45, 1536, x2=True, res=True, seed=3)
    want = reference(args, True, True)
    out = fused_rms_mxfp4_quant_triton(**args, shuffle=True, scale_shuffle_padding=True, block_m=block_m,
                                       x2_main=x2_main)
    assert_matches_reference(out, want, args)


@pytest.mark.parametrize("padding", [False, True], ids=["plain", "padded"])
@pytest.mark.parametrize("n1", [96, 480, 1000, 2016])
def test_triton_kernel_covers_rows_of_any_block_count(n1, padding):
    # The kernel splits a row's blocks into <= 3 power-of-two tiles: 3 blocks = 2 + 1,
    # 15 = 8 + 4 + (3 rounded up to 4), 2016 = 63 blocks = 32 + 16 + (15 -> 16), and 1000 ends
    # in a partial block (31.25 blocks).
    from layouts._triton_fused_quant import _tiles

    cols = -(-n1 // 32)
    cols_pad = -(-cols // 8) * 8 if padding else cols
    t = _tiles(cols_pad)
    assert sum(t) >= cols_pad and all(v & (v - 1) == 0 for v in t)
    args = make_inputs(33, n1, res=True, seed=n1)
    for shuffle in ((False, True) if padding else (False,)):
        assert_matches_reference(run(args, shuffle, padding, "triton"), reference(args, shuffle, padding), args)


@pytest.mark.parametrize("n1,n2,raw", [(7168, 0, False), (1536, 512, True), (512, 512, False), (80, 0, True)])
def test_gpu_launch_plan_covers_every_row_and_scale_byte(n1, n2, raw):
    # The GPU plan (not run here: the interpreter uses its own) for a 132-SM device: row programs
    # cover every row, their slices every scale column, pad-row programs the rest up to the 32-row
    # band, fill programs exactly the rest of the padded scale; launch sizes are powers of two.
    from layouts._triton_fused_quant import _plan

    for m, padded, others, rt in itertools.product((1, 16, 31, 33, 256, 300, 4096, 65536), (False, True),
                                                   (False, True), (None, True)):
        try:
            p = _plan(m, n1, n2, padded, raw, True, 132, None, None, all_paired=others, run_tiles=rt)
        except ValueError:  # run-major tiles asked where they do not fit (pinned below)
            assert rt
            continue
        assert (p.rows_pad, p.cols_pad) == FQ.fused_scale_shape(m, n1, padded, padded)
        main_rows = -(-m // 32) * 32 if padded else m
        real = -(-m // p.bm)
        assert p.n_split == real * p.split and p.split * p.ts >= p.cols_pad and (p.split - 1) * p.ts < p.cols_pad
        assert real * p.bm + (p.n_main - p.n_split) * p.bm == max(main_rows, real * p.bm) and 32 % p.bm == 0
        fill = (main_rows * p.cols_pad, p.rows_pad * p.cols_pad) if padded else (0, 0)
        assert (p.fill_start, p.fill_end) == fill
        assert p.grid[0] == p.n_main + p.n_x2 + -(-(p.fill_end - p.fill_start) // 4096)
        # x2 rows: in the row programs (whole rows only) or in programs of their own.
        x2_rows = real * p.bm if p.x2_main else p.n_x2 * p.bm2
        assert x2_rows >= (m if n2 else 0) and p.nb2 >= n2 and (p.split == 1 or not p.x2_main)
        assert p.x2_main == bool(n2 and p.split == 1) and (p.n_x2 == 0 or not p.x2_main)
        assert sum(p.tiles) >= p.cols_pad and all(t & (t - 1) == 0 for t in p.tiles) and p.ts & (p.ts - 1) == 0
        assert p.warps & (p.warps - 1) == 0 and 1 <= p.warps <= 16 and p.bm2 & (p.bm2 - 1) == 0
        # Run-major tiles: multiples of one layer of the lanes covering the row exactly, one row a program.
        assert not p.run_tiles or (sum(p.tiles) == p.cols_pad and all(t % p.fold == 0 for t in p.tiles)
                                   and p.fold * 4 == 32 * p.warps and p.bm == 1 and others)
    # Decode sizes split each row's quant over several programs (small rows stay whole); split
    # programs sum their rows as one flat tile.
    assert _plan(1, 7168, 0, True, False, True, 132, None, None).flat_sum
    assert not _plan(65536, 7168, 0, True, False, True, 132, None, None).flat_sum
    assert _plan(1, 7168, 0, True, False, True, 132, None, None).split == 7
    assert _plan(1, 1536, 512, True, True, True, 132, None, None).split == 3
    assert _plan(65536, 7168, 0, True, False, True, 132, None, None).split == 1
    # Run-major tiles where every operand is paired bf16 and the rows are whole: q_a + kv_a on 2
    # warps (on 1 where a warp has 64 lanes), the input norm on 4; refused elsewhere; the GPU plan
    # takes them by default where they were timed: on 32-lane warps.
    qa = _plan(4096, 1536, 512, True, True, True, 132, None, None, all_paired=True, run_tiles=True)
    assert (qa.run_tiles, qa.tiles, qa.fold, qa.warps, qa.bm, qa.x2_main, qa.n_x2) == (True, (32, 16, 0), 16, 2, 1,
                                                                                    True, 0)
    assert _plan(4096, 1536, 512, True, True, True, 132, None, None, all_paired=True, run_tiles=True,
                 lanes=64).warps == 1
    inp = _plan(4096, 7168, 0, True, False, True, 132, None, None, all_paired=True, run_tiles=True)
    assert (inp.run_tiles, inp.tiles, inp.fold, inp.warps) == (True, (128, 64, 32), 32, 4)
    for m, n1, n2, paired in ((4096, 1536, 512, False), (1, 1536, 512, True), (4096, 1536, 500, True),
                              (4096, 1000, 0, True)):
        with pytest.raises(ValueError, match="run_tiles needs"):
            _plan(m, n1, n2, True, True, True, 132, None, None, all_paired=paired, run_tiles=True)
    assert _plan(4096, 1536, 512, True, True, True, 132, None, None, all_paired=True).run_tiles
    assert not _plan(4096, 1536, 512, True, True, True, 132, None, None, all_paired=True, lanes=64).run_tiles
    assert _plan(4096, 7168, 0, True, False, True, 132, None, None, all_paired=True).run_tiles
    assert not _plan(4096, 7168, 0, True, False, True, 132, None, None, all_paired=True, lanes=64).run_tiles
    assert not _plan(4096, 1536, 512, True, True, True, 132, None, None, all_paired=False).run_tiles
    assert not _plan(4096, 1536, 512, True, True, True, 132, None, 1, all_paired=True).run_tiles  # a sweep's warps


# Each shape with the split programs' sums as one flat tile (the plan at decode sizes) and tile by
# tile, but the interpreter's costliest (33 rows of 1000) with the plan's flat sums only.
@pytest.mark.parametrize("m,n1,with_x2,with_res,split,flat_sum", [
    (m, n1, x2, res, split, flat) for (m, n1, x2, res, split) in
    [(1, 7168, False, True, 7), (3, 1536, True, False, 3), (33, 1000, True, True, 2), (2, 512, False, True, 4)]
    for flat in (True, False) if flat or m != 33])
def test_triton_kernel_result_does_not_depend_on_row_split(m, n1, with_x2, with_res, split, flat_sum):
    # Decode sizes on a GPU split each row over `split` programs, each quantizing a slice of the
    # row's blocks after summing the whole row; the bytes must be those of the unsplit kernel,
    # pad rows, pad columns and out_res1 included (1000: a partial last block; 512 in 4 slices
    # of 16 blocks: the last slice wholly past the 16 real columns, only padding).
    from layouts._triton_fused_quant import fused_rms_mxfp4_quant_triton

    args = make_inputs(m, n1, x2=with_x2, res=with_res, seed=m + split)
    for shuffle, padding in ((True, True), (False, False)):
        want = reference(args, shuffle, padding)
        out = fused_rms_mxfp4_quant_triton(**args, shuffle=shuffle, scale_shuffle_padding=padding, block_m=1,
                                           split=split, flat_sum=flat_sum)
        assert_matches_reference(out, want, args)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_triton_kernel_handles_fp16_and_fp32_inputs(dtype):
    # Only bf16 takes the paired-load fast path; other dtypes load elements one by one.
    args = make_inputs(33, 1536, x2=True, res=True, seed=11, dtype=dtype)
    out = run(args, True, True, "triton")
    want = reference(args, True, True)
    assert out[1].dtype == out[2].dtype == dtype
    assert_matches_reference(out, want, args)


# Whole rows with every operand paired bf16 take run-major tiles on the GPU (q_a + kv_a on 2 warps,
# the input norm with its residual on 4); forced here, at both sites and the smallest (512: one
# 16-block tile, x2 one more). x1 and x2 also as views of the fused q_a + kv_a GEMM output.
@pytest.mark.parametrize("m,n1,x2,res,block_m", [(7, 1536, "fused", False, 1), (45, 1536, "own", False, None),
                                                 (3, 7168, None, True, 1), (2, 512, "own", True, 1)])
def test_triton_kernel_run_major_tiles_match_torch_reference(m, n1, x2, res, block_m):
    from layouts._triton_fused_quant import fused_rms_mxfp4_quant_triton

    args = make_inputs(m, n1, x2=x2 is not None, res=res, seed=m + n1)
    if x2 == "fused":  # [q_a | kv_a | rope]: x1 and x2 are column slices of one row
        fused = torch.zeros(m, n1 + N2_KV + 64, dtype=torch.bfloat16)
        fused[:, :n1], fused[:, n1:n1 + N2_KV] = args["x1"], args["x2"]
        args = dict(args, x1=fused[:, :n1], x2=fused[:, n1:n1 + N2_KV])
    for shuffle, padding in FLAGS:
        out = fused_rms_mxfp4_quant_triton(**args, shuffle=shuffle, scale_shuffle_padding=padding, block_m=block_m,
                                           run_tiles=True)
        assert_matches_reference(out, reference(args, shuffle, padding), args)


# Fewer warps a row (q_a + kv_a on one: each thread holds two layers of x2's tile and four of
# x1's first) and the weights loaded with the rows change the registers' plan, not the bytes.
@pytest.mark.parametrize("m,n1,x2,res,run_warps,w_early", [(5, 1536, True, False, 1, True), (3, 512, True, True, 1, False),
                                                           (2, 7168, False, True, 2, True)])
def test_run_major_tiles_on_fewer_warps_or_with_early_weights_match_torch_reference(m, n1, x2, res, run_warps, w_early):
    from layouts._triton_fused_quant import _plan, fused_rms_mxfp4_quant_triton

    plan = _plan(4096, n1, 512 if x2 else 0, True, not res, True, 132, None, None, all_paired=True, run_tiles=True,
                 run_warps=run_warps, w_early=w_early)  # the GPU's plan at a size that takes whole rows
    assert (plan.warps, plan.fold, plan.w_early) == (run_warps, run_warps * 8, w_early)
    args = make_inputs(m, n1, x2=x2, res=res, seed=m + n1 + 1)
    out = fused_rms_mxfp4_quant_triton(**args, shuffle=True, scale_shuffle_padding=True, block_m=1, run_tiles=True,
                                       run_warps=run_warps, w_early=w_early)
    assert_matches_reference(out, reference(args, True, True), args)


# Persistent row programs (interpreter: 2 "multiprocessors" x persist programs) loop over the row
# blocks with the next one's loads in flight: every row written once, the prefetches past M (which
# read row M - 1) never stored, and the scale pad rows after the real ones still filled; with
# `stages`, one row block an iteration, Triton's pipeliner doing the prefetch (on a GPU), the
# weights held (w_early) or loaded each block.
@pytest.mark.parametrize("m,n1,x2,res,run_warps,persist,block_m,stages", [(7, 1536, True, False, 1, 1, 1, None),
                                                                          (9, 512, True, True, None, 2, 2, None),
                                                                          (37, 7168, False, True, 2, 1, 4, None),
                                                                          (7, 1536, True, False, 1, 1, 1, 3),
                                                                          (9, 512, True, True, None, 2, 2, 2)])
def test_persistent_run_major_programs_match_torch_reference(m, n1, x2, res, run_warps, persist, block_m, stages):
    from layouts._triton_fused_quant import _plan, fused_rms_mxfp4_quant_triton

    plan = _plan(m, n1, 512 if x2 else 0, True, not res, False, 0, block_m, None, all_paired=True, run_tiles=True,
                 run_warps=run_warps, persist=persist, stages=stages)
    assert plan.stages == (stages or 0) and plan.persist
    assert plan.n_split == min(2 * persist, -(-m // block_m)) < plan.n_blocks
    args = make_inputs(m, n1, x2=x2, res=res, seed=m + n1 + 2)
    # pipelined programs hold the weights (w_early) or load them each row block
    for (shuffle, padding), w_early in zip(((True, True), (False, False)), (False, True) if stages else (None, None)):
        out = fused_rms_mxfp4_quant_triton(**args, shuffle=shuffle, scale_shuffle_padding=padding, block_m=block_m,
                                           run_tiles=True, run_warps=run_warps, persist=persist, stages=stages,
                                           w_early=w_early)
        assert_matches_reference(out, reference(args, shuffle, padding), args)
    with pytest.raises(ValueError, match="persist needs run-major tiles or lane blocks"):
        fused_rms_mxfp4_quant_triton(**args, run_tiles=False, persist=1)
    for bad in (dict(stages=2), dict(persist=1, stages=0)):
        with pytest.raises(ValueError, match="stages needs persist"):
            fused_rms_mxfp4_quant_triton(**args, run_tiles=True, **bad)


# Lane blocks (a block's 32 values in one thread, its runs loaded as four tensors; rows of 1-3
# 16-block tiles): every flag setting, odd row counts (the last program's second row past M), with
# and without a residual, one and two warps, the rows unpacked again for the quant or kept.
@pytest.mark.parametrize("m,n1,x2,res,run_warps,unpack_late", [(5, 1536, True, False, 1, True),
                                                               (3, 512, True, True, 1, False),
                                                               (4, 1024, False, True, 2, False),
                                                               (1, 1536, True, False, None, False)])
def test_lane_block_tiles_match_torch_reference(m, n1, x2, res, run_warps, unpack_late):
    from layouts._triton_fused_quant import _plan, fused_rms_mxfp4_quant_triton

    plan = _plan(4096, n1, 512 if x2 else 0, True, not res, True, 132, None, None, all_paired=True,
                 lane_blocks=True, run_warps=run_warps)  # the GPU's plan: rows fill the lanes once
    assert plan.lane_blocks and not plan.run_tiles and plan.bm * 16 == plan.warps * 32
    args = make_inputs(m, n1, x2=x2, res=res, seed=m + n1 + 3)
    for shuffle, padding in ((True, True), (False, True), (False, False)):
        out = fused_rms_mxfp4_quant_triton(**args, shuffle=shuffle, scale_shuffle_padding=padding, lane_blocks=True,
                                           run_warps=run_warps, unpack_late=unpack_late)
        assert_matches_reference(out, reference(args, shuffle, padding), args)


def test_lane_block_tiles_are_refused_where_they_do_not_fit():
    from layouts._triton_fused_quant import fused_rms_mxfp4_quant_triton

    for n1, n2 in ((7168, 0), (1536, 256), (2048, 512)):  # 224 or 64 blocks; an x2 of half a tile
        with pytest.raises(ValueError, match="lane_blocks needs"):
            fused_rms_mxfp4_quant_triton(**make_inputs(2, n1, x2=bool(n2), n2=n2 or 512), lane_blocks=True)
    args = make_inputs(2, 1536, x2=True)
    with pytest.raises(ValueError, match="two row layouts"):
        fused_rms_mxfp4_quant_triton(**args, lane_blocks=True, run_tiles=True)
    with pytest.raises(ValueError, match="at most 16 warps"):
        fused_rms_mxfp4_quant_triton(**args, lane_blocks=True, run_warps=32)


# Persistent lane-block programs (interpreter: 2 "multiprocessors" x persist programs) loop over the
# row blocks, Triton's pipeliner prefetching on a GPU: every row written once, rows past M (row M - 1
# read in their place) never stored, the scale pad rows still filled.
@pytest.mark.parametrize("m,n1,x2,res,unpack_late,persist,stages", [(37, 1536, True, False, True, 1, 3),
                                                                    (70, 512, True, True, False, 2, 2),
                                                                    (5, 1024, False, False, False, 1, None)])
def test_persistent_lane_block_programs_match_torch_reference(m, n1, x2, res, unpack_late, persist, stages):
    from layouts._triton_fused_quant import _plan, fused_rms_mxfp4_quant_triton

    plan = _plan(m, n1, 512 if x2 else 0, True, not res, False, 0, None, None, all_paired=True, lanes=32,
                 lane_blocks=True, persist=persist, stages=stages)
    assert plan.lane_blocks and plan.persist and plan.stages == (stages or 0)
    assert plan.n_split == min(2 * persist, plan.n_blocks) < plan.n_blocks  # the programs loop
    gpu = _plan(4096, n1, 512 if x2 else 0, True, not res, True, 132, None, None, all_paired=True, lanes=32,
                lane_blocks=True, persist=persist, stages=stages)  # an H100's: two rows a one-warp program
    assert (gpu.bm, gpu.warps, gpu.n_split, gpu.n_blocks) == (2, 1, 132 * persist, 2048)
    args = make_inputs(m, n1, x2=x2, res=res, seed=m + n1 + 3)
    for shuffle, padding in ((True, True), (False, False)):
        out = fused_rms_mxfp4_quant_triton(**args, shuffle=shuffle, scale_shuffle_padding=padding, lane_blocks=True,
                                           unpack_late=unpack_late, persist=persist, stages=stages)
        assert_matches_reference(out, reference(args, shuffle, padding), args)


def test_run_major_tiles_are_refused_where_they_do_not_fit():
    from layouts._triton_fused_quant import fused_rms_mxfp4_quant_triton

    args = make_inputs(2, 1000, x2=True)  # a partial last block
    with pytest.raises(ValueError, match="run_tiles needs"):
        fused_rms_mxfp4_quant_triton(**args, run_tiles=True)
    args = make_inputs(2, 384, x2=True)  # 12 blocks: the padded scale's 16 columns are no whole tiles of rows
    for run_warps in (None, 1):
        with pytest.raises(ValueError, match="run_tiles needs"):
            fused_rms_mxfp4_quant_triton(**args, shuffle=True, run_tiles=True, run_warps=run_warps)
    with pytest.raises(ValueError, match="run_warps must be a power of two"):
        fused_rms_mxfp4_quant_triton(**make_inputs(2, 512, x2=True), run_tiles=True, run_warps=3)


@pytest.mark.parametrize("layout", ["odd_row_stride", "wide_row_stride", "column_major"])
def test_triton_kernel_reads_strided_inputs(layout):
    args = make_inputs(33, 512, x2=True, res=True, seed=12)
    base = args["x1"]
    if layout == "odd_row_stride":  # rows 513 elements apart: no aligned uint32 pairs
        x1 = torch.zeros(33, 513, dtype=base.dtype)[:, :512]
    elif layout == "wide_row_stride":
        x1 = torch.zeros(33, 1024, dtype=base.dtype)[:, 256:768]
    else:
        x1 = torch.zeros(512, 33, dtype=base.dtype).t()
    x1.copy_(base)
    res_wide = torch.zeros(33, 600, dtype=base.dtype)[:, 1:513]
    res_wide.copy_(args["res1"])
    strided = dict(args, x1=x1, res1=res_wide)
    assert_matches_reference(run(strided, True, True, "triton"), reference(args, True, True), args)


def test_zero_rows_and_negative_weights_give_byte_zero_scales_and_negative_zero_codes():
    # An all-zero row normalises to 0 (rstd = 1/sqrt(eps)); a negative weight makes it -0.0,
    # which aiter's quant keeps as code 8. Its blocks get scale byte 0 (amax 0).
    args = make_inputs(3, 512, res=True, seed=13)
    args["x1"][1] = 0
    args["res1"][1] = 0
    w = args["x1_weight"].clone()
    w[:64] = -w[:64].abs()
    w[64:] = w[64:].abs()
    args["x1_weight"] = w
    (q, s), _, _ = want = reference(args, False, False)
    codes = unpack_fp4(q[1])
    assert torch.equal(s[1], torch.zeros(16, dtype=torch.uint8))
    assert torch.equal(codes[:64], torch.full((64,), 8, dtype=torch.uint8))
    assert not codes[64:].any()
    assert_matches_reference(run(args, False, False, "triton"), want, args)


def tie_inputs() -> dict:
    """Rows whose rstd is exactly a power of two (x = +-1, 2), so y = +-w exactly: the weights
    put every E2M1 rounding tie, saturation, tiny and huge blocks and -0 into the quantizer."""
    ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 6.5, 0.1, 0.0, -0.0, 0.3, 2.75, 4.5, 5.5]
    blocks = [
        ties + [-t for t in ties],                               # scale 1: every tie, both signs
        [2.0 ** -126 * (1 + i / 64) for i in range(32)],         # tiny: exponent -128 clamps to -127
        [3e36 * (1 + i / 31) for i in range(32)],                # huge: exponent near the top
        [1.75 * 2 ** -10] + [1e-4] * 31,                         # amax rounds up an octave
        [1.74 * 2 ** -10] + [-1e-4] * 31,                        # amax just below
        [0.0] * 16 + [-0.0] * 16,                                # all zero: byte 0, +0 and -0
    ]
    w = torch.tensor([v for b in blocks for v in b], dtype=torch.float32).to(torch.bfloat16)
    n1 = w.numel()
    x1 = torch.stack([torch.ones(n1), -torch.ones(n1), 2 * torch.ones(n1)]).to(torch.bfloat16)
    return dict(x1=x1, x1_weight=w, x1_epsilon=0.0)


def test_triton_kernel_rounds_every_tie_and_extreme_block_like_the_reference():
    args = tie_inputs()
    want = reference(args, True, True)
    (q, s), _, _ = out = run(args, True, True, "triton")
    assert torch.equal(q, want[0][0])  # exact: every sum of squares here is exact
    assert_matches_reference(out, want, args)
    scale = valid_scale(s, 3, args["x1"].shape[1], True)
    assert scale[0].tolist() == [127, 0, 127 + 120, 127 - 11, 127 - 12, 0]


@pytest.mark.parametrize("n1, n2, res", [(7168, 0, True), (1536, 512, False)], ids=["input-norm", "q_a+kv_a"])
def test_triton_kernel_compiles_for_nvidia_with_its_ptx_and_for_amd_without(n1, n2, res, tmp_path):
    # The suite interprets the kernel; this compiles it (no GPU needed) as a GPU launch would:
    # for sm_90 its inline PTX (the E2M1 runs, the bf16 pair stores) must pass ptxas; for
    # gfx942 (ROCm torch without aiter) the kernel must take its tl steps, as LLVM refuses PTX.
    # Both row layouts: run-major tiles (paired inputs) and block-major ones.
    from offline_compile import compile_for_nvidia_and_amd

    both = compile_for_nvidia_and_amd("layouts._triton_fused_quant", (4096, n1, n2, res), tmp_path,
                                      kwargs=[{"run_tiles": True}, {"run_tiles": False}])
    for got in both:
        assert got["nvidia"]["cubin"] > 0 and got["amd"]["hsaco"] > 0
        ptx = got["nvidia"]["ptx"]
        assert "fma.rz.f32" in ptx and "prmt.b32" in ptx  # the E2M1 runs' PTX block
        assert "cvt.rn.bf16x2.f32" in ptx or not res  # out_res1's pairs (out2's: Triton's own)
    assert both[0]["nvidia"]["ptx"] != both[1]["nvidia"]["ptx"]  # two kernels, not one


def test_triton_kernel_with_no_rows_returns_empty_outputs():
    args = make_inputs(0, 512, x2=True, res=True)
    (q, s), out2, res = run(args, True, True, "triton")
    assert q.shape == (0, 256) and s.shape == (0, 16) and out2.shape == (0, N2_KV) and res.shape == (0, 512)
    assert_matches_reference(((q, s), out2, res), reference(args, True, True), args)


# ---------------------------------------------------- reference semantics, checked independently
@pytest.mark.parametrize("n1", [80, 512, 7168])
def test_reference_quantizes_the_float32_rmsnorm_with_the_aiter_triton_recipe(n1):
    args = make_inputs(9, n1, x2=True, res=True, seed=21)
    (q, s), out2, res = reference(args, False, False)
    x = args["x1"].float() + args["res1"].float()
    y = x * (1.0 / torch.sqrt((x * x).sum(-1, keepdim=True) / n1 + EPS)) * args["x1_weight"].float()
    want_q, want_s = layouts.mxfp4.quantize(y, AITER_TRITON)
    assert torch.equal(q, want_q) and torch.equal(s, want_s)
    assert torch.equal(res, x.to(torch.bfloat16))
    # torch's own RMSNorm agrees up to rounding (an independent implementation of the norm).
    torch_y = torch.nn.functional.rms_norm(x, (n1,), args["x1_weight"].float(), EPS)
    assert_codes_close(q, layouts.mxfp4.quantize(torch_y, AITER_TRITON)[0], "q vs F.rms_norm")
    torch_out2 = torch.nn.functional.rms_norm(args["x2"].float(), (N2_KV,), args["x2_weight"].float(), EPS)
    assert_one_step(out2, torch_out2.to(torch.bfloat16), "out2 vs F.rms_norm")


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("m,n1", [(1, 1536), (33, 80), (300, 512)])
def test_shuffled_scale_is_preshuffle_scale_of_the_row_major_scale(m, n1, backend):
    args = make_inputs(m, n1, seed=31)
    plain = run(args, False, False, backend)[0][1]
    padded = run(args, False, True, backend)[0][1]
    cols = -(-n1 // 32)
    assert plain.shape == (m, cols)
    want_padded = torch.full(FQ.fused_scale_shape(m, n1, False, True), layouts.mxfp4.E8M0_ONE, dtype=torch.uint8)
    want_padded[:m, :cols] = plain
    assert torch.equal(padded, want_padded)
    for padding in (False, True):  # shuffling implies padding, as in aiter
        shuffled = run(args, True, padding, backend)[0][1]
        assert torch.equal(shuffled, preshuffle_scale(plain, pad_value=layouts.mxfp4.E8M0_ONE))  # aiter's activation pad
        assert torch.equal(unshuffle_scale(shuffled, m, cols), plain)


# ------------------------------------------------------------ aiter's own fused kernel (oracle)
AITER_CASES = [
    # m, n1, x2, res1, shuffle, padding
    (1, 512, False, False, False, False),
    (1, 7168, False, True, True, True),
    (31, 512, True, True, False, False),
    (33, 1536, True, False, False, True),
    (33, 1536, True, True, True, False),
    (40, 7168, False, True, True, True),
    (3, 80, False, True, True, True),  # a partial 32-block and fewer than 8 scale columns
]


@pytest.mark.parametrize("m,n1,with_x2,with_res,shuffle,padding", AITER_CASES)
def test_reference_and_triton_kernel_match_aiter_fused_kernel(aiter_fused_rms_quant, m, n1, with_x2,
                                                               with_res, shuffle, padding):
    args = make_inputs(m, n1, x2=with_x2, res=with_res, seed=41 + m + n1)
    (aq, a_s), a_out2, a_res = aiter_fused_rms_quant(**args, shuffle=shuffle, scale_shuffle_padding=padding)
    assert a_s.shape == FQ.fused_scale_shape(m, n1, shuffle, padding)
    want_res = reference(args, shuffle, padding)[2]
    assert_res_close(a_res, want_res, args)  # aiter's interpreted cast truncates too
    for name, backend in (("reference", "torch"), ("triton", "triton")):
        (q, s), out2, res = run(args, shuffle, padding, backend)
        assert s.shape == a_s.shape, name
        # aiter leaves the scale pad uninitialised: compare the valid region only.
        assert torch.equal(valid_scale(s, m, n1, shuffle), valid_scale(a_s, m, n1, shuffle)), name
        assert_codes_close(q, aq, f"{name} q vs aiter")
        assert_one_step(out2, a_out2, f"{name} out2 vs aiter")
        if backend == "triton" and with_res:  # both interpreted: the same cast, the same bytes
            assert torch.equal(res, a_res)


def test_tie_and_extreme_blocks_match_aiter_fused_kernel_bytes(aiter_fused_rms_quant):
    args = tie_inputs()
    (aq, a_s), _, _ = aiter_fused_rms_quant(**args, shuffle=False, scale_shuffle_padding=False)
    for backend in ("torch", "triton"):
        (q, s), _, _ = run(args, False, False, backend)
        assert torch.equal(s, a_s) and torch.equal(q, aq), backend


def test_aiter_quantizes_the_float32_norm_not_a_bf16_rounded_one(aiter_fused_rms_quant):
    # Where aiter rounds intermediates decides bytes: its kernel quantizes the float32 norm
    # output. Quantizing a bf16-rounded norm instead changes far more codes than the bound.
    args = make_inputs(33, 1536, res=True, seed=51)
    (aq, _), _, _ = aiter_fused_rms_quant(**args, shuffle=False, scale_shuffle_padding=False)
    x = args["x1"].float() + args["res1"].float()
    y = x * (1.0 / torch.sqrt((x * x).sum(-1, keepdim=True) / 1536 + EPS)) * args["x1_weight"].float()
    assert_codes_close(layouts.mxfp4.quantize(y, AITER_TRITON)[0], aq)
    rounded = layouts.mxfp4.quantize(y.to(torch.bfloat16), AITER_TRITON)[0]
    n_diff = int((unpack_fp4(rounded) != unpack_fp4(aq)).sum())
    assert n_diff > 10 * max_code_diffs(aq.numel() * 2)


# --------------------------------------------------------------------------- DeepSeek call sites
@pytest.mark.parametrize("tokens", [1, 40])
@pytest.mark.parametrize("gemm_path", ["asm", "triton-preshuffle", "triton-non-shuffle"])
def test_deepseek_input_layernorm_with_residual(aiter_fused_rms_quant, gemm_path, tokens):
    # input_layernorm (+ residual) before fused_qkv_a_proj: hidden 7168, bf16.
    shuffle, padding = select_activation_quant(ATOM.gemm_paths[gemm_path], tokens)
    args = make_inputs(tokens, 7168, res=True, seed=61 + tokens)
    out = run(args, shuffle, padding, "triton")
    want = reference(args, shuffle, padding)
    assert out[0][1].shape == ((256, 224) if padding else (tokens, 224))
    assert out[0][0].shape == (tokens, 3584) and out[1] is None and out[2].shape == (tokens, 7168)
    assert_matches_reference(out, want, args)
    (aq, a_s), _, a_res = aiter_fused_rms_quant(**args, shuffle=shuffle, scale_shuffle_padding=padding)
    assert torch.equal(valid_scale(out[0][1], tokens, 7168, shuffle), valid_scale(a_s, tokens, 7168, shuffle))
    assert_codes_close(out[0][0], aq, "q vs aiter")
    assert torch.equal(out[2], a_res)  # both interpreted: the same fp32 -> bf16 rounding


@pytest.mark.parametrize("tokens", [1, 40])
@pytest.mark.parametrize("gemm_path", ["asm", "triton-preshuffle", "triton-non-shuffle"])
def test_deepseek_q_a_layernorm_with_kv_a_layernorm(aiter_fused_rms_quant, gemm_path, tokens):
    # q_a_layernorm (q_lora 1536, quantized for q_b_proj) + kv_a_layernorm (kv_lora 512, bf16).
    shuffle, padding = select_activation_quant(ATOM.gemm_paths[gemm_path], tokens)
    args = make_inputs(tokens, 1536, x2=True, seed=71 + tokens)
    out = run(args, shuffle, padding, "triton")
    want = reference(args, shuffle, padding)
    assert out[0][1].shape == ((256, 48) if padding else (tokens, 48))
    assert out[1].shape == (tokens, 512) and out[1].dtype == torch.bfloat16 and out[2] is None
    assert_matches_reference(out, want, args)
    (aq, a_s), a_out2, _ = aiter_fused_rms_quant(**args, shuffle=shuffle, scale_shuffle_padding=padding)
    assert torch.equal(valid_scale(out[0][1], tokens, 1536, shuffle), valid_scale(a_s, tokens, 1536, shuffle))
    assert_codes_close(out[0][0], aq, "q vs aiter")
    assert_one_step(out[1], a_out2, "out2 vs aiter")


# ----------------------------------------------------------------------------- back-end choice
class _NoRocm:
    """A meta-path finder that fails `import aiter` the way aiter does without ROCm."""

    def find_spec(self, name, path=None, target=None):
        if name == "aiter" or name.startswith("aiter."):
            raise RuntimeError("no ROCm device (simulated)")
        return None


@pytest.fixture
def no_aiter(monkeypatch):
    for name in [n for n in sys.modules if n == "aiter" or n.startswith("aiter.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(sys, "meta_path", [_NoRocm(), *sys.meta_path])
    FQ._aiter_probe.cache_clear()
    yield
    FQ._aiter_probe.cache_clear()


def test_cpu_tensors_run_the_torch_reference(no_aiter):
    args = make_inputs(5, 512, x2=True, res=True, seed=81)
    assert FQ.select_backend(args["x1"].device) == "torch"
    out = FQ.fused_rms_mxfp4_quant(**args, shuffle=True, scale_shuffle_padding=True)
    want = reference(args, True, True)
    for got, exp in zip((out[0][0], out[0][1], out[1], out[2]), (want[0][0], want[0][1], want[1], want[2])):
        assert torch.equal(got, exp)


def test_gpu_tensors_run_our_triton_kernel_when_aiter_cannot_be_imported(no_aiter):
    assert FQ.select_backend("cuda") == "triton"
    assert FQ.select_backend("cuda:1", "torch") == "torch"


def test_asking_for_aiter_where_it_cannot_be_imported_is_a_clear_error(no_aiter):
    with pytest.raises(RuntimeError, match=r"aiter cannot be imported here \(RuntimeError: no ROCm"):
        FQ.select_backend("cuda", "aiter")
    args = make_inputs(2, 512)
    with pytest.raises(RuntimeError, match="backend='aiter'"):
        FQ.fused_rms_mxfp4_quant(**args, backend="aiter")


def test_unknown_backend_is_refused():
    with pytest.raises(ValueError, match="unknown backend 'cuda'"):
        FQ.select_backend("cpu", "cuda")


def test_aiter_probe_runs_and_logs_once(no_aiter, caplog):
    caplog.set_level(logging.INFO, logger="layouts")
    for _ in range(3):
        assert not FQ.aiter_available()
        FQ.select_backend("cuda")
    records = [r for r in caplog.records if r.name == "layouts" and "aiter is not usable" in r.getMessage()]
    assert len(records) == 1 and records[0].levelno == logging.INFO
    assert "RuntimeError: no ROCm device (simulated)" in records[0].getMessage()


def test_triton_backend_on_cpu_needs_the_interpreter(monkeypatch):
    from layouts import _triton_fused_quant

    monkeypatch.setattr(_triton_fused_quant, "INTERPRETED", False)  # as if imported without it
    with pytest.raises(RuntimeError, match="needs GPU tensors"):
        FQ.fused_rms_mxfp4_quant(**make_inputs(2, 512), backend="triton")


def test_shape_errors_name_the_argument():
    args = make_inputs(4, 512, x2=True, res=True)
    with pytest.raises(ValueError, match="x1 must be"):
        FQ.fused_rms_mxfp4_quant(**dict(args, x1=args["x1"][:, :511]))
    with pytest.raises(ValueError, match="res1 must have"):
        FQ.fused_rms_mxfp4_quant(**dict(args, res1=args["res1"][:3]))
    with pytest.raises(ValueError, match="x2 must be"):
        FQ.fused_rms_mxfp4_quant(**dict(args, x2=args["x2"][:3]))
