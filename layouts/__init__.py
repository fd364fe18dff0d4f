"""prep's runtime library: MXFP4 numerics, the byte layouts AMD's kernels read, and the rules
for picking them. Imports torch only; engines import this at start-up.

The layouts and their byte formulas: ``docs/layouts.md``. What each engine's switches mean, which
layout each of its paths reads and what it refuses: its profile in ``layouts/engines/``
(``docs/engines.md``). aiter and ATOM are the ground truth.
"""

# The names an engine needs, and nothing else: open a converted rank and check it against the
# engine's configuration, load it, and plan (and run) its fused activation quant; the layouts and
# engine profiles those steps name. The toolkit behind them is in public submodules, each with its
# own ``__all__``: ``layouts.mxfp4`` (MXFP4 numerics and quant recipes), ``layouts.shuffle`` (the
# byte shuffles and their inverses), ``layouts.registry`` (the layouts), ``layouts.transforms``
# (their weight and scale transforms), ``layouts.dequant`` (stored bytes back to values),
# ``layouts.manifest`` (the schema), ``layouts.families`` (model families), ``layouts.engines``
# (profiles and their shared checks), ``layouts.fused_quant`` / ``layouts.fused_fp8_quant`` (the
# kernels' back ends and references).
from . import activation, dequant, engines, families, manifest, mla, mxfp4, registry, shuffle, transforms
from .activation import ActivationQuantPlan
from .engines import (CompatibilityError, EngineConfig, EngineProfile, check_compatibility, engine_names, get_engine,
                      register_engine)
from .errors import LayoutsError
from .fused_fp8_quant import fused_rms_fp8_quant
from .fused_quant import fused_rms_mxfp4_quant
from .loader import OpenRank, RankTensors, iter_rank_files, load_rank, open_rank
from .manifest import Manifest, ManifestError, TensorRecord, load_manifest
from .mla import MlaShape, absorbed_kv_b, absorbed_kv_b_of_rank
from .registry import Layout, get_layout, layout_names, register_layout
from .selection import ActivationQuantFlags, select_activation_quant

__version__ = "0.1.0"

__all__ = [
    # open a rank and check it against the engine
    "load_manifest", "Manifest", "ManifestError", "TensorRecord",
    "EngineConfig", "check_compatibility", "CompatibilityError", "LayoutsError",
    "get_engine", "engine_names", "EngineProfile", "register_engine",
    # load it
    "open_rank", "OpenRank", "load_rank", "RankTensors", "iter_rank_files",
    # plan and run its activation quant
    "ActivationQuantPlan", "ActivationQuantFlags", "select_activation_quant",
    "fused_rms_mxfp4_quant", "fused_rms_fp8_quant",
    # MLA's absorbed W_K / W_V from a rank's kv_b_proj
    "MlaShape", "absorbed_kv_b", "absorbed_kv_b_of_rank",
    # the layouts those name
    "Layout", "get_layout", "layout_names", "register_layout",
]
