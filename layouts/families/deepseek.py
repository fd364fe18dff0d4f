"""The DeepSeek-V3 family's tables: DeepSeek-V2/V3/R1 (MLA attention, DeepSeek MoE with a shared
expert and a grouped router, the MTP layer after the decoder layers); Kimi-K2, which is that
model at other sizes (384 routed experts, 64 heads, no MTP layer) under its own model type;
Kimi-K2.5, Kimi-K2 inside a multimodal checkpoint (``language_model.`` before every text tensor, a
vision tower and its projector beside them); DeepSeek-V3.2, which adds a sparse-attention indexer to every layer; and GLM-5, V3.2's layers
under Zhipu's model type, at its own sizes, with an MTP layer that has no embedding or head of its
own.

The TP splits are what every engine profiled here holds (ATOM, SGLang 0.5.23, vLLM 0.34.0: read
in each one's DeepSeek model code and checked against its real load): embeddings and heads
vocabulary parallel (rows; the MTP layer's own too), q_b / q_proj / kv_b column parallel (rows),
o_proj and down row parallel (columns), gate and up column parallel (rows). q_a and kv_a are held
whole (every engine merges them into one replicated module); the routed experts are stacked by the
MoE planner, not split here.
"""

from __future__ import annotations

from . import (ALWAYS, COLS, DENSE, EXPERTS, INDEXED, MOE, NO_Q_LORA, Q_LORA, ROWS, SHARED, WHOLE, Family, Module,
               Wrapper, register_family)

_ATTN = dict(attention=True)

LAYER = (
    Module("input_layernorm", "norm"),
    Module("self_attn.q_a_proj", "q_a_proj", WHOLE, when=Q_LORA, **_ATTN),
    Module("self_attn.q_a_layernorm", "norm", when=Q_LORA, **_ATTN),
    Module("self_attn.q_b_proj", "q_b_proj", ROWS, when=Q_LORA, **_ATTN),
    Module("self_attn.q_proj", "q_proj", ROWS, when=NO_Q_LORA, **_ATTN),
    Module("self_attn.kv_a_proj_with_mqa", "kv_a_proj", WHOLE, **_ATTN),
    Module("self_attn.kv_a_layernorm", "norm", **_ATTN),
    Module("self_attn.kv_b_proj", "kv_b_proj", ROWS, **_ATTN),
    Module("self_attn.o_proj", "o_proj", COLS, **_ATTN),
    Module("post_attention_layernorm", "norm"),
    Module("mlp.gate", "router", when=MOE, extra=("e_score_correction_bias",)),
    Module("mlp.experts.{e}.gate_proj", "routed_expert", when=EXPERTS),
    Module("mlp.experts.{e}.up_proj", "routed_expert", when=EXPERTS),
    Module("mlp.experts.{e}.down_proj", "routed_expert", when=EXPERTS),
    Module("mlp.shared_experts.gate_proj", "shared_expert", ROWS, when=SHARED),
    Module("mlp.shared_experts.up_proj", "shared_expert", ROWS, when=SHARED),
    Module("mlp.shared_experts.down_proj", "shared_expert", COLS, when=SHARED),
    Module("mlp.gate_proj", "dense_mlp", ROWS, when=DENSE),
    Module("mlp.up_proj", "dense_mlp", ROWS, when=DENSE),
    Module("mlp.down_proj", "dense_mlp", COLS, when=DENSE),
)

# What an MTP layer holds beside a decoder layer's modules (DeepSeek's modeling code; every engine's
# DeepSeekMTP): its own embedding and head (which engines may share with the target's), the two norms
# of its inputs, the projection of their concatenation, and the head's norm.
MTP = (
    Module("embed_tokens", "embedding", ROWS),
    Module("enorm", "norm"),
    Module("hnorm", "norm"),
    Module("eh_proj", "mtp_eh_proj"),
    Module("shared_head.norm", "norm"),
    Module("shared_head.head", "head", ROWS),
)

BEFORE = (Module("model.embed_tokens", "embedding", ROWS),)
AFTER = (Module("model.norm", "norm"), Module("lm_head", "head", ROWS))

# DeepSeek-V3.2's sparse-attention indexer, in every layer and the MTP layer's: it scores the
# cached tokens for each query (index_n_heads heads of index_head_dim) and attention reads only the
# index_topk best. ATOM, vLLM 0.34.0 and SGLang 0.5.23 all hold it whole on every rank (replicated
# linears; ATOM and vLLM merge wk with weights_proj at load, SGLang on ROCm keeps them apart).
INDEXER = (
    Module("self_attn.indexer.wq_b", "indexer", when=INDEXED, **_ATTN),
    Module("self_attn.indexer.wk", "indexer", when=INDEXED, **_ATTN),
    Module("self_attn.indexer.k_norm", "norm", extra=("bias",), when=INDEXED, **_ATTN),
    Module("self_attn.indexer.weights_proj", "indexer", when=INDEXED, **_ATTN),
)

DEEPSEEK_V3 = register_family(Family(
    "deepseek-v3", "DeepSeek-V2/V3", ("DeepseekV3ForCausalLM", "DeepseekV2ForCausalLM"), ("deepseek_v3", "deepseek_v2"),
    BEFORE, LAYER, AFTER, MTP,
))

KIMI_K2 = register_family(Family(
    "kimi-k2", "Kimi-K2", (), ("kimi_k2",), BEFORE, LAYER, AFTER, MTP,
))

# Kimi-K2.5 (KimiK25ForConditionalGeneration, model_type kimi_k25): Kimi-K2's language model under
# "language_model." (language_model.model.layers.N..., language_model.lm_head), its config.json keys
# under text_config (AMD's Quark exports keep quantization_config at the top, where ATOM reads it), and
# MoonViT's vision tower and the patch-merger projector beside it (vision_tower.*, mm_projector.*: BF16,
# Quark excludes both). ATOM serves the text only and skips those (its kimi_k25.py skip_weight_prefixes).
KIMI_K25 = register_family(Family(
    "kimi-k2.5", "Kimi-K2.5", ("KimiK25ForConditionalGeneration",), ("kimi_k25",), BEFORE, LAYER, AFTER, MTP,
    twist="multimodal: Kimi-K2 under language_model., a vision tower beside it",
    wrapper=Wrapper("language_model.", "text_config", ("vision_tower.", "mm_projector.")),
))

DEEPSEEK_V32 = register_family(Family(
    "deepseek-v3.2", "DeepSeek-V3.2", ("DeepseekV32ForCausalLM",), ("deepseek_v32",), BEFORE,
    (*LAYER[:9], *INDEXER, *LAYER[9:]), AFTER, MTP, twist="sparse-attention indexer", dense_up_to="index_topk",
))

# GLM-5 / GLM-5.1 (GlmMoeDsaForCausalLM, model_type glm_moe_dsa): DeepSeek-V3.2's modules under the
# same names, the indexer in every layer, and an MTP layer (model.layers.78 in GLM-5) that holds no
# embedding and no shared_head.head: every engine's draft uses the target's (transformers'
# modeling_glm_moe_dsa; ATOM's drafter, SGLang's NextN and vLLM's proposer share them). ATOM holds
# GLM's embedding whole on every rank (its own choice, in its profile), the others vocabulary
# parallel. GLM-5.2 (IndexShare) gives an indexer only to the layers its indexer_types marks "full"
# (every fourth after the first three); the others reuse the last full layer's top-k and hold none.
GLM_MTP = tuple(m for m in MTP if m.name not in ("embed_tokens", "shared_head.head"))

GLM_5 = register_family(Family(
    "glm-5", "GLM-5", ("GlmMoeDsaForCausalLM",), ("glm_moe_dsa",), BEFORE, DEEPSEEK_V32.layer, AFTER, GLM_MTP,
    twist="sparse-attention indexer", dense_up_to="index_topk",
))

__all__ = ["DEEPSEEK_V3", "DEEPSEEK_V32", "GLM_5", "KIMI_K2", "KIMI_K25"]
