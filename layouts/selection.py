"""Picking the fused activation quant's flags for the dense MXFP4 GEMM that consumes its output.

The fused RMSNorm + MXFP4 quant writes the activation scale either row-major ``[M, K/32]`` or
S32x8-shuffled, and either exactly ``M`` rows or padded to ``[pad256(M), pad8(K/32)]``; the GEMM
path decides which, from the token count. The rules are the engines' (each profile's
``gemm_paths``, ATOM's table in ``layouts/engines/atom/``); this module applies them.
"""

from __future__ import annotations

from typing import NamedTuple

from .engines import NEVER, GemmPathRule, gemm_path_rule, get_engine

GEMM_PATH_RULES: dict[str, GemmPathRule] = dict(get_engine().gemm_paths)
"""The default engine's (ATOM's) GEMM paths and their rules, by name."""

__all__ = ["NEVER", "GEMM_PATH_RULES", "ActivationQuantFlags", "GemmPathRule", "gemm_path_rule",
           "select_activation_quant"]


class ActivationQuantFlags(NamedTuple):
    shuffle: bool
    scale_shuffle_padding: bool


def select_activation_quant(gemm_path: str, num_tokens: int) -> ActivationQuantFlags:
    """``(shuffle, scale_shuffle_padding)`` for the fused activation quant feeding ``gemm_path``
    (any engine's: path names are shared), for a batch of ``num_tokens`` rows."""
    if num_tokens < 0:
        raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
    rule = gemm_path_rule(gemm_path)

    def on(threshold: int | None) -> bool:
        return threshold is not None and num_tokens >= threshold

    return ActivationQuantFlags(on(rule.min_tokens_shuffle), on(rule.min_tokens_padding))
