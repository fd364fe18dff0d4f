"""Load aiter's own layout functions by path, as an oracle, without aiter's package init.

The files come from the pinned amd-aiter wheel (scripts/fetch_aiter_oracle.py unpacks them into
.cache/aiter-oracle; PREP_AITER_ORACLE_DIR overrides the location). `fp4_utils.py` imports
`from . import dtypes` (which pulls in aiter's chip detection) and `triton`; we give it a
package of its own with a minimal `dtypes` module and, where triton is not installed, a stand-in
that only satisfies its decorators (its Triton kernels are never called here).
"""

from __future__ import annotations

import importlib.util
import os
import pathlib
import sys
import types

import torch

REPO = pathlib.Path(__file__).resolve().parent.parent
ORACLE_DIR = pathlib.Path(os.environ.get("PREP_AITER_ORACLE_DIR", REPO / ".cache" / "aiter-oracle"))
_PKG = "_aiter_oracle"


def available() -> bool:
    return (ORACLE_DIR / "aiter" / "ops" / "shuffle.py").is_file()


def _ensure_triton_importable() -> None:
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except ImportError:
        stub = types.ModuleType("triton")
        stub.jit = lambda fn=None, **_: fn if fn is not None else (lambda f: f)
        stub.heuristics = lambda *_a, **_k: (lambda f: f)
        lang = types.ModuleType("triton.language")
        lang.constexpr = object
        stub.language = lang
        sys.modules.setdefault("triton", stub)
        sys.modules.setdefault("triton.language", lang)


def _load(relpath: str, modname: str) -> types.ModuleType:
    if modname in sys.modules:
        return sys.modules[modname]
    spec = importlib.util.spec_from_file_location(modname, ORACLE_DIR / "aiter" / relpath)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[modname] = mod
    spec.loader.exec_module(mod)
    return mod


def shuffle_module() -> types.ModuleType:
    """aiter/ops/shuffle.py (`shuffle_weight`)."""
    return _load("ops/shuffle.py", f"{_PKG}.shuffle")


def fp4_utils_module() -> types.ModuleType:
    """aiter/utility/fp4_utils.py (`e8m0_shuffle`, `mxfp4_to_f32`, `e8m0_to_f32`)."""
    if _PKG not in sys.modules:
        pkg = types.ModuleType(_PKG)
        pkg.__path__ = [str(ORACLE_DIR / "aiter" / "utility")]
        sys.modules[_PKG] = pkg
        dtypes = types.ModuleType(f"{_PKG}.dtypes")
        dtypes.fp4x2 = getattr(torch, "float4_e2m1fn_x2", torch.uint8)
        dtypes.fp8_e8m0 = getattr(torch, "float8_e8m0fnu", torch.uint8)
        dtypes.fp32, dtypes.bf16, dtypes.fp16 = torch.float32, torch.bfloat16, torch.float16
        dtypes.i32, dtypes.u32 = torch.int32, torch.uint32
        sys.modules[dtypes.__name__] = dtypes
        pkg.dtypes = dtypes
    _ensure_triton_importable()
    return _load("utility/fp4_utils.py", f"{_PKG}.fp4_utils")


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return available()


def triton_quant_module() -> types.ModuleType:
    """aiter/ops/triton/_triton_kernels/quant.py, jitted for the Triton interpreter (CPU)."""
    # triton.jit decides at decoration time whether to interpret, so set this before loading.
    os.environ["TRITON_INTERPRET"] = "1"
    return _load("ops/triton/_triton_kernels/quant.py", f"{_PKG}_triton_quant")


def dynamic_mxfp4_quant(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """aiter's Triton MXFP4 quant kernel (`_mxfp4_quant_op`, "even" mode) run on the CPU.

    Same launch as aiter's `dynamic_mxfp4_quant` wrapper with its small-N configuration
    (one 32-column quant block per program), which covers every column of any even N.
    """
    kernels = triton_quant_module()
    m, n = x.shape
    out = torch.empty((m, n // 2), dtype=torch.uint8)
    nblocks = -(-n // 32)
    scale = torch.empty((nblocks, m), dtype=torch.uint8).T
    block_m = 8
    grid = (-(-m // block_m), nblocks)
    kernels._dynamic_mxfp4_quant_kernel[grid](
        x, out, scale, *x.stride(), *out.stride(), *scale.stride(),
        M=m, N=n, MXFP4_QUANT_BLOCK_SIZE=32, SCALING_MODE=0, NUM_ITER=1,
        BLOCK_SIZE_M=block_m, BLOCK_SIZE_N=32, NUM_STAGES=1,
    )
    return out, scale.contiguous()
