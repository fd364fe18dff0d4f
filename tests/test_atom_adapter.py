"""The ATOM adapter against the manifest contract: a model whose MXFP4 parameters are allocated
as ATOM's ``create_weights`` allocates them (from config.json alone, not from the manifest)
receives every converted tensor, the attributes ATOM's kernels read, and no second shuffle; the
MTP layer, which ATOM's main model lacks, goes to its draft model (or back in the report).
ATOM itself does not run here (no ROCm)."""

import json
import shutil

import pytest
import torch

import layouts as L
from layouts.engines.atom import atom_mtp_param_name, install_converted_weights
from layouts.engines.atom.adapter import install_draft_weights
from layouts.compat import EngineConfig
from prep.convert import convert
from prep.deepseek import Target
from prep.testing import SynthSpec, write_checkpoint

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


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """Format 1 (``--common-bf16``): the MXFP4 tensors installed, the BF16 ones left whole for
    ATOM's loader. Rank-exact checkpoints (the default) are the tests at the end of this file."""
    root = tmp_path_factory.mktemp("atom")
    src = write_checkpoint(SynthSpec(variant="v2"), root / "src")
    convert(str(src), root / "tp2", Target("preshuffle", "ck", 2, rank_exact=False))
    convert(str(src), root / "ep2", Target("preshuffle", "ck", 2, ep=2, rank_exact=False))
    return root, json.loads((src / "config.json").read_text())


@pytest.fixture(scope="module")
def r1_ckpt(tmp_path_factory):
    """R1-0528 style: attention (and the whole MTP layer) BF16, experts and dense MLP MXFP4; format 1."""
    root = tmp_path_factory.mktemp("atom-r1")
    src = write_checkpoint(SynthSpec(variant="r1-0528"), root / "src")
    convert(str(src), root / "tp2", Target("preshuffle", "ck", 2, rank_exact=False))
    return root / "tp2", json.loads((src / "config.json").read_text())


def fp4_params(model):
    """The parameters ATOM allocates for MXFP4 bytes (fp4x2 / e8m0 / uint8), by name."""
    return {n for n, p in model.named_parameters() if p.dtype.itemsize == 1}


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
        else:  # ATOM marks the shuffled weight, never its scale (ROCm/ATOM ffdf3bb5 atom/model_ops/utils.py:168,
            assert not hasattr(p, "is_shuffled"), name  # moe.py:1297-1298): the scale has no such attribute
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
    # v2 quantizes the MTP layer, which ATOM's main model does not have: it comes back, whole, for the draft.
    mtp = {n for n in loaded if n.startswith(mtp_prefixes(cfg))}
    assert set(report.mtp) | set(report.mtp_pending) == mtp  # whole BF16 for ATOM's loader; the rest set aside
    assert set(report.mtp_pending) == {n for n in mtp if loaded.records[n].layout is not None}
    assert any(loaded.records[n].role == "mxfp4_weight" for n in report.mtp_pending)
    assert all(torch.equal(report.mtp[n], loaded[n]) for n in report.mtp)
    assert not mtp & set(report.passthrough) and not report.mtp_installed


@pytest.mark.parametrize("kind", ["tp2", "ep2"])
def test_the_mtp_layer_installs_into_atoms_draft_model_under_its_names(ckpt, kind):
    root, cfg = ckpt
    ep = 2 if kind == "ep2" else 1
    model, draft = atom_like_model(cfg, tp=2, ep=ep), atom_like_draft_model(cfg, tp=2, ep=ep)
    draft_mxfp4 = fp4_params(draft)
    report = install_converted_weights(model, root / kind, EngineConfig("asm", "ck", 2, rank=1, ep_size=ep),
                                       mtp_model=draft)
    assert set(report.installed) == fp4_params(model)
    assert set(report.mtp_installed) == draft_mxfp4  # every MXFP4 parameter of the draft filled
    assert all(".mtp_block." in n for n in report.mtp_installed)
    loaded = L.load_rank(root / kind, 1)
    layer = cfg["num_hidden_layers"]
    by_param = {atom_mtp_param_name(n, layer): n for n in loaded if n.startswith(mtp_prefixes(cfg))}
    params = dict(draft.named_parameters())
    for name in report.mtp_installed:  # byte-identical, with the manifest's attributes
        assert torch.equal(params[name].data.view(torch.uint8), loaded[by_param[name]]), name
        if name.endswith("weight"):
            assert params[name].is_shuffled is True
    # What is left for ATOM's draft loader is the BF16 part, by checkpoint name; every one of them
    # names a parameter of the draft under ATOM's rewrite (embed_tokens moves to the top).
    assert set(report.mtp) == {n for n in by_param.values() if loaded.records[n].role == "passthrough"}
    assert set(by_param) <= set(params)
    assert atom_mtp_param_name(f"model.layers.{layer}.embed_tokens.weight", layer) == "model.embed_tokens.weight"
    assert f"model.layers.{layer}.mtp_block.mlp.experts" in report.skipped_processing
    for module in draft.modules():
        if isinstance(module, FusedMoE):
            module.quant_method.process_weights_after_loading(module)
            assert module.quant_method.processed == 0
        if isinstance(module, Fp4Linear):
            module.process_weights_after_loading()
            assert module.processed == 0


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
    draft = atom_like_draft_model(cfg, tp=2)
    del draft.model.layers[str(cfg["num_hidden_layers"])].mtp_block.self_attn.o_proj
    with pytest.raises(L.ManifestError, match=r"model.layers.3.self_attn.o_proj.weight \(ATOM's draft parameter "
                                              r"model.layers.3.mtp_block.self_attn.o_proj.weight\): the checkpoint "
                                              "has it but the draft model has no such parameter"):
        install_converted_weights(atom_like_model(cfg, tp=2), root / "tp2", EngineConfig("asm", "ck", 2), mtp_model=draft)


def test_a_tensor_of_neither_model_is_named(ckpt, tmp_path):
    # With no MTP layer in config.json, layer 3 belongs to no model ATOM builds: refused, named.
    root, cfg = ckpt
    out = tmp_path / "c"
    shutil.copytree(root / "tp2", out)
    (out / "config.json").write_text(json.dumps(dict(cfg, num_nextn_predict_layers=0)))
    with pytest.raises(L.ManifestError, match="model.layers.3.self_attn.*: the checkpoint has it but the model has no "
                                              "such parameter"):
        install_converted_weights(atom_like_model(cfg, tp=2), out, EngineConfig("asm", "ck", 2))
    (out / "config.json").unlink()
    with pytest.raises(L.ManifestError, match="config.json: cannot read num_hidden_layers"):
        install_converted_weights(atom_like_model(cfg, tp=2), out, EngineConfig("asm", "ck", 2))


def test_the_adapter_refuses_an_engine_that_would_misread(ckpt):
    root, cfg = ckpt
    with pytest.raises(L.CompatibilityError, match="preshuffled"):
        install_converted_weights(atom_like_model(cfg, tp=2), root / "tp2", EngineConfig("triton-non-shuffle", "ck", 2))


TRITON_GEMM = {"ATOM_USE_TRITON_GEMM": "1", "ATOM_USE_TRITON_MOE": "0"}  # CK MoE: the experts' layout fits


def test_triton_gemm_is_refused_for_mxfp4_attention_with_atoms_reason(ckpt):
    # ATOM (deepseek_v2.py, ffdf3bb5) builds the attention for a BF16 source under ATOM_USE_TRITON_GEMM=1.
    root, cfg = ckpt
    engine = EngineConfig.from_env(tp_size=2, rank=0, gpu_arch="gfx950", env=TRITON_GEMM)
    assert engine.gemm_path == "triton-preshuffle"
    with pytest.raises(L.CompatibilityError) as e:
        install_converted_weights(atom_like_model(cfg, tp=2), root / "tp2", engine)
    msg = str(e.value)
    assert "attention is MXFP4 (model.layers." in msg and "BF16 source" in msg and "\n" not in msg
    assert "unset ATOM_USE_TRITON_GEMM" in msg and "model config" not in msg


def test_triton_gemm_with_bf16_attention_installs(r1_ckpt):
    # R1-0528 keeps attention BF16: ATOM's triton-GEMM attention path is never taken, the MLPs fit.
    out, cfg = r1_ckpt
    model = atom_like_model(cfg, tp=2, mxfp4_attention=False)
    engine = EngineConfig.from_env(tp_size=2, rank=0, gpu_arch="gfx950", env=TRITON_GEMM)
    report = install_converted_weights(model, out, engine)
    assert set(report.installed) == fp4_params(model)
    assert "model.layers.0.self_attn.q_a_proj.weight" in report.passthrough
    mtp = set(report.mtp)  # the excluded (BF16) MTP layer, for the draft model's own loader
    assert mtp and all(n.startswith(mtp_prefixes(cfg)) for n in mtp)
    assert all(report.records[n].role == "passthrough" for n in mtp)


# ---------------------------------------------------------------------------- rank-exact (format 2)
@pytest.fixture(scope="module", params=["v2", "r1-0528"])
def exact_ckpt(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"atom-exact-{request.param}")
    src = write_checkpoint(SynthSpec(variant=request.param), root / "src")
    for tp, ep in ((2, 1), (2, 2)):
        convert(str(src), root / f"tp{tp}ep{ep}", Target("preshuffle", "ck", tp, ep, rank_exact=True))
    return root, src, request.param, json.loads((src / "config.json").read_text())


@pytest.mark.parametrize("ep", (1, 2))
def test_a_rank_exact_checkpoint_fills_every_parameter_of_atoms_models(exact_ckpt, ep):
    """Every parameter of the target and the draft model is written, BF16 included (ATOM's
    "N/M parameters were NOT loaded" warning has nothing to count), each with the bytes of the
    rank's tensor, and nothing is handed to ATOM's loader."""
    root, src, variant, cfg = exact_ckpt
    bf16_attention = variant == "r1-0528"
    for rank in range(2):
        model = atom_like_model(cfg, tp=2, ep=ep, mxfp4_attention=not bf16_attention, full=True)
        draft = atom_like_draft_model(cfg, tp=2, ep=ep, bf16_layer=bf16_attention)
        engine = EngineConfig("asm", "ck", 2, rank=rank, ep_size=ep)
        report = install_converted_weights(model, root / f"tp2ep{ep}", engine, mtp_model=draft)
        assert not report.not_installed and not report.passthrough and not report.mtp and not report.mtp_pending
        assert set(report.installed) == {n for n, _ in model.named_parameters()}
        assert set(report.mtp_installed) == {n for n, _ in draft.named_parameters()}
        loaded = L.load_rank(root / f"tp2ep{ep}", rank)
        params = dict(model.named_parameters())
        for name, t in loaded.items():
            if name in params:
                p = params[name]
                want = t if p.dtype == t.dtype or loaded.records[name].layout else t.to(p.dtype)
                assert torch.equal(p.data.view(torch.uint8), want.view(torch.uint8)), name
        # ATOM's drafter shares the target's embedding: the draft gets the rank's target embedding.
        assert torch.equal(dict(draft.named_parameters())["model.embed_tokens.weight"],
                           loaded["model.embed_tokens.weight"])
        # Experts skip ATOM's processing, BF16 ones (R1-0528's MTP layer) too: they are stored in
        # the layout ATOM's unquantized MoE would shuffle them into, and marked so.
        layer = cfg["num_hidden_layers"]
        assert f"model.layers.{layer}.mtp_block.mlp.experts" in report.skipped_processing
        w13 = dict(draft.named_parameters())[f"model.layers.{layer}.mtp_block.mlp.experts.w13_weight"]
        assert w13.is_shuffled and (w13.dtype == torch.bfloat16) == bf16_attention


def test_a_rank_exact_checkpoint_without_a_draft_returns_the_mtp_layer(exact_ckpt):
    root, _, variant, cfg = exact_ckpt
    model = atom_like_model(cfg, tp=2, mxfp4_attention=variant != "r1-0528", full=True)
    report = install_converted_weights(model, root / "tp2ep1", EngineConfig("asm", "ck", 2, rank=1))
    assert not report.not_installed and not report.passthrough and not report.mtp
    assert report.mtp_pending and all(n.startswith(mtp_prefixes(cfg)) for n in report.mtp_pending)
    assert f"model.layers.{cfg['num_hidden_layers']}.embed_tokens.weight" not in report.mtp_pending  # no rank reads it
    # ATOM loads its draft model later: the layer set aside installs then, read again from the files.
    draft = atom_like_draft_model(cfg, tp=2, bf16_layer=variant == "r1-0528")
    installed = install_draft_weights(draft, report)
    assert set(installed) == {n for n, _ in draft.named_parameters()} and not report.not_installed
    loaded = L.load_rank(root / "tp2ep1", 1)
    layer = cfg["num_hidden_layers"]
    by_param = {atom_mtp_param_name(n, layer): n for n in loaded if n.startswith(mtp_prefixes(cfg))}
    by_param["model.embed_tokens.weight"] = "model.embed_tokens.weight"  # the target's, as ATOM's drafter shares it
    for name, p in draft.named_parameters():
        want = loaded[by_param[name]]
        want = want if p.dtype == want.dtype or loaded.records[by_param[name]].layout else want.to(p.dtype)
        assert torch.equal(p.data.view(torch.uint8).reshape(-1), want.view(torch.uint8).reshape(-1)), name


def test_tensors_go_into_the_parameters_atom_allocated_not_beside_them(exact_ckpt):
    # The device holds a rank's weights once: every tensor whose shape is ATOM's allocation is copied
    # into that storage; only scales padded past it (S32x8, 2-D CK MoE scales) get storage of their own.
    root, _, variant, cfg = exact_ckpt
    model = atom_like_model(cfg, tp=2, mxfp4_attention=variant != "r1-0528", full=True)
    before = {n: (p.data_ptr(), tuple(p.shape)) for n, p in model.named_parameters()}
    report = install_converted_weights(model, root / "tp2ep1", EngineConfig("asm", "ck", 2, rank=0))
    moved = {n for n, p in model.named_parameters() if p.data_ptr() != before[n][0]}
    assert moved and all(report.records[n].role == "e8m0_scale" for n in moved)
    assert all(tuple(p.shape) != before[n][1] for n, p in model.named_parameters() if n in moved)
