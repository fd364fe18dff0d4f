"""The ATOM adapter against the manifest contract: a model whose MXFP4 parameters are allocated
as ATOM's ``create_weights`` allocates them (from config.json alone, not from the manifest)
receives every converted tensor, the attributes ATOM's kernels read, and no second shuffle.
ATOM itself does not run here (no ROCm)."""

import json

import pytest
import torch

import layouts as L
from layouts.atom import install_converted_weights
from layouts.compat import EngineConfig
from prep.convert import convert
from prep.deepseek import Target
from prep.synth import SynthSpec, write_checkpoint

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


def atom_like_model(cfg, tp, ep=1):
    """The MXFP4 modules of ATOM's DeepseekV2ForCausalLM for one rank (attention in MXFP4)."""
    h, heads = cfg["hidden_size"], cfg["num_attention_heads"] // tp
    nope, rope, v = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    n_routed = cfg["n_routed_experts"]
    root = torch.nn.Module()
    model = torch.nn.Module()
    root.model = model
    model.layers = torch.nn.ModuleList()
    for i in range(cfg["num_hidden_layers"] + cfg["num_nextn_predict_layers"]):
        layer = torch.nn.Module()
        attn = torch.nn.Module()
        attn.fused_qkv_a_proj = Fp4Linear(cfg["q_lora_rank"] + cfg["kv_lora_rank"] + rope, h)
        attn.q_b_proj = Fp4Linear(heads * (nope + rope), cfg["q_lora_rank"])
        attn.kv_b_proj = Fp4Linear(heads * (nope + v), cfg["kv_lora_rank"])
        attn.o_proj = Fp4Linear(h, heads * v)
        layer.self_attn = attn
        mlp = torch.nn.Module()
        if i < cfg["first_k_dense_replace"]:
            mlp.gate_up_proj = Fp4Linear(2 * cfg["intermediate_size"] // tp, h)
            mlp.down_proj = Fp4Linear(h, cfg["intermediate_size"] // tp)
        else:
            inter = cfg["moe_intermediate_size"] // (1 if ep > 1 else tp)
            n_local = (n_routed // ep if ep > 1 else n_routed) + 1  # + the fused shared expert
            mlp.experts = FusedMoE(n_local, inter, h)
        layer.mlp = mlp
        model.layers.append(layer)
    return root


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("atom")
    src = write_checkpoint(SynthSpec(variant="v2"), root / "src")
    convert(str(src), root / "tp2", Target("preshuffle", "ck", 2))
    convert(str(src), root / "ep2", Target("preshuffle", "ck", 2, ep=2))
    return root, json.loads((src / "config.json").read_text())


@pytest.mark.parametrize("kind", ["tp2", "ep2"])
def test_every_converted_tensor_lands_in_its_atom_parameter_and_processing_is_skipped(ckpt, kind):
    root, cfg = ckpt
    ep = 2 if kind == "ep2" else 1
    model = atom_like_model(cfg, tp=2, ep=ep)
    engine = EngineConfig("asm", "ck", tp_size=2, rank=1, ep_size=ep)
    report = install_converted_weights(model, root / kind, engine)
    params = dict(model.named_parameters())
    mxfp4 = {n for n in params}
    assert set(report.installed) == mxfp4  # every MXFP4 parameter filled, nothing left over
    loaded = L.load_rank(root / kind, 1)
    for name in report.installed:
        p = params[name]
        assert torch.equal(p.data.view(torch.uint8), loaded[name]), name
        if name.endswith("weight"):
            assert p.is_shuffled is True
    moe = model.model.layers[1].mlp.experts
    assert moe.w13_weight_scale.dim() == 2  # CK MoE scales become 2-D, as ATOM's moe_shuffle_scale leaves them
    assert moe.quant_method.intermediate_pad == (0 if ep > 1 else 128) and moe.quant_method.hidden_pad == 0
    for module in model.modules():  # nothing shuffled a second time
        assert getattr(module, "processed", 0) == 0
        if isinstance(module, FusedMoE):
            assert isinstance(module.quant_method, Mxfp4MoEMethod)  # ATOM dispatches on the method's type
            module.quant_method.process_weights_after_loading(module)
            assert module.quant_method.processed == 0
        if isinstance(module, Fp4Linear):
            module.process_weights_after_loading()
            assert module.processed == 0
    assert "model.embed_tokens.weight" in report.passthrough and not report.needs_engine_wrapping


def test_a_model_that_disagrees_with_the_checkpoint_is_named(ckpt):
    root, cfg = ckpt
    wrong = dict(cfg, moe_intermediate_size=cfg["moe_intermediate_size"] * 2)  # pads differently
    model = atom_like_model(wrong, tp=2)
    with pytest.raises(L.ManifestError, match="experts.*intermediate_pad|experts.w13_weight: the model allocates"):
        install_converted_weights(model, root / "tp2", EngineConfig("asm", "ck", 2, rank=0))
    model = atom_like_model(cfg, tp=2)
    del model.model.layers[1].self_attn.q_b_proj
    with pytest.raises(L.ManifestError, match="q_b_proj.weight: the checkpoint has it but the model has no such parameter"):
        install_converted_weights(model, root / "tp2", EngineConfig("asm", "ck", 2, rank=0))


def test_the_adapter_refuses_an_engine_that_would_misread(ckpt):
    root, cfg = ckpt
    with pytest.raises(L.CompatibilityError, match="preshuffled"):
        install_converted_weights(atom_like_model(cfg, tp=2), root / "tp2", EngineConfig("triton-non-shuffle", "ck", 2))
