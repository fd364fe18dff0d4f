"""vLLM's door: ``vllm serve OUT --load-format prep`` loads each rank's files of a conversion made
with ``prep convert --engine vllm``, through a model loader this module registers with vLLM
(the ``vllm.general_plugins`` entry point ``prep`` calls :func:`register` in every vLLM process).

What the loader does, in vLLM's own order (``BaseModelLoader.load_model``), and why:

1. vLLM builds its model (``create_model``), as for any load.
2. vLLM's ``process_weights_after_loading`` runs on the model as built, with its last step,
   ``finalize_model_weights`` (the MLA ``W_UK_T`` / ``W_UV`` from ``kv_b_proj``), held back.
   vLLM cannot be told its parameters are already processed (``weights_already_processed`` is
   refused by both Quark methods), and processing builds more than bytes: each dense linear's
   GEMM choice, the MoE kernel and its quant config. So it runs on the unwritten parameters, and
   the parameters it leaves have the processed shapes and dtypes; the MoE's byte conversion (the
   shuffle of every expert) is skipped (:func:`_unconverted`), the rest of it runs.
3. The rank's files are copied into those parameters by name: each tensor prep wrote is one vLLM
   holds after processing, so nothing is processed twice. A linear vLLM chose to shuffle (aiter
   has a tuned GEMM for its shape on this GPU: its scale is no longer ``[K/32, N]``), a tensor of
   another shape, and a parameter left unwritten are refused, naming the fix.
4. ``finalize_model_weights`` derives ``W_UK_T`` / ``W_UV`` from the ``kv_b_proj`` just copied in.

What step 2 still does to bytes: the dense linears' scale transpose, on unwritten memory (a
sixteenth of their bytes). The experts, the bulk of the model, are neither shuffled nor copied.
"""

from __future__ import annotations

import os
from typing import Any

LOAD_FORMAT = "prep"

# vLLM's tensors that no checkpoint holds: the MLA scalars it constructs (1.0), and what
# finalize_model_weights derives after the copy.
ENGINE_OWNED = ("._k_scale", "._v_scale", "._q_scale", "._prob_scale", ".W_UK_T", ".W_UV")


class DoorError(RuntimeError):
    """A converted folder this vLLM cannot load as it is (the message names the fix)."""


def register() -> None:
    """The ``vllm.general_plugins`` entry point: ``--load-format prep`` is prep's loader."""
    from vllm.model_executor.model_loader import register_model_loader

    register_model_loader(LOAD_FORMAT)(loader_class())


def loader_class() -> type:
    """vLLM's ``BaseModelLoader`` for converted folders (module docstring); built on first use,
    so that importing :mod:`layouts` never imports vLLM."""
    import torch
    from vllm.model_executor.layers.quantization.quark import quark_moe
    from vllm.model_executor.model_loader import utils as vutils
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader
    from vllm.utils.torch_utils import set_default_torch_dtype

    class PrepModelLoader(BaseModelLoader):
        def download_model(self, model_config) -> None:
            pass  # a converted folder is local

        def load_weights(self, model, model_config) -> None:
            raise DoorError("prep's loader fills a model in load_model; load_weights alone cannot run it")

        def load_model(self, vllm_config, model_config, prefix: str = ""):
            device_config, load_config = vllm_config.device_config, vllm_config.load_config
            target = torch.device(device_config.device if load_config.device is None else load_config.device)
            manifest, rank = checked(model_config.model, vllm_config.parallel_config)  # before building
            with set_default_torch_dtype(model_config.dtype):
                with target:
                    model = self.create_model(vllm_config=vllm_config, model_config=model_config, prefix=prefix)
                finalize, convert = vutils.finalize_model_weights, quark_moe.convert_weight_to_mxfp4_moe_kernel_format
                vutils.finalize_model_weights = lambda *a, **k: None
                quark_moe.convert_weight_to_mxfp4_moe_kernel_format = _unconverted
                try:
                    vutils.process_weights_after_loading(model, model_config, target)
                finally:
                    vutils.finalize_model_weights = finalize
                    quark_moe.convert_weight_to_mxfp4_moe_kernel_format = convert
                install(model, model_config.model, manifest, rank)
                finalize(model, target)
            return model.eval()

    return PrepModelLoader


def _unconverted(mxfp4_backend: Any, layer: Any, w13_weight: Any, w2_weight: Any, w13_weight_scale: Any,
                 w2_weight_scale: Any, w13_bias: Any = None, w2_bias: Any = None, **_: Any) -> tuple:
    """vLLM's ``convert_weight_to_mxfp4_moe_kernel_format`` for aiter's CK MoE without its byte work:
    the same tensors in the same shapes, dtype (``float4_e2m1fn_x2``) and ``is_shuffled`` mark, not
    shuffled, because the rank's files hold them shuffled already and are copied in next. So the MoE
    is not shuffled at load (the time and memory of a copy of every expert). Any other MoE back end
    reads another layout than ``ck-3d``: refused."""
    import torch
    from vllm.model_executor.layers.fused_moe.oracle.mxfp4 import Mxfp4MoeBackend

    if mxfp4_backend != Mxfp4MoeBackend.AITER_MXFP4_MXFP4:
        raise DoorError(f"vLLM runs the MoE {getattr(layer, 'layer_name', '')} on {mxfp4_backend.name}, which reads "
                        "another layout than prep's ck-3d; serve with VLLM_ROCM_USE_AITER=1 on MI355 (gfx950)")
    fp4 = getattr(torch, "float4_e2m1fn_x2", None)
    w13, w2 = (w.data.view(fp4) if fp4 is not None else w.data for w in (w13_weight, w2_weight))
    w13.is_shuffled = w2.is_shuffled = True  # what the converted tensors carry
    bias = [None if b is None else b.data.to(torch.float32) for b in (w13_bias, w2_bias)]
    return w13, w2, w13_weight_scale.data, w2_weight_scale.data, *bias


def checked(folder: str, parallel_config: Any) -> tuple[Any, int]:
    """``(manifest, rank)``: the converted ``folder``'s manifest checked against vLLM's TP and EP
    sizes, this process's rank and vLLM's switches (:class:`DoorError` naming the fix), before
    vLLM allocates its model."""
    from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

    from ... import CompatibilityError, EngineConfig, ManifestError, check_compatibility, load_manifest

    tp, rank = get_tensor_model_parallel_world_size(), get_tensor_model_parallel_rank()
    ep = tp if getattr(parallel_config, "enable_expert_parallel", False) else 1
    try:
        engine = EngineConfig.from_env(tp_size=tp, rank=rank, ep_size=ep, env=os.environ, engine="vllm")
        manifest = load_manifest(folder)
        check_compatibility(manifest, engine)
    except (CompatibilityError, ManifestError) as e:  # their messages name the folder
        raise DoorError(str(e)) from None
    return manifest, rank


def install(model: Any, folder: str, manifest: Any, rank: int) -> list[str]:
    """Copy rank ``rank``'s tensors of the converted ``folder`` (its checked ``manifest``) into
    ``model``'s processed parameters (module docstring, step 3); returns the names written."""
    from ... import iter_rank_files

    params = model.state_dict(keep_vars=True)
    written, seen = [], set()
    for part in iter_rank_files(folder, rank, "cpu", manifest=manifest):
        for name, t in part.items():
            p = params.get(name)
            if p is None:
                raise DoorError(f"{folder}: {name} is not a tensor of vLLM's model; convert again with this prep "
                                "for this vLLM (--engine vllm)")
            _copy_into(p.data, t, name, folder)
            written.append(name)
            seen.add(p.data.untyped_storage().data_ptr())
    left = [n for n, p in params.items() if p.data.untyped_storage().data_ptr() not in seen
            and not n.endswith(ENGINE_OWNED)]
    if left:
        raise DoorError(f"{folder}: rank {rank}'s files hold no {left[0]} (and {len(left) - 1} more of vLLM's model); "
                        "it would run with unwritten memory: convert again with --engine vllm")
    return written


def _copy_into(dst: Any, t: Any, name: str, folder: str) -> None:
    """``t`` into vLLM's parameter ``dst``: floating point cast as vLLM's own loading casts (the
    router bias F32 -> BF16); MXFP4 bytes as they are (vLLM views them as ``float4_e2m1fn_x2``)."""
    import torch

    if tuple(dst.shape) != tuple(t.shape):
        hint = (" (vLLM shuffles this linear on this GPU: aiter has a tuned GEMM for its shape, so vLLM holds "
                "its scale [N, K/32] and the weight W16, which prep does not write yet; serve without the tuned "
                "config for it or convert for another engine)" if name.endswith(".weight_scale") and dst.dim() == 2
                and tuple(dst.shape) == tuple(reversed(t.shape)) else "")
        raise DoorError(f"{folder}: {name} is {list(t.shape)} but vLLM holds {list(dst.shape)}{hint}")
    if dst.is_floating_point() and t.is_floating_point() and dst.element_size() > 1:
        dst.copy_(t)
    elif dst.element_size() == t.element_size():
        dst.view(torch.uint8).copy_(t.view(torch.uint8))
    else:
        raise DoorError(f"{folder}: {name} is {t.dtype} but vLLM holds {dst.dtype}; convert again with --engine vllm")
