"""aiter's own MXFP4 GEMMs computing on converted checkpoints (issue 14, items 1 and 2).

The kernels are aiter's ``gemm_afp4wfp4``, ``gemm_afp4wfp4_preshuffled_scales`` and
``gemm_afp4wfp4_preshuffled_weight_scales`` (aiter/ops/triton/gemm_afp4wfp4.py from the pinned
amd-aiter wheel, with its JSON configs), run under triton's CPU interpreter (triton >= 3.8 has
``tl.dot_scaled`` there); tests/aiter_oracle.py loads them by path with aiter's arch detection
stubbed to gfx950. They read the tensors ``layouts.load_rank`` returns from real conversions of
generated Quark checkpoints of both variants, and activations quantized by
``layouts.ActivationQuantPlan`` (the fused RMSNorm + MXFP4 quant with the flags of the GEMM path).

Each kernel writes float32 (in the interpreter a bf16 output is truncated, not rounded), compared
with a float64 product of the dequantized operands: every element must lie within
``K * 2**-24 * (|A| @ |W|^T)``, the worst-case bound of float32 summation of the (exact) products.

What runs (the rest of docs/consumer-kernels.md explains each choice):

* every dense MXFP4 module of layer 0 (v2: ``fused_qkv_a_proj``, ``q_b_proj``, ``kv_b_proj``,
  ``o_proj``, ``gate_up_proj``, ``down_proj``; r1-0528, whose attention is BF16: the last two),
  at TP 1, 2 and 4 (rank ``tp - 1``), on the kernel of each engine path, for every M in ``MS``;
* slicing: the kernels compute the first ``WINDOW`` = 64 output rows of each weight, taken as
  views of the stored bytes (W16 and S32x8 keep every 16 / 32-row block contiguous, so the first
  64 rows are the first 4 / 2 blocks); K is never sliced. The kernels' blocks are up to 256 rows
  wide and index rows modulo N (raw weights) or read whole 32-row scale blocks past the window:
  those reads land on later rows of the same tensor, and the outputs past the window are
  masked. ``test_full_tensors`` runs whole tensors (N = 272, past the last 32-row block);
* the preshuffle kernels only where K is a multiple of 256 (K = 128 raises in aiter's wrapper,
  pinned below); gemm_afp4wfp4 at every K, its scale over-read past K/32 given finite bytes
  (``with_slack``; pinned by ``test_non_shuffle_gemm_reads_scale_bytes_past_the_tensor``);
* negative controls: wrong activation flags, wrong weight layout;
* the S32x8 K-pad byte (issue 14, item 2): pad columns set to 0x00, 0x7F, 0xFF, with hostile
  data past K (``test_s32x8_k_pad_byte``; ``python tests/test_consumer_kernels.py NEW_DIR``
  prints the evidence table of docs/consumer-kernels.md), and the bytes prep writes there (0x00
  since layout version 2) computing right even with K passed as the padded width
  (``test_written_k_pad_computes_right_with_k_passed_as_padded_width``).
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

import layouts
from layouts.dequant import stored_positions
from layouts.engines import get_engine
from prep.convert import convert
from prep.deepseek import target_for
from prep.reference.aiter_gemm import DENSE_MODULES
from prep.testing import SynthSpec
from checkpoints import write_checkpoint

ATOM = get_engine("atom")  # the engine whose profile these tests use

MS = (1, 16, 31, 32, 33, 256)
TPS = (1, 2, 4)
WINDOW = 64
EPS = 1e-6
VARIANTS = ("v2", "r1-0528")
LAYOUTS = ("non-shuffle", "preshuffle")

MODULES = DENSE_MODULES
MXFP4_MODULES = {"v2": tuple(MODULES), "r1-0528": ("gate_up_proj", "down_proj")}  # r1-0528: BF16 attention

# The kernel each engine path runs, and the kernel taking raw weights with S32x8 scales.
NON_SHUFFLE = "gemm_afp4wfp4"
PRESHUFFLED_WEIGHT_SCALES = "gemm_afp4wfp4_preshuffled_weight_scales"
PRESHUFFLED_SCALES = "gemm_afp4wfp4_preshuffled_scales"


def module_k(module: str, tp: int, spec: SynthSpec = SynthSpec()) -> int:
    """K (input features) of a dense module on one rank of a TP-``tp`` conversion."""
    return {
        "fused_qkv_a_proj": spec.hidden_size,
        "q_b_proj": spec.q_lora_rank,
        "kv_b_proj": spec.kv_lora_rank,
        "o_proj": spec.num_attention_heads * spec.v_head_dim // tp,
        "gate_up_proj": spec.hidden_size,
        "down_proj": spec.intermediate_size // tp,
    }[module]


def preshuffle_kernels_run(k: int) -> bool:
    """aiter's preshuffle kernels need BLOCK_SIZE_K >= 256 and K a multiple of it."""
    return k % 256 == 0


CASES = [(v, tp, m) for v in VARIANTS for tp in TPS for m in MXFP4_MODULES[v]]


# ------------------------------------------------------------------------------------------------
# conversions


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """(variant, layout, tp) -> folder of a real conversion of the generated checkpoint."""
    root = tmp_path_factory.mktemp("consumer")
    out = {}
    for variant in VARIANTS:
        src = write_checkpoint(SynthSpec(variant=variant), root / f"src-{variant}")
        for layout in LAYOUTS:
            for tp in TPS:
                dest = root / f"{variant}-{layout}-tp{tp}"
                convert(str(src), dest, target_for(ATOM, layout=layout, moe_layout="ck", tp=tp))
                out[variant, layout, tp] = dest
    return out


def engine(variant: str, layout: str, tp: int) -> layouts.EngineConfig:
    """The engine that reads this conversion: the Triton GEMM of its layout (v2 preshuffle: ATOM
    refuses ATOM_USE_TRITON_GEMM=1 with MXFP4 attention and runs its ASM gemm_a4w4 on the same
    bytes; that engine is the one checked at load)."""
    if layout == "non-shuffle":
        path = "triton-non-shuffle"
    else:
        path = "triton-preshuffle" if variant == "r1-0528" else "asm"
    return layouts.EngineConfig(gemm_path=path, moe_backend="ck", tp_size=tp, rank=tp - 1, profile=ATOM)


@pytest.fixture(scope="module")
def ranks(converted):
    """(variant, layout, tp) -> (RankTensors of rank tp - 1, its ActivationQuantPlan)."""

    @functools.lru_cache(maxsize=None)
    def get(variant: str, layout: str, tp: int):
        eng = engine(variant, layout, tp)
        tensors = layouts.load_rank(converted[variant, layout, tp], tp - 1, engine=eng)
        if layout == "non-shuffle":
            plan = layouts.ActivationQuantPlan.for_checkpoint(tensors.manifest, eng)
        else:
            # The Triton preshuffle GEMM's flags. For v2 the engine cannot be built
            # (test_v2_triton_preshuffle_engine_refused); its kernels still read these bytes.
            plan = layouts.ActivationQuantPlan("triton-preshuffle", profile=ATOM)
            if variant == "r1-0528":
                assert plan == layouts.ActivationQuantPlan.for_checkpoint(
                    tensors.manifest,
                    layouts.EngineConfig(gemm_path="triton-preshuffle", moe_backend="ck", tp_size=tp, rank=tp - 1, profile=ATOM))
        return tensors, plan

    return get


# ------------------------------------------------------------------------------------------------
# weights, activations, the check


@dataclasses.dataclass
class Window:
    """Output rows ``[0, rows)`` of one converted weight, as each kernel is given them."""

    name: str
    rows: int
    k: int
    ref: torch.Tensor  # float64 [rows, K], dequantized from the stored bytes
    raw_w: torch.Tensor  # non-shuffle conversion: [rows, K/2]
    raw_s: torch.Tensor  # [rows, K/32]
    w16: torch.Tensor  # preshuffle conversion, W16 viewed [rows/16, 16*K/2]
    s32: torch.Tensor  # S32x8 viewed [rows/32, 32*pad8(K/32)]


def window(ns: layouts.RankTensors, ps: layouts.RankTensors, prefix: str, rows: int | None = WINDOW) -> Window:
    """Output rows ``[0, rows)`` of the module's weight (all of them with ``rows=None``)."""
    w_raw, s_raw = ns[prefix + ".weight"], ns[prefix + ".weight_scale"]
    w16, s32 = ps[prefix + ".weight"], ps[prefix + ".weight_scale"]
    assert ns.records[prefix + ".weight"].layout == "non-shuffle" and not w_raw.is_shuffled
    assert ps.records[prefix + ".weight"].layout == "preshuffle" and w16.is_shuffled
    n, k = w_raw.shape[0], 2 * w_raw.shape[1]
    shapes = (n, k // 2), (n, -(-k // 32))
    ref = layouts.dequant.dequantize_stored(w16, s32, layouts.get_layout("preshuffle"), *shapes).double()
    # Both conversions hold the same numbers (each read through its own layout's index map).
    raw_ref = layouts.dequant.dequantize_stored(w_raw, s_raw, layouts.get_layout("non-shuffle"), *shapes).double()
    assert torch.equal(ref, raw_ref)
    n1 = n if rows is None else min(n, rows)
    assert n1 == n or n1 % 32 == 0, (n, n1)
    # A window keeps the S32x8 scale's every 32-row block (the kernels index it in blocks); the
    # full tensor keeps its pad to 256 rows, which the kernels read for rows N.. of their last block.
    s32v = s32.view(s32.shape[0] // 32, -1)
    return Window(prefix, n1, k, ref[:n1], w_raw[:n1], s_raw[:n1], w16.view(n // 16, -1)[: n1 // 16],
                  s32v if rows is None else s32v[: n1 // 32])


def activation(plan: layouts.ActivationQuantPlan, module: str, m: int, k: int, seed: int):
    """``(q, scale, flags)`` of an ``[m, k]`` activation from the fused RMSNorm + MXFP4 quant, at
    the module's call site: ``input_layernorm`` before fused_qkv_a_proj, ``q_a_layernorm`` before
    q_b_proj, the same fused op with the plan's flags before the others."""
    g = torch.Generator().manual_seed(seed)
    x = (3 * torch.randn(m, k, generator=g)).to(torch.bfloat16)
    w = 0.5 + torch.rand(k, generator=g)
    if module == "fused_qkv_a_proj":
        res = torch.randn(m, k, generator=g).to(torch.bfloat16)
        (q, s), _ = plan.input_layernorm(x, w, EPS, res)
    elif module == "q_b_proj":
        kv = torch.randn(m, 64, generator=g).to(torch.bfloat16)
        (q, s), _ = plan.q_a_layernorm(x, w, EPS, kv, torch.ones(64), EPS)
    else:
        shuffle, padding = plan.flags(m)
        (q, s), _, _ = layouts.fused_rms_mxfp4_quant(x, w, EPS, shuffle=shuffle, scale_shuffle_padding=padding,
                                                      backend=plan.backend)
    return q, s, plan.flags(m)


def x_scales(s: torch.Tensor, flags) -> torch.Tensor:
    """The activation scale as aiter's wrappers take it: S32x8 viewed ``[pad256(M)/32, -1]``
    when shuffled, else as the fused op returned it."""
    return s.view(s.shape[0] // 32, -1) if flags[0] else s


def with_slack(t: torch.Tensor, nbytes: int, value: int = 0x7F) -> torch.Tensor:
    """A copy of ``t`` followed in memory by ``nbytes`` bytes of ``value``."""
    flat = torch.full((t.numel() + nbytes,), value, dtype=torch.uint8)
    flat[: t.numel()] = t.reshape(-1)
    return flat[: t.numel()].view(t.shape)


def over_read(k: int) -> int:
    """Scale bytes gemm_afp4wfp4 reads past the end of a raw ``[rows, K/32]`` scale: its K loop
    takes BLOCK_SIZE_K = 256 (8 scale columns) per step, with the data masked past K but the
    scales not, so the last row reads up to ``pad8(K/32) - K/32`` bytes beyond the tensor."""
    return -(-k // 256) * 8 - k // 32


def run(gemm, kernel: str, win: Window, q: torch.Tensor, xs: torch.Tensor) -> torch.Tensor:
    if kernel == NON_SHUFFLE:
        ws = win.raw_s
        if over_read(win.k):
            # Give the kernel's over-read a finite byte to land on (the activation's and the weight's
            # scale): test_non_shuffle_gemm_reads_scale_bytes_past_the_tensor pins why.
            xs, ws = with_slack(xs, over_read(win.k)), with_slack(ws, over_read(win.k))
        return gemm.gemm_afp4wfp4(q, win.raw_w, xs, ws, dtype=torch.float32)
    if kernel == PRESHUFFLED_SCALES:
        return gemm.gemm_afp4wfp4_preshuffled_scales(q, win.raw_w, xs, win.s32, dtype=torch.float32)
    return gemm.gemm_afp4wfp4_preshuffled_weight_scales(q, win.w16, xs, win.s32, dtype=torch.float32, use_aot=False)


@dataclasses.dataclass
class Outcome:
    ok: bool
    finite: bool
    max_err: float  # max |y - ref|
    rel_err: float  # max |y - ref| / max |ref|
    worst: float  # max |y - ref| / bound (<= 1 passes)


def compare(y: torch.Tensor, a: torch.Tensor, w: torch.Tensor) -> Outcome:
    ref = a @ w.T
    bound = a.shape[1] * 2.0 ** -24 * (a.abs() @ w.abs().T)
    err = (y.double() - ref).abs()
    finite = bool(torch.isfinite(y).all())
    ok = finite and bool((err <= bound).all())
    worst = float((err / bound.clamp_min(1e-300)).max()) if finite else float("nan")
    return Outcome(ok, finite, float(err.max()), float(err.max() / ref.abs().max().clamp_min(1e-300)), worst)


def dequant_act(q, s, flags) -> torch.Tensor:
    return layouts.dequant.dequantize_activation(q, s, *flags).double()


# ------------------------------------------------------------------------------------------------
# item 1: every dense module, every TP, every M, on the engine path's kernel


def _check_all_m(gemm, ranks, variant, tp, module, kernel, ms):
    ns, ns_plan = ranks(variant, "non-shuffle", tp)
    ps, ps_plan = ranks(variant, "preshuffle", tp)
    win = window(ns, ps, MODULES[module])
    assert win.k == module_k(module, tp)
    plan = ns_plan if kernel == NON_SHUFFLE else ps_plan
    bad = []
    for i, m in enumerate(ms):
        q, s, flags = activation(plan, module, m, win.k, seed=1000 * tp + i)
        y = run(gemm, kernel, win, q, x_scales(s, flags))
        assert y.shape == (m, win.rows) and y.dtype == torch.float32
        out = compare(y, dequant_act(q, s, flags), win.ref)
        if not out.ok:
            bad.append((m, flags, out))
    assert not bad, f"{kernel} on {variant} tp{tp} {module}: {bad}"


@pytest.mark.parametrize("variant,tp,module", CASES, ids=[f"{v}-tp{tp}-{m}" for v, tp, m in CASES])
def test_non_shuffle_gemm_on_non_shuffle_conversion(aiter_triton_gemm, ranks, variant, tp, module):
    """ATOM_USE_FP4_NON_SHUFFLE_TRITON_GEMM=1: gemm_afp4wfp4 on raw weight, raw scales, raw
    activation scales (the plan never shuffles for this path)."""
    _check_all_m(aiter_triton_gemm, ranks, variant, tp, module, NON_SHUFFLE, MS)


PS_CASES = [c for c in CASES if preshuffle_kernels_run(module_k(c[2], c[1]))]


@pytest.mark.parametrize("variant,tp,module", PS_CASES, ids=[f"{v}-tp{tp}-{m}" for v, tp, m in PS_CASES])
def test_preshuffle_gemm_on_preshuffle_conversion(aiter_triton_gemm, ranks, variant, tp, module):
    """ATOM_USE_TRITON_GEMM=1: gemm_afp4wfp4_preshuffled_weight_scales on W16 / S32x8; the plan's
    activation scale is raw below 32 tokens and S32x8-shuffled, padded from 32 on."""
    _check_all_m(aiter_triton_gemm, ranks, variant, tp, module, PRESHUFFLED_WEIGHT_SCALES, MS)


@pytest.mark.parametrize("variant,tp,module", PS_CASES, ids=[f"{v}-tp{tp}-{m}" for v, tp, m in PS_CASES])
def test_preshuffled_scales_gemm(aiter_triton_gemm, ranks, variant, tp, module):
    """gemm_afp4wfp4_preshuffled_scales (M >= 32 only, asserted by aiter's wrapper): the raw
    weight of the non-shuffle conversion with the S32x8 scale of the preshuffle conversion (no
    ATOM path pairs them; the kernel pins the S32x8 scale bytes on their own)."""
    _check_all_m(aiter_triton_gemm, ranks, variant, tp, module, PRESHUFFLED_SCALES, [m for m in MS if m >= 32])


@pytest.mark.parametrize("after", [0x7F, 0x00, 0xFF])
def test_non_shuffle_gemm_reads_scale_bytes_past_the_tensor(aiter_triton_gemm, ranks, after):
    """gemm_afp4wfp4 with K = 128 (v2 o_proj at TP 2): K/32 = 4 scale columns, but the kernel
    loads 8 per step; the data past K are masked to 0, the scales are not, so the last row of
    the weight scale reads 4 bytes past the tensor and multiplies them by zeros: harmless when
    they are finite, NaN in the last output column when one of them is 0xFF (E8M0 NaN). On
    load_rank's views those bytes are the next tensor of the file (there, v2 TP 2 rank 1's
    o_proj.weight_scale is followed by a 0xFF byte)."""
    ns, plan = ranks("v2", "non-shuffle", 2)
    ps, _ = ranks("v2", "preshuffle", 2)
    win = window(ns, ps, MODULES["o_proj"])
    assert win.k == 128 and over_read(win.k) == 4
    q, s, flags = activation(plan, "o_proj", 33, win.k, seed=11)
    xs = with_slack(s, 4)
    y = aiter_triton_gemm.gemm_afp4wfp4(q, win.raw_w, xs, with_slack(win.raw_s, 4, after), dtype=torch.float32)
    out = compare(y, dequant_act(q, s, flags), win.ref)
    if after == 0xFF:
        assert torch.isnan(y[:, -1]).all() and not torch.isnan(y[:, :-1]).any()
    else:
        assert out.ok, out


@pytest.mark.parametrize("kernel", [NON_SHUFFLE, PRESHUFFLED_WEIGHT_SCALES, PRESHUFFLED_SCALES])
def test_full_tensors(aiter_triton_gemm, ranks, kernel):
    """Whole tensors, unsliced: v2 TP 1 fused_qkv_a_proj, N = 272 rows (8.5 blocks of 32, the
    S32x8 scale padded to 512 rows), on each kernel at a decode and a prefill M."""
    ns, ns_plan = ranks("v2", "non-shuffle", 1)
    ps, ps_plan = ranks("v2", "preshuffle", 1)
    win = window(ns, ps, MODULES["fused_qkv_a_proj"], rows=None)
    assert (win.rows, win.k, win.s32.shape[0]) == (272, 256, 16)
    plan = ns_plan if kernel == NON_SHUFFLE else ps_plan
    for m in ([33] if kernel == PRESHUFFLED_SCALES else [16, 33]):
        q, s, flags = activation(plan, "fused_qkv_a_proj", m, win.k, seed=20 + m)
        out = compare(run(aiter_triton_gemm, kernel, win, q, x_scales(s, flags)), dequant_act(q, s, flags), win.ref)
        assert out.ok, (m, out)


def test_v2_triton_preshuffle_engine_refused(converted):
    """Why the v2 preshuffle runs take the plan without an engine: ATOM's Triton GEMM switch
    builds attention for a BF16 source, so check_compatibility refuses v2's MXFP4 attention."""
    m = layouts.load_manifest(converted["v2", "preshuffle", 2])
    with pytest.raises(layouts.CompatibilityError, match="attention is MXFP4"):
        layouts.ActivationQuantPlan.for_checkpoint(
            m, layouts.EngineConfig(gemm_path="triton-preshuffle", moe_backend="ck", tp_size=2, rank=1, profile=ATOM))


def test_r1_attention_is_bf16(ranks):
    """r1-0528's attention is BF16 (Quark excludes it), so only its MLP is in CASES."""
    ns, _ = ranks("r1-0528", "non-shuffle", 1)
    for module in set(MODULES) - set(MXFP4_MODULES["r1-0528"]):
        assert MODULES[module] + ".weight_scale" not in ns, module


def test_preshuffle_kernel_needs_k_multiple_of_256(aiter_triton_gemm, ranks):
    """K = 128 (q_b_proj): BLOCK_SIZE_K becomes 128 and the S32x8 scale reshape needs
    BLOCK_SIZE_K // 32 // 8 >= 1: triton refuses the block shape."""
    ns, _ = ranks("v2", "non-shuffle", 1)
    ps, plan = ranks("v2", "preshuffle", 1)
    win = window(ns, ps, MODULES["q_b_proj"])
    assert win.k == 128
    q, s, flags = activation(plan, "q_b_proj", 16, win.k, seed=7)
    with pytest.raises(Exception, match="power of 2"):
        run(aiter_triton_gemm, PRESHUFFLED_WEIGHT_SCALES, win, q, x_scales(s, flags))


# ------------------------------------------------------------------------------------------------
# negative controls: the same comparison fails on wrong inputs


def _control_window(ranks):
    ns, ns_plan = ranks("v2", "non-shuffle", 1)
    ps, ps_plan = ranks("v2", "preshuffle", 1)
    return window(ns, ps, MODULES["fused_qkv_a_proj"]), ns_plan, ps_plan


def _wrong(out: Outcome) -> bool:
    return not out.ok and (not out.finite or out.rel_err > 0.05)


# Misread bytes give huge products: numpy's overflow warnings from the interpreter are expected.
OVERFLOW_EXPECTED = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")


@OVERFLOW_EXPECTED
@pytest.mark.parametrize("m", [16, 33])
def test_wrong_activation_flags_fail(aiter_triton_gemm, ranks, m):
    """The preshuffle GEMM given the activation quantized with the ASM path's flags (always
    shuffled) below 32 tokens, or padded but not shuffled from 32 on; the non-shuffle GEMM given
    a shuffled activation scale: each reads scale bytes in the wrong order."""
    win, ns_plan, ps_plan = _control_window(ranks)
    asm = layouts.ActivationQuantPlan("asm", profile=ATOM)
    gemm = aiter_triton_gemm
    if m < 32:
        q, s, flags = activation(asm, "fused_qkv_a_proj", m, win.k, seed=3)
        assert flags == (True, True) and ps_plan.flags(m) == (False, False)
        a = dequant_act(q, s, flags)  # the right values; the kernel reads the bytes as raw [M, K/32]
        y = run(gemm, PRESHUFFLED_WEIGHT_SCALES, win, q, s)
        assert _wrong(compare(y, a, win.ref))
    else:
        g = torch.Generator().manual_seed(3)
        x = (3 * torch.randn(m, win.k, generator=g)).to(torch.bfloat16)
        (q, s), _, _ = layouts.fused_rms_mxfp4_quant(x, torch.ones(win.k), EPS, shuffle=False,
                                                      scale_shuffle_padding=True)
        a = dequant_act(q, s, (False, True))
        assert ps_plan.flags(m) == (True, True)
        y = run(gemm, PRESHUFFLED_WEIGHT_SCALES, win, q, s.view(s.shape[0] // 32, -1))
        assert _wrong(compare(y, a, win.ref))
    # The non-shuffle GEMM given a shuffled (padded) scale where it reads raw [M, K/32] rows.
    q, s, flags = activation(asm, "fused_qkv_a_proj", m, win.k, seed=4)
    assert ns_plan.flags(m) == (False, False)
    y = run(gemm, NON_SHUFFLE, win, q, s)
    assert _wrong(compare(y, dequant_act(q, s, flags), win.ref))
    # ... and the right flags pass on the same kernels (the controls above are not vacuous).
    for plan, kernel in ((ps_plan, PRESHUFFLED_WEIGHT_SCALES), (ns_plan, NON_SHUFFLE)):
        q, s, flags = activation(plan, "fused_qkv_a_proj", m, win.k, seed=5)
        assert compare(run(gemm, kernel, win, q, x_scales(s, flags)), dequant_act(q, s, flags), win.ref).ok


@OVERFLOW_EXPECTED
@pytest.mark.parametrize("m", [1, 33])
def test_wrong_weight_layout_fails(aiter_triton_gemm, ranks, m):
    """Preshuffled bytes given to the non-shuffle GEMM, raw bytes given to the preshuffle GEMM."""
    win, ns_plan, ps_plan = _control_window(ranks)
    rows = win.rows
    assert win.k == 256  # K/32 == pad8(K/32): the raw and S32x8 windows hold as many bytes
    swapped = dataclasses.replace(
        win,
        raw_w=win.w16.reshape(rows, -1),  # W16 bytes read as [N, K/2]
        raw_s=win.s32.reshape(rows, -1)[:, : win.k // 32],  # S32x8 bytes read as [N, K/32]
        w16=win.raw_w.reshape(rows // 16, -1),  # raw bytes read as W16
        s32=win.raw_s.reshape(win.s32.shape),  # raw scale bytes read as S32x8 (K = 256: no pad)
    )
    for plan, kernel in ((ns_plan, NON_SHUFFLE), (ps_plan, PRESHUFFLED_WEIGHT_SCALES)):
        q, s, flags = activation(plan, "fused_qkv_a_proj", m, win.k, seed=6)
        a = dequant_act(q, s, flags)
        assert compare(run(aiter_triton_gemm, kernel, win, q, x_scales(s, flags)), a, win.ref).ok
        assert _wrong(compare(run(aiter_triton_gemm, kernel, swapped, q, x_scales(s, flags)), a, win.ref)), kernel


# ------------------------------------------------------------------------------------------------
# item 2: the S32x8 K-pad byte, as the kernels read it
#
# down_proj of a generated r1-0528 checkpoint with intermediate_size = 1152, converted at TP 1
# (K = 1152, as DeepSeek's down_proj at TP 16: K/32 = 36 scale columns, padded to 40) and TP 2
# (K = 576: 18 columns, padded to 24). The S32x8 scale of the preshuffle conversion gets its pad
# bytes (every stored byte no logical scale lands on) set to 0x00, 0x7F or 0xFF; every byte the
# kernels could read past K in the activation and the weight is hostile (0x77: E2M1 +6.0, +6.0).
# gemm_afp4wfp4 reads raw [N, K/32] scales, which have no pad; it is given them in an [N, pad8]
# buffer whose pad columns hold the byte under test (a raw scale padded as S32x8 pads).
#
# Two ways to call each kernel:
#   "K":    K as the weight has it (what ATOM passes): the kernel's last BLOCK_SIZE_K = 256 step
#           runs past K, with the data masked to 0 past K but the scales read unmasked;
#   "Kpad": K passed as the padded width pad8(K/32) * 32, i.e. a caller (or kernel) that takes K
#           from the scale's padded shape: the pad columns then scale the hostile data past K.
# The activation's own pad columns are 0x7F throughout (what the fused quant writes, ours and
# aiter's when it shuffles); only the weight scale's pad varies.

PAD_BYTES = (0x00, 0x7F, 0xFF)
PAD_KS = (1152, 576)
HOSTILE = 0x77
PAD_MODES = ("K", "Kpad")
PAD_RUNS = [(NON_SHUFFLE, 1), (NON_SHUFFLE, 32), (PRESHUFFLED_SCALES, 32), (PRESHUFFLED_WEIGHT_SCALES, 1),
            (PRESHUFFLED_WEIGHT_SCALES, 32)]


@dataclasses.dataclass
class PadCase:
    win: Window  # first 64 rows of down_proj
    s32_full: torch.Tensor  # the converted S32x8 scale, [256, pad8(K/32)]
    pad: torch.Tensor  # bool, per stored byte of s32_full: holds no logical scale
    pad_value: int  # what the manifest says prep wrote there


def pad_cases(root) -> dict[int, PadCase]:
    src = write_checkpoint(SynthSpec(variant="r1-0528", intermediate_size=1152), root / "src")
    out = {}
    for tp in (1, 2):
        rt = {}
        for layout in LAYOUTS:
            convert(str(src), root / f"{layout}-tp{tp}", target_for(ATOM, layout=layout, moe_layout="ck", tp=tp))
            rt[layout] = layouts.load_rank(root / f"{layout}-tp{tp}", tp - 1)
        prefix = MODULES["down_proj"]
        win = window(rt["non-shuffle"], rt["preshuffle"], prefix)
        s32 = rt["preshuffle"][prefix + ".weight_scale"]
        n = rt["preshuffle"][prefix + ".weight"].shape[0]
        layout = layouts.get_layout("preshuffle")
        pad = torch.ones(s32.numel(), dtype=torch.bool)
        pad[stored_positions(layout.scale, (n, win.k // 32))] = False
        (xform,) = [t for t in rt["preshuffle"].records[prefix + ".weight_scale"].transforms if t.get("op") == "layout"]
        out[win.k] = PadCase(win, s32, pad.view(s32.shape), xform["scale_transform"]["pad_value"])
    return out


@pytest.fixture(scope="module")
def pad_case(tmp_path_factory):
    return pad_cases(tmp_path_factory.mktemp("pad-byte"))


def _hostile_tail(t: torch.Tensor, extra: int) -> torch.Tensor:
    """``t`` [R, C] in an [R, C + extra] buffer whose trailing columns are HOSTILE (the buffer)."""
    buf = torch.full((t.shape[0], t.shape[1] + extra), HOSTILE, dtype=torch.uint8)
    buf[:, : t.shape[1]] = t
    return buf


def pad_byte_run(gemm, case: PadCase, byte: int | None, kernel: str, m: int, mode: str) -> tuple[str, str]:
    """One kernel call of the pad experiment: ``(verdict, detail)``, verdict one of "exact" (within
    the fp32 bound), "wrong", "NaN", "raises". ``byte`` None: the S32x8 scale as prep wrote it."""
    win = case.win
    k = win.k
    kc, cp = k // 32, -(-k // 256) * 8
    kk = k if mode == "K" else cp * 32  # the K the kernel is told
    s32 = case.s32_full.clone()
    if byte is not None:
        s32[case.pad] = byte
    elif kernel == NON_SHUFFLE:
        raise ValueError("a non-shuffle conversion's raw scale has no pad prep writes")
    s32v = s32.view(s32.shape[0] // 32, -1)[: win.rows // 32]
    path = "triton-non-shuffle" if kernel == NON_SHUFFLE else "triton-preshuffle"
    q, s, flags = activation(layouts.ActivationQuantPlan(path, profile=ATOM), "down_proj", m, k, seed=5)
    a = dequant_act(q, s, flags)
    qv = _hostile_tail(q, (cp * 32 - k) // 2)[:, : kk // 2]
    if flags.shuffle:
        xs = s.view(s.shape[0] // 32, -1)  # the fused op's padded S32x8 scale, pad columns 0x7F
    else:
        xs = torch.full((m, cp), 0x7F, dtype=torch.uint8)
        xs[:, :kc] = s
        xs = xs[:, : kk // 32]
    if kernel == NON_SHUFFLE:
        ws = torch.full((win.rows, cp), byte, dtype=torch.uint8)
        ws[:, :kc] = win.raw_s
        call = lambda: gemm.gemm_afp4wfp4(qv, _hostile_tail(win.raw_w, (cp * 32 - k) // 2)[:, : kk // 2], xs,
                                          ws[:, : kk // 32], dtype=torch.float32)
    elif kernel == PRESHUFFLED_SCALES:
        call = lambda: gemm.gemm_afp4wfp4_preshuffled_scales(
            qv, _hostile_tail(win.raw_w, (cp * 32 - k) // 2)[:, : kk // 2], xs, s32v, dtype=torch.float32)
    else:
        # W16 keeps each 16-row block's K tiles together: the hostile tail of a block row is its
        # K past the real K.
        call = lambda: gemm.gemm_afp4wfp4_preshuffled_weight_scales(
            qv, _hostile_tail(win.w16, 16 * (cp * 32 - k) // 2)[:, : 16 * kk // 2], xs, s32v,
            dtype=torch.float32, use_aot=False)
    try:
        y = call()
    except Exception as e:  # noqa: BLE001 - the verdict records what the kernel did
        return "raises", f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:120].replace("|", "/")
    out = compare(y, a, win.ref)
    if not out.finite:
        return "NaN", f"{int(torch.isnan(y).sum())} of {y.numel()} outputs"
    if out.ok:
        return "exact", f"{out.max_err:.3g}"
    return "wrong", f"{out.max_err:.3g} (rel {out.rel_err:.3g}): wrong"


def expected_pad_verdict(kernel: str, mode: str, byte: int) -> str:
    """What aiter's kernels did (docs/consumer-kernels.md): the preshuffle-weight kernel has no
    masked (EVEN_K = False) branch and cannot run K % 256 != 0; the others read the pad columns
    (0xFF, E8M0 NaN, poisons every output) but, told the real K, multiply them by masked zeros;
    told the padded K they multiply them by the data past K, which only 0x00 (2^-127) cancels."""
    if kernel == PRESHUFFLED_WEIGHT_SCALES and mode == "K":
        return "raises"
    if byte == 0xFF:
        return "NaN"
    if mode == "Kpad" and byte != 0x00:
        return "wrong"
    return "exact"


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.parametrize("byte", PAD_BYTES, ids=[f"pad{b:02X}" for b in PAD_BYTES])
@pytest.mark.parametrize("k", PAD_KS)
def test_s32x8_k_pad_byte(aiter_triton_gemm, pad_case, k, byte):
    case = pad_case[k]
    assert case.win.k == k and k % 32 == 0 and k % 256
    # The bytes under test replace exactly prep's pad, which the manifest records.
    assert bool((case.s32_full[case.pad] == case.pad_value).all())
    assert int(case.pad.sum()) == 256 * (-(-k // 256) * 8 - k // 32)  # N = 256: K-pad columns only
    got = {}
    for kernel, m in PAD_RUNS:
        for mode in PAD_MODES:
            verdict, detail = pad_byte_run(aiter_triton_gemm, case, byte, kernel, m, mode)
            got[kernel, m, mode] = verdict
            if verdict == "raises":
                assert "UnboundLocalError" in detail, detail  # aiter's `b` is set only when EVEN_K
    want = {key: expected_pad_verdict(key[0], key[2], byte) for key in got}
    assert got == want


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.parametrize("k", PAD_KS)
def test_written_k_pad_computes_right_with_k_passed_as_padded_width(aiter_triton_gemm, pad_case, k):
    # The checkpoint's own S32x8 bytes, untouched: with 0x00 in the K pad even a caller that takes
    # K from the scale's padded width gets the exact product (0x7F let the hostile data in).
    case = pad_case[k]
    assert case.pad_value == 0x00 and bool((case.s32_full[case.pad] == 0x00).all())
    for kernel, m in PAD_RUNS:
        if kernel == NON_SHUFFLE:
            continue  # reads raw scales: no pad
        for mode in PAD_MODES:
            verdict, detail = pad_byte_run(aiter_triton_gemm, case, None, kernel, m, mode)
            assert verdict == expected_pad_verdict(kernel, mode, 0x00), (kernel, m, mode, detail)
            assert verdict == ("raises" if (kernel, mode) == (PRESHUFFLED_WEIGHT_SCALES, "K") else "exact")


def pad_table(root) -> str:
    """The table of docs/consumer-kernels.md: ``python tests/test_consumer_kernels.py NEW_DIR``."""
    import aiter_oracle

    gemm = aiter_oracle.triton_gemm_module()
    cases = pad_cases(root)
    lines = ["| kernel | K | K passed | M | pad 0x00 (prep, layout v2) | pad 0x7F (layout v1) | pad 0xFF |",
             "|---|---|---|---|---|---|---|"]
    for k in PAD_KS:
        for kernel, m in PAD_RUNS:
            for mode in PAD_MODES:
                cells = []
                for byte in PAD_BYTES:
                    verdict, detail = pad_byte_run(gemm, cases[k], byte, kernel, m, mode)
                    if verdict == "raises" and "UnboundLocalError" in detail:
                        detail = "UnboundLocalError (`b` unset: EVEN_K is False)"
                    cells.append({"exact": f"{detail} (within bound)", "wrong": detail}.get(
                        verdict, f"{verdict}: {detail}"))
                told = k if mode == "K" else -(-k // 256) * 256
                lines.append(f"| `{kernel}` | {k} | {told} | {m} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    import os
    import pathlib
    import sys
    import warnings

    os.environ.setdefault("TRITON_INTERPRET", "1")
    warnings.simplefilter("ignore", RuntimeWarning)
    out = pathlib.Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=False)
    print(pad_table(out))
