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
import sys

import torch

CONFIG = dict(hidden_size=256, q_lora_rank=128, kv_lora_rank=128, qk_nope_head_dim=32, qk_rope_head_dim=16,
              v_head_dim=32, num_attention_heads=8, num_key_value_heads=8, intermediate_size=512,
              moe_intermediate_size=256, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=2,
              topk_group=1, first_k_dense_replace=1, num_hidden_layers=3, vocab_size=1024,
              max_position_embeddings=256, rope_scaling=None, tie_word_embeddings=False, dtype="bfloat16")


EXPERTS_DECORATOR = "use_experts_implementation"


def import_quark_torch() -> None:
    """``import quark.torch``, with its scan of transformers narrowed to the files that can match.

    quark.torch's import walks every transformers ``modeling_*.py`` (538 in transformers 5.24)
    through ``ast.parse`` to find the classes decorated ``@use_experts_implementation`` and registers
    them (``_find_decorated_experts_classes``): 10.5 s of ``compile`` in an import of 16.1 s on the
    2-core CI machine, in every test process that exports. A file whose text does not hold that
    name holds no such decorator, so the scan's parse of it is answered with an empty module; every
    file that does (67) is parsed and imported as before. The same classes are found and
    registered (checked when this was written: ``PREPROCESS_REGISTRY``'s 73 entries identical, in
    the same order), and the import takes 7.6 s. Only the scan's own calls are narrowed (by the
    caller's name)."""
    import ast

    if "quark.torch" in sys.modules:
        return
    parse = ast.parse

    def narrowed(source, *args, **kwargs):
        if sys._getframe(1).f_code.co_name == "_find_decorated_experts_classes" and \
                EXPERTS_DECORATOR not in (source if isinstance(source, str) else source.decode()):
            return ast.Module(body=[], type_ignores=[])
        return parse(source, *args, **kwargs)

    ast.parse = narrowed
    try:
        import quark.torch  # noqa: F401
    finally:
        ast.parse = parse


def available() -> bool:
    try:
        import transformers  # noqa: F401

        import_quark_torch()
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
    import_quark_torch()
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
