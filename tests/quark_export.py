"""A real amd-quark export to test against: a tiny transformers-5 DeepseekV3 with seeded random
weights, its routed experts unfused into per-expert linears (quark's own preprocessing), then
quantized by amd-quark 0.13 to MXFP4 weight-only and exported in Quark's Hugging Face format:
per-expert uint8 ``weight`` + ``weight_scale``, as amd/DeepSeek-R1-0528-MXFP4 stores them.

transformers' quark integration cannot load per-expert MXFP4 experts (facts page, section 8),
so the reference forward is quark's own in-memory model, which the export reloads into exactly
(quark's ``import_model_from_safetensors`` gives identical logits; checked when this was
written). Router and lm_head stay BF16, attention, dense MLP and all experts are MXFP4.
"""

from __future__ import annotations

import os
import pathlib

import torch

CONFIG = dict(hidden_size=256, q_lora_rank=128, kv_lora_rank=128, qk_nope_head_dim=32, qk_rope_head_dim=16,
              v_head_dim=32, num_attention_heads=8, num_key_value_heads=8, intermediate_size=512,
              moe_intermediate_size=256, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=2,
              topk_group=1, first_k_dense_replace=1, num_hidden_layers=3, vocab_size=1024,
              max_position_embeddings=256, rope_scaling=None, tie_word_embeddings=False, dtype="bfloat16")


def available() -> bool:
    try:
        import quark.torch  # noqa: F401
        import transformers  # noqa: F401
    except Exception:  # noqa: BLE001 - any failure means the oracle cannot run here
        return False
    return True


@torch.no_grad()
def build_model(seed: int = 0, std: float = 0.05):
    """The BF16 model with weights from our own generator (independent of transformers' init)."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    # _from_config(dtype=bf16) keeps RoPE's inv_freq, the router and the correction bias in
    # float32, as from_pretrained does (.to(bf16) would round inv_freq too).
    model = DeepseekV3ForCausalLM._from_config(DeepseekV3Config(**CONFIG), dtype=torch.bfloat16)
    for mod in model.modules():  # the router weight is BF16 in R1's checkpoint
        if type(mod).__name__ == "DeepseekV3TopkRouter":
            mod.weight.data = mod.weight.data.to(torch.bfloat16)
    gen = torch.Generator().manual_seed(seed)
    for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
        vals = 1.0 + 0.1 * torch.randn(p.shape, generator=gen) if name.endswith("norm.weight") else \
            std * torch.randn(p.shape, generator=gen)
        p.copy_(vals.to(torch.bfloat16).to(p.dtype))
    for name, b in sorted(model.named_buffers(), key=lambda kv: kv[0]):
        if name.endswith("e_score_correction_bias"):
            b.copy_((0.01 * torch.randn(b.shape, generator=gen)).to(torch.bfloat16).to(b.dtype))
    return model.eval()


def export(out: pathlib.Path, seed: int = 0, scheme: str = "mxfp4_weight_only",
           exclude_layers: list[str] | None = None, layer_config: dict[str, str] | None = None):
    """Quantize and export into ``out``; returns quark's quantized in-memory model. ``scheme``
    "mxfp4": weights and activations (dynamic), as amd/DeepSeek-R1-0528-MXFP4 is; with
    ``exclude_layers`` None there the deepseek_v3 template's own excludes (attention BF16, as
    that checkpoint's card). ``layer_config``: per-pattern schemes, e.g. ``{"*self_attn*":
    "ptpc_fp8"}``, the FP8 per-channel attention of MTP-MoEFP4 (quark 0.13 writes its scales as
    BF16 ``[N]``)."""
    os.environ.setdefault("QUARK_LOG_LEVEL", "warning")
    from quark.torch import LLMTemplate, ModelQuantizer, export_safetensors
    from quark.torch.utils.llm import preprocess_for_quantization

    model = build_model(seed)
    preprocess_for_quantization(model)  # fused 3-D experts -> per-expert nn.Linear, as in R1
    # The template's default also excludes attention (R1-0528's card); weight-only keeps it MXFP4.
    if exclude_layers is None and scheme == "mxfp4_weight_only":
        exclude_layers = ["*mlp.gate", "lm_head"]
    qcfg = LLMTemplate.get("deepseek_v3").get_config(
        scheme=scheme, **({} if exclude_layers is None else {"exclude_layers": exclude_layers}),
        **({} if layer_config is None else {"layer_config": layer_config}))
    with torch.no_grad():  # dynamic activation scales: no calibration data either way
        model = ModelQuantizer(qcfg).quantize_model(model, None)
    export_safetensors(model, str(out), custom_mode="quark", weight_format="real_quantized", pack_method="reorder")
    return model
