#!/usr/bin/env python3
"""GPU benchmark of the fused (residual add +) RMSNorm + MXFP4 quant, all contenders in one run.

    PYTHONPATH=. python scripts/bench_fused_quant.py [--quick] [--aiter-dir DIR] [--out FILE]
                                                     [--sweep] [--no-compile]

Contenders, each on the same inputs (bf16, shuffle=True and scale_shuffle_padding=True, the
ASM-GEMM flags):

* ours      -- ``layouts.fused_rms_mxfp4_quant(..., backend="triton")`` (the public call);
* aiter     -- aiter's own Triton ``fused_rms_mxfp4_quant``, loaded from the pinned oracle files
               (``.cache/aiter-oracle`` or ``--aiter-dir``) without aiter's package init;
* compiled  -- ``torch.compile`` of our torch reference (``fused_rms_mxfp4_quant_reference``);
* unfused   -- torch ops for the residual add and ``F.rms_norm``, then aiter's separate
               ``dynamic_mxfp4_quant`` Triton kernel (row-major scale, no shuffle: a lower bound
               on what the unfused sequence costs);
* old       -- with ``--old-kernel FILE``: an earlier version of our kernel file, loaded by path
               (before/after in one run);
* copy      -- a copy moving the same number of bytes (read + written): the faster of torch's
               ``copy_`` (in a CUDA graph a memcpy node) and a plain Triton copy kernel.

"%best" is ours against the best copy of the run: both copies timed at 64 MiB to 4 GiB moved at
the start, the fastest of all in GB/s. The one-byte kernel's time is the launch floor in a graph.

Two DeepSeek call sites: input_layernorm (N1=7168, with residual) and q_a_layernorm + kv_a
(N1=1536, x2 N2=512). Times are medians of CUDA-graph replays (many calls per graph: device
time without launch overhead), plus an eager column (one Python call each, launch included).
Bandwidth = bytes read + written by the op / time; "%copy" = that over the copy's bandwidth.

Before timing, every shape is checked: ours against the torch reference on the GPU for all
three flag settings (scale bytes exact including pad, FP4 codes within the test bound, out_res1
exact, out2 within one bf16 step), against the CPU reference for small M, and against aiter.
``--sweep`` then times a few (rows per program, warps) launch configs around our default plan.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
import time
import traceback

REPO = pathlib.Path(__file__).resolve().parent.parent


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer shapes and shorter timing")
    ap.add_argument("--aiter-dir", default=None, help="unpacked amd-aiter files (default .cache/aiter-oracle)")
    ap.add_argument("--out", default=None, help="also write the report here")
    ap.add_argument("--sweep", action="store_true", help="also time launch configs around our default plan")
    ap.add_argument("--ab-flags", action="store_true",
                    help="only time ours with the scale shuffled + padded, row-major padded and row-major, "
                         "alternating twice in this process (what the shuffle costs)")
    ap.add_argument("--sweep-ms", default=None, help="comma-separated M values of the sweep (default: 1,16,16384,65536)")
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile contender")
    ap.add_argument("--ms", default=None, help="comma-separated M values (default: 1,16,256,4096,16384,65536)")
    ap.add_argument("--time-limit", type=float, default=240,
                    help="seconds after which the remaining contenders are skipped (the table still prints)")
    ap.add_argument("--old-kernel", default=None,
                    help="a copy of an earlier layouts/_triton_fused_quant.py: timed (and checked) beside ours "
                         "as 'old'")
    ap.add_argument("--e2m1-exhaustive", action="store_true",
                    help="compare our E2M1 encoding with the old kernel's on all 2^32 float32 values (GPU)")
    ap.add_argument("--cpu-smoke", action="store_true",
                    help="exercise this script on the CPU (TRITON_INTERPRET=1, tiny shapes, wall-clock times)")
    return ap.parse_args()


ARGS = parse_args()
if ARGS.aiter_dir:
    os.environ["PREP_AITER_ORACLE_DIR"] = str(pathlib.Path(ARGS.aiter_dir).resolve())
if ARGS.cpu_smoke:
    os.environ["TRITON_INTERPRET"] = "1"
elif os.environ.get("TRITON_INTERPRET") == "1":
    sys.exit("unset TRITON_INTERPRET: this benchmark compiles kernels for the GPU")
DEVICE = "cpu" if ARGS.cpu_smoke else "cuda"
sys.path[:0] = [str(REPO), str(REPO / "tests")]

import torch  # noqa: E402

from layouts import fused_quant as FQ  # noqa: E402
from layouts._triton_fused_quant import fused_rms_mxfp4_quant_triton  # noqa: E402
from layouts.mxfp4 import unpack_fp4  # noqa: E402
from layouts.shuffle import unshuffle_scale  # noqa: E402

import cuda_timing  # noqa: E402  (scripts/, beside this file)

def say(msg: str = "") -> None:
    print(msg, flush=True)
    if ARGS.out:  # as we go, so that a run cut short still leaves its report
        with open(ARGS.out, "a") as f:
            f.write(msg + "\n")


# ------------------------------------------------------------------------------------- timing
def time_eager_us(fn, budget_ms: float) -> float:
    return cuda_timing.time_eager_us(fn, budget_ms, cpu=ARGS.cpu_smoke)


def time_graph_us(fn, budget_ms: float) -> float:
    return cuda_timing.time_graph_us(fn, budget_ms, cpu=ARGS.cpu_smoke)


def _copy_kernel():
    """A plain Triton copy of int32 words, 16-byte vectors (the bound a memory-bound kernel can
    reach: in a CUDA graph torch's ``copy_`` becomes a memcpy node, which may run on the copy
    engines rather than the SMs)."""
    import triton
    import triton.language as tl

    @triton.jit
    def copy_words(src, dst, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        tl.store(dst + offs, tl.load(src + offs, mask=offs < n), mask=offs < n)

    def run(src, dst, block=4096, warps=8):
        n = src.numel()
        copy_words[(triton.cdiv(n, block),)](src, dst, n, BLOCK=block, num_warps=warps)
    return run


def copy_fns(nbytes: int) -> dict:
    """Copies of ``nbytes`` bytes read + written (``nbytes / 2`` each way, int32 words): torch's
    ``copy_`` and the Triton copy kernel."""
    words = max(1, nbytes // 8)
    src = torch.ones(words, dtype=torch.int32, device=DEVICE)
    dst = torch.empty_like(src)
    tcopy = _copy_kernel()
    return {"copy_": lambda: dst.copy_(src), "triton": lambda: tcopy(src, dst)}


def copy_ceiling() -> float:
    """The machine's best copy in this run (GB/s, read + written): torch ``copy_`` and the Triton
    copy at sizes from 64 MiB to 4 GiB moved; prints each."""
    best, row = 0.0, []
    for mib in (64, 256, 1024, 4096):
        nbytes = mib << 20
        for name, fn in copy_fns(nbytes).items():
            gbs = nbytes / time_graph_us(fn, 100) / 1e3
            row.append(f"{name}@{mib}MiB={gbs:.0f}")
            best = max(best, gbs)
        torch.cuda.empty_cache()
    say("copy GB/s (read + written), CUDA graph: " + "  ".join(row))
    return best


def floor_us() -> float:
    """Device time per call of a Triton kernel that stores one byte: the per-launch floor inside
    a CUDA graph (what no kernel can beat)."""
    import triton
    import triton.language as tl

    @triton.jit
    def one_byte(p):
        tl.store(p, tl.full((), 1, tl.uint8))

    buf = torch.empty(1, dtype=torch.uint8, device=DEVICE)
    return time_graph_us(lambda: one_byte[(1,)](buf), 30)


# ------------------------------------------------------------------------------------- inputs
SITES = {
    # name: (N1, with residual, N2 of x2 or 0)
    "input_layernorm+res": (7168, True, 0),
    "q_a+kv_a_layernorm": (1536, False, 512),
}
EPS = 1e-6


def make_inputs(m: int, n1: int, res: bool, n2: int, seed: int = 0) -> dict:
    g = torch.Generator(device=DEVICE).manual_seed(seed)

    def act(rows, cols):
        scale = torch.exp(torch.randn(rows, 1, device=DEVICE, generator=g) * 1.5)
        return (torch.randn(rows, cols, device=DEVICE, generator=g) * scale).to(torch.bfloat16)

    def weight(cols):
        return (1 + 0.4 * torch.randn(cols, device=DEVICE, generator=g)).to(torch.bfloat16)

    args = dict(x1=act(m, n1), x1_weight=weight(n1), x1_epsilon=EPS)
    if res:
        args["res1"] = act(m, n1)
    if n2:
        args.update(x2=act(m, n2), x2_weight=weight(n2), x2_epsilon=EPS)
    return args


def op_bytes(m: int, n1: int, res: bool, n2: int) -> int:
    """Bytes the fused op must read and write (bf16 in/out, padded shuffled scale)."""
    rows_pad, cols_pad = FQ.fused_scale_shape(m, n1, True, True)
    read = 2 * m * n1 + 2 * n1 + (2 * m * n1 if res else 0) + (2 * m * n2 + 2 * n2 if n2 else 0)
    written = m * n1 // 2 + rows_pad * cols_pad + (2 * m * n1 if res else 0) + (2 * m * n2 if n2 else 0)
    return read + written


# -------------------------------------------------------------------------------- correctness
def max_code_diffs(n: int) -> int:
    return 2 + n // 100_000  # the bound tests/test_fused_quant.py pins


def max_scale_diffs(n: int) -> int:
    # A block whose amax sits within an ulp of the EVEN rounding point (mantissa 1.75) changes
    # scale when rstd moves by an ulp: rarer than a code flip by the blocks' 1 point per octave
    # against the codes' ~2. Absent at test sizes; possible at M = 65536 (14.7M blocks).
    return 2 + n // 10_000_000


def row_major_scale(s: torch.Tensor, shuffle: bool) -> torch.Tensor:
    """The whole scale buffer in row-major order (pad included)."""
    return unshuffle_scale(s, *s.shape) if shuffle else s


def code_diffs(q, want, skip=None) -> tuple[int, bool]:
    """(number of differing FP4 codes, all of them one step with the same sign); codes where
    ``skip`` (a bool [M, N1] mask) is set are not compared."""
    if torch.equal(q, want):
        return 0, True
    a, b = unpack_fp4(q).to(torch.int16), unpack_fp4(want).to(torch.int16)
    d = a != b
    if skip is not None:
        d &= ~skip
    da, db = a[d], b[d]
    one_step = bool(torch.equal(da & 8, db & 8) and ((da & 7) - (db & 7)).abs().eq(1).all())
    return int(d.sum()), one_step


def bf16_steps(a, b) -> int:
    """Largest distance in ulps between two 16-bit float tensors (fp32: 0 if within 2^-20)."""
    if a.dtype == torch.float32:
        return 0 if torch.allclose(a, b, rtol=2 ** -20, atol=0) else 99
    ia, ib = a.view(torch.int16).to(torch.int32), b.view(torch.int16).to(torch.int32)
    ia = torch.where(ia < 0, -(ia & 0x7FFF), ia)
    ib = torch.where(ib < 0, -(ib & 0x7FFF), ib)
    return int((ia - ib).abs().max()) if a.numel() else 0


def check(out, want, what: str, shuffle: bool) -> tuple[list[str], int, int]:
    """(problems of ``out`` against the reference ``want``, FP4 codes differing, scale bytes
    differing). Scale bytes: pad exact, at most :func:`max_scale_diffs` valid bytes off by one
    (their blocks' codes are then not compared); codes: :func:`max_code_diffs`, one step each;
    out_res1 exact (compiled: round to nearest even); out2 within one bf16 step."""
    (q, s), out2, res = out
    (wq, ws), wout2, wres = want
    m, n1 = q.shape[0], q.shape[1] * 2
    cols = -(-n1 // 32)
    bad = []
    if s.shape != ws.shape:
        return [f"{what}: scale shape {tuple(s.shape)} != {tuple(ws.shape)}"], 0, 0
    rs, rws = row_major_scale(s, shuffle), row_major_scale(ws, shuffle)
    differ = rs != rws
    n_s = int(differ.sum())
    skip = None
    if n_s:
        in_pad = differ.clone()
        in_pad[:m, :cols] = False
        step = (rs.to(torch.int16) - rws.to(torch.int16)).abs()
        if in_pad.any() or n_s > max_scale_diffs(m * cols) or bool((step[differ] != 1).any()):
            bad.append(f"{what}: {n_s} scale bytes differ ({int(in_pad.sum())} in the pad)")
        skip = differ[:m, :cols].repeat_interleave(32, dim=1)[:, :n1]
    n, one_step = code_diffs(q, wq, skip)
    if n > max_code_diffs(q.numel() * 2) or not one_step:
        bad.append(f"{what}: {n} FP4 codes differ of {q.numel() * 2} (one step: {one_step})")
    if wout2 is not None and bf16_steps(out2, wout2) > 1:
        bad.append(f"{what}: out2 more than one bf16 step off")
    if wres is not None:
        if not ARGS.cpu_smoke and not torch.equal(res, wres):  # interpreted casts truncate
            bad.append(f"{what}: out_res1 differs ({int((res != wres).sum())} elements)")
        elif bf16_steps(res, wres) > 1:
            bad.append(f"{what}: out_res1 more than one bf16 step off")
    return bad, n, n_s


def versus_aiter(out, theirs, m: int, n1: int) -> str:
    """How aiter's own kernel, compiled for this GPU, compares (informational: that kernel is
    written for AMD; its CPU-interpreted results are pinned by tests/test_fused_quant.py)."""
    cols = -(-n1 // 32)
    ours_s, their_s = unshuffle_scale(out[0][1], m, cols), unshuffle_scale(theirs[0][1], m, cols)
    # aiter turns the float exponent into a byte with `.to(tl.uint8)`; compiled for NVIDIA the
    # conversion saturates negative exponents to 0 (byte 127), where AMD's wraps around.
    differ = ours_s != their_s
    cast = differ & (ours_s < 127) & (their_s == 127)
    other = differ & ~cast
    skip = other.repeat_interleave(32, dim=1)[:, :n1]
    a, b = unpack_fp4(out[0][0]).to(torch.int16), unpack_fp4(theirs[0][0]).to(torch.int16)
    d = (a != b) & ~skip
    far = d & (((a & 7) - (b & 7)).abs() > 1)
    return (f"vs aiter's kernel on this GPU: {int(cast.sum())}/{differ.numel()} scale bytes are 127 where ours "
            f"< 127 (its saturating cast), {int(other.sum())} other scale bytes differ; {int(d.sum())} codes "
            f"differ elsewhere ({int(far.sum())} by more than a step)")


def verify(site: str, m: int, args: dict, aiter_fused) -> str:
    n1 = args["x1"].shape[1]
    notes, total_diffs, total_s, problems = [], 0, 0, []
    for shuffle, padding in ((False, False), (False, True), (True, True)):
        out = FQ.fused_rms_mxfp4_quant(**args, shuffle=shuffle, scale_shuffle_padding=padding, backend="triton")
        want = FQ.fused_rms_mxfp4_quant_reference(**args, shuffle=shuffle, scale_shuffle_padding=padding)
        what = f"{site} M={m} shuffle={shuffle} pad={padding}"
        bad, n, n_s = check(out, want, what + " vs GPU reference", shuffle)
        problems += bad
        total_diffs, total_s = total_diffs + n, total_s + n_s
        if m <= 256:
            cpu = {k: (v.cpu() if torch.is_tensor(v) else v) for k, v in args.items()}
            want_cpu = FQ.fused_rms_mxfp4_quant_reference(**cpu, shuffle=shuffle, scale_shuffle_padding=padding)
            out_cpu = ((out[0][0].cpu(), out[0][1].cpu()), *(t.cpu() if t is not None else None for t in out[1:]))
            problems += check(out_cpu, want_cpu, what + " vs CPU reference", shuffle)[0]
    notes.append(f"vs GPU reference over 3 flag settings: {total_diffs} codes one step off, "
                 f"{total_s} scale bytes off")
    if aiter_fused is not None:
        out = FQ.fused_rms_mxfp4_quant(**args, shuffle=True, scale_shuffle_padding=True, backend="triton")
        notes.append(versus_aiter(out, aiter_fused(**args, shuffle=True, scale_shuffle_padding=True), m, n1))
    for p in problems:
        say("  FAIL " + p)
    return ("ok; " if not problems else "FAILED; ") + "; ".join(notes)


def verify_edges() -> None:
    """Shapes and dtypes the timed sites do not cover: partial blocks, fp16, strided rows."""
    cases = []
    for m, n1, res, n2, dtype in ((33, 80, True, 0, torch.bfloat16), (300, 512, True, 512, torch.bfloat16),
                                  (33, 1536, True, 512, torch.float16), (1, 7168, True, 512, torch.float32)):
        args = make_inputs(m, n1, res, n2, seed=n1)
        cases.append((f"M={m} N1={n1} {str(dtype)[6:]}", {k: (v.to(dtype) if torch.is_tensor(v) else v)
                                                          for k, v in args.items()}))
    args = make_inputs(45, 7168, True, 0, seed=5)
    wide = torch.zeros(45, 7169, dtype=torch.bfloat16, device=DEVICE)[:, 1:]  # odd offset: unpaired
    wide.copy_(args["x1"])
    cases.append(("M=45 N1=7168 strided x1", dict(args, x1=wide)))
    problems = []
    for name, args in cases:
        for shuffle, padding in ((False, False), (False, True), (True, True)):
            out = FQ.fused_rms_mxfp4_quant(**args, shuffle=shuffle, scale_shuffle_padding=padding, backend="triton")
            want = FQ.fused_rms_mxfp4_quant_reference(**args, shuffle=shuffle, scale_shuffle_padding=padding)
            problems += check(out, want, f"{name} shuffle={shuffle} pad={padding}", shuffle)[0]
    for p in problems:
        say("  FAIL " + p)
    say(f"check edge cases ({len(cases)} shapes x 3 flag settings): {'ok' if not problems else 'FAILED'}")


# ----------------------------------------------------------------------------------- contenders
def load_aiter():
    import aiter_oracle

    fused = quant = None
    try:
        fused = aiter_oracle.triton_ops_module("fused_mxfp4_quant", interpret=ARGS.cpu_smoke).fused_rms_mxfp4_quant
    except Exception as exc:  # noqa: BLE001 - reported, the rest of the bench still runs
        say(f"aiter fused_rms_mxfp4_quant unavailable: {type(exc).__name__}: {exc}")
    try:
        quant = aiter_dynamic_quant(aiter_oracle.triton_ops_module("quant", interpret=ARGS.cpu_smoke))
    except Exception as exc:  # noqa: BLE001
        say(f"aiter dynamic_mxfp4_quant unavailable: {type(exc).__name__}: {exc}")
    return fused, quant


def load_old_kernel():
    """The old kernel file's wrapper (module loaded by path under its own name, beside ours)."""
    if not ARGS.old_kernel:
        return None
    import importlib.util

    spec = importlib.util.spec_from_file_location("_old_triton_fused_quant", ARGS.old_kernel)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def e2m1_exhaustive(old_mod) -> None:
    """Every float32 bit pattern through our E2M1 pair encoding (both nibbles) and the old
    kernel's compare-based ``_e2m1_code``, compiled for this GPU; prints the mismatch count."""
    import triton
    import triton.language as tl

    from layouts import _triton_fused_quant as new_mod

    g = globals()
    g["_new_pair"], g["_old_code"] = new_mod._e2m1_pair, old_mod._e2m1_code

    @triton.jit
    def kernel(count_ptr, base, BLOCK: tl.constexpr):
        bits = (base + tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)).to(tl.uint32)
        v = bits.to(tl.float32, bitcast=True)
        new = _new_pair(v, v, True)  # noqa: F821 - set in globals above
        old = _old_code(v)  # noqa: F821
        bad = tl.sum((new != (old | (old << 4))).to(tl.int32), axis=0)
        tl.atomic_add(count_ptr, bad)

    count = torch.zeros(1, dtype=torch.int32, device="cuda")
    block, per_launch = 1024, 1 << 30
    t0 = time.time()
    for base in range(0, 1 << 32, per_launch):
        kernel[(per_launch // block,)](count, base, BLOCK=block)
    torch.cuda.synchronize()
    say(f"E2M1 encoding, all 2^32 float32 patterns, ours vs the old kernel's: {int(count.item())} mismatches "
        f"({time.time() - t0:.1f} s)")


def aiter_dynamic_quant(mod):
    """aiter's `dynamic_mxfp4_quant` launch (its own block-size choice, read from the pinned
    wrapper) minus the AMD-only `waves_per_eu` launch option, which NVIDIA's Triton rejects."""
    import triton

    kernel = mod._dynamic_mxfp4_quant_kernel

    def quant(x):
        m, n = x.shape
        out = torch.empty((m, n // 2), dtype=torch.uint8, device=x.device)
        scale = torch.empty(((n + 31) // 32, m), dtype=torch.uint8, device=x.device).T
        if m <= 32:
            num_iter, bm, bn, warps, stages = 1, triton.next_power_of_2(m), 32, 1, 1
        else:
            num_iter, bm, bn, warps, stages = 4, 64, 64, 4, 2
            if n <= 16384:
                bm, bn = 32, 128
        if n <= 1024:
            num_iter, stages, warps = 1, 1, 4
            bn = max(32, min(256, triton.next_power_of_2(n)))
            bm = min(8, triton.next_power_of_2(m))
        grid = (triton.cdiv(m, bm), triton.cdiv(n, bn * num_iter))
        kernel[grid](x, out, scale, *x.stride(), *out.stride(), *scale.stride(), M=m, N=n,
                     MXFP4_QUANT_BLOCK_SIZE=32, SCALING_MODE=0, NUM_ITER=num_iter, BLOCK_SIZE_M=bm,
                     BLOCK_SIZE_N=bn, NUM_STAGES=stages, num_warps=warps, num_stages=1)
        return out, scale
    return quant


def unfused_fn(args: dict, n1: int, quant):
    x1, w1, res1 = args["x1"], args["x1_weight"], args.get("res1")
    x2, w2 = args.get("x2"), args.get("x2_weight")
    rms = torch.nn.functional.rms_norm
    if quant is None:  # our own torch quant (several kernels) when aiter's is missing
        def quant(y):
            return FQ._mxfp4_quant_f32(y.float())

    def fn():
        x = x1 + res1 if res1 is not None else x1
        y = rms(x, (n1,), w1, EPS)
        out = quant(y)
        if x2 is not None:
            rms(x2, (x2.shape[1],), w2, EPS)
        return out
    return fn


def _plan_of(m: int, n1: int, n2: int) -> tuple:
    from layouts import _triton_fused_quant as T

    raw = n2 > 0  # the x2 site has no residual: bf16 x1 stays packed
    if ARGS.cpu_smoke:
        return T._plan(m, n1, n2, True, raw, False, 0, None, None)
    return T._plan(m, n1, n2, True, raw, True, T._num_sms(torch.cuda.current_device()), None, None)


X2IN, X2OWN, FLAT, TILES = dict(x2_main=True), dict(x2_main=False), dict(flat_sum=True), dict(flat_sum=False)
SWEEP = {  # (rows per program, warps, row split, plan options) around the defaults
    "input_layernorm+res": {"small": [(1, 4, 1, {}), (1, 4, 7, FLAT), (1, 4, 7, TILES), (1, 8, 7, FLAT),
                                      (1, 2, 7, FLAT), (1, 4, 14, FLAT), (1, 8, 14, FLAT), (1, 8, 4, FLAT)],
                            "large": [(1, 2, 1, {}), (1, 4, 1, {}), (1, 8, 1, {}), (1, 16, 1, {}), (2, 4, 1, {}),
                                      (2, 8, 1, {}), (2, 16, 1, {})]},
    "q_a+kv_a_layernorm": {"small": [(1, 1, 1, X2IN), (1, 2, 3, FLAT), (1, 2, 3, TILES), (1, 1, 3, FLAT),
                                     (1, 4, 3, FLAT), (1, 1, 6, FLAT)],
                           "large": [(1, 1, 1, X2IN), (1, 1, 1, X2OWN), (1, 2, 1, X2IN), (1, 4, 1, X2IN),
                                     (2, 1, 1, X2IN), (2, 2, 1, X2IN), (4, 2, 1, X2IN), (4, 4, 1, X2IN)]},
}


def _same_bytes(a, b) -> bool:
    """Whether two outputs of the fused call ((q, scale), out2, out_res1) are equal byte for byte."""
    pairs = [(a[0][0], b[0][0]), (a[0][1], b[0][1]), (a[1], b[1]), (a[2], b[2])]
    return all((x is None and y is None) or (x is not None and y is not None and torch.equal(x, y)) for x, y in pairs)


def sweep(ms: list[int], t_start: float) -> None:
    say()
    say("== launch-config sweep (ours, CUDA-graph us per call; the default plan is marked *) ==")
    for site, (n1, res, n2) in SITES.items():
        for m in ms:
            if time.time() - t_start > ARGS.time_limit:
                say(f"{site} M={m}: skipped, past --time-limit")
                continue
            args = make_inputs(m, n1, res, n2)
            plan = _plan_of(m, n1, n2)
            row = []
            flags = dict(shuffle=True, scale_shuffle_padding=True)
            want = fused_rms_mxfp4_quant_triton(**args, **flags)
            for bm, warps, split, opts in SWEEP[site]["small" if m < 256 else "large"]:
                name = f"bm{bm}/w{warps}/s{split}" + "".join(f"/{k}={int(v)}" for k, v in opts.items())
                try:
                    got = fused_rms_mxfp4_quant_triton(**args, **flags, block_m=bm, num_warps=warps, split=split,
                                                       **opts)
                    # the same rows and warps sum each row in the same order: the same bytes
                    if (bm, warps, split) == (plan.bm, plan.warps, plan.split) and not _same_bytes(got, want):
                        name += "(BYTES DIFFER)"
                    t = time_graph_us(lambda: fused_rms_mxfp4_quant_triton(
                        **args, shuffle=True, scale_shuffle_padding=True, block_m=bm, num_warps=warps, split=split,
                        **opts), 30)
                    mark = "*" if ((bm, warps, split) == (plan.bm, plan.warps, plan.split)
                                   and all(getattr(plan, k) == v for k, v in opts.items())) else ""
                    row.append(f"{name}{mark}={t:.1f}")
                except Exception as exc:  # noqa: BLE001
                    row.append(f"{name}=ERR({type(exc).__name__})")
            say(f"{site} M={m} (default bm{plan.bm}/w{plan.warps}/s{plan.split}/x2_main={int(plan.x2_main)}"
                f"/flat_sum={int(plan.flat_sum)}): "
                + "  ".join(row))
            del args
            if not ARGS.cpu_smoke:
                torch.cuda.empty_cache()


def ab_flags(ms: list[int]) -> None:
    """Ours with each scale flag setting, alternating (two rounds), at each site and M."""
    flags = {"shuffled+padded": (True, True), "row-major padded": (False, True), "row-major": (False, False)}
    say("== ours by scale flags (CUDA-graph us per call, two alternating rounds) ==")
    for site, (n1, res, n2) in SITES.items():
        for m in ms:
            args = make_inputs(m, n1, res, n2)
            times = {k: [] for k in flags}
            for _ in range(2):
                for k, (sh, pad) in flags.items():
                    times[k].append(time_graph_us(lambda: fused_rms_mxfp4_quant_triton(
                        **args, shuffle=sh, scale_shuffle_padding=pad), 40))
            say(f"{site} M={m}: " + "  ".join(f"{k} {' / '.join(f'{t:.1f}' for t in v)}" for k, v in times.items()))
            del args
            if not ARGS.cpu_smoke:
                torch.cuda.empty_cache()


def main() -> None:
    if not torch.cuda.is_available() and not ARGS.cpu_smoke:
        sys.exit("needs a CUDA device")
    t_start = time.time()
    if ARGS.ab_flags:
        ab_flags([int(v) for v in ARGS.ms.split(",")] if ARGS.ms else [33] if ARGS.cpu_smoke else [4096, 65536])
        return
    import triton

    name = "CPU smoke test (interpreter)" if ARGS.cpu_smoke else torch.cuda.get_device_name()
    say(f"device: {name}  torch {torch.__version__}  triton {triton.__version__}")
    ms = [int(v) for v in ARGS.ms.split(",")] if ARGS.ms else (
        [1, 33] if ARGS.cpu_smoke else [1, 256, 16384] if ARGS.quick else [1, 16, 256, 4096, 16384, 65536])
    budget = 20 if ARGS.quick else 60  # ms of timed work per measurement
    aiter_fused, aiter_quant = load_aiter()
    old_mod = load_old_kernel()
    if old_mod is not None and ARGS.e2m1_exhaustive and not ARGS.cpu_smoke:
        e2m1_exhaustive(old_mod)
    verify_edges()
    best_copy = None
    if not ARGS.cpu_smoke:
        best_copy = copy_ceiling()
        say(f"best copy: {best_copy:.0f} GB/s (read + written); one-byte Triton kernel: {floor_us():.2f} us "
            "per call (the launch floor in a graph)")
    compiled = None
    if not ARGS.no_compile:
        compiled = torch.compile(FQ.fused_rms_mxfp4_quant_reference, dynamic=True)

    rows = []
    for site, (n1, res, n2) in SITES.items():
        for m in ms:
            args = make_inputs(m, n1, res, n2, seed=m)
            status = verify(site, m, args, aiter_fused)
            say(f"check {site} M={m}: {status}")
            if old_mod is not None:
                flags = dict(shuffle=True, scale_shuffle_padding=True)
                bad = check(old_mod.fused_rms_mxfp4_quant_triton(**args, **flags),
                            FQ.fused_rms_mxfp4_quant_reference(**args, **flags), f"old kernel {site} M={m}", True)[0]
                say(f"check old kernel {site} M={m}: {'ok' if not bad else 'FAILED ' + '; '.join(bad)}")
            nbytes = op_bytes(m, n1, res, n2)
            copies = copy_fns(nbytes)
            fns = {
                "ours": lambda: FQ.fused_rms_mxfp4_quant(**args, shuffle=True, scale_shuffle_padding=True,
                                                         backend="triton"),
                "aiter": ((lambda: aiter_fused(**args, shuffle=True, scale_shuffle_padding=True))
                          if aiter_fused else None),
                "compiled": (lambda: compiled(**args, shuffle=True, scale_shuffle_padding=True)) if compiled else None,
                "unfused": unfused_fn(args, n1, aiter_quant),
                "copy_": copies["copy_"],
                "tcopy": copies["triton"],
            }
            if old_mod is not None:
                fns["old"] = lambda: old_mod.fused_rms_mxfp4_quant_triton(**args, shuffle=True,
                                                                           scale_shuffle_padding=True)
            t = {}
            for name, fn in fns.items():
                if fn is None:
                    continue
                if time.time() - t_start > ARGS.time_limit and name != "ours":
                    say(f"  {name} skipped at {site} M={m}: past --time-limit")
                    continue
                try:
                    t[name] = time_graph_us(fn, budget)
                    if name in ("ours", "aiter"):
                        t[name + "_eager"] = time_eager_us(fn, budget)
                except Exception as exc:  # noqa: BLE001 - report and go on
                    say(f"  {name} failed at {site} M={m}: {type(exc).__name__}: {exc}")
                    traceback.print_exc()
            if "copy_" in t or "tcopy" in t:  # the faster of the two copies of the op's bytes
                t["copy"] = min(v for k, v in t.items() if k in ("copy_", "tcopy"))
            rows.append((site, n1, m, nbytes, t))
            del args, copies, fns
            if not ARGS.cpu_smoke:
                torch.cuda.empty_cache()
            say(f"  timed {site} M={m} ({time.time() - t_start:.0f} s so far)")

    say()
    say("== fused RMSNorm + MXFP4 quant, shuffle + padding; us = median device time per call "
        "(CUDA graph), eager = one Python call ==")
    head = (f"{'site':<21}{'N1':>6}{'M':>7} {'ours us':>9}{'eager':>8}{'aiter us':>9}{'eager':>8}"
            f"{'compiled':>9}{'unfused':>9}{'copy us':>9} {'ours GB/s':>10}{'%copy':>7}{'aiter %copy':>12}"
            f"{'x aiter':>8}{'x unfused':>10}{'x compiled':>11}{'old us':>8}{'x old':>7}{'%best':>7}"
            f"{'aiter %best':>12}{'old %best':>10}")
    say(head)
    say("-" * len(head))

    def f(v, w, p=1):
        return f"{v:>{w}.{p}f}" if v is not None else f"{'-':>{w}}"

    for site, n1, m, nbytes, t in rows:
        ours, copy = t.get("ours"), t.get("copy")
        aiter, comp, unf = t.get("aiter"), t.get("compiled"), t.get("unfused")
        gbs = nbytes / ours / 1e3 if ours else None
        pct = 100 * copy / ours if ours and copy else None
        apct = 100 * copy / aiter if aiter and copy else None
        say(f"{site:<21}{n1:>6}{m:>7} {f(ours, 9)}{f(t.get('ours_eager'), 8)}{f(aiter, 9)}"
            f"{f(t.get('aiter_eager'), 8)}{f(comp, 9)}{f(unf, 9)}{f(copy, 9)} {f(gbs, 10, 0)}{f(pct, 7, 0)}"
            f"{f(apct, 12, 0)}{f(aiter / ours if aiter and ours else None, 8, 2)}"
            f"{f(unf / ours if unf and ours else None, 10, 2)}{f(comp / ours if comp and ours else None, 11, 2)}"
            f"{f(t.get('old'), 8)}{f(t['old'] / ours if t.get('old') and ours else None, 7, 2)}"
            f"{f(100 * gbs / best_copy if gbs and best_copy else None, 7, 0)}"
            f"{f(100 * nbytes / aiter / 1e3 / best_copy if aiter and best_copy else None, 12, 0)}"
            f"{f(100 * nbytes / t['old'] / 1e3 / best_copy if t.get('old') and best_copy else None, 10, 0)}")
    say("%copy: against the faster copy (torch copy_ or the Triton copy kernel) of the op's own bytes; %best: "
        "against the best copy of the run (GB/s); x old / x aiter: their time / ours")
    if ARGS.sweep:
        sweep([int(v) for v in ARGS.sweep_ms.split(",")] if ARGS.sweep_ms else
              [1, 33] if ARGS.cpu_smoke else [1, 16, 16384, 65536], t_start)
    say(f"(total {time.time() - t_start:.0f} s)")


if __name__ == "__main__":
    main()
