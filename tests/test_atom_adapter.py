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
from layouts import EngineConfig
from layouts.engines import get_engine
from prep.convert import convert
from prep.deepseek import target_for
from prep.testing import SynthSpec
from checkpoints import write_checkpoint

from atom_like import FusedMoE, Fp4Linear, Mxfp4MoEMethod, atom_like_draft_model, atom_like_model, mtp_prefixes

ATOM = get_engine("atom")  # the engine whose profile these tests use


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """Format 1 (``--common-bf16``): the MXFP4 tensors installed, the BF16 ones left whole for
    ATOM's loader. Rank-exact checkpoints (the default) are the tests at the end of this file."""
    root = tmp_path_factory.mktemp("atom")
    src = write_checkpoint(SynthSpec(variant="v2"), root / "src")
    convert(str(src), root / "tp2", target_for(ATOM, layout="preshuffle", moe_layout="ck", tp=2, rank_exact=False))
    convert(str(src), root / "ep2", target_for(ATOM, layout="preshuffle", moe_layout="ck", tp=2, ep=2, rank_exact=False))
    return root, json.loads((src / "config.json").read_text())


@pytest.fixture(scope="module")
def r1_ckpt(tmp_path_factory):
    """R1-0528 style: attention (and the whole MTP layer) BF16, experts and dense MLP MXFP4; format 1."""
    root = tmp_path_factory.mktemp("atom-r1")
    src = write_checkpoint(SynthSpec(variant="r1-0528"), root / "src")
    convert(str(src), root / "tp2", target_for(ATOM, layout="preshuffle", moe_layout="ck", tp=2, rank_exact=False))
    return root / "tp2", json.loads((src / "config.json").read_text())


def fp4_params(model):
    """The parameters ATOM allocates for MXFP4 bytes (fp4x2 / e8m0 / uint8), by name."""
    return {n for n, p in model.named_parameters() if p.dtype.itemsize == 1}


@pytest.mark.parametrize("kind", ["tp2", "ep2"])
def test_every_converted_tensor_lands_in_its_atom_parameter_and_processing_is_skipped(ckpt, kind):
    root, cfg = ckpt
    ep = 2 if kind == "ep2" else 1
    model = atom_like_model(cfg, tp=2, ep=ep)
    engine = EngineConfig("asm", "ck", tp_size=2, rank=1, ep_size=ep, profile=ATOM)
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
    assert "model.embed_tokens.weight" in report.passthrough
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
    report = install_converted_weights(model, root / kind, EngineConfig("asm", "ck", 2, rank=1, ep_size=ep, profile=ATOM),
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
        install_converted_weights(model, root / "tp2", EngineConfig("asm", "ck", 2, rank=0, profile=ATOM))
    model = atom_like_model(cfg, tp=2)
    del model.model.layers[1].self_attn.q_b_proj
    with pytest.raises(L.ManifestError, match="q_b_proj.weight: the checkpoint has it but the model has no such parameter"):
        install_converted_weights(model, root / "tp2", EngineConfig("asm", "ck", 2, rank=0, profile=ATOM))
    draft = atom_like_draft_model(cfg, tp=2)
    del draft.model.layers[str(cfg["num_hidden_layers"])].mtp_block.self_attn.o_proj
    with pytest.raises(L.ManifestError, match=r"model.layers.3.self_attn.o_proj.weight \(ATOM's draft parameter "
                                              r"model.layers.3.mtp_block.self_attn.o_proj.weight\): the checkpoint "
                                              "has it but the draft model has no such parameter"):
        install_converted_weights(atom_like_model(cfg, tp=2), root / "tp2", EngineConfig("asm", "ck", 2, profile=ATOM), mtp_model=draft)


def test_a_tensor_of_neither_model_is_named(ckpt, tmp_path):
    # With no MTP layer in config.json, layer 3 belongs to no model ATOM builds: refused, named.
    root, cfg = ckpt
    out = tmp_path / "c"
    shutil.copytree(root / "tp2", out)
    (out / "config.json").write_text(json.dumps(dict(cfg, num_nextn_predict_layers=0)))
    with pytest.raises(L.ManifestError, match="model.layers.3.self_attn.*: the checkpoint has it but the model has no "
                                              "such parameter"):
        install_converted_weights(atom_like_model(cfg, tp=2), out, EngineConfig("asm", "ck", 2, profile=ATOM))
    (out / "config.json").unlink()
    with pytest.raises(L.ManifestError, match="config.json: cannot read num_hidden_layers"):
        install_converted_weights(atom_like_model(cfg, tp=2), out, EngineConfig("asm", "ck", 2, profile=ATOM))
    for bad in ("1", 1.5, [1]):  # prep-atom-serve --method mtp reads it too: one line, not a traceback
        (out / "config.json").write_text(json.dumps(dict(cfg, num_nextn_predict_layers=bad)))
        with pytest.raises(L.ManifestError, match="cannot read num_hidden_layers and num_nextn_predict_layers as counts"):
            install_converted_weights(atom_like_model(cfg, tp=2), out, EngineConfig("asm", "ck", 2, profile=ATOM))


def test_the_adapter_refuses_an_engine_that_would_misread(ckpt):
    root, cfg = ckpt
    with pytest.raises(L.CompatibilityError, match="preshuffled"):
        install_converted_weights(atom_like_model(cfg, tp=2), root / "tp2", EngineConfig("triton-non-shuffle", "ck", 2, profile=ATOM))


TRITON_GEMM = {"ATOM_USE_TRITON_GEMM": "1", "ATOM_USE_TRITON_MOE": "0"}  # CK MoE: the experts' layout fits


def test_triton_gemm_is_refused_for_mxfp4_attention_with_atoms_reason(ckpt):
    # ATOM (deepseek_v2.py, ffdf3bb5) builds the attention for a BF16 source under ATOM_USE_TRITON_GEMM=1.
    root, cfg = ckpt
    engine = EngineConfig.from_env(ATOM, tp_size=2, rank=0, gpu_arch="gfx950", env=TRITON_GEMM)
    assert engine.gemm_path == "triton-preshuffle"
    with pytest.raises(L.CompatibilityError) as e:
        install_converted_weights(atom_like_model(cfg, tp=2), root / "tp2", engine)
    msg = str(e.value)
    assert "attention is MXFP4 (model.layers." in msg and "BF16 source" in msg and "\n" not in msg
    assert "unset ATOM_USE_TRITON_GEMM" in msg and "model config" not in msg


def test_triton_gemm_is_refused_for_fp8_attention_with_atoms_reason(tmp_path):
    # Under ATOM_USE_TRITON_GEMM=1 ATOM's fused q_a/kv_a path runs FP8 block-scale GEMMs whatever the
    # linear's quant type; a per-channel FP8 weight is read wrong there (deepseek_v2.py, ffdf3bb5).
    from prep.convert import convert
    from prep.deepseek import target_for
    from prep.testing import SynthSpec
    from checkpoints import write_checkpoint

    src = write_checkpoint(SynthSpec(variant="mtp-moefp4", num_hidden_layers=2), tmp_path / "src")
    convert(str(src), tmp_path / "tp2", target_for(ATOM, tp=2))
    cfg = json.loads((src / "config.json").read_text())
    engine = EngineConfig.from_env(ATOM, tp_size=2, rank=0, gpu_arch="gfx950", env=TRITON_GEMM)
    with pytest.raises(L.CompatibilityError) as e:
        L.check_compatibility(L.load_manifest(tmp_path / "tp2"), engine)
    msg = str(e.value)
    assert "attention is FP8 per channel (model.layers." in msg and "block-scale GEMMs" in msg and "\n" not in msg
    assert "unset ATOM_USE_TRITON_GEMM" in msg
    assert cfg["quantization_config"]["layer_quant_config"]["*self_attn*"]["weight"]["qscheme"] == "per_channel"


def test_triton_gemm_with_bf16_attention_installs(r1_ckpt):
    # R1-0528 keeps attention BF16: ATOM's triton-GEMM attention path is never taken, the MLPs fit.
    out, cfg = r1_ckpt
    model = atom_like_model(cfg, tp=2, mxfp4_attention=False)
    engine = EngineConfig.from_env(ATOM, tp_size=2, rank=0, gpu_arch="gfx950", env=TRITON_GEMM)
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
        convert(str(src), root / f"tp{tp}ep{ep}", target_for(ATOM, layout="preshuffle", moe_layout="ck", tp=tp, ep=ep, rank_exact=True))
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
        engine = EngineConfig("asm", "ck", 2, rank=rank, ep_size=ep, profile=ATOM)
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
    report = install_converted_weights(model, root / "tp2ep1", EngineConfig("asm", "ck", 2, rank=1, profile=ATOM))
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
    report = install_converted_weights(model, root / "tp2ep1", EngineConfig("asm", "ck", 2, rank=0, profile=ATOM))
    moved = {n for n, p in model.named_parameters() if p.data_ptr() != before[n][0]}
    assert moved and all(report.records[n].role == "e8m0_scale" for n in moved)
    assert all(tuple(p.shape) != before[n][1] for n, p in model.named_parameters() if n in moved)


def test_the_doors_e4m3fnuz_step_sets_minus_zero_to_zero_a_block_at_a_time_as_atom_does_at_once():
    # On gfx942 the door does ATOM's normalize_e4m3fn_to_e4m3fnuz for the FP8 weights it skipped the
    # processing of: every 0x80 byte (e4m3fn's -0, e4m3fnuz's NaN) becomes 0x00, nothing else changes;
    # in blocks of rows, so that no mask the size of a layer's experts is made.
    from layouts.engines.atom.adapter import fnuz_zero_in_place

    g = torch.Generator().manual_seed(0)
    for shape in ((3, 40, 64), (37, 96), (1000,)):
        raw = torch.randint(0, 256, shape, dtype=torch.uint8, generator=g)
        raw.view(-1)[::7] = 0x80
        want = raw.clone()
        want[want == 0x80] = 0  # ATOM's, on the whole tensor
        w = raw.clone().view(torch.float8_e4m3fnuz)
        fnuz_zero_in_place(w, block_bytes=100)  # several blocks, one not whole
        assert torch.equal(w.view(torch.uint8), want), shape
