"""ROCm ATOM adapter: put a converted checkpoint's MXFP4 tensors straight into ATOM's DeepSeek
model and skip the load-time processing they have already had.

ATOM's loader (``atom/model_loader/loader.py``) copies every checkpoint tensor into the
parameters its layers created, then calls each module's ``process_weights_after_loading`` (and
its ``quant_method``'s): for MXFP4 that is ``shuffle_weights`` + ``e8m0_shuffle`` on every dense
linear, ``moe_shuffle_weight`` / ``moe_shuffle_scale`` (2-D scales) or ``_swizzle_mxfp4`` on
every MoE layer. ATOM has no hook to skip that, and ``is_shuffled`` is only ever written. So:

1. :func:`install_converted_weights` checks the checkpoint against the engine configuration
   (:func:`layouts.check_compatibility`), loads this rank (:func:`layouts.load_rank`), and for
   every MXFP4 tensor replaces the data of the parameter of the same name (shapes differ where
   the layout pads: S32x8 scales, 2-D CK MoE scales), sets the attributes the manifest states
   (``is_shuffled`` on the weight, ``hidden_pad`` / ``intermediate_pad`` on the MoE method,
   which ATOM passes to ``fused_moe``), and makes that module's processing a no-op;
2. it returns the pass-through (BF16) tensors, which ATOM's own weight loader takes as usual
   (norms, embeddings, router, and attention where the checkpoint keeps it BF16).

Call it after the model is built and before (instead of) ATOM's ``load_model`` for the MXFP4
tensors. What is exercised here, without ROCm: the name and shape contract against a model
built as ATOM's ``create_weights`` builds it (tests/test_atom_adapter.py). What is not: ATOM
itself, aiter's kernels on the installed bytes, and the Triton MoE path, whose ``_swizzle_mxfp4``
wraps the scales in triton_kernels layout objects that ATOM must still construct from the
``CDNA4_SCALE`` tensors handed over (reported in ``AtomInstallReport.needs_engine_wrapping``).
"""

from __future__ import annotations

import dataclasses
import pathlib
from typing import Any

import torch

from .compat import EngineConfig, check_compatibility
from .loader import RankTensors, load_rank
from .manifest import ManifestError, load_manifest


@dataclasses.dataclass
class AtomInstallReport:
    """What :func:`install_converted_weights` did, for the engine's log."""

    installed: list[str]  # parameter names whose data now holds the converted tensor
    skipped_processing: list[str]  # modules whose process_weights_after_loading is now a no-op
    passthrough: dict[str, torch.Tensor]  # BF16 tensors for ATOM's own weight loader
    needs_engine_wrapping: list[str]  # Triton MoE scales ATOM still wraps in its layout objects
    rank_tensors: RankTensors | None = None


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


def install_converted_weights(model: torch.nn.Module, model_dir: str | pathlib.Path, engine: EngineConfig,
                              device: str | torch.device | None = None) -> AtomInstallReport:
    """Install rank ``engine.rank``'s converted MXFP4 tensors into ``model`` (ATOM's DeepSeek).

    Raises :class:`~layouts.CompatibilityError` when the engine would misread the checkpoint,
    and :class:`~layouts.ManifestError` naming the tensor when the model has no parameter for
    it or its shape is not the one ATOM allocates before processing."""
    manifest = load_manifest(model_dir)
    check_compatibility(manifest, engine)
    params = dict(model.named_parameters())
    modules = dict(model.named_modules())
    if device is None:
        device = next(iter(params.values())).device if params else "cpu"
    tensors = load_rank(model_dir, engine.rank, device, manifest=manifest)
    report = AtomInstallReport([], [], {}, [], tensors)
    groups: dict[str, dict[str, Any]] = {}
    for name, t in tensors.items():
        rec = tensors.records[name]
        if rec.role == "passthrough":
            report.passthrough[name] = t
            continue
        param = params.get(name)
        if param is None:
            raise ManifestError(f"{name}: the checkpoint has it but the model has no such parameter; "
                                "is this ATOM's DeepSeek model with the same --tp/--ep?")
        module_name, _, leaf = name.rpartition(".")
        if rec.role == "mxfp4_weight" and tuple(param.shape) != tuple(t.shape):
            raise ManifestError(f"{name}: the model allocates {list(param.shape)} but the checkpoint holds "
                                f"{list(t.shape)}; the model config differs from the converted one")
        param.data = _as_param_dtype(t, param)
        for k, v in rec.runtime_attrs.items():
            setattr(param, k, v)
        report.installed.append(name)
        groups.setdefault(module_name, {}).update(
            {k: v for k, v in rec.runtime_attrs.items() if k in ("hidden_pad", "intermediate_pad")})
        if rec.runtime_attrs.get("scale_swizzle"):
            report.needs_engine_wrapping.append(name)
    for module_name, method_attrs in groups.items():
        module = modules[module_name]
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
        report.skipped_processing.append(module_name)
    return report
