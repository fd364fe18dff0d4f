"""The fused activation quant of a DeepSeek layer with FP8 attention: (residual add +) RMSNorm + FP8.

Same contract as aiter's ``aiter.ops.triton.fused_fp8_quant.fused_rms_fp8_group_quant``, the
Triton form of what ATOM's ``_fused_rms_fp8_quant`` asks aiter for at DeepSeek's two call sites
(``input_layernorm`` with the residual; ``q_a_layernorm`` quantized with ``kv_a_layernorm`` beside
it), with ATOM's ``group_size=128`` or per token::

    (q, scale), out2, out_res1 = fused_rms_fp8_quant(x1, w1, eps1, x2, w2, eps2, res1,
                                                     group_size=128, transpose_scale=True)

1. if ``res1`` is given, ``x1 = x1 + res1`` in float32; ``out_res1`` is that sum in x1's dtype,
   and the RMSNorm uses the float32 sum;
2. ``y = (x1 * rstd) * w1`` in float32, ``rstd = 1 / sqrt(sum(x1**2) / N1 + eps1)``;
3. ``out2`` is the RMSNorm of ``x2`` (``w2``, ``eps2``) in x1's dtype, when x2 is given;
4. ``y`` is quantized per group of ``group_size`` consecutive elements of a row (``None``: per
   token, one group per row): ``amax = max(max|y|, 1e-10)``, ``scale = amax / FP8_MAX`` (448 for
   ``float8_e4m3fn``, 240 for ``float8_e4m3fnuz``, MI300's), ``q = clamp(y * (1 / scale), -MAX,
   MAX)`` rounded to the nearest FP8 value, ties to even (as the GPUs' conversion instructions
   do). Each division is correctly rounded.

``q`` is ``[M, N1]`` in the FP8 dtype. ``scale`` is float32 ``[M, G]``, ``G = ceil(N1 /
group_size)`` (1 per token). With ``transpose_scale`` its bytes are those of the ``[G, M]``
transpose, the buffer presented as ``[M, G]`` (aiter's default presentation for the CK
"bpreshuffle" FP8 GEMM, which ATOM asks for): read it with ``scale.view(G, M).t()``.

Back ends, as for the MXFP4 op (:func:`layouts.fused_quant.select_backend`): aiter's Triton kernel
where ``import aiter`` works (group quant; per token runs ours), prep's Triton kernel
(:mod:`layouts._triton_fused_fp8_quant`) on other GPUs, :func:`fused_rms_fp8_quant_reference` on
CPU tensors. Under the Triton interpreter aiter's own kernel converts to FP8 rounding some ties
away from zero; ours encodes FP8 itself, ties to even, on every device.
"""

from __future__ import annotations

from typing import Optional

import torch

from .fp8 import AMAX_FLOOR, GROUP_SIZE, fp8_max
from .fused_quant import FusedQuantOutput, _aiter_probe, _unit_last, check_rms_inputs, rms_norm_f32, select_backend

__all__ = [
    "fp8_quant", "present_scale", "fused_rms_fp8_quant_reference", "fused_rms_fp8_quant",
]


def _check(x1, x1_weight, x2, x2_weight, res1, group_size, dtype) -> None:
    check_rms_inputs(x1, x1_weight, x2, x2_weight, res1)
    if group_size is not None and (group_size < 8 or group_size & (group_size - 1)):
        raise ValueError(f"group_size must be a power of two >= 8 or None (per token), got {group_size}")
    fp8_max(dtype)


def _quant_f32(y: torch.Tensor, group_size: Optional[int], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    m, n = y.shape
    g = n if group_size is None else group_size
    groups = -(-n // g) if n else 0
    padded = torch.nn.functional.pad(y, (0, groups * g - n)) if groups * g != n else y
    blocks = padded.reshape(m, groups, g)
    big = fp8_max(dtype)
    scale = blocks.abs().amax(dim=-1).clamp_min(AMAX_FLOOR) / big if g else y.new_zeros(m, 0)
    q = (blocks * (1.0 / scale).unsqueeze(-1)).clamp(-big, big).to(dtype).reshape(m, groups * g)[:, :n]
    return q, scale


def fp8_quant(x: torch.Tensor, group_size: Optional[int] = None,
              dtype: torch.dtype = torch.float8_e4m3fn) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic FP8 quant of a 2-D ``x`` without the norm (what an FP8 linear does to an input no
    fused op quantized, ``per_token_quant_hip``): per token (``group_size=None``) or per group,
    with the fused op's numerics. Returns ``(q, scale)``, scale ``[M, groups]`` float32."""
    return _quant_f32(x.float(), group_size, dtype)


def present_scale(scale: torch.Tensor, transpose_scale: bool) -> torch.Tensor:
    """A row-major ``[M, G]`` scale as the op returns it: itself, or (``transpose_scale``) the
    ``[G, M]`` transpose's bytes presented as ``[M, G]``."""
    return scale.t().contiguous().view(scale.shape) if transpose_scale else scale


def fused_rms_fp8_quant_reference(
    x1: torch.Tensor,
    x1_weight: torch.Tensor,
    x1_epsilon: float,
    x2: Optional[torch.Tensor] = None,
    x2_weight: Optional[torch.Tensor] = None,
    x2_epsilon: float = 0.0,
    res1: Optional[torch.Tensor] = None,
    *,
    group_size: Optional[int] = GROUP_SIZE,
    dtype: torch.dtype = torch.float8_e4m3fn,
    transpose_scale: bool = False,
) -> FusedQuantOutput:
    """The fused op in plain torch (any device): the numerical reference and the CPU back end."""
    _check(x1, x1_weight, x2, x2_weight, res1, group_size, dtype)
    x = x1.float()
    out_res1 = None
    if res1 is not None:
        x = x + res1.float()
        out_res1 = x.to(x1.dtype)
    q, scale = _quant_f32(rms_norm_f32(x, x1_weight, x1_epsilon), group_size, dtype)
    out2 = None
    if x2 is not None:
        out2 = rms_norm_f32(x2.float(), x2_weight, x2_epsilon).to(x1.dtype)
    return (q, present_scale(scale, transpose_scale)), out2, out_res1


def _aiter_fp8_op():
    # Only reached where select_backend said aiter imports (ROCm).
    from aiter.ops.triton.fused_fp8_quant import fused_rms_fp8_group_quant

    return fused_rms_fp8_group_quant


def fused_rms_fp8_quant(
    x1: torch.Tensor,
    x1_weight: torch.Tensor,
    x1_epsilon: float,
    x2: Optional[torch.Tensor] = None,
    x2_weight: Optional[torch.Tensor] = None,
    x2_epsilon: float = 0.0,
    res1: Optional[torch.Tensor] = None,
    *,
    group_size: Optional[int] = GROUP_SIZE,
    dtype: torch.dtype = torch.float8_e4m3fn,
    transpose_scale: bool = False,
    backend: str = "auto",
) -> FusedQuantOutput:
    """(residual add +) RMSNorm + FP8 quant of ``x1`` per group of ``group_size`` (``None``: per
    token), and RMSNorm of ``x2``: aiter's contract (module docstring).

    Returns ``((q [M, N1] dtype, scale float32 [M, G]), out2, out_res1)``. ``backend`` ("auto" |
    "aiter" | "triton" | "torch") forces an implementation (tests, benchmarks).
    """
    _check(x1, x1_weight, x2, x2_weight, res1, group_size, dtype)
    which = select_backend(x1.device, backend)
    if which == "aiter" and group_size is None:
        which = "triton"  # aiter's group kernel takes one group per row only at power-of-two widths
    if which == "aiter":
        _aiter_probe()
        (q, s), _, out2, out_res1 = _aiter_fp8_op()(
            x1, x1_weight, x1_epsilon, x2, x2_weight, x2_epsilon, group_size, dtype, res1,
            transpose_scale=transpose_scale)
        return (q, s), out2, out_res1
    if which == "torch":
        return fused_rms_fp8_quant_reference(x1, x1_weight, x1_epsilon, x2, x2_weight, x2_epsilon, res1,
                                             group_size=group_size, dtype=dtype, transpose_scale=transpose_scale)
    from . import _triton_fused_fp8_quant  # imported on first use: the module imports with torch alone

    unit = [_unit_last(t) for t in (x1, x1_weight, x2, x2_weight, res1)]  # the kernel indexes columns by 1
    return _triton_fused_fp8_quant.fused_rms_fp8_quant_triton(
        unit[0], unit[1], x1_epsilon, unit[2], unit[3], x2_epsilon, unit[4],
        group_size=group_size, dtype=dtype, transpose_scale=transpose_scale)
