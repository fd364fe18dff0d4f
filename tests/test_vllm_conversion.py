"""``prep convert --engine vllm``: each rank's files hold what vLLM 0.34.0's DeepSeek model holds
after loading on MI355 with aiter (layouts/engines/vllm.py; checked against vLLM's real
DefaultModelLoader on the CPU, docs/engines.md "vLLM"), and the conversion verifies and reverts
like every other. vLLM's door is prep's model loader (``vllm serve OUT --load-format prep``,
layouts/engines/vllm/door.py), registered by the ``vllm.general_plugins`` entry point."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

import layouts
from layouts import CompatibilityError, EngineConfig
from layouts.engines import get_engine
from conftest import assert_verifies_and_reverts, engine_check_rows, read_tensors
from prep.cli import main
from prep.testing import PRESETS


def test_each_ranks_files_hold_vllms_names_and_layouts_and_the_conversion_reverts(tiny_r1, tmp_path):
    out = tmp_path / "out"
    r = CliRunner().invoke(main, ["convert", str(tiny_r1), "-o", str(out), "--engine", "vllm", "--tp", "2", "--ep", "2"])
    assert r.exit_code == 0, r.output
    serve, draft = r.output.strip().splitlines()[-2:]
    assert serve.startswith("serve it with vLLM: VLLM_ROCM_USE_AITER=1 vllm serve ") and \
        "--load-format prep --tensor-parallel-size 2 --enable-expert-parallel --hf-overrides" in serve
    assert draft == ("  with its MTP layer as the draft model (speculative decoding), add: --speculative-config "
                     "'{\"method\": \"mtp\", \"num_speculative_tokens\": 1}'")
    j = CliRunner().invoke(main, ["inspect", str(out), "--json"])
    assert j.exit_code == 0 and json.loads(j.output)["serve_mtp_draft"] == layouts.get_engine("vllm").mtp_draft_flags
    m = layouts.load_manifest(out)
    assert (m.target.engine, m.target.layout, m.target.moe_layout) == ("vllm", "non-shuffle-t", "ck-3d")
    mtp = f"model.layers.{PRESETS['tiny'].num_hidden_layers}."
    src = read_tensors(tiny_r1)
    # the MTP layer's embedding and head, which vLLM's draft replaces by the main model's: read by no rank
    unread = {t.name for t in m.tensors if t.role == "unread"}
    assert unread == {f"{mtp}embed_tokens.weight", f"{mtp}shared_head.head.weight"}
    for rank in range(2):
        held = read_tensors(out, m.rank_files(rank))
        # the MTP layer for vLLM's draft: split and merged as the main layers, its BF16 experts (R1-0528)
        # this rank's block in aiter's shuffle_weight (16, 16) order, as vLLM's unquantized aiter MoE holds them
        w13 = held[f"{mtp}mlp.experts.routed_experts.w13_weight"]
        block = range(4 * rank, 4 * rank + 4)
        stack = torch.stack([torch.cat([src[f"{mtp}mlp.experts.{e}.{p}_proj.weight"] for p in ("gate", "up")])
                             for e in block])
        assert torch.equal(w13, layouts.get_layout("bf16-preshuffle").apply(stack, None)[0])
        gate_up = held[f"{mtp}mlp.shared_experts.gate_up_proj.weight"]
        n = src[f"{mtp}mlp.shared_experts.gate_proj.weight"].shape[0] // 2
        assert torch.equal(gate_up, torch.cat([src[f"{mtp}mlp.shared_experts.{p}_proj.weight"][rank * n:(rank + 1) * n]
                                               for p in ("gate", "up")]))
        assert f"{mtp}eh_proj.weight" in held and not unread & held.keys()
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
    assert EngineConfig.from_env(get_engine("vllm"), env=base).expected_dense_layout() == "non-shuffle-t"
    with pytest.raises(CompatibilityError, match="VLLM_ROCM_USE_AITER is not set"):
        EngineConfig.from_env(get_engine("vllm"), env={})
    with pytest.raises(CompatibilityError, match="VLLM_ROCM_USE_AITER_FUSION_SHARED_EXPERTS=1: .* unset it"):
        EngineConfig.from_env(get_engine("vllm"), env={**base, "VLLM_ROCM_USE_AITER_FUSION_SHARED_EXPERTS": "1"})


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
    # vLLM 0.34.0's real DeepseekV3ForCausalLM per rank on the CPU (harness/vllm.py): its
    # DefaultModelLoader on the source against --load-format prep on the conversion, which vLLM
    # finds through the package's vllm.general_plugins entry point; every state-dict tensor,
    # aliases and the derived W_UK_T / W_UV included.
    out = tmp_path / "out"
    r = CliRunner().invoke(main, ["convert", str(tiny_r1), "-o", str(out), "--engine", "vllm", "--tp", "2", "--ep", "2"])
    assert r.exit_code == 0, r.output
    # rank 1 (every split part past the tensor's start, the second block of experts; rank 0 is the
    # TP 1 test's below and the script's runs in docs/engines.md)
    rows, report = engine_check_rows("vllm", tiny_r1, out, tmp_path / "work", "--ranks", "1")
    # 104 tensors of the model, and 39 of its MTP draft (--speculative-config mtp) loaded after it
    assert "the MTP draft compared too" in report
    assert [row["rank"] for row in rows] == ["1/2"] and all(
        row["result"] == "ok" and row["tensors"] == "143" and row["draft"] == "39" for row in rows), report


def test_linears_vllm_runs_on_tuned_aiter_gemms_are_laid_out_by_the_door_as_vllm_holds_them(tmp_path):
    # Which GEMM vLLM runs a dense linear on depends on aiter's tuned tables where it runs (not
    # known when converting). Both loads made with aiter's probes answering "tuned" (--asm-tuned):
    # for every MXFP4 shape (vLLM holds such a linear W16 with the scale [N, K/32] swizzled), and for
    # the FP8 ones whose N is a multiple of 128 (aiter's preshuffled per-token GEMM: the weight
    # shuffled (16, 16)); the other FP8 linears stay on torch's row-wise GEMM, the weight a
    # transposed view of its memory with the scale [N, 1]. The door lays prep's bytes out so on
    # the way. Tiny MTP-MoEFP4 (Quark's FP8 per-channel attention beside MXFP4 MLPs and experts),
    # whose MLA kv_b_proj vLLM runs on an identity (aiter's per-token quant and FP8 GEMM as torch
    # stand-ins, named per rank): all three in the model and in its MTP draft.
    import dataclasses

    from checkpoints import write_checkpoint

    src = write_checkpoint(dataclasses.replace(PRESETS["tiny"], variant="mtp-moefp4"), tmp_path / "mtp")
    out = tmp_path / "out"
    r = CliRunner().invoke(main, ["convert", str(src), "-o", str(out), "--engine", "vllm", "--tp", "1"])
    assert r.exit_code == 0, r.output
    rows, report = engine_check_rows("vllm", src, out, tmp_path / "work", "--asm-tuned")
    assert [(row["rank"], row["result"]) for row in rows] == [("0/1", "ok")], report
    assert ("dense linears by vLLM's GEMM: FP8 AiterPreshuffledPerTokenFp8ScaledMMLinearKernel 9, FP8 "
            "RowWiseTorchFP8ScaledMMLinearKernel 3, MXFP4 ASM GEMM (shuffled) 6, draft FP8 "
            "AiterPreshuffledPerTokenFp8ScaledMMLinearKernel 3, draft FP8 RowWiseTorchFP8ScaledMMLinearKernel 1, "
            "draft MXFP4 ASM GEMM (shuffled) 2\n") in report, report
    assert "torch stand-ins computed for GPU kernels: aiter.dynamic_per_token_scaled_quant, aiter.gemm_a8w8_bpreshuffle\n" \
        in report, report
    assert_verifies_and_reverts(out, src, tmp_path / "back")


def test_the_asm_gemm_layout_is_the_registrys_from_the_written_one():
    from layouts.engines.vllm.door import DoorError, _as_asm_gemm_holds

    w, s = torch.randint(0, 256, (64, 128), dtype=torch.uint8), torch.randint(0, 256, (64, 8), dtype=torch.uint8)
    written_w, written_s = layouts.get_layout("non-shuffle-t").apply(w, s)
    held_w, held_s = layouts.get_layout("preshuffle-unpadded").apply(w, s)
    assert torch.equal(_as_asm_gemm_holds(written_w, "x.weight", "non-shuffle-t", "OUT"), held_w)
    assert torch.equal(_as_asm_gemm_holds(written_s, "x.weight_scale", "non-shuffle-t", "OUT"), held_s)
    with pytest.raises(DoorError, match="x.weight is in layout 'preshuffle'.* convert again with --engine vllm"):
        _as_asm_gemm_holds(held_w, "x.weight", "preshuffle", "OUT")


def test_vllms_mtp_draft_takes_the_mtp_layer_under_its_own_names():
    from layouts.engines.vllm.door import draft_name

    assert draft_name("model.layers.61.mlp.experts.routed_experts.w13_weight") == \
        "model.layers.61.mtp_block.mlp.experts.routed_experts.w13_weight"
    assert draft_name("model.layers.61.self_attn.fused_qkv_a_proj.weight") == \
        "model.layers.61.mtp_block.self_attn.fused_qkv_a_proj.weight"
    for own in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight"):
        assert draft_name(f"model.layers.61.{own}") == f"model.layers.61.{own}"


def test_a_draft_load_of_a_conversion_without_an_mtp_layer_is_refused_in_one_line(tiny_r1, tmp_path):
    from layouts.engines.vllm.door import DoorError, install

    out = tmp_path / "out"
    r = CliRunner().invoke(main, ["convert", str(tiny_r1), "-o", str(out), "--engine", "vllm", "--tp", "2", "--ep", "2"])
    assert r.exit_code == 0, r.output
    # as a folder converted before the MTP layer went into the ranks' files reads: no MTP tensor
    # from the main model's layer count on (here: none past layer 99)
    with pytest.raises(DoorError, match=r"rank 1's files hold no MTP layer for vLLM's draft model .* or serve "
                                        r"without --speculative-config"):
        install(torch.nn.Linear(1, 1), str(out), layouts.load_manifest(out), 1, first_mtp=99, draft=True)


def test_a_model_a_plugin_put_in_place_of_vllms_own_is_refused_naming_the_switch():
    from layouts.engines.vllm.door import DoorError, check_own_model

    def cls(module: str) -> type:
        return type("DeepseekV3ForCausalLM", (), {"__module__": module})

    check_own_model(cls("vllm.model_executor.models.deepseek_v2"))
    with pytest.raises(DoorError, match="from atom.plugin.vllm.model_wrapper, not its own model.* "
                                        "ATOM's vLLM plugin .* ATOM_DISABLE_VLLM_PLUGIN=1$"):
        check_own_model(cls("atom.plugin.vllm.model_wrapper"))
    with pytest.raises(DoorError, match="a vLLM plugin replaced vLLM's own: serve without that plugin$"):
        check_own_model(cls("someplugin.models"))


def test_an_fp8_weight_is_copied_into_the_memory_of_vllms_transposed_view():
    # A square one, where the shapes alone cannot say which way round the bytes go.
    from layouts.engines.vllm.door import _copy_into

    src = torch.randint(0, 256, (32, 32), dtype=torch.uint8).view(torch.float8_e4m3fn)
    held = torch.empty(32, 32, dtype=torch.float8_e4m3fn).t()  # vLLM's processed weight.t()
    _copy_into(held, src, "x.weight", "OUT")
    assert torch.equal(held.t().view(torch.uint8), src.view(torch.uint8))
    scale = torch.empty(32, 1)
    _copy_into(scale, torch.arange(32, dtype=torch.bfloat16), "x.weight_scale", "OUT")
    assert torch.equal(scale, torch.arange(32, dtype=torch.float32).reshape(32, 1))
