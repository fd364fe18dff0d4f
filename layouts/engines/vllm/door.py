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
   holds after processing, so nothing is processed twice, except a dense linear vLLM runs on
   aiter's ASM FP4 GEMM (where the aiter installed has a tuned GEMM for its shape on this GPU,
   which prep cannot know when converting): its bytes are laid out from ``non-shuffle-t`` into
   ``preshuffle-unpadded`` on the way (:func:`_as_asm_gemm_holds`, exact), and an FP8
   per-channel weight, written as the source's bytes: copied into the memory of vLLM's
   transposed view, or shuffled (16, 16) on the way where vLLM runs it on aiter's preshuffled
   FP8 GEMM (:func:`_as_shuffled_fp8_gemm_holds`). A name vLLM's model lacks, a tensor of another
   shape and a parameter left unwritten are refused, naming the fix.
4. ``finalize_model_weights`` derives ``W_UK_T`` / ``W_UV`` from the ``kv_b_proj`` just copied in.

The MTP draft (``--speculative-config '{"method": "mtp", ...}'``) is a second model vLLM loads
through the same loader from the same folder, after the main one (its ``model_config`` is the
draft's: ``runner_type`` "draft"). Each load takes its own part of the rank's files: the main
model the decoder layers, the draft the MTP layers (``model.layers.{L}.*`` from the main
model's ``num_hidden_layers`` on), renamed as vLLM's ``DeepSeekMTP`` holds them
(:func:`draft_name`). The draft's embedding and ``shared_head.head`` are left unwritten: vLLM
replaces both by the main model's once the draft is loaded, and prep wrote none of them.

What step 2 still does to bytes: the dense linears' scale transpose, on unwritten memory (a
sixteenth of their bytes). The experts, the bulk of the model, are neither shuffled nor copied
(nor the draft's BF16 experts: :func:`_unshuffled`).
"""

from __future__ import annotations

import logging
import os
from typing import Any

LOAD_FORMAT = "prep"

# vLLM's tensors that no checkpoint holds: the MLA scalars it constructs (1.0), and what
# finalize_model_weights derives after the copy.
ENGINE_OWNED = ("._k_scale", "._v_scale", "._q_scale", "._prob_scale", ".W_UK_T", ".W_UV")
# The draft's tensors vLLM replaces by the main model's after loading it (eagle/utils.py's
# maybe_share_target_embed, share_target_lm_head): left unwritten.
DRAFT_SHARED = ("model.embed_tokens.weight", ".shared_head.head.weight")
# An MTP layer's modules DeepSeekMTP holds beside its decoder layer; the rest is under mtp_block.
_MTP_OWN = ("enorm.", "hnorm.", "eh_proj.", "shared_head.")


class DoorError(RuntimeError):
    """A converted folder this vLLM cannot load as it is (the message names the fix)."""


def register() -> None:
    """The ``vllm.general_plugins`` entry point: ``--load-format prep`` is prep's loader."""
    from vllm.model_executor.model_loader import register_model_loader

    register_model_loader(LOAD_FORMAT)(loader_class())


def check_own_model(cls: type) -> None:
    """Refuse a model class a plugin put in place of vLLM's own (prep's files hold what vLLM's own
    DeepSeek model holds): ATOM's vLLM plugin, installed with ATOM, replaces DeepseekV3ForCausalLM
    unless ATOM_DISABLE_VLLM_PLUGIN=1."""
    module = getattr(cls, "__module__", "") or ""
    if module == "vllm" or module.startswith("vllm."):
        return
    fix = ("ATOM's vLLM plugin (installed with ATOM) replaced vLLM's own: serve with ATOM_DISABLE_VLLM_PLUGIN=1"
           if module.split(".")[0] == "atom" else "a vLLM plugin replaced vLLM's own: serve without that plugin")
    raise DoorError(f"vLLM built {cls.__name__} from {module}, not its own model, whose tensors prep's files hold; "
                    f"{fix}")


def loader_class() -> type:
    """vLLM's ``BaseModelLoader`` for converted folders (module docstring); built on first use,
    so that importing :mod:`layouts` never imports vLLM."""
    import torch
    from vllm.model_executor.layers.fused_moe import unquantized_fused_moe_method as unquantized_moe
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
            draft = getattr(model_config, "runner_type", None) == "draft"
            # The MTP layers follow the main model's decoder layers (the draft's config is rewritten);
            # a multimodal model's are its language model's (get_text_config: Kimi-K2.5's text_config)
            first_mtp = vllm_config.model_config.hf_config.get_text_config().num_hidden_layers
            if draft and vllm_config.parallel_config.pipeline_parallel_size > 1:
                raise DoorError("the MTP draft with pipeline parallel keeps its own embedding, which prep does not "
                                "write; serve it without --pipeline-parallel-size")
            with set_default_torch_dtype(model_config.dtype):
                with target:
                    model = self.create_model(vllm_config=vllm_config, model_config=model_config, prefix=prefix)
                check_own_model(type(model))
                outside = load_outside(model, model_config.model, manifest, rank) if not draft else set()
                held = ((vutils, "finalize_model_weights", lambda *a, **k: None),
                        (quark_moe, "convert_weight_to_mxfp4_moe_kernel_format", _unconverted),
                        (unquantized_moe, "convert_to_unquantized_kernel_format", _unshuffled))
                kept = [getattr(mod, attr) for mod, attr, _ in held]
                for mod, attr, stand_in in held:
                    setattr(mod, attr, stand_in)
                try:
                    vutils.process_weights_after_loading(model, model_config, target)
                finally:
                    for (mod, attr, _), original in zip(held, kept):
                        setattr(mod, attr, original)
                install(model, model_config.model, manifest, rank, first_mtp, draft, loaded=outside)
                kept[0](model, target)  # finalize_model_weights
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


def _unshuffled(backend: Any, moe_config: Any, w13_weight: Any, w2_weight: Any, layer: Any = None) -> tuple:
    """vLLM's ``convert_to_unquantized_kernel_format`` (BF16 experts: R1-0528's MTP layer) for
    aiter's MoE without its shuffle: the same tensors, marked ``is_shuffled`` as vLLM's are, since
    the rank's files hold them in ``bf16-preshuffle`` and are copied in next. Any other back end
    reads the experts unshuffled: refused."""
    from vllm.model_executor.layers.fused_moe.oracle.unquantized import UnquantizedMoeBackend

    if backend != UnquantizedMoeBackend.AITER:
        raise DoorError(f"vLLM runs the BF16 MoE {getattr(layer, 'layer_name', '')} on {backend.value}, which reads "
                        "the experts unshuffled, not prep's bf16-preshuffle; serve with VLLM_ROCM_USE_AITER=1 and "
                        "VLLM_ROCM_USE_AITER_MOE unset or 1")
    w13_weight.is_shuffled = w2_weight.is_shuffled = True
    return w13_weight, w2_weight


def draft_name(name: str) -> str:
    """The name vLLM's MTP draft (``DeepSeekMTP``) holds the converted tensor ``name`` of an MTP
    layer under: its norms, ``eh_proj`` and ``shared_head`` as they are, the decoder layer's
    modules under ``mtp_block`` (``model.layers.61.mlp.gate.weight`` ->
    ``model.layers.61.mtp_block.mlp.gate.weight``)."""
    head, _, rest = name.partition(".layers.")
    layer, _, module = rest.partition(".")
    return name if module.startswith(_MTP_OWN) else f"{head}.layers.{layer}.mtp_block.{module}"


def checked(folder: str, parallel_config: Any) -> tuple[Any, int]:
    """``(manifest, rank)``: the converted ``folder``'s manifest checked against vLLM's TP and EP
    sizes, this process's rank and vLLM's switches (:class:`DoorError` naming the fix), before
    vLLM allocates its model."""
    from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

    from ... import CompatibilityError, EngineConfig, ManifestError, check_compatibility, load_manifest
    from . import PROFILE

    tp, rank = get_tensor_model_parallel_world_size(), get_tensor_model_parallel_rank()
    ep = tp if getattr(parallel_config, "enable_expert_parallel", False) else 1
    try:
        engine = EngineConfig.from_env(PROFILE, tp_size=tp, rank=rank, ep_size=ep, env=os.environ)
        manifest = load_manifest(folder)
        check_compatibility(manifest, engine)
    except (CompatibilityError, ManifestError) as e:  # their messages name the folder
        raise DoorError(str(e)) from None
    from ...loader import side_file_problem

    problem = side_file_problem(manifest, "vLLM")  # it built the model from config.json already: say so
    if problem:
        raise DoorError(problem)
    return manifest, rank


def load_outside(model: Any, folder: str, manifest: Any, rank: int) -> set[str]:
    """A multimodal checkpoint's tensors outside its language model (Kimi-K2.5's vision tower and
    projector), which prep keeps whole in the common file for vLLM (``loads_outside``), through
    vLLM's own ``load_weights`` before processing, as its own load does: vLLM renames and splits
    them as it holds them (its ``hf_to_vllm_mapper``, QKV- and row-parallel vision linears). Returns
    the parameters they filled (none for a checkpoint without them)."""
    from ... import iter_rank_files

    names = {t.name for t in manifest.tensors if t.rank is None and t.role == "passthrough"}
    if not names:
        return set()
    wrapper = manifest.source.wrapper if manifest.source is not None else None
    if wrapper is None or not all(wrapper.is_outside(n) for n in names):
        raise DoorError(f"{folder}: its common files hold tensors every rank loads whole ({sorted(names)[0]}, ...), "
                        "which vLLM's door reads only for a multimodal checkpoint's vision tower; convert again with "
                        "--engine vllm")

    def tensors():
        for part in iter_rank_files(folder, rank, "cpu", manifest=manifest, names=names):
            yield from part.items()

    return set(model.load_weights(tensors()))


def install(model: Any, folder: str, manifest: Any, rank: int, first_mtp: int, draft: bool = False,
            loaded: set[str] = frozenset()) -> list[str]:
    """Copy rank ``rank``'s tensors of the converted ``folder`` (its checked ``manifest``) into
    ``model``'s processed parameters (module docstring, step 3): the main model's (``draft``
    False) or the MTP draft's, the MTP layers being those from ``first_mtp`` on. Returns the
    names written. ``loaded``: parameters :func:`load_outside` filled (not the rank's files').
    vLLM's multimodal model (Kimi-K2.5) holds the language model as ``language_model``, whose
    parameters have the source's names; prep's files name the tensors as the family does."""
    from ... import iter_rank_files
    from .._sharding import layer_index

    wrapper = manifest.source.wrapper if manifest.source is not None and not draft else None
    inner = wrapper.prefix if wrapper else ""

    def is_mtp(name: str) -> bool:  # a tensor of an MTP layer (index first_mtp on)
        layer = layer_index(name)
        return layer is not None and layer >= first_mtp

    # this load's tensors of the rank (the main model's or the draft's), with the layout each was written in
    mine = {t.name: t.layout for t in manifest.tensors if t.rank == rank and t.role != "unread"
            and is_mtp(t.name) == draft}
    if draft and not mine:
        raise DoorError(f"{folder}: rank {rank}'s files hold no MTP layer for vLLM's draft model (converted from a "
                        "checkpoint without one, or by a prep before 2026-12-05); convert again with --engine vllm, "
                        "or serve without --speculative-config")
    params = model.state_dict(keep_vars=True)
    written, seen, relaid, shuffled_fp8 = [], set(), set(), set()
    for part in iter_rank_files(folder, rank, "cpu", manifest=manifest, names=set(mine)):
        for name, t in part.items():
            held = draft_name(name) if draft else inner + name
            p = params.get(held)
            if p is None:
                raise DoorError(f"{folder}: {name} is not a tensor of vLLM's {'MTP draft' if draft else 'model'} "
                                f"({held}); convert again with this prep for this vLLM (--engine vllm)")
            if _on_asm_gemm(model, held):
                t = _as_asm_gemm_holds(t, name, mine[name], folder)
                relaid.add(held.rsplit(".", 1)[0])
            elif _on_shuffled_fp8_gemm(model, held):
                t = _as_shuffled_fp8_gemm_holds(t, name, mine[name], folder)
                shuffled_fp8.add(held.rsplit(".", 1)[0])
            _copy_into(p.data, t, name, folder)
            written.append(held)
            seen.add(p.data.untyped_storage().data_ptr())
    log = logging.getLogger(__name__)
    if relaid:
        log.info("prep: %d dense linears of rank %d run on aiter's ASM FP4 GEMM (aiter has tuned it for their shapes on "
                 "this GPU): their non-shuffle-t bytes were laid out as vLLM holds them for it (preshuffle-unpadded) at "
                 "load", len(relaid), rank)
    if shuffled_fp8:
        log.info("prep: %d FP8 per-channel linears of rank %d run on aiter's preshuffled per-token FP8 GEMM (tuned for "
                 "their shapes on this GPU): their weights were shuffled (16, 16) at load, as vLLM's processing does",
                 len(shuffled_fp8), rank)
    skip = ENGINE_OWNED + (DRAFT_SHARED if draft else ())
    left = [n for n, p in params.items() if p.data.untyped_storage().data_ptr() not in seen and not n.endswith(skip)
            and n not in loaded]
    if left:
        raise DoorError(f"{folder}: rank {rank}'s files hold no {left[0]} (and {len(left) - 1} more of vLLM's "
                        f"{'MTP draft' if draft else 'model'}); it would run with unwritten memory: convert again "
                        "with --engine vllm")
    return written


def _on_asm_gemm(model: Any, param: str) -> bool:
    """Whether ``param`` is the weight or scale of a dense MXFP4 linear that vLLM runs on aiter's
    ASM FP4 GEMM: where aiter has tuned that GEMM (and its Triton preshuffle one) for the
    linear's (N, K) on this GPU, vLLM's ``AiterMxfp4LinearKernel`` chooses it at processing."""
    if not param.endswith((".weight", ".weight_scale")):
        return False
    return bool(getattr(_linear_kernel(model, param, "ocp_mx_linear"), "use_asm_gemm", False))


def _as_asm_gemm_holds(t: Any, name: str, layout: str | None, folder: str) -> Any:
    """A dense linear's tensor as prep wrote it (``non-shuffle-t``) in the layout vLLM holds it in
    for aiter's ASM FP4 GEMM (``preshuffle-unpadded``: the weight W16, the scale ``[N, K/32]``
    S32x8 without pad), through the registry's exact inverse and forward. Which linears take that
    GEMM depends on the aiter installed where vLLM runs (its tuned-shape tables), not known when
    converting; for R1-0528 at TP 1 to 8 aiter e4048607 tunes none (docs/engines.md "vLLM")."""
    from ...registry import NON_SHUFFLE_T, PRESHUFFLE_UNPADDED

    if layout != NON_SHUFFLE_T.name:
        raise DoorError(f"{folder}: {name} is in layout {layout!r}, but vLLM runs its linear on aiter's ASM FP4 GEMM "
                        f"and prep lays out only {NON_SHUFFLE_T.name} for it; convert again with --engine vllm")
    if name.endswith(".weight_scale"):
        return PRESHUFFLE_UNPADDED.scale.forward(NON_SHUFFLE_T.scale.inverse(t, (t.shape[1], t.shape[0])))
    return PRESHUFFLE_UNPADDED.weight.forward(NON_SHUFFLE_T.weight.inverse(t, tuple(t.shape)))


def _on_shuffled_fp8_gemm(model: Any, param: str) -> bool:
    """Whether ``param`` is the weight of an FP8 per-channel linear (Quark's FP8 attention) that
    vLLM runs on one of aiter's preshuffled per-token GEMMs (``bpreshuffle``, or hipBLASLt's with
    ``VLLM_ROCM_USE_AITER_LINEAR_HIPBMM=1``): vLLM chooses them at processing, per linear, where
    aiter has tuned them for its (N, K) on this GPU, and shuffles that weight (16, 16)."""
    if not param.endswith(".weight"):
        return False
    return type(_linear_kernel(model, param, "fp8_linear")).__name__ in (
        "AiterPreshuffledPerTokenFp8ScaledMMLinearKernel", "AiterHipbMMPerTokenFp8ScaledMMLinearKernel")


def _linear_kernel(model: Any, param: str, attr: str) -> Any:
    """The linear kernel vLLM chose at processing for the module holding ``param`` (its Quark
    scheme's ``attr``: ``ocp_mx_linear`` for MXFP4, ``fp8_linear`` for FP8), None where it has none."""
    try:
        module = model.get_submodule(param.rsplit(".", 1)[0])
    except AttributeError:
        return None
    return getattr(getattr(module, "scheme", None), attr, None)


def _as_shuffled_fp8_gemm_holds(t: Any, name: str, layout: str | None, folder: str) -> Any:
    """An FP8 per-channel weight as prep wrote it for vLLM (the source's bytes, split) in aiter's
    (16, 16) shuffle, as vLLM holds it for its preshuffled per-token GEMMs: the registry's
    ``fp8-preshuffle`` forward (exact; which linears take those GEMMs depends on the aiter
    installed where vLLM runs, not known when converting)."""
    from ...registry import FP8_PRESHUFFLE

    if layout is not None:
        raise DoorError(f"{folder}: {name} is in layout {layout!r}, but vLLM runs its linear on aiter's preshuffled "
                        "FP8 GEMM and prep lays out only the source's bytes for it; convert again with --engine vllm")
    return FP8_PRESHUFFLE.weight.forward(t)


def _copy_into(dst: Any, t: Any, name: str, folder: str) -> None:
    """``t`` into vLLM's parameter ``dst``: floating point cast as vLLM's own loading casts (the
    router bias F32 -> BF16; an FP8 per-channel scale BF16 -> F32); MXFP4 and FP8 bytes as they
    are (vLLM views MXFP4 as ``float4_e2m1fn_x2``). Two parameters vLLM's processing leaves in
    another shape than the checkpoint's, with the same bytes in memory: an FP8 per-channel weight
    ``[N, K]`` transposed (a view ``[K, N]`` of its memory, which the file's bytes fill in order)
    and its scale ``[N]`` as ``[N, 1]``."""
    import torch

    if dst.dim() == 2 and not dst.is_contiguous() and dst.t().is_contiguous() and t.dtype == dst.dtype:
        dst = dst.t()  # the processed weight.t() of an FP8 linear: its memory is [N, K] in order
    if dst.dim() == t.dim() + 1 and dst.shape[-1] == 1 and tuple(dst.shape[:-1]) == tuple(t.shape):
        t = t.unsqueeze(-1)  # a per-channel scale [N] held [N, 1]
    if tuple(dst.shape) != tuple(t.shape):
        raise DoorError(f"{folder}: {name} is {list(t.shape)} but vLLM holds {list(dst.shape)}; convert again with "
                        "this prep for this vLLM (--engine vllm)")
    if dst.is_floating_point() and t.is_floating_point() and dst.element_size() > 1:
        dst.copy_(t)
    elif dst.element_size() == t.element_size():
        dst.view(torch.uint8).copy_(t.view(torch.uint8))
    else:
        raise DoorError(f"{folder}: {name} is {t.dtype} but vLLM holds {dst.dtype}; convert again with --engine vllm")
