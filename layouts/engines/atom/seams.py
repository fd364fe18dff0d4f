"""ATOM's seams, checked against ATOM's own code before the door uses them (in the server process,
and in each worker before it allocates anything): the functions and defaults ``prep-atom-serve``
wraps or relies on (:mod:`layouts.engines.atom.serve` lists them), as ROCm/ATOM has them at
:data:`CHECKED_ATOM`. An ATOM whose seams differ, or that cannot be imported, is refused in one
line naming the version seen and what differs."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import pathlib
import sys
from typing import Callable

from .serve_checks import PROG, ServeError

CHECKED_ATOM = "ffdf3bb5"  # ROCm/ATOM commit whose seams this module was checked against
ATOM_RUNNER = "atom.model_engine.model_runner.ModelRunner"


def atom_version() -> str:
    """ATOM's installed version, or where its source tree was imported from."""
    try:
        from importlib.metadata import version

        return f"ATOM {version('atom')}"
    except Exception:  # noqa: BLE001 - a source tree on sys.path has no metadata
        atom = sys.modules.get("atom") or importlib.import_module("atom")
        return f"ATOM from {pathlib.Path(atom.__file__).parent.parent}"


def _calls(fn: Callable, name: str) -> bool:
    """Whether ``fn``'s code refers to ``name`` (a global it calls, or an attribute it reads)."""
    code = getattr(fn, "__code__", None)
    return code is not None and name in code.co_names


def _params(fn: Callable) -> list[str]:
    return list(inspect.signature(fn).parameters)


def _seams_differ(checks: list[tuple[bool, str]]) -> None:
    differ = [what for ok, what in checks if not ok]
    if differ:
        raise ServeError(f"{atom_version()}: {'; '.join(differ)}; {PROG} was checked against ROCm/ATOM {CHECKED_ATOM}: "
                         f"use that ATOM, or a prep checked against yours")


def import_atom(*modules: str) -> None:
    """Import ATOM's ``modules``, or refuse in one line saying why they cannot be."""
    for name in modules:
        try:
            importlib.import_module(name)
        except ImportError as e:
            if (e.name or "").partition(".")[0] == "atom":
                raise ServeError(f"ATOM is not installed in this Python ({sys.executable}): {PROG} runs ATOM's own "
                                 "server; install ROCm/ATOM here (pip install from its source tree: `pip install atom` installs an "
                                 "unrelated PyPI package)") from None
            raise ServeError(f"importing ATOM's {name} failed: {e} (ATOM's dependencies: its pyproject.toml)") from None
        except Exception as e:  # noqa: BLE001 - e.g. aiter refusing to import without ROCm
            raise ServeError(f"importing ATOM's {name} failed: {type(e).__name__}: {str(e).splitlines()[0]}") from None


def check_server_seams() -> None:
    """The seams the server process uses: ``EngineArgs._get_engine_kwargs`` builds the engine's
    keyword arguments, ``Config.runner_qualname`` names the workers' runner, and the worker
    resolves it (``AsyncIOProc``)."""
    import_atom("atom.config", "atom.model_engine.arg_utils")
    from atom.config import Config
    from atom.model_engine.arg_utils import EngineArgs

    runner = {f.name: f.default for f in dataclasses.fields(Config)}.get("runner_qualname")
    checks = [(callable(getattr(EngineArgs, "_get_engine_kwargs", None)), "EngineArgs has no _get_engine_kwargs"),
              (_calls(getattr(EngineArgs, "create_engine", None), "_get_engine_kwargs"),
               "EngineArgs.create_engine does not call _get_engine_kwargs"),
              (runner == ATOM_RUNNER, f"Config.runner_qualname defaults to {runner!r}, not {ATOM_RUNNER!r}")]
    _seams_differ(checks)


LOADER_PARAMS = ["model", "model_name_or_path", "hf_config", "load_dummy", "spec_decode", "prefix",
                 "weights_mapper", "load_fused_expert_weights_fn", "default_weight_loader", "fuse_shared_expert",
                 "is_rank0", "weights_iterator", "online_quant_streamer"]
COVERAGE_PARAMS = ["loaded_weights_record", "params_dict", "dropped_ckpt_keys", "prefix", "is_rank0"]


def check_worker_seams() -> None:
    """The seams a worker uses: ``ModelRunner._build_and_load_model``, the reading step
    ``load_weights_into_model`` that ``load_model`` calls (with the parameters it has at the
    checked commit), ``_report_coverage``, and the drafter loading through ``load_model``."""
    import_atom("atom.model_engine.model_runner", "atom.model_loader.loader", "atom.spec_decode.drafter")
    from atom.model_engine.model_runner import ModelRunner
    from atom.model_loader import loader, loading_core
    from atom.spec_decode.drafter import Drafter

    reading = getattr(loader, "load_weights_into_model", None)
    reading = getattr(reading, "__wrapped__", reading)  # our own wrapper, where installed already
    checks = [(callable(getattr(ModelRunner, "_build_and_load_model", None)),
               "ModelRunner has no _build_and_load_model"),
              (_calls(ModelRunner._build_and_load_model, "load_model"),
               "ModelRunner._build_and_load_model does not call load_model"),
              (callable(reading) and _params(reading) == LOADER_PARAMS,
               f"load_weights_into_model's parameters are not {LOADER_PARAMS}"),
              (_calls(loader.load_model, "load_weights_into_model"), "load_model does not call load_weights_into_model"),
              (callable(getattr(loading_core, "_report_coverage", None))
               and _params(loading_core._report_coverage) == COVERAGE_PARAMS,
               f"loading_core._report_coverage's parameters are not {COVERAGE_PARAMS}"),
              (_calls(Drafter.load_model, "load_model"), "Drafter.load_model does not call load_model")]
    _seams_differ(checks)
