"""Picking the fused activation quant's flags for the dense MXFP4 GEMM that consumes its output.

The fused RMSNorm + MXFP4 quant writes the activation scale either row-major ``[M, K/32]`` or
S32x8-shuffled, and either exactly ``M`` rows or padded to ``[pad256(M), pad8(K/32)]``; the GEMM
path decides which, from the token count. The rules are the engines' (each profile's
``gemm_paths``: a path's :class:`GemmPathRule`); this module applies one.
"""

from __future__ import annotations

from typing import NamedTuple

from .engines import NEVER, GemmPathRule

__all__ = ["NEVER", "ActivationQuantFlags", "GemmPathRule", "select_activation_quant"]


class ActivationQuantFlags(NamedTuple):
    shuffle: bool
    scale_shuffle_padding: bool


def select_activation_quant(rule: GemmPathRule, num_tokens: int) -> ActivationQuantFlags:
    """``(shuffle, scale_shuffle_padding)`` for the fused activation quant feeding the GEMM path
    whose rule is ``rule`` (its engine's: ``profile.gemm_paths[path]``), for a batch of
    ``num_tokens`` rows."""
    if num_tokens < 0:
        raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")

    def on(threshold: int | None) -> bool:
        return threshold is not None and num_tokens >= threshold

    return ActivationQuantFlags(on(rule.min_tokens_shuffle), on(rule.min_tokens_padding))
