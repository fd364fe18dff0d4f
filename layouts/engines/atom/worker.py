"""Each ATOM worker's side of ``prep-atom-serve`` (seams 2 and 3 of :mod:`layouts.engines.atom.serve`):
:class:`ConvertedModelRunner`, ATOM's ``ModelRunner`` checking the worker's seams, the folder and
the manifest against this worker's configuration before it allocates anything, and the reading
step put in ATOM's loader, which installs the worker's rank of the converted folder (target model
and MTP draft model) through the adapter instead of reading a checkpoint. ATOM is imported inside
the functions only: a worker imports it, ``layouts`` never does."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import pathlib
from typing import Any, Callable

from .._compat import EngineConfig
from .. import _config
from ...errors import LayoutsError
from ...families import language_config
from ...manifest import Manifest
from .adapter import AtomInstallReport, install_converted_weights, install_draft_weights
from .seams import check_worker_seams
from .serve_checks import PROG, ServeError, atom_gpu_arch, check_folder, converted_root, engine_config

# Config.runner_qualname for a converted folder: ATOM's workers import the runner by this name, from
# serve (its module __getattr__ makes the class: _converted_model_runner, below)
RUNNER = "layouts.engines.atom.serve.ConvertedModelRunner"  # by qualname: serve may run as __main__
log = logging.getLogger("atom")  # ATOM's logger: the worker's lines land where ATOM's do


@dataclasses.dataclass
class ConvertedRank:
    """One worker's rank of the converted folder: what it installed into the target, kept until
    the draft model takes the MTP layer."""

    root: pathlib.Path
    engine: EngineConfig
    manifest: Manifest | None = None  # as the worker's check read it (read once)
    report: AtomInstallReport | None = None

    def install_target(self, model: Any) -> list[str]:
        self.report = install_converted_weights(model, self.root, self.engine, manifest=self.manifest)
        self._refuse_unfilled("ATOM's model")
        return self.report.installed

    def install_draft(self, model: Any) -> list[str]:
        if self.report is None:
            raise ServeError(f"{self.root}: ATOM loads the MTP draft model before the target; {PROG} installs the "
                             "draft from the target's rank and cannot: this is not the ATOM it was checked against")
        installed = install_draft_weights(model, self.report)
        self._refuse_unfilled("ATOM's MTP draft model")
        return installed

    def _refuse_unfilled(self, what: str) -> None:
        if self.report.not_installed:
            n = self.report.not_installed
            raise ServeError(f"{self.root}: rank {self.engine.rank} leaves {len(n)} parameters of {what} unfilled "
                             f"(first: {n[0]}); the folder was converted from another config than ATOM builds from")


_RANK: dict[str, ConvertedRank] = {}  # this worker's, by folder


def _reading_step(original: Callable) -> Callable:
    """ATOM's ``load_weights_into_model``, installing the rank instead for a converted folder."""

    def read(model, model_name_or_path, hf_config, load_dummy=None, spec_decode=False, prefix="",
             weights_mapper=None, load_fused_expert_weights_fn=None, *, is_rank0, **host):
        root = converted_root(model_name_or_path)
        if root is None or load_dummy:
            return original(model, model_name_or_path, hf_config, load_dummy, spec_decode, prefix, weights_mapper,
                            load_fused_expert_weights_fn, is_rank0=is_rank0, **host)
        rank = _RANK.get(str(root))
        if rank is None:
            raise ServeError(f"{root}: a converted folder reached ATOM's loader outside {PROG}'s model runner; "
                             f"serve it with {PROG}")
        installed = rank.install_draft(model) if spec_decode else rank.install_target(model)
        from atom.model_loader.loading_core import _report_coverage

        record = {prefix + n for n in installed}
        _report_coverage(loaded_weights_record=record, params_dict=dict(model.named_parameters()),
                         dropped_ckpt_keys=[], prefix=prefix, is_rank0=is_rank0)
        log.info("[%s] installed rank %d of %s: %d parameters of the %s", PROG, rank.engine.rank, root,
                 len(installed), "MTP draft model" if spec_decode else "model")
        return record

    read.__wrapped__ = original
    return read


def install_reading_step() -> None:
    """Put :func:`_reading_step` in ATOM's loader (once per process)."""
    from atom.model_loader import loader

    if not hasattr(loader.load_weights_into_model, "__wrapped__"):
        loader.load_weights_into_model = _reading_step(loader.load_weights_into_model)


def _converted_model_runner() -> type:
    """:class:`ConvertedModelRunner`, made on first use: its base, ATOM's ``ModelRunner``, imports
    aiter's kernels, which only a worker should import (not the server process, nor the checks)."""
    from atom.model_engine.model_runner import ModelRunner

    class ConvertedModelRunner(ModelRunner):
        """ATOM's ``ModelRunner`` for a converted folder: checks before allocating, installs at load."""

        def __init__(self, rank: int, config: Any, *args: Any, **kwargs: Any):
            root = converted_root(config.model)
            if root is not None:
                prepare_worker(root, config, rank)
            super().__init__(rank, config, *args, **kwargs)

    ConvertedModelRunner.__module__, ConvertedModelRunner.__qualname__ = RUNNER.rsplit(".", 1)
    return ConvertedModelRunner


def prepare_worker(root: pathlib.Path, config: Any, rank: int) -> ConvertedRank:
    """What a worker does before ATOM's ``ModelRunner.__init__`` allocates anything: checks its
    seams, the folder and the manifest against this worker's configuration, and puts the reading
    step in ATOM's loader."""
    check_worker_seams()
    manifest = check_folder(root)
    engine = engine_config(manifest, os.environ, tp=config.tensor_parallel_size, rank=rank,
                           expert_parallel=config.enable_expert_parallel, gpu_arch=atom_gpu_arch())
    _RANK[str(root)] = converted = ConvertedRank(root, engine, manifest)
    complete_hf_config(root, config)
    install_reading_step()
    log.info("[%s] rank %d/%d: %s checked (GEMM path %s, MoE %s on %s)", PROG, rank, engine.tp_size, root,
             engine.gemm_path, engine.moe_backend, engine.gpu_arch)
    return converted


def complete_hf_config(root: pathlib.Path, config: Any) -> dict:
    """Set on ATOM's model config (and its draft model's) the DeepSeek-V3 keys the folder's
    config.json lacks (a config saved by transformers 5 drops ``topk_method``, ``scoring_func``
    and ``moe_layer_freq``; ATOM's DeepSeek model reads all three): what SGLang's and vLLM's serve
    commands pass as an override (layouts.engines._config). config.json stays the source's, so
    that ``revert`` is exact. Returns what was set."""
    try:
        raw = language_config(json.loads((root / "config.json").read_text()))  # ATOM's hf_config: the text model's
    except (OSError, ValueError, LayoutsError):
        return {}  # check_folder has refused a folder without its config already
    missing = _config.missing_keys(raw)
    for hf in (getattr(config, "hf_config", None), getattr(config, "draft_model_hf_config", None)):
        for key, value in (missing.items() if hf is not None else ()):
            setattr(hf, key, value)
    if missing:
        log.info("[%s] config.json lacks %s: set to DeepSeek-V3's values", PROG, ", ".join(missing))
    return missing
