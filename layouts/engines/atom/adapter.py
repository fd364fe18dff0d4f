"""ATOM's adapter: installs one rank of a converted checkpoint into ATOM's DeepSeek model and its
MTP draft model, in place of the reading step of ATOM's ``load_model``.

The adapter (:func:`install_converted_weights`). ATOM's loader (``atom/model_loader/loader.py``)
copies every checkpoint tensor into the parameters its layers created, then calls each module's
``process_weights_after_loading`` (and its ``quant_method``'s): for MXFP4 that is
``shuffle_weights`` + ``e8m0_shuffle`` on every dense linear, ``moe_shuffle_weight`` /
``moe_shuffle_scale`` (2-D scales) or ``_swizzle_mxfp4`` on every MoE layer. ATOM has no hook to
skip that, and ``is_shuffled`` is only ever written. So:

1. :func:`install_converted_weights` checks the checkpoint against the engine configuration
   (:func:`layouts.check_compatibility`), reads this rank a file at a time
   (:func:`layouts.iter_rank_files`), and copies every MXFP4 tensor into the parameter of the same
   name (a scale the layout pads past ATOM's allocation, S32x8 or a 2-D CK MoE scale, becomes the
   parameter's data instead), sets the attributes the manifest states
   (``is_shuffled`` on the weight, ``hidden_pad`` / ``intermediate_pad`` on the MoE method,
   which ATOM passes to ``fused_moe``), and makes that module's processing a no-op;
2. a rank-exact checkpoint (manifest format 2, ``docs/rank-exact.md``) holds the rank's BF16
   tensors already split and merged as ATOM's layer classes hold them: each is installed into its
   parameter too (the F32 router bias cast to ATOM's BF16), so nothing is left for ATOM's loader
   and ``AtomInstallReport.not_installed`` lists any parameter still unfilled. BF16 linears need
   no processing; BF16 experts (the R1-0528 MTP layer) are stored in ``bf16-preshuffle``, the
   layout ATOM's ``shuffle_weights`` would give them, so their module's processing is made a no-op
   as for MXFP4 (experts stored without a layout keep ATOM's own processing). Of a format-1
   checkpoint the pass-through (BF16) tensors are whole and come back in
   ``AtomInstallReport.passthrough`` for ATOM's own loader to slice;
3. the MTP layer (``model.layers.{num_hidden_layers + i}``, ``i < num_nextn_predict_layers``) is
   not in ATOM's ``DeepseekV2ForCausalLM``: ATOM builds it only in its separate draft model
   (``DeepSeekMTP``). Its tensors are installed into that draft model when one is passed
   (``mtp_model=``), under the draft's parameter names (:func:`atom_mtp_param_name`), else named
   in ``AtomInstallReport.mtp_pending`` for :func:`install_draft_weights`, which reads them again
   once ATOM has built its draft model.

Call it after the model (and draft model) is built and instead of the reading step of ATOM's
``load_model``; ATOM's post-loading loop (``process_weights_after_loading`` of every module)
still runs, and does nothing to the modules made no-ops here. What is exercised without ROCm:
the name and shape contract against models built as ATOM's ``create_weights`` builds them
(tests/test_atom_adapter.py), and ATOM's real DeepSeek and MTP models, built and post-processed
by ATOM's own code on the CPU, compared byte for byte with ATOM's own load of the source, every
rank of each conversion it makes (``python -m harness check-engine atom``, with ``--serve`` the
Triton MoE included: :func:`_hold_as_triton_moe`; docs/engines.md). What is not: aiter's kernels on
the installed bytes.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Any

import torch

from .._compat import EngineConfig, check_compatibility
from ...errors import LayoutsError
from ...families import language_config
from ...loader import iter_rank_files
from ...manifest import Manifest, ManifestError, TensorRecord, load_manifest
from ...registry import FP8, MOE_CK, MOE_TRITON, MOE_TRITON_GFX942, Layout, get_layout
from .._sharding import layer_index


# ---------------------------------------------------------------------------- the adapter
@dataclasses.dataclass
class AtomInstallReport:
    """What :func:`install_converted_weights` did, for the engine's log.

    Names in ``skipped_processing`` are those of the model the
    tensor went into; the draft model's carry ``.mtp_block.`` (or are its layer's own), so the
    two never collide."""

    installed: list[str]  # main-model parameter names whose data now holds the converted tensor
    skipped_processing: list[str]  # modules whose process_weights_after_loading is now a no-op
    passthrough: dict[str, torch.Tensor]  # format 1: whole BF16 tensors for ATOM's own weight loader (main model)
    manifest: Manifest | None = None  # the checkpoint's, and the rank installed (install_draft_weights reads them)
    rank: int = 0
    records: dict[str, TensorRecord] = dataclasses.field(default_factory=dict)  # the rank's tensors read, by name
    # Format 1: the MTP layer's whole BF16 tensors, by checkpoint name (``model.layers.{N}.…``), for
    # ATOM's draft loader, which takes these names as they are (its ``remap_mtp_weight_name``).
    mtp: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    # The MTP layer's tensors set aside without ``mtp_model``, by checkpoint name, for
    # install_draft_weights (read again from the files then: nothing is held meanwhile).
    mtp_pending: list[str] = dataclasses.field(default_factory=list)
    mtp_installed: list[str] = dataclasses.field(default_factory=list)  # draft-model parameter names filled
    # Rank-exact: parameters of the models ("main:…", "draft:…") the checkpoint did not fill; ATOM's
    # loader would warn that they were NOT loaded. Empty when the model is the converted one.
    not_installed: list[str] = dataclasses.field(default_factory=list)


def _processing_done(layer: torch.nn.Module) -> None:
    """Stands in for ``process_weights_after_loading``: the converted bytes are final."""
    return None


def _as_param_dtype(t: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """Our uint8 bytes seen as the parameter's dtype (ATOM allocates fp4x2 / e8m0 / uint8)."""
    if param.dtype == t.dtype:
        return t
    if param.dtype.itemsize != 1:
        raise ManifestError(f"parameter dtype {param.dtype} cannot hold MXFP4 bytes")
    return t.view(param.dtype)


# ---------------------------------------------------------------------------- the MTP layer
# ATOM's draft model, from ROCm/ATOM atom/models/deepseek_mtp.py at commit ffdf3bb5:
# DeepSeekMTP.model is a DeepSeekMultiTokenPredictor whose ``layers`` is a ModuleDict keyed by the
# checkpoint's own layer index (``range(num_hidden_layers, num_hidden_layers + num_nextn_predict_layers)``),
# so the draft keeps ``model.layers.{N}.``. Each layer (DeepSeekMultiTokenPredictorLayer) holds
# enorm, hnorm, eh_proj and shared_head itself and its decoder layer as ``mtp_block``; ATOM's loader
# (spec_decode) renames checkpoint names with remap_mtp_weight_name -> rewrite_spec_layer_name:
# decoder-layer tensors gain ``.mtp_block.``, the layer's own keep their name, and embed_tokens,
# shared with the target, moves to the top (``model.embed_tokens``). The main model
# (DeepseekV2Model, atom/models/deepseek_v2.py) makes only num_hidden_layers layers and its loader
# drops names past them (CheckpointNameRewriter._is_past_last_layer, atom/model_loader/weight_names.py).
_MTP_LAYER_OWN = ("embed_tokens", "enorm", "hnorm", "eh_proj", "shared_head")  # ATOM's spec_layer_weight_names
_MTP_SHARED = ("embed_tokens",)  # ATOM's shared_weight_names
_TARGET_EMBED = "model.embed_tokens.weight"
_DRAFT_SHARED_IF_ABSENT = ("shared_head.head.weight",)  # the drafter takes the target's lm_head instead


def atom_mtp_param_name(name: str, layer: int) -> str:
    """The parameter of ATOM's ``DeepSeekMTP`` that checkpoint tensor ``name`` of MTP layer
    ``layer`` fills: ATOM's ``rewrite_spec_layer_name``, substring tests included."""
    prefix = f"model.layers.{layer}."
    own = next((w for w in _MTP_LAYER_OWN if w in name), None)
    if own is None:
        return name.replace(prefix, f"{prefix}mtp_block.")
    return name.replace(prefix, "model.") if own in _MTP_SHARED else name


def mtp_layers(root: pathlib.Path) -> range:
    """The MTP layers' indices, from the config.json the conversion copied next to its files
    (the manifest does not hold the model's shape). ATOM builds its models from that file too."""
    path = root / "config.json"
    try:
        cfg = language_config(json.loads(path.read_text()))
        start = cfg["num_hidden_layers"]
        count = cfg.get("num_nextn_predict_layers") or 0
        if type(start) is not int or type(count) is not int or start < 1 or count < 0:
            raise ValueError(f"num_hidden_layers {start!r}, num_nextn_predict_layers {count!r}: not counts")
    except (OSError, ValueError, KeyError, TypeError, AttributeError, LayoutsError) as e:
        raise ManifestError(f"{path}: cannot read num_hidden_layers and num_nextn_predict_layers as counts ({e}); "
                            "they tell the main model's layers from the MTP layer: copy the source's config.json "
                            "there or convert again") from None
    return range(start, start + count)


# ---------------------------------------------------------------------------- installing
def _put(param: torch.nn.Parameter, t: torch.Tensor) -> None:
    """``t`` into ``param``: copied into ATOM's own allocation where the shapes agree, so the
    weights are never on the device twice (the file's buffer goes once its tensors are copied);
    else (a scale padded past ATOM's allocation, a CK MoE scale made 2-D) as a copy of its own."""
    if tuple(param.shape) == tuple(t.shape):
        if param.dtype.itemsize == 1 and t.dtype.itemsize == 1:  # MXFP4 / E8M0 bytes: ATOM's fp4x2, e8m0, uint8
            param.data.view(torch.uint8).copy_(t.view(torch.uint8))
        else:  # BF16 as stored; the F32 router bias into ATOM's BF16 parameter
            param.data.copy_(t)
    elif param.dtype != t.dtype and param.dtype.is_floating_point and t.dtype.is_floating_point and \
            param.dtype.itemsize != t.dtype.itemsize:  # a padded BF16 scale into ATOM's F32, as its loader casts
        param.data = t.to(param.device, param.dtype, copy=True)
    else:
        param.data = _as_param_dtype(t, param).to(param.device, copy=True)


class _Installer:
    """Puts checkpoint tensors into one model's parameters (:func:`_put`), sets the attributes the
    manifest states, and at :meth:`finish` makes the processing of the modules it filled a no-op."""

    def __init__(self, model: torch.nn.Module, report: AtomInstallReport, which: str):
        self.params = dict(model.named_parameters())
        self.modules = dict(model.named_modules())
        self.report, self.which = report, which
        self.what = "model" if which == "main" else f"{which} model"
        self.installed: list[str] = []
        self.groups: dict[str, dict[str, Any]] = {}
        self.triton_moe: dict[str, Layout] = {}  # MoE modules ATOM runs on its Triton MoE: their layout
        self.fp8: set[str] = set()  # modules whose FP8 weights the files hold as ATOM holds them once loaded

    def put(self, ckpt_name: str, name: str, t: torch.Tensor, rec: TensorRecord) -> None:
        param = self.params.get(name)
        shown = ckpt_name if name == ckpt_name else f"{ckpt_name} (ATOM's {self.which} parameter {name})"
        if param is None:
            raise ManifestError(f"{shown}: the checkpoint has it but the {self.what} has no such parameter; "
                                f"is this ATOM's {'DeepSeekMTP' if self.which == 'draft' else 'DeepSeek model'} "
                                "with the same --tp/--ep?")
        # Scales may be padded past ATOM's allocation; every other tensor is exactly the parameter,
        # up to dims of 1: a whole per-channel scale [N] goes into ATOM's [N, 1], as ATOM's loader
        # reshapes it (atom/model_ops/linear.py weight_loader_process; a row-parallel layer's).
        if rec.layout is None and tuple(param.shape) != tuple(t.shape) \
                and [d for d in param.shape if d != 1] == [d for d in t.shape if d != 1]:
            t = t.reshape(param.shape)
        layout = get_layout(rec.layout) if rec.layout else None
        # ATOM pads an FP8 per-channel linear's rows (weight and scale) to 128 as it processes it: the
        # files hold them padded, in place of the parameter ATOM allocated unpadded
        padded = layout is not None and layout.kind == FP8 and tuple(param.shape[1:]) == tuple(t.shape[1:]) \
            and t.shape[0] > param.shape[0]
        if rec.role != "e8m0_scale" and tuple(param.shape) != tuple(t.shape) and not padded:
            raise ManifestError(f"{shown}: the {self.what} allocates {list(param.shape)} but the checkpoint holds "
                                f"{list(t.shape)}; the model config differs from the converted one")
        if param.dtype.itemsize != t.dtype.itemsize and not (param.dtype.is_floating_point and t.dtype.is_floating_point):
            raise ManifestError(f"{shown}: the {self.what} allocates {param.dtype}, which cannot hold the "
                                f"checkpoint's {t.dtype}")
        rows = param.shape[0]
        _put(param, t)
        self.installed.append(name)
        if padded and t.dtype.itemsize == 1:  # the weight: what ATOM's padding leaves on the module
            module = self.modules[name.rpartition(".")[0]]
            module.is_output_padded, module._output_size_before_padding = True, rows
        if rec.layout is None:  # source bytes, already split: ATOM's own processing still runs on them
            return
        # is_shuffled goes on weights only, as ATOM sets it (ROCm/ATOM ffdf3bb5 atom/model_ops/utils.py:168
        # shuffle_weights; moe.py:1297-1298 w13_weight/w2_weight) and as its readers look for it (aiter
        # e4048607 aiter/ops/moe_op.py:626 reads w1; ATOM's attention_mla.py:876 kv_b_proj.weight).
        for k, v in rec.runtime_attrs.items():
            if k != "is_shuffled" or rec.role != "e8m0_scale":
                setattr(param, k, v)
        self.groups.setdefault(name.rpartition(".")[0], {}).update(
            {k: v for k, v in rec.runtime_attrs.items() if k in ("hidden_pad", "intermediate_pad")})
        if layout in TRITON_MOE_LAYOUTS:
            self.triton_moe[name.rpartition(".")[0]] = layout
        if layout.kind == FP8:
            self.fp8.add(name.rpartition(".")[0])

    def finish(self, exact: bool) -> list[str]:
        """Skip the filled modules' processing; on a rank-exact checkpoint, report what is unfilled."""
        for module_name, method_attrs in self.groups.items():
            if module_name in self.triton_moe:
                _hold_as_triton_moe(self.modules[module_name], module_name, self.triton_moe[module_name])
            if module_name in self.fp8:
                _fnuz_as_atom_does(self.modules[module_name])
            _skip_processing(self.modules[module_name], module_name, method_attrs)
            self.report.skipped_processing.append(module_name)
        if exact:
            filled = set(self.installed)
            # A draft whose checkpoint has no shared_head.head gets the target's lm_head from ATOM's
            # drafter, which shares it exactly when the name is missing from the load's record
            # (atom/spec_decode/drafter.py, Drafter.load_model: _share_if_not_loaded).
            shared = _DRAFT_SHARED_IF_ABSENT if self.which == "draft" else ()
            self.report.not_installed += [f"{self.which}:{n}" for n in self.params
                                          if n not in filled and not n.endswith(shared)]
        return self.installed


# ---------------------------------------------------------------------------- ATOM's Triton MoE
# What ATOM's Triton MoE leaves on its FusedMoE after loading (ROCm/ATOM ffdf3bb5 atom/model_ops/moe.py
# Mxfp4MoEMethod._process_weight_layout_after_loading, fused_moe_triton.py _swizzle_mxfp4): a raw copy of
# the shared expert's slots for its dense GEMM (shared_w13_weight, ... their scales raw), w13/w2 replaced by
# their transposed uint8 views, each scale by the transposed view of aiter's shuffle_scale_moe of it where
# the shapes allow (N % 32 == 0 and K % 256 == 0; gfx950: CDNA4_SCALE, the per-expert S32x8 the "triton"
# layout stores; gfx942 keeps it raw) and the label it returns, None otherwise. The files hold those bytes:
# here they are only viewed so, and the shared expert's scale (a few KB) read back raw.
TRITON_MOE_LAYOUTS = (MOE_TRITON, MOE_TRITON_GFX942)


def _triton_label(module_name: str, proj: str, w: torch.Tensor, layout: Layout) -> str | None:
    """The swizzle label ATOM gives ``proj``'s scale, checking that ATOM shuffles it where the
    checkpoint holds it shuffled (its condition on the raw weight ``w``, [E, N, K/2])."""
    n, k = w.shape[-2], w.shape[-1] * 2
    label = layout.runtime_attrs.get("scale_swizzle")
    if label is not None and (n % 32 or k % 256):
        raise ManifestError(f"{module_name}.{proj}_weight_scale: ATOM keeps a [{n}, {k // 32}] expert scale raw "
                            f"(its shuffle needs N % 32 == 0 and K % 256 == 0), but the checkpoint holds it in "
                            f"{layout.name}; convert with --moe-layout {MOE_CK.name} and serve the CK MoE")
    return label


def _hold_as_triton_moe(module: torch.nn.Module, module_name: str, layout: Layout) -> None:
    """Leave ``module`` (ATOM's FusedMoE, its files' bytes installed) as ATOM's Triton MoE leaves it
    after loading (the comment above). Only the shared expert's slots are read back raw."""
    held = {}
    for proj in ("w13", "w2"):
        w = getattr(module, f"{proj}_weight").data.view(torch.uint8)
        held[proj] = (w, getattr(module, f"{proj}_weight_scale").data, _triton_label(module_name, proj, w, layout))
    n_shared = int(getattr(module, "num_fused_shared_experts", 0) or 0)
    if n_shared > 0:
        for proj, (w, s, label) in held.items():
            tail = s[-n_shared:]
            raw = tail if label is None else layout.scale.inverse(tail, (n_shared, w.shape[-2], w.shape[-1] * 2 // 32))
            setattr(module, f"shared_{proj}_weight", w[-n_shared:].contiguous())
            setattr(module, f"shared_{proj}_weight_scale", raw.contiguous())
            bias = getattr(module, f"{proj}_bias", None)
            setattr(module, f"shared_{proj}_bias", None if bias is None else bias.data[-n_shared:].contiguous())
    for proj, (w, s, label) in held.items():
        delattr(module, f"{proj}_weight")
        delattr(module, f"{proj}_weight_scale")
        setattr(module, f"{proj}_weight", w.transpose(-2, -1))
        setattr(module, f"{proj}_weight_scale", s.transpose(-1, -2))
        setattr(module, f"{proj}_swizzle_layout", label)


def _fnuz_as_atom_does(module: torch.nn.Module) -> None:
    """What ATOM's processing of FP8 weights does on gfx942, where it allocates them e4m3fnuz (the
    processing skipped, the door does it): e4m3fn's -0 (0x80, NaN in e4m3fnuz) becomes 0 and each
    scale is doubled, the same bits being half the value in e4m3fnuz (ROCm/ATOM ffdf3bb5
    atom/model_ops/utils.py normalize_e4m3fn_to_e4m3fnuz, from linear.py:821-824 and moe.py:2354).
    A byte per value, so it commutes with the shuffle the files hold. Nothing on gfx950 (e4m3fn)."""
    for weight in ("weight", "w13_weight", "w2_weight"):
        w = getattr(module, weight, None)
        if w is None or w.dtype != torch.float8_e4m3fnuz:
            continue
        fnuz_zero_in_place(w.data)
        scale = getattr(module, f"{weight}_scale")
        doubled = scale.data * 2.0
        if getattr(module, "is_output_padded", False):  # ATOM doubles before it pads: its pad rows stay 1.0
            doubled[module._output_size_before_padding:] = scale.data[module._output_size_before_padding:]
        scale.data = doubled


def fnuz_zero_in_place(w: torch.Tensor, block_bytes: int = 64 << 20) -> None:
    """e4m3fn's -0 (byte 0x80) set to 0 in ``w`` (one byte per value), in place, a block of
    leading rows at a time: ATOM's ``weight[weight == -128] = 0`` makes a mask the size of the
    weight, 1.4 GB for one layer's experts of R1 on a TP 8 rank, while this holds 64 MiB at most."""
    codes = w.view(torch.int8).reshape(-1, w.shape[-1]) if w.dim() > 1 else w.view(torch.int8).reshape(1, -1)
    step = max(1, block_bytes // max(1, codes.shape[1]))
    for r0 in range(0, codes.shape[0], step):
        block = codes[r0:r0 + step]
        block.masked_fill_(block == -128, 0)


def _skip_processing(module: torch.nn.Module, module_name: str, method_attrs: dict[str, Any]) -> None:
    method = getattr(module, "quant_method", None)
    if method is not None and hasattr(method, "process_weights_after_loading"):
        for k, v in method_attrs.items():  # ATOM computes these from the config: they must agree
            have = getattr(method, k, v)
            if have != v:
                raise ManifestError(f"{module_name}: ATOM's MoE method has {k}={have} but the checkpoint was padded "
                                    f"with {k}={v}; convert with the same hidden/intermediate padding")
        # Patch this instance (ATOM makes one quant method per layer) rather than wrap it:
        # ATOM dispatches on isinstance(layer.quant_method, ...), which a proxy would break.
        method.process_weights_after_loading = _processing_done
    if hasattr(module, "process_weights_after_loading"):
        module.process_weights_after_loading = lambda: None  # this instance only


def _device_of(model: torch.nn.Module) -> torch.device:
    first = next(iter(model.parameters()), None)
    return first.device if first is not None else torch.device("cpu")


def install_converted_weights(model: torch.nn.Module, model_dir: str | pathlib.Path, engine: EngineConfig,
                              device: str | torch.device | None = None,
                              mtp_model: torch.nn.Module | None = None, *,
                              manifest: Manifest | None = None) -> AtomInstallReport:
    """Install rank ``engine.rank``'s converted tensors into ``model`` (ATOM's DeepSeek), and the
    MTP layer's into ``mtp_model`` (ATOM's ``DeepSeekMTP`` draft) when given; without it the MTP
    layer's tensors are named in the report's ``mtp_pending`` for :func:`install_draft_weights`
    (ATOM builds and loads its draft model after the target).

    The rank's files are read one at a time (to ``device``, default the model's) and each tensor
    copied into the parameter ATOM allocated for it, so a rank's weights are on the device once
    plus one file (about 4 GiB), not twice; a scale padded past ATOM's allocation gets a copy of
    its own. A rank-exact checkpoint (manifest format 2) holds every tensor of the rank already
    split as ATOM holds it: all of them are installed, BF16 included, and nothing is left for
    ATOM's loader (``report.not_installed`` names any parameter of the model still unfilled). The
    draft's ``model.embed_tokens`` gets the rank's target embedding, which is what ATOM's drafter
    puts there after loading. Of a format-1 checkpoint the MXFP4 tensors are installed and the
    pass-through ones (whole, for every rank) come back in ``report.passthrough`` (and, of the
    MTP layer, ``report.mtp``) for ATOM's loaders to slice.

    ``manifest``: the folder's, where the caller read it already (the loads check that it is).

    Raises :class:`~layouts.CompatibilityError` when the engine would misread the checkpoint,
    and :class:`~layouts.ManifestError` naming the tensor when the model has no parameter for
    it or its shape is not the one ATOM allocates before processing."""
    manifest = manifest or load_manifest(model_dir)
    check_compatibility(manifest, engine)
    layers = mtp_layers(manifest.root)
    device = torch.device(device) if device is not None else _device_of(model)
    exact = manifest.target.rank_exact
    report = AtomInstallReport([], [], {}, manifest=manifest, rank=engine.rank)
    # ATOM's model of a multimodal checkpoint (kimi_k25.py) holds the language model as
    # ``language_model``, so its parameters have the source's names; prep's files the family's
    held = manifest.source.source_name if manifest.source is not None else str
    main = _Installer(model, report, "main")
    draft = _Installer(mtp_model, report, "draft") if mtp_model is not None else None
    for part in iter_rank_files(manifest.root, engine.rank, device, manifest=manifest):
        for name, t in part.items():
            rec = report.records[name] = part.records[name]
            layer = layer_index(name)
            whole = rec.role == "passthrough" and not exact  # format 1: ATOM's loader slices it
            if layer is not None and layer in layers:  # ATOM's main model has no MTP layer: the draft takes it
                if whole:
                    report.mtp[name] = t
                elif draft is not None:
                    draft.put(name, atom_mtp_param_name(name, layer), t, rec)
                else:
                    report.mtp_pending.append(name)
            elif whole:
                report.passthrough[held(name)] = t
            else:
                main.put(name, held(name), t, rec)
                if exact and draft is not None and name == _TARGET_EMBED:
                    draft.put(name, _TARGET_EMBED, t, rec)  # ATOM's drafter shares the target's embedding
        del part  # its file's buffer goes here, unless a format-1 pass-through tensor still views it
    report.installed = main.finish(exact)
    if draft is not None:
        report.mtp_installed = draft.finish(exact)
    return report


def install_draft_weights(mtp_model: torch.nn.Module, report: AtomInstallReport) -> list[str]:
    """Install the MTP layer's tensors that :func:`install_converted_weights` set aside
    (``report.mtp_pending``) into ATOM's draft model (``DeepSeekMTP``), under the draft's
    parameter names (:func:`atom_mtp_param_name`), and, of a rank-exact checkpoint, the rank's
    target embedding into the draft's ``model.embed_tokens`` (what ATOM's drafter shares after
    loading). They are read again from the rank's files, mapped on the host and copied tensor by
    tensor to the draft's parameters: one layer's bytes, from files that hold mostly others.
    Returns the draft parameter names filled (also in ``report.mtp_installed``)."""
    if report.manifest is None:
        raise ValueError("install_draft_weights needs the report of install_converted_weights on the same rank")
    exact = report.manifest.target.rank_exact
    names = set(report.mtp_pending) | ({_TARGET_EMBED} if exact and _TARGET_EMBED in report.records else set())
    draft = _Installer(mtp_model, report, "draft")
    for part in iter_rank_files(report.manifest.root, report.rank, "cpu", manifest=report.manifest, names=names):
        for name, t in part.items():
            target = _TARGET_EMBED if name == _TARGET_EMBED else atom_mtp_param_name(name, layer_index(name))
            draft.put(name, target, t, part.records[name])
    report.mtp_pending = []
    report.mtp_installed = draft.finish(exact)
    return report.mtp_installed
