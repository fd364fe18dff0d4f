"""``prep convert --engine vllm``: each rank's files hold what vLLM 0.34.0's DeepSeek model holds
after loading on MI355 with aiter (layouts/engines/vllm.py; checked against vLLM's real
DefaultModelLoader on the CPU, docs/engines.md "vLLM"), and the conversion verifies and reverts
like every other. vLLM's door is prep's model loader (``vllm serve OUT --load-format prep``,
layouts/engines/vllm/door.py), registered by the ``vllm.general_plugins`` entry point."""

from __future__ import annotations


import pytest
import torch
from click.testing import CliRunner

import layouts
from layouts.compat import CompatibilityError, EngineConfig
from conftest import assert_verifies_and_reverts, engine_check_rows, read_tensors
from prep.cli import main
from prep.testing import PRESETS


def test_each_ranks_files_hold_vllms_names_and_layouts_and_the_conversion_reverts(tiny_r1, tmp_path):
    out = tmp_path / "out"
    r = CliRunner().invoke(main, ["convert", str(tiny_r1), "-o", str(out), "--engine", "vllm", "--tp", "2", "--ep", "2"])
    assert r.exit_code == 0, r.output
    serve = r.output.strip().splitlines()[-1]
    assert serve.startswith("serve it with vLLM: VLLM_ROCM_USE_AITER=1 vllm serve ") and \
        "--load-format prep --tensor-parallel-size 2 --enable-expert-parallel --hf-overrides" in serve
    m = layouts.load_manifest(out)
    assert (m.target.engine, m.target.layout, m.target.moe_layout) == ("vllm", "non-shuffle-t", "ck-3d")
    mtp = f"model.layers.{PRESETS['tiny'].num_hidden_layers}."
    src = read_tensors(tiny_r1)
    for rank in range(2):
        held = read_tensors(out, m.rank_files(rank))
        assert not [n for n in held if n.startswith(mtp)]
        # the dense scale transposed [K/32, N]: the rank's rows of the source's gate and up scales
        gate_up = held["model.layers.0.mlp.gate_up_proj.weight_scale"]
        gate, up = src["model.layers.0.mlp.gate_proj.weight_scale"], src["model.layers.0.mlp.up_proj.weight_scale"]
        n = gate.shape[0] // 2
        want = torch.cat([gate[rank * n:(rank + 1) * n], up[rank * n:(rank + 1) * n]]).t()
        assert torch.equal(gate_up, want)
        # experts under vLLM's name, this rank's block of 4 (EP 2), the shared expert not stacked
        assert tuple(held["model.layers.1.mlp.experts.routed_experts.w13_weight"].shape) == (4, 512, 128)
        assert tuple(held["model.layers.1.mlp.experts.routed_experts.w13_weight_scale"].shape) == (4, 512, 8)
        assert "model.layers.1.mlp.shared_experts.gate_up_proj.weight" in held
    assert_verifies_and_reverts(out, tiny_r1, tmp_path / "back")


def test_vllms_switches_that_would_misread_the_files_are_refused():
    base = {"VLLM_ROCM_USE_AITER": "1"}
    assert EngineConfig.from_env(env=base, engine="vllm").expected_dense_layout() == "non-shuffle-t"
    with pytest.raises(CompatibilityError, match="VLLM_ROCM_USE_AITER is not set"):
        EngineConfig.from_env(env={}, engine="vllm")
    with pytest.raises(CompatibilityError, match="VLLM_ROCM_USE_AITER_FUSION_SHARED_EXPERTS=1: .* unset it"):
        EngineConfig.from_env(env={**base, "VLLM_ROCM_USE_AITER_FUSION_SHARED_EXPERTS": "1"}, engine="vllm")


def test_a_rank_whose_expert_scale_vllm_would_pad_is_refused_in_one_line(tiny_r1, tmp_path):
    # The tiny experts' 256 intermediate at TP 2 is 128 a rank: w2's scale has 4 columns, which
    # aiter's shuffle pads to 8 from memory vLLM never writes; prep refuses rather than guess.
    r = CliRunner().invoke(main, ["convert", str(tiny_r1), "-o", str(tmp_path / "o"), "--engine", "vllm", "--tp", "2"])
    assert r.exit_code != 0 and "layout 'ck-3d' cannot apply" in r.output and "K/32 % 8 == 0 (K/32 = 4)" in r.output
    assert not (tmp_path / "o").exists()


def test_a_fused_shared_expert_is_refused_for_vllm(tiny_r1, tmp_path):
    r = CliRunner().invoke(main, ["convert", str(tiny_r1), "-o", str(tmp_path / "o"), "--engine", "vllm",
                                  "--fuse-shared-expert"])
    assert r.exit_code != 0 and "VLLM_ROCM_USE_AITER_FUSION_SHARED_EXPERTS=1, which its door does not serve" in r.output


def test_the_door_is_registered_for_vllm_by_the_packages_entry_point():
    from importlib.metadata import entry_points

    (ep,) = [e for e in entry_points(group="vllm.general_plugins") if e.name == "prep"]
    assert ep.value == "layouts.engines.vllm.door:register"
    from layouts.engines.vllm import door

    assert ep.load() is door.register and door.LOAD_FORMAT == "prep"


def test_vllms_load_through_the_door_equals_its_own_load_of_the_source(tiny_r1, tmp_path):
    # vLLM 0.34.0's real DeepseekV3ForCausalLM per rank on the CPU (scripts/vllm_on_cpu.py): its
    # DefaultModelLoader on the source against --load-format prep on the conversion, which vLLM
    # finds through the package's vllm.general_plugins entry point; every state-dict tensor,
    # aliases and the derived W_UK_T / W_UV included.
    out = tmp_path / "out"
    r = CliRunner().invoke(main, ["convert", str(tiny_r1), "-o", str(out), "--engine", "vllm", "--tp", "2", "--ep", "2"])
    assert r.exit_code == 0, r.output
    rows, report = engine_check_rows("vllm", tiny_r1, out, tmp_path / "work")
    assert [row[0] for row in rows] == ["0", "1"] and all(row[-1] == "ok" and row[1] == "104" for row in rows), report
