"""ATOM's DeepSeek models for one rank as ATOM allocates their parameters before loading (its
``create_weights``: shapes from config.json alone, not from a manifest), without ATOM: the
stand-ins tests/test_atom_adapter.py installs converted checkpoints into, and
scripts/bench.py install measures the device memory of installing on a GPU. Each parameter is
made on torch's default device."""

import torch

FP4 = getattr(torch, "float4_e2m1fn_x2", torch.uint8)
E8M0 = getattr(torch, "float8_e8m0fnu", torch.uint8)


class Fp4Linear(torch.nn.Module):
    """ATOM's LinearBase for MXFP4: weight (out, in/2) fp4x2, weight_scale (out, in/32) e8m0."""

    def __init__(self, out_features, in_features):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(out_features, in_features // 2, dtype=torch.uint8).view(FP4),
                                         requires_grad=False)
        self.weight_scale = torch.nn.Parameter(torch.zeros(out_features, in_features // 32, dtype=torch.uint8).view(E8M0),
                                               requires_grad=False)
        self.processed = 0

    def process_weights_after_loading(self):
        self.processed += 1  # ATOM would shuffle_weights + e8m0_shuffle here


class Mxfp4MoEMethod:
    def __init__(self, hidden_pad, intermediate_pad):
        self.hidden_pad, self.intermediate_pad, self.processed = hidden_pad, intermediate_pad, 0

    def process_weights_after_loading(self, layer):
        self.processed += 1  # ATOM would moe_shuffle_weight / moe_shuffle_scale here


class FusedMoE(torch.nn.Module):
    """ATOM's FusedMoE + Mxfp4MoEMethod.create_weights: padded to 256, uint8 scales."""

    def __init__(self, n_local, inter, hidden, align=256):
        super().__init__()
        ip, hp = -(-inter // align) * align, -(-hidden // align) * align
        z = lambda *s: torch.nn.Parameter(torch.zeros(*s, dtype=torch.uint8), requires_grad=False)  # noqa: E731
        self.w13_weight, self.w13_weight_scale = z(n_local, 2 * ip, hp // 2), z(n_local, 2 * ip, hp // 32)
        self.w2_weight, self.w2_weight_scale = z(n_local, hp, ip // 2), z(n_local, hp, ip // 32)
        self.quant_method = Mxfp4MoEMethod(hp - hidden, ip - inter)


def bf16(*shape):
    return torch.nn.Parameter(torch.zeros(*shape, dtype=torch.bfloat16), requires_grad=False)


def atom_decoder_layer(cfg, i, tp, ep=1, mxfp4_attention=True, full=False, mxfp4_experts=True):
    """ATOM's DeepseekV2DecoderLayer ``i`` for one rank: its MXFP4 modules, and with ``full`` its
    BF16 parameters too (norms, router and its bias, BF16 attention, BF16 experts), shaped as
    ATOM's layer classes allocate them for the rank (split, merged, stacked). With BF16 attention
    (r1-0528) ATOM builds plain BF16 linears there."""
    h, heads = cfg["hidden_size"], cfg["num_attention_heads"] // tp
    nope, rope, v = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    q_lora, kv_lora = cfg["q_lora_rank"], cfg["kv_lora_rank"]
    n_routed = cfg["n_routed_experts"]
    layer = torch.nn.Module()
    attn = torch.nn.Module()
    shapes = {"fused_qkv_a_proj": (q_lora + kv_lora + rope, h), "q_b_proj": (heads * (nope + rope), q_lora),
              "kv_b_proj": (heads * (nope + v), kv_lora), "o_proj": (h, heads * v)}
    for module, (n, k) in shapes.items():
        if mxfp4_attention:
            setattr(attn, module, Fp4Linear(n, k))
        elif full:
            setattr(attn, module, torch.nn.Module())
            getattr(attn, module).weight = bf16(n, k)
    layer.self_attn = attn
    mlp = torch.nn.Module()
    if i < cfg["first_k_dense_replace"]:
        mlp.gate_up_proj = Fp4Linear(2 * cfg["intermediate_size"] // tp, h)
        mlp.down_proj = Fp4Linear(h, cfg["intermediate_size"] // tp)
    else:
        inter = cfg["moe_intermediate_size"] // (1 if ep > 1 else tp)
        n_local = (n_routed // ep if ep > 1 else n_routed) + 1  # + the fused shared expert
        if mxfp4_experts:
            mlp.experts = FusedMoE(n_local, inter, h)
        elif full:  # ATOM's UnquantizedFusedMoEMethod: BF16 w13 [E, 2I, H] and w2 [E, H, I], no pad
            mlp.experts = torch.nn.Module()
            mlp.experts.w13_weight, mlp.experts.w2_weight = bf16(n_local, 2 * inter, h), bf16(n_local, h, inter)
        if full:
            mlp.gate = torch.nn.Module()
            mlp.gate.weight = bf16(n_routed, h)
            mlp.gate.e_score_correction_bias = bf16(n_routed)  # ATOM holds it in BF16 (the checkpoint: F32)
    layer.mlp = mlp
    if full:
        for norm in ("input_layernorm", "post_attention_layernorm"):
            setattr(layer, norm, torch.nn.Module())
            getattr(layer, norm).weight = bf16(h)
        for norm, dim in (("q_a_layernorm", q_lora), ("kv_a_layernorm", kv_lora)):
            setattr(attn, norm, torch.nn.Module())
            getattr(attn, norm).weight = bf16(dim)
    return layer


def atom_like_model(cfg, tp, ep=1, mxfp4_attention=True, full=False):
    """ATOM's DeepseekV2ForCausalLM for one rank: num_hidden_layers layers, no MTP layer (ATOM's
    DeepseekV2Model makes only those; the MTP layer is the draft model's). Its MXFP4 modules, and
    with ``full`` every parameter (embedding and lm_head split by vocabulary rows)."""
    root = torch.nn.Module()
    model = torch.nn.Module()
    root.model = model
    model.layers = torch.nn.ModuleList(atom_decoder_layer(cfg, i, tp, ep, mxfp4_attention, full)
                                       for i in range(cfg["num_hidden_layers"]))
    if full:
        h, vocab = cfg["hidden_size"], cfg["vocab_size"]
        model.embed_tokens, model.norm, root.lm_head = torch.nn.Module(), torch.nn.Module(), torch.nn.Module()
        model.embed_tokens.weight, model.norm.weight, root.lm_head.weight = bf16(vocab // tp, h), bf16(h), \
            bf16(vocab // tp, h)
    return root


def atom_like_draft_model(cfg, tp, ep=1, bf16_layer=False):
    """ATOM's DeepSeekMTP draft model as atom/models/deepseek_mtp.py (ROCm/ATOM ffdf3bb5) names it:
    model.layers is a ModuleDict keyed by the checkpoint's layer index N = num_hidden_layers + i;
    each layer holds enorm, hnorm, eh_proj (BF16: excluded by ATOM when the checkpoint has no
    eh_proj.weight_scale) and shared_head, and the decoder layer as ``mtp_block``; embed_tokens is
    the predictor's own, at the top. BF16 parameters included, so every name the checkpoint
    maps to can be checked against it. ``bf16_layer``: the whole layer BF16 (R1-0528)."""
    h, vocab, n = cfg["hidden_size"], cfg["vocab_size"], cfg["num_hidden_layers"]
    root, predictor = torch.nn.Module(), torch.nn.Module()
    root.model = predictor
    predictor.layers = torch.nn.ModuleDict()
    for idx in range(n, n + cfg["num_nextn_predict_layers"]):
        layer = torch.nn.Module()
        for norm in ("enorm", "hnorm"):
            setattr(layer, norm, torch.nn.Module())
            getattr(layer, norm).weight = bf16(h)
        layer.eh_proj = torch.nn.Module()
        layer.eh_proj.weight = bf16(h, 2 * h)
        layer.shared_head = torch.nn.Module()
        layer.shared_head.norm, layer.shared_head.head = torch.nn.Module(), torch.nn.Module()
        layer.shared_head.norm.weight, layer.shared_head.head.weight = bf16(h), bf16(vocab // tp, h)
        layer.mtp_block = atom_decoder_layer(cfg, idx, tp, ep, not bf16_layer, full=True, mxfp4_experts=not bf16_layer)
        predictor.layers[str(idx)] = layer
    predictor.embed_tokens = torch.nn.Module()
    predictor.embed_tokens.weight = bf16(vocab // tp, h)
    return root


def mtp_prefixes(cfg):
    n = cfg["num_hidden_layers"]
    return tuple(f"model.layers.{i}." for i in range(n, n + cfg["num_nextn_predict_layers"]))


