"""A synthetic checkpoint's ``config.json``: the architecture's keys at the spec's dims and the
Quark ``quantization_config`` of its recipe (exclude list, per-layer overrides)."""

from __future__ import annotations

import fnmatch
import re

from layouts.dequant import FP8_BLOCK  # DeepSeek's FP8 release: one scale per 128x128 block of a weight

from .spec import VT_BLOCKS, VT_HEADS, VT_HIDDEN, VT_INTERMEDIATE, VT_PATCH, VT_POS, SynthSpec

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
