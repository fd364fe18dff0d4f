"""The model-family tables (layouts/families): resolved once from config.json, every module of a
checkpoint has a row (its kind and TP split), and what no row names is refused."""

from __future__ import annotations

import dataclasses
import json

import pytest
from click.testing import CliRunner

from harness.report import rows as harness_rows
from layouts.errors import LayoutsError
from layouts.families import COLS, ROWS, WHOLE, Family, Module, family_of, get_family, register_family
from layouts.engines import get_engine
from prep.cli import main
from prep.source import SourceCheckpoint
from prep.testing import PRESETS, build_config, tensor_specs
from checkpoints import write_checkpoint

ATOM = get_engine("atom")  # the engine whose profile these tests use


@pytest.mark.parametrize("config, family", [
    ({"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3"}, "deepseek-v3"),
    ({"architectures": ["DeepseekV2ForCausalLM"]}, "deepseek-v3"),
    ({"architectures": ["DeepseekV3ForCausalLM"], "model_type": "kimi_k2"}, "kimi-k2"),  # the type decides
    ({"architectures": ["GlmMoeDsaForCausalLM"], "model_type": "glm_moe_dsa"}, "glm-5"),
    ({"model_type": "glm_moe_dsa", "indexer_types": ["full", "full"]}, "glm-5"),  # GLM-5.1 written by transformers 5
])
def test_the_family_is_resolved_from_config_json(config, family):
    assert family_of(config).name == family


def test_a_config_of_no_known_family_is_refused_naming_the_families_prep_knows():
    with pytest.raises(LayoutsError, match=r"architecture \['LlamaForCausalLM'\] \(model_type 'llama'\) is no family "
                                           r"prep knows: DeepSeek-V2/V3 \(DeepseekV3ForCausalLM, .*Kimi-K2 \(model_type kimi_k2\)"):
        family_of({"architectures": ["LlamaForCausalLM"], "model_type": "llama"})
    with pytest.raises(LayoutsError):
        family_of({"architectures": 3})  # not a list: no family, not a crash


@pytest.mark.parametrize("config, says", [
    ({"indexer_types": ["full", "sparse", "full"]}, "indexer_types must list 'full' or 'shared' for each of the "
                                                     "num_hidden_layers=3 decoder layers"),
    ({"indexer_types": ["full", "shared"]}, "indexer_types must list"),
    ({"index_topk_freq": 4}, "index_topk_freq is 4 without indexer_types, so which layers share an indexer is each "
                             "engine's own reading; add indexer_types"),
])
def test_a_config_whose_layers_indexers_prep_cannot_tell_is_refused_in_one_line(config, says):
    with pytest.raises(LayoutsError, match="^config.json: " + says.replace("(", r"\(").replace(")", r"\)")):
        family_of({"architectures": ["GlmMoeDsaForCausalLM"], "model_type": "glm_moe_dsa", "num_hidden_layers": 3,
                   **config})


@pytest.mark.parametrize("preset", ["tiny", "kimi-k2", "v3.2", "glm-5", "glm-5.2"])
def test_every_tensor_a_generated_checkpoint_holds_is_known_to_its_familys_table(preset):
    spec = PRESETS[preset]
    family = family_of(build_config(spec))
    assert family.name == {"tiny": "deepseek-v3", "kimi-k2": "kimi-k2", "v3.2": "deepseek-v3.2", "glm-5": "glm-5",
                           "glm-5.2": "glm-5"}[preset]
    for name in tensor_specs(spec):
        module = name.rsplit(".", 1)[0]
        assert family.knows_tensor(name) and (family.module(module) is not None or family.is_mtp_own(module)), name


def test_the_table_says_how_tp_splits_each_module():
    f = get_family("deepseek-v3")
    assert f.split_of("model.layers.3.self_attn.q_b_proj") == ROWS
    assert f.split_of("model.layers.3.self_attn.o_proj") == COLS
    assert f.split_of("model.layers.3.self_attn.kv_a_proj_with_mqa") == WHOLE  # merged and replicated by engines
    assert f.split_of("model.layers.3.mlp.shared_experts.down_proj") == COLS
    assert f.kind_of("model.layers.3.mlp.experts.255.up_proj") == "routed_expert"
    assert f.split_of("model.layers.61.shared_head.head") == ROWS  # an MTP layer's own head: vocabulary parallel
    assert f.split_of("lm_head") == ROWS and f.kind_of("model.norm") == "norm"
    assert f.module("model.layers.3.self_attn.q_b_proj").attention
    with pytest.raises(LayoutsError, match="model.layers.3.self_attn.indexer.wk: no module of DeepSeek-V2/V3"):
        f.split_of("model.layers.3.self_attn.indexer.wk")  # nothing is split or replicated by default


def test_a_family_table_is_checked_as_it_is_written():
    with pytest.raises(ValueError, match="split 'diagonal'"):
        Module("mlp.up_proj", "dense_mlp", "diagonal")
    with pytest.raises(ValueError, match="routed expert"):
        Module("mlp.experts.gate_proj", "routed_expert", when="experts")
    f = get_family("deepseek-v3")
    with pytest.raises(ValueError, match="two rows"):
        Family("x", "X", (), ("x",), f.before, (*f.layer, f.layer[0]), f.after)
    with pytest.raises(ValueError, match="both claim model_type"):
        register_family(dataclasses.replace(f, name="copy"))


def test_a_family_is_one_module_of_the_package_found_by_its_scan(tmp_path, monkeypatch):
    # A new family is a module of layouts/families/ and nothing else: the package scan registers it,
    # config.json resolves to it, and the manifest records its architecture from its own table.
    import layouts.families as families

    (tmp_path / "toymoe.py").write_text(
        "from layouts.families import Family, register_family\n"
        "from layouts.families.deepseek import AFTER, BEFORE, LAYER, MTP\n"
        "TOYMOE = register_family(Family('toymoe', 'ToyMoE', ('ToyMoeForCausalLM',), ('toymoe',), BEFORE, LAYER, "
        "AFTER, MTP, twist='a toy'))\n")
    monkeypatch.setattr(families, "__path__", [*families.__path__, str(tmp_path)])
    monkeypatch.setattr(families, "_FAMILIES", dict(families._FAMILIES))
    monkeypatch.setattr(families, "_SCANNED", [])
    monkeypatch.delitem(__import__("sys").modules, "layouts.families.toymoe", raising=False)
    config = {"architectures": ["ToyMoeForCausalLM"], **{k: v for k, v in build_config(PRESETS["tiny"]).items()
                                                          if k not in ("architectures", "model_type")}}
    assert family_of(config).name == "toymoe" and "toymoe" in families.family_names()
    assert families.architecture_of(config) == "toymoe"
    assert families.architecture_of({"architectures": ["DeepseekV3ForCausalLM"], "model_type": "kimi_k2"}) == "deepseek_v3"


# ------------------------------------------------------------------------------ Kimi-K2.5
@pytest.fixture(scope="module")
def kimi(tmp_path_factory):
    # Kimi-K2.5: Kimi-K2's language model (384 experts, 64 heads, no MTP layer) under "language_model.",
    # a vision tower and projector beside it. Random bytes: the same names, shapes and dtypes as the
    # quantized preset, in a fraction of the time.
    return write_checkpoint(dataclasses.replace(PRESETS["kimi-k2.5"], random_bytes=True),
                            tmp_path_factory.mktemp("kimi") / "src")


@pytest.fixture(scope="module")
def kimi_doors(tmp_path_factory):
    # The doors' checks: Kimi-K2.5 with 8 routed experts and 8 heads (the wrapper and the vision
    # tower as the preset has them). SGLang derives w_kc / w_vc from each layer's kv_b_proj through
    # aiter's Triton MXFP4 quant, which the CPU interprets: 64 heads took 41 s a rank. Kimi-K2's
    # 384 experts and 64 heads are converted above and checked on every engine in the script runs.
    return write_checkpoint(dataclasses.replace(PRESETS["kimi-k2.5"], n_routed_experts=8, num_experts_per_tok=2,
                                                num_attention_heads=8, random_bytes=True),
                            tmp_path_factory.mktemp("kimi-doors") / "src")


def test_kimi_k25_is_read_as_kimi_k2_under_its_prefix_with_the_vision_tower_kept_aside(kimi):
    src = SourceCheckpoint(kimi)
    family = family_of(src.file_config)
    assert family.name == "kimi-k2.5" and src.wrapper is family.wrapper
    assert src.config["model_type"] == "kimi_k2" and src.config["n_routed_experts"] == 384
    assert src.config["quantization_config"]["quant_method"] == "quark"  # from the top level, where AMD's export has it
    assert "model.layers.1.mlp.experts.383.down_proj.weight" in src.tensors and "lm_head.weight" in src.tensors
    assert src.tensors["lm_head.weight"].name == "language_model.lm_head.weight"  # read from the source's own tensor
    outside = [n for n in src.tensors if not n.startswith(("model.", "lm_head."))]
    assert outside and all(n.startswith(("vision_tower.", "mm_projector.")) for n in outside)
    assert src.source_name("model.norm.weight") == "language_model.model.norm.weight"
    r = CliRunner().invoke(main, ["inspect", str(kimi)])
    assert r.exit_code == 0, r.output
    assert r.output.splitlines()[0] == (f"{kimi}: Quark MXFP4, Kimi-K2.5 (384 routed experts, 64 heads, multimodal: "
                                        "Kimi-K2 under language_model., a vision tower beside it), kimi_k25, 3 layers, "
                                        "no MTP layer")


@pytest.mark.parametrize("engine, tp, ep", [("atom", 8, 8), ("vllm", 2, 2), ("sglang", 2, 1)])  # the rest: a script run
def test_kimi_k25_converts_with_the_vision_tower_whole_in_a_common_file_and_reverts_under_the_sources_names(
        kimi, tmp_path, engine, tp, ep):
    # ATOM serves the text only: no rank reads the vision tower (kept for revert). vLLM loads it
    # itself: every rank reads it whole and vLLM's loader splits it (role passthrough). SGLang's
    # sharded_state reads every parameter from the rank's files: prep splits and names them so.
    import layouts
    from conftest import assert_verifies_and_reverts, read_tensors
    from prep.convert import convert
    from prep.deepseek import target_for

    out = tmp_path / "out"
    convert(str(kimi), out, target_for(get_engine(engine), tp=tp, ep=ep))
    m = layouts.load_manifest(out)
    assert m.format_version == 5 and m.source.wrapper.prefix == "language_model."
    vision = [t for t in m.tensors if t.name.startswith(("vision_tower.", "mm_projector."))]
    if engine == "sglang":  # in each rank's files, under SGLang's names, its attention split
        assert {t.rank for t in vision} == set(range(tp)) and not any(".wqkv." in t.name for t in vision)
        qkv = {t.rank: t.shape for t in m.tensors if t.name == "vision_tower.encoder.blocks.0.attn.qkv_proj.bias"}
        assert qkv == {r: (3 * 32 // tp,) for r in range(tp)}  # 1-D, as SGLang holds it: its third of q, k and v
    else:
        role = "unread" if engine == "atom" else "passthrough"
        assert len(vision) == 35 and {(t.rank, t.role) for t in vision} == {(None, role)}  # a common file only
    for r in range(tp):  # each rank's files: the language model under the family's names, as ATOM's door installs it
        names = {t.name for t in m.tensors if t.rank == r}
        inner = "language_model." if engine == "sglang" else ""  # SGLang's loader reads the files by its names
        assert f"{inner}model.embed_tokens.weight" in names
        assert engine == "sglang" or not any(n.startswith(("language_model.", "vision_tower.")) for n in names)
    assert_verifies_and_reverts(out, kimi, tmp_path / "back")  # every source name and byte back
    assert "language_model.lm_head.weight" in read_tensors(tmp_path / "back")
    raw = json.loads((out / layouts.manifest.MANIFEST_NAME).read_text())
    with pytest.raises(layouts.ManifestError, match="format_version 4 with source.wrapper: a multimodal source's "
                                                    "manifest, and only one, is version 5"):
        layouts.manifest.Manifest.from_json({**raw, "format_version": 4}, out)  # what a reader before 5 would misread
    if engine == "atom":  # prep's reference engine runs the language model the same from the source and the conversion
        r = CliRunner().invoke(main, ["compare", str(kimi), str(out), "--prompt-ids", "1,5,7,9"])
        assert r.exit_code == 0 and "identical bit for bit" in r.output, r.output


def test_kimi_k25_through_atoms_door_equals_atoms_own_load_and_a_flipped_byte_fails(kimi_doors, tmp_path):
    # ATOM's KimiK25ForCausalLM (the class its ModelRunner builds for the architecture: the DeepSeek
    # model as language_model, the vision tower skipped); the door installs prep's files, which name
    # the language model as its family does, under ATOM's (the source's) names. Rank 1's file holds
    # one flipped byte, which the check must find and nothing else. (ATOM's whole start-up through
    # prep-atom-serve: `check-engine atom --serve`, a script run at TP 2 and TP 8, docs/engines.md.)
    from harness.report import rows as harness_rows
    from prep.convert import convert
    from prep.deepseek import target_for

    out = tmp_path / "out"
    convert(str(kimi_doors), out, target_for(ATOM, tp=2))
    data = bytearray((f := sorted(out.glob("model-tp2-rank1-*.safetensors"))[-1]).read_bytes())
    data[-1] ^= 0x01
    f.write_bytes(bytes(data))
    report = _atom_install_check(kimi_doors, out, tmp_path / "work")
    rows = harness_rows(report)
    assert [(row["rank"], row["result"]) for row in rows] == [("0/2", "ok"), ("1/2", "FAIL")], report
    lines = report.splitlines()
    after = lines[next(i for i, x in enumerate(lines) if x.split()[1:2] == ["1/2"]) + 1:]
    said = [x.strip() for x in after[:next((i for i, x in enumerate(after) if not x.startswith("    ")), len(after))]
            if "bytes differ" in x]  # its differences alone: one tensor, under ATOM's name for it (both fills)
    assert said and all(x.startswith("main:language_model.") and "1 of" in x for x in said), report
    assert len({x.split(":")[1] for x in said}) == 1, report


def test_kimi_k25_through_vllms_door_equals_its_own_load_vision_tower_included(kimi_doors, tmp_path):
    # vLLM's KimiK25ForConditionalGeneration: its DeepSeek model as language_model, filled from the
    # rank's files, and MoonViT with the projector, which the door hands to vLLM's own load_weights
    # from the common file (vLLM splits the vision attention and MLP over TP 2: 2 heads, one a rank).
    from conftest import engine_check_rows
    from prep.convert import convert
    from prep.deepseek import target_for

    out = tmp_path / "out"
    convert(str(kimi_doors), out, target_for(get_engine("vllm"), tp=2, ep=2))
    rows, report = engine_check_rows("vllm", kimi_doors, out, tmp_path / "work", "--ranks", "1")  # rank 0: a script run
    assert [(row["rank"], row["tensors"], row["result"]) for row in rows] == [("1/2", "139", "ok")], report


def test_kimi_k25_through_sglangs_sharded_state_equals_its_own_load_vision_tower_included(kimi_doors, tmp_path):
    # SGLang's KimiK25ForConditionalGeneration, whose every parameter sharded_state wants in the
    # rank's files under its names: the language model under language_model., MoonViT's attention
    # split (qkv_proj: q, k and v each by heads; proj by columns), its MLP, norms and the projector
    # whole, renamed as SGLang's load_weights renames them. Rank 1 here (rank 0: a script run).
    from conftest import engine_check_rows
    from prep.convert import convert
    from prep.deepseek import target_for

    out = tmp_path / "out"
    convert(str(kimi_doors), out, target_for(get_engine("sglang"), tp=2))
    rows, report = engine_check_rows("sglang", kimi_doors, out, tmp_path / "work", "--ranks", "1")
    assert [(row["rank"], row["tensors"], row["result"]) for row in rows] == [("1/2", "90", "ok")], report


def test_a_multimodal_checkpoint_with_a_language_model_tensor_twice_or_one_no_module_names_is_refused(kimi, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    bad = tmp_path / "bad"
    shutil.copytree(kimi, bad)
    index = json.loads((bad / "model.safetensors.index.json").read_text())
    shard = bad / index["weight_map"]["vision_tower.encoder.final_layernorm.weight"]
    tensors = load_file(shard)
    # nvidia's Kimi-K2.5 export names layers language_model.layers.N (no .model.): no module of the family
    tensors["language_model.layers.0.input_layernorm.weight"] = tensors["vision_tower.encoder.final_layernorm.weight"].clone()
    index["weight_map"]["language_model.layers.0.input_layernorm.weight"] = shard.name
    save_file(tensors, shard, metadata={"format": "pt"})
    (bad / "model.safetensors.index.json").write_text(json.dumps(index))
    r = CliRunner().invoke(main, ["convert", str(bad), "-o", str(tmp_path / "o")])
    assert r.exit_code == 1 and not (tmp_path / "o").exists(), r.output
    assert r.output.startswith("error: language_model.layers.0.input_layernorm.weight: no module of Kimi-K2.5"), r.output
    tensors["model.norm.weight"] = tensors.pop("language_model.layers.0.input_layernorm.weight")  # also with its prefix
    index["weight_map"]["model.norm.weight"] = index["weight_map"].pop("language_model.layers.0.input_layernorm.weight")
    save_file(tensors, shard, metadata={"format": "pt"})
    (bad / "model.safetensors.index.json").write_text(json.dumps(index))
    r = CliRunner().invoke(main, ["inspect", str(bad)])
    assert r.exit_code == 1 and r.output.count("\n") == 1, r.output
    assert "are the same tensor of the language model, with and without 'language_model.'" in r.output, r.output


# ------------------------------------------------------------------------------ DeepSeek-V3.2
@pytest.fixture(scope="module")
def v32(tmp_path_factory):
    return write_checkpoint(PRESETS["v3.2"], tmp_path_factory.mktemp("v32") / "src")


def _atom_install_check(src, out, work, *more: str) -> str:
    """``python -m harness check-engine atom`` (ATOM's own load of SRC against its door's install of
    OUT, both models, on ATOM's real code on the CPU): its output, exit status 0 or not."""
    import os

    from conftest import forked_python, need_engine_sources

    argv = ["check-engine", "atom", "--source", str(src), "--converted", str(out), "--work", str(work),
            "--oracles", str(need_engine_sources()), *more]
    rc, stdout, _ = forked_python("harness", argv, {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"})
    return f"rc={rc}\n{stdout}"


def test_deepseek_v32_is_its_own_family_with_the_indexer_in_every_layer(v32):
    src = SourceCheckpoint(v32)
    family = family_of(src.config)
    assert family.name == "deepseek-v3.2" and src.config["architectures"] == ["DeepseekV32ForCausalLM"]
    indexer = sorted(n for n in src.tensors if ".indexer." in n and n.startswith("model.layers.3."))  # the MTP layer's
    assert indexer == [f"model.layers.3.self_attn.indexer.{m}" for m in
                       ("k_norm.bias", "k_norm.weight", "weights_proj.weight", "wk.weight", "wq_b.weight")]
    assert all(family.knows_tensor(n) for n in src.tensors)
    r = CliRunner().invoke(main, ["inspect", str(v32)])
    assert r.output.splitlines()[0].endswith(": Quark MXFP4, DeepSeek-V3.2 (8 routed experts, 8 heads, sparse-attention "
                                             "indexer), deepseek_v32, 3 layers + MTP [3]"), r.output


@pytest.mark.parametrize("tp, ep", [(2, 1), (8, 8)])  # the other TP / EP pairs: GLM-5's, the same table rows
def test_deepseek_v32_converts_for_atom_with_the_indexer_whole_on_every_rank_and_reverts(v32, tmp_path, tp, ep):
    import layouts
    from conftest import assert_verifies_and_reverts
    from prep.convert import convert
    from prep.deepseek import target_for

    out = tmp_path / "out"
    convert(str(v32), out, target_for(ATOM, tp=tp, ep=ep))
    m = layouts.load_manifest(out)
    wq_b = "model.layers.1.self_attn.indexer.wq_b.weight"  # whole (4 heads of 32 over q_lora 128) on every rank
    assert [{t.name: t.shape for t in m.rank_tensors(r)}[wq_b] for r in range(tp)] == [(4 * 32, 128)] * tp
    assert_verifies_and_reverts(out, v32, tmp_path / "back")


def test_a_family_an_engines_door_is_not_checked_with_is_refused_naming_the_engines_that_serve_it(v32, tmp_path,
                                                                                              monkeypatch):
    import layouts

    monkeypatch.setattr(layouts.get_engine("vllm"), "families", ("deepseek-v3", "kimi-k2"))
    r = CliRunner().invoke(main, ["convert", str(v32), "-o", str(tmp_path / "o"), "--engine", "vllm", "--tp", "2",
                                  "--ep", "2"])
    assert r.exit_code == 1 and r.output.count("\n") == 1 and not (tmp_path / "o").exists(), r.output
    assert r.output == ("error: config.json: DeepSeek-V3.2 (sparse-attention indexer) is not checked against vLLM's "
                        "own load yet, so prep does not write it for vLLM; convert with --engine atom or sglang\n")


def test_the_reference_engine_computes_deepseek_v32_where_its_indexer_keeps_every_token_and_refuses_past(v32,
                                                                                                      tmp_path):
    # Up to index_topk positions the indexer keeps every cached token, so attention is dense: the
    # reference engine computes it exactly without the indexer (the source's and an ATOM
    # conversion's logits bit for bit); past it the indexer chooses, which it does not compute.
    from prep.convert import convert
    from prep.deepseek import target_for

    out = tmp_path / "out"
    convert(str(v32), out, target_for(ATOM, tp=2))
    r = CliRunner().invoke(main, ["compare", str(v32), str(out), "--prompt-ids", "1,2,3,4"])
    assert r.exit_code == 0 and "(identical bit for bit)" in r.output, r.output
    r = CliRunner().invoke(main, ["run", str(v32), "--prompt-ids", "1,2,3", "--generate", "2"])
    assert r.exit_code == 1 and r.output.count("\n") == 1, r.output
    assert r.output.endswith("DeepSeek-V3.2's indexer keeps 4 cached tokens per query (index_topk); up to that many "
                             "positions attention is dense and prep's reference engine computes it, but this prompt "
                             "and generation take 5: give at most 4\n"), r.output


# ------------------------------------------------------------------------------ GLM-5
@pytest.fixture(scope="module")
def glm(tmp_path_factory):
    return write_checkpoint(PRESETS["glm-5"], tmp_path_factory.mktemp("glm") / "src")


def test_glm5_is_its_own_family_with_an_mtp_layer_that_has_no_embedding_or_head(glm):
    src = SourceCheckpoint(glm)
    family = family_of(src.config)
    assert family.name == "glm-5" and src.config["architectures"] == ["GlmMoeDsaForCausalLM"]
    assert sorted(n.split(".", 3)[3] for n in src.tensors if n.startswith("model.layers.3.") and "mlp" not in n
                  and "attn" not in n) == ["eh_proj.weight", "enorm.weight", "hnorm.weight", "input_layernorm.weight",
                                           "post_attention_layernorm.weight", "shared_head.norm.weight"]
    r = CliRunner().invoke(main, ["inspect", str(glm)])
    assert r.output.splitlines()[0].endswith(": Quark MXFP4, GLM-5 (8 routed experts, 8 heads, sparse-attention "
                                             "indexer), glm_moe_dsa, 3 layers + MTP [3]"), r.output


@pytest.mark.parametrize("engine, tp, ep", [("atom", 8, 8), ("vllm", 2, 2), ("sglang", 8, 1)])
def test_glm5_converts_with_the_embedding_as_each_engine_holds_it_and_reverts(glm, tmp_path, engine, tp, ep):
    # ATOM holds GLM-5's embedding whole on every rank (ReplicatedEmbedding, its default
    # ATOM_REPLICATE_VOCAB_EMBED=1 with an untied head), its head vocabulary parallel; SGLang and
    # vLLM hold both vocabulary parallel.
    import layouts
    from conftest import assert_verifies_and_reverts
    from prep.convert import convert
    from prep.deepseek import target_for

    out = tmp_path / "out"
    convert(str(glm), out, target_for(get_engine(engine), tp=tp, ep=ep))
    m = layouts.load_manifest(out)
    shapes = [{t.name: t.shape for t in m.rank_tensors(r)} for r in range(tp)]
    embed = 1024 if engine == "atom" else 1024 // tp
    assert [(s["model.embed_tokens.weight"], s["lm_head.weight"]) for s in shapes] == [((embed, 256), (1024 // tp, 256))] * tp
    assert_verifies_and_reverts(out, glm, tmp_path / "back")


def test_glm5_through_atoms_door_equals_atoms_own_load_and_a_flipped_embedding_byte_fails(glm, tmp_path):
    # ATOM's GlmMoeDsaForCausalLM (its DeepSeek model) and DeepSeekMTP draft, which holds no
    # embedding or head of its own: ATOM's drafter shares the target's after the load, and warns
    # of the head it could not load from the checkpoint, on its own load as on the door's. ATOM
    # loads DeepSeek-V3.2 with the same model (GLM's subclasses it): this check stands for V3.2's
    # door too, the indexer included (check-engine atom on the v3.2 preset).
    import struct

    from prep.convert import convert
    from prep.deepseek import target_for

    out = tmp_path / "out"
    convert(str(glm), out, target_for(ATOM, tp=2))
    name = "model.embed_tokens.weight"  # rank 1's whole table: a byte past rank 0's half of the vocabulary
    for f in sorted(out.glob("model-tp2-rank1-*.safetensors")):
        with open(f, "r+b") as fh:
            n = struct.unpack("<Q", fh.read(8))[0]
            header = json.loads(fh.read(n))
            if name in header:
                start, stop = header[name]["data_offsets"]
                fh.seek(8 + n + stop - 2)
                b = fh.read(1)
                fh.seek(-1, 1)
                fh.write(bytes([b[0] ^ 0x40]))
                break
    else:
        raise AssertionError(f"{name} is in no file of rank 1")
    # one run over both ranks (the suite's time): rank 0 equal, rank 1 failing on its flipped byte alone
    report = _atom_install_check(glm, out, tmp_path / "work")
    rows = harness_rows(report)
    assert [(row["rank"], row["result"], row["warned"]) for row in rows] == [("0/2", "ok", "same"),
                                                                             ("1/2", "FAIL", "same")], report
    lines = report.splitlines()
    after = lines[next(i for i, x in enumerate(lines) if x.split()[1:2] == ["1/2"]) + 1:]
    said = [x for x in after[:next((i for i, x in enumerate(after) if not x.startswith("    ")), len(after))]
            if "bytes differ" in x]
    assert said and all("embed_tokens" in x for x in said), report


@pytest.mark.parametrize("engine, ep, tensors", [("sglang", "1", "72"), ("vllm", "2", "123")])
def test_glm5_through_sglangs_and_vllms_doors_equals_their_own_loads(glm, tmp_path, engine, ep, tensors):
    # SGLang's GlmMoeDsaForCausalLM and vLLM's (DeepSeek-V3.2's model on ROCm), vLLM's MTP draft
    # too (no embedding or head of its own: its proposer shares the target's); rank 1 here. The
    # same model classes load DeepSeek-V3.2 (SGLang's DeepseekV32ForCausalLM and GLM's both
    # subclass its DeepseekV2ForCausalLM; vLLM's GLM is its V3.2 model), so these checks stand for
    # V3.2's doors too (check-engine on the v3.2 preset, docs/engines.md).
    from conftest import engine_check_rows

    out = tmp_path / "out"
    r = CliRunner().invoke(main, ["convert", str(glm), "-o", str(out), "--engine", engine, "--tp", "2", "--ep", ep, "-q"])
    assert r.exit_code == 0, r.output
    rows, report = engine_check_rows(engine, glm, out, tmp_path / "work", "--ranks", "1")
    assert [(row["rank"], row["tensors"], row["result"]) for row in rows] == [("1/2", tensors, "ok")], report


def test_the_reference_engine_computes_glm5_with_its_rope_parameters(glm, tmp_path):
    # GLM-5's RoPE is in transformers 5's rope_parameters (theta 1e6; the layer-by-layer agreement
    # with transformers' GlmMoeDsa is in test_reference_engine.py): an ATOM conversion's logits
    # are the source's bit for bit.
    from prep.convert import convert
    from prep.deepseek import target_for

    out = tmp_path / "out"
    convert(str(glm), out, target_for(ATOM, tp=2))
    r = CliRunner().invoke(main, ["compare", str(glm), str(out), "--prompt-ids", "1,2,3,4"])
    assert r.exit_code == 0 and "(identical bit for bit)" in r.output, r.output


def test_prep_atom_serve_refuses_glm5_when_atom_would_split_its_embedding(glm, tmp_path):
    import layouts
    from layouts.engines.atom import serve
    from prep.convert import convert
    from prep.deepseek import target_for

    out = tmp_path / "out"
    convert(str(glm), out, target_for(ATOM, tp=2))
    manifest = layouts.load_manifest(out)
    serve.check_vocab_embed(manifest, {})  # ATOM's default: the whole table on every rank
    with pytest.raises(serve.ServeError, match=r"^ATOM_REPLICATE_VOCAB_EMBED=0: ATOM then splits GLM-5's embedding .* "
                                               r"unset ATOM_REPLICATE_VOCAB_EMBED$"):
        serve.check_vocab_embed(manifest, {"ATOM_REPLICATE_VOCAB_EMBED": "0"})


# ------------------------------------------------------------------------------ GLM-5.2 (IndexShare)
@pytest.fixture(scope="module")
def glm52(tmp_path_factory):
    return write_checkpoint(PRESETS["glm-5.2"], tmp_path_factory.mktemp("glm52") / "src")


def test_glm52_layers_that_share_an_indexer_hold_none_and_a_checkpoint_missing_a_full_layers_is_refused(glm52,
                                                                                                   tmp_path):
    import shutil

    from prep.testing import drop_tensors

    src = SourceCheckpoint(glm52)
    assert src.config["indexer_types"] == ["full", "shared", "full"]
    assert sorted({int(n.split(".")[2]) for n in src.tensors if ".indexer." in n}) == [0, 2, 3]  # 3: the MTP layer's
    bad = tmp_path / "bad"
    shutil.copytree(glm52, bad)
    drop_tensors(bad, lambda n: n == "model.layers.2.self_attn.indexer.wk.weight")
    r = CliRunner().invoke(main, ["convert", str(bad), "-o", str(tmp_path / "o"), "--tp", "2"])
    assert r.exit_code == 1 and "model.layers.2.self_attn.indexer.wk" in r.output and not (tmp_path / "o").exists(), \
        r.output


def test_glm52_through_atoms_door_equals_atoms_own_load(glm52, tmp_path):
    # ATOM builds no indexer in a layer its indexer_types marks "shared" (_indexer_weights_shared);
    # its load of prep's files, which hold none there either, equals its own load of the source on
    # rank 1 (vLLM's and SGLang's: check-engine, docs/engines.md).
    out = tmp_path / "out"
    r = CliRunner().invoke(main, ["convert", str(glm52), "-o", str(out), "--engine", "atom", "--tp", "2", "-q"])
    assert r.exit_code == 0, r.output
    report = _atom_install_check(glm52, out, tmp_path / "work", "--ranks", "1")
    rows = harness_rows(report)
    assert report.startswith("rc=0") and len(rows) == 1 and rows[0]["result"] == "ok", report


def test_sglangs_serve_command_says_the_shared_expert_fusion_the_files_hold(glm, tmp_path):
    # GLM-5-MXFP4's shared expert is BF16 beside MXFP4 routed experts: SGLang (and ATOM) keep it
    # apart whatever the switch says, and prep writes it apart, so the command says so.
    r = CliRunner().invoke(main, ["convert", str(glm), "-o", str(tmp_path / "o"), "--engine", "sglang", "--tp", "2",
                                  "--json"])
    assert r.exit_code == 0, r.output
    import json

    serve = json.loads(r.stdout)["serve"]
    assert "--disable-shared-experts-fusion" in serve and "--enforce-shared-experts-fusion" not in serve


def test_vllm_serves_glm51_without_its_draft_naming_the_quantized_eh_proj(tmp_path):
    # amd/GLM-5.1-MXFP4 quantizes its MTP layer's eh_proj; vLLM 0.34's MTP layer holds eh_proj as a
    # plain nn.Linear, so its own load of the source fails with the draft: prep's serve hint says
    # to serve without speculative decoding, and why (ATOM and SGLang hold it quantized).
    src = write_checkpoint(PRESETS["glm-5.1"], tmp_path / "src")
    r = CliRunner().invoke(main, ["convert", str(src), "-o", str(tmp_path / "o"), "--engine", "vllm", "--tp", "2",
                                  "--ep", "2"])
    assert r.exit_code == 0, r.output
    assert ("its MTP layer is not served as vLLM's draft model: model.layers.3.eh_proj.weight is quantized, and "
            "vLLM's MTP layer holds eh_proj unquantized (its own load of the source fails); serve it without "
            "speculative decoding") in r.output and "--speculative-config" not in r.output
    r = CliRunner().invoke(main, ["convert", str(src), "-o", str(tmp_path / "a"), "--engine", "atom", "--tp", "2"])
    assert r.exit_code == 0 and "add: --method mtp" in r.output, r.output
