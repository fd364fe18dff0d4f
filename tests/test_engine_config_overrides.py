"""What SGLang and vLLM would read from a DeepSeek config.json otherwise than the checkpoint means,
and the override their serve commands pass for it (layouts/engines/_config.py): Quark excludes
written as shell wildcards, and DeepSeek-V3's routing keys that a config saved by transformers 5
drops (an amd-quark 0.13 export has none of topk_method, scoring_func, moe_layer_freq; without
them vLLM builds no router bias and SGLang stops: seen on such an export with both engines' own
loaders, python -m harness check-quark-export). ATOM's door takes no override: its note says to
fix config.json."""

from __future__ import annotations

import json
import shlex
import shutil

import pytest
from click.testing import CliRunner

from layouts.engines import _config
from prep.cli import main

V3 = {"topk_method": "noaux_tc", "scoring_func": "sigmoid", "moe_layer_freq": 1}


def test_a_deepseek_v3_config_without_its_routing_keys_gets_v3s_values():
    assert _config.missing_keys({"model_type": "deepseek_v3"}) == V3
    assert _config.missing_keys({"model_type": "deepseek_v3", **V3}) == {}
    assert _config.missing_keys({"model_type": "deepseek_v3", "topk_method": "noaux_tc"}) == {
        "scoring_func": "sigmoid", "moe_layer_freq": 1}
    assert _config.missing_keys({"model_type": "deepseek_v2"}) == {}  # V2's routing differs: nothing assumed


def test_the_override_holds_the_regex_excludes_and_the_missing_keys():
    cfg = {"model_type": "deepseek_v3", "quantization_config": {"exclude": ["*self_attn*", "lm_head"]}}
    assert _config.override(cfg) == {"quantization_config": {"exclude": ["re:.*self_attn.*$", "lm_head"]}, **V3}
    assert _config.override({"model_type": "deepseek_v3", **V3, "quantization_config": {"exclude": ["lm_head"]}}) is None


def _without_routing_keys(src, tmp_path):
    """A copy of ``src`` whose config.json is as transformers 5 saves it: no V3 routing keys."""
    dst = tmp_path / "t5"
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    for k in V3:
        cfg.pop(k, None)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_convert_for_vllm_and_sglang_says_so_and_the_serve_command_passes_the_keys(tiny_r1, tmp_path):
    src = _without_routing_keys(tiny_r1, tmp_path)
    for engine, flag in (("vllm", "--hf-overrides"), ("sglang", "--json-model-override-args")):
        out = tmp_path / engine
        r = CliRunner().invoke(main, ["convert", str(src), "-o", str(out), "--engine", engine,
                                                      "--tp", "2", "--ep", "2"])
        assert r.exit_code == 0, r.output
        assert "config.json lacks DeepSeek-V3's topk_method, scoring_func, moe_layer_freq" in r.stderr
        serve = next(line for line in r.stdout.splitlines() if line.startswith("serve it with"))
        words = shlex.split(serve)
        override = json.loads(words[words.index(flag) + 1])
        assert {k: override[k] for k in V3} == V3 and override["quantization_config"]["exclude"][0].startswith("re:")
        # config.json stays the source's (revert is exact)
        assert json.loads((out / "config.json").read_text()) == json.loads((src / "config.json").read_text())


def test_convert_for_atom_says_its_door_sets_the_keys_and_the_door_sets_them_on_atoms_config(tiny_r1, tmp_path):
    from types import SimpleNamespace

    from layouts.engines.atom import worker

    src = _without_routing_keys(tiny_r1, tmp_path)
    out = tmp_path / "atom"
    r = CliRunner().invoke(main, ["convert", str(src), "-o", str(out), "--tp", "2"])
    assert r.exit_code == 0, r.output
    assert ('without which ATOM builds another router and fails on the checkpoint: prep-atom-serve sets V3\'s values '
            '("topk_method": "noaux_tc", "scoring_func": "sigmoid", "moe_layer_freq": 1) on ATOM\'s config in each '
            'worker') in r.stderr
    # What each worker does before ATOM builds its models (worker.prepare_worker): the target's and
    # the draft's configs get V3's values; config.json stays the source's (revert is exact).
    config = SimpleNamespace(hf_config=SimpleNamespace(), draft_model_hf_config=SimpleNamespace())
    assert worker.complete_hf_config(out, config) == V3
    assert all(vars(hf) == V3 for hf in (config.hf_config, config.draft_model_hf_config))
    assert json.loads((out / "config.json").read_text()) == json.loads((src / "config.json").read_text())
    whole = tmp_path / "whole"  # a source whose config.json has them: nothing set
    assert CliRunner().invoke(main, ["convert", str(tiny_r1), "-o", str(whole), "--tp", "2"]).exit_code == 0
    untouched = SimpleNamespace(hf_config=SimpleNamespace())
    assert worker.complete_hf_config(whole, untouched) == {} and vars(untouched.hf_config) == {}


def test_inspect_of_such_a_source_says_what_each_engine_would_misread_before_converting(tiny_r1, tmp_path):
    src = _without_routing_keys(tiny_r1, tmp_path)
    r = CliRunner().invoke(main, ["inspect", str(src), "--json"])
    assert r.exit_code == 0, r.output
    notes = json.loads(r.output)["engine_notes"]
    assert set(notes) == {"ATOM", "SGLang", "vLLM"}
    assert all(any("lacks DeepSeek-V3's topk_method" in line for line in said) for said in notes.values())
    assert any("shell wildcards" in line for line in notes["vLLM"])  # the generated config's excludes too


@pytest.mark.parametrize("change, said", [
    ({}, "3 layers + MTP [3]\n"),
    # config.json names a second MTP layer the checkpoint does not hold.
    ({"num_nextn_predict_layers": 2}, "3 layers + MTP [3] (config.json names [3, 4]; the checkpoint holds no tensor of [4])"),
    # An amd-quark export made with transformers 5: num_nextn_predict_layers 1 and no MTP tensor
    # (here config.json counts the tiny's MTP layer as a decoder layer, and names the next).
    ({"num_hidden_layers": 4}, "4 layers, no MTP layer (config.json names [4]; the checkpoint holds no tensor of [4])"),
])
def test_inspect_says_which_mtp_layers_the_checkpoint_holds_not_only_what_config_json_names(tiny_r1, tmp_path,
                                                                                         change, said):
    src = tmp_path / "src"
    shutil.copytree(tiny_r1, src)
    cfg = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**cfg, **change}))
    r = CliRunner().invoke(main, ["inspect", str(src)])
    assert r.exit_code == 0, r.output
    assert said in r.output
