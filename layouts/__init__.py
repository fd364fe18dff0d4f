"""prep's runtime library: MXFP4 numerics, the byte layouts AMD's kernels read, and the rules
for picking them. Imports torch only; engines import this at start-up.

The layouts and their byte formulas: ``docs/layouts.md``. What each engine's switches mean, which
layout each of its paths reads and what it refuses: its profile in ``layouts/engines/``
(``docs/engines.md``). aiter and ATOM are the ground truth.
"""

from .mxfp4 import (
    BLOCK_SIZE,
    E2M1_VALUES,
    AITER_HIP,
    AITER_TRITON,
    E8M0_ONE,
    QUARK,
    QuantRecipe,
    Rounding,
    ScaleRule,
    dequantize,
    e2m1_decode,
    e2m1_encode,
    e8m0_decode,
    e8m0_encode,
    pack_fp4,
    quantize,
    unpack_fp4,
)
from . import activation, dequant, engines, manifest, mla
from .activation import ActivationQuantPlan
from .compat import CompatibilityError, EngineConfig, check_compatibility
from .errors import LayoutsError
from .engines import EngineProfile, engine_names, get_engine, register_engine
from .dequant import dequantize_activation, dequantize_expert, dequantize_stored, dequantize_stored_rows
from .fused_fp8_quant import fused_rms_fp8_quant, fused_rms_fp8_quant_reference
from .fused_quant import fused_rms_mxfp4_quant, fused_rms_mxfp4_quant_reference
from .loader import OpenRank, RankTensors, iter_rank_files, load_rank, open_rank
from .manifest import Manifest, ManifestError, TensorRecord, load_manifest
from .mla import MlaShape, absorbed_kv_b, absorbed_kv_b_of_rank
from .registry import Layout, get_layout, layout_names, register_layout
from .selection import ActivationQuantFlags, select_activation_quant
from .shuffle import (
    LayoutConstraintError,
    preshuffle_scale,
    preshuffle_scale_per_expert,
    preshuffle_weight,
    preshuffle_weight_16bit,
    shuffled_scale_shape,
    unshuffle_scale,
    unshuffle_scale_per_expert,
    unshuffle_weight,
    unshuffle_weight_16bit,
)
from .transforms import Transform

__version__ = "0.1.0"

__all__ = [
    "BLOCK_SIZE", "E2M1_VALUES", "E8M0_ONE", "Rounding", "ScaleRule",
    "AITER_HIP", "AITER_TRITON", "QUARK", "QuantRecipe",
    "dequantize", "e2m1_decode", "e2m1_encode", "e8m0_decode", "e8m0_encode", "pack_fp4", "quantize", "unpack_fp4",
    "Layout", "Transform", "get_layout", "layout_names", "register_layout",
    "ActivationQuantFlags", "select_activation_quant",
    "ActivationQuantPlan", "CompatibilityError", "LayoutsError", "EngineConfig", "check_compatibility",
    "EngineProfile", "engine_names", "get_engine", "register_engine",
    "dequantize_activation", "dequantize_expert", "dequantize_stored", "dequantize_stored_rows",
    "fused_rms_mxfp4_quant", "fused_rms_mxfp4_quant_reference", "fused_rms_fp8_quant", "fused_rms_fp8_quant_reference", "RankTensors", "iter_rank_files", "load_rank", "OpenRank", "open_rank",
    "Manifest", "ManifestError", "TensorRecord", "load_manifest",
    "MlaShape", "absorbed_kv_b", "absorbed_kv_b_of_rank",
    "LayoutConstraintError", "preshuffle_scale", "preshuffle_scale_per_expert", "preshuffle_weight",
    "shuffled_scale_shape", "unshuffle_scale", "unshuffle_scale_per_expert", "unshuffle_weight",
    "preshuffle_weight_16bit", "unshuffle_weight_16bit",
]
