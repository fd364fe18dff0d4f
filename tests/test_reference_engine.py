"""The reference engine (``prep run`` / ``prep compare``): every converted layout and TP size
computes the source's logits bit for bit; a wrong layout pairing visibly does not; and the
forward itself agrees with transformers' DeepseekV3 (an independent implementation)."""

import json
import shutil
from dataclasses import replace

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

from prep.cli import main
from prep.convert import convert
from prep.deepseek import target_for
from prep.errors import PrepError
from prep.reference.model import DeepseekV3, ForwardOptions, rope_tables
from prep.reference.run import compare, run
from prep.reference.weights import load_weights
from prep.testing import PRESETS, SynthSpec
from checkpoints import write_checkpoint
from conftest import _need
from layouts.engines import get_engine

ATOM = get_engine("atom")  # the engine whose profile these tests use

IDS = [1, 5, 9, 200, 17, 3, 44, 900, 12, 7, 33, 512, 1000, 2, 8, 64, 99, 31, 250, 600,
       4, 77, 123, 321, 11, 22, 0, 1023, 400, 45, 67, 89, 101]  # 33 tokens: both sides of the M >= 32 switch

TARGETS = {f"{lay}+{moe}-tp{tp}": target_for(ATOM, layout=lay, moe_layout=moe, tp=tp) for lay, moe in
           [("preshuffle", "ck"), ("preshuffle", "triton"), ("non-shuffle", "triton"), ("non-shuffle", "ck")]
           for tp in (1, 2, 4)}
TARGETS["preshuffle+ck-ep2"] = target_for(ATOM, layout="preshuffle", moe_layout="ck", tp=2, ep=2)


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("eng")
    return {v: write_checkpoint(SynthSpec(variant=v), root / v) for v in ("r1-0528", "v2")}


@pytest.fixture(scope="module")
def source_logits(sources):
    return {(v, n): run(src, IDS[:n], source_engine=ATOM)["logits"] for v, src in sources.items() for n in (17, 33)}


@pytest.mark.parametrize("variant", ["r1-0528", "v2"])
@pytest.mark.parametrize("name", list(TARGETS))
def test_every_converted_layout_computes_the_source_logits_bit_for_bit(sources, source_logits, tmp_path, variant, name):
    # The source runs with the raw (non-shuffle) activation flags, a preshuffled checkpoint with
    # the ASM path's (scales shuffled and padded): only the layouts differ, not one logit bit.
    out = tmp_path / "out"
    convert(str(sources[variant]), out, TARGETS[name])
    logits = run(out, IDS, source_engine=ATOM)["logits"]
    assert logits.shape == (33, 1024) and torch.isfinite(logits).all()
    assert torch.equal(logits, source_logits[(variant, 33)]), name


@pytest.mark.parametrize("n", [17, 33])
def test_the_triton_preshuffle_path_computes_the_source_logits_and_refuses_mxfp4_attention(sources, source_logits,
                                                                                         tmp_path, n):
    # ATOM's Triton preshuffle GEMM path (ATOM_USE_TRITON_GEMM=1) loads only BF16 attention: a v2
    # checkpoint (MXFP4 attention) is refused for it (layouts/engines/_compat.py says why), an r1-0528 one
    # computes its source's logits on both sides of the 32-token switch of the fused op's
    # activation layout. (That layout itself is pinned against aiter in tests/test_fused_quant.py.)
    out = tmp_path / "out"
    convert(str(sources["r1-0528"]), out, target_for(ATOM, layout="preshuffle", moe_layout="ck", tp=2))
    assert torch.equal(run(out, IDS[:n], gemm_path="triton-preshuffle", source_engine=ATOM)["logits"], source_logits[("r1-0528", n)])
    with pytest.raises(PrepError, match="preshuffled; the non-shuffle Triton GEMM would read garbage"):
        run(out, IDS[:n], gemm_path="triton-non-shuffle", source_engine=ATOM)
    v2 = tmp_path / "v2"
    convert(str(sources["v2"]), v2, target_for(ATOM, layout="preshuffle", moe_layout="ck", tp=2))
    with pytest.raises(PrepError, match="unset ATOM_USE_TRITON_GEMM"):
        run(v2, IDS[:n], gemm_path="triton-preshuffle", source_engine=ATOM)


def test_a_wrong_layout_pairing_gives_visibly_different_logits(sources, source_logits, tmp_path):
    out = tmp_path / "out"
    convert(str(sources["v2"]), out, target_for(ATOM, layout="preshuffle", moe_layout="ck", tp=2))
    wrong = run(out, IDS[:17], assume_layout="non-shuffle", source_engine=ATOM)["logits"]  # preshuffled bytes read as raw
    right = source_logits[("v2", 17)]
    assert (wrong - right).abs().max() > 0.1 and (wrong.argmax(-1) != right.argmax(-1)).any()
    wrong_moe = run(out, IDS[:17], assume_layout="triton", source_engine=ATOM)["logits"]  # CK experts read as Triton MoE
    assert (wrong_moe - right).abs().max() > 0.1


def test_activations_are_quantized_unless_switched_off(sources, source_logits):
    weight_only = run(sources["v2"], IDS[:17], act_quant=False)["logits"]
    assert torch.isfinite(weight_only).all() and not torch.equal(weight_only, source_logits[("v2", 17)])


def test_cli_run_saves_logits_and_compare_exits_on_a_difference(sources, tmp_path):
    out, logits = tmp_path / "out", tmp_path / "logits.safetensors"
    convert(str(sources["r1-0528"]), out, target_for(ATOM, layout="preshuffle", moe_layout="ck", tp=2))
    runner = CliRunner()
    r = runner.invoke(main, ["run", str(out), "--prompt-ids", "1,2,3,4", "--save-logits", str(logits), "--json"])
    assert r.exit_code == 0, r.output
    saved = load_file(logits)["logits"]
    assert saved.shape == (4, 1024) and json.loads(r.output)["argmax"] == saved.argmax(-1).tolist()
    r = runner.invoke(main, ["compare", str(sources["r1-0528"]), str(out), "--prompt-ids", "1,2,3,4"])
    assert r.exit_code == 0 and "identical bit for bit" in r.output, r.output
    r = runner.invoke(main, ["compare", str(sources["r1-0528"]), str(sources["v2"]), "--prompt-ids", "1,2,3"])
    assert r.exit_code == 1 and "differ by" in r.output
    r = runner.invoke(main, ["run", str(out), "--prompt-ids", "1,x"])
    assert r.exit_code == 1 and "comma-separated integer token ids" in r.output
    r = runner.invoke(main, ["run", str(out), "--prompt-ids", "5000"])
    assert r.exit_code == 1 and "ids must be in [0, 1024)" in r.output


# ----------------------------------------------------------------------------- transformers
def _transformers_model(src, w, **overrides):
    try:
        import transformers  # installed by scripts/setup_env.sh
    except ImportError:
        _need(False, "transformers")
    cfg = json.loads((src / "config.json").read_text())
    cfg.pop("quantization_config")
    cfg.update(overrides)
    glm = cfg["model_type"] == "glm_moe_dsa"  # transformers' own GLM-5 (its indexer included)
    config = (transformers.GlmMoeDsaConfig if glm else transformers.DeepseekV3Config)(**cfg)
    config._attn_implementation = "eager"
    model = (transformers.GlmMoeDsaForCausalLM if glm else transformers.DeepseekV3ForCausalLM)(config).eval()
    state = {}
    for n, p in model.named_parameters():  # our dequantized weights, in transformers' names
        pre = n.rsplit(".", 1)[0]
        if n.endswith("experts.gate_up_proj"):
            state[n] = torch.stack([torch.cat([w.linear(f"{pre}.{e}.gate_proj"), w.linear(f"{pre}.{e}.up_proj")])
                                    for e in range(p.shape[0])])
        elif n.endswith("experts.down_proj"):
            state[n] = torch.stack([w.linear(f"{pre}.{e}.down_proj") for e in range(p.shape[0])])
        elif n.endswith(".weight") and w.mxfp4(n[:-7]):
            state[n] = w.linear(n[:-7])
        else:
            state[n] = w.tensor(n).float()
    for n, _ in model.named_buffers():
        if n.endswith("e_score_correction_bias"):
            state[n] = w.tensor(n)
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and all("rotary" in k for k in missing), (missing, unexpected)
    return model


@pytest.mark.parametrize("variant", ["r1-0528", "v2", "glm-5"])
def test_each_decoder_layer_agrees_with_transformers_deepseek_v3(sources, variant, tmp_path):
    # Weight-only emulation (activations BF16) against transformers 5's DeepseekV3 in float32,
    # layer by layer on transformers' own layer inputs. Tolerance: 2% of the layer output's
    # largest magnitude: we round activations to BF16 between modules as the kernels do,
    # transformers keeps float32 (seen: <= 0.9%). Random experts score within a hair of each
    # other, so that rounding can flip a token's expert choice: the routing must agree for 90%
    # of tokens, and the outputs are compared on the tokens routed alike. GLM-5 against
    # transformers' GlmMoeDsa, its indexer run with index_topk = the 33 tokens (it keeps every
    # one, so its attention is the dense attention the reference engine computes there) and its
    # RoPE from rope_parameters (theta 1e6).
    src = sources[variant] if variant in sources else write_checkpoint(PRESETS[variant], tmp_path / variant)
    w = load_weights(src)
    model = _transformers_model(src, w, **({"index_topk": len(IDS)} if variant == "glm-5" else {}))
    ids = torch.tensor(IDS)
    ins, outs, routes = {}, {}, {}
    for i, layer in enumerate(model.model.layers):
        if hasattr(layer.mlp, "gate"):
            layer.mlp.gate.register_forward_hook(lambda mod, a, out, i=i: routes.__setitem__(i, out[2].detach()))
        layer.register_forward_pre_hook(
            lambda mod, a, kw, i=i: ins.__setitem__(i, (a[0] if a else kw["hidden_states"])[0].detach()), with_kwargs=True)
        layer.register_forward_hook(
            lambda mod, a, kw, out, i=i: outs.__setitem__(i, (out[0] if isinstance(out, tuple) else out)[0].detach()),
            with_kwargs=True)
    with torch.no_grad():
        model(ids[None])
    engine = DeepseekV3(w, ForwardOptions(act_quant=False))
    rope = rope_tables(engine.cfg, torch.arange(len(IDS)))
    for i in range(len(model.model.layers)):
        h, r = engine.decoder_layer(i, ins[i].to(torch.bfloat16), None, rope)
        ours, theirs = h.float() + r.float(), outs[i]
        alike = torch.ones(len(IDS), dtype=torch.bool)
        if i in routes:
            alike = (engine.last_routing.sort(-1).values == routes[i].sort(-1).values).all(-1)
            assert alike.float().mean() >= 0.9, f"layer {i}: routing agrees for {int(alike.sum())} of {len(IDS)} tokens"
        assert (ours - theirs)[alike].abs().max() <= 0.02 * theirs.abs().max(), f"layer {i}"


def test_dense_model_logits_agree_with_transformers_end_to_end(tmp_path):
    # End to end on a model without MoE layers: routing among random experts is near a tie for
    # every token, so a BF16-level difference can flip an expert choice and the rest of the
    # sequence with it; the MoE layers are checked layer by layer above instead.
    src = write_checkpoint(SynthSpec(variant="v2", first_k_dense_replace=3), tmp_path / "dense")
    w = load_weights(src)
    model = _transformers_model(src, w)
    with torch.no_grad():
        theirs = model(torch.tensor([IDS])).logits[0]
    ours = run(src, IDS, act_quant=False)["logits"]
    assert (ours - theirs).abs().max() <= 0.03 * theirs.abs().max()
    assert (ours.argmax(-1) == theirs.argmax(-1)).float().mean() >= 0.9


def test_compare_api_reports_bit_identity(sources, tmp_path):
    out = tmp_path / "out"
    convert(str(sources["v2"]), out, target_for(ATOM, layout="non-shuffle", moe_layout="triton", tp=4))
    r = compare(sources["v2"], out, IDS[:5], source_engine=ATOM)
    assert r["identical"] and r["max_abs_diff"] == 0.0 and r["argmax_agree"] == 1.0


def test_a_forward_over_the_first_layers_dequantizes_only_those_layers(sources, tmp_path):
    # What makes `prep compare SRC OUT --layers 4` possible on a 350 GB checkpoint: matrices are
    # made on first use, never all at once.
    out = tmp_path / "out"
    convert(str(sources["v2"]), out, target_for(ATOM, layout="preshuffle", moe_layout="ck", tp=2))
    for root in (sources["v2"], out):
        w = load_weights(root)
        DeepseekV3(w, ForwardOptions(engine=ATOM, gemm_path="asm"), layers=1)(torch.tensor(IDS[:5]))
        made = [k for k in w._cache if k.startswith("model.layers.")]
        assert made and all(k.startswith("model.layers.0.") for k in made), made


def _nan_scale_copy(src, dst):
    """A copy of ``src`` whose first dense down_proj scale byte is 0xFF (E8M0 NaN)."""
    import shutil

    from safetensors import safe_open
    from safetensors.torch import save_file

    shutil.copytree(src, dst)
    name = "model.layers.0.mlp.down_proj.weight_scale"
    index = json.loads((dst / "model.safetensors.index.json").read_text())["weight_map"]
    f = dst / index[name]
    with safe_open(str(f), "pt") as h:
        tensors = {k: h.get_tensor(k) for k in h.keys()}
        meta = h.metadata()
    tensors[name] = tensors[name].clone()
    tensors[name][0, 0] = 0xFF
    save_file(tensors, str(f), metadata=meta)
    return dst


def test_compare_fails_on_logits_that_are_not_finite(sources, tmp_path):
    bad = _nan_scale_copy(sources["v2"], tmp_path / "nan")
    r = CliRunner().invoke(main, ["compare", str(bad), str(bad), "--prompt-ids", "1,5,9"])
    assert r.exit_code == 1 and "are not finite" in r.output, r.output
    out = tmp_path / "out"  # a converted copy runs too (to the same NaN), it is not "incomplete"
    convert(str(bad), out, target_for(ATOM, layout="preshuffle", moe_layout="ck", tp=2))
    assert torch.isnan(run(out, [1, 5, 9], source_engine=ATOM)["logits"]).all()


@pytest.mark.parametrize("args, message", [
    (["--layers", "0"], "run at least one layer"),
    (["--assume-layout", "bogus"], "not a layout; known:"),
    (["--device", "cuda:7"] if not torch.cuda.is_available() else ["--device", "tpu"], "no such device here"),
    (["--save-logits", "/nonexistent-dir/x.safetensors"], "its folder does not exist"),
])
def test_run_refuses_bad_options_in_one_line(sources, args, message):
    r = CliRunner().invoke(main, ["run", str(sources["v2"]), "--prompt-ids", "1,2", *args])
    assert r.exit_code == 1 and message in r.output and r.output.count("\n") == 1, r.output


def test_yarn_rope_scaling_agrees_with_transformers(sources):
    # DeepSeek-V3/R1 ship YaRN (factor 40, mscale_all_dim 1): frequencies and the softmax scale
    # both change. Dense first layer of the v2 model, on transformers' own layer input.
    yarn = {"type": "yarn", "rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 64,
            "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}
    src = sources["v2"]
    w = load_weights(src)
    w.config = dict(w.config, rope_scaling=yarn, max_position_embeddings=2560)
    model = _transformers_model(src, w, rope_scaling=yarn, max_position_embeddings=2560)
    ins, outs = {}, {}
    layer = model.model.layers[0]
    layer.register_forward_pre_hook(lambda mod, a, kw: ins.__setitem__(0, (a[0] if a else kw["hidden_states"])[0]),
                                    with_kwargs=True)
    layer.register_forward_hook(lambda mod, a, kw, out: outs.__setitem__(0, (out[0] if isinstance(out, tuple) else out)[0]),
                                with_kwargs=True)
    with torch.no_grad():
        model(torch.tensor([IDS]))
    engine = DeepseekV3(w, ForwardOptions(act_quant=False))
    rope = rope_tables(engine.cfg, torch.arange(len(IDS)))
    assert rope[2] > 1.0  # the YaRN mscale really applies
    h, r = engine.decoder_layer(0, ins[0].to(torch.bfloat16), None, rope)
    ours, theirs = h.float() + r.float(), outs[0]
    assert (ours - theirs).abs().max() <= 0.02 * theirs.abs().max()


# ---------------------------------------------------------------------------- config values by range
@pytest.mark.parametrize("change, says", [
    ({"rms_norm_eps": float("nan")}, "rms_norm_eps is nan, not a finite number > 0"),
    ({"rms_norm_eps": -1e-6}, "rms_norm_eps is -1e-06, not a finite number > 0"),
    ({"rope_theta": 0}, "rope_theta is 0, not a finite number > 1"),
    ({"routed_scaling_factor": float("inf")}, "routed_scaling_factor is inf"),
    ({"num_experts_per_tok": 99}, "num_experts_per_tok is 99, not an integer in [1, n_routed_experts"),
    ({"n_group": 3}, "cannot route"),
    ({"qk_rope_head_dim": 15}, "qk_rope_head_dim is 15, odd"),
    ({"num_attention_heads": 0}, "num_attention_heads is 0, not an integer in [1,"),
    ({"num_hidden_layers": 100_000_000}, "num_hidden_layers is 100000000, not an integer in [1, "),
    ({"rope_scaling": {"type": "yarn", "factor": 0, "original_max_position_embeddings": 4096}},
     "rope_scaling.factor is 0, not a finite number >= 1"),
])
def test_config_values_the_forward_cannot_compute_with_are_refused_naming_the_key(sources, tmp_path, change, says):
    src = tmp_path / "src"
    shutil.copytree(sources["v2"], src)
    cfg = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**cfg, **change}))
    r = CliRunner().invoke(main, ["run", str(src), "--prompt-ids", "1,5,9", "--layers", "2"])
    assert r.exit_code == 1, r.output
    line = r.output.strip()
    assert "\n" not in line and line.startswith(f"error: {src / 'config.json'}: ") and says in line, line


def test_prep_run_refuses_non_finite_logits_instead_of_reporting_their_argmax(sources, tmp_path):
    bad = _nan_scale_copy(sources["v2"], tmp_path / "nan")
    saved = tmp_path / "logits.safetensors"
    r = CliRunner().invoke(main, ["run", str(bad), "--prompt-ids", "1,5,9", "--save-logits", str(saved)])
    assert r.exit_code == 1 and "non-finite logits (NaN or inf) from position 0 of 3" in r.output, r.output
    assert "argmax" not in r.output and not saved.exists()


def test_fp8_attention_is_computed_with_its_scales_and_every_conversion_gives_the_source_logits(tmp_path):
    # MTP-MoEFP4: every *self_attn* linear FP8 with one scale per output channel. The reference
    # multiplies each row's codes by its scale (it once read the codes alone: plausible logits,
    # silently wrong), quantizes the input per token as ATOM's per_Token linears do, and reads the
    # same numbers from every conversion (TP, EP, format-1, other layouts).
    from prep.deepseek import target_for

    src = write_checkpoint(SynthSpec(variant="mtp-moefp4"), tmp_path / "src")
    w = load_weights(src)
    q_b = "model.layers.1.self_attn.q_b_proj"
    raw = load_file(next(f for f in sorted(src.glob("*.safetensors")) if f"{q_b}.weight" in load_file(f)))
    assert torch.equal(w.linear(q_b), raw[f"{q_b}.weight"].float() * raw[f"{q_b}.weight_scale"].reshape(-1, 1))
    want = run(src, IDS[:17], source_engine=ATOM)["logits"]
    assert torch.isfinite(want).all() and not torch.equal(run(src, IDS[:17], act_quant=False)["logits"], want)
    for i, target in enumerate([target_for(ATOM, tp=1), target_for(ATOM, tp=2, ep=2), target_for(ATOM, tp=4, rank_exact=False),
                                target_for(ATOM, tp=2, layout="non-shuffle", moe_layout="triton")]):
        out = tmp_path / f"out{i}"
        convert(str(src), out, target)
        assert torch.equal(run(out, IDS[:17], source_engine=ATOM)["logits"], want), target
    # the scales are read: all of them 1.0 gives other logits
    unscaled = tmp_path / "unscaled"
    shutil.copytree(src, unscaled)
    from safetensors.torch import save_file

    for f in sorted(unscaled.glob("*.safetensors")):
        t = load_file(f)
        t.update({k: torch.ones_like(v) for k, v in t.items() if k.endswith("weight_scale") and v.dtype == torch.float32})
        save_file(t, f, metadata={"format": "pt"})
    assert (run(unscaled, IDS[:17], source_engine=ATOM)["logits"] - want).abs().max() > 0.1


def test_fp8_blocks_are_computed_with_their_scales_and_every_conversion_gives_the_source_logits(tmp_path):
    # DeepSeek's own FP8 release: every linear and expert FP8 with one scale per 128x128 block. The
    # reference multiplies each block's codes by its scale (a block of rows that starts inside a
    # block, as the row-block reader makes, included), quantizes the input per token and 128
    # columns as ATOM's per_1x128 linears do, and reads the same numbers from every conversion.
    from prep.deepseek import target_for
    from prep.testing import PRESETS

    src = write_checkpoint(replace(PRESETS["r1-0528-fp8"], num_hidden_layers=2), tmp_path / "src")
    w = load_weights(src)
    raw = {}
    for f in sorted(src.glob("*.safetensors")):
        raw.update(load_file(f))
    for prefix in ("model.layers.1.self_attn.kv_a_proj_with_mqa", "model.layers.1.mlp.experts.3.down_proj"):
        codes, scale = raw[f"{prefix}.weight"].float(), raw[f"{prefix}.weight_scale_inv"]
        blocks = torch.kron(scale, torch.ones(128, 128))[:codes.shape[0], :codes.shape[1]]
        assert torch.equal(w.linear(prefix), codes * blocks), prefix
        assert torch.equal(w._make_rows(prefix, slice(100, 140)), (codes * blocks)[100:140]), prefix
    want = run(src, IDS[:17], source_engine=ATOM)["logits"]
    assert torch.isfinite(want).all() and not torch.equal(run(src, IDS[:17], act_quant=False)["logits"], want)
    for i, target in enumerate([target_for(ATOM, tp=2), target_for(ATOM, tp=4, ep=4),
                                target_for(ATOM, tp=2, rank_exact=False)]):
        out = tmp_path / f"out{i}"
        convert(str(src), out, target)
        assert torch.equal(run(out, IDS[:17], source_engine=ATOM)["logits"], want), target
