"""aiter's Triton MXFP4 GEMMs compiled for this GPU, on the bytes of real conversions: checks, then timing.

Baseline: ``torch.matmul`` of the dequantized bf16 operands (the GEMM an engine without MXFP4
kernels runs), timed beside each kernel. The kernels are aiter's ``gemm_afp4wfp4``, ``gemm_afp4wfp4_preshuffled_scales`` and
``gemm_afp4wfp4_preshuffled_weight_scales`` from the pinned wheel's files (.cache/aiter-oracle), loaded
by tests/aiter_oracle.py with aiter's arch detection stubbed (gfx950) and the AMD-only launch keys
dropped from its configs, then compiled by this machine's Triton (nothing is interpreted unless
``--cpu-smoke``). Every weight is what ``layouts.load_rank`` returns from a ``prep convert`` of a
generated Quark checkpoint, ``non-shuffle`` for the first kernel, ``preshuffle`` (W16 weight, S32x8
scale) for the preshuffle-weight kernel, the non-shuffle weight with the preshuffle conversion's
S32x8 scale for the preshuffled-scales kernel (as tests/test_consumer_kernels.py pairs them).
Activations come from ``layouts.fused_rms_mxfp4_quant`` (our Triton kernel on a GPU) with the flags of
each kernel's engine path.

1. Checks: tiny v2 and r1-0528 checkpoints at TP 1, 2, 4 (every dense MXFP4 module, whole tensors,
   M in 1, 16, 31, 32, 33, 256, float32 output), then the DeepSeek shapes below; each output against
   the float64 product of the dequantized operands, within ``K * 2**-24 * (|A| @ |W|^T)`` (plus half a
   bf16 step of |ref| for bf16 output). A kernel that fails to compile or launch is reported with its
   error, not skipped silently.
2. Timing at DeepSeek shapes (generated with DeepSeek-V3's dims, random codes, converted): q_b_proj
   1536 -> 24576 and o_proj 16384 -> 7168 and fused_qkv_a_proj 7168 -> 2112 at TP 1, the dense
   MLP's gate_up_proj 7168 -> 4608 and down_proj 2304 -> 7168 at TP 8 (rank 0), for M in --ms, bf16
   output. Beside each, in the same run: ``torch.matmul`` of the dequantized bf16 activation and
   weight (the bf16 GEMM an engine without MXFP4 kernels would run). Times are medians of CUDA-graph
   replays; every call in a replay reads its own copy of the weight (enough copies to exceed the L2
   cache), so decode sizes read the weight from HBM as an engine's layer-by-layer calls do.

``--cpu-smoke`` runs it all on the CPU under Triton's interpreter (tiny shapes, wall-clock times).

Example:
    python3 scripts/bench.py gemm --workdir /tmp/g --out /tmp/gemm.txt
    python3 scripts/bench.py gemm --cpu-smoke --skip-check
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import shutil
import sys
import tempfile
import time
import traceback

import torch

import layouts
from layouts.engines import get_engine
from prep.convert import convert
from prep.deepseek import target_for
from prep.reference.aiter_gemm import DENSE_MODULES
from prep.testing import SynthSpec, write_checkpoint

from .common import cuda_timing
from .common.args import add_cpu_smoke, add_ms, require_compiled_triton
from .common.table import Table

ATOM = get_engine("atom")  # the engine this benchmark converts for and runs as

# The run's options and device, set by run(): the CPU smoke run changes tolerances, shapes and
# timing throughout.
ARGS = argparse.Namespace(cpu_smoke=False)
DEVICE = "cuda"


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--skip-check", action="store_true", help="no tiny-checkpoint checks")
    ap.add_argument("--skip-time", action="store_true", help="no DeepSeek-shape timing")
    add_ms(ap, "1,16,128,4096")
    ap.add_argument("--workdir", default=None, help="where checkpoints are generated (default: a temp folder)")
    ap.add_argument("--time-limit", type=float, default=420, help="seconds after which timing stops")
    add_cpu_smoke(ap)


NON_SHUFFLE = "gemm_afp4wfp4"
PS_WEIGHT = "gemm_afp4wfp4_preshuffled_weight_scales"
PS_SCALES = "gemm_afp4wfp4_preshuffled_scales"
KERNELS = (NON_SHUFFLE, PS_WEIGHT, PS_SCALES)
MODULES = DENSE_MODULES
EPS = 1e-6


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


# ------------------------------------------------------------------------------------- weights
@dataclasses.dataclass
class Weight:
    """One dense MXFP4 linear of one rank, as each kernel takes it, and its float64 values."""

    name: str
    n: int
    k: int
    raw_w: torch.Tensor  # non-shuffle conversion [N, K/2]
    raw_s: torch.Tensor  # [N, K/32]
    w16: torch.Tensor  # preshuffle conversion, W16 viewed [N/16, 16*K/2]
    s32: torch.Tensor  # S32x8 viewed [pad256(N)/32, 32*pad8(K/32)]
    ref: torch.Tensor | None  # float64 [N, K] (None once freed)


def load_weight(ns: layouts.RankTensors, ps: layouts.RankTensors, prefix: str) -> Weight:
    w_raw, s_raw = ns[prefix + ".weight"], ns[prefix + ".weight_scale"]
    w16, s32 = ps[prefix + ".weight"], ps[prefix + ".weight_scale"]
    assert not w_raw.is_shuffled and w16.is_shuffled, prefix
    n, k = w_raw.shape[0], 2 * w_raw.shape[1]
    shapes = (n, k // 2), (n, -(-k // 32))
    ref = layouts.dequant.dequantize_stored(w16, s32, layouts.get_layout("preshuffle"), *shapes).double()
    raw_ref = layouts.dequant.dequantize_stored(w_raw, s_raw, layouts.get_layout("non-shuffle"), *shapes).double()
    if not torch.equal(ref, raw_ref):
        raise AssertionError(f"{prefix}: the two conversions hold different numbers")
    del raw_ref
    return Weight(prefix.rsplit(".", 1)[-1], n, k, w_raw, s_raw, w16.view(n // 16, -1),
                  s32.view(s32.shape[0] // 32, -1), ref)


def with_slack(t: torch.Tensor, nbytes: int, value: int = 0x7F) -> torch.Tensor:
    """A copy of ``t`` followed in memory by ``nbytes`` bytes of ``value``: gemm_afp4wfp4 loads its
    scales unmasked in steps of 8 columns, so for K % 256 != 0 it reads up to pad8(K/32) - K/32
    bytes past the end of a raw scale (docs/consumer-kernels.md); on load_rank's views those bytes
    are the next tensor of the file, and past the end of an allocation a GPU read can fault."""
    flat = torch.full((t.numel() + nbytes,), value, dtype=torch.uint8, device=t.device)
    flat[: t.numel()] = t.reshape(-1)
    return flat[: t.numel()].view(t.shape)


def over_read(k: int) -> int:
    return -(-k // 256) * 8 - k // 32


def kernel_runs(kernel: str, m: int, k: int) -> str:
    """'' when aiter's wrapper accepts this (kernel, M, K), else why not (docs/consumer-kernels.md)."""
    if kernel != NON_SHUFFLE and k % 256:
        return "K % 256 != 0 (preshuffle kernels need BLOCK_SIZE_K >= 256 dividing K)"
    if kernel == PS_SCALES and m < 32:
        return "M < 32 (asserted by aiter's wrapper)"
    return ""


# ---------------------------------------------------------------------------------- activation
def flags_for(kernel: str, m: int) -> tuple[bool, bool]:
    path = "triton-non-shuffle" if kernel == NON_SHUFFLE else "triton-preshuffle"
    return tuple(layouts.ActivationQuantPlan(path, profile=ATOM).flags(m))


def activation(m: int, k: int, flags, seed: int):
    """``(q, scale)`` of an [m, k] activation from the fused RMSNorm + MXFP4 quant with ``flags``."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    x = (3 * torch.randn(m, k, generator=g, device=DEVICE)).to(torch.bfloat16)
    w = (0.5 + torch.rand(k, generator=g, device=DEVICE)).to(torch.bfloat16)
    (q, s), _, _ = layouts.fused_rms_mxfp4_quant(x, w, EPS, shuffle=flags[0], scale_shuffle_padding=flags[1])
    return q, s


def x_scales(s: torch.Tensor, flags) -> torch.Tensor:
    return s.view(s.shape[0] // 32, -1) if flags[0] else s


def call(gemm, kernel: str, wt: Weight, q, xs, dtype):
    if kernel == NON_SHUFFLE:
        ws = wt.raw_s
        if over_read(wt.k):
            xs, ws = with_slack(xs, over_read(wt.k)), with_slack(ws, over_read(wt.k))
        return lambda: gemm.gemm_afp4wfp4(q, wt.raw_w, xs, ws, dtype=dtype)
    if kernel == PS_SCALES:
        return lambda: gemm.gemm_afp4wfp4_preshuffled_scales(q, wt.raw_w, xs, wt.s32, dtype=dtype)
    return lambda: gemm.gemm_afp4wfp4_preshuffled_weight_scales(q, wt.w16, xs, wt.s32, dtype=dtype, use_aot=False)


@dataclasses.dataclass
class Outcome:
    ok: bool
    detail: str


def compare(y: torch.Tensor, a: torch.Tensor, w: torch.Tensor) -> Outcome:
    """``y`` against the float64 ``a @ w.T``: within the float32 summation bound (+ half a bf16 step)."""
    ref = a @ w.T
    bound = a.shape[1] * 2.0 ** -24 * (a.abs() @ w.abs().T)
    if y.dtype == torch.bfloat16:
        # rounding to bf16: half a step (2^-8 relative); the interpreter truncates: a whole step
        bound = bound + (2.0 ** -7 if ARGS.cpu_smoke else 2.0 ** -8) * ref.abs()
    err = (y.double() - ref).abs()
    if not bool(torch.isfinite(y).all()):
        return Outcome(False, f"{int((~torch.isfinite(y)).sum())} non-finite outputs")
    worst = float((err / bound.clamp_min(1e-300)).max())
    rel = float(err.max() / ref.abs().max().clamp_min(1e-300))
    return Outcome(worst <= 1.0, f"max err/bound {worst:.3g}, rel {rel:.2g}")


def first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[-1] if text else ''}"[:200]


def check_one(gemm, kernel: str, wt: Weight, m: int, seed: int, dtype=torch.float32) -> Outcome:
    why = kernel_runs(kernel, m, wt.k)
    if why:
        return Outcome(True, "n/a: " + why)
    flags = flags_for(kernel, m)
    q, s = activation(m, wt.k, flags, seed)
    a = layouts.dequant.dequantize_activation(q, s, *flags).double()
    try:
        y = call(gemm, kernel, wt, q, x_scales(s, flags), dtype)()
        sync()
    except Exception as exc:  # noqa: BLE001 - reported in the table
        return Outcome(False, "raises " + first_line(exc))
    if tuple(y.shape) != (m, wt.n):
        return Outcome(False, f"shape {tuple(y.shape)}")
    return compare(y, a, wt.ref)


# ---------------------------------------------------------------------------------- conversions
def convert_both(src: pathlib.Path, root: pathlib.Path, tp: int, tag: str) -> dict:
    out = {}
    for layout in ("non-shuffle", "preshuffle"):
        dest = root / f"{tag}-{layout}-tp{tp}"
        if not (dest / "prep-complete.json").exists():
            convert(str(src), dest, target_for(ATOM, layout=layout, moe_layout="ck", tp=tp))
        out[layout] = dest
    return out


def rank_pair(dirs: dict, rank: int):
    return (layouts.load_rank(dirs["non-shuffle"], rank, device=DEVICE),
            layouts.load_rank(dirs["preshuffle"], rank, device=DEVICE))


def check_tiny(gemm, root: pathlib.Path) -> list:
    """Every dense MXFP4 module of the tiny checkpoints, whole tensors, every kernel and M."""
    ms = (1, 33) if ARGS.cpu_smoke else (1, 16, 31, 32, 33, 256)
    tps = (1,) if ARGS.cpu_smoke else (1, 2, 4)
    rows = []
    for variant, modules in (("v2", tuple(MODULES)), ("r1-0528", ("gate_up_proj", "down_proj"))):
        src = root / f"tiny-{variant}"
        if not src.exists():
            write_checkpoint(SynthSpec(variant=variant), src)
        for tp in tps:
            ns, ps = rank_pair(convert_both(src, root, tp, f"tiny-{variant}"), tp - 1)
            for module in modules:
                wt = load_weight(ns, ps, MODULES[module])
                for kernel in KERNELS:
                    outs = [check_one(gemm, kernel, wt, m, seed=100 * tp + i) for i, m in enumerate(ms)]
                    rows.append((f"{variant} tp{tp}", module, wt.n, wt.k, kernel, ms, outs))
    return rows


def print_checks(title: str, rows: list) -> tuple[int, int]:
    print()
    print(f"== {title}: aiter's kernels compiled here vs the float64 reference (per M: ok / FAIL / n/a) ==")
    n_ok = n_bad = 0
    for where, module, n, k, kernel, ms, outs in rows:
        cells = []
        for m, o in zip(ms, outs):
            tag = "n/a" if o.detail.startswith("n/a") else ("ok" if o.ok else "FAIL")
            n_ok += tag == "ok"
            n_bad += tag == "FAIL"
            cells.append(f"M={m}:{tag}")
        print(f"{where:<12} {module:<17} N={n:<6} K={k:<6} {kernel:<40} " + " ".join(cells))
        seen = set()
        for m, o in zip(ms, outs):
            if (not o.ok or o.detail.startswith("raises")) and o.detail not in seen:
                seen.add(o.detail)
                print(f"    M={m}: {o.detail}")
    print(f"{n_ok} calls within the bound, {n_bad} failed")
    return n_ok, n_bad


# ------------------------------------------------------------------------------------ timing
def time_graph_us(fns: list, budget_ms: float = 40) -> float:
    """Median per-call device time of a CUDA graph that calls ``fns`` in turn (each its own weight
    copy), replayed."""
    return cuda_timing.time_graph_us(fns, budget_ms, cpu=ARGS.cpu_smoke, max_calls=50 * len(fns), max_replays=30)


DEEPSEEK_ATTN = SynthSpec(variant="v2", hidden_size=7168, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
                          qk_rope_head_dim=64, v_head_dim=128, num_attention_heads=128, intermediate_size=256,
                          moe_intermediate_size=256, num_hidden_layers=1, vocab_size=256, num_shards=1,
                          random_bytes=True)
# small attention that still converts to preshuffle at TP 8 (o_proj K = 16 * 64 / 8 = 128: W16 needs K % 64 == 0)
DEEPSEEK_MLP = SynthSpec(variant="v2", hidden_size=7168, intermediate_size=18432, moe_intermediate_size=256,
                         num_attention_heads=16, v_head_dim=64, num_hidden_layers=1, vocab_size=256, num_shards=1,
                         random_bytes=True)
TIMED = (("q_b_proj", 1), ("o_proj", 1), ("fused_qkv_a_proj", 1), ("gate_up_proj", 8), ("down_proj", 8))
SMOKE_ATTN = SynthSpec(variant="v2", random_bytes=True, num_hidden_layers=1)


def deepseek_weights(root: pathlib.Path) -> list[tuple[str, int, Weight]]:
    out = []
    specs = {1: SMOKE_ATTN, 8: SMOKE_ATTN} if ARGS.cpu_smoke else {1: DEEPSEEK_ATTN, 8: DEEPSEEK_MLP}
    tps = {1: 1, 8: 2} if ARGS.cpu_smoke else {1: 1, 8: 8}
    for key, spec in specs.items():
        t0 = time.time()
        src = root / f"deepseek-{key}"
        if not src.exists():
            write_checkpoint(spec, src)
        dirs = convert_both(src, root, tps[key], f"deepseek-{key}")
        ns, ps = rank_pair(dirs, 0)
        for module, tp in TIMED:
            if tp == key:
                out.append((module, tps[key], load_weight(ns, ps, MODULES[module])))
        print(f"generated, converted (both layouts, tp {tps[key]}) and loaded in {time.time() - t0:.1f} s")
    return out


def time_shapes(gemm, weights: list, ms: list[int], t_start: float) -> list:
    rows = []
    l2 = 0 if ARGS.cpu_smoke else torch.cuda.get_device_properties(0).L2_cache_size
    for module, tp, wt in weights:
        # weight copies so that one replay's calls read more than 3x the L2 cache
        w_bytes = wt.raw_w.numel() + wt.raw_s.numel()
        bf_bytes = 2 * wt.n * wt.k
        copies_fp4 = max(1, min(16, -(-3 * l2 // w_bytes)))
        copies_bf = max(1, min(8, -(-3 * l2 // bf_bytes)))
        fp4 = [wt] + [dataclasses.replace(wt, raw_w=wt.raw_w.clone(), raw_s=wt.raw_s.clone(), w16=wt.w16.clone(),
                                          s32=wt.s32.clone(), ref=None) for _ in range(copies_fp4 - 1)]
        w_bf = wt.ref.to(torch.bfloat16)
        bfs = [w_bf] + [w_bf.clone() for _ in range(copies_bf - 1)]
        for m in ms:
            if time.time() - t_start > ARGS.time_limit:
                print(f"{module} M={m}: skipped, past --time-limit")
                continue
            t, notes = {}, []
            a_bf = None
            for kernel in KERNELS:
                why = kernel_runs(kernel, m, wt.k)
                if why:
                    notes.append(f"{kernel}: {why}")
                    continue
                flags = flags_for(kernel, m)
                q, s = activation(m, wt.k, flags, seed=m)
                a = layouts.dequant.dequantize_activation(q, s, *flags)
                if a_bf is None:
                    a_bf = a.to(torch.bfloat16)
                xs = x_scales(s, flags)
                try:
                    # (checked at this shape and M beforehand, in main)
                    t[kernel] = time_graph_us([call(gemm, kernel, c, q, xs, torch.bfloat16) for c in fp4])
                except Exception as exc:  # noqa: BLE001 - reported
                    notes.append(f"{kernel}: raises {first_line(exc)}")
                    if not ARGS.cpu_smoke:
                        traceback.print_exc()
            if a_bf is not None:
                t["bf16"] = time_graph_us([lambda w=w: torch.matmul(a_bf, w.T) for w in bfs])
            rows.append((module, tp, wt.n, wt.k, m, t, notes, len(fp4), len(bfs)))
            print(f"  timed {module} M={m}: " + ", ".join(f"{k} {v:.1f} us" for k, v in t.items())
                + f" ({time.time() - t_start:.0f} s)")
            for n in notes:
                print(f"    {n}")
        del fp4, bfs, w_bf
        wt.ref = None
        if not ARGS.cpu_smoke:
            torch.cuda.empty_cache()
    return rows


def print_times(rows: list) -> None:
    table = Table("bf16", title="\n== MXFP4 GEMM (aiter's Triton kernels, compiled here) vs bf16 torch.matmul of the "
                                "dequantized operands; time = median per call (CUDA graph, weights rotated past L2), "
                                "bf16 output ==")
    for module, tp, n, k, m, t, notes, _, _ in rows:
        fp4_bytes = n * k // 2 + n * -(-k // 32) + m * k // 2 + 2 * m * n
        bytes_of = {"bf16": 2 * n * k + 2 * m * k + 2 * m * n, **{x: fp4_bytes for x in KERNELS}}
        for name in ("bf16", *KERNELS):
            if name in t:
                table.add(name, t[name] * 1e-6, case=f"{module} tp{tp} N={n} K={k} M={m}", nbytes=bytes_of[name],
                          TFLOPS=f"{2 * m * n * k / t[name] / 1e6:.1f}")
    table.print()
    print("GB/s = the bytes each must move (weight, scales, activation, output) / time")


def run(args: argparse.Namespace) -> None:
    global ARGS, DEVICE
    ARGS, DEVICE = args, "cpu" if args.cpu_smoke else "cuda"
    require_compiled_triton(args.cpu_smoke)
    if DEVICE == "cuda" and not torch.cuda.is_available():
        sys.exit("needs a CUDA device (or --cpu-smoke)")
    import triton

    import aiter_oracle

    t_start = time.time()
    name = "CPU (interpreter)" if ARGS.cpu_smoke else torch.cuda.get_device_name()
    cap = "" if ARGS.cpu_smoke else f" sm_{''.join(map(str, torch.cuda.get_device_capability()))}"
    print(f"device: {name}{cap}  torch {torch.__version__}  triton {triton.__version__}")
    if not aiter_oracle.triton_gemm_available():
        sys.exit(f"aiter's GEMM files are missing under {aiter_oracle.ORACLE_DIR} (scripts/fetch_aiter_oracle.py)")
    gemm = aiter_oracle.triton_gemm_module(interpret=ARGS.cpu_smoke)
    root = pathlib.Path(ARGS.workdir) if ARGS.workdir else pathlib.Path(tempfile.mkdtemp(prefix="gpu-gemm-"))
    root.mkdir(parents=True, exist_ok=True)
    bad = 0
    try:
        if not ARGS.skip_check:
            bad += print_checks("tiny checkpoints (v2, r1-0528), whole tensors, float32 output",
                                check_tiny(gemm, root))[1]
            print(f"(checks done at {time.time() - t_start:.0f} s)")
        if not ARGS.skip_time:
            weights = deepseek_weights(root)
            ms = [1, 33] if ARGS.cpu_smoke else ARGS.ms
            check_rows = []
            for module, tp, wt in weights:
                outs = [check_one(gemm, kernel, wt, m, seed=7 + m, dtype=torch.bfloat16)
                        for kernel in KERNELS for m in ms]
                for i, kernel in enumerate(KERNELS):
                    check_rows.append((f"deepseek tp{tp}", module, wt.n, wt.k, kernel, ms,
                                       outs[i * len(ms):(i + 1) * len(ms)]))
            bad += print_checks("DeepSeek shapes (generated, converted), bf16 output", check_rows)[1]
            print_times(time_shapes(gemm, weights, ms, t_start))
    finally:
        if not ARGS.workdir:
            shutil.rmtree(root, ignore_errors=True)
    print(f"(total {time.time() - t_start:.0f} s)")
    sys.exit(1 if bad else 0)
