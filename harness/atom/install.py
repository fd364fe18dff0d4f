"""ATOM's load of a converted folder against its own load of the source, on the CPU: every rank,
installed with ``layouts.engines.atom.install_converted_weights``, must leave the model ATOM builds
for the architecture (``atom_model_class``) and its ``DeepSeekMTP`` draft model byte for byte as ATOM's own loader
leaves them from the source checkpoint, and ATOM's "NOT loaded" warning must not fire but where
ATOM's own load gives it for the same parameters (GLM-5's draft, whose checkpoint holds no head:
ATOM's drafter then shares the target's). :mod:`harness.atom.on_cpu` says what of aiter is ATOM's
real dependency here and what is a stand-in.

For each rank (:func:`check_rank`):

1. reference: ATOM builds the models for that rank (``set_tp``), ``load_model`` reads the source
   checkpoint (ATOM's loader and its ``process_weights_after_loading``), and the drafter shares
   the target's embedding (``Drafter.load_model``), as ATOM's ModelRunner does. Run twice, with
   ``torch.empty`` memory filled with 0x00 and with 0xFF: the bytes that differ are memory ATOM
   never writes (aiter's ``shuffle_scale`` pads scales into ``torch.empty``), compared nowhere;
2. converted: ATOM builds fresh models, our adapter installs the converted rank into both, and
   ATOM's ``load_model`` runs with its checkpoint-reading step replaced by the adapter's record
   of what it installed: so ATOM's own post-processing loop and its own ``_report_coverage``
   (the "NOT loaded" warning) run on exactly what the adapter did;
3. compares every parameter, buffer and tensor attribute of both models (and ``is_shuffled``);
4. compares the ``W_K``/``W_V`` ATOM derived from each ``kv_b_proj`` with
   ``layouts.absorbed_kv_b`` of the rank's stored bytes through ATOM's own quantization
   (:mod:`harness.atom.mla`).

A rank fails on any mismatch, any warning ATOM's own load does not give, or any stand-in called
while loading (work a stand-in would have skipped).
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import json
import logging
import os
import pathlib
import types
from typing import Iterator
from unittest import mock

import torch

from harness import converted, stand_ins
from harness.atom import mla, on_cpu
from harness.compare import compare
from harness.report import RankResult
from layouts.engines.atom import (ASM, ENV_NON_SHUFFLE, ENV_TRITON_GEMM, ENV_TRITON_MOE, PROFILE, TRITON_NON_SHUFFLE,
                                  TRITON_PRESHUFFLE, install_converted_weights)

# ATOM's dense GEMM paths and the switches that select them (layouts/engines/atom/). The MoE is
# aiter's CK fused_moe throughout, asked for with ATOM_USE_TRITON_MOE=0: ATOM's Triton MoE (its
# default on gfx94x, and on gfx95x with ATOM_USE_TRITON_GEMM=1) wraps the scales with
# triton_kernels, which is not run here.
PATHS = {ASM: {ENV_TRITON_MOE: "0"}, TRITON_NON_SHUFFLE: {ENV_NON_SHUFFLE: "1", ENV_TRITON_MOE: "0"},
         TRITON_PRESHUFFLE: {ENV_TRITON_GEMM: "1", ENV_TRITON_MOE: "0"}}
NOT_LOADED = "were NOT loaded from checkpoint"  # ATOM's loading_core._report_coverage


@dataclasses.dataclass(frozen=True)
class Case:
    """One configuration the install check runs (the source's name, ATOM's path, TP, EP)."""

    variant: str
    path: str  # ATOM's dense GEMM path
    tp: int
    ep: int = 1

    @property
    def layout(self) -> str:
        return PROFILE.dense_layout(self.path)

    @property
    def name(self) -> str:
        return f"{self.variant} {self.path} tp{self.tp}" + (f" ep{self.ep}" if self.ep > 1 else "")


# ---------------------------------------------------------------------------- ATOM's models
def atom_config(src: pathlib.Path, case: Case):
    """ATOM's Config for the source, prepared as ModelRunner prepares it before building."""
    from atom.config import Config, SpeculativeConfig, set_current_atom_config

    # The MTP draft where the source has an MTP layer; not where config.json says one and the
    # checkpoint has none (an amd-quark export made with transformers 5): ATOM would leave it
    # unloaded, and its door refuses --method mtp on such a conversion.
    spec = SpeculativeConfig(method="mtp", model=str(src), num_speculative_tokens=1) if has_mtp_layer(src) else None
    cfg = Config(model=str(src), tensor_parallel_size=case.tp, enable_expert_parallel=case.ep > 1,
                 enforce_eager=True, speculative_config=spec)
    model_class = atom_model_class(cfg)
    cfg.quant_config.remap_layer_name(
        cfg.hf_config, packed_modules_mapping=getattr(model_class, "packed_modules_mapping", {}),
        quant_exclude_name_mapping=getattr(model_class, "quant_exclude_name_mapping", {}))
    set_current_atom_config(cfg)
    torch.set_default_dtype(cfg.torch_dtype)
    return cfg


def atom_model_class(cfg) -> type:
    """The model class ATOM's ModelRunner builds for the config's architecture (its
    ``support_model_arch_dict``: ``DeepseekV2ForCausalLM`` for DeepSeek-V3 and V3.2,
    ``GlmMoeDsaForCausalLM``, ``KimiK25ForCausalLM`` with the DeepSeek model as ``language_model``)."""
    from atom.model_engine.model_runner import support_model_arch_dict
    from atom.utils import resolve_obj_by_qualname

    return resolve_obj_by_qualname(support_model_arch_dict[cfg.hf_config.architectures[0]])


def build(cfg) -> tuple[torch.nn.Module, torch.nn.Module | None]:
    """The target model, then the MTP draft model from the same Config (ATOM's order; None
    without a speculative config). Stand-ins
    called while building (rotary embedding, activation-quant function: forward-only objects)
    are not recorded: only those called while loading count."""
    from atom.models.deepseek_mtp import DeepSeekMTP

    before = len(on_cpu.CALLS)
    models = atom_model_class(cfg)(cfg), DeepSeekMTP(cfg) if cfg.speculative_config is not None else None
    del on_cpu.CALLS[before:]
    return models


def load_reference(src: pathlib.Path, case: Case, fill: int):
    """ATOM's own load of the source checkpoint."""
    from atom.model_loader.loader import load_model
    from atom.spec_decode.drafter import Drafter

    with on_cpu.on_cpu(fill):
        cfg = atom_config(src, case)
        target, draft = build(cfg)
        load_model(target, cfg.model, cfg.hf_config)
        if draft is None:
            return target, draft
        drafter = types.SimpleNamespace(model=draft, speculative_config=cfg.speculative_config, config=cfg,
                                        is_block_drafter=False, _share_if_not_loaded=Drafter._share_if_not_loaded)
        Drafter.load_model(drafter, target)  # loads the MTP layer, then shares the target's embedding
    return target, draft


def atom_post_load(model: torch.nn.Module, cfg, hf_config, installed: list[str], spec_decode: bool) -> None:
    """ATOM's ``load_model`` with its checkpoint-reading step replaced by ``installed`` (what the
    adapter filled): ATOM's coverage report judges it, ATOM's post-processing loop follows."""
    from atom.model_loader import loader
    from atom.model_loader.loading_core import _report_coverage

    def read_nothing(*, model, prefix, **_):
        # ATOM warns from TP rank 0 only (its is_rank0); asked here on every rank
        _report_coverage(loaded_weights_record=set(installed), params_dict=dict(model.named_parameters()),
                         dropped_ckpt_keys=[], prefix=prefix, is_rank0=lambda: True)
        return set(installed)

    with mock.patch.object(loader, "load_weights_into_model", read_nothing):
        loader.load_model(model, cfg.model, hf_config, None, spec_decode)


def load_converted(src: pathlib.Path, out: pathlib.Path, case: Case, rank: int):
    """Our adapter's install into fresh models, then ATOM's post-loading on each."""
    engine = PROFILE.config_from_env(os.environ, tp_size=case.tp, rank=rank, ep_size=case.ep,
                                     gpu_arch=on_cpu.GPU_ARCH["name"])
    with on_cpu.on_cpu(0):
        cfg = atom_config(src, case)
        target, draft = build(cfg)
        report = install_converted_weights(target, out, engine, device="cpu", mtp_model=draft)
        atom_post_load(target, cfg, cfg.hf_config, report.installed, False)
        if draft is not None:
            # ATOM's drafter around the draft's load, as prep-atom-serve runs it: it shares the
            # target's embedding, and its lm_head where the draft's record has no shared_head.head
            # (GLM-5's MTP layer holds neither)
            from atom.spec_decode import drafter as drafter_module

            def post_load(model, *_args, **_kw):
                atom_post_load(model, cfg, cfg.speculative_config.draft_model_hf_config, report.mtp_installed, True)
                return set(report.mtp_installed)

            drafter = types.SimpleNamespace(model=draft, speculative_config=cfg.speculative_config, config=cfg,
                                            is_block_drafter=False,
                                            _share_if_not_loaded=drafter_module.Drafter._share_if_not_loaded)
            with mock.patch.object(drafter_module, "load_model", post_load):
                drafter_module.Drafter.load_model(drafter, target)
    return target, draft, report


@functools.lru_cache(maxsize=None)
def has_mtp_layer(src: pathlib.Path) -> bool:
    """Whether the source holds a tensor of an MTP layer (from config.json's num_hidden_layers on);
    asked by every load of every rank, its headers read once."""
    from prep.source import SourceCheckpoint

    ck = SourceCheckpoint(pathlib.Path(src))
    layers = ck.config.get("num_hidden_layers")
    return any(n.startswith(f"model.layers.{layers}.") for n in ck.tensors)


# ---------------------------------------------------------------------------- comparing
def held(target: torch.nn.Module, draft: torch.nn.Module | None) -> tuple[dict, dict]:
    """``(state, derived)`` of both models, by "main:"/"draft:" name: every parameter and buffer,
    and every other tensor a module holds as an attribute (MLA's W_K/W_V and their scales)."""
    state, derived = {}, {}
    for which, model in (("main", target), ("draft", draft)):
        if model is None:
            continue
        for n, t in [*model.named_parameters(), *model.named_buffers()]:
            state[f"{which}:{n}"] = t.data
        for mname, module in model.named_modules():
            for k, v in vars(module).items():
                name = f"{which}:{mname}.{k}"
                if isinstance(v, torch.Tensor) and not isinstance(v, torch.nn.Parameter) and name not in state:
                    derived.setdefault(name, v)
    return state, derived


def swizzle_labels(target: torch.nn.Module, draft: torch.nn.Module) -> dict[str, str | None]:
    """Every ``*_swizzle_layout`` attribute of both models' modules (the label ATOM's Triton MoE
    passes its kernels with each scale), by "main:"/"draft:" name."""
    return {f"{w}:{name}.{k}": v for w, m in (("main", target), ("draft", draft)) if m is not None
            for name, module in m.named_modules() for k, v in vars(module).items() if k.endswith("_swizzle_layout")}


def shuffled_flags(target: torch.nn.Module, draft: torch.nn.Module) -> dict[str, bool]:
    """``is_shuffled`` of every parameter, absent read as False (as aiter and ATOM read it)."""
    return {f"{w}:{n}": bool(getattr(p, "is_shuffled", False)) for w, m in (("main", target), ("draft", draft))
            if m is not None for n, p in m.named_parameters()}


# ---------------------------------------------------------------------------- one rank
class CaughtWarnings(logging.Handler):
    """The warnings a logger gives while attached (ATOM's "NOT loaded" among them)."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def check_rank(case: Case, src: pathlib.Path, out: pathlib.Path, rank: int, kernels: types.ModuleType | None = None,
               label: str | None = None) -> RankResult:
    """One rank's result (its ``engine`` column ``label``, default the case's name); ``kernels``:
    aiter's Triton MXFP4 GEMMs where ATOM's MXFP4 ``W_K``/``W_V`` derivation is to run
    (:func:`harness.atom.mla.mla_from_mxfp4`), None to skip it in both loads."""
    from atom.model_loader import loading_core

    atoms_coverage = loading_core._report_coverage

    def coverage_on_every_rank(*args, **kw):
        return atoms_coverage(*args, **{**kw, "is_rank0": lambda: True})

    on_cpu.set_tp(rank, case.tp)
    log, caught = logging.getLogger("atom"), CaughtWarnings()
    log.addHandler(caught)
    try:
        # ATOM reads its switches when it uses them; it warns of unloaded parameters on rank 0 only,
        # asked here on every rank (as the converted load's is: atom_post_load)
        with mock.patch.dict(os.environ, PATHS[case.path]), mla.mla_from_mxfp4(kernels), \
                mock.patch.object(loading_core, "_report_coverage", coverage_on_every_rank):
            on_cpu.CALLS.clear()
            ref = [load_reference(src, case, fill) for fill in (0x00, 0xFF)]
            ref_warned = {m for m in caught.messages if NOT_LOADED in m}
            caught.messages.clear()
            target, draft, report = load_converted(src, out, case, rank)
    finally:
        log.removeHandler(caught)
    (state0, derived0), (state1, derived1) = held(*ref[0]), held(*ref[1])
    state, derived = held(target, draft)
    compared = compare({**state0, **derived0}, {**state, **derived}, {**state1, **derived1})
    mla_checked, mla_bad = mla.mla_derivation(target, out, rank, case.tp, kernels is not None)
    flags_ref, flags_got = shuffled_flags(*ref[0]), shuffled_flags(target, draft)
    calls = sorted(set(on_cpu.CALLS))
    problems = compared.problems + mla_bad + [
        f"{k}: is_shuffled {flags_ref[k]} in ATOM's load, {flags_got.get(k)} after the adapter"
        for k in flags_ref if flags_ref[k] != flags_got.get(k)]
    problems += [f"not installed: {x}" for x in report.not_installed]
    problems += [f"stand-in called while loading: {s}" for s in stand_ins.skipped(calls)]
    notes = [f"MLA: ATOM's W_K/W_V equal layouts.absorbed_kv_b's through its own quantization in {mla_checked} layers"]
    note = stand_ins.computed_note(calls)
    notes += [note] if note else []
    notes += [f"warning: {m[:200]}" for m in caught.messages if NOT_LOADED not in m]
    notes += ["ATOM's own load of the source warned too"] if ref_warned else []
    return RankResult(
        engine=label or case.name, rank=rank, tp=case.tp, tensors=len(state0),
        draft=sum(k.startswith("draft:") for k in state0) if ref[0][1] is not None else None,
        derived=len(derived0), bytes_equal=compared.equal, unwritten=compared.unwritten,
        # ATOM's NOT-loaded warning: a failure unless its own load of the source gives the very
        # same (GLM-5's draft: shared_head.head, which the drafter then takes from the target)
        warned=_warned({m for m in caught.messages if NOT_LOADED in m}, ref_warned), problems=problems, notes=notes)


def _unloaded(messages: set[str]) -> set[str]:
    """The parameter names ATOM's NOT-loaded warnings name (its first 20 per load)."""
    return {n for m in messages for n in ast.literal_eval(m.rpartition("unloaded names: ")[2])}


def _warned(got: set[str], ref: set[str]) -> str:
    """The warned column: "no"; "same" where every parameter the converted load's warning names is
    one ATOM's own load of the source leaves unloaded too (GLM-5's draft: shared_head.head, and the
    embedding the adapter fills, both of which ATOM's drafter then takes from the target); "yes"."""
    return "no" if not got else "same" if _unloaded(got) <= _unloaded(ref) else "yes"


# ---------------------------------------------------------------------------- check-engine atom
def check(src: pathlib.Path, out: pathlib.Path, trees: tuple[pathlib.Path, pathlib.Path],
          ranks: list[int] | None = None, gpu_arch: str = "gfx950") -> Iterator[str | RankResult]:
    """``check-engine atom``: ATOM's own load of ``src`` against the adapter's install of ``out``,
    rank by rank (``ranks``, default all), ATOM's GEMM path and MoE back end being those that read
    ``out``'s layouts; ``trees``: ATOM's and aiter's sources. Yields what to say, then each rank."""
    t = converted.target(out, "atom")
    if t.moe_layout != "ck":
        raise SystemExit(f"error: {out}: MoE layout {t.moe_layout}: the install check runs aiter's CK MoE only (its "
                         "Triton MoE needs triton_kernels); check ATOM's server start-up instead (--serve)")
    kernels = mla.mla_kernels()
    on_cpu.install(*trees, gpu_arch)
    logging.getLogger("atom").setLevel(logging.WARNING)  # its warnings are what we look for
    case = Case("source", PROFILE.gemm_path_reading(t.layout), t.tp, t.ep)
    kv_lora_rank = json.loads((out / "config.json").read_text()).get("kv_lora_rank") or 0
    derive = kernels if mla.mla_gemm_runs(case.path, kv_lora_rank) else None
    if derive is not None:
        yield f"kv_b_proj GEMM of ATOM's MXFP4 W_K/W_V derivation on the {case.path} path: {mla.MLA_GEMM[case.path]}"
    for rank in ranks if ranks is not None else range(t.tp):
        yield check_rank(case, src, out, rank, derive, label="atom")
