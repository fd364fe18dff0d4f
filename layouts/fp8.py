"""FP8 activation numerics shared by the fused FP8 quant's reference and its Triton kernel: the
two e4m3 types (OCP ``float8_e4m3fn``; MI300's ``float8_e4m3fnuz``), their largest value, the
scale group ATOM asks for and the scale's shape."""

from __future__ import annotations

from typing import Optional

import torch

__all__ = [
    "FP8_DTYPES", "GROUP_SIZE", "AMAX_FLOOR", "fp8_max", "fp8_dtype_for", "fp8_scale_shape",
]

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e4m3fnuz)
GROUP_SIZE = 128
"""ATOM's group for FP8 activations (``group_size=128`` at both DeepSeek call sites)."""
AMAX_FLOOR = 1e-10
"""The smallest amax a group's scale is made from (aiter's ``tl.maximum(amax, 1e-10)``): an
all-zero group gets scale 1e-10 / FP8_MAX and codes 0, never a division by zero."""


def fp8_max(dtype: torch.dtype) -> float:
    """The largest finite value of ``dtype`` (448.0 for e4m3fn, 240.0 for e4m3fnuz)."""
    if dtype not in FP8_DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(map(str, FP8_DTYPES))}, got {dtype}")
    return float(torch.finfo(dtype).max)


def fp8_dtype_for(gpu_arch: str) -> torch.dtype:
    """The FP8 type activations are quantized to on ``gpu_arch``: MI300 (gfx94x) computes in
    e4m3fnuz (bias 8, max 240), later Instinct GPUs in OCP e4m3fn (aiter's ``dtypes.fp8``)."""
    return torch.float8_e4m3fnuz if gpu_arch.startswith("gfx94") else torch.float8_e4m3fn


def fp8_scale_shape(m: int, n1: int, group_size: Optional[int] = GROUP_SIZE) -> tuple[int, int]:
    """Shape of the scale the fused op returns for ``x1 [m, n1]`` (either presentation)."""
    return m, 1 if group_size is None else -(-n1 // group_size)
