"""GPU benchmark of the fused (residual add +) RMSNorm + MXFP4 quant, all contenders in one run.

Baseline: a copy of the op's bytes ("x copy": the share of the copy's bandwidth reached), with
"x aiter" beside it. Contenders, each on the same inputs (bf16, shuffle=True and scale_shuffle_padding=True, the
ASM-GEMM flags):

* ours      -- ``layouts.fused_rms_mxfp4_quant(..., backend="triton")`` (the public call);
* aiter     -- aiter's own Triton ``fused_rms_mxfp4_quant``, loaded from the pinned oracle files
               (``.cache/aiter-oracle`` or ``--aiter-dir``) without aiter's package init;
* compiled  -- ``torch.compile`` of our torch reference (``fused_rms_mxfp4_quant_reference``);
* unfused   -- torch ops for the residual add and ``F.rms_norm``, then aiter's separate
               ``dynamic_mxfp4_quant`` Triton kernel (row-major scale, no shuffle: a lower bound
               on what the unfused sequence costs);
* blocks, runs, lanes -- with ``--tile-orders``: our kernel with each row layout forced, block-major
               (``run_tiles=False``), run-major (``run_tiles=True``, where they fit; also on one warp
               a row, "1w", with the norm weights loaded with the rows, "+w", or as persistent
               programs, "+pN") and lane blocks (``lane_blocks=True``, q_a-sized rows), each
               checked like ours at all three flag settings ("ours" is the plan's default);
* old       -- with ``--old-kernel REV`` (a git revision, or a copy of the kernel file): an earlier
               version of our kernel, loaded beside ours (before/after in one run);
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
``--cpu-smoke`` runs it all on the CPU under Triton's interpreter (tiny shapes, wall-clock times).

Example:
    python scripts/bench.py fused-quant --sweep --time-limit 255 --out /tmp/fq.txt
    python scripts/bench.py fused-quant --cpu-smoke --no-compile
"""

from __future__ import annotations

import argparse
import functools
import itertools
import os
import pathlib
import sys
import time
import traceback

import torch

from layouts import fused_quant as FQ
from layouts._triton_fused_quant import fused_rms_mxfp4_quant_triton
from layouts.mxfp4 import unpack_fp4
from layouts.shuffle import unshuffle_scale

from .common import cuda_timing
from .common.args import add_cpu_smoke, add_ms, int_list, require_compiled_triton
from .common.fused_sites import EPS, SITES, copy_fns, make_inputs
from .common.table import Table
from .common.timing import Timed, alternate

# The run's options and device, set by run(): every helper below reads them (the CPU smoke run
# changes tolerances, shapes and timing throughout).
ARGS = argparse.Namespace(cpu_smoke=False)
DEVICE = "cuda"
# (shuffle, scale_shuffle_padding) of every check: row-major, padded, S32x8
FLAG_SETTINGS = ((False, False), (False, True), (True, True))
# --tile-orders: each row layout forced, by its name in the tables (name: the plan's overrides): block-
# major, run-major as planned, run-major on one warp a row, and either with the norm weights loaded
# with the rows (w_early) or as persistent programs (+pN: N a multiprocessor; +pNsK: pipelined by
# Triton, K stages, the weights held with +w); lane blocks (a block's values in one thread; q_a-sized
# rows only) on one or two warps, unpacked late (+u), persistent (+pNsK)
TILE_ORDERS = {"blocks": dict(run_tiles=False), "runs": dict(run_tiles=True, w_early=False),
               "runs+w": dict(run_tiles=True, w_early=True), "runs1w": dict(run_tiles=True, run_warps=1, w_early=False),
               "runs1w+w": dict(run_tiles=True, run_warps=1, w_early=True),
               "runs+p4": dict(run_tiles=True, persist=4), "runs+p8": dict(run_tiles=True, persist=8),
               "runs1w+p8": dict(run_tiles=True, run_warps=1, persist=8),
               "runs+p8s3": dict(run_tiles=True, persist=8, stages=3),
               "runs+w+p8s3": dict(run_tiles=True, persist=8, stages=3, w_early=True),
               "runs1w+p16s3": dict(run_tiles=True, run_warps=1, persist=16, stages=3),
               "runs+p4s2": dict(run_tiles=True, persist=4, stages=2),
               "lanes": dict(lane_blocks=True), "lanes2w": dict(lane_blocks=True, run_warps=2),
               "lanes+u": dict(lane_blocks=True, unpack_late=True),
               "lanes2w+u": dict(lane_blocks=True, run_warps=2, unpack_late=True),
               "lanes+u+p8s2": dict(lane_blocks=True, unpack_late=True, persist=8, stages=2)}


def _tile_orders(names: str) -> dict:
    """--tile-orders' value: the named entries of TILE_ORDERS."""
    unknown = [n for n in names.split(",") if n not in TILE_ORDERS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown tile order(s) {', '.join(unknown)}; known: {', '.join(TILE_ORDERS)}")
    return {n: TILE_ORDERS[n] for n in names.split(",")}


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--quick", action="store_true", help="fewer shapes and shorter timing")
    ap.add_argument("--aiter-dir", default=None, help="unpacked amd-aiter files (default .cache/aiter-oracle)")
    ap.add_argument("--sweep", action="store_true", help="also time launch configs around our default plan")
    ap.add_argument("--ab-flags", action="store_true",
                    help="only time ours with the scale shuffled + padded, row-major padded and row-major, "
                         "alternating twice in this process (what the shuffle costs)")
    ap.add_argument("--sweep-ms", type=int_list, default=None,
                    help="comma-separated M values of the sweep (default: 1,16,16384,65536)")
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile contender")
    add_ms(ap, None, "1,16,256,4096,16384,65536")
    ap.add_argument("--time-limit", type=float, default=240,
                    help="seconds after which the remaining contenders are skipped (the table still prints)")
    ap.add_argument("--old-kernel", default=None,
                    help="an earlier version of our kernel, timed (and checked) beside ours as 'old': a git "
                         "revision (e.g. HEAD~3), or a copy of layouts/_triton_fused_quant.py (with its folder's "
                         "_triton_fused_quant_tiles.py, where there is one)")
    ap.add_argument("--tile-orders", nargs="?", const=",".join(TILE_ORDERS), default=None, type=_tile_orders,
                    metavar="NAMES",
                    help="also time our kernel with each row layout forced, 'blocks' (run_tiles=False) and 'runs' "
                         "(run_tiles=True, where they fit), the latter also on one warp a row ('runs1w'), with "
                         "the norm weights loaded with the rows ('+w') or as persistent programs ('+pN', N a "
                         "multiprocessor; '+pNsK': pipelined by Triton, K stages), and lane blocks ('lanes', 'lanes2w'; '+u': unpacked late; q_a-sized rows "
                         "only); NAMES (comma-separated) picks some; with --sass, count each")
    ap.add_argument("--sass", action="store_true",
                    help="only compile our kernel for an H100 (sm_90, no GPU needed) at both sites and print its "
                         "registers and SASS instruction counts (the row program's and by opcode)")
    ap.add_argument("--e2m1-exhaustive", action="store_true",
                    help="compare our E2M1 encoding with the old kernel's on all 2^32 float32 values (GPU)")
    add_cpu_smoke(ap)


# ------------------------------------------------------------------------------------- timing
def time_eager_us(fn, budget_ms: float) -> float:
    return cuda_timing.time_eager_us(fn, budget_ms, cpu=ARGS.cpu_smoke)


def time_graph_us(fn, budget_ms: float) -> float:
    return cuda_timing.time_graph_us(fn, budget_ms, cpu=ARGS.cpu_smoke)


def copy_ceiling() -> float:
    """The machine's best copy in this run (GB/s, read + written): torch ``copy_`` and the Triton
    copy at sizes from 64 MiB to 4 GiB moved; prints each."""
    best, row = 0.0, []
    for mib in (64, 256, 1024, 4096):
        nbytes = mib << 20
        for name, fn in copy_fns(nbytes, DEVICE).items():
            gbs = nbytes / time_graph_us(fn, 100) / 1e3
            row.append(f"{name}@{mib}MiB={gbs:.0f}")
            best = max(best, gbs)
        torch.cuda.empty_cache()
    print("copy GB/s (read + written), CUDA graph: " + "  ".join(row))
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
    for shuffle, padding in FLAG_SETTINGS:
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
        print("  FAIL " + p)
    return ("ok; " if not problems else "FAILED; ") + "; ".join(notes)


def verify_edges() -> None:
    """Shapes and dtypes the timed sites do not cover: partial blocks, fp16, strided rows."""
    cases = []
    for m, n1, res, n2, dtype in ((33, 80, True, 0, torch.bfloat16), (300, 512, True, 512, torch.bfloat16),
                                  (33, 1536, True, 512, torch.float16), (1, 7168, True, 512, torch.float32)):
        args = make_inputs(m, n1, res, n2, seed=n1, device=DEVICE)
        cases.append((f"M={m} N1={n1} {str(dtype)[6:]}", {k: (v.to(dtype) if torch.is_tensor(v) else v)
                                                          for k, v in args.items()}))
    args = make_inputs(45, 7168, True, 0, seed=5, device=DEVICE)
    wide = torch.zeros(45, 7169, dtype=torch.bfloat16, device=DEVICE)[:, 1:]  # odd offset: unpaired
    wide.copy_(args["x1"])
    cases.append(("M=45 N1=7168 strided x1", dict(args, x1=wide)))
    problems = []
    for name, args in cases:
        for shuffle, padding in FLAG_SETTINGS:
            out = FQ.fused_rms_mxfp4_quant(**args, shuffle=shuffle, scale_shuffle_padding=padding, backend="triton")
            want = FQ.fused_rms_mxfp4_quant_reference(**args, shuffle=shuffle, scale_shuffle_padding=padding)
            problems += check(out, want, f"{name} shuffle={shuffle} pad={padding}", shuffle)[0]
    for p in problems:
        print("  FAIL " + p)
    print(f"check edge cases ({len(cases)} shapes x 3 flag settings): {'ok' if not problems else 'FAILED'}")


# ----------------------------------------------------------------------------------- contenders
def load_aiter():
    import aiter_oracle

    fused = quant = None
    try:
        fused = aiter_oracle.triton_ops_module("fused_mxfp4_quant", interpret=ARGS.cpu_smoke).fused_rms_mxfp4_quant
    except Exception as exc:  # noqa: BLE001 - reported, the rest of the bench still runs
        print(f"aiter fused_rms_mxfp4_quant unavailable: {type(exc).__name__}: {exc}")
    try:
        quant = aiter_dynamic_quant(aiter_oracle.triton_ops_module("quant", interpret=ARGS.cpu_smoke))
    except Exception as exc:  # noqa: BLE001
        print(f"aiter dynamic_mxfp4_quant unavailable: {type(exc).__name__}: {exc}")
    return fused, quant


KERNEL_FILES = ("_triton_fused_quant.py", "_triton_fused_quant_tiles.py")  # the second since 2026-12-07


def load_old_kernel():
    """The old kernel's module, loaded beside ours as a package of its own (``_old_kernel``): from
    a git revision (``git show REV:layouts/<file>``) or from a kernel file (with the tiles module
    of its folder, where there is one), since the kernel imports its device functions relatively."""
    if not ARGS.old_kernel:
        return None
    import importlib
    import subprocess
    import tempfile

    root = pathlib.Path(tempfile.mkdtemp(prefix="old-kernel-"))
    pkg = root / "_old_kernel"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    given = pathlib.Path(ARGS.old_kernel)
    for i, name in enumerate(KERNEL_FILES):
        if given.is_file():
            src = given if i == 0 else given.parent / name
            if src.is_file():
                (pkg / name).write_bytes(src.read_bytes())
            continue
        repo = pathlib.Path(__file__).resolve().parents[2]
        r = subprocess.run(["git", "-C", str(repo), "show", f"{ARGS.old_kernel}:layouts/{name}"], capture_output=True)
        if r.returncode == 0:
            (pkg / name).write_bytes(r.stdout)
        elif i == 0:
            raise SystemExit(f"error: --old-kernel {ARGS.old_kernel}: neither a file nor a git revision holding "
                             f"layouts/{name} ({r.stderr.decode().strip()})")
    sys.path.insert(0, str(root))
    return importlib.import_module("_old_kernel._triton_fused_quant")


def sass_counts(ms: list[int]) -> None:
    """Our kernel compiled for sm_90 as a launch at each site and M would be (no GPU: Triton's own
    ptxas and cuobjdump): registers, and SASS instructions a lane from the start to the first
    unconditional EXIT (the row program: pad and fill programs branch off before it)."""
    import collections
    import re
    import subprocess
    import tempfile

    import triton
    from triton.backends.compiler import GPUTarget

    from layouts._triton_fused_quant import compile_offline

    cuobjdump = pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    print(f"our kernel for sm_90, triton {triton.__version__} (offline)")
    orders = ARGS.tile_orders or {"": {}}  # {}: the plan's
    for site, (n1, res, n2) in SITES.items():
        for (order, plan), m in itertools.product(orders.items(), ms):
            try:
                ck = compile_offline(GPUTarget("cuda", 90, 32), m, n1, n2, res, **plan)
            except ValueError as exc:  # a row layout this site's rows do not fit
                print(f"{site} M={m} {order}: {exc}")
                continue
            with tempfile.TemporaryDirectory() as d:
                cubin = pathlib.Path(d) / "k.cubin"
                cubin.write_bytes(ck.asm["cubin"])
                usage = subprocess.run([str(cuobjdump), "-res-usage", str(cubin)], capture_output=True, text=True).stdout
                sass = subprocess.run([str(cuobjdump), "-sass", str(cubin)], capture_output=True, text=True).stdout
            regs = re.search(r"REG:(\d+)", usage)
            ops, total, ended, loop = [], 0, False, None
            for addr, pred, op, rest in re.findall(
                    r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z0-9_.]+)([^;]*);", sass):
                total += 1
                target = re.search(r"0x([0-9a-f]+)", rest) if op.startswith("BRA") else None
                if not ended:
                    ops.append((int(addr, 16), op))
                    ended = op == "EXIT" and not pred
                    if target and int(target.group(1), 16) < int(addr, 16):  # a persistent program's row loop
                        loop = (int(target.group(1), 16), int(addr, 16))
            # A persistent loop does two row blocks an iteration, one with `stages` (see the kernel).
            per = 2 if loop and plan.get("run_tiles") and not plan.get("stages") else 1
            if loop:
                ops = [(a, o) for a, o in ops if loop[0] <= a <= loop[1]]
                where = f"{len(ops) / per:.0f} instructions a lane a row block in the row loop"
            else:
                where = f"{len(ops)} instructions a lane in the row program"
            top = [(o, c // per) for o, c in collections.Counter(o.split(".")[0] for _, o in ops).most_common(8)]
            print(f"{site} M={m}{' ' + order if order else ''}: {regs.group(1) if regs else '?'} registers, "
                  f"{where} ({total} in the kernel): " + ", ".join(f"{o} {c}" for o, c in top))


def e2m1_exhaustive(old_mod) -> None:
    """Every float32 bit pattern through our E2M1 encoding of 4-pair runs (the kernel's PTX
    block), through the same steps as the interpreter takes them (compiled for this GPU) and
    through the old kernel's encoding (its ``_e2m1_pairs``, ``_e2m1_pair`` or the compare-based
    ``_e2m1_code`` of older kernels); prints the mismatch counts and how many values were compared. Every pattern
    goes through each pass twice, in two different slots of a run (even and odd of pairs 0-3)."""
    import triton
    import triton.language as tl

    from layouts import _triton_fused_quant_tiles as new_mod

    old_tiles = sys.modules.get(old_mod.__name__.rsplit(".", 1)[0] + "._triton_fused_quant_tiles")
    g = globals()
    g["_new_pairs"] = new_mod._e2m1_pairs
    # The old kernel's encoding, whichever it has: 4-pair runs, one pair, or one value.
    olds = [(name, getattr(mod, name, None)) for mod, name in
            ((old_tiles, "_e2m1_pairs"), (old_tiles, "_e2m1_pair"), (old_mod, "_e2m1_code"))]
    mode = next((i for i, (_, fn) in enumerate(olds) if fn is not None), None)
    if mode is None:
        print("E2M1 encoding: the old kernel has none of _e2m1_pairs, _e2m1_pair, _e2m1_code; not compared")
        return
    old_name, g["_old_enc"] = olds[mode]

    @triton.jit
    def kernel(count_ptr, idx_ptr, base, BLOCK: tl.constexpr, MODE: tl.constexpr):
        # [BLOCK // 8, 4] pairs, loaded as in the fused kernel (4 contiguous per thread): even
        # slots take patterns base + 2i, odd slots base + 2i + 1; then all of them inverted.
        r = tl.arange(0, BLOCK // 8)[:, None] * 4 + tl.arange(0, 4)[None, :]
        i = tl.load(idx_ptr + r)  # = r, from memory so the layout is the kernel's
        be = (base + tl.program_id(0).to(tl.int64) * BLOCK + 2 * i).to(tl.uint32)
        bo = be + 1
        for rev in tl.static_range(2):
            if rev == 1:
                be, bo = ~bo, ~be  # every pattern again, in another slot
            ve = be.to(tl.float32, bitcast=True)
            vo = bo.to(tl.float32, bitcast=True)
            new = _new_pairs(ve, vo, True).to(tl.uint32)  # noqa: F821 - set in globals above
            steps = _new_pairs(ve, vo, False).to(tl.uint32)  # noqa: F821
            if MODE == 0:
                old = _old_enc(ve, vo, True).to(tl.uint32)  # noqa: F821
            elif MODE == 1:
                old = _old_enc(ve, vo, True) & 0xFF  # noqa: F821
            else:
                old = _old_enc(ve) | (_old_enc(vo) << 4)  # noqa: F821
            tl.atomic_add(count_ptr, tl.sum(tl.sum((new != old).to(tl.int64), axis=1), axis=0))
            tl.atomic_add(count_ptr + 1, tl.sum(tl.sum((new != steps).to(tl.int64), axis=1), axis=0))
            tl.atomic_add(count_ptr + 2, tl.sum(tl.sum((new == new).to(tl.int64), axis=1), axis=0) * 2)

    count = torch.zeros(3, dtype=torch.int64, device="cuda")
    block, per_launch = 2048, 1 << 30
    idx = torch.arange(block // 2, dtype=torch.int32, device="cuda")
    t0 = time.time()
    for base in range(0, 1 << 32, per_launch):
        kernel[(per_launch // block,)](count, idx, base, BLOCK=block, MODE=mode)
    torch.cuda.synchronize()
    bad_old, bad_steps, values = (int(c) for c in count.tolist())
    print(f"E2M1 encoding, {values:,} float32 values (every pattern twice, in two slots of a run): the PTX block "
          f"vs the old kernel's {old_name}: {bad_old} bytes differ; vs the "
          f"interpreter's steps compiled: {bad_steps} differ ({time.time() - t0:.1f} s)")


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
    print()
    print("== launch-config sweep (ours, CUDA-graph us per call; the default plan is marked *) ==")
    for site, (n1, res, n2) in SITES.items():
        for m in ms:
            if time.time() - t_start > ARGS.time_limit:
                print(f"{site} M={m}: skipped, past --time-limit")
                continue
            args = make_inputs(m, n1, res, n2, seed=0, device=DEVICE)
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
            print(f"{site} M={m} (default bm{plan.bm}/w{plan.warps}/s{plan.split}/x2_main={int(plan.x2_main)}"
                f"/flat_sum={int(plan.flat_sum)}): "
                + "  ".join(row))
            del args
            if not ARGS.cpu_smoke:
                torch.cuda.empty_cache()


def ab_flags(ms: list[int]) -> None:
    """Ours with each scale flag setting, alternating (two rounds), at each site and M."""
    flags = {"shuffled+padded": (True, True), "row-major padded": (False, True), "row-major": (False, False)}
    table = Table("row-major", title="== ours by scale flags (CUDA-graph time per call, two alternating rounds) ==")
    for site, (n1, res, n2) in SITES.items():
        for m in ms:
            args = make_inputs(m, n1, res, n2, seed=0, device=DEVICE)
            runs = alternate({k: (lambda sh=sh, pad=pad: Timed(1e-6 * time_graph_us(
                lambda: fused_rms_mxfp4_quant_triton(**args, shuffle=sh, scale_shuffle_padding=pad), 40)))
                for k, (sh, pad) in flags.items()}, 2)
            for k, seconds in runs.seconds.items():
                table.add(k, seconds, case=f"{site} M={m}")
            del args
            if not ARGS.cpu_smoke:
                torch.cuda.empty_cache()
    table.print()


def run(args: argparse.Namespace) -> None:
    global ARGS, DEVICE
    ARGS, DEVICE = args, "cpu" if args.cpu_smoke else "cuda"
    if args.sass:
        sass_counts(ARGS.ms or [4096])
        return
    require_compiled_triton(args.cpu_smoke)
    if args.aiter_dir:  # read when tests/aiter_oracle.py is first imported (load_aiter)
        os.environ["PREP_AITER_ORACLE_DIR"] = str(pathlib.Path(args.aiter_dir).resolve())
    if not torch.cuda.is_available() and not ARGS.cpu_smoke:
        sys.exit("needs a CUDA device")
    t_start = time.time()
    if ARGS.ab_flags:
        ab_flags(ARGS.ms or ([33] if ARGS.cpu_smoke else [4096, 65536]))
        return
    import triton

    name = "CPU smoke test (interpreter)" if ARGS.cpu_smoke else torch.cuda.get_device_name()
    print(f"device: {name}  torch {torch.__version__}  triton {triton.__version__}")
    ms = ARGS.ms or (
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
        print(f"best copy: {best_copy:.0f} GB/s (read + written); one-byte Triton kernel: {floor_us():.2f} us "
            "per call (the launch floor in a graph)")
    compiled = None
    if not ARGS.no_compile:
        compiled = torch.compile(FQ.fused_rms_mxfp4_quant_reference, dynamic=True)

    rows = []
    for site, (n1, res, n2) in SITES.items():
        for m in ms:
            args = make_inputs(m, n1, res, n2, seed=m, device=DEVICE)
            status = verify(site, m, args, aiter_fused)
            print(f"check {site} M={m}: {status}")
            if old_mod is not None:
                flags = dict(shuffle=True, scale_shuffle_padding=True)
                bad = check(old_mod.fused_rms_mxfp4_quant_triton(**args, **flags),
                            FQ.fused_rms_mxfp4_quant_reference(**args, **flags), f"old kernel {site} M={m}", True)[0]
                print(f"check old kernel {site} M={m}: {'ok' if not bad else 'FAILED ' + '; '.join(bad)}")
            nbytes = op_bytes(m, n1, res, n2)
            copies = copy_fns(nbytes, DEVICE)
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
            for order, plan in (ARGS.tile_orders or {}).items():
                bad = []
                try:
                    for sh, pad in FLAG_SETTINGS:
                        bad += check(fused_rms_mxfp4_quant_triton(**args, shuffle=sh, scale_shuffle_padding=pad,
                                                                  **plan),
                                     FQ.fused_rms_mxfp4_quant_reference(**args, shuffle=sh, scale_shuffle_padding=pad),
                                     f"{order} {site} M={m}", sh)[0]
                    print(f"check {order} {site} M={m}: {'ok' if not bad else 'FAILED ' + '; '.join(bad)}")
                    fns[order] = functools.partial(fused_rms_mxfp4_quant_triton, **args, shuffle=True,
                                                   scale_shuffle_padding=True, **plan)
                except ValueError as exc:  # split rows (small M): the plan has no run-major tiles
                    print(f"{order} {site} M={m}: {exc}")
            t = {}
            for name, fn in fns.items():
                if fn is None:
                    continue
                if time.time() - t_start > ARGS.time_limit and name not in ("ours", *TILE_ORDERS):
                    print(f"  {name} skipped at {site} M={m}: past --time-limit")
                    continue
                try:
                    t[name] = time_graph_us(fn, budget)
                    if name in ("ours", "aiter"):
                        t[name + "_eager"] = time_eager_us(fn, budget)
                except Exception as exc:  # noqa: BLE001 - report and go on
                    print(f"  {name} failed at {site} M={m}: {type(exc).__name__}: {exc}")
                    traceback.print_exc()
            if "copy_" in t or "tcopy" in t:  # the faster of the two copies of the op's bytes
                t["copy"] = min(v for k, v in t.items() if k in ("copy_", "tcopy"))
            rows.append((site, n1, m, nbytes, t))
            del args, copies, fns
            if not ARGS.cpu_smoke:
                torch.cuda.empty_cache()
            print(f"  timed {site} M={m} ({time.time() - t_start:.0f} s so far)")

    table = Table("copy", also_against=("aiter",),
                  title="\n== fused RMSNorm + MXFP4 quant, shuffle + padding; time = median device time per call "
                        "(CUDA graph), eager = one Python call ==")
    for site, n1, m, nbytes, t in rows:
        for name in ("ours", *TILE_ORDERS, "aiter", "compiled", "unfused", "old", "copy"):
            if name not in t:
                continue
            notes = {"eager": f"{t[name + '_eager']:.1f} us"} if name + "_eager" in t else {}
            if best_copy:
                notes["of_best_copy"] = f"{100 * nbytes / t[name] / 1e3 / best_copy:.0f}%"
            table.add(name, t[name] * 1e-6, case=f"{site} N1={n1} M={m}", nbytes=nbytes, **notes)
    table.print()
    print("copy: the faster of torch copy_ and the Triton copy kernel, of the op's own bytes; of best copy: "
          "against the best copy of the run (GB/s)")
    if ARGS.sweep:
        sweep(ARGS.sweep_ms or ([1, 33] if ARGS.cpu_smoke else [1, 16, 16384, 65536]), t_start)
    print(f"(total {time.time() - t_start:.0f} s)")
