"""GPU benchmark of the fused (residual add +) RMSNorm + FP8 quant, contenders in one run.

Baseline: a copy of the op's bytes ("x copy": the share of the copy's bandwidth reached);
"x aiter" beside it. At ATOM's two DeepSeek call sites (input_layernorm: N1 = 7168 with the
residual; q_a_layernorm: N1 = 1536 with kv_a_layernorm's x2, N2 = 512), group 128, transposed
scale, e4m3fn, bf16 inputs:

* ours  -- ``layouts.fused_rms_fp8_quant(..., backend="triton")`` (the public call);
* aiter -- aiter's own Triton ``fused_rms_fp8_group_quant`` at the commit ATOM is pinned with
           (the pinned aiter tree, harness/sources.py), compiled for this GPU;
* copy  -- a copy moving the same bytes (read + written): the faster of torch's ``copy_`` and a
           plain Triton copy kernel, at the same size.

Times are medians of CUDA-graph replays (device time, no launch overhead); "GB/s" counts the
bytes the op must read and write. Before timing, each shape is
checked against the torch reference on the GPU (scale within 4 ulp, codes within one step at
most 2 + n/1e5 of them, out_res1 exact, out2 within one bf16 step) and against aiter's bytes.
``--sweep`` times (rows per program, warps) around our plan. Needs a CUDA GPU and the pinned
aiter tree (harness/sources.py); no CPU path.

Example:
    python scripts/bench.py fused-fp8-quant --sweep --out /tmp/fp8.txt
"""

from __future__ import annotations

import argparse
import pathlib

import torch

from layouts._triton_fused_fp8_quant import _plan, fused_rms_fp8_quant_triton
from layouts.fused_fp8_quant import fused_rms_fp8_quant, fused_rms_fp8_quant_reference

from .common import cuda_timing
from .common.args import add_ms, require_compiled_triton
from .common.fused_sites import EPS, SITES, copy_us, make_inputs
from .common.table import Table
from .common.timing import Timed, alternate


def op_bytes(m: int, n1: int, res: bool, n2: int) -> int:
    groups = -(-n1 // 128)
    read = 2 * m * n1 + 2 * n1 + (2 * m * n1 if res else 0) + (2 * m * n2 + 2 * n2 if n2 else 0)
    written = m * n1 + 4 * m * groups + (2 * m * n1 if res else 0) + (2 * m * n2 if n2 else 0)
    return read + written


def check(out, want, what: str) -> str:
    (q, s), out2, res = out
    (wq, ws), wout2, wres = want
    problems = []
    if not torch.allclose(s, ws, rtol=2 ** -21, atol=0):
        problems.append(f"scale off by {float((s / ws - 1).abs().max()):.2e}")
    qa, qb = q.view(torch.uint8).to(torch.int16), wq.view(torch.uint8).to(torch.int16)
    qa, qb = torch.where(qa >= 128, -(qa & 0x7F), qa), torch.where(qb >= 128, -(qb & 0x7F), qb)
    steps = (qa - qb).abs()
    n = int((steps > 0).sum())
    if n > 2 + q.numel() // 100_000 or (n and int(steps.max()) > 1):
        problems.append(f"{n} codes differ (max {int(steps.max())} steps)")
    if wres is not None and not torch.equal(res, wres):
        problems.append("out_res1 differs")
    if wout2 is not None:
        d = (out2.float() - wout2.float()).abs() / wout2.float().abs().clamp_min(1e-30)
        if float(d.max()) > 2 ** -7:
            problems.append("out2 beyond one bf16 step")
    return f"{what}: " + ("; ".join(problems) if problems else f"ok ({n} codes one step off)")


def add_arguments(ap: argparse.ArgumentParser) -> None:
    add_ms(ap, "1,16,256,4096,16384,65536")
    ap.add_argument("--sweep", action="store_true", help="time (rows per program, warps) around our plan")
    ap.add_argument("--ab-cast", action="store_true",
                    help="also time our kernel with the FP8 bytes from _fp8_byte against the GPU's own conversion, "
                         "alternating, and check both")


def run(args: argparse.Namespace) -> None:
    require_compiled_triton(False)
    import aiter_oracle  # tests/
    from harness import sources as engine_sources  # the pinned aiter tree

    _, tree = engine_sources.trees(engine_sources.require(), pathlib.Path("/tmp/bench-fp8-sources"))
    aiter_op = aiter_oracle.pinned_fused_fp8_quant(tree, interpret=False).fused_rms_fp8_group_quant
    print(f"device: {torch.cuda.get_device_name()}; group 128, transpose_scale, e4m3fn, bf16; "
          "us = median of CUDA-graph replays", flush=True)
    for site, (n1, res, n2) in SITES.items():
        for m in args.ms:
            a = make_inputs(m, n1, res, n2, seed=m, device="cuda")
            kw = dict(group_size=128, transpose_scale=True)

            def ours():
                return fused_rms_fp8_quant(**a, **kw, backend="triton")

            def theirs():
                return aiter_op(a["x1"], a["x1_weight"], EPS, a.get("x2"), a.get("x2_weight"), a.get("x2_epsilon"),
                                128, torch.float8_e4m3fn, a.get("res1"), transpose_scale=True)

            want = fused_rms_fp8_quant_reference(**a, **kw)
            (tq, ts), _, t2, tres = theirs()
            print("  check " + check(ours(), want, f"{site} M={m} ours vs reference") + "; "
                  + check(((tq, ts), t2, tres), want, "aiter vs reference"), flush=True)
            nbytes = op_bytes(m, n1, res, n2)
            table = Table("copy", also_against=("aiter",))
            case = f"{site} M={m}"
            table.add("ours", cuda_timing.time_graph_us(ours, 200) * 1e-6, case=case, nbytes=nbytes)
            table.add("aiter", cuda_timing.time_graph_us(theirs, 200) * 1e-6, case=case, nbytes=nbytes)
            table.add("copy", copy_us(nbytes, 60) * 1e-6, case=case, nbytes=nbytes)
            table.print()
            if args.ab_cast:
                variants = {c: (lambda c=c: fused_rms_fp8_quant_triton(**a, **kw, native_cast=c)) for c in (False, True)}
                outs = {c: f() for c, f in variants.items()}
                same = torch.equal(outs[False][0][0].view(torch.uint8), outs[True][0][0].view(torch.uint8))
                print("    cast check " + "; ".join(check(o, want, f"native={c}") for c, o in outs.items())
                      + f"; the two casts' bytes {'identical' if same else 'DIFFER'}", flush=True)
                runs = alternate({name: (lambda f=variants[c]: Timed(cuda_timing.time_graph_us(f, 200) * 1e-6))
                                  for name, c in (("_fp8_byte", False), ("native", True))}, 3)
                ab = Table("_fp8_byte", stat="median", title="    cast A/B, 3 alternating rounds")
                for name, seconds in runs.seconds.items():
                    ab.add(name, seconds, case=case)
                ab.print()
            if args.sweep:
                plan = _plan(m, n1, 128, True, None, None)
                best = []
                for bm in sorted({max(1, plan.bm // 2), plan.bm, plan.bm * 2}):
                    for warps in sorted({max(1, plan.warps // 2), plan.warps, min(16, plan.warps * 2)}):
                        t = cuda_timing.time_graph_us(
                            lambda: fused_rms_fp8_quant_triton(**a, **kw, block_m=bm, num_warps=warps), 60)
                        best.append((t, bm, warps))
                print("    sweep (us, rows, warps): " + "  ".join(f"{t:.2f}/{bm}/{w}" for t, bm, w in sorted(best)[:6])
                      + f"  [plan {plan.bm}/{plan.warps}]", flush=True)
            del a
            torch.cuda.empty_cache()
