"""``prep convert --engine sglang``: each rank's files hold exactly what SGLang 0.5.23's DeepSeek
model holds after loading (layouts/engines/sglang.py), so that SGLang's own ``--load-format
sharded_state`` loads them; checked against SGLang's real model and loaders on the CPU
(``python -m harness check-engine sglang``, in .venv-sglang), and the conversion stays verifiable and
revertible like every other."""

from __future__ import annotations

import json
import shlex

import pytest
import torch
from click.testing import CliRunner

import layouts
from conftest import assert_verifies_and_reverts, engine_check_rows, read_tensors
from layouts import CompatibilityError, EngineConfig
from layouts.engines import get_engine
from prep.cli import main
from prep.testing import PRESETS


def _convert(src, out, *args) -> str:
    r = CliRunner().invoke(main, ["convert", str(src), "-o", str(out), "--engine", "sglang", "--tp", "2", *args])
    assert r.exit_code == 0, r.output
    return r.output


def test_each_ranks_files_hold_sglangs_model_and_the_mtp_layer_stays_whole_in_the_common_file(tiny_r1, tmp_path):
    out = tmp_path / "out"
    printed = _convert(tiny_r1, out)
    m = layouts.load_manifest(out)
    mtp = f"model.layers.{PRESETS['tiny'].num_hidden_layers}."  # the MTP layer follows the decoder layers
    for rank in range(2):
        held = read_tensors(out, m.rank_files(rank))
        assert not [n for n in held if n.startswith(mtp)], "SGLang's main model holds no MTP layer"
        # SGLang's names and shapes: q_a and kv_a merged, experts stacked with the shared one (slot 8),
        # the intermediate 256 / TP 2 = 128 padded to 256, the scale held 3-D
        assert held["model.layers.0.self_attn.fused_qkv_a_proj_with_mqa.weight"].dtype == torch.bfloat16
        assert tuple(held["model.layers.1.mlp.experts.w13_weight"].shape) == (9, 512, 128)
        assert tuple(held["model.layers.1.mlp.experts.w13_weight_scale"].shape) == (9, 512, 8)
        scales = [n for n in held if n.endswith("_scale") and n.count(".attn_m")]
        assert len(scales) == 3 * 4 and all(held[n].dtype == torch.float32 and held[n].shape == () and
                                            held[n].item() == 1.0 for n in scales)
    common = [t for t in m.tensors if t.rank is None]
    assert {t.role for t in common} == {"unread"} and {t.name for t in common} == {
        n for n in m.source.tensors if n.startswith(mtp)}
    assert "--load-format sharded_state" in printed and "--tp-size 2 --enforce-shared-experts-fusion" in printed
    # the tiny config's wildcard excludes, which SGLang matches as exact names only: said, and passed as re:
    assert "'*self_attn*', '*mlp.gate.*', 'model.layers.3.*' are shell wildcards" in printed
    serve = next(line for line in printed.splitlines() if line.startswith("serve it with SGLang: "))
    override = json.loads(shlex.split(serve)[-1])
    assert override["quantization_config"]["exclude"] == [r"re:.*self_attn.*$", r"re:.*mlp\.gate\..*$", "lm_head",
                                                          r"re:model\.layers\.3\..*$"]
    assert_verifies_and_reverts(out, tiny_r1, tmp_path / "back")


def test_sglangs_switches_that_would_misread_the_files_are_refused():
    base = {"SGLANG_USE_AITER": "1"}
    assert EngineConfig.from_env(get_engine("sglang"), env=base, tp_size=2).expected_moe_layout() == "ck-3d"
    with pytest.raises(CompatibilityError, match="SGLANG_USE_AITER is not set"):
        EngineConfig.from_env(get_engine("sglang"), env={})
    with pytest.raises(CompatibilityError, match="SGLANG_ROCM_USE_AITER_FP4_ASM_GEMM=1: .* unset it"):
        EngineConfig.from_env(get_engine("sglang"), env={**base, "SGLANG_ROCM_USE_AITER_FP4_ASM_GEMM": "1"})


def test_common_bf16_is_refused_for_sglang_in_one_line(tiny_r1, tmp_path):
    r = CliRunner().invoke(main, ["convert", str(tiny_r1), "-o", str(tmp_path / "o"), "--engine", "sglang", "--common-bf16"])
    assert r.exit_code != 0 and "--common-bf16: engine 'sglang' loads only" in r.output
    assert not (tmp_path / "o").exists()


def test_sglangs_own_sharded_state_load_of_the_files_equals_its_load_of_the_source(tiny_r1, tmp_path):
    # SGLang's real DeepseekV3ForCausalLM per rank: ShardedStateLoader on prep's files against
    # DefaultModelLoader on the source, every tensor and the MLA w_kc/w_vc; a flipped byte fails.
    out = tmp_path / "out"
    printed = _convert(tiny_r1, out, "--ep", "2")
    lines = printed.splitlines()
    serve = next(line for line in lines if line.startswith("serve it with SGLang: "))
    assert "--ep-size 2 --enforce-shared-experts-fusion" in serve
    # SGLang's draft would read its tensors from the same files and fail deep inside: said, not served
    assert lines[lines.index(serve) + 1] == ("  its MTP layer is not served as SGLang's draft model from this folder yet "
                                             "(docs/engines.md): serve it without speculative decoding")
    # rank 1: every split part of it starts past the tensor's start (rank 0's too is checked by the
    # script's runs in docs/engines.md; the suite keeps to one rank for its time)
    rows, report = engine_check_rows("sglang", tiny_r1, out, tmp_path / "work", "--ranks", "1")
    assert [row["rank"] for row in rows] == ["1/2"] and all(row["result"] == "ok" and row["derived"] == "12"
                                                           for row in rows), report
