"""The fused (residual add +) RMSNorm + FP8 activation quant (``layouts.fused_fp8_quant``).

Pinned on the CPU (Triton kernels under TRITON_INTERPRET=1): our Triton kernel against our torch
reference, and the reference against aiter's own ``fused_rms_fp8_group_quant`` at the commit ATOM
is pinned with (the pinned aiter tree from harness/sources.py), at DeepSeek's two call
sites with ATOM's arguments (group 128, transposed scale; per token), e4m3fn and MI300's e4m3fnuz.

Exactness: where the float32 sum of squares is the same in any order (every partial sum exact:
inputs on a 1/16 grid), every byte is equal, scales included. On general data the order moves
rstd, and with it a group's amax and its float32 scale, by an ulp or two: scales then agree
within 4 ulp (relative 2^-21; seen: 3) and at most ``2 + n / 100000`` FP8 codes differ, each by
one step of the FP8 grid. aiter's kernel is compared with the interpreter's float -> FP8
conversion replaced by the GPUs' (``aiter_oracle.interpreter_fp8_conversion_as_on_gpu``: the
interpreter's drops the carry into the exponent).
"""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

import aiter_oracle
from conftest import need_engine_sources
from layouts import fused_fp8_quant as F8
from layouts._triton_fused_fp8_quant import _fp8_byte
from layouts.fused_fp8_quant import fused_rms_fp8_quant, fused_rms_fp8_quant_reference
from layouts.engines import get_engine
from test_fused_quant import EPS, N2_KV, assert_one_step, assert_res_close, make_inputs

ATOM = get_engine("atom")  # the engine whose profile these tests use

FN, FNUZ = torch.float8_e4m3fn, torch.float8_e4m3fnuz
SCALE_RTOL = 2 ** -21


def on_grid(args: dict, seed: int = 1) -> dict:
    """``args`` with x1 (and res1) on the 1/16 grid in [-15/16, 15/16]: every square and partial
    sum of squares is exact in float32 (7168 * 30**2 / 256 < 2**24 / 256), so the order of the sum
    cannot matter and all outputs must be equal byte for byte."""
    g = torch.Generator().manual_seed(seed)
    out = dict(args)
    for k in ("x1", "res1"):
        if k in out:
            out[k] = (torch.randint(-15, 16, tuple(out[k].shape), generator=g).float() / 16).to(out[k].dtype)
    return out


def fp8_steps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Distance in grid steps between FP8 tensors of the same sign (sign-magnitude bytes)."""
    ia, ib = a.view(torch.uint8).to(torch.int16), b.view(torch.uint8).to(torch.int16)
    ia = torch.where(ia >= 128, -(ia & 0x7F), ia)
    ib = torch.where(ib >= 128, -(ib & 0x7F), ib)
    return (ia - ib).abs()


def assert_fp8_close(out, want, args: dict, exact: bool) -> None:
    (q, s), out2, res = out
    (wq, ws), wout2, wres = want
    assert q.dtype == wq.dtype and q.shape == wq.shape and s.dtype == torch.float32 and s.shape == ws.shape
    assert s.stride() == ws.stride() and s.is_contiguous()
    if exact:
        assert torch.equal(s, ws) and torch.equal(q.view(torch.uint8), wq.view(torch.uint8))
    else:
        assert torch.allclose(s, ws, rtol=SCALE_RTOL, atol=0), float((s / ws - 1).abs().max())
        steps = fp8_steps(q, wq)
        assert int((steps > 0).sum()) <= 2 + q.numel() // 100_000 and int(steps.max()) <= 1
    assert_one_step(out2, wout2, "out2")
    assert_res_close(res, wres, args)


# ------------------------------------------------------------------------ our kernel vs reference
@pytest.mark.parametrize("m, n1, with_x2, with_res, group, dtype, transpose", [
    (1, 7168, False, True, 128, FN, True),     # decode, input_layernorm with its residual
    (37, 1536, True, False, 128, FN, True),    # q_a_layernorm + kv_a_layernorm
    (33, 7168, False, True, 128, FNUZ, False),  # MI300's type
    (7, 1536, True, True, None, FN, False),    # per token
    (5, 200, False, False, 64, FNUZ, True),    # a partial last group
    (3, 96, True, False, None, FN, True),      # per token, a row narrower than a chunk
])
@pytest.mark.parametrize("grid", [True, False], ids=["exact-sums", "random"])
def test_triton_kernel_matches_torch_reference(m, n1, with_x2, with_res, group, dtype, transpose, grid):
    args = make_inputs(m, n1, x2=with_x2, res=with_res)
    if grid:
        args = on_grid(args)
    kw = dict(group_size=group, dtype=dtype, transpose_scale=transpose)
    out = fused_rms_fp8_quant(**args, **kw, backend="triton")
    assert_fp8_close(out, fused_rms_fp8_quant_reference(**args, **kw), args, exact=grid)


def test_the_kernels_fp8_encoding_is_torchs_round_to_nearest_even_on_every_float():
    # Every float32 bit pattern from 0 up to beyond each type's largest value in steps that hit
    # every rounding boundary class (ties, carries into the exponent, subnormals), both signs, NaN.
    bits = torch.arange(0, 0x43E1_0000, 997, dtype=torch.int64).to(torch.int32)
    ties = torch.arange(0x3A80_0000, 0x43E0_0000, 1 << 19, dtype=torch.int64).to(torch.int32)  # every half step
    v = torch.cat([bits, ties, ties + 1, ties - 1]).view(torch.float32)
    v = torch.cat([v, -v, torch.tensor([float("nan"), -float("nan")])])
    for dtype in (FN, FNUZ):
        big = F8.fp8_max(dtype)
        x = v.clamp(-big, big).where(~v.isnan(), v).reshape(1, -1)
        n = x.shape[1] - x.shape[1] % 128
        x = x[:, :n].contiguous()
        want = x.to(dtype).view(torch.uint8)
        got = _encode_with_kernel(x, dtype)
        bad = got != want
        assert not bool(bad.any()), (dtype, x[bad][:5].tolist(), got[bad][:5].tolist(), want[bad][:5].tolist())


@triton.jit
def _encode_kernel(x_ptr, o_ptr, n, FNUZ: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    tl.store(o_ptr + offs, _fp8_byte(tl.load(x_ptr + offs, mask=ok), FNUZ).to(tl.uint8), mask=ok)


def _encode_with_kernel(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    out = torch.empty(x.numel(), dtype=torch.uint8)
    _encode_kernel[(triton.cdiv(x.numel(), 1 << 16),)](x.reshape(-1), out, x.numel(), FNUZ=dtype == FNUZ,
                                                       BLOCK=1 << 16)
    return out.reshape(x.shape)


@pytest.mark.parametrize("n1, n2, res", [(7168, 0, True), (1536, 512, False)], ids=["input-norm", "q_a+kv_a"])
def test_triton_kernel_compiles_with_the_gpus_fp8_conversion_for_nvidia_and_fnuz_bytes_for_amd(n1, n2, res, tmp_path):
    # On a CUDA GPU the kernel encodes e4m3fn with the GPU's own conversion (NATIVE_CAST), which the
    # interpreter never runs; MI300 takes e4m3fnuz through _fp8_byte. Both compiled here, no GPU.
    from offline_compile import compile_for_nvidia_and_amd

    got = compile_for_nvidia_and_amd("layouts._triton_fused_fp8_quant", (4096, n1, n2, res), tmp_path,
                                     amd_kwargs={"dtype": "torch.float8_e4m3fnuz"})
    assert got["nvidia"]["cubin"] > 0 and got["amd"]["hsaco"] > 0
    assert "cvt.rn.satfinite.e4m3x2.f32" in got["nvidia"]["ptx"]  # the GPU's conversion, two at a time


def test_transposed_scale_holds_the_transposes_bytes_presented_as_rows_by_groups():
    args = make_inputs(9, 1536)
    (_, s), _, _ = fused_rms_fp8_quant_reference(**args)
    (_, st), _, _ = fused_rms_fp8_quant_reference(**args, transpose_scale=True)
    assert st.shape == s.shape == (9, 12) and torch.equal(st.reshape(12, 9).t(), s)
    (_, kt), _, _ = fused_rms_fp8_quant(**on_grid(args), transpose_scale=True, backend="triton")
    (_, rt), _, _ = fused_rms_fp8_quant_reference(**on_grid(args), transpose_scale=True)
    assert torch.equal(kt, rt)


def test_an_all_zero_row_gets_the_floor_scale_and_zero_codes():
    args = make_inputs(4, 512, res=True)
    args["x1"][1] = 0
    args["res1"][1] = 0
    for backend in ("torch", "triton"):
        (q, s), _, _ = fused_rms_fp8_quant(**args, backend=backend)
        assert torch.equal(s[1], torch.full((4,), F8.AMAX_FLOOR, dtype=torch.float32) / 448.0), backend
        assert not bool((q[1].view(torch.uint8) & 0x7F).any()), backend  # zeros (-0 under a negative weight)


def test_bad_arguments_are_refused_naming_the_argument():
    args = make_inputs(2, 256)
    with pytest.raises(ValueError, match="group_size must be a power of two"):
        fused_rms_fp8_quant(**args, group_size=100)
    with pytest.raises(ValueError, match="dtype must be one of"):
        fused_rms_fp8_quant(**args, dtype=torch.float8_e5m2)
    with pytest.raises(ValueError, match="x1_weight must be"):
        fused_rms_fp8_quant(args["x1"], args["x1_weight"][:-1], EPS)


def test_cpu_tensors_run_the_torch_reference():
    args = make_inputs(3, 256)
    got = fused_rms_fp8_quant(**args)
    want = fused_rms_fp8_quant_reference(**args)
    assert torch.equal(got[0][0].view(torch.uint8), want[0][0].view(torch.uint8)) and torch.equal(got[0][1], want[0][1])


# ----------------------------------------------------------------------------- against aiter's
@pytest.fixture(scope="module")
def aiter_fused_fp8(tmp_path_factory):
    """aiter's ``fused_rms_fp8_group_quant`` at e4048607, interpreted on the CPU."""
    from harness import sources

    _, aiter_tree = sources.trees(need_engine_sources(), tmp_path_factory.mktemp("engine-sources"))
    return aiter_oracle.pinned_fused_fp8_quant(aiter_tree).fused_rms_fp8_group_quant


@pytest.mark.parametrize("site, m, dtype", [
    ("input_layernorm", 1, FN), ("input_layernorm", 40, FNUZ), ("q_a_layernorm", 33, FN),
    ("q_a_layernorm", 2, FNUZ), ("per-token-pow2", 6, FN)])
@pytest.mark.parametrize("grid", [True, False], ids=["exact-sums", "random"])
def test_reference_and_triton_kernel_match_aiters_kernel_at_atoms_call_sites(aiter_fused_fp8, site, m, dtype, grid):
    # ATOM (deepseek_v2.py, ffdf3bb5): input_layernorm(hidden [M, 7168], residual) and
    # q_a_layernorm(q_c [M, 1536]) with kv_a_layernorm(kv_c [M, 512]) beside it, group_size=128,
    # transpose_scale=True. Per token is aiter's group kernel with one group per row (it needs a
    # power-of-two width for that).
    if site == "input_layernorm":
        args, group = make_inputs(m, 7168, res=True, seed=m), 128
    elif site == "q_a_layernorm":
        args, group = make_inputs(m, 1536, x2=True, n2=N2_KV, seed=m), 128
    else:
        args, group = make_inputs(m, 1024, x2=True, seed=m), None
    if grid:
        args = on_grid(args)
    transpose = group is not None
    with aiter_oracle.interpreter_fp8_conversion_as_on_gpu():
        (q, s), _, out2, res = aiter_fused_fp8(
            args["x1"], args["x1_weight"], EPS, args.get("x2"), args.get("x2_weight"), args.get("x2_epsilon"),
            group or args["x1"].shape[1], dtype, args.get("res1"), transpose_scale=transpose)
    kw = dict(group_size=group, dtype=dtype, transpose_scale=transpose)
    want = fused_rms_fp8_quant_reference(**args, **kw)
    assert_fp8_close(((q, s), out2, res), want, args, exact=grid)
    assert_fp8_close(fused_rms_fp8_quant(**args, **kw, backend="triton"), want, args, exact=grid)


# ------------------------------------------------------------------------------ the engine's plan
@pytest.mark.parametrize("attention_quant, group", [("fp8-per-token", None), ("fp8-1x128", 128)])
@pytest.mark.parametrize("arch, dtype", [("gfx950", FN), ("gfx942", FNUZ)])
def test_the_plan_runs_atoms_fp8_call_at_both_sites_in_the_archs_fp8_type(attention_quant, group, arch, dtype):
    import layouts

    engine = layouts.EngineConfig(gemm_path="triton-preshuffle", gpu_arch=arch, profile=ATOM)
    plan = layouts.ActivationQuantPlan.for_engine(engine, backend="torch", attention_quant=attention_quant)
    h = make_inputs(5, 7168, res=True)
    (q, s), res = plan.input_layernorm(h["x1"], h["x1_weight"], EPS, h["res1"])
    (wq, ws), _, wres = fused_rms_fp8_quant_reference(h["x1"], h["x1_weight"], EPS, res1=h["res1"], group_size=group,
                                                      dtype=dtype, transpose_scale=True)
    assert q.dtype == dtype and torch.equal(q.view(torch.uint8), wq.view(torch.uint8)) and torch.equal(s, ws)
    assert torch.equal(res, wres)
    a = make_inputs(5, 1536, x2=True, seed=3)
    (q, s), kv = plan.q_a_layernorm(a["x1"], a["x1_weight"], EPS, a["x2"], a["x2_weight"], EPS)
    (wq, ws), wkv, _ = fused_rms_fp8_quant_reference(**a, group_size=group, dtype=dtype, transpose_scale=True)
    assert torch.equal(q.view(torch.uint8), wq.view(torch.uint8)) and torch.equal(s, ws) and torch.equal(kv, wkv)


def test_fp8_block_input_quant_is_fused_only_where_the_gemm_path_fuses_it():
    # ATOM fuses the input RMSNorm with a 1x128 FP8 quant only under ATOM_USE_TRITON_GEMM=1; on its
    # default ASM path that layer's input stays BF16 (the linear quantizes it), per token is fused.
    import layouts

    h = make_inputs(3, 7168, res=True)
    asm = layouts.EngineConfig(gemm_path="asm", profile=ATOM)
    block = layouts.ActivationQuantPlan.for_engine(asm, backend="torch", attention_quant="fp8-1x128")
    (x, scale), res = block.input_layernorm(h["x1"], h["x1_weight"], EPS, h["res1"])
    assert scale is None and x.dtype == torch.bfloat16 and torch.equal(res, (h["x1"].float() + h["res1"].float()).bfloat16())
    token = layouts.ActivationQuantPlan.for_engine(asm, backend="torch", attention_quant="fp8-per-token")
    (q, scale), _ = token.input_layernorm(h["x1"], h["x1_weight"], EPS, h["res1"])
    assert q.dtype == FN and scale.shape == (3, 1)
    with pytest.raises(ValueError, match="attention_quant must be one of"):
        layouts.ActivationQuantPlan("asm", attention_quant="fp8", profile=ATOM)
