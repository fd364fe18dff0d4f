"""Which activation-quant flags each dense MXFP4 GEMM path needs (ATOM's
``_mxfp4_activation_quant_layout``), kept as data plus one function.

The fused RMSNorm + MXFP4 quant writes the activation scale either row-major ``[M, K/32]`` or
S32x8-shuffled, and either exactly ``M`` rows or padded to ``[pad256(M), pad8(K/32)]``. The GEMM
that consumes it decides which:

===================== ============== ======================== ==================
GEMM path             weight layout  shuffle                  scale_shuffle_padding
===================== ============== ======================== ==================
asm                   preshuffle     always                   always
triton-preshuffle     preshuffle     M >= 32                  M >= 32 (the GEMM takes ``scale[:M]`` below)
triton-non-shuffle    non-shuffle    never                    never
===================== ============== ======================== ==================
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

NEVER = None


@dataclasses.dataclass(frozen=True)
class GemmPathRule:
    """``min_tokens_*``: smallest token count that turns the flag on (0 = always, None = never)."""

    weight_layout: str
    min_tokens_shuffle: int | None
    min_tokens_padding: int | None


GEMM_PATH_RULES: dict[str, GemmPathRule] = {
    "asm": GemmPathRule("preshuffle", 0, 0),
    "triton-preshuffle": GemmPathRule("preshuffle", 32, 32),
    "triton-non-shuffle": GemmPathRule("non-shuffle", NEVER, NEVER),
}


class ActivationQuantFlags(NamedTuple):
    shuffle: bool
    scale_shuffle_padding: bool


def gemm_path_rule(gemm_path: str) -> GemmPathRule:
    try:
        return GEMM_PATH_RULES[gemm_path]
    except KeyError:
        raise ValueError(f"unknown GEMM path '{gemm_path}'; known: {', '.join(GEMM_PATH_RULES)}") from None


def select_activation_quant(gemm_path: str, num_tokens: int) -> ActivationQuantFlags:
    """``(shuffle, scale_shuffle_padding)`` for the fused activation quant feeding ``gemm_path``."""
    if num_tokens < 0:
        raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
    rule = gemm_path_rule(gemm_path)

    def on(threshold: int | None) -> bool:
        return threshold is not None and num_tokens >= threshold

    return ActivationQuantFlags(on(rule.min_tokens_shuffle), on(rule.min_tokens_padding))
