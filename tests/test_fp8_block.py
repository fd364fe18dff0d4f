"""DeepSeek's own FP8 release (DeepSeek-R1-0528 as released): every linear and expert F8_E4M3
with F32 ``weight_scale_inv`` per 128x128 block. prep splits and merges each scale by whole
blocks with its weight, as ATOM's loaders hold them, under ATOM's names (``weight_scale``,
``w13_weight_scale``), leaving ATOM's own processing to run at load; ``verify --source`` and
``revert`` stay byte-exact. ATOM's start-up on these ranks is compared with its own on the
source in tests/test_atom_serve.py."""

from __future__ import annotations

import json
import pathlib
import shutil

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

import layouts
from layouts.engines import get_engine
from prep.cli import main
from prep.convert import convert
from prep.converted import same_bytes
from prep.deepseek import target_for
from prep.errors import PrepError
from prep.testing import PRESETS, SynthSpec
from checkpoints import write_checkpoint

from conftest import assert_verifies_and_reverts

ATOM = get_engine("atom")  # the engine whose profile these tests use

B = 128  # DeepSeek's FP8 block


def all_tensors(folder: pathlib.Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def nothing_left(out: pathlib.Path) -> bool:
    return not out.exists() and not (out.parent / f".{out.name}.prep").exists()


@pytest.fixture(scope="module")
def fp8_block(tmp_path_factory) -> pathlib.Path:
    return write_checkpoint(PRESETS["r1-0528-fp8"], tmp_path_factory.mktemp("fp8-block") / "src")


def test_deepseeks_own_fp8_release_is_generated_as_released(tmp_path):
    # Every linear F8_E4M3 with an F32 weight_scale_inv per 128x128 block (experts and the MTP layer
    # too), the router, embeddings, heads, norms and eh_proj BF16, DeepSeek's own
    # quantization_config. Each block's scale is its amax / 448, so its largest code is +-448.
    src = write_checkpoint(SynthSpec(variant="fp8-block"), tmp_path / "src")
    qc = json.loads((src / "config.json").read_text())["quantization_config"]
    assert qc == {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}
    t = all_tensors(src)
    w, s = t["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"], t["model.layers.0.self_attn.kv_a_proj_with_mqa.weight_scale_inv"]
    assert w.dtype == torch.float8_e4m3fn and w.shape == (144, 256) and s.dtype == torch.float32 and s.shape == (2, 2)
    for r in range(2):
        for c in range(2):
            assert w[r * B:(r + 1) * B, c * B:(c + 1) * B].float().abs().max() == 448
    assert t["model.layers.1.mlp.experts.0.down_proj.weight"].dtype == torch.float8_e4m3fn
    assert all(t[n].dtype == torch.bfloat16 for n in ("lm_head.weight", "model.layers.1.mlp.gate.weight",
                                                       "model.layers.3.eh_proj.weight", "model.embed_tokens.weight"))


def rows(t: torch.Tensor, r: int, tp: int) -> torch.Tensor:
    n = t.shape[0] // tp
    return t[r * n:(r + 1) * n]


def cols(t: torch.Tensor, r: int, tp: int) -> torch.Tensor:
    k = t.shape[1] // tp
    return t[:, r * k:(r + 1) * k]


@pytest.mark.parametrize("tp, ep", [(1, 1), (2, 1), (4, 4), (8, 8)])
def test_fp8_block_scales_follow_their_weights_by_whole_blocks_and_round_trip(fp8_block, tmp_path, tp, ep):
    # What ATOM's loaders hold before processing (atom/model_ops/linear.py, moe.py): a column-
    # parallel weight's rows and its scale's rows [r * N/tp/128, ...), a row-parallel one's columns
    # with its scale's columns, fused_qkv_a_proj = [q_a ; kv_a] with their scale rows stacked,
    # gate_up likewise per rank, and the experts stacked w13 = [gate ; up], the shared expert last,
    # their scales stacked the same way: w13_weight_scale [E, 2 I/tp/128, H/128].
    # Every FP8 weight is stored as ATOM holds it once loaded: aiter's (16, 16) shuffle (fp8-preshuffle,
    # is_shuffled), taken back here to compare; the scales as the source holds them.
    src, out, back = fp8_block, tmp_path / "out", tmp_path / "back"
    convert(str(src), out, target_for(ATOM, tp=tp, ep=ep))
    s = all_tensors(src)
    m = json.loads((out / "prep-manifest.json").read_text())
    assert m["target"]["fp8_layout"] == "fp8-preshuffle"
    for t in m["tensors"]:
        fp8 = t["dtype"] == "F8_E4M3"
        assert (t.get("layout"), t.get("runtime_attrs", {})) == (("fp8-preshuffle", {"is_shuffled": True}) if fp8 else (None, {})), t
    n_routed = 8
    unshuffle = layouts.get_layout("fp8-preshuffle").weight
    for r in range(tp):
        files = {t["file"] for t in m["tensors"] if t["rank"] == r}
        rank = {k: unshuffle.inverse(v, tuple(v.shape)) if v.dtype == torch.float8_e4m3fn else v
                for f in files for k, v in load_file(out / f).items()}
        assert not any(k.endswith("_scale_inv") for k in rank)  # ATOM's names
        for layer in (1, 3):  # a decoder layer and the MTP layer (ATOM's drafter)
            a = f"model.layers.{layer}.self_attn"
            for proj in ("q_b_proj", "kv_b_proj"):
                assert same_bytes(rank[f"{a}.{proj}.weight"], rows(s[f"{a}.{proj}.weight"], r, tp))
                assert same_bytes(rank[f"{a}.{proj}.weight_scale"], rows(s[f"{a}.{proj}.weight_scale_inv"], r, tp))
            assert same_bytes(rank[f"{a}.o_proj.weight"], cols(s[f"{a}.o_proj.weight"], r, tp))
            assert same_bytes(rank[f"{a}.o_proj.weight_scale"], cols(s[f"{a}.o_proj.weight_scale_inv"], r, tp))
            for what in ("weight", "weight_scale"):
                src_what = "weight" if what == "weight" else "weight_scale_inv"
                assert same_bytes(rank[f"{a}.fused_qkv_a_proj.{what}"],
                                  torch.cat([s[f"{a}.q_a_proj.{src_what}"], s[f"{a}.kv_a_proj_with_mqa.{src_what}"]]))
            e = f"model.layers.{layer}.mlp"
            local = list(range(n_routed)) if ep == 1 else list(range(r * n_routed // ep, (r + 1) * n_routed // ep))
            experts = [f"{e}.experts.{i}" for i in local] + [f"{e}.shared_experts"]
            moe_tp, moe_r = (tp, r) if ep == 1 else (1, 0)
            for what, src_what in (("weight", "weight"), ("weight_scale", "weight_scale_inv")):
                w13, w2 = rank[f"{e}.experts.w13_{what}"], rank[f"{e}.experts.w2_{what}"]
                assert w13.shape[0] == w2.shape[0] == len(experts)
                for slot, x in enumerate(experts):
                    assert same_bytes(w13[slot], torch.cat([rows(s[f"{x}.gate_proj.{src_what}"], moe_r, moe_tp),
                                                            rows(s[f"{x}.up_proj.{src_what}"], moe_r, moe_tp)]))
                    assert same_bytes(w2[slot], cols(s[f"{x}.down_proj.{src_what}"], moe_r, moe_tp))
        d = "model.layers.0.mlp"
        assert same_bytes(rank[f"{d}.gate_up_proj.weight_scale"],
                          torch.cat([rows(s[f"{d}.gate_proj.weight_scale_inv"], r, tp), rows(s[f"{d}.up_proj.weight_scale_inv"], r, tp)]))
        assert rank[f"{d}.gate_up_proj.weight_scale"].shape == (2 * 1024 // tp // B, 256 // B)
        assert same_bytes(rank[f"{d}.down_proj.weight_scale"], cols(s[f"{d}.down_proj.weight_scale_inv"], r, tp))
    assert_verifies_and_reverts(out, src, back)


def test_a_tp_that_cuts_a_128_block_is_refused_naming_the_scales(fp8_block, tmp_path):
    # ATOM narrows a rank's scales by ceil(part / 128) without checking that the part is whole
    # blocks: a cut block would be read with its neighbour's scale. At TP 4 an expert's 256 rows
    # leave each rank 64; with --ep 4 (whole experts) it converts (tested above). The default tiny's
    # q_b_proj (8 heads x 48 rows) cuts a block at TP 2.
    with pytest.raises(PrepError, match=r"experts\.0\.gate_proj\.weight_scale_inv: over tp=4 a rank holds 256/4 rows of "
                                        r"its weight, not whole 128x128 blocks .* choose a tp \(or --ep\)"):
        convert(str(fp8_block), tmp_path / "out", target_for(ATOM, tp=4))
    assert nothing_left(tmp_path / "out")
    tiny = write_checkpoint(SynthSpec(variant="fp8-block"), tmp_path / "tiny")
    with pytest.raises(PrepError, match=r"q_b_proj\.weight_scale_inv: over tp=2 a rank holds 384/2 rows"):
        convert(str(tiny), tmp_path / "out", target_for(ATOM, tp=2))
    assert nothing_left(tmp_path / "out")


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_fp8_block_is_refused_for_an_engine_whose_door_is_not_checked_with_it(fp8_block, tmp_path, engine):
    with pytest.raises(PrepError, match=r"\.weight: FP8 with 128x128 block scales is not checked against .*'s own "
                                        r"load yet.*convert with --engine atom"):
        convert(str(fp8_block), tmp_path / "out", target_for(get_engine(engine), tp=2, ep=2))
    assert nothing_left(tmp_path / "out")


def test_block_scales_of_another_shape_or_without_a_scale_are_refused_in_one_line(fp8_block, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(fp8_block, src)
    name = "model.layers.1.self_attn.o_proj.weight_scale_inv"
    shard = next(f for f in sorted(src.glob("*.safetensors")) if name in load_file(f))
    tensors = load_file(shard)
    good = tensors[name]
    tensors[name] = good[:, :1].contiguous()
    save_file(tensors, shard, metadata={"format": "pt"})
    r = CliRunner().invoke(main, ["convert", str(src), "-o", str(tmp_path / "out"), "--tp", "2"])
    assert r.exit_code == 1 and r.output.count("\n") == 1, r.output
    assert r.output.startswith(f"error: {name}: block scales must be F32 [ceil(N/128), ceil(K/128)] of an F8_E4M3 "
                               "weight [N, K] (got F32 [2, 1] for weight F8_E4M3 [256, 2048])"), r.output
    assert nothing_left(tmp_path / "out")
    # DeepSeek's quantization_config with another block size: refused before any tensor is read
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"]["weight_block_size"] = [64, 64]
    (src / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(PrepError, match=r"an FP8 checkpoint with weight_block_size \[64, 64\].*prep converts DeepSeek's "
                                        r"FP8 release \(weight_block_size \[128, 128\]"):
        convert(str(src), tmp_path / "out", target_for(ATOM, tp=2))


def test_atoms_triton_gemm_takes_block_scaled_fp8_attention_where_per_channel_is_refused(fp8_block, tmp_path):
    # ATOM's fused q_a/kv_a path under ATOM_USE_TRITON_GEMM=1 runs its block-scale GEMMs: right for
    # DeepSeek's blocks (checked on ATOM's start-up by hand, docs/engines.md), wrong for Quark's
    # per-channel FP8, which the door refuses. The two are told apart by the scale's rows. And the
    # MoE layout the target names does not matter where no expert is MXFP4: ATOM's Triton MoE
    # switch does nothing for FP8 experts.
    from layouts.engines.atom import TRITON_PRESHUFFLE, fp8_attention_tensor

    out = tmp_path / "out"
    convert(str(fp8_block), out, target_for(ATOM, tp=2))
    manifest = layouts.load_manifest(out)
    assert fp8_attention_tensor(manifest) is None
    for gemm_path, backend in ((TRITON_PRESHUFFLE, "ck"), ("asm", "triton")):
        layouts.check_compatibility(manifest, layouts.EngineConfig(gemm_path, backend, tp_size=2, profile=ATOM))
    channel = tmp_path / "channel"
    convert(str(write_checkpoint(SynthSpec(variant="mtp-moefp4"), tmp_path / "src")), channel, target_for(ATOM, tp=2))
    assert ".self_attn." in fp8_attention_tensor(layouts.load_manifest(channel))


def test_atom_configured_to_leave_fp8_weights_unshuffled_is_refused_naming_the_switch(fp8_block, tmp_path):
    # ATOM_FP8_BLOCKSCALE_WEIGHT_PRESHUFFLE=0: ATOM keeps its FP8 weights unshuffled (fused_qkv_a
    # aside) and its non-preshuffled block-scale GEMM would read the shuffled files as garbage.
    profile = layouts.get_engine("atom")
    out = tmp_path / "out"
    convert(str(fp8_block), out, target_for(ATOM, tp=2))
    manifest = layouts.load_manifest(out)
    for env in ({}, {"ATOM_FP8_BLOCKSCALE_WEIGHT_PRESHUFFLE": "1"}):
        layouts.check_compatibility(manifest, profile.config_from_env(env, tp_size=2, rank=0, ep_size=1, gpu_arch=None))
    off = profile.config_from_env({"ATOM_FP8_BLOCKSCALE_WEIGHT_PRESHUFFLE": "0"}, tp_size=2, rank=0, ep_size=1,
                                  gpu_arch=None)
    with pytest.raises(layouts.CompatibilityError, match=r"FP8 weights are in the 'fp8-preshuffle' layout but the atom "
                                                         r"engine as configured reads them as the source holds them.*"
                                                         r"unset ATOM_FP8_BLOCKSCALE_WEIGHT_PRESHUFFLE"):
        layouts.check_compatibility(manifest, off)
    # an MXFP4 checkpoint has no FP8 weight: the switch does not matter to it, nor is fp8_layout recorded
    mx = tmp_path / "mx"
    convert(str(write_checkpoint(SynthSpec(), tmp_path / "mxsrc")), mx, target_for(ATOM, tp=2))
    assert "fp8_layout" not in json.loads((mx / "prep-manifest.json").read_text())["target"]
    layouts.check_compatibility(layouts.load_manifest(mx), off)


def test_inspect_names_deepseeks_fp8_release_and_the_tp_sizes_it_splits_over(fp8_block):
    r = CliRunner().invoke(main, ["inspect", str(fp8_block), "--engine", "atom"])
    assert r.exit_code == 0, r.output
    lines = r.output.splitlines()
    assert lines[0].endswith(": DeepSeek FP8 (128x128 block scales), DeepSeek-V2/V3 (8 routed experts, 16 heads), "
                             "deepseek_v3, 3 layers + MTP [3]"), lines[0]
    assert any(x.startswith("  FP8 block-scaled linears and experts: 104 ") and x.endswith("served by ATOM") for x in lines)
    assert "    preshuffle+ck: tp 1, 2, 4 (with --ep 4), 8 (with --ep 8); tp 16 refused: " in r.output
