"""ATOM's real DeepSeek model code, imported and built on a CPU without ROCm (for the ATOM checks,
:mod:`harness.atom.install` and :mod:`harness.atom.serve`; ATOM is not installed: its tree is put
on the path).

ATOM (``ROCm/ATOM``) imports ``aiter`` everywhere, and ``import aiter`` needs ROCm (its package
``__init__`` builds and loads HIP modules). What we give it instead, and why each is enough:

* aiter's own pure-Python files, loaded from an aiter source tree (``--aiter-dir``): the ones
  ATOM's weight processing runs on the CPU, where a stand-in would make the check circular:
  ``aiter/ops/shuffle.py`` (``shuffle_weight``, ``shuffle_scale``, ``moe_shuffle_*``),
  ``aiter/utility/fp4_utils.py`` (``e8m0_shuffle``), ``dtypes``, ``mx_types``, ``aiter_types``.
* ``aiter.ops.enum``: ``QuantType`` / ``ActivationType`` are C++ enums in aiter's compiled core;
  ours are Python enums with the same names and values (aiter ``csrc/include/aiter_enum.h``).
* ``aiter.utility.aiter_types`` parses that C header for the dtype ids aiter passes to its C++
  kernels; a Python-only tree (the oracles' subset) has no header, and then the ids are ours
  (numbered in the order aiter's docstring lists them): nothing on the CPU passes them anywhere.
* ``aiter.jit.utils.chip_info``: the arch is asked of the GPU driver; we answer
  :data:`GPU_ARCH["name"]` (:func:`install`'s ``gpu_arch``, default gfx950: MI355, the arch with
  MXFP4 GEMMs), so ATOM picks that arch's paths.
* ``aiter.dist.parallel_state``: the process groups. A single process plays any rank:
  :func:`set_tp` sets the TP rank and size every ``get_tp_group()`` / ``..._world_size()``
  answers; every other group (DP, PP, EP, PCP, DCP) is size 1 (ATOM derives EP from TP).
* every other ``aiter`` module, and the server-side packages ATOM imports at module level but
  never calls while building or loading a model (zmq, msgspec, ...): permissive stand-ins whose
  attributes are callables returning stand-ins. Each call of one is recorded in :data:`CALLS`,
  so a caller can show that loading a model never ran a stand-in (that would be silently
  skipped work).

:func:`on_cpu` is the context to build and load models in: ``device="cuda"`` becomes the CPU
(ATOM allocates routing scratch buffers there), pinned memory is plain memory,
``torch.cuda.Stream``/``Event`` are stand-ins,
and every ``torch.empty*`` is filled with one byte, so that memory ATOM leaves uninitialised can
be told from memory it writes (two runs with different bytes differ exactly there).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import pathlib
import sys
import types
from typing import Iterator

import torch

from harness import freeze_imports, stand_ins
from harness.mi355x import CpuMode
from harness.stand_ins import StandInFinder, StandInModule, fill_aiter_stub, file_spec

# aiter modules loaded from its own files (everything else under aiter is a stand-in).
REAL_AITER = stand_ins.REAL_AITER
# Packages ATOM imports at module level for its server, none of them used to build or load a model.
# Only those not installed get a stand-in (prep itself uses xxhash where it is installed).
SERVER_PACKAGES = ("zmq", "msgspec", "xxhash", "prometheus_client", "fastapi", "uvicorn")
ATOM_MODULES = ("atom.models.deepseek_v2", "atom.models.deepseek_mtp", "atom.model_loader.loader",
                "atom.spec_decode.drafter")
CALLS = stand_ins.CALLS  # every call of a stand-in, by name, in order (stand_ins)
_TP = {"rank": 0, "size": 1}
GPU_ARCH = {"name": "gfx950"}


class _Group:
    is_first_rank = is_last_rank = True

    def __init__(self, rank: int, size: int):
        self.rank = self.rank_in_group = rank
        self.world_size = size


class _ParallelState(types.ModuleType):
    """aiter.dist.parallel_state for one process playing TP rank ``_TP['rank']`` of ``_TP['size']``."""

    _TP_NAMES = ("get_tp_group", "get_tensor_model_parallel_world_size", "get_tensor_model_parallel_rank")

    def __getattr__(self, name: str):
        tp = name in self._TP_NAMES  # read at each call: ATOM imports these functions once

        def rank():
            return _TP["rank"] if tp else 0

        def size():
            return _TP["size"] if tp else 1

        if name.endswith("_group"):
            return lambda: _Group(rank(), size())
        if name.endswith("_world_size"):
            return size
        if name.endswith("_rank"):
            return rank
        raise AttributeError(name)


class _AiterFinder(StandInFinder):
    def __init__(self, aiter_root: pathlib.Path):
        super().__init__(("aiter", *SERVER_PACKAGES))
        self.root = aiter_root

    def aiter_root(self) -> pathlib.Path:
        return self.root

    def source(self, name):
        return file_spec(name, self.root) if name in REAL_AITER else None

    def module_for(self, name: str) -> type:
        return _ParallelState if name == "aiter.dist.parallel_state" else StandInModule

    def exec_module(self, m):
        fill_aiter_stub(m, lambda: GPU_ARCH["name"])


# What ATOM's code imports on the CPU beyond torch (its server, tokenizer and config handling):
# `bash scripts/setup_env.sh --atom` installs them.
ATOM_CPU_DEPS = ("fastapi", "msgspec", "psutil", "setproctitle", "uvicorn", "zmq", "PIL", "transformers", "triton")


def missing_deps() -> list[str]:
    """The modules of :data:`ATOM_CPU_DEPS` this interpreter cannot import."""
    return [m for m in ATOM_CPU_DEPS if importlib.util.find_spec(m) is None]


_INSTALLED: dict[str, tuple] = {}  # the trees install() put on the path, once per process


def install(atom_dir: pathlib.Path, aiter_dir: pathlib.Path, gpu_arch: str = "gfx950") -> None:
    """Make ``import atom`` work here: ATOM's tree first on the path, aiter as described above.
    ATOM's custom-op registration (for torch.compile of the forward, which never runs here) is
    a no-op: torch refuses the stand-in default arguments of some op signatures."""
    missing = missing_deps()
    if missing:  # one line, not a traceback from deep inside ATOM's imports
        raise SystemExit(f"error: ATOM's code needs {', '.join(missing)}, not installed in {sys.executable}: run "
                         "`bash scripts/setup_env.sh --atom`")
    if not (aiter_dir / "aiter" / "ops" / "shuffle.py").is_file():
        raise SystemExit(f"{aiter_dir}: no aiter/ops/shuffle.py; pass --aiter-dir an aiter source tree")
    if _INSTALLED.get("trees") == (atom_dir, aiter_dir, gpu_arch):
        return  # a TP worker forked from harness.atom.serve's server process, which installed them
    _INSTALLED["trees"] = (atom_dir, aiter_dir, gpu_arch)
    GPU_ARCH["name"] = gpu_arch
    sys.path.insert(0, str(atom_dir))
    sys.meta_path.insert(0, _AiterFinder(aiter_dir))
    import atom.utils.custom_register as custom_register

    def register(op_name, op_func, mutates_args=(), fake_impl=None, target_lib=None, **_):
        # not defined with torch (its schema has stand-in defaults); looked up at build time by the
        # modules that call it in forward (DeepSeek-V3.2's sparse_attn_indexer): a recording stand-in
        ns = getattr(torch.ops, (target_lib or custom_register.aiter_lib).ns)
        if op_name not in vars(ns):
            setattr(ns, op_name, stand_ins.StandIn(f"torch.ops.{ns.name}.{op_name}"))

    custom_register.direct_register_custom_op = register
    for name in ATOM_MODULES:  # imported outside on_cpu: class bodies read the real torch.cuda.Stream
        importlib.import_module(name)
    freeze_imports()


def set_tp(rank: int, size: int) -> None:
    _TP.update(rank=rank, size=size)


class _NoStream:
    """torch.cuda.Stream / Event while building: ATOM makes side streams it only uses in forward."""

    def __init__(self, *args, **kwargs):
        pass


@contextlib.contextmanager
def on_cpu(fill: int = 0) -> Iterator[None]:
    """Build and load ATOM models on the CPU; ``torch.empty*`` memory holds byte ``fill``."""
    saved = torch.cuda.Stream, torch.cuda.Event, torch.cuda.current_device
    torch.cuda.Stream = torch.cuda.Event = _NoStream
    torch.cuda.current_device = lambda: "cpu"
    try:
        with CpuMode(fill):  # pinned memory (page-locked staging for GPU copies) is plain memory here
            yield
    finally:
        torch.cuda.Stream, torch.cuda.Event, torch.cuda.current_device = saved
