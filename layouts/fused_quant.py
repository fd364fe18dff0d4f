"""The fused activation quant of a DeepSeek MXFP4 layer: (residual add +) RMSNorm + MXFP4 quant.

Same contract as aiter's ``aiter.ops.triton.fused_mxfp4_quant.fused_rms_mxfp4_quant``::

    (q, scale), out2, out_res1 = fused_rms_mxfp4_quant(x1, w1, eps1, x2, w2, eps2, res1,
                                                       shuffle, scale_shuffle_padding)

1. if ``res1`` is given, ``x1 = x1 + res1`` (in float32) and ``out_res1`` is that sum in x1's
   dtype; the RMSNorm below uses the float32 sum, not the rounded one (as aiter does);
2. ``y = (x1 * rstd) * w1`` in float32, ``rstd = 1 / sqrt(mean(x1**2) + eps1)``;
3. if ``x2`` is given, ``out2`` is the RMSNorm of x2 with ``w2`` / ``eps2``, in **x1's** dtype
   (aiter allocates it so; DeepSeek passes bf16 for both);
4. ``y`` (float32, not rounded to bf16 first: aiter quantizes the float32 norm) is quantized with
   the ``AITER_TRITON`` recipe: EVEN scale, ties away from zero, -0 kept as code 8, an all-zero
   block gets scale byte 0.

``q`` is uint8 ``[M, N1/2]`` (low nibble = even element). ``scale`` is uint8 ``[M, ceil(N1/32)]``,
or ``[pad256(M), pad8(ceil(N1/32))]`` when ``shuffle or scale_shuffle_padding`` (aiter's
condition: shuffling implies padding), written in S32x8 order when ``shuffle``.

Scale padding: aiter allocates the padded buffer with ``torch.empty`` and leaves the pad rows
uninitialised (pad columns of real rows get 127 when shuffling, 0 when not). The ``torch`` and
``triton`` back ends here write 0x7F (scale 1.0, :data:`layouts.mxfp4.E8M0_ONE`) into every pad
byte, rows and columns, so the buffer is deterministic; the ``aiter`` back end returns aiter's
bytes unchanged (pad unspecified). Consumers read only ``[:M, :ceil(N1/32)]`` (unshuffled).

Back ends, picked per call (``backend="auto"``) by the tensors' device:

* ``aiter``: aiter's own Triton kernel, when ``import aiter`` works (ROCm);
* ``triton``: prep's own Triton kernel (:mod:`layouts._triton_fused_quant`) on other GPUs;
* ``torch``: :func:`fused_rms_mxfp4_quant_reference`, on CPU tensors.

The module imports torch only; triton (and aiter) are imported on first use.
"""

from __future__ import annotations

import functools
import logging
from typing import Callable, Optional

import torch

from .mxfp4 import AITER_TRITON, BLOCK_SIZE, E8M0_BIAS, E8M0_ONE, QuantRecipe, e2m1_encode, pack_fp4, scale_exponent
from .shuffle import S8_COLS, SCALE_ROW_PAD, pad_to

__all__ = [
    "RECIPE", "BACKENDS", "FusedQuantOutput", "fused_scale_shape", "rms_norm_f32",
    "check_rms_inputs", "fused_rms_mxfp4_quant_reference", "aiter_available", "select_backend",
    "fused_rms_mxfp4_quant",
]

_LOG = logging.getLogger("layouts")

RECIPE: QuantRecipe = AITER_TRITON
"""The quant recipe of the fused op (aiter's Triton ``_mxfp4_quant_op``)."""

BACKENDS = ("auto", "aiter", "triton", "torch")

FusedQuantOutput = tuple[tuple[torch.Tensor, torch.Tensor], Optional[torch.Tensor], Optional[torch.Tensor]]
"""``((q, scale), out2, out_res1)``; out2 / out_res1 are None when x2 / res1 are."""


def fused_scale_shape(m: int, n1: int, shuffle: bool = False, scale_shuffle_padding: bool = False) -> tuple[int, int]:
    """Shape of the scale buffer the fused op returns for ``x1 [m, n1]``."""
    cols = -(-n1 // BLOCK_SIZE)
    if shuffle or scale_shuffle_padding:
        return pad_to(m, SCALE_ROW_PAD), pad_to(cols, S8_COLS)
    return m, cols


# ---------------------------------------------------------------------------------------------
# torch reference


def rms_norm_f32(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """aiter's RMSNorm on a float32 ``x``: ``(x * rstd) * w`` with ``rstd = 1/sqrt(ss/N + eps)``.

    ``1 / sqrt`` (both correctly rounded on CPU and CUDA) rather than ``rsqrt`` (approximate on
    CUDA), so that the reference is the same on every device up to the summation order. The square
    root is taken in float64 and rounded once to float32, which is the correctly rounded float32
    root: torch's vectorised float32 sqrt on the CPU is not (1 row in 40 an ulp off, against
    numpy's and the kernels' ``sqrt_rn``).
    """
    ms = (x * x).sum(dim=-1, keepdim=True) / x.shape[-1]
    rstd = 1.0 / torch.sqrt((ms + eps).double()).float()
    return x * rstd * weight.float()


def _mxfp4_quant_f32(y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`layouts.mxfp4.quantize` with the AITER_TRITON recipe, free of host syncs (so it can
    be captured in a CUDA graph or compiled)."""
    m, k = y.shape
    nblocks = -(-k // BLOCK_SIZE)
    if nblocks * BLOCK_SIZE != k:
        y = torch.nn.functional.pad(y, (0, nblocks * BLOCK_SIZE - k))
    blocks = y.reshape(m, nblocks, BLOCK_SIZE)
    e = scale_exponent(blocks.abs().amax(dim=-1), RECIPE.rule)
    # 2^-e built from its bits (exact for every e in [-127, 127]; 2^-127 is a denormal).
    ib = E8M0_BIAS - e
    inv = torch.where(ib == 0, 0x00400000, ib << 23).view(torch.float32)
    codes = e2m1_encode(blocks * inv.unsqueeze(-1), RECIPE.rounding, RECIPE.keep_negative_zero)
    codes = codes.reshape(m, nblocks * BLOCK_SIZE)[:, :k]
    return pack_fp4(codes), (e + E8M0_BIAS).to(torch.uint8)


def _s32x8(u: torch.Tensor) -> torch.Tensor:
    """S32x8 of an already padded ``[32i, 8j]`` buffer as one view-permute-copy (graph-safe; the
    tests check it against :func:`layouts.shuffle.preshuffle_scale`)."""
    rp, cp = u.shape
    # source (s, a, l, g, d, e) with r = 32s + 16a + l, c = 8g + 4d + e -> (s, g, e, l, d, a)
    return u.view(rp // 32, 2, 16, cp // 8, 2, 4).permute(0, 3, 5, 2, 4, 1).reshape(rp, cp)


def _scale_layout(s: torch.Tensor, shuffle: bool, padded: bool) -> torch.Tensor:
    if not padded:
        return s
    m, cols = s.shape
    out = s.new_full(fused_scale_shape(m, cols * BLOCK_SIZE, True, True), E8M0_ONE)
    out[:m, :cols] = s
    return _s32x8(out) if shuffle else out


def _check(x1, x1_weight, x2, x2_weight, res1) -> None:
    if x1.dim() != 2 or x1.shape[1] % 2:
        raise ValueError(f"x1 must be [M, N1] with N1 even, got shape {tuple(x1.shape)}")
    check_rms_inputs(x1, x1_weight, x2, x2_weight, res1)


def check_rms_inputs(x1, x1_weight, x2, x2_weight, res1) -> None:
    """The shapes every fused RMSNorm + quant takes (ValueError naming the argument): x1 ``[M, N1]``,
    its weight ``[N1]``, res1 x1's shape, x2 ``[M, N2]`` with its weight ``[N2]``."""
    if x1.dim() != 2:
        raise ValueError(f"x1 must be [M, N1], got shape {tuple(x1.shape)}")
    m, n1 = x1.shape
    if tuple(x1_weight.shape) != (n1,):
        raise ValueError(f"x1_weight must be [{n1}], got shape {tuple(x1_weight.shape)}")
    if res1 is not None and tuple(res1.shape) != (m, n1):
        raise ValueError(f"res1 must have x1's shape {(m, n1)}, got {tuple(res1.shape)}")
    if x2 is not None:
        if x2.dim() != 2 or x2.shape[0] != m:
            raise ValueError(f"x2 must be [{m}, N2] (x1's rows), got shape {tuple(x2.shape)}")
        if x2_weight is None or tuple(x2_weight.shape) != (x2.shape[1],):
            raise ValueError(f"x2_weight must be [{x2.shape[1]}], got "
                             f"{None if x2_weight is None else tuple(x2_weight.shape)}")


def fused_rms_mxfp4_quant_reference(
    x1: torch.Tensor,
    x1_weight: torch.Tensor,
    x1_epsilon: float,
    x2: Optional[torch.Tensor] = None,
    x2_weight: Optional[torch.Tensor] = None,
    x2_epsilon: float = 0.0,
    res1: Optional[torch.Tensor] = None,
    shuffle: bool = False,
    scale_shuffle_padding: bool = False,
) -> FusedQuantOutput:
    """The fused op in plain torch (any device): the numerical reference and the CPU back end.

    Same contract as :func:`fused_rms_mxfp4_quant`; pad bytes of a padded scale are 0x7F. No
    host syncs, so it can be captured in a CUDA graph or ``torch.compile``-d.
    """
    _check(x1, x1_weight, x2, x2_weight, res1)
    x = x1.float()
    out_res1 = None
    if res1 is not None:
        x = x + res1.float()
        out_res1 = x.to(x1.dtype)
    q, s = _mxfp4_quant_f32(rms_norm_f32(x, x1_weight, x1_epsilon))
    out2 = None
    if x2 is not None:
        out2 = rms_norm_f32(x2.float(), x2_weight, x2_epsilon).to(x1.dtype)
    return (q, _scale_layout(s, bool(shuffle), bool(shuffle or scale_shuffle_padding))), out2, out_res1


# ---------------------------------------------------------------------------------------------
# back ends


@functools.lru_cache(maxsize=1)
def _aiter_probe() -> tuple[Optional[Callable], str]:
    """aiter's fused op and "", or None and why not. Probed once: ``import aiter`` raises
    RuntimeError (not ImportError) where there is no ROCm, so any exception means unusable."""
    try:
        import aiter  # noqa: F401
        from aiter.ops.triton.fused_mxfp4_quant import fused_rms_mxfp4_quant as fn
    except Exception as exc:  # noqa: BLE001 - see docstring
        reason = f"{type(exc).__name__}: {exc}"
        _LOG.info("aiter is not usable here (%s); fused_rms_mxfp4_quant runs prep's own Triton "
                  "kernel on GPU tensors and the torch reference on CPU tensors", reason)
        return None, reason
    return fn, ""


def aiter_available() -> bool:
    """Whether aiter's own fused kernel can be used (``import aiter`` works: ROCm)."""
    return _aiter_probe()[0] is not None


def select_backend(device: torch.device | str, backend: str = "auto") -> str:
    """The back end a call on ``device`` runs with: "aiter", "triton" or "torch".

    "auto" picks torch for CPU tensors, else aiter when importable, else our Triton kernel.
    Asking for "aiter" where it cannot be imported raises RuntimeError with the reason.
    """
    if not isinstance(device, torch.device):
        device = torch.device(device)
    if backend == "auto":
        if device.type == "cpu":
            return "torch"
        return "aiter" if aiter_available() else "triton"
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend '{backend}'; known: {', '.join(BACKENDS)}")
    if backend == "aiter" and not aiter_available():
        raise RuntimeError(f"backend='aiter' was asked for, but aiter cannot be imported here "
                           f"({_aiter_probe()[1]}); use backend='triton' (GPU) or 'torch'")
    return backend


_TRITON_IMPL: Optional[Callable] = None


def _triton_impl() -> Callable:
    global _TRITON_IMPL
    if _TRITON_IMPL is None:  # imported on first use: the module must import with torch alone
        try:
            from . import _triton_fused_quant
        except ImportError as exc:
            raise RuntimeError(f"backend='triton' needs the triton package ({exc})") from exc
        _TRITON_IMPL = _triton_fused_quant.fused_rms_mxfp4_quant_triton
    return _TRITON_IMPL


def fused_rms_mxfp4_quant(
    x1: torch.Tensor,
    x1_weight: torch.Tensor,
    x1_epsilon: float,
    x2: Optional[torch.Tensor] = None,
    x2_weight: Optional[torch.Tensor] = None,
    x2_epsilon: float = 0.0,
    res1: Optional[torch.Tensor] = None,
    shuffle: bool = False,
    scale_shuffle_padding: bool = False,
    *,
    backend: str = "auto",
) -> FusedQuantOutput:
    """(residual add +) RMSNorm + MXFP4 quant of ``x1``, and RMSNorm of ``x2``: aiter's contract.

    Returns ``((q [M, N1/2] uint8, scale uint8), out2, out_res1)``; see the module docstring for
    the numerics (recipe ``AITER_TRITON``), the scale shape/layout and the pad bytes. ``backend``
    ("auto" | "aiter" | "triton" | "torch") forces an implementation (tests, benchmarks).
    """
    _check(x1, x1_weight, x2, x2_weight, res1)
    which = select_backend(x1.device, backend)
    if which == "aiter":
        return _aiter_probe()[0](x1, x1_weight, x1_epsilon, x2, x2_weight, x2_epsilon, res1,
                                 shuffle, scale_shuffle_padding)
    if which == "torch":
        return fused_rms_mxfp4_quant_reference(x1, x1_weight, x1_epsilon, x2, x2_weight, x2_epsilon,
                                               res1, shuffle, scale_shuffle_padding)
    impl = _triton_impl()
    # The kernel indexes rows by their stride and columns by 1.
    x1, x1_weight = _unit_last(x1), _unit_last(x1_weight)
    res1, x2, x2_weight = _unit_last(res1), _unit_last(x2), _unit_last(x2_weight)
    return impl(x1, x1_weight, x1_epsilon, x2, x2_weight, x2_epsilon, res1, shuffle, scale_shuffle_padding)


def _unit_last(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    return t if t is None or t.stride(-1) == 1 else t.contiguous()
