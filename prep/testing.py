"""Synthetic DeepSeek-V3 checkpoints in AMD Quark MXFP4 format, generated offline.

Why: the real amd/DeepSeek-R1-0528-MXFP4 is ~350 GiB behind a network we do not have, yet the
converter must be tested on the exact things that make it hard: HF tensor names, per-expert
routed experts, the Quark ``quantization_config`` with its ``exclude`` list, the MTP layer and
its BF16 ``eh_proj`` quirk, a sharded ``model.safetensors.index.json``, and files copied through
(tokenizer, generation config). This module writes such a checkpoint with small dims ("tiny", for
tests) or multi-GB dims ("bench", for throughput), deterministically (same spec -> same bytes;
every tensor draws from its own generator seeded by ``(seed, name)``), one shard at a time so
memory stays bounded by one shard.

What a Quark MXFP4 DeepSeek checkpoint holds (names, dtypes, the exclude list, the MTP layer's
BF16 ``eh_proj``) is the format prep converts; ``docs/manifest.md`` and ``docs/layouts.md`` say
what it becomes.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import math
import re
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import save_file

import layouts
from layouts.dequant import FP8_BLOCK  # DeepSeek's FP8 release: one scale per 128x128 block of a weight
from layouts.sizes import ceil_div

__all__ = [
    "PRESETS", "VARIANTS", "Param", "SynthSpec", "build_config", "exclude_patterns", "is_excluded",
    "plan_groups", "run_measured", "tensor_specs", "write_checkpoint", "drop_tensors", "edit_at_same_size",
]

VARIANTS = ("r1-0528", "v2", "mtp-moefp4", "fp8-block", "moe-only", "experts")
"""r1-0528: attention and the MTP layer BF16 (as amd/DeepSeek-R1-0528-MXFP4). v2: attention
MXFP4 too, MTP layer quantized except its embedding and head. mtp-moefp4: as v2, but every
``*self_attn*`` linear (the MTP layer's too) FP8 per channel, Quark's ``layer_quant_config``
override (as amd/DeepSeek-R1-0528-MXFP4-MTP-MoEFP4 and the AttnFP8 checkpoints): an F8_E4M3
weight and one F32 ``weight_scale`` per output channel, activations quantized per token at run
time. fp8-block: DeepSeek's own FP8 release (DeepSeek-R1-0528 as released, V3): every linear
F8_E4M3 with an F32 ``weight_scale_inv`` per 128x128 block, experts and the MTP layer included;
the router, embeddings, heads, norms and the MTP layer's ``eh_proj`` BF16; no Quark config but
DeepSeek's ``{"quant_method": "fp8", "weight_block_size": [128, 128], ...}``. moe-only: only the
routed experts MXFP4 (amd/GLM-5-MXFP4's recipe: attention, the router, the dense MLPs, the shared
experts and the head excluded). experts: the routed and the shared experts MXFP4, and the MTP
layer's ``eh_proj`` (amd/GLM-5.1-MXFP4's)."""

FP8_MAX = 448.0  # e4m3fn's largest finite value


@dataclass(frozen=True)
class SynthSpec:
    """Dims and knobs of a synthetic checkpoint; defaults are the "tiny" preset (10 MB; 5 MB as v2).

    Layers ``0..num_hidden_layers-1`` are the model; ``model.layers.{num_hidden_layers}`` is the
    MTP layer (DeepSeek's ``num_nextn_predict_layers = 1``). ``random_bytes`` skips quantization
    and writes random codes and scales in [118, 126]: same names, shapes and dtypes, fast enough
    for multi-GB checkpoints, but the values are not the quantization of anything.
    """

    hidden_size: int = 256
    q_lora_rank: int = 128
    kv_lora_rank: int = 128
    qk_nope_head_dim: int = 32
    qk_rope_head_dim: int = 16
    v_head_dim: int = 32
    num_attention_heads: int = 8
    intermediate_size: int = 512
    moe_intermediate_size: int = 256
    n_routed_experts: int = 8
    n_shared_experts: int = 1
    num_experts_per_tok: int = 2
    n_group: int = 2
    topk_group: int = 1
    first_k_dense_replace: int = 1
    num_hidden_layers: int = 3
    vocab_size: int = 1024
    variant: str = "r1-0528"
    model_type: str = "deepseek_v3"  # config.json's; Kimi-K2 says "kimi_k2" with the same architecture;
    # "glm_moe_dsa": GLM-5's architecture, config keys and MTP layer (no embedding or head of its own)
    mtp: bool = True  # the MTP layer (DeepSeek's num_nextn_predict_layers = 1); Kimi-K2 has none
    # DeepSeek-V3.2's sparse-attention indexer in every layer (0: none): its heads, their size, and
    # how many cached tokens each query's attention reads
    index_n_heads: int = 0
    index_head_dim: int = 32
    index_topk: int = 4
    # GLM-5.2's IndexShare (1: every layer has its own indexer): layer i has one where
    # max(i - offset + 1, 0) % freq == 0 (transformers' GlmMoeDsaConfig), config.json's indexer_types
    index_topk_freq: int = 1
    index_skip_topk_offset: int = 2
    # Kimi-K2.5's multimodal checkpoint: the language model under "language_model.", its config under
    # text_config, and a small MoonViT vision tower and projector beside it (BF16, as Quark leaves them)
    multimodal: bool = False
    num_shards: int = 4
    seed: int = 0
    random_bytes: bool = False

    def has_indexer(self, layer: int) -> bool:
        """Whether ``layer`` holds a sparse-attention indexer (the MTP layer always does)."""
        return bool(self.index_n_heads) and (layer >= self.num_hidden_layers or max(
            layer - self.index_skip_topk_offset + 1, 0) % self.index_topk_freq == 0)

    def __post_init__(self) -> None:
        """Refuse specs a DeepSeek-V3 engine could not load, before writing anything."""
        problems = []
        if self.variant not in VARIANTS:
            problems.append(f"variant must be one of {VARIANTS}, got {self.variant!r}")
        for name, value in asdict(self).items():
            if isinstance(value, int) and not isinstance(value, bool) and name not in ("seed", "first_k_dense_replace",
                                                                                        "index_n_heads") and value < 1:
                problems.append(f"{name} must be >= 1, got {value}")
        # Every linear's K must be even to pack two E2M1 codes per byte.
        ks = {"hidden_size": self.hidden_size, "q_lora_rank": self.q_lora_rank, "kv_lora_rank": self.kv_lora_rank,
              "intermediate_size": self.intermediate_size, "moe_intermediate_size": self.moe_intermediate_size,
              "num_attention_heads*v_head_dim": self.num_attention_heads * self.v_head_dim}
        problems += [f"{k} must be even (MXFP4 packs two codes per byte), got {v}" for k, v in ks.items() if v % 2]
        if self.n_group >= 1 and self.n_routed_experts % self.n_group:
            problems.append(f"n_routed_experts ({self.n_routed_experts}) must be a multiple of n_group ({self.n_group})")
        elif self.n_group >= 1 and self.num_experts_per_tok > self.topk_group * (self.n_routed_experts // self.n_group):
            problems.append("num_experts_per_tok exceeds the experts in topk_group groups (noaux_tc routing)")
        if self.topk_group > self.n_group:
            problems.append(f"topk_group ({self.topk_group}) must be <= n_group ({self.n_group})")
        if not 0 <= self.first_k_dense_replace <= self.num_hidden_layers:
            problems.append("first_k_dense_replace must lie in [0, num_hidden_layers]")
        if problems:
            raise ValueError("invalid SynthSpec: " + "; ".join(problems))


PRESETS: dict[str, SynthSpec] = {
    "tiny": SynthSpec(),
    # bench: 2.58 GB on disk (2,575,365,632 bytes of tensors, 2.40 GiB), 11,677 tensors (256 experts:
    # ~1,550 tensors per MoE layer, as in the real checkpoint), 8 shards of whole layers; written in
    # ~15 s on 2 CPUs, peak RSS ~2 GB. As in R1-0528 the excluded MTP layer is all BF16 (0.9 GB).
    "bench": SynthSpec(
        hidden_size=2048, q_lora_rank=512, kv_lora_rank=256, qk_nope_head_dim=64, qk_rope_head_dim=32,
        v_head_dim=64, num_attention_heads=16, intermediate_size=4096, moe_intermediate_size=256,
        n_routed_experts=256, num_experts_per_tok=8, n_group=8, topk_group=4, num_hidden_layers=8,
        vocab_size=8192, num_shards=8, random_bytes=True,
    ),
}
# bench-large: the bench dims with 40 layers, 9.14 GiB in 24 shards (61,373 tensors): more than
# a 24 GiB machine's dirty-page limit, so copies reach the disk as a real 350 GB one does.
PRESETS["bench-large"] = replace(PRESETS["bench"], num_hidden_layers=40, num_shards=24)
# bench-r1: R1-0528's shape where it decides what a rank reads: its 128 heads of 192/128 dims
# (BF16 attention 5.6% of the bytes, R1's 5.8%), 256 experts of moe_intermediate 2048 (at TP 8
# a rank's 256 rows need no padding, as in R1), the MTP layer BF16 with its experts; hidden 256
# and 8 layers keep it at 2.35 GiB (11,677 tensors), so the MTP experts are 32% of it (R1: 5.6%).
PRESETS["bench-r1"] = replace(
    PRESETS["bench"], hidden_size=256, q_lora_rank=64, kv_lora_rank=64, qk_nope_head_dim=128, qk_rope_head_dim=64,
    v_head_dim=128, num_attention_heads=128, intermediate_size=2048, moe_intermediate_size=2048, vocab_size=32768,
)

# kimi-k2: Kimi-K2's shape where it differs from R1 (Kimi-K2-Thinking / K2.5 MXFP4, ATOM's
# recipes/Kimi-K2.md): 384 routed experts of which 8 are chosen, one expert group, 64 attention heads
# (8 per rank at TP 8, which ATOM's MLA repeats to 16), model_type "kimi_k2" on DeepSeek-V3's
# architecture, no MTP layer; the tiny widths otherwise.
PRESETS["kimi-k2"] = replace(
    PRESETS["tiny"], n_routed_experts=384, num_experts_per_tok=8, n_group=1, topk_group=1, num_attention_heads=64,
    model_type="kimi_k2", mtp=False,
)

# kimi-k2.5: Kimi-K2.5 as amd/Kimi-K2.5-MXFP4 has it: kimi-k2's language model inside the
# multimodal checkpoint (KimiK25ForConditionalGeneration: language_model.model.layers..., the config
# under text_config, quantization_config at the top), a 2-block vision tower of width 32 (K2.5: 27
# of 1152) and its projector beside it, all BF16 (AMD's exclude list: *mm_projector* *vision_tower*).
PRESETS["kimi-k2.5"] = replace(PRESETS["kimi-k2"], multimodal=True)

# r1-0528-fp8: DeepSeek-R1-0528 as DeepSeek released it (the fp8-block variant) at tiny widths but
# R1's head dims (128 nope, 64 rope, 128 v) over 16 heads and a dense intermediate of 1024, so
# that at TP 2 every rank's part of every FP8 linear is whole 128x128 blocks, as R1's are up to
# TP 8 (the default tiny's q_b_proj of 8 x 48 rows would cut a block, and prep refuses that);
# its experts (intermediate 256) split into whole blocks at TP 2, and at TP 4 and 8 with --ep.
PRESETS["r1-0528-fp8"] = replace(
    PRESETS["tiny"], variant="fp8-block", num_attention_heads=16, qk_nope_head_dim=128, qk_rope_head_dim=64,
    v_head_dim=128, intermediate_size=1024,
)

# real-dims: DeepSeek-V3/R1's real widths (hidden 7168, 128 heads, q/kv LoRA 1536/512, dense
# intermediate 18432, 256 experts of 2048, vocab 129,280) with one dense layer and the MTP layer
# (MoE) only, v2 (the MTP layer quantized but its embedding and head): 13.0 GiB in 16 shards of
# ~0.8 GiB, so that what a command holds at once is measured on the tensors the real one has
# (the embedding is 1.8 GiB, a MoE layer 6 GB). scripts/bench.py memory runs every command on it.
PRESETS["real-dims"] = replace(
    PRESETS["bench"], hidden_size=7168, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
    qk_rope_head_dim=64, v_head_dim=128, num_attention_heads=128, intermediate_size=18432,
    moe_intermediate_size=2048, vocab_size=129280, num_hidden_layers=1, first_k_dense_replace=1,
    variant="v2", num_shards=16,
)

# r1-count: DeepSeek-R1-0528's tensor count (61 layers, the first 3 dense, 256 experts, the BF16
# MTP layer: 90,910 source tensors in 76 shards, as the real checkpoint) at small widths but R1's
# moe_intermediate (2048: a TP 8 rank's 256 rows need no padding, as in R1; hidden 256 needs none
# either), 12.5 GB: what grows with the number of tensors (manifests, placements, indexes) and a
# rank's load at R1's count are measured on it.
PRESETS["r1-count"] = replace(
    PRESETS["bench"], hidden_size=256, q_lora_rank=128, kv_lora_rank=128, qk_nope_head_dim=32, qk_rope_head_dim=16,
    v_head_dim=32, num_attention_heads=16, intermediate_size=512, moe_intermediate_size=2048, num_hidden_layers=61,
    first_k_dense_replace=3, vocab_size=8192, num_shards=76,
)


# v3.2: DeepSeek-V3.2 as AMD's MXFP4 export has it (amd/DeepSeek-V3.2-mxfp4: every self_attn module,
# the indexer's too, and the MTP layer left BF16; the experts and MLPs MXFP4), its indexer at tiny
# widths: 4 index heads of 32 (V3.2: 64 of 128), 4 tokens per query (V3.2: 2048).
PRESETS["v3.2"] = replace(PRESETS["tiny"], model_type="deepseek_v32", index_n_heads=4)

# glm-5: GLM-5 as amd/GLM-5-MXFP4 has it (only the routed experts MXFP4: "MOE-only"), at tiny
# widths with GLM's shape where it differs from DeepSeek's: one expert group, attention heads whose
# value is wider than their no-rope query part (GLM: 192 and 256; here 48 and 64), the indexer in
# every layer (4 heads of 32; GLM: 32 of 128), the MTP layer without embedding or head.
PRESETS["glm-5"] = replace(PRESETS["tiny"], model_type="glm_moe_dsa", variant="moe-only", index_n_heads=4,
                           n_group=1, topk_group=1, qk_nope_head_dim=48, v_head_dim=64)
# glm-5.2: GLM-5.2's IndexShare on glm-5: layers 0 and 2 (and the MTP layer) have an indexer, layer 1
# reuses layer 0's top-k and holds none (GLM-5.2: 0-2, then every fourth: index_topk_freq 4, offset 3).
PRESETS["glm-5.2"] = replace(PRESETS["glm-5"], index_topk_freq=2, index_skip_topk_offset=1)
# glm-5.1: amd/GLM-5.1-MXFP4's recipe on glm-5: the shared experts MXFP4 too, and the MTP eh_proj.
PRESETS["glm-5.1"] = replace(PRESETS["glm-5"], variant="experts")


def exclude_patterns(spec: SynthSpec) -> list[str]:
    """The Quark ``exclude`` list of the variant (L = the MTP layer's index)."""
    mtp = spec.num_hidden_layers
    if spec.multimodal:  # amd/Kimi-K2.5-MXFP4's exclude_layers; -AttnFP8 (variant mtp-moefp4) quantizes self_attn FP8
        return [*(["*self_attn*"] if spec.variant != "mtp-moefp4" else []), "*mlp.gate", "*lm_head", "*mm_projector*",
                "*vision_tower*"]
    if spec.variant == "r1-0528":
        return ["*self_attn*", "*mlp.gate.*", "lm_head", f"model.layers.{mtp}.*"]
    if spec.variant in ("moe-only", "experts"):  # amd/GLM-5-MXFP4's exclude_layers (5.1: experts shared too)
        return ["*self_attn*", "*mlp.gate", "*lm_head", "*mlp.gate_proj", "*mlp.up_proj", "*mlp.down_proj",
                *(["*shared_experts*"] if spec.variant == "moe-only" else [])]
    if spec.variant == "fp8-block":  # not Quark's: what DeepSeek's FP8 release keeps in BF16
        return ["*mlp.gate.*", "lm_head", f"model.layers.{mtp}.shared_head.head", f"model.layers.{mtp}.embed_tokens",
                f"model.layers.{mtp}.eh_proj"]
    return ["*mlp.gate.*", "lm_head", f"model.layers.{mtp}.shared_head.head", f"model.layers.{mtp}.embed_tokens"]


def is_excluded(module: str, patterns: list[str]) -> bool:
    """Whether Quark leaves ``module`` (a name without ``.weight``) unquantized.

    Entries match as Quark reads them: exact name or dotted prefix, fnmatch glob, ``re:`` regex.
    """
    for pat in patterns:
        if pat.startswith("re:"):
            if re.fullmatch(pat[3:], module):
                return True
        elif module == pat or module.startswith(pat + ".") or fnmatch.fnmatchcase(module, pat):
            return True
    return False


def _quant_spec(is_dynamic: bool) -> dict:
    return {
        "dtype": "fp4", "qscheme": "per_group", "group_size": 32, "ch_axis": -1, "scale_format": "e8m0",
        "scale_calculation_mode": "even", "is_dynamic": is_dynamic, "round_method": "half_even",
        "observer_cls": "PerBlockMXObserver", "symmetric": None, "mx_element_dtype": None,
    }


def _fp8_channel_spec(ch_axis: int, is_dynamic: bool) -> dict:
    """Quark's FP8 per-channel spec (its ``ptpc_fp8`` scheme: weights per output channel, static;
    activations per token, dynamic)."""
    return {
        "dtype": "fp8_e4m3", "qscheme": "per_channel", "ch_axis": ch_axis, "is_dynamic": is_dynamic,
        "group_size": None, "symmetric": True, "round_method": "half_even", "scale_type": "float",
        "observer_cls": "PerChannelMinMaxObserver", "scale_format": None, "scale_calculation_mode": None,
        "mx_element_dtype": None,
    }


def layer_quant_config(spec: SynthSpec) -> dict:
    """Quark's per-layer overrides of the variant (pattern -> spec)."""
    if spec.variant != "mtp-moefp4":
        return {}
    return {"*self_attn*": {"weight": _fp8_channel_spec(0, False), "input_tensors": _fp8_channel_spec(1, True),
                            "output_tensors": None, "bias": None}}


def build_config(spec: SynthSpec) -> dict:
    """A DeepSeek-V3 ``config.json`` (as HF and Quark write it) for the spec's dims."""
    config = _base_config(spec)
    if spec.index_n_heads:  # DeepSeek-V3.2's own architecture and its indexer's sizes
        config.update(architectures=["DeepseekV32ForCausalLM"], index_n_heads=spec.index_n_heads,
                      index_head_dim=spec.index_head_dim, index_topk=spec.index_topk)
    if spec.index_topk_freq > 1:  # GLM-5.2's IndexShare, with the indexer_types transformers 5 writes
        config.update(index_topk_freq=spec.index_topk_freq, index_skip_topk_offset=spec.index_skip_topk_offset,
                      indexer_types=["full" if spec.has_indexer(i) else "shared"
                                     for i in range(spec.num_hidden_layers)])
    if spec.model_type == "glm_moe_dsa":  # GLM-5's config.json (transformers 5's GlmMoeDsaConfig keys)
        for key in ("rope_theta", "rope_scaling", "torch_dtype"):
            del config[key]
        config.update(architectures=["GlmMoeDsaForCausalLM"], dtype="bfloat16", head_dim=spec.qk_rope_head_dim,
                      qk_head_dim=spec.qk_nope_head_dim + spec.qk_rope_head_dim, rope_interleave=True,
                      indexer_rope_interleave=True, rope_parameters={"rope_theta": 1000000.0, "rope_type": "default"},
                      rms_norm_eps=1e-5, transformers_version="5.0.2.dev0")
    if spec.variant == "fp8-block":  # DeepSeek's own, as its FP8 release's config.json has it
        config["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                         "weight_block_size": [FP8_BLOCK, FP8_BLOCK]}
    if spec.multimodal:  # Kimi-K2.5's: the language model's keys under text_config, Quark's config at the top
        quant = config.pop("quantization_config")
        config = {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
                  "bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"],
                  "media_placeholder_token_id": config["vocab_size"] - 2, "pad_token_id": config["vocab_size"] - 1,
                  # the vision config under both schemas: the hub's remote code (vt_*, read by SGLang and
                  # ATOM's plugins) and transformers 5's Kimi_K25VisionConfig (read by vLLM); Kimi-K2.5's
                  # widths are transformers' defaults, the tiny ones are not
                  "text_config": config, "vision_config": {
                      "hidden_size": VT_HIDDEN, "intermediate_size": VT_INTERMEDIATE, "num_attention_heads": VT_HEADS,
                      "num_hidden_layers": VT_BLOCKS, "pos_emb_height": VT_POS, "pos_emb_width": VT_POS,
                      "pos_emb_time": 4, "hidden_act": "gelu_pytorch_tanh",
                      "patch_size": VT_PATCH, "init_pos_emb_height": VT_POS, "init_pos_emb_width": VT_POS,
                      "init_pos_emb_time": 4, "pos_emb_type": "divided_fixed", "vt_num_attention_heads": VT_HEADS,
                      "vt_num_hidden_layers": VT_BLOCKS, "vt_hidden_size": VT_HIDDEN,
                      "vt_intermediate_size": VT_INTERMEDIATE, "merge_kernel_size": [2, 2],
                      "video_attn_type": "spatial_temporal", "merge_type": "sd2_tpool",
                      "mm_projector_type": "patchmerger", "mm_hidden_size": VT_HIDDEN, "projector_hidden_act": "gelu",
                      "projector_ln_eps": 1e-5, "text_hidden_size": spec.hidden_size},
                  "quantization_config": quant, "tie_word_embeddings": False, "transformers_version": "4.57.1"}
    return config


def _base_config(spec: SynthSpec) -> dict:
    s = spec
    return {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": s.model_type,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "first_k_dense_replace": s.first_k_dense_replace,
        "hidden_act": "silu",
        "hidden_size": s.hidden_size,
        "initializer_range": 0.02,
        "intermediate_size": s.intermediate_size,
        "kv_lora_rank": s.kv_lora_rank,
        "max_position_embeddings": 4096,
        "moe_intermediate_size": s.moe_intermediate_size,
        "moe_layer_freq": 1,
        "n_group": s.n_group,
        "n_routed_experts": s.n_routed_experts,
        "n_shared_experts": s.n_shared_experts,
        "norm_topk_prob": True,
        "num_attention_heads": s.num_attention_heads,
        "num_experts_per_tok": s.num_experts_per_tok,
        "num_hidden_layers": s.num_hidden_layers,
        "num_key_value_heads": s.num_attention_heads,
        "num_nextn_predict_layers": 1 if s.mtp else 0,
        "q_lora_rank": s.q_lora_rank,
        "qk_nope_head_dim": s.qk_nope_head_dim,
        "qk_rope_head_dim": s.qk_rope_head_dim,
        "rms_norm_eps": 1e-6,
        "rope_scaling": None,
        "rope_theta": 10000,
        "routed_scaling_factor": 2.5,
        "scoring_func": "sigmoid",
        "tie_word_embeddings": False,
        "topk_group": s.topk_group,
        "topk_method": "noaux_tc",
        "torch_dtype": "bfloat16",
        "transformers_version": "4.46.3",
        "use_cache": True,
        "v_head_dim": s.v_head_dim,
        "vocab_size": s.vocab_size,
        "quantization_config": {
            "quant_method": "quark",
            "global_quant_config": {
                "weight": _quant_spec(False), "input_tensors": _quant_spec(True),
                "output_tensors": None, "bias": None,
            },
            "layer_quant_config": layer_quant_config(spec),
            "layer_type_quant_config": {},
            "exclude": exclude_patterns(spec),
            "export": {
                "kv_cache_group": [], "pack_method": "reorder", "weight_format": "real_quantized",
                "weight_merge_groups": None, "min_kv_scale": 0.0,
            },
            "quant_mode": "eager_mode",
            "version": "0.10",
        },
    }


@dataclass(frozen=True)
class Param:
    """One module's stored tensors. ``kind``: "fp4" (weight U8 [N, K/2] + weight_scale U8
    [N, ceil(K/32)] from the logical [N, K]), "fp8" (weight F8_E4M3 [N, K] + weight_scale F32
    [N], one per output channel), "fp8-block" (weight F8_E4M3 [N, K] + weight_scale_inv F32
    [ceil(N/128), ceil(K/128)]), "bf16" (a BF16 weight), "norm" (BF16 around 1), "bias"
    (float32 ``e_score_correction_bias``)."""

    module: str
    shape: tuple[int, ...]
    kind: str

    def tensors(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Stored name -> (shape, dtype)."""
        if self.kind == "fp4":
            n, k = self.shape
            return {f"{self.module}.weight": ((n, k // 2), torch.uint8),
                    f"{self.module}.weight_scale": ((n, ceil_div(k, 32)), torch.uint8)}
        if self.kind == "bias":
            return {f"{self.module}.e_score_correction_bias": (self.shape, torch.float32)}
        if self.kind == "norm-bias":  # a LayerNorm's bias (DeepSeek-V3.2's indexer k_norm)
            return {f"{self.module}.bias": (self.shape, torch.bfloat16)}
        if self.kind == "fp8":
            return {f"{self.module}.weight": (self.shape, torch.float8_e4m3fn),
                    f"{self.module}.weight_scale": ((self.shape[0],), torch.float32)}
        if self.kind == "fp8-block":
            n, k = self.shape
            return {f"{self.module}.weight": (self.shape, torch.float8_e4m3fn),
                    f"{self.module}.weight_scale_inv": ((ceil_div(n, FP8_BLOCK), ceil_div(k, FP8_BLOCK)), torch.float32)}
        return {f"{self.module}.weight": (self.shape, torch.bfloat16)}

    def nbytes(self) -> int:
        total = 0
        for shape, dtype in self.tensors().values():
            total += torch.Size(shape).numel() * dtype.itemsize
        return total


def _layer_params(spec: SynthSpec, layer: int, excluded: list[str]) -> list[Param]:
    s, h = spec, spec.hidden_size
    p = f"model.layers.{layer}"
    mtp = layer == s.num_hidden_layers

    overrides = layer_quant_config(spec)

    def linear(module: str, n: int, k: int) -> Param:
        if is_excluded(module, excluded):
            return Param(module, (n, k), "bf16")
        if spec.variant == "fp8-block":
            return Param(module, (n, k), "fp8-block")
        fp8 = any(fnmatch.fnmatchcase(module, pat) for pat in overrides)  # the only override: FP8 per channel
        return Param(module, (n, k), "fp8" if fp8 else "fp4")

    out = []
    glm = s.model_type == "glm_moe_dsa"  # GLM-5's MTP layer: no embedding or head of its own
    if mtp and not glm:
        out.append(Param(f"{p}.embed_tokens", (s.vocab_size, h), "bf16"))
    if mtp:  # DeepSeek's MTP block: embed, two norms and eh_proj ahead of a normal decoder layer.
        out += [Param(f"{p}.enorm", (h,), "norm"),
                Param(f"{p}.hnorm", (h,), "norm"),
                # The real quirk: eh_proj is BF16 without weight_scale even where not excluded
                # (but in amd/GLM-5.1-MXFP4, which quantizes it: ATOM's deepseek_mtp.py says so).
                Param(f"{p}.eh_proj", (h, 2 * h), "fp4" if s.variant == "experts" else "bf16")]
    heads, qk = s.num_attention_heads, s.qk_nope_head_dim + s.qk_rope_head_dim
    a = f"{p}.self_attn"
    out += [
        Param(f"{p}.input_layernorm", (h,), "norm"),
        linear(f"{a}.q_a_proj", s.q_lora_rank, h),
        Param(f"{a}.q_a_layernorm", (s.q_lora_rank,), "norm"),
        linear(f"{a}.q_b_proj", heads * qk, s.q_lora_rank),
        linear(f"{a}.kv_a_proj_with_mqa", s.kv_lora_rank + s.qk_rope_head_dim, h),
        Param(f"{a}.kv_a_layernorm", (s.kv_lora_rank,), "norm"),
        linear(f"{a}.kv_b_proj", heads * (s.qk_nope_head_dim + s.v_head_dim), s.kv_lora_rank),
        linear(f"{a}.o_proj", h, heads * s.v_head_dim),
    ]
    if s.has_indexer(layer):  # DeepSeek-V3.2's indexer (self_attn.indexer.*), the MTP layer's too
        i = f"{a}.indexer"
        out += [linear(f"{i}.wq_b", s.index_n_heads * s.index_head_dim, s.q_lora_rank),
                linear(f"{i}.wk", s.index_head_dim, h),
                Param(f"{i}.k_norm", (s.index_head_dim,), "norm"), Param(f"{i}.k_norm", (s.index_head_dim,), "norm-bias"),
                Param(f"{i}.weights_proj", (s.index_n_heads, h), "bf16")]  # never quantized (every engine: BF16)
    out += [Param(f"{p}.post_attention_layernorm", (h,), "norm")]

    def mlp(prefix: str, inter: int) -> list[Param]:
        return [linear(f"{prefix}.gate_proj", inter, h), linear(f"{prefix}.up_proj", inter, h),
                linear(f"{prefix}.down_proj", h, inter)]

    if layer < s.first_k_dense_replace:
        out += mlp(f"{p}.mlp", s.intermediate_size)
    else:  # The router is a custom module, never a quantized linear: BF16 whatever the config says.
        out += [Param(f"{p}.mlp.gate", (s.n_routed_experts, h), "bf16"),
                Param(f"{p}.mlp.gate", (s.n_routed_experts,), "bias")]
        for e in range(s.n_routed_experts):
            out += mlp(f"{p}.mlp.experts.{e}", s.moe_intermediate_size)
        out += mlp(f"{p}.mlp.shared_experts", s.moe_intermediate_size * s.n_shared_experts)
    if mtp:
        out.append(Param(f"{p}.shared_head.norm", (h,), "norm"))
    if mtp and not glm:
        out.append(linear(f"{p}.shared_head.head", s.vocab_size, h))
    return out


def plan_groups(spec: SynthSpec) -> list[list[Param]]:
    """Params in file order, grouped into units a shard should not split: the embedding, each
    layer 0..L-1, final norm + lm_head, then the MTP layer L (last, as in DeepSeek's repo)."""
    excluded = exclude_patterns(spec)
    h = spec.hidden_size
    groups = [[Param("model.embed_tokens", (spec.vocab_size, h), "bf16")]]
    groups += [_layer_params(spec, layer, excluded) for layer in range(spec.num_hidden_layers)]
    lm_head = "bf16" if is_excluded("lm_head", excluded) else "fp4"
    groups.append([Param("model.norm", (h,), "norm"), Param("lm_head", (spec.vocab_size, h), lm_head)])
    if spec.mtp:
        groups.append(_layer_params(spec, spec.num_hidden_layers, excluded))
    if spec.multimodal:
        groups = [[replace(p, module=LANGUAGE_MODEL + p.module) for p in g] for g in groups] + _vision_params(spec.hidden_size)
    return groups


LANGUAGE_MODEL = "language_model."  # Kimi-K2.5's prefix of every language-model tensor
# The multimodal preset's vision tower (MoonViT, Kimi-K2.5's names and shapes at tiny widths)
VT_HIDDEN, VT_INTERMEDIATE, VT_BLOCKS, VT_HEADS, VT_PATCH, VT_POS = 32, 64, 2, 2, 14, 4


def _vision_params(text_hidden: int) -> list[list[Param]]:
    """MoonViT's tensors and the patch-merger projector's (Kimi-K2.5: ``vision_tower.*``,
    ``mm_projector.*``, every linear and LayerNorm with its bias), one group each."""
    def with_bias(module: str, shape: tuple[int, ...], kind: str = "bf16") -> list[Param]:
        return [Param(module, shape, kind), Param(module, (shape[0],), "norm-bias")]

    h, merged = VT_HIDDEN, VT_HIDDEN * 4  # the projector reads 2x2 merged patches
    vt = "vision_tower"
    groups = [with_bias(f"{vt}.patch_embed.proj", (h, 3, VT_PATCH, VT_PATCH))
              + [Param(f"{vt}.patch_embed.pos_emb", (VT_POS, VT_POS, h), "bf16")]]
    for b in range(VT_BLOCKS):
        p = f"{vt}.encoder.blocks.{b}"
        groups.append(with_bias(f"{p}.norm0", (h,), "norm") + with_bias(f"{p}.wqkv", (3 * h, h))
                      + with_bias(f"{p}.wo", (h, h)) + with_bias(f"{p}.norm1", (h,), "norm")
                      + with_bias(f"{p}.mlp.fc0", (VT_INTERMEDIATE, h)) + with_bias(f"{p}.mlp.fc1", (h, VT_INTERMEDIATE)))
    groups.append(with_bias(f"{vt}.encoder.final_layernorm", (h,), "norm")
                  + with_bias("mm_projector.pre_norm", (h,), "norm") + with_bias("mm_projector.proj.0", (merged, merged))
                  + with_bias("mm_projector.proj.2", (text_hidden, merged)))
    return groups


def tensor_specs(spec: SynthSpec) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Every stored tensor of the checkpoint: name -> (shape, dtype), without generating data."""
    return {name: sd for group in plan_groups(spec) for p in group for name, sd in p.tensors().items()}


def _generator(spec: SynthSpec, name: str) -> torch.Generator:
    # Seeded per tensor, so a tensor's bytes do not depend on shard layout or generation order.
    digest = hashlib.sha256(f"{spec.seed}:{name}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))


def _random_uint8(shape: tuple[int, ...], g: torch.Generator, low: int = 0, high: int = 256) -> torch.Tensor:
    n = torch.Size(shape).numel()
    if (low, high) == (0, 256):  # int32 draws give 4 bytes per RNG call: ~3x faster for GBs.
        words = torch.randint(-(2**31), 2**31 - 1, (ceil_div(n, 4),), dtype=torch.int32, generator=g)
        return words.view(torch.uint8)[:n].reshape(shape).clone()
    return torch.randint(low, high, shape, dtype=torch.uint8, generator=g)


def _materialize(spec: SynthSpec, p: Param) -> dict[str, torch.Tensor]:
    g = _generator(spec, p.module + ("#bias" if p.kind in ("bias", "norm-bias") else ""))
    names = list(p.tensors())
    if p.kind == "norm":
        return {names[0]: (1.0 + 0.05 * torch.randn(p.shape, generator=g)).to(torch.bfloat16)}
    if p.kind == "bias":
        return {names[0]: 0.01 * torch.randn(p.shape, generator=g)}
    if p.kind == "norm-bias":
        return {names[0]: (0.01 * torch.randn(p.shape, generator=g)).to(torch.bfloat16)}
    if p.kind == "bf16":
        out = torch.empty(p.shape, dtype=torch.bfloat16)
        for rows in _row_blocks(p.shape):
            out[rows] = (0.02 * torch.randn(out[rows].shape, generator=g)).to(torch.bfloat16)
        return {names[0]: out}
    n, k = p.shape
    if p.kind == "fp8-block":  # per 128x128 block: scale_inv = block amax / 448, codes nearest even
        w = torch.empty((n, k), dtype=torch.float8_e4m3fn)
        nb, kb = ceil_div(n, FP8_BLOCK), ceil_div(k, FP8_BLOCK)
        scale = torch.empty((nb, kb), dtype=torch.float32)
        for r in range(nb):  # a band of 128 rows at a time: blocks never span bands
            rows = slice(r * FP8_BLOCK, min(n, (r + 1) * FP8_BLOCK))
            x = (0.02 * torch.randn((rows.stop - rows.start, k), generator=g)).to(torch.bfloat16).float()
            for c in range(kb):
                cols = slice(c * FP8_BLOCK, min(k, (c + 1) * FP8_BLOCK))
                s = (x[:, cols].abs().amax() / FP8_MAX).clamp_min(1e-12)
                w[rows, cols] = (x[:, cols] / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
                scale[r, c] = s
        return {names[0]: w, names[1]: scale}
    if p.kind == "fp8":  # per output channel: scale = row amax / 448, codes rounded to nearest even
        w = torch.empty((n, k), dtype=torch.float8_e4m3fn)
        scale = torch.empty((n,), dtype=torch.float32)
        for rows in _row_blocks((n, k)):
            x = (0.02 * torch.randn((rows.stop - rows.start, k), generator=g)).to(torch.bfloat16).float()
            s = (x.abs().amax(dim=1) / FP8_MAX).clamp_min(1e-12)
            w[rows] = (x / s[:, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
            scale[rows] = s
        return {names[0]: w, names[1]: scale}
    if spec.random_bytes:
        return {names[0]: _random_uint8((n, k // 2), g), names[1]: _random_uint8((n, ceil_div(k, 32)), g, 118, 127)}
    # Rows spread over 2^-2..2^2 so scale bytes vary across rows, as in trained weights.
    row_scale = torch.exp2(4.0 * torch.rand((n, 1), generator=g) - 2.0)
    packed = torch.empty((n, k // 2), dtype=torch.uint8)
    scale = torch.empty((n, ceil_div(k, 32)), dtype=torch.uint8)
    for rows in _row_blocks((n, k)):  # MXFP4 blocks run along rows: a block of rows quantizes alone
        w = (0.02 * torch.randn((rows.stop - rows.start, k), generator=g) * row_scale[rows]).to(torch.bfloat16)
        packed[rows], scale[rows] = layouts.quantize(w, layouts.QUARK)  # bytes as Quark's exporter writes them
    return {names[0]: packed, names[1]: scale}


def _row_blocks(shape: tuple[int, ...], block_bytes: int = 64 << 20) -> list[slice]:
    """Blocks of whole rows of about ``block_bytes`` of float32: drawing a tensor at once held it
    several times over in float32 (9.3 GB for the real-dims preset's 1.8 GiB embedding)."""
    if len(shape) < 2:
        return [slice(0, shape[0] if shape else 1)]
    per_row = 4 * math.prod(shape[1:])
    step = max(1, block_bytes // per_row)
    return [slice(r, min(shape[0], r + step)) for r in range(0, shape[0], step)]


def _shard_cuts(sizes: list[int], group_ends: list[int], n: int) -> list[int]:
    """Cut indices ``[0, c1, ..., len(sizes)]`` splitting items into n non-empty shards of roughly
    equal bytes. Cuts fall on group ends when there are enough of them; else anywhere."""
    if n > len(sizes):
        raise ValueError(f"cannot write {n} shards of only {len(sizes)} modules")
    inner = [c for c in group_ends if 0 < c < len(sizes)]
    allowed = inner if len(inner) >= n - 1 else list(range(1, len(sizes)))
    cum = [0]
    for size in sizes:
        cum.append(cum[-1] + size)
    cuts, j = [0], -1
    for k in range(1, n):
        target = cum[-1] * k / n
        # Leave enough allowed cuts after this one for the shards still to come.
        choices = range(j + 1, len(allowed) - (n - 1 - k))
        j = min(choices, key=lambda i: abs(cum[allowed[i]] - target))
        cuts.append(allowed[j])
    return cuts + [len(sizes)]


def _write_json(path: Path, obj: object) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _tokenizer_files() -> dict[str, object]:
    """Tiny tokenizer files: only their bytes matter (copy-through), but they look like V3's."""
    bos, eos = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
    special = [bos, eos]
    vocab = {tok: i for i, tok in enumerate(special + [chr(c) for c in range(33, 127)])}
    added = [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": True, "special": True} for i, t in enumerate(special)]
    tokenizer = {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added, "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
        "post_processor": None, "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True,
                                            "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "vocab": vocab, "merges": []},
    }
    tok_config = {
        "add_bos_token": True, "add_eos_token": False, "bos_token": bos, "eos_token": eos, "pad_token": eos,
        "clean_up_tokenization_spaces": False, "legacy": True, "model_max_length": 4096,
        "tokenizer_class": "LlamaTokenizerFast", "unk_token": None,
    }
    gen_config = {"_from_model_config": True, "bos_token_id": 0, "eos_token_id": 1, "do_sample": True,
                  "temperature": 0.6, "top_p": 0.95, "transformers_version": "4.46.3"}
    return {"tokenizer.json": tokenizer, "tokenizer_config.json": tok_config, "generation_config.json": gen_config}


def write_checkpoint(spec: SynthSpec, out_dir: str | Path,
                     progress: Callable[[int, int], None] | None = None) -> Path:
    """Write the checkpoint of ``spec`` into ``out_dir`` (created; must be absent or empty).

    Writes ``config.json``, the shards ``model-0000i-of-0000N.safetensors``,
    ``model.safetensors.index.json``, ``generation_config.json``, ``tokenizer_config.json`` and
    ``tokenizer.json``. Tensors are generated shard by shard, each in blocks of rows, so peak
    memory is about twice the largest shard (safetensors serializes a shard in memory): 4.1 GB
    for the real-dims preset, whose largest shard (the embedding's) is 1.85 GB; 1.3 GB for bench.
    ``progress(done, total)`` is called with bytes generated after each tensor. Returns
    ``out_dir`` as a Path.
    """
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"refusing to write a checkpoint into {out}: it exists and is not an empty directory")
    groups = plan_groups(spec)
    params = [p for group in groups for p in group]
    ends, count = [], 0
    for group in groups:
        count += len(group)
        ends.append(count)
    cuts = _shard_cuts([p.nbytes() for p in params], ends, spec.num_shards)
    out.mkdir(parents=True, exist_ok=True)

    weight_map: dict[str, str] = {}
    total, planned, made = 0, sum(p.nbytes() for p in params), 0
    for i in range(spec.num_shards):
        fname = f"model-{i + 1:05d}-of-{spec.num_shards:05d}.safetensors"
        tensors: dict[str, torch.Tensor] = {}
        for p in params[cuts[i]:cuts[i + 1]]:
            tensors.update(_materialize(spec, p))
            made += p.nbytes()
            if progress:
                progress(made, planned)
        save_file(tensors, str(out / fname), metadata={"format": "pt"})
        for name, t in tensors.items():
            weight_map[name] = fname
            total += t.numel() * t.element_size()
        del tensors
    _write_json(out / "model.safetensors.index.json",
                {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))})
    _write_json(out / "config.json", build_config(spec))
    for name, obj in _tokenizer_files().items():
        _write_json(out / name, obj)
    return out


# Started by run_measured: runs the command and writes its ru_maxrss (KiB) to $PREP_MAXRSS_FILE.
# A child's ru_maxrss is at least its parent's resident size when it was forked (exec records the
# old address space's high-water mark), so the command is forked from this small interpreter,
# not from the caller (a test process holding torch and a checkpoint).
_LAUNCHER = """import os, subprocess, sys
p = subprocess.Popen(sys.argv[1:])
_, status, usage = os.wait4(p.pid, 0)
with open(os.environ["PREP_MAXRSS_FILE"], "w") as f:
    f.write(str(usage.ru_maxrss))
sys.exit(os.waitstatus_to_exitcode(status))
"""


def drop_tensors(folder: Path, gone: Callable[[str], bool]) -> None:
    """Remove the tensors ``gone(name)`` picks from a written checkpoint's shards and its index (a
    checkpoint whose producer left them out: e.g. an MTP layer without its own head)."""
    from safetensors.torch import load_file

    index_path = Path(folder) / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    for shard in sorted(Path(folder).glob("model-0000*.safetensors")):
        tensors = load_file(shard)
        if any(gone(n) for n in tensors):
            save_file({n: t for n, t in tensors.items() if not gone(n)}, shard, metadata={"format": "pt"})
    index["weight_map"] = {n: f for n, f in index["weight_map"].items() if not gone(n)}
    _write_json(index_path, index)


def edit_at_same_size(path: Path) -> None:
    """A user's edit of a JSON side file that keeps its size: its first digit changed
    (``"temperature": 0.6`` -> ``0.7``), which a check by size alone cannot tell."""
    raw = Path(path).read_bytes()
    digit = next(i for i, b in enumerate(raw) if chr(b).isdigit())
    Path(path).write_bytes(raw[:digit] + (b"7" if raw[digit:digit + 1] != b"7" else b"8") + raw[digit + 1:])


def as_format_3(folder: Path) -> bytes:
    """Rewrite the converted ``folder`` (manifest format 4) as versions 1-3 wrote it: the source
    tensor table back inside the manifest as ``source.tensors``, ``prep-source.json`` removed,
    the completion marker resealed. Returns the manifest's new bytes. Rewrites the three files in
    place: give it a copy (never hard links of them)."""
    from layouts.manifest import COMPLETE_NAME, MANIFEST_NAME, SOURCE_TABLE_NAME, manifest_hash

    m = json.loads((folder / MANIFEST_NAME).read_bytes())
    m["source"]["tensors"] = json.loads((folder / SOURCE_TABLE_NAME).read_bytes())["tensors"]
    del m["source"]["tensors_file"]
    m["format_version"] = 3
    raw = json.dumps(m, separators=(",", ":")).encode()
    (folder / MANIFEST_NAME).write_bytes(raw)
    marker = json.loads((folder / COMPLETE_NAME).read_bytes())
    (folder / COMPLETE_NAME).write_text(json.dumps({**marker, "manifest_sha256": manifest_hash(raw)}))
    (folder / SOURCE_TABLE_NAME).unlink()
    return raw


def run_measured(cmd: list[str], env: dict[str, str] | None = None, cwd: str | None = None) -> tuple[int, int, str]:
    """Run ``cmd`` as a process of its own, in ``cwd``: (exit code, its peak resident memory in
    bytes, its output). The peak is the kernel's high-water mark (``ru_maxrss``): anonymous
    memory and the mapped file pages it touched, as ``top`` and the OOM killer count them.
    (``python -m`` puts ``cwd`` first on the path, ahead of PYTHONPATH.)"""
    import os
    import subprocess
    import sys
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        where = os.path.join(tmp, "maxrss")
        proc = subprocess.run([sys.executable, "-c", _LAUNCHER, *cmd], cwd=cwd, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, env={**os.environ, **(env or {}), "PREP_MAXRSS_FILE": where})
        with open(where) as f:
            peak = int(f.read()) * 1024
    return proc.returncode, peak, proc.stdout.decode(errors="replace")
