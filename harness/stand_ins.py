"""Stand-ins for what an engine imports but cannot use on a CPU without ROCm (aiter's compiled
modules, GPU-only packages): the one home of the objects :mod:`harness.atom.on_cpu`,
:mod:`harness.sglang` and :mod:`harness.vllm` hand out in their place, and of the harnesses'
other shared helper (:func:`called_from`).

A stand-in module answers every attribute with a :class:`StandIn`: callable (each call is
recorded in :data:`CALLS`, so a check can show that loading a model ran none: that would be
silently skipped work; used as a bare decorator it returns the function), subscriptable,
iterable (empty), usable as a base class, and false.
"""

from __future__ import annotations

import enum
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import pathlib
import sys
import types
from typing import Callable

CALLS: list[str] = []  # every call of a stand-in, by name, in order
COMPUTING = " (torch stand-in)"  # the name's tail of a call of a stand-in that computes (not skipped work)


def skipped(calls: list[str]) -> list[str]:
    """The calls among ``calls`` of stand-ins that compute nothing (work a load would have skipped)."""
    return sorted({c for c in calls if not c.endswith(COMPUTING)})


def computing(calls: list[str]) -> list[str]:
    """The calls among ``calls`` of the computing stand-ins (torch math for a GPU kernel)."""
    return sorted({c for c in calls if c.endswith(COMPUTING)})


def computed_note(calls: list[str]) -> str | None:
    """The line a check prints for the computing stand-ins among ``calls`` (the same on both
    sides it compares: said, not hidden), None where none ran."""
    used = computing(calls)
    return f"torch stand-ins computed for GPU kernels: {', '.join(c.removesuffix(COMPUTING) for c in used)}" \
        if used else None

# aiter's modules every harness loads from aiter's own files (the shuffles and the dtypes they
# use); every other aiter module is a stand-in unless a harness names more.
REAL_AITER = ("aiter.ops.shuffle", "aiter.utility.dtypes", "aiter.utility.fp4_utils", "aiter.utility.mx_types",
              "aiter.utility.aiter_types",
              # the Triton MoE's scale shuffle (ATOM's _swizzle_mxfp4 at load): plain torch
              "aiter.ops.triton.utils.shuffle")


class _StandInBase:
    """What a class deriving from a stand-in derives from (msgspec.Struct takes class keywords)."""

    def __init_subclass__(cls, **kw):
        pass

    def __init__(self, *a, **k):
        pass


class StandIn:
    """Any attribute of a stand-in module (module docstring)."""

    def __init__(self, name: str):
        self._name = name

    def __call__(self, *args, **kwargs):
        if len(args) == 1 and not kwargs and callable(args[0]) and not isinstance(args[0], StandIn):
            return args[0]  # a decorator: keep the function
        CALLS.append(self._name)
        return StandIn(self._name + "()")

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return StandIn(f"{self._name}.{name}")

    def __mro_entries__(self, bases):
        return (_StandInBase,)

    def __getitem__(self, key):
        return StandIn(self._name + "[]")

    def __iter__(self):
        return iter(())

    def __bool__(self):
        return False

    def __or__(self, other):  # type annotations written with a stand-in: `X | None`
        return self

    __ror__ = __or__

    def __repr__(self):
        return f"<stand-in {self._name}>"


class StandInModule(types.ModuleType):
    """A module whose every attribute is a :class:`StandIn`."""

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return StandIn(f"{self.__name__}.{name}")


def file_spec(name: str, root: pathlib.Path) -> importlib.machinery.ModuleSpec:
    """The spec of module ``name`` loaded from its file under the source tree ``root``."""
    return importlib.util.spec_from_file_location(name, root / (name.replace(".", "/") + ".py"))


class StandInFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """The import hook each engine's harness puts first on ``sys.meta_path``: a package of
    ``packages`` that is not importable here (or is one of ``always``) is made of stand-in modules
    (:meth:`module_for`, filled by :meth:`exec_module`), except the modules :meth:`source` loads
    from their files (aiter's pure-Python ones). aiter's dtype ids, which it parses from a C header
    a Python-only tree lacks, are a module of ours where :meth:`aiter_root` has no header.
    ``hidden`` packages stay absent for code under ``hidden_from`` (transformers asks find_spec,
    then parses the stand-in's missing version). A harness says only what differs."""

    def __init__(self, packages, always=("aiter",), hidden=(), hidden_from: str = "transformers"):
        self.absent = {p for p in packages if p in always or importlib.util.find_spec(p) is None}
        self.hidden, self.hidden_from = set(hidden), hidden_from

    def aiter_root(self) -> pathlib.Path:
        """The aiter source tree the harness reads aiter's Python files from."""
        raise NotImplementedError

    def source(self, name: str) -> importlib.machinery.ModuleSpec | None:
        """The spec of a stand-in package's module that is real code (None: a stand-in)."""
        return None

    def find_spec(self, name, path, target=None):
        top = name.partition(".")[0]
        if top not in self.absent:
            return None
        if top in self.hidden and called_from(self.hidden_from):
            return None
        if name == "aiter.utility.aiter_types" and not (self.aiter_root() / "csrc/include/aiter_enum.h").is_file():
            return importlib.machinery.ModuleSpec(name, self)
        return self.source(name) or importlib.machinery.ModuleSpec(name, self, is_package=True)

    def module_for(self, name: str) -> type:
        """The type of the stand-in module ``name``."""
        return StandInModule

    def create_module(self, spec):
        m = self.module_for(spec.name)(spec.name)
        m.__path__ = []
        return m

    def exec_module(self, m):
        pass


def fill_aiter_enums(m: types.ModuleType) -> None:
    """aiter's compiled enums (``csrc/include/aiter_enum.h``), as Python enums with aiter's names
    and values, into module ``m`` (``aiter.ops.enum``). ``module=``: pickled by reference to
    that module (an ATOM worker unpickles a Config holding them)."""
    quant = "No per_Tensor per_Token per_1x32 per_1x128 per_128x128 per_256x128 per_1024x128".split()
    m.QuantType = enum.IntEnum("QuantType", [(n, i) for i, n in enumerate(quant)], module=m.__name__)
    m.ActivationType = enum.IntEnum("ActivationType", {"No": -1, "Silu": 0, "Gelu": 1, "Swiglu": 2, "Situv2": 3},
                                    module=m.__name__)
    m.MlaVersion = enum.IntEnum("MlaVersion", {"V32": 0}, module=m.__name__)


def fill_aiter_stub(m: types.ModuleType, gpu_arch: Callable[[], str]) -> None:
    """What the stand-in of aiter's modules must really hold (the rest answers with stand-ins):
    aiter's top level its enums and dtypes; ``aiter.ops.enum`` the enums (:func:`fill_aiter_enums`);
    ``aiter.utility.aiter_types`` dtype ids (aiter parses them from a C header a Python-only tree
    lacks; nothing on the CPU passes them anywhere); ``chip_info`` the GPU arch ``gpu_arch()``
    answers, with an MI355X's 256 compute units."""
    if m.__name__ == "aiter":
        # import_module, not "from aiter.ops import enum": a stand-in package answers every name
        aiter_enum, dtypes = (importlib.import_module(n) for n in ("aiter.ops.enum", "aiter.utility.dtypes"))
        m.dtypes, m.QuantType, m.ActivationType = dtypes, aiter_enum.QuantType, aiter_enum.ActivationType
        # Computing stand-ins for the two GPU kernels ATOM's start-up runs on an FP8 per-channel
        # linear: MLA derives W_K / W_V from kv_b_proj by running the layer on an identity matrix
        # (atom/model_ops/utils.py get_and_maybe_dequant_weights). Torch math, the same on both
        # sides a check compares, so the derived bytes can be compared.
        m.get_hip_quant = lambda qtype: _hip_quant(qtype, aiter_enum.QuantType)
        m.gemm_a8w8_bpreshuffle = gemm_a8w8_bpreshuffle
        # and the two an FP8 block-scaled (128x128) kv_b_proj runs there, preshuffled or not
        m.gemm_a8w8_blockscale_bpreshuffle = _gemm_a8w8_blockscale
        m.gemm_a8w8_blockscale = _gemm_a8w8_blockscale
    elif m.__name__ == "aiter.ops.enum":
        fill_aiter_enums(m)
    elif m.__name__ == "aiter.utility.aiter_types":
        names = "fp8 fp8_e8m0 fp16 bf16 fp32 i4x2 fp4x2 u32 i32 i16 i8".split()
        m.aiter_dtypes = {n: i for i, n in enumerate(names)}
        m.aiter_tensor_t = type("aiter_tensor_t", (), {})
    elif m.__name__ == "aiter.jit.utils.chip_info":
        m.get_gfx = m.get_gfx_runtime = gpu_arch
        m.get_cu_num = lambda: 256
    elif m.__name__ == "aiter.ops.triton.utils._triton.arch_info":  # asks the Triton driver: the same answer
        m.get_arch = gpu_arch


def _hip_quant(qtype, quant_types):
    """aiter's ``get_hip_quant(qtype)`` for per-token quant (``per_token_quant_hip``: scale
    ``[M, 1]`` = row amax / the dtype's max, 1 where the row is zero) and per 1x128 group
    (:func:`_per_group_quant`); any other type is a recording stand-in, as before."""
    if qtype == quant_types.per_1x128:
        return _per_group_quant
    if qtype != quant_types.per_Token:
        return StandIn(f"aiter.get_hip_quant({qtype.name})")

    def per_token_quant(x, scale=None, quant_dtype=None, **_):
        if scale is not None:
            raise ValueError("unsupported: static per token quant")
        CALLS.append("aiter.per_token_quant_hip" + COMPUTING)
        return _per_token(x, quant_dtype)

    return per_token_quant


def _per_token(x, quant_dtype):
    """Per-token quant as aiter's HIP kernels do it: scale ``[M, 1]`` = row amax / the dtype's
    max (1 where the row is zero), codes x / scale clamped to the dtype's range."""
    import torch

    xf = x.float()
    s = xf.abs().amax(dim=-1, keepdim=True) / torch.finfo(quant_dtype).max
    s[s == 0] = 1
    return (xf / s).clamp(torch.finfo(quant_dtype).min, torch.finfo(quant_dtype).max).to(quant_dtype), s


def dynamic_per_token_scaled_quant(out, x, scale, scale_ub=None, shuffle_scale=False, num_rows=None, **_):
    """aiter's ``dynamic_per_token_scaled_quant`` (``aiter.ops.quant``, in place into ``out`` and
    ``scale``), which vLLM's per-token FP8 quant op calls: :func:`_per_token`."""
    if scale_ub is not None or shuffle_scale or num_rows is not None:
        raise ValueError("dynamic_per_token_scaled_quant stand-in: scale_ub, shuffle_scale and num_rows unsupported")
    CALLS.append("aiter.dynamic_per_token_scaled_quant" + COMPUTING)
    q, s = _per_token(x.reshape(-1, x.shape[-1]), out.dtype)
    out.copy_(q.reshape(out.shape))
    scale.copy_(s.reshape(scale.shape))


def gemm_a8w8_bpreshuffle(x, w, x_scale, w_scale, bias=None, dtype=None, check=False, *, shuffled=None, **_):
    """aiter's ``gemm_a8w8_bpreshuffle`` (y = (x * x_scale) @ (w * w_scale)^T + bias) in torch, the
    weight taken back from aiter's (16, 16) shuffle where ATOM marked it shuffled (``shuffled``:
    whether it is, where the caller's weights carry no mark): on one-byte elements the same byte
    order as the ``preshuffle`` layout's (``layouts.shuffle``)."""
    import torch

    from layouts.shuffle import unshuffle_weight

    CALLS.append("aiter.gemm_a8w8_bpreshuffle" + COMPUTING)
    n = w.shape[0]
    if getattr(w, "is_shuffled", False) if shuffled is None else shuffled:
        w = unshuffle_weight(w.view(torch.uint8)).view(w.dtype)
    y = (x.float() * x_scale.float()) @ (w.float() * w_scale.float().reshape(n, 1)).t()
    return (y if bias is None else y + bias.float()).to(dtype or torch.bfloat16)


def _per_group_quant(x, scale=None, quant_dtype=None, group_size=128, transpose_scale=False, **_):
    """aiter's ``per_group_quant_hip`` (``csrc/kernels/quant_kernels.cu``) per (row, 128-group):
    scale = max(amax, 1e-10) * (1 / the dtype's max) in F32, codes x * (1 / scale); the scale
    ``[M, K/128]`` in column-major memory (``transpose_scale``, what the preshuffled GEMM reads),
    still shaped ``[M, K/128]``, as aiter returns it."""
    import torch

    if scale is not None:
        raise ValueError("unsupported: static per group quant")
    CALLS.append("aiter.per_group_quant_hip" + COMPUTING)
    m, k = x.shape
    if k % group_size:  # DeepSeek's are 512 (kv_lora_rank) and up
        raise ValueError(f"per_group_quant_hip stand-in: K={k} is not a multiple of the group size {group_size}")
    g = x.float().reshape(m, k // group_size, group_size)
    inv_max = torch.tensor(1.0 / torch.finfo(quant_dtype).max, dtype=torch.float32)
    s = g.abs().amax(dim=-1).clamp_min(1e-10) * inv_max
    q = (g * (1.0 / s).unsqueeze(-1)).reshape(m, k).to(quant_dtype)
    return q, (s.t().contiguous().reshape(m, k // group_size) if transpose_scale else s)


def _gemm_a8w8_blockscale(x, w, x_scale, w_scale, dtype=None, out=None, **_):
    """aiter's ``gemm_a8w8_blockscale[_bpreshuffle]`` in torch: y[m, n] = sum over 128-groups g
    of (x * x_scale[m, g]) . (w * w_scale[n / 128, g]), F32 accumulation, BF16 out; the weight
    taken back from aiter's (16, 16) shuffle where ATOM marked it shuffled, and the activation
    scale read in the column-major memory the preshuffled GEMM takes (:func:`_per_group_quant`)."""
    import torch

    from layouts.dequant import fp8_block_scales
    from layouts.shuffle import unshuffle_weight

    CALLS.append("aiter.gemm_a8w8_blockscale" + COMPUTING)
    (m, k), n = x.shape, w.shape[0]
    shuffled = getattr(w, "is_shuffled", False)
    if shuffled:
        w = unshuffle_weight(w.view(torch.uint8)).view(w.dtype)
    groups = k // 128
    xs = x_scale.reshape(-1).view(groups, m).t() if shuffled else x_scale.reshape(m, groups)
    xd = (x.float().reshape(m, groups, 128) * xs.float().unsqueeze(-1)).reshape(m, k)
    ws = fp8_block_scales(w_scale, slice(0, n), k)
    y = (xd @ (w.float() * ws).t()).to(dtype or torch.bfloat16)
    if out is not None:
        out.copy_(y)
        return None
    return y


def called_from(module: str) -> bool:
    """Whether the caller's caller runs, anywhere up its stack, under module ``module`` or one in
    its package (a stand-in finder hides a package from transformers' version probe this way)."""
    f = sys._getframe(2)
    while f is not None:
        name = f.f_globals.get("__name__", "")
        if name == module or name.startswith(module + "."):
            return True
        f = f.f_back
    return False
