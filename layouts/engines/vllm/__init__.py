"""vLLM's profile (the ``vllm`` 0.34.0 wheel from PyPI, on MI355 with aiter: ``VLLM_ROCM_USE_AITER=1``):
what its DeepSeek model holds per rank after loading a Quark MXFP4 checkpoint. ``prep convert
--engine vllm`` writes that, and ``vllm serve OUT --load-format prep`` loads it: the model loader
in :mod:`.door`, which the ``vllm.general_plugins`` entry point ``prep`` registers in every vLLM
process of an environment where prep (or the runtime ``mxfp4-layouts``) is installed.

What vLLM holds (read in its source and run on the CPU, docs/engines.md "vLLM"):

* dense MXFP4 linears (``AiterMxfp4LinearKernel``): per ``(N, K)``, W16 with the scale cut to N
  rows where both of aiter's tuned tables list the shape, else the weight raw and the scale
  **transposed** ``[K/32, N]`` for aiter's Triton ``gemm_afp4wfp4``: prep's ``non-shuffle-t``. With
  aiter e4048607's tables every MXFP4 dense linear of DeepSeek-R1-0528 (the MLPs; its attention
  is BF16) takes the transposed path at TP 1 to 8; the door is to check vLLM's own lookup per
  linear and refuse a shape it would shuffle;
* stacked experts (aiter's CK W4A4 ``fused_moe``): ``ck-3d``'s bytes, under
  ``mlp.experts.routed_experts``; the intermediate padded to a multiple of 128, the hidden to 256;
  the shared expert not fused (``VLLM_ROCM_USE_AITER_FUSION_SHARED_EXPERTS`` off by default);
* ``fused_qkv_a_proj`` = [q_a; kv_a] replicated and ``gate_up_proj``, split as ATOM's;
* FP8 per-channel linears (Quark's FP8 attention: MTP-MoEFP4, the AttnFP8 checkpoints): the
  weight ``[N, K]`` as its transpose (a view of the same memory) with the scale ``[N, 1]``, or
  shuffled (16, 16) where aiter's preshuffled per-token FP8 GEMM is tuned for ``(N, K)``: prep
  writes the source's bytes and the door copies them in that way (:mod:`.door`);
* the MTP layer only in its draft model (``DeepSeekMTP``, ``--speculative-config '{"method":
  "mtp", ...}'``), built and loaded after the main model through the same loader, at the same TP
  and EP: its decoder layer under ``model.layers.{L}.mtp_block``, split and merged as the main
  model's layers; R1-0528's BF16 experts in aiter's ``shuffle_weight`` (16, 16) order
  (``bf16-preshuffle``, vLLM's unquantized aiter MoE); its ``embed_tokens`` and
  ``shared_head.head`` replaced by the main model's after loading, so no rank reads them. prep
  writes the layer into the ranks' files under the checkpoint's names and the door renames it
  (:func:`.door.draft_name`).
"""

from __future__ import annotations

import json
import shlex
from typing import Mapping

from .._compat import (CompatibilityError, EngineConfig, bf16_moe_layout_matches, dense_layout_matches,
                       engine_matches, ep_matches, fp8_layout_matches, moe_layout_matches, rank_in_range, tp_matches)
from ...registry import MOE_BF16, MOE_CK_3D, NON_SHUFFLE_T, PRESHUFFLE_UNPADDED
from .. import (NEVER, WHOLE, EngineProfile, Merge, GemmPathRule, GpuArch, ShardingRules, _config,
                current_gpu_arch, deepseek_merges, layer_index)

ENV_AITER = "VLLM_ROCM_USE_AITER"
ENV_FUSE_SHARED = "VLLM_ROCM_USE_AITER_FUSION_SHARED_EXPERTS"

# aiter's gemm_afp4wfp4 on a raw weight with the scale transposed; the activation quantized raw
TRITON_NON_SHUFFLE_T = "triton-non-shuffle-t"
# aiter's ASM FP4 GEMM (gemm_a4w4; up to 64 tokens its Triton preshuffle GEMM) on W16 with the
# scale swizzled unpadded: vLLM's choice, per linear, where aiter has tuned both for its (N, K).
# No switch selects it for a whole model, so no configuration's default; prep writes
# non-shuffle-t and the door lays such a linear out at load (door._as_asm_gemm_holds).
AITER_ASM_UNPADDED = "aiter-asm-unpadded"
AITER = "aiter"  # vLLM's MoE back end AITER_MXFP4_MXFP4: aiter's CK fused_moe
GFX95 = GpuArch("gfx95", "gfx950", "gfx95x (MI355)")

SHARDING = ShardingRules(
    # DeepSeek-V3.2's indexer: wk and weights_proj one replicated BF16 linear (deepseek_v32's
    # MergedColumnParallelLinear(..., disable_tp=True)), [wk; weights_proj] by rows
    merges=(*deepseek_merges("self_attn.fused_qkv_a_proj"),
            Merge("self_attn.indexer.wk_weights_proj", ("self_attn.indexer.wk", "self_attn.indexer.weights_proj"),
                  WHOLE)),
    experts="mlp.experts.routed_experts",
    fuse_shared_expert=False,
    moe_pad_to=(128, 256),
    bf16_moe_inter_align=(192, 64, 128),  # aiter_moe_intermediate_alignment (fused_moe/oracle/unquantized.py)
    mtp_replaced=("embed_tokens.weight", "shared_head.head.weight"),
    loads_outside=True,  # Kimi-K2.5's vision tower and projector: vLLM loads and TP-splits them (kimi_k25.py)
)


class VllmProfile(EngineProfile):
    """vLLM 0.34.0 serving DeepSeek V2/V3/R1 on MI355 with aiter (``VLLM_ROCM_USE_AITER=1``)."""

    name = "vllm"
    label = "vLLM"
    gemm_paths = {TRITON_NON_SHUFFLE_T: GemmPathRule(NON_SHUFFLE_T.name, NEVER, NEVER),
                  # the activation scale shuffled from 32 tokens (per_1x32_f4_quant_hip(shuffle=M >= 32))
                  AITER_ASM_UNPADDED: GemmPathRule(PRESHUFFLE_UNPADDED.name, 32, 32)}
    moe_layouts = {(AITER, GFX95.prefix): MOE_CK_3D.name}
    mtp_draft_flags = "--speculative-config '{\"method\": \"mtp\", \"num_speculative_tokens\": 1}'"

    def mtp_draft_refusal(self, manifest, config):
        # vLLM 0.34's MTP layer (DeepSeekMultiTokenPredictorLayer) builds eh_proj as a plain
        # nn.Linear: an MXFP4 eh_proj (GLM-5.1-MXFP4's) fails its own load of the source too
        # ("Attempted to load weight (torch.Size([256, 256])) into parameter (torch.Size([256, 512]))")
        layers = config.get("num_hidden_layers")
        for t in manifest.tensors:
            layer = layer_index(t.name)
            if layer is not None and isinstance(layers, int) and layer >= layers and \
                    t.name.endswith(".eh_proj.weight_scale"):
                return (f"{t.name.removesuffix('_scale')} is quantized, and vLLM's MTP layer holds eh_proj "
                        "unquantized (its own load of the source fails)")
        return None
    bf16_moe_layout = MOE_BF16.name  # bf16-preshuffle: aiter's shuffle_weight (16, 16), vLLM's unquantized aiter MoE
    gpu_archs = (GFX95,)
    default_gpu_arch = GFX95.example
    expert_parallel_backends = (AITER,)
    expert_parallel_switch = "--enable-expert-parallel"
    sharding = SHARDING
    fp8_channel_linears = True  # the door lays them out (door._copy_into, _as_shuffled_fp8_gemm_holds): tests/test_vllm_conversion.py
    families = ("deepseek-v3", "kimi-k2", "kimi-k2.5", "deepseek-v3.2", "glm-5")  # check-engine on tiny kimi-k2, kimi-k2.5, v3.2, glm-5
    checks = (engine_matches, tp_matches, rank_in_range, ep_matches, dense_layout_matches, moe_layout_matches,
              bf16_moe_layout_matches, fp8_layout_matches)

    def config_from_env(self, env: Mapping[str, str], *, tp_size: int, rank: int, ep_size: int,
                        gpu_arch: str | None) -> EngineConfig:
        def on(name: str) -> bool:  # vLLM's envs: "1" / "true" (any case)
            return env.get(name, "").strip().lower() in ("1", "true")

        if not on(ENV_AITER):
            raise CompatibilityError(f"{ENV_AITER} is not set: vLLM then runs MXFP4 without aiter's kernels, on "
                                     f"other layouts; set {ENV_AITER}=1")
        if on(ENV_FUSE_SHARED):
            raise CompatibilityError(f"{ENV_FUSE_SHARED}=1: vLLM then stacks the shared expert with the routed ones, "
                                     "which vLLM conversions do not; unset it")
        arch = gpu_arch or current_gpu_arch() or self.default_gpu_arch
        return EngineConfig(TRITON_NON_SHUFFLE_T, AITER, tp_size, rank, ep_size, arch, False, False, profile=self)

    def target_refusal(self, tp: int, ep: int, moe_layout: str, fuse_shared_expert: bool = False) -> str | None:
        if ep not in (1, tp):
            return (f"--ep {ep} with --tp {tp}: vLLM's expert parallel spreads the experts over the TP ranks "
                    f"({self.expert_parallel_switch}); pass --ep 1 or --ep equal to --tp")
        if fuse_shared_expert:
            return (f"--fuse-shared-expert: vLLM stacks the shared expert with the routed ones only with "
                    f"{ENV_FUSE_SHARED}=1, which its door does not serve yet; convert without it")
        return None

    def serve_command(self, folder: str, tp: int, ep: int, layout: str, moe_layout: str,
                      fuse_shared_expert: bool = True, config: Mapping | None = None) -> str | None:
        """vLLM's server on the folder through prep's loader (:mod:`.door`), its TP / EP sizes."""
        if layout != NON_SHUFFLE_T.name or moe_layout != MOE_CK_3D.name:
            return None
        override = _config.override(config or {})
        return (f"{ENV_AITER}=1 vllm serve {shlex.quote(folder)} --load-format prep --tensor-parallel-size {tp}"
                + (f" {self.expert_parallel_switch}" if ep > 1 else "")
                + (f" --hf-overrides {shlex.quote(json.dumps(override))}" if override else ""))

    def source_notes(self, config: Mapping) -> list[str]:
        """Quark ``exclude`` entries vLLM would misread (:mod:`.._quark`)."""
        return _config.notes(config, "vLLM", "--hf-overrides")


PROFILE = VllmProfile()

__all__ = ["PROFILE", "SHARDING", "VllmProfile"]
