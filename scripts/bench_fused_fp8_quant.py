#!/usr/bin/env python3
"""GPU benchmark of the fused (residual add +) RMSNorm + FP8 quant, contenders in one run.

    PYTHONPATH=. python scripts/bench_fused_fp8_quant.py [--ms 1,16,...] [--out FILE] [--sweep]

At ATOM's two DeepSeek call sites (input_layernorm: N1 = 7168 with the residual;
q_a_layernorm: N1 = 1536 with kv_a_layernorm's x2, N2 = 512), group 128, transposed scale,
e4m3fn, bf16 inputs:

* ours  -- ``layouts.fused_rms_fp8_quant(..., backend="triton")`` (the public call);
* aiter -- aiter's own Triton ``fused_rms_fp8_group_quant`` at the commit ATOM is pinned with
           (the pinned aiter tree, scripts/engine_sources.py), compiled for this GPU;
* copy  -- a copy moving the same bytes (read + written): the faster of torch's ``copy_`` and a
           plain Triton copy kernel, at the same size.

Times are medians of CUDA-graph replays (device time, no launch overhead); "GB/s" counts the
bytes the op must read and write; "/copy" is that over the copy's. Before timing, each shape is
checked against the torch reference on the GPU (scale within 4 ulp, codes within one step at
most 2 + n/1e5 of them, out_res1 exact, out2 within one bf16 step) and against aiter's bytes.
``--sweep`` times (rows per program, warps) around our plan.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

REPO = pathlib.Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "tests"), str(REPO / "scripts")]

import torch  # noqa: E402

import cuda_timing  # noqa: E402
from layouts.fused_fp8_quant import fused_rms_fp8_quant, fused_rms_fp8_quant_reference  # noqa: E402
from layouts._triton_fused_fp8_quant import _plan, fused_rms_fp8_quant_triton  # noqa: E402

SITES = {"input_layernorm+res": (7168, True, 0), "q_a+kv_a_layernorm": (1536, False, 512)}
EPS = 1e-6


def make_inputs(m: int, n1: int, res: bool, n2: int) -> dict:
    g = torch.Generator(device="cuda").manual_seed(m)

    def act(rows, cols):
        scale = torch.exp(torch.randn(rows, 1, device="cuda", generator=g) * 1.5)
        return (torch.randn(rows, cols, device="cuda", generator=g) * scale).to(torch.bfloat16)

    def weight(cols):
        return (1 + 0.4 * torch.randn(cols, device="cuda", generator=g)).to(torch.bfloat16)

    args = dict(x1=act(m, n1), x1_weight=weight(n1), x1_epsilon=EPS)
    if res:
        args["res1"] = act(m, n1)
    if n2:
        args.update(x2=act(m, n2), x2_weight=weight(n2), x2_epsilon=EPS)
    return args


def op_bytes(m: int, n1: int, res: bool, n2: int) -> int:
    groups = -(-n1 // 128)
    read = 2 * m * n1 + 2 * n1 + (2 * m * n1 if res else 0) + (2 * m * n2 + 2 * n2 if n2 else 0)
    written = m * n1 + 4 * m * groups + (2 * m * n1 if res else 0) + (2 * m * n2 if n2 else 0)
    return read + written


def copy_us(nbytes: int) -> float:
    import triton
    import triton.language as tl

    @triton.jit
    def copy_words(src, dst, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        tl.store(dst + offs, tl.load(src + offs, mask=offs < n), mask=offs < n)

    words = max(1, nbytes // 8)
    src = torch.ones(words, dtype=torch.int32, device="cuda")
    dst = torch.empty_like(src)
    t1 = cuda_timing.time_graph_us(lambda: dst.copy_(src), 60)
    t2 = cuda_timing.time_graph_us(lambda: copy_words[(triton.cdiv(words, 4096),)](src, dst, words, BLOCK=4096,
                                                                                   num_warps=8), 60)
    return min(t1, t2)


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ms", default="1,16,256,4096,16384,65536")
    ap.add_argument("--out", default=None)
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--ab-cast", action="store_true",
                    help="also time our kernel with the FP8 bytes from _fp8_byte against the GPU's own conversion, "
                         "alternating, and check both")
    args = ap.parse_args()
    lines: list[str] = []

    def say(msg: str) -> None:
        print(msg, flush=True)
        lines.append(msg)
        if args.out:
            pathlib.Path(args.out).write_text("\n".join(lines) + "\n")

    import aiter_oracle
    import engine_sources

    _, tree = engine_sources.trees(engine_sources.require(), pathlib.Path("/tmp/bench-fp8-sources"))
    aiter_op = aiter_oracle.pinned_fused_fp8_quant(tree, interpret=False).fused_rms_fp8_group_quant
    say(f"device: {torch.cuda.get_device_name()}; group 128, transpose_scale, e4m3fn, bf16")
    say(f"{'site':22} {'M':>6} {'ours us':>9} {'aiter us':>9} {'copy us':>8} {'ours GB/s':>10} "
        f"{'/copy':>6} {'aiter/copy':>10} {'ours/aiter':>10}")
    for site, (n1, res, n2) in SITES.items():
        for m in [int(v) for v in args.ms.split(",")]:
            a = make_inputs(m, n1, res, n2)
            kw = dict(group_size=128, transpose_scale=True)

            def ours():
                return fused_rms_fp8_quant(**a, **kw, backend="triton")

            def theirs():
                return aiter_op(a["x1"], a["x1_weight"], EPS, a.get("x2"), a.get("x2_weight"), a.get("x2_epsilon"),
                                128, torch.float8_e4m3fn, a.get("res1"), transpose_scale=True)

            want = fused_rms_fp8_quant_reference(**a, **kw)
            (tq, ts), _, t2, tres = theirs()
            say("  check " + check(ours(), want, f"{site} M={m} ours vs reference") + "; "
                + check(((tq, ts), t2, tres), want, "aiter vs reference"))
            nbytes = op_bytes(m, n1, res, n2)
            t_ours = cuda_timing.time_graph_us(ours, 200)
            t_aiter = cuda_timing.time_graph_us(theirs, 200)
            t_copy = copy_us(nbytes)
            say(f"{site:22} {m:>6} {t_ours:>9.2f} {t_aiter:>9.2f} {t_copy:>8.2f} {nbytes / t_ours / 1e3:>10.0f} "
                f"{t_copy / t_ours:>6.2f} {t_copy / t_aiter:>10.2f} {t_aiter / t_ours:>10.2f}")
            if args.ab_cast:
                variants = {c: (lambda c=c: fused_rms_fp8_quant_triton(**a, **kw, native_cast=c)) for c in (False, True)}
                outs = {c: f() for c, f in variants.items()}
                same = torch.equal(outs[False][0][0].view(torch.uint8), outs[True][0][0].view(torch.uint8))
                say("    cast check " + "; ".join(check(o, want, f"native={c}") for c, o in outs.items())
                    + f"; the two casts' bytes {'identical' if same else 'DIFFER'}")
                times = {c: [] for c in variants}
                for _ in range(3):  # alternating: the machine drifts
                    for c, f in variants.items():
                        times[c].append(cuda_timing.time_graph_us(f, 200))
                med = {c: sorted(v)[1] for c, v in times.items()}
                say(f"    cast A/B (median of 3, us): _fp8_byte {med[False]:.2f}, native {med[True]:.2f}, "
                    f"native / _fp8_byte {med[True] / med[False]:.3f}")
            if args.sweep:
                plan = _plan(m, n1, 128, True, None, None)
                best = []
                for bm in sorted({max(1, plan.bm // 2), plan.bm, plan.bm * 2}):
                    for warps in sorted({max(1, plan.warps // 2), plan.warps, min(16, plan.warps * 2)}):
                        t = cuda_timing.time_graph_us(
                            lambda: fused_rms_fp8_quant_triton(**a, **kw, block_m=bm, num_warps=warps), 60)
                        best.append((t, bm, warps))
                say("    sweep (us, rows, warps): " + "  ".join(f"{t:.2f}/{bm}/{w}" for t, bm, w in sorted(best)[:6])
                    + f"  [plan {plan.bm}/{plan.warps}]")
            del a
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
