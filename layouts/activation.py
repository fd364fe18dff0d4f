"""The activation side of a converted checkpoint: at each of DeepSeek's two fused call sites,
which flags the fused RMSNorm + MXFP4 quant needs for the GEMM that consumes its output.

A plan is made from the manifest and the engine's configuration (after the compatibility
check), and picks ``shuffle`` / ``scale_shuffle_padding`` per call from the token count, as
ATOM's ``_mxfp4_activation_quant_layout`` does:

* ``input_layernorm`` (+ residual) before ``fused_qkv_a_proj``;
* ``q_a_layernorm`` (q, quantized) + ``kv_a_layernorm`` (kv, BF16) before ``q_b_proj``.

When the engine turns a call site's fusion off (``ATOM_ENABLE_DS_*_QUANT_FUSION=0``), the plan
returns the BF16 RMSNorm output and no scale there: the GEMM's own path quantizes it.

Where the attention's linears are FP8 (``attention_quant``: Quark's per-channel FP8 attention,
whose activations are quantized per token, or FP8 128x128 blocks, whose activations are quantized
per 1x128 group), both sites run the fused RMSNorm + FP8 quant instead, as ATOM calls it
(``group_size=128``, the scale transposed), in the arch's FP8 type; the input site with 1x128
groups is fused only on a GEMM path whose rule says so (ATOM: its Triton GEMM).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from .engines._compat import EngineConfig, check_compatibility
from .engines import EngineProfile, GemmPathRule
from .fp8 import GROUP_SIZE, fp8_dtype_for
from .fused_fp8_quant import fused_rms_fp8_quant
from .fused_quant import rms_norm_f32, fused_rms_mxfp4_quant
from .manifest import Manifest
from .selection import ActivationQuantFlags, select_activation_quant

__all__ = [
    "ATTENTION_QUANTS", "Quantized", "rms_norm", "ActivationQuantPlan",
]

MXFP4, FP8_PER_TOKEN, FP8_BLOCK = "mxfp4", "fp8-per-token", "fp8-1x128"
ATTENTION_QUANTS = (MXFP4, FP8_PER_TOKEN, FP8_BLOCK)
"""What the attention's quantized linears read: MXFP4 activations (the GEMM path's flags), or FP8
activations per token (per-channel FP8 weights) or per 1x128 group (FP8 block weights)."""

Quantized = tuple[torch.Tensor, Optional[torch.Tensor]]
"""``(q, scale)``: MXFP4 codes and E8M0 scales, or ``(bf16 activations, None)`` when unfused."""


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm in float32 (the fused op's own arithmetic), returned in ``x``'s dtype."""
    return rms_norm_f32(x.float(), weight, eps).to(x.dtype)


@dataclasses.dataclass(frozen=True)
class ActivationQuantPlan:
    """How activations are quantized for the GEMM path that reads this checkpoint's weights."""

    gemm_path: str  # one of its engine's GEMM paths
    # The engine whose GEMM path it is: the path's rule (its activation flags) is that profile's
    profile: EngineProfile = dataclasses.field(kw_only=True)
    input_norm_quant_fusion: bool = True
    qknorm_quant_fusion: bool = True
    backend: str = "auto"  # fused op back end: "auto" | "aiter" | "triton" | "torch"
    attention_quant: str = MXFP4  # one of ATTENTION_QUANTS
    fp8_dtype: torch.dtype = torch.float8_e4m3fn  # FP8 activations' type (fp8_dtype_for the arch)

    def __post_init__(self) -> None:
        if self.gemm_path not in self.profile.gemm_paths:
            raise ValueError(f"{self.gemm_path!r} is not a GEMM path of {self.profile.display_name}; "
                             f"choose one of {', '.join(self.profile.gemm_paths)}")
        if self.attention_quant not in ATTENTION_QUANTS:
            raise ValueError(f"attention_quant must be one of {', '.join(ATTENTION_QUANTS)}, got {self.attention_quant!r}")

    @classmethod
    def for_checkpoint(cls, manifest: Manifest, engine: EngineConfig, backend: str = "auto") -> "ActivationQuantPlan":
        """The plan for ``engine`` reading ``manifest``'s checkpoint; refuses a mismatched pair."""
        check_compatibility(manifest, engine)
        return cls.for_engine(engine, backend)

    @classmethod
    def for_engine(cls, engine: EngineConfig, backend: str = "auto",
                   attention_quant: str = MXFP4) -> "ActivationQuantPlan":
        """The plan of ``engine``'s GEMM path and fusion switches, for a checkpoint already checked
        against it (:func:`layouts.open_rank` checks once for the load and the plan), whose
        attention reads ``attention_quant`` activations."""
        return cls(engine.gemm_path, engine.input_norm_quant_fusion, engine.qknorm_quant_fusion, backend,
                   attention_quant, fp8_dtype_for(engine.gpu_arch), profile=engine.profile)

    @property
    def rule(self) -> GemmPathRule:
        """The GEMM path's rule, as its engine states it."""
        return self.profile.gemm_paths[self.gemm_path]

    def flags(self, num_tokens: int) -> ActivationQuantFlags:
        """``(shuffle, scale_shuffle_padding)`` for a batch of ``num_tokens`` rows."""
        return select_activation_quant(self.rule, num_tokens)

    def _fused(self, x1, w1, eps1, x2=None, w2=None, eps2=0.0, res1=None):
        if self.attention_quant != MXFP4:
            group = GROUP_SIZE if self.attention_quant == FP8_BLOCK else None
            return fused_rms_fp8_quant(x1, w1, eps1, x2, w2, eps2, res1, group_size=group, dtype=self.fp8_dtype,
                                       transpose_scale=True, backend=self.backend)
        shuffle, padding = self.flags(x1.shape[0])
        return fused_rms_mxfp4_quant(x1, w1, eps1, x2, w2, eps2, res1, shuffle=shuffle,
                                     scale_shuffle_padding=padding, backend=self.backend)

    def input_layernorm(self, x: torch.Tensor, weight: torch.Tensor, eps: float,
                        residual: torch.Tensor | None = None) -> tuple[Quantized, torch.Tensor]:
        """Before ``fused_qkv_a_proj``: ``((q, scale), new_residual)``. ``new_residual`` is
        ``x + residual`` (or ``x`` on the first layer, which has none)."""
        fused = self.input_norm_quant_fusion and (
            self.attention_quant != FP8_BLOCK or self.rule.fuses_fp8_group_input_quant)
        if not fused:
            summed = x if residual is None else (x.float() + residual.float()).to(x.dtype)
            return (rms_norm(summed, weight, eps), None), summed
        (q, scale), _, res = self._fused(x, weight, eps, res1=residual)
        return (q, scale), (x if res is None else res)

    def q_a_layernorm(self, q_c: torch.Tensor, q_weight: torch.Tensor, q_eps: float, kv_c: torch.Tensor,
                      kv_weight: torch.Tensor, kv_eps: float) -> tuple[Quantized, torch.Tensor]:
        """Before ``q_b_proj``: ``((q, scale), kv_normed)``; q_c is quantized, kv_c only normed."""
        if not self.qknorm_quant_fusion:
            return (rms_norm(q_c, q_weight, q_eps), None), rms_norm(kv_c, kv_weight, kv_eps)
        (q, scale), kv, _ = self._fused(q_c, q_weight, q_eps, kv_c, kv_weight, kv_eps)
        return (q, scale), kv
