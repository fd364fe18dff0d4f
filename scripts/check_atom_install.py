#!/usr/bin/env python
"""Check the ATOM adapter against ATOM's real model code, on the CPU: every rank of a converted
(rank-exact) checkpoint, installed with ``layouts.engines.atom.install_converted_weights``,
must leave ATOM's ``DeepseekV3ForCausalLM`` and its ``DeepSeekMTP`` draft model byte for byte
as ATOM's own loader leaves them from the source checkpoint, and ATOM's "NOT loaded" warning
must not fire but where ATOM's own load gives it for the same parameters (GLM-5's draft, whose
checkpoint holds no head: ATOM's drafter then shares the target's).

    .venv/bin/python scripts/check_atom_install.py --atom-dir ATOM_TREE --aiter-dir AITER_TREE [--work DIR]
        [--only TEXT] [--preset NAME [--layers N]] [--gpu-arch gfx950|gfx942]

ATOM_TREE / AITER_TREE: extracted source trees of ROCm/ATOM and ROCm/aiter (default: extracted
from the bare git directories in $PREP_ATOM_GIT / $PREP_AITER_GIT). scripts/atom_on_cpu.py says
what of aiter is ATOM's real dependency here and what is a stand-in.

For each configuration (checkpoint, ATOM's dense GEMM path, TP, EP) it writes the checkpoint
(``prep.testing``: tiny, or ``--preset``), converts it with prep, and for each rank:

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
4. compares the ``W_K``/``W_V`` ATOM derived from each BF16 ``kv_b_proj`` with
   ``layouts.absorbed_kv_b`` of the rank's stored bytes through ATOM's own quantization
   (column ``mla``: the layers checked; :func:`mla_derivation`).

ATOM's derivation of ``W_K``/``W_V`` from an MXFP4 ``kv_b_proj`` (v2) runs its ``kv_b_proj`` GEMM;
here on aiter's Triton kernels, interpreted (:func:`mla_from_mxfp4`, :data:`MLA_GEMM`: on the asm
path a stand-in for ``gemm_a4w4``), where the kernel takes ``kv_lora_rank`` as K
(:func:`mla_gemm_runs`: the tiny v2's 128 only on the non-shuffle path, hence ``v2-wide``);
elsewhere that one step is skipped in both loads alike.

Prints one row per rank and exits 1 on any mismatch, any warning ATOM's own load does not give,
or any stand-in called while loading (work a stand-in would have skipped).
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import dataclasses
import functools
import logging
import os
import pathlib
import subprocess
import sys
import tempfile
import types
from unittest import mock

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import atom_on_cpu  # noqa: E402
import stand_ins  # noqa: E402
from layouts.engines.atom import (ASM, ENV_NON_SHUFFLE, ENV_TRITON_GEMM, ENV_TRITON_MOE, GFX95, PROFILE,  # noqa: E402
                                  TRITON_NON_SHUFFLE, TRITON_PRESHUFFLE, install_converted_weights)
from layouts.errors import LayoutsError  # noqa: E402
from prep.convert import convert  # noqa: E402
from prep.deepseek import Target  # noqa: E402
from prep.errors import PrepError  # noqa: E402
from prep.testing import PRESETS, SynthSpec, write_checkpoint  # noqa: E402

# The checkpoints: prep.testing's tiny one of each variant (or another preset's: --preset), and
# with the tiny one R1-0528 "wide": 16 heads (o_proj [256, 512], wider than tall as R1's [7168,
# 16384]) and moe_intermediate 320 (ATOM and prep pad the experts' intermediate to 512 at TP 1).
WIDE = SynthSpec(variant="r1-0528", num_attention_heads=16, moe_intermediate_size=320)
# v2 "wide": kv_lora_rank 256, which aiter's preshuffle GEMM takes as K (the tiny one's 128 it
# cannot), so that ATOM's MXFP4 W_K/W_V derivation runs on the asm path too (mla_from_mxfp4).
V2_WIDE = SynthSpec(variant="v2", q_lora_rank=256, kv_lora_rank=256, v_head_dim=64)
VARIANTS = ("r1-0528", "v2")
# ATOM's dense GEMM paths and the switches that select them (layouts/engines/atom/). The MoE is
# aiter's CK fused_moe throughout, asked for with ATOM_USE_TRITON_MOE=0: ATOM's Triton MoE (its
# default on gfx94x, and on gfx95x with ATOM_USE_TRITON_GEMM=1) wraps the scales with
# triton_kernels, which is not run here.
PATHS = {ASM: {ENV_TRITON_MOE: "0"}, TRITON_NON_SHUFFLE: {ENV_NON_SHUFFLE: "1", ENV_TRITON_MOE: "0"},
         TRITON_PRESHUFFLE: {ENV_TRITON_GEMM: "1", ENV_TRITON_MOE: "0"}}
NOT_LOADED = "were NOT loaded from checkpoint"  # ATOM's loading_core._report_coverage


@dataclasses.dataclass(frozen=True)
class Case:
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


def default_cases() -> list[Case]:
    """Both variants on the default (asm) and non-shuffle paths at TP 1-8, R1-0528 on the
    triton-preshuffle path (ATOM cannot load MXFP4 attention there: the profile refuses it),
    expert parallel, the wide R1-0528, and the v2 whose kv_lora_rank the preshuffle GEMM takes."""
    cases = [Case(v, p, tp) for v in VARIANTS for p in (ASM, TRITON_NON_SHUFFLE) for tp in (1, 2, 4, 8)]
    cases += [Case("r1-0528", TRITON_PRESHUFFLE, tp) for tp in (1, 2, 4, 8)]
    cases += [Case(v, ASM, 2, 2) for v in VARIANTS] + [Case("r1-0528", TRITON_NON_SHUFFLE, 4, 4)]
    cases += [Case("r1-0528", ASM, 8, 8), Case("v2", TRITON_NON_SHUFFLE, 8, 8)]
    cases += [Case("v2-wide", ASM, tp) for tp in (1, 2)] + [Case("v2-wide", ASM, 2, 2),
                                                             Case("v2-wide", TRITON_NON_SHUFFLE, 2)]
    return cases + [Case("r1-wide", p, tp) for p in (ASM, TRITON_NON_SHUFFLE) for tp in (1, 2)] + \
        [Case("r1-wide", ASM, 2, 2)]


# ---------------------------------------------------------------------------- inputs
def source_tree(given: str | None, env: str, repo: str, work: pathlib.Path) -> pathlib.Path:
    """``given``, else the HEAD of the bare git directory in ``$env`` extracted under ``work``."""
    if given:
        return pathlib.Path(given)
    git_dir = os.environ.get(env)
    flag = repo.split("/")[1].lower()
    if not git_dir:
        raise SystemExit(f"no {repo} source: pass --{flag}-dir (an extracted {repo} tree) or set {env} to a bare "
                         f"git directory of {repo}")
    out = work / f"{flag}-src"
    if not out.is_dir():
        out.mkdir(parents=True)
        archive = subprocess.run(["git", f"--git-dir={git_dir}", "archive", "HEAD"], check=True, capture_output=True)
        subprocess.run(["tar", "-x", "-C", str(out)], input=archive.stdout, check=True)
    return out


def converted(case: Case, sources: dict[str, pathlib.Path], work: pathlib.Path) -> pathlib.Path | str:
    """The case's conversion (made once), or prep's one-line refusal."""
    out = work / case.name.replace(" ", "-")
    if not (out / "config.json").is_file():
        try:
            convert(str(sources[case.variant]), out, Target(layout=case.layout, tp=case.tp, ep=case.ep))
        except (PrepError, LayoutsError) as e:  # a layout the tiny dims cannot take at this TP
            return str(e).splitlines()[0]
    return out


# ---------------------------------------------------------------------------- ATOM's models
def atom_config(src: pathlib.Path, case: Case):
    """ATOM's Config for the source, prepared as ModelRunner prepares it before building."""
    from atom.config import Config, SpeculativeConfig, set_current_atom_config
    from atom.models.deepseek_v2 import DeepseekV3ForCausalLM

    # The MTP draft where the source has an MTP layer; not where config.json says one and the
    # checkpoint has none (an amd-quark export made with transformers 5): ATOM would leave it
    # unloaded, and its door refuses --method mtp on such a conversion.
    spec = SpeculativeConfig(method="mtp", model=str(src), num_speculative_tokens=1) if has_mtp_layer(src) else None
    cfg = Config(model=str(src), tensor_parallel_size=case.tp, enable_expert_parallel=case.ep > 1,
                 enforce_eager=True, speculative_config=spec)
    model_class = DeepseekV3ForCausalLM
    cfg.quant_config.remap_layer_name(
        cfg.hf_config, packed_modules_mapping=getattr(model_class, "packed_modules_mapping", {}),
        quant_exclude_name_mapping=getattr(model_class, "quant_exclude_name_mapping", {}))
    set_current_atom_config(cfg)
    torch.set_default_dtype(cfg.torch_dtype)
    return cfg


def build(cfg) -> tuple[torch.nn.Module, torch.nn.Module | None]:
    """The target model, then the MTP draft model from the same Config (ATOM's order; None
    without a speculative config). Stand-ins
    called while building (rotary embedding, activation-quant function: forward-only objects)
    are not recorded: only those called while loading count."""
    from atom.models.deepseek_mtp import DeepSeekMTP
    from atom.models.deepseek_v2 import DeepseekV3ForCausalLM

    before = len(atom_on_cpu.CALLS)
    models = DeepseekV3ForCausalLM(cfg), DeepSeekMTP(cfg) if cfg.speculative_config is not None else None
    del atom_on_cpu.CALLS[before:]
    return models


def load_reference(src: pathlib.Path, case: Case, fill: int):
    """ATOM's own load of the source checkpoint."""
    from atom.model_loader.loader import load_model
    from atom.spec_decode.drafter import Drafter

    with atom_on_cpu.on_cpu(fill):
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
                                     gpu_arch=atom_on_cpu.GPU_ARCH["name"])
    with atom_on_cpu.on_cpu(0):
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


def mla_kernels(root: str | None = None) -> types.ModuleType | None:
    """aiter's Triton MXFP4 GEMMs (from ``root``, the wheel's files; default prep.reference.aiter_gemm's
    folder) for ATOM's MXFP4 ``W_K``/``W_V`` derivation, or None, said in one line, where they are
    missing. Loaded before anything imports triton (the kernels are interpreted) and before ATOM's
    aiter stand-ins exist (prep.reference.aiter_gemm loads them under aiter's own names)."""
    from prep.reference import aiter_gemm

    try:
        return aiter_gemm.gemm_module(root)
    except PrepError as e:
        print(f"ATOM's W_K/W_V derivation from MXFP4 kv_b_proj is NOT run (skipped in both loads): {e}")
        return None


def mla_gemm_runs(case: Case, spec: SynthSpec) -> bool:
    """Whether aiter's Triton kernel for the case's path can run ``kv_b_proj``'s GEMM (K =
    ``kv_lora_rank``, not split by TP): the non-shuffle kernel takes any K, the preshuffle one
    (which stands in for ``gemm_a4w4`` on the asm path) K % 256 == 0 only (prep.reference.aiter_gemm)."""
    return case.path == TRITON_NON_SHUFFLE or spec.kv_lora_rank % 256 == 0


# What computes kv_b_proj's GEMM on an identity when ATOM derives W_K/W_V from MXFP4 bytes.
MLA_GEMM = {TRITON_NON_SHUFFLE: "aiter's gemm_afp4wfp4 (Triton, interpreted): ATOM's own call",
            TRITON_PRESHUFFLE: "aiter's preshuffled-weight Triton GEMM (interpreted): ATOM's own call",
            ASM: "STAND-IN for aiter's gemm_a4w4 (a GPU binary): aiter's preshuffled-weight Triton GEMM "
                 "(interpreted) on the same W16 weight and S32x8 scale bytes"}


def _mxfp4_quant_stand_in(x, quant_dtype=None, scale=None, shuffle=False, **_):
    """STAND-IN for aiter's ``get_hip_quant(per_1x32)`` (a HIP binary): MXFP4 rows with
    ``layouts``' quantization, the scale S32x8-shuffled and padded when ``shuffle`` (as the HIP
    kernel lays it out for gemm_a4w4). Its only input here is the identity ATOM multiplies
    ``kv_b_proj`` by: every block of 32 holds one 1.0 or none, which any MXFP4 rule quantizes
    exactly (code 4.0, scale 2^-2; zeros)."""
    import layouts
    from aiter import dtypes

    q, s = layouts.mxfp4.quantize(x.float())
    if shuffle:
        s = layouts.preshuffle_scale(s, pad_value=layouts.E8M0_ONE)
    return q.view(dtypes.fp4x2), s.view(torch.float8_e8m0fnu)


@contextlib.contextmanager
def mla_from_mxfp4(kernels: types.ModuleType | None):
    """ATOM's derivation of ``W_K``/``W_V`` from an MXFP4 ``kv_b_proj`` (v2): with ``kernels``
    (aiter's Triton MXFP4 GEMMs, prep.reference.aiter_gemm), ``MLAAttention.process_weights_after_loading``
    runs as ATOM wrote it, ``get_and_maybe_dequant_weights`` multiplying the stored bytes by an
    identity through ATOM's own ``gemm_a4w4_quant`` (its views of weight and scales per path), with
    aiter's kernels for the GEMM (:data:`MLA_GEMM`) and :func:`_mxfp4_quant_stand_in` for the
    activation. Without ``kernels`` (the kernel cannot take this K, :func:`mla_gemm_runs`) the
    step is skipped in both loads alike; its only input, ``kv_b_proj``'s bytes, is compared."""
    from aiter import dtypes
    from atom.model_ops import linear
    from atom.model_ops.attention_mla import MLAAttention

    if kernels is None:
        run = MLAAttention.process_weights_after_loading

        def unless_mxfp4(self):
            if self.kv_b_proj.weight.dtype != dtypes.fp4x2:
                run(self)

        with mock.patch.object(MLAAttention, "process_weights_after_loading", unless_mxfp4):
            yield
        return
    from prep.reference.aiter_gemm import with_defined_overread

    def non_shuffle(x, w, x_scale, w_scale, otype, y):
        return with_defined_overread(kernels.gemm_afp4wfp4)(x, w, x_scale, w_scale, dtype=otype, y=y)

    def preshuffle(x, w, x_scale, w_scale, dtype=torch.bfloat16, y=None):
        return kernels.gemm_afp4wfp4_preshuffled_weight_scales(x, w, x_scale, w_scale, dtype=y.dtype if y is not None
                                                               else dtype, y=y, use_aot=False)

    def a4w4(x, weight, x_scale, weight_scale, y):
        # gemm_a4w4 reads the same bytes as ATOM's Triton preshuffle path; viewed as that path views them
        x_scale = x_scale.view(torch.uint8)
        x_scale = x_scale.view(x_scale.shape[0] // 32, -1) if x.shape[0] >= 32 else x_scale[: x.shape[0]]
        w_scale = weight_scale.view(torch.uint8)
        return preshuffle(x.view(torch.uint8), weight.view(torch.uint8).view(weight.shape[0] // 16, -1), x_scale,
                          w_scale.view(w_scale.shape[0] // 32, -1), y=y)

    with mock.patch.object(linear, "get_hip_quant", lambda _qtype: _mxfp4_quant_stand_in), \
            mock.patch.object(linear, "gemm_afp4wfp4", non_shuffle), \
            mock.patch.object(linear, "gemm_afp4wfp4_preshuffle", preshuffle), \
            mock.patch.object(linear, "gemm_a4w4", a4w4):
        yield


# ---------------------------------------------------------------------------- comparing
def tensors(target: torch.nn.Module, draft: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter, buffer and tensor attribute of both models, by "main:"/"draft:" name."""
    out = {}
    for which, model in (("main", target), ("draft", draft)):
        if model is None:
            continue
        for n, t in [*model.named_parameters(), *model.named_buffers()]:
            out[f"{which}:{n}"] = t.data
        for mname, module in model.named_modules():
            for k, v in vars(module).items():
                if isinstance(v, torch.Tensor) and not isinstance(v, torch.nn.Parameter):
                    out.setdefault(f"{which}:{mname}.{k}", v)
    return out


def swizzle_labels(target: torch.nn.Module, draft: torch.nn.Module) -> dict[str, str | None]:
    """Every ``*_swizzle_layout`` attribute of both models' modules (the label ATOM's Triton MoE
    passes its kernels with each scale), by "main:"/"draft:" name."""
    return {f"{w}:{name}.{k}": v for w, m in (("main", target), ("draft", draft)) if m is not None
            for name, module in m.named_modules() for k, v in vars(module).items() if k.endswith("_swizzle_layout")}


def shuffled_flags(target: torch.nn.Module, draft: torch.nn.Module) -> dict[str, bool]:
    """``is_shuffled`` of every parameter, absent read as False (as aiter and ATOM read it)."""
    return {f"{w}:{n}": bool(getattr(p, "is_shuffled", False)) for w, m in (("main", target), ("draft", draft))
            if m is not None for n, p in m.named_parameters()}


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)


def compare(ref0: dict, ref1: dict, got: dict) -> tuple[int, int, int, list[str]]:
    """(tensors, bytes equal, bytes never written by ATOM, mismatches): ``got`` against the
    reference on every byte both reference runs agree on."""
    bad = [f"{n}: only in ATOM's load" for n in ref0.keys() - got.keys()]
    bad += [f"{n}: only after the adapter" for n in got.keys() - ref0.keys()]
    equal = undefined = 0
    for n in sorted(ref0.keys() & got.keys()):
        a, b, g = ref0[n], ref1[n], got[n]
        if (a.shape, a.dtype) != (g.shape, g.dtype):
            bad.append(f"{n}: ATOM {list(a.shape)} {a.dtype}, adapter {list(g.shape)} {g.dtype}")
            continue
        a, b, g = _bytes(a), _bytes(b), _bytes(g)
        defined = a == b
        differ = int((defined & (a != g)).sum())
        undefined += int((~defined).sum())
        equal += int((defined & (a == g)).sum())
        if differ:
            bad.append(f"{n}: {differ} of {a.numel()} bytes differ")
    return len(ref0), equal, undefined, bad


def mla_derivation(target: torch.nn.Module, out: pathlib.Path, rank: int, tp: int,
                   mxfp4_derived: bool) -> tuple[int, list[str]]:
    """(layers checked, mismatches): the ``W_K``/``W_V`` (and scales) ATOM derived from each
    ``kv_b_proj`` in ``process_weights_after_loading``, against ``layouts.absorbed_kv_b`` of
    the rank's stored bytes put through ATOM's own quantization (``W_K`` is ``W_UK`` with its
    last two dims swapped, ``W_V`` is ``W_UV``). From a BF16 ``kv_b_proj`` ATOM takes the weight as
    it is; from an MXFP4 one it multiplies the stored bytes by an identity (:func:`mla_from_mxfp4`),
    whose BF16 result is exact (an MXFP4 value times 1.0 fits BF16's 8 bits), so both must give the
    same bytes. Layers whose MXFP4 derivation did not run (``mxfp4_derived`` False) are left out;
    tests/test_mla.py checks ours against the source there."""
    import json
    import re

    import layouts
    from aiter import dtypes
    from atom.model_ops.attention_mla import MLAAttention, dynamic_per_batched_tensor_quant

    loaded = layouts.load_rank(out, rank)
    shape = layouts.MlaShape.from_config(json.loads((out / "config.json").read_text()), tp)
    checked, bad = 0, []
    for name, module in target.named_modules():
        if not isinstance(module, MLAAttention) or (module.kv_b_proj.weight.dtype == dtypes.fp4x2
                                                     and not mxfp4_derived):
            continue
        if not (isinstance(getattr(module, "W_K", None), torch.Tensor) and module.W_K.dtype == dtypes.fp8):
            bad.append(f"{name}: ATOM kept no FP8 W_K (another derivation than this check knows)")
            continue
        layer = int(re.search(r"layers\.(\d+)\.", name).group(1))
        w_uk, w_uv = layouts.absorbed_kv_b_of_rank(loaded, loaded.records, layer, shape)
        ours = dict(zip(("W_K", "W_K_scale"), dynamic_per_batched_tensor_quant(
            w_uk.transpose(1, 2).to(torch.bfloat16), dtype=dtypes.fp8)))
        ours.update(zip(("W_V", "W_V_scale"), dynamic_per_batched_tensor_quant(w_uv.to(torch.bfloat16),
                                                                               dtype=dtypes.fp8)))
        for k, t in ours.items():
            got = getattr(module, k)
            if got.shape != t.shape or not torch.equal(_bytes(got), _bytes(t)):
                bad.append(f"{name}.{k}: ATOM's derivation differs from layouts.absorbed_kv_b's")
        checked += 1
    return checked, bad


# ---------------------------------------------------------------------------- one rank
class _Warnings(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def check_rank(case: Case, src: pathlib.Path, out: pathlib.Path, rank: int,
               kernels: types.ModuleType | None = None) -> dict:
    """One rank's row; ``kernels``: aiter's Triton MXFP4 GEMMs where ATOM's MXFP4 ``W_K``/``W_V``
    derivation is to run (:func:`mla_from_mxfp4`), None to skip it in both loads."""
    from atom.model_loader import loading_core

    atoms_coverage = loading_core._report_coverage

    def coverage_on_every_rank(*args, **kw):
        return atoms_coverage(*args, **{**kw, "is_rank0": lambda: True})

    atom_on_cpu.set_tp(rank, case.tp)
    log, caught = logging.getLogger("atom"), _Warnings()
    log.addHandler(caught)
    try:
        # ATOM reads its switches when it uses them; it warns of unloaded parameters on rank 0 only,
        # asked here on every rank (as the converted load's is: atom_post_load)
        with mock.patch.dict(os.environ, PATHS[case.path]), mla_from_mxfp4(kernels), \
                mock.patch.object(loading_core, "_report_coverage", coverage_on_every_rank):
            atom_on_cpu.CALLS.clear()
            ref = [load_reference(src, case, fill) for fill in (0x00, 0xFF)]
            ref_warned = {m for m in caught.messages if NOT_LOADED in m}
            caught.messages.clear()
            target, draft, report = load_converted(src, out, case, rank)
    finally:
        log.removeHandler(caught)
    n, equal, undefined, bad = compare(tensors(*ref[0]), tensors(*ref[1]), tensors(target, draft))
    mla_checked, mla_bad = mla_derivation(target, out, rank, case.tp, kernels is not None)
    bad += mla_bad
    params = sum(1 for m in ref[0] if m is not None for _ in m.named_parameters())
    flags_ref, flags_got = shuffled_flags(*ref[0]), shuffled_flags(target, draft)
    bad += [f"{k}: is_shuffled {flags_ref[k]} in ATOM's load, {flags_got.get(k)} after the adapter"
            for k in flags_ref if flags_ref[k] != flags_got.get(k)]
    return {"config": case.name, "rank": rank, "params": params, "others": n - params, "bytes_equal": equal,
            "uninit": undefined,
            "not_installed": len(report.not_installed),
            # ATOM's NOT-loaded warning: a failure unless its own load of the source gives the very
            # same (GLM-5's draft: shared_head.head, which the drafter then takes from the target)
            "warned": _warned({m for m in caught.messages if NOT_LOADED in m}, ref_warned),
            "ref_warned": bool(ref_warned), "other_warnings": [m for m in caught.messages if NOT_LOADED not in m],
            "mla_checked": mla_checked,
            "stand_ins": sorted(set(atom_on_cpu.CALLS)), "mismatches": bad + [f"not installed: {x}" for x in
                                                                               report.not_installed]}


# ---------------------------------------------------------------------------- main
HEADER = (f"{'config':<34} {'rank':>4} {'params':>6} {'others':>6} {'bytes equal':>11} {'uninit':>6} "
          f"{'not_installed':>13} {'warned':>6} {'mla':>4}")


def _unloaded(messages: set[str]) -> set[str]:
    """The parameter names ATOM's NOT-loaded warnings name (its first 20 per load)."""
    return {n for m in messages for n in ast.literal_eval(m.rpartition("unloaded names: ")[2])}


def _warned(got: set[str], ref: set[str]) -> str:
    """The warned column: "no"; "same" where every parameter the converted load's warning names is
    one ATOM's own load of the source leaves unloaded too (GLM-5's draft: shared_head.head, and the
    embedding the adapter fills, both of which ATOM's drafter then takes from the target); "yes"."""
    return "no" if not got else "same" if _unloaded(got) <= _unloaded(ref) else "yes"


def failed(r: dict) -> bool:
    """Whether a rank's check failed: a byte that differs, a NOT-loaded warning ATOM's own load
    does not give, or a stand-in that skipped work (a computing one runs on both sides alike and
    is said, not a failure)."""
    return bool(r["mismatches"] or r["warned"] == "yes" or stand_ins.skipped(r["stand_ins"]))


def row(r: dict) -> str:
    ok = not failed(r)
    return (f"{r['config']:<34} {r['rank']:>4} {r['params']:>6} {r['others']:>6} {r['bytes_equal']:>11} "
            f"{r['uninit']:>6} {r['not_installed']:>13} {r['warned']:>6} {r['mla_checked']:>4}  "
            f"{'ok' if ok else 'FAIL'}")


def source_specs(preset: str, layers: int | None) -> dict[str, SynthSpec]:
    """The checkpoints to check: each variant at the preset's dims (``layers`` decoder layers),
    and the wide R1-0528 and v2 with the tiny preset."""
    base = PRESETS[preset]
    if layers:
        base = dataclasses.replace(base, num_hidden_layers=layers,
                                   first_k_dense_replace=min(base.first_k_dense_replace, layers))
    specs = {v: dataclasses.replace(base, variant=v) for v in VARIANTS}
    return specs | ({"r1-wide": WIDE, "v2-wide": V2_WIDE} if base == PRESETS["tiny"] else {})


def write_sources(work: pathlib.Path, specs: dict[str, SynthSpec]) -> dict[str, pathlib.Path]:
    """The checkpoints, written once per work folder."""
    sources = {v: work / f"src-{v}" for v in specs}
    for v, path in sources.items():
        if not (path / "config.json").is_file():
            write_checkpoint(specs[v], path)
    return sources


def print_rank(r: dict) -> bool:
    """Print the rank's row and what went wrong; True when it failed."""
    print(row(r), flush=True)
    notes = r["mismatches"][:10] + [f"stand-in called while loading: {s}" for s in stand_ins.skipped(r["stand_ins"])]
    note = stand_ins.computed_note(r["stand_ins"])
    notes += [note] if note else []
    notes += [f"warning: {m[:200]}" for m in r["other_warnings"]]
    notes += ["ATOM's own load of the source warned too"] if r["ref_warned"] else []
    for line in notes:
        print(f"    {line}")
    return failed(r)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--atom-dir", help="extracted ROCm/ATOM tree (default: HEAD of $PREP_ATOM_GIT)")
    ap.add_argument("--aiter-dir", help="extracted ROCm/aiter tree (default: HEAD of $PREP_AITER_GIT)")
    ap.add_argument("--work", help="folder for checkpoints and conversions (default: a temporary one)")
    ap.add_argument("--only", action="append", metavar="TEXT",
                    help="run only the configurations whose name contains this (repeatable: any of them)")
    ap.add_argument("--preset", default="tiny", choices=sorted(PRESETS),
                    help="prep.testing preset of the checkpoints (default tiny; a larger one wants --only)")
    ap.add_argument("--layers", type=int, help="decoder layers of the checkpoints (default: the preset's)")
    ap.add_argument("--aiter-triton-dir",
                    help="folder of the amd-aiter wheel's files, for its Triton MXFP4 GEMMs (default: $PREP_AITER_DIR, "
                         "else .cache/aiter-oracle: python scripts/fetch_aiter_oracle.py)")
    ap.add_argument("--gpu-arch", default=GFX95.example, choices=[a.example for a in PROFILE.gpu_archs],
                    help="the GPU ATOM is told it runs on (default %(default)s)")
    args = ap.parse_args(argv)
    work = pathlib.Path(args.work or tempfile.mkdtemp(prefix="atom-check-"))
    atom_dir = source_tree(args.atom_dir, "PREP_ATOM_GIT", "ROCm/ATOM", work)
    aiter_dir = source_tree(args.aiter_dir, "PREP_AITER_GIT", "ROCm/aiter", work)
    specs = source_specs(args.preset, args.layers)
    data = work / f"{args.preset}-{args.layers or 'all'}"
    sources = write_sources(data, specs)
    kernels = mla_kernels(args.aiter_triton_dir)
    # Convert first: prep runs before ATOM's stand-ins exist (scripts/atom_on_cpu.py).
    cases = [(c, converted(c, sources, data)) for c in default_cases()
             if c.variant in specs and (not args.only or any(t in c.name for t in args.only))]
    atom_on_cpu.install(atom_dir, aiter_dir, args.gpu_arch)
    logging.getLogger("atom").setLevel(logging.WARNING)  # its warnings are what we look for
    if kernels is not None:
        for path in sorted({c.path for c, _ in cases}):
            print(f"kv_b_proj GEMM of ATOM's MXFP4 W_K/W_V derivation on the {path} path: {MLA_GEMM[path]}")
    print(HEADER)
    failed = False
    for case, out in cases:
        if isinstance(out, str):
            print(f"{case.name:<34} refused by prep: {out}")
            continue
        for rank in range(case.tp):
            derive = kernels if mla_gemm_runs(case, specs[case.variant]) else None
            failed |= print_rank(check_rank(case, sources[case.variant], out, rank, derive))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
