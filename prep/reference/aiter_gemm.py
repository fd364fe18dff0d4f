"""aiter's own Triton MXFP4 GEMMs, found and loaded, and one call that runs the right one on a
converted weight as it is stored (``prep run --gemm aiter-triton``; the consumer-kernel tests).

Where the kernels come from: an installed ``aiter`` package where it imports (ROCm), else a
folder of the pinned amd-aiter wheel's files (``--aiter-dir``, env ``PREP_AITER_DIR``, default
the repository's ``.cache/aiter-oracle``, filled by ``python scripts/fetch_aiter_oracle.py``).
From a folder, ``aiter/ops/triton/gemm_afp4wfp4.py`` (the wrappers), its kernels file, its
``utils/`` and its JSON configs are imported by path inside a package of our own whose
``__path__`` is that ``aiter/ops/triton/`` folder (their relative imports work; aiter's package
``__init__``, which needs ROCm, never runs). aiter's arch detection asks the GPU driver, so it
is stubbed to gfx950 (MI350X, the arch with MXFP4): ``arch_info.get_arch`` -> "gfx950" (the
config files' ``MI350X-`` prefix follows), ``is_fp4_avail`` -> True, ``chip_info.get_gfx`` ->
"gfx950"; ahead-of-time binaries (``AOTMetadataContext``) are a no-op. The absolute ``aiter.*``
names the wrapper imports exist only while it loads (a lasting fake ``aiter`` would make
``import aiter`` succeed elsewhere). ``_get_config`` is wrapped to drop the AMD-only launch
keys (``waves_per_eu``, ``matrix_instr_nonkdim``, ``kpack``), which the interpreter and CUDA
refuse, and to hand out a copy: aiter's wrappers write into the config they get and its
``_get_config`` returns lru-cached dicts, so one call's edits would leak into the next.

Interpreted on the CPU, compiled on a GPU: ``triton.jit`` decides when a function is defined
whether it is interpreted (it reads ``TRITON_INTERPRET`` then), and triton's own library
(``tl.cdiv``, ...) is defined when triton is imported. So for the interpreter the variable is
set before triton is first imported, and kept (every triton kernel of this process is then
interpreted: on a CPU nothing else runs); a triton imported earlier without it is refused in one
line. aiter's kernels file is imported with the variable as asked; interpreted and compiled
copies are separate modules. The interpreter runs ``tl.dot_scaled`` from triton 3.8 on.

Which kernel reads which stored layout (as ATOM calls them):

* ``non-shuffle``: ``gemm_afp4wfp4``: raw weight ``[N, K/2]``, raw scale ``[N, K/32]``, raw
  activation scale ``[M, K/32]``. Its K loop takes 8 scale columns per step and loads the
  scales unmasked, so for K % 256 != 0 it reads ``pad8(K/32) - K/32`` bytes past the end of both
  scales (multiplied by data masked to zero: harmless unless a byte is 0xFF, E8M0's NaN); the
  scales are handed over as copies followed by finite bytes (docs/consumer-kernels.md).
* ``preshuffle``: ``gemm_afp4wfp4_preshuffled_weight_scales``: W16 weight viewed
  ``[N/16, 16*K/2]``, S32x8 scale viewed ``[pad256(N)/32, -1]``; the activation scale raw
  ``[M, K/32]`` below 32 tokens, S32x8-shuffled and padded to ``[pad256(M), pad8(K/32)]``
  (viewed ``[pad256(M)/32, -1]``) from 32 on: the triton-preshuffle path's activation flags.
  It needs K % 256 == 0 (no masked branch; K = 128 fails its block shape).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import pathlib
import sys
import types
from typing import Callable, Iterator

import torch

from layouts.engines.atom import PROFILE as ATOM, TRITON_NON_SHUFFLE, TRITON_PRESHUFFLE

from ..errors import PrepError

ENV_DIR = "PREP_AITER_DIR"
DEFAULT_DIR = pathlib.Path(__file__).resolve().parents[2] / ".cache" / "aiter-oracle"  # the repository's (prep/reference/)
FETCH = "python scripts/fetch_aiter_oracle.py"
GEMM_AFP4WFP4 = "gemm_afp4wfp4"
AMD_ONLY_LAUNCH_KEYS = ("waves_per_eu", "matrix_instr_nonkdim", "kpack")
STUB_ARCH = "gfx950"
CONFIGS = ("MI350X-GEMM-AFP4WFP4.json", "MI350X-GEMM-AFP4WFP4_PRESHUFFLED.json")
# aiter's Triton GEMMs are what ATOM's two Triton GEMM paths call: ATOM's profile states the
# dense layout each reads and the activation-quant flags of each (layout names have one home:
# the registry, and the profiles that say who reads which). The kernel for each layout, and the
# path of ``KERNEL_ENGINE``'s profile whose activation flags that kernel reads.
KERNEL_ENGINE = ATOM
_PATHS = (TRITON_NON_SHUFFLE, TRITON_PRESHUFFLE)
NON_SHUFFLE, PRESHUFFLE = (ATOM.dense_layout(p) for p in _PATHS)
KERNELS = {NON_SHUFFLE: "gemm_afp4wfp4", PRESHUFFLE: "gemm_afp4wfp4_preshuffled_weight_scales"}
ACTIVATION_PATH = dict(zip((NON_SHUFFLE, PRESHUFFLE), _PATHS))

# The dense MXFP4 modules of a DeepSeek layer (layer 0 of a converted checkpoint): what the
# consumer-kernel tests and scripts/bench.py gemm run aiter's GEMMs on.
DENSE_MODULES = {
    "fused_qkv_a_proj": "model.layers.0.self_attn.fused_qkv_a_proj",
    "q_b_proj": "model.layers.0.self_attn.q_b_proj",
    "kv_b_proj": "model.layers.0.self_attn.kv_b_proj",
    "o_proj": "model.layers.0.self_attn.o_proj",
    "gate_up_proj": "model.layers.0.mlp.gate_up_proj",
    "down_proj": "model.layers.0.mlp.down_proj",
}


def aiter_dir(given: str | os.PathLike | None = None) -> pathlib.Path:
    """The folder of the amd-aiter wheel's files: ``given``, else ``$PREP_AITER_DIR``, else the default."""
    return pathlib.Path(given or os.environ.get(ENV_DIR) or DEFAULT_DIR)


def missing_files(root: pathlib.Path) -> list[str]:
    """The files of aiter's MXFP4 GEMM that ``root`` lacks (relative paths; empty when all are there)."""
    base = pathlib.Path("aiter") / "ops" / "triton"
    need = [base / "gemm_afp4wfp4.py", base / "_triton_kernels" / "gemm_afp4wfp4.py",
            base / "utils" / "core.py", base / "utils" / "logger.py"]
    need += [base / "configs" / "gemm" / c for c in CONFIGS]
    return [str(p) for p in need if not (root / p).is_file()]


def interpreter_has_dot_scaled() -> bool:
    """triton's interpreter runs ``tl.dot_scaled`` from 3.8 on (3.6 and 3.7 lack it)."""
    try:
        from triton.runtime.interpreter import InterpreterBuilder
    except ImportError:
        return False
    return hasattr(InterpreterBuilder, "create_dot_scaled")


@contextlib.contextmanager
def triton_interpret(on: bool) -> Iterator[None]:
    """TRITON_INTERPRET set to ``on`` for the block: triton.jit picks interpreter or compiler when a
    kernel is decorated, i.e. when its module is imported."""
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1" if on else "0"
    try:
        yield
    finally:
        if old is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = old


@contextlib.contextmanager
def temporary_modules(mods: dict[str, types.ModuleType]) -> Iterator[None]:
    """``mods`` in sys.modules for the block (stubs an import resolves against), then as before."""
    saved = {k: sys.modules.get(k) for k in mods}
    sys.modules.update(mods)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v


def _package(name: str, path: pathlib.Path) -> types.ModuleType:
    pkg = types.ModuleType(name)
    pkg.__path__ = [str(path)]
    pkg.__package__ = name
    sys.modules[name] = pkg
    return pkg


def _arch_info_stub(name: str) -> types.ModuleType:
    m = types.ModuleType(name)
    m.get_arch = lambda: STUB_ARCH
    m.get_device = lambda: "MI350X"
    m.is_fp4_avail = lambda: True
    m.is_fp8_avail = lambda: True
    return m


def strip_amd_launch_keys(config: dict) -> dict:
    """A copy of an aiter GEMM config without the AMD-only launch keys."""
    return {k: v for k, v in config.items() if k not in AMD_ONLY_LAUNCH_KEYS}


def _exec_file(modname: str, path: pathlib.Path) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(modname, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[modname] = mod
    try:
        spec.loader.exec_module(mod)
    except BaseException:
        del sys.modules[modname]
        raise
    return mod


def _triton_for(interpret: bool) -> None:
    """Import triton so that it can interpret (or compile) aiter's kernels (module docstring)."""
    if interpret and "triton" not in sys.modules:
        os.environ["TRITON_INTERPRET"] = "1"
    try:
        import triton.language as tl
    except ImportError:
        raise PrepError("aiter's MXFP4 GEMMs need triton (>= 3.8 on the CPU): pip install 'triton>=3.8'") from None
    if interpret and type(tl.cdiv).__name__ != "InterpretedFunction":
        raise PrepError("triton was imported before TRITON_INTERPRET=1 was set, so its interpreter cannot run "
                        "aiter's kernels on the CPU; set TRITON_INTERPRET=1 in the environment")


def load_from_folder(root: str | os.PathLike | None = None, interpret: bool = True) -> types.ModuleType:
    """aiter/ops/triton/gemm_afp4wfp4.py from a folder of the wheel's files (module docstring),
    with its kernels interpreted (``interpret=True``) or compiled; loaded once per folder and mode."""
    root = aiter_dir(root).resolve()
    _triton_for(interpret)
    if not interpreter_has_dot_scaled() and interpret:
        raise PrepError("aiter's MXFP4 GEMMs need triton >= 3.8 on the CPU (its interpreter runs tl.dot_scaled "
                        "from 3.8 on); pip install 'triton>=3.8' or run on a GPU")
    gone = missing_files(root)
    if gone:
        raise PrepError(f"{root}: aiter's MXFP4 GEMM files are missing ({gone[0]}); fetch them with `{FETCH}` "
                        f"(or point --aiter-dir / ${ENV_DIR} at a folder of the amd-aiter wheel's files)")
    tag = f"{'interp' if interpret else 'jit'}_{abs(hash(str(root))):x}"
    pkg = f"_prep_aiter_triton_{tag}"
    modname = f"{pkg}.{GEMM_AFP4WFP4}"
    if modname in sys.modules:
        return sys.modules[modname]
    base = root / "aiter" / "ops" / "triton"
    if pkg not in sys.modules:
        _package(pkg, base)
        _package(f"{pkg}._triton_kernels", base / "_triton_kernels")
        _package(f"{pkg}.utils", base / "utils")
        _package(f"{pkg}.utils._triton", base / "utils" / "_triton")
        sys.modules[f"{pkg}.utils._triton.arch_info"] = _arch_info_stub(f"{pkg}.utils._triton.arch_info")
    with triton_interpret(interpret):
        kernels = importlib.import_module(f"{pkg}._triton_kernels.{GEMM_AFP4WFP4}")
        logger = importlib.import_module(f"{pkg}.utils.logger")
        names = ["aiter", "aiter.ops", "aiter.ops.triton", "aiter.ops.triton._triton_kernels",
                 "aiter.ops.triton.utils", "aiter.ops.triton.utils._triton", "aiter.utility",
                 "aiter.utility.triton", "aiter.jit", "aiter.jit.utils"]
        stubs = {n: types.ModuleType(n) for n in names}
        for stub in stubs.values():
            stub.__path__ = []
        stubs[f"aiter.ops.triton._triton_kernels.{GEMM_AFP4WFP4}"] = kernels
        stubs["aiter.ops.triton.utils.logger"] = logger
        stubs["aiter.ops.triton.utils._triton.arch_info"] = sys.modules[f"{pkg}.utils._triton.arch_info"]
        redirect = types.ModuleType("aiter.utility.triton.triton_metadata_redirect")
        redirect.AOTMetadataContext = lambda *_a, **_k: contextlib.nullcontext()  # AOT binaries: MI350X only
        stubs[redirect.__name__] = redirect
        chip_info = types.ModuleType("aiter.jit.utils.chip_info")
        chip_info.get_gfx = lambda: STUB_ARCH
        stubs[chip_info.__name__] = chip_info
        with temporary_modules(stubs):
            mod = _exec_file(modname, base / f"{GEMM_AFP4WFP4}.py")
    aiter_get_config = kernels._get_config
    mod.aiter_get_config = aiter_get_config
    mod._get_config = lambda M, N, K, shuffle=False: strip_amd_launch_keys(aiter_get_config(M, N, K, shuffle))
    return mod


def installed() -> types.ModuleType | None:
    """aiter's own ``aiter.ops.triton.gemm_afp4wfp4`` where aiter is installed and imports (ROCm)."""
    if getattr(torch.version, "hip", None) is None or importlib.util.find_spec("aiter") is None:
        return None
    try:
        return importlib.import_module("aiter.ops.triton.gemm_afp4wfp4")
    except Exception:  # noqa: BLE001 - an aiter that does not import here: fall back to the files
        return None


def gemm_module(root: str | os.PathLike | None = None, device: str | torch.device = "cpu") -> types.ModuleType:
    """aiter's MXFP4 GEMM wrappers for ``device``: the installed package on a ROCm GPU, else the
    folder's files, interpreted on the CPU and compiled on a GPU."""
    on_cpu = torch.device(device).type == "cpu"
    if not on_cpu and root is None and os.environ.get(ENV_DIR) is None:
        mod = installed()
        if mod is not None:
            return mod
    return load_from_folder(root, interpret=on_cpu)


def scale_over_read(k: int) -> int:
    """Bytes past the end of each scale row that ``gemm_afp4wfp4`` reads for this K (module docstring)."""
    return _pad8(k // 32) - k // 32


def with_slack(t: torch.Tensor, nbytes: int) -> torch.Tensor:
    """A copy of ``t`` followed in memory by ``nbytes`` bytes of 0x7F (E8M0 1.0: finite)."""
    flat = torch.full((t.numel() + nbytes,), 0x7F, dtype=torch.uint8, device=t.device)
    flat[: t.numel()] = t.reshape(-1)
    return flat[: t.numel()].view(t.shape)


def with_defined_overread(gemm: Callable) -> Callable:
    """``gemm`` (``gemm_afp4wfp4``, or any call taking its ``x, w, x_scales, w_scales`` first) handed
    copies of both scales followed by defined bytes where the kernel reads past K (module
    docstring): on the CPU the bytes past a tensor belong to another allocation, so without them
    two runs may differ."""
    def call(x, w, x_scales, w_scales, *args, **kwargs):
        slack = scale_over_read(x.shape[-1] * 2)
        if slack:
            x_scales, w_scales = with_slack(x_scales, slack), with_slack(w_scales, slack)
        return gemm(x, w, x_scales, w_scales, *args, **kwargs)
    return call


def _pad256(n: int) -> int:
    return -(-n // 256) * 256


def _pad8(n: int) -> int:
    return -(-n // 8) * 8


def shape_problem(layout: str, n: int, k: int, name: str = "weight") -> str | None:
    """Why aiter's kernel for ``layout`` cannot run a weight of logical shape ``[n, k]`` (None if it can)."""
    if layout not in KERNELS:
        return (f"{name}: layout {layout!r} has no aiter Triton GEMM here (they read {', '.join(KERNELS)}); "
                "run with --gemm torch")
    if layout == PRESHUFFLE and k % 256:
        return (f"{name}: K = {k} (per rank) is not a multiple of 256, which aiter's {KERNELS[layout]} needs "
                "(K = 128 fails its block shape: 'Shape element 1 must be a power of 2'; other K have no masked "
                "loop); convert with --layout non-shuffle or a smaller --tp, or run --gemm torch")
    if layout == PRESHUFFLE and n % 16:
        return f"{name}: N = {n} is not a multiple of 16, which the W16 layout needs; convert again"
    return None


def mxfp4_gemm(kernels: types.ModuleType, q: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor,
               weight_scale: torch.Tensor, layout: str, n: int, k: int, name: str = "weight") -> torch.Tensor:
    """float32 ``[M, N]`` = MXFP4 activation ``(q [M, K/2], x_scale)`` times the stored weight
    ``(weight, weight_scale)`` of logical shape ``[n, k]`` in ``layout``, on aiter's kernel for that
    layout. ``x_scale`` is in the layout the kernel's GEMM path gives (``ACTIVATION_PATH``): raw
    ``[M, K/32]``, or for ``preshuffle`` from 32 tokens on S32x8 ``[pad256(M), pad8(K/32)]``.
    ``name`` (the stored tensor) is what an error names."""
    problem = shape_problem(layout, n, k, name)
    if problem:
        raise PrepError(problem)
    q, x_scale = q.view(torch.uint8), x_scale.view(torch.uint8)
    weight, weight_scale = weight.view(torch.uint8), weight_scale.view(torch.uint8)
    m = q.shape[0]
    if q.dim() != 2 or q.shape[1] * 2 != k:
        raise PrepError(f"{name}: activation is {list(q.shape)} packed, the weight takes K = {k}")
    kernel = KERNELS[layout]
    if layout == NON_SHUFFLE:
        if tuple(x_scale.shape) != (m, k // 32):
            raise PrepError(f"{name}: {kernel} reads a raw activation scale [{m}, {k // 32}], got "
                            f"{list(x_scale.shape)}")
        w = weight.reshape(-1)[: n * k // 2].view(n, k // 2)
        ws = weight_scale.reshape(-1)[: n * k // 32].view(n, k // 32)
        gemm = with_defined_overread(kernels.gemm_afp4wfp4)
        call = lambda: gemm(q, w, x_scale, ws, dtype=torch.float32)  # noqa: E731
    else:
        if weight.numel() < n * k // 2 or weight_scale.numel() < _pad256(n) * _pad8(k // 32):
            raise PrepError(f"{name}: {list(weight.shape)} / {list(weight_scale.shape)} bytes are not a W16 weight "
                            f"and S32x8 scale of [{n}, {k}]; the checkpoint is not in the preshuffle layout")
        w = weight.reshape(-1)[: n * k // 2].view(n // 16, 16 * k // 2)
        ws = weight_scale.reshape(-1)[: _pad256(n) * _pad8(k // 32)].view(_pad256(n) // 32, -1)
        if m >= 32:
            want = (_pad256(m), _pad8(k // 32))
            if tuple(x_scale.shape) != want:
                raise PrepError(f"{name}: {kernel} reads, from 32 tokens on, an S32x8 activation scale "
                                f"{list(want)}, got {list(x_scale.shape)}")
            xs = x_scale.view(want[0] // 32, -1)
        else:
            if x_scale.shape[0] < m or x_scale.dim() != 2 or x_scale.shape[1] < k // 32:
                raise PrepError(f"{name}: {kernel} reads, below 32 tokens, a raw activation scale [{m}, {k // 32}], "
                                f"got {list(x_scale.shape)}")
            xs = x_scale
        call = lambda: kernels.gemm_afp4wfp4_preshuffled_weight_scales(  # noqa: E731
            q, w, xs, ws, dtype=torch.float32, use_aot=False)
    try:
        return call()
    except PrepError:
        raise
    except Exception as e:  # noqa: BLE001 - the kernel's own refusal, in one line naming the tensor
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise PrepError(f"{name}: aiter's {kernel} failed on M = {m}, N = {n}, K = {k} ({type(e).__name__}: "
                        f"{first}); run with --gemm torch") from e
