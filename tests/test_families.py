"""The model-family tables (layouts/families): resolved once from config.json, every module of a
checkpoint has a row (its kind and TP split), and what no row names is refused."""

from __future__ import annotations

import dataclasses

import pytest
from click.testing import CliRunner

from layouts.errors import LayoutsError
from layouts.families import COLS, ROWS, WHOLE, Family, Module, family_of, get_family, register_family
from prep.cli import main
from prep.source import SourceCheckpoint
from prep.testing import PRESETS, write_checkpoint


@pytest.mark.parametrize("config, family", [
    ({"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3"}, "deepseek-v3"),
    ({"architectures": ["DeepseekV2ForCausalLM"]}, "deepseek-v3"),
    ({"architectures": ["DeepseekV3ForCausalLM"], "model_type": "kimi_k2"}, "kimi-k2"),  # the type decides
])
def test_the_family_is_resolved_from_config_json(config, family):
    assert family_of(config).name == family


def test_a_config_of_no_known_family_is_refused_naming_the_families_prep_knows():
    with pytest.raises(LayoutsError, match=r"architecture \['LlamaForCausalLM'\] \(model_type 'llama'\) is no family "
                                           r"prep knows: DeepSeek-V2/V3 \(DeepseekV3ForCausalLM, .*Kimi-K2"):
        family_of({"architectures": ["LlamaForCausalLM"], "model_type": "llama"})
    with pytest.raises(LayoutsError):
        family_of({"architectures": 3})  # not a list: no family, not a crash


@pytest.mark.parametrize("preset", ["tiny", "kimi-k2"])
def test_every_tensor_of_a_generated_checkpoint_is_a_module_of_its_familys_table(tmp_path, preset):
    src = SourceCheckpoint(write_checkpoint(PRESETS[preset], tmp_path / preset))
    family = family_of(src.config)
    assert family.name == {"tiny": "deepseek-v3", "kimi-k2": "kimi-k2"}[preset]
    for name in src.tensors:
        module = name.rsplit(".", 1)[0]
        assert family.module(module) is not None or family.is_mtp_own(module), name


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


def test_inspect_names_the_family_and_its_sizes_first(tmp_path):
    src = write_checkpoint(PRESETS["kimi-k2"], tmp_path / "kimi")
    r = CliRunner().invoke(main, ["inspect", str(src)])
    assert r.exit_code == 0, r.output
    assert r.output.splitlines()[0] == (f"{src}: Quark MXFP4, Kimi-K2 (384 routed experts, 64 heads), deepseek_v3, "
                                        "3 layers, no MTP layer")
