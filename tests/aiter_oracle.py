"""Load aiter's own layout functions by path, as an oracle, without aiter's package init.

The files come from the pinned amd-aiter wheel (scripts/fetch_aiter_oracle.py unpacks them into
.cache/aiter-oracle; PREP_AITER_ORACLE_DIR overrides the location). `fp4_utils.py` imports
`from . import dtypes` (which pulls in aiter's chip detection) and `triton`; we give it a
package of its own with a minimal `dtypes` module and, where triton is not installed, a stand-in
that only satisfies its decorators (its Triton kernels are never called here).
"""

from __future__ import annotations

import contextlib
import importlib
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


# --- aiter's Python wrappers for its Triton kernels (fused RMSNorm + MXFP4 quant, dynamic quant) ---
#
# The wrappers (aiter/ops/triton/<name>.py) import their kernels as
# `aiter.ops.triton._triton_kernels.<name>` and a logger from `aiter.ops.triton.utils.logger`.
# We load the kernel files as a package of our own (so their `from .quant import ...` works),
# then exec the wrapper with those aiter module names pointing at our copies *only while it
# loads*: a lasting fake `aiter` in sys.modules would make `import aiter` succeed elsewhere.

_TRITON_DIR = ("ops", "triton")


def triton_ops_available(name: str) -> bool:
    """Whether aiter/ops/triton/<name>.py and its kernels file are here (and triton imports)."""
    base = ORACLE_DIR / "aiter" / "ops" / "triton"
    return triton_available() and (base / f"{name}.py").is_file() and (base / "_triton_kernels" / f"{name}.py").is_file()


# TRITON_INTERPRET per import, and stub modules for one import: one home, prep.reference.aiter_gemm.
from prep.reference.aiter_gemm import temporary_modules as _temporary_modules  # noqa: E402
from prep.reference.aiter_gemm import triton_interpret as _triton_interpret  # noqa: E402


def triton_ops_module(name: str, interpret: bool = True) -> types.ModuleType:
    """aiter/ops/triton/<name>.py (aiter's own wrapper) with its Triton kernels, interpreted on the
    CPU (``interpret=True``) or compiled for the GPU. Loaded without aiter's package init."""
    tag = "interp" if interpret else "jit"
    modname = f"{_PKG}_ops_{name}_{tag}"
    if modname in sys.modules:
        return sys.modules[modname]
    kpkg = f"{_PKG}_kernels_{tag}"
    if kpkg not in sys.modules:
        pkg = types.ModuleType(kpkg)
        pkg.__path__ = [str(ORACLE_DIR / "aiter" / "ops" / "triton" / "_triton_kernels")]
        sys.modules[kpkg] = pkg
    with _triton_interpret(interpret):
        kernels = importlib.import_module(f"{kpkg}.{name}")
        logger = _load("ops/triton/utils/logger.py", f"{_PKG}_triton_logger")
        names = ["aiter", "aiter.ops", "aiter.ops.triton", "aiter.ops.triton._triton_kernels",
                 "aiter.ops.triton.utils"]
        stubs = {n: types.ModuleType(n) for n in names}
        for stub in stubs.values():
            stub.__path__ = []
        stubs[f"aiter.ops.triton._triton_kernels.{name}"] = kernels
        stubs["aiter.ops.triton.utils.logger"] = logger
        with _temporary_modules(stubs):
            return _load(f"ops/triton/{name}.py", modname)


# --- aiter's Triton MXFP4 GEMMs (gemm_afp4wfp4 and its two preshuffled variants) ---
#
# Loaded by prep/reference/aiter_gemm.py (`prep run --gemm aiter-triton` loads them the same way): from this
# oracle folder, arch detection stubbed to gfx950, AMD-only launch keys dropped from the configs
# (that module's docstring says why each).


def triton_gemm_available() -> bool:
    """Whether aiter's gemm_afp4wfp4 wrapper, kernels and JSON configs are here (and triton imports)."""
    from prep.reference import aiter_gemm

    return triton_available() and not aiter_gemm.missing_files(ORACLE_DIR)


def interpreter_has_dot_scaled() -> bool:
    """triton's interpreter runs `tl.dot_scaled` from 3.8 on (3.6 and 3.7 lack it)."""
    from prep.reference import aiter_gemm

    return aiter_gemm.interpreter_has_dot_scaled()


def triton_gemm_module(interpret: bool = True) -> types.ModuleType:
    """aiter/ops/triton/gemm_afp4wfp4.py (`gemm_afp4wfp4`, `gemm_afp4wfp4_preshuffled_scales`,
    `gemm_afp4wfp4_preshuffled_weight_scales`) from the oracle folder, interpreted on the CPU
    (``interpret=True``) or compiled for the GPU (prep/reference/aiter_gemm.py)."""
    from prep.reference import aiter_gemm

    return aiter_gemm.load_from_folder(ORACLE_DIR, interpret=interpret)


# --- aiter's Triton FP8 quant at the commit ATOM is pinned with (e4048607) ---
#
# The amd-aiter wheel's fused_fp8_quant is older than what ATOM at ffdf3bb5 calls: this one comes
# from the pinned aiter source tree (scripts/engine_sources.py), its kernels file loaded as a
# package of its own (its `activation` kernels import `.quant.fused_fp8_quant` relatively), the
# wrapper with stubs for aiter's package init (`aiter.dtypes.fp8`: e4m3fn, the gfx950 type; every
# call here passes dtype_quant) and arch probe (`utils.types`).


def pinned_fused_fp8_quant(aiter_tree: pathlib.Path, interpret: bool = True) -> types.ModuleType:
    """``aiter/ops/triton/quant/fused_fp8_quant.py`` of ``aiter_tree`` (aiter's own wrapper with
    its Triton kernels), interpreted on the CPU (``interpret``) or compiled for the GPU."""
    tag = "interp" if interpret else "jit"
    modname = f"{_PKG}_pinned_fused_fp8_quant_{tag}"
    if modname in sys.modules:
        return sys.modules[modname]
    triton_dir = aiter_tree / "aiter" / "ops" / "triton"
    kpkg = f"{_PKG}_pinned_kernels_{tag}"
    if kpkg not in sys.modules:
        pkg = types.ModuleType(kpkg)
        pkg.__path__ = [str(triton_dir / "_triton_kernels")]
        sys.modules[kpkg] = pkg
    with _triton_interpret(interpret):
        kernels = importlib.import_module(f"{kpkg}.quant.fused_fp8_quant")
        activation = importlib.import_module(f"{kpkg}.activation")
        aiter = types.ModuleType("aiter")
        aiter.__path__ = []
        aiter.dtypes = types.SimpleNamespace(fp8=torch.float8_e4m3fn)
        utypes = types.ModuleType("aiter.ops.triton.utils.types")
        utypes.get_fp8_e4m3_dtype = lambda: torch.float8_e4m3fn
        spec = importlib.util.spec_from_file_location(f"{_PKG}_pinned_logger", triton_dir / "utils" / "logger.py")
        logger = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(logger)
        stubs = {n: types.ModuleType(n) for n in ("aiter.ops", "aiter.ops.triton", "aiter.ops.triton._triton_kernels",
                                                  "aiter.ops.triton._triton_kernels.quant", "aiter.ops.triton.utils")}
        for stub in stubs.values():
            stub.__path__ = []
        stubs.update({"aiter": aiter, "aiter.ops.triton.utils.types": utypes, "aiter.ops.triton.utils.logger": logger,
                      "aiter.ops.triton._triton_kernels.activation": activation,
                      "aiter.ops.triton._triton_kernels.quant.fused_fp8_quant": kernels})
        with _temporary_modules(stubs):
            spec = importlib.util.spec_from_file_location(modname, triton_dir / "quant" / "fused_fp8_quant.py")
            mod = importlib.util.module_from_spec(spec)
            sys.modules[modname] = mod
            spec.loader.exec_module(mod)
    return mod


@contextlib.contextmanager
def interpreter_fp8_conversion_as_on_gpu():
    """Within the block, the Triton interpreter converts float32 to FP8 E4M3 (fn and fnuz) as the
    GPUs' conversion instructions do: nearest, ties to even (torch's conversion). The interpreter's
    own (triton 3.8, ``interpreter._convert_float``) rounds ties up and drops the carry of a rounded
    up mantissa into the exponent (1.97 becomes 1.0): a stand-in for the hardware's conversion, so
    that aiter's FP8 kernels can be compared byte for byte on the CPU."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    own = interpreter._convert_float
    to_torch = {tl.float8e4nv: torch.float8_e4m3fn, tl.float8e4b8: torch.float8_e4m3fnuz}

    def convert(value, input_dtype, output_dtype, rounding_mode):
        if input_dtype == tl.float32 and output_dtype in to_torch:
            t = torch.from_numpy(np.ascontiguousarray(value).view(np.float32))
            return t.to(to_torch[output_dtype]).view(torch.uint8).numpy().reshape(value.shape)
        return own(value, input_dtype, output_dtype, rounding_mode)

    interpreter._convert_float = convert
    try:
        yield
    finally:
        interpreter._convert_float = own
