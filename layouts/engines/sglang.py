"""SGLang's profile (the ``sglang`` 0.5.23 wheel from PyPI, on MI355 with ``SGLANG_USE_AITER=1``):
what its DeepSeek model holds per rank after loading a Quark MXFP4 checkpoint, and the door that
serves a converted folder with SGLang's own ``--load-format sharded_state``.

What SGLang holds (read in its source and checked against its real model and loaders on the
CPU: ``python -m harness check-engine sglang``):

* dense MXFP4 linears raw, as in the checkpoint (``quark_w4a4_mxfp4``'s ``process_weights_after_loading``
  keeps them unless ``SGLANG_ROCM_USE_AITER_FP4_ASM_GEMM=1``), read by aiter's Triton
  ``gemm_afp4wfp4``: prep's ``non-shuffle`` layout, the activation scale raw;
* stacked experts shuffled W16 per expert, the scale aiter's ``e8m0_shuffle`` of the flattened
  ``[E*N, K/32]`` viewed back as ``[E, N, K/32]`` (``quark_w4a4_mxfp4_moe``): ``ck-3d``; the
  per-rank intermediate padded to a multiple of 256 with zeros, the hidden size not padded;
* ``q_a_proj`` and ``kv_a_proj_with_mqa`` merged into a replicated ``fused_qkv_a_proj_with_mqa``;
  ``gate_up_proj`` for the dense MLP and an unfused shared expert; the rest split as ATOM splits it;
* per decoder layer four float32 scalars no checkpoint has (``self_attn.attn_mqa`` / ``attn_mha``
  ``k_scale`` / ``v_scale``, 1.0 from construction);
* the MTP layer only in its separate draft model, which the main model's files must not hold.

``sharded_state`` (``ShardedStateLoader``) builds the model, runs ``process_weights_after_loading``
on its empty parameters, copies each file's tensors into the post-processed state dict by name,
refuses a missing or unknown name, and runs ``post_load_weights`` (the MLA ``w_kc``/``w_vc``): so
each rank's files must hold exactly what SGLang holds, which is what prep writes for this engine.
The files are found by ``--model-loader-extra-config '{"pattern": ...}'`` (prep's file names).
"""

from __future__ import annotations

import json
import shlex
from typing import Mapping

from ._compat import (CompatibilityError, EngineConfig, bf16_moe_layout_matches, dense_layout_matches,
                      engine_matches, ep_matches, fp8_layout_matches, moe_layout_matches, rank_in_range, tp_matches)
from ..registry import MOE_CK_3D, NON_SHUFFLE
from . import _config
from . import (COLS, NEVER, QKV, Constant, EngineProfile, GemmPathRule, GpuArch, OutsideRow, ShardingRules,
               current_gpu_arch, deepseek_merges)

ENV_AITER = "SGLANG_USE_AITER"
ENV_ASM_GEMM = "SGLANG_ROCM_USE_AITER_FP4_ASM_GEMM"

TRITON_NON_SHUFFLE = "triton-non-shuffle"  # aiter's gemm_afp4wfp4 on raw weights: ATOM's path of that name
AITER = "aiter"  # SGLang's MoE runner with SGLANG_USE_AITER=1: aiter's CK fused_moe
GFX95 = GpuArch("gfx95", "gfx950", "gfx95x (MI355)")

SHARDING = ShardingRules(
    merges=deepseek_merges("self_attn.fused_qkv_a_proj_with_mqa"),
    # SGLang fuses by default for DeepSeek-V3/R1's 256 routed experts on gfx942+; the serve
    # command states prep's choice either way (--enforce / --disable-shared-experts-fusion).
    fuse_shared_expert=True,
    moe_pad_to=(256, 1),  # aiter's padding of the rank's intermediate (AITER_PADDING_SIZE on packed bytes)
    holds_mtp=False,
    constants=tuple(Constant(f"self_attn.{attn}.{s}", "F32", 1.0)
                    for attn in ("attn_mqa", "attn_mha") for s in ("k_scale", "v_scale")),
    # Kimi-K2.5: SGLang's KimiK25ForConditionalGeneration holds the DeepSeek model as language_model
    # and MoonViT beside it, each parameter of which sharded_state wants in the rank's files: the
    # vision attention's qkv_proj (QKVParallelLinear) and proj (RowParallelLinear) split over TP,
    # the MLP (plain nn.Linear), norms, patch embedding and projector whole (kimi_k25.py, its
    # load_weights' renames: wqkv -> attn.qkv_proj, wo -> attn.proj, proj.0/2 -> linear_1/2)
    wrapped=True,
    outside=(
        OutsideRow(r"(vision_tower\.encoder\.blocks\.\d+)\.wqkv\.(weight|bias)", r"\1.attn.qkv_proj.\2", QKV),
        OutsideRow(r"(vision_tower\.encoder\.blocks\.\d+)\.wo\.weight", r"\1.attn.proj.weight", COLS),
        OutsideRow(r"(vision_tower\.encoder\.blocks\.\d+)\.wo\.bias", r"\1.attn.proj.bias"),
        OutsideRow(r"mm_projector\.proj\.0\.(weight|bias)", r"mm_projector.linear_1.\1"),
        OutsideRow(r"mm_projector\.proj\.2\.(weight|bias)", r"mm_projector.linear_2.\1"),
        OutsideRow(r"(vision_tower|mm_projector)\..+"),
    ),
)


class SglangProfile(EngineProfile):
    """SGLang 0.5.23 serving DeepSeek V2/V3/R1 on MI355 with aiter (``SGLANG_USE_AITER=1``)."""

    name = "sglang"
    label = "SGLang"
    gemm_paths = {TRITON_NON_SHUFFLE: GemmPathRule(NON_SHUFFLE.name, NEVER, NEVER)}
    moe_layouts = {(AITER, GFX95.prefix): MOE_CK_3D.name}
    gpu_archs = (GFX95,)
    default_gpu_arch = GFX95.example
    expert_parallel_backends = (AITER,)
    expert_parallel_switch = "--ep-size"
    sharding = SHARDING
    families = ("deepseek-v3", "kimi-k2", "kimi-k2.5", "deepseek-v3.2", "glm-5")  # check-engine on tiny kimi-k2, v3.2, glm-5 (tests/test_families.py)
    checks = (engine_matches, tp_matches, rank_in_range, ep_matches, dense_layout_matches, moe_layout_matches,
              bf16_moe_layout_matches, fp8_layout_matches)
    # ShardedStateLoader runs post_load_weights after processing: on an FP8 kv_b_proj that is the
    # transposed [K, N] weight against its [N, 1] scale, and SGLang 0.5.23 raises (its own
    # save_sharded_state refuses those transposed weights before that); its default loader, which
    # runs post_load_weights first, serves the source (docs/engines.md "SGLang").
    fp8_channel_refusal = ("SGLang's sharded_state load (the door prep writes SGLang's files for) derives MLA's "
                           "w_kc/w_vc from kv_b_proj after processing it, and SGLang 0.5.23 fails on a processed FP8 "
                           "kv_b_proj")

    def config_from_env(self, env: Mapping[str, str], *, tp_size: int, rank: int, ep_size: int,
                        gpu_arch: str | None) -> EngineConfig:
        def on(name: str) -> bool:  # SGLang's EnvBool: "1", "true", "yes" (any case)
            return env.get(name, "").strip().lower() in ("1", "true", "yes")

        if not on(ENV_AITER):
            raise CompatibilityError(f"{ENV_AITER} is not set: SGLang then runs its MXFP4 MoE without aiter, on "
                                     f"unshuffled weights; set {ENV_AITER}=1")
        if on(ENV_ASM_GEMM):
            raise CompatibilityError(f"{ENV_ASM_GEMM}=1: SGLang then shuffles its dense MXFP4 weights at load (W16 "
                                     "with an unpadded scale: preshuffle-unpadded), which prep's SGLang conversions "
                                     "do not hold; unset it")
        arch = gpu_arch or current_gpu_arch() or self.default_gpu_arch
        return EngineConfig(TRITON_NON_SHUFFLE, AITER, tp_size, rank, ep_size, arch, False, False, profile=self)

    def target_refusal(self, tp: int, ep: int, moe_layout: str, fuse_shared_expert: bool = False) -> str | None:
        if ep not in (1, tp):
            return (f"--ep {ep} with --tp {tp}: prep writes SGLang's expert parallel with ep_size = tp_size "
                    f"(moe TP 1); pass --ep 1 or --ep equal to --tp")
        return None

    def source_notes(self, config: Mapping) -> list[str]:
        """Quark ``exclude`` entries SGLang would misread (:mod:`._quark`)."""
        return _config.notes(config, "SGLang", "--json-model-override-args")

    def serve_command(self, folder: str, tp: int, ep: int, layout: str, moe_layout: str,
                      fuse_shared_expert: bool = True, config: Mapping | None = None) -> str | None:
        """SGLang's server on the folder's files (``sharded_state`` with prep's file names), the TP /
        EP sizes and the shared-expert fusion prep wrote stated explicitly; with the folder's
        ``config``, its Quark excludes as SGLang matches them where they need it."""
        if layout != NON_SHUFFLE.name or moe_layout != MOE_CK_3D.name:
            return None
        pattern = json.dumps({"pattern": f"model-tp{tp}-rank{{rank}}-{{part}}.safetensors"})
        fusion = "--enforce-shared-experts-fusion" if fuse_shared_expert else "--disable-shared-experts-fusion"
        override = _config.override(config or {})
        return (f"{ENV_AITER}=1 python -m sglang.launch_server --model-path {shlex.quote(folder)} --load-format "
                f"sharded_state --model-loader-extra-config {shlex.quote(pattern)} --tp-size {tp}"
                + (f" --ep-size {ep}" if ep > 1 else "") + f" {fusion}"
                + (f" --json-model-override-args {shlex.quote(json.dumps(override))}" if override else ""))


PROFILE = SglangProfile()

__all__ = ["PROFILE", "SglangProfile", "SHARDING"]
