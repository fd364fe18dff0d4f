"""What a synthetic checkpoint is: :class:`SynthSpec` (its dims, quant recipe and family), the
recipes (``VARIANTS``) and the named presets (``PRESETS``)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

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

LANGUAGE_MODEL = "language_model."  # Kimi-K2.5's prefix of every language-model tensor
# The multimodal preset's vision tower (MoonViT, Kimi-K2.5's names and shapes at tiny widths)
VT_HIDDEN, VT_INTERMEDIATE, VT_BLOCKS, VT_HEADS, VT_PATCH, VT_POS = 32, 64, 2, 2, 14, 4
