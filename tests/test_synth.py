"""Pins the synthetic Quark MXFP4 DeepSeek-V3 checkpoint: names, shapes, dtypes per variant, the
index, the numerics of stored weights, determinism and the refusal to overwrite.

Why: every converter test stands on this generator; if it drifts from the real checkpoint's
conventions (doc section 1), the converter would be tested against the wrong thing.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import layouts
from prep.testing import PRESETS, SynthSpec, build_config, is_excluded, tensor_specs, write_checkpoint

TINY = PRESETS["tiny"]
L = TINY.num_hidden_layers  # the MTP layer's index


def _load(ckpt: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for f in sorted(ckpt.glob("*.safetensors")):
        with safe_open(str(f), "pt") as sf:
            assert sf.metadata() == {"format": "pt"}
            tensors.update({k: sf.get_tensor(k) for k in sf.keys()})
    return tensors


@pytest.fixture(scope="module")
def r1(tmp_path_factory) -> Path:
    return write_checkpoint(TINY, tmp_path_factory.mktemp("r1") / "ckpt")


@pytest.fixture(scope="module")
def v2(tmp_path_factory) -> Path:
    return write_checkpoint(dataclasses.replace(TINY, variant="v2"), tmp_path_factory.mktemp("v2") / "ckpt")


def _assert_fp4(t: dict[str, torch.Tensor], module: str, n: int, k: int) -> None:
    assert t[f"{module}.weight"].dtype == torch.uint8 and t[f"{module}.weight"].shape == (n, k // 2), module
    assert t[f"{module}.weight_scale"].dtype == torch.uint8 and t[f"{module}.weight_scale"].shape == (n, -(-k // 32))


def _assert_bf16(t: dict[str, torch.Tensor], module: str, shape: tuple[int, ...]) -> None:
    assert t[f"{module}.weight"].dtype == torch.bfloat16 and t[f"{module}.weight"].shape == shape, module
    assert f"{module}.weight_scale" not in t, module


def _common_bf16(t: dict[str, torch.Tensor], s: SynthSpec) -> None:
    h, v, e = s.hidden_size, s.vocab_size, s.n_routed_experts
    for m in ("model.embed_tokens", "lm_head", f"model.layers.{L}.embed_tokens", f"model.layers.{L}.shared_head.head"):
        _assert_bf16(t, m, (v, h))
    _assert_bf16(t, f"model.layers.{L}.eh_proj", (h, 2 * h))  # BF16, no scale, in both variants
    for m in ("model.norm", f"model.layers.{L}.enorm", f"model.layers.{L}.hnorm", f"model.layers.{L}.shared_head.norm",
              "model.layers.0.input_layernorm", "model.layers.1.post_attention_layernorm"):
        _assert_bf16(t, m, (h,))
    _assert_bf16(t, "model.layers.1.self_attn.q_a_layernorm", (s.q_lora_rank,))
    _assert_bf16(t, "model.layers.1.self_attn.kv_a_layernorm", (s.kv_lora_rank,))
    for layer in range(1, L + 1):
        _assert_bf16(t, f"model.layers.{layer}.mlp.gate", (e, h))
        bias = t[f"model.layers.{layer}.mlp.gate.e_score_correction_bias"]
        assert bias.dtype == torch.float32 and bias.shape == (e,)
    assert "model.layers.0.mlp.gate.weight" not in t  # layer 0 is dense
    assert not any(".mlp.experts." in k for k in t if k.startswith("model.layers.0."))


def _attention(s: SynthSpec) -> dict[str, tuple[int, int]]:
    heads, h = s.num_attention_heads, s.hidden_size
    return {"q_a_proj": (s.q_lora_rank, h), "q_b_proj": (heads * (s.qk_nope_head_dim + s.qk_rope_head_dim), s.q_lora_rank),
            "kv_a_proj_with_mqa": (s.kv_lora_rank + s.qk_rope_head_dim, h),
            "kv_b_proj": (heads * (s.qk_nope_head_dim + s.v_head_dim), s.kv_lora_rank), "o_proj": (h, heads * s.v_head_dim)}


def _mlps(s: SynthSpec, layer: int) -> dict[str, tuple[int, int]]:
    h = s.hidden_size
    if layer < s.first_k_dense_replace:
        blocks = {"mlp": s.intermediate_size}
    else:
        blocks = {f"mlp.experts.{e}": s.moe_intermediate_size for e in range(s.n_routed_experts)}
        blocks["mlp.shared_experts"] = s.moe_intermediate_size * s.n_shared_experts
    out = {}
    for b, inter in blocks.items():
        out.update({f"{b}.gate_proj": (inter, h), f"{b}.up_proj": (inter, h), f"{b}.down_proj": (h, inter)})
    return out


def test_r1_names_shapes_dtypes(r1: Path) -> None:
    t, s = _load(r1), TINY
    _common_bf16(t, s)
    for layer in range(L + 1):
        for name, shape in _attention(s).items():  # attention BF16 in every layer
            _assert_bf16(t, f"model.layers.{layer}.self_attn.{name}", shape)
        for name, (n, k) in _mlps(s, layer).items():  # MTP layer excluded entirely
            module = f"model.layers.{layer}.{name}"
            if layer == L:
                _assert_bf16(t, module, (n, k))
            else:
                _assert_fp4(t, module, n, k)
    assert set(t) == set(tensor_specs(s))
    cfg = json.loads((r1 / "config.json").read_text())
    assert cfg["quantization_config"]["exclude"] == ["*self_attn*", "*mlp.gate.*", "lm_head", f"model.layers.{L}.*"]


def test_v2_names_shapes_dtypes(v2: Path) -> None:
    t, s = _load(v2), dataclasses.replace(TINY, variant="v2")
    _common_bf16(t, s)
    for layer in range(L + 1):  # attention and MLPs MXFP4 everywhere, MTP layer included
        for name, (n, k) in {**{f"self_attn.{a}": nk for a, nk in _attention(s).items()}, **_mlps(s, layer)}.items():
            _assert_fp4(t, f"model.layers.{layer}.{name}", n, k)
    assert set(t) == set(tensor_specs(s))


def test_config_is_quark_deepseek_v3(v2: Path) -> None:
    cfg = json.loads((v2 / "config.json").read_text())
    assert cfg["architectures"] == ["DeepseekV3ForCausalLM"] and cfg["model_type"] == "deepseek_v3"
    assert cfg["num_key_value_heads"] == cfg["num_attention_heads"] and cfg["num_nextn_predict_layers"] == 1
    q = cfg["quantization_config"]
    assert q["quant_method"] == "quark" and q["export"]["pack_method"] == "reorder"
    w, a = q["global_quant_config"]["weight"], q["global_quant_config"]["input_tensors"]
    assert (w["dtype"], w["group_size"], w["scale_format"], w["scale_calculation_mode"]) == ("fp4", 32, "e8m0", "even")
    assert not w["is_dynamic"] and a["is_dynamic"] and {**a, "is_dynamic": False} == w
    assert q["exclude"] == ["*mlp.gate.*", "lm_head", f"model.layers.{L}.shared_head.head",
                            f"model.layers.{L}.embed_tokens"]
    assert cfg == build_config(dataclasses.replace(TINY, variant="v2"))
    for name in ("generation_config.json", "tokenizer_config.json", "tokenizer.json"):
        json.loads((v2 / name).read_text())


def test_is_excluded_matching() -> None:
    pats = ["*self_attn*", "lm_head", "model.layers.3", "re:.*experts\\.7\\..*"]
    assert is_excluded("model.layers.0.self_attn.q_a_proj", pats)
    assert is_excluded("lm_head", pats) and not is_excluded("lm_headx", pats)
    assert is_excluded("model.layers.3.mlp.down_proj", pats) and not is_excluded("model.layers.31.mlp.down_proj", pats)
    assert is_excluded("model.layers.1.mlp.experts.7.up_proj", pats)
    assert not is_excluded("model.layers.1.mlp.experts.17.up_proj", pats)


@pytest.mark.parametrize("fixture", ["r1", "v2"])
def test_index_covers_every_tensor_once(fixture: str, request: pytest.FixtureRequest) -> None:
    ckpt: Path = request.getfixturevalue(fixture)
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    shards = sorted(ckpt.glob("*.safetensors"))
    assert [f.name for f in shards] == [f"model-{i:05d}-of-{TINY.num_shards:05d}.safetensors"
                                        for i in range(1, TINY.num_shards + 1)]
    seen, total = {}, 0
    for f in shards:
        with safe_open(str(f), "pt") as sf:
            for k in sf.keys():
                assert k not in seen, f"{k} stored twice"
                seen[k] = f.name
                t = sf.get_tensor(k)
                total += t.numel() * t.element_size()
    assert index["weight_map"] == seen and index["metadata"]["total_size"] == total
    # A layer stays in one shard when there are enough layer boundaries.
    for layer in range(L + 1):
        assert len({f for k, f in seen.items() if k.startswith(f"model.layers.{layer}.")}) == 1


def test_weights_dequantize_to_finite_small_values(v2: Path) -> None:
    t = _load(v2)
    for module in ("model.layers.1.mlp.experts.3.down_proj", f"model.layers.{L}.self_attn.kv_b_proj"):
        w = layouts.mxfp4.dequantize(t[f"{module}.weight"], t[f"{module}.weight_scale"])
        assert w.isfinite().all() and w.abs().max() < 1.0 and w.std() > 1e-3
        assert t[f"{module}.weight_scale"].unique().numel() > 1  # row scales vary


def test_deterministic_and_seed_sensitive(r1: Path, tmp_path: Path) -> None:
    again = write_checkpoint(TINY, tmp_path / "again")
    for f in sorted(r1.iterdir()):
        assert (again / f.name).read_bytes() == f.read_bytes(), f.name
    other = write_checkpoint(dataclasses.replace(TINY, seed=1), tmp_path / "other")
    assert (other / "model-00002-of-00004.safetensors").read_bytes() != (r1 / "model-00002-of-00004.safetensors").read_bytes()


def test_random_bytes_mode(tmp_path: Path) -> None:
    spec = dataclasses.replace(TINY, random_bytes=True, num_shards=7)  # more shards than layers: splits
    t = _load(write_checkpoint(spec, tmp_path / "rb"))
    assert set(t) == set(tensor_specs(spec)) and len(list((tmp_path / "rb").glob("*.safetensors"))) == 7
    scales = torch.cat([v.flatten() for k, v in t.items() if k.endswith(".weight_scale")])
    assert scales.min() >= 118 and scales.max() <= 126


def test_refuses_non_empty_out_dir(tmp_path: Path) -> None:
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "keep.txt").write_text("mine")
    with pytest.raises(ValueError, match="not an empty directory"):
        write_checkpoint(TINY, tmp_path / "x")
    assert [p.name for p in (tmp_path / "x").iterdir()] == ["keep.txt"]
    write_checkpoint(TINY, tmp_path / "empty_ok")  # absent dir is created; an empty one is fine too
    (tmp_path / "empty").mkdir()
    write_checkpoint(TINY, tmp_path / "empty")


def test_invalid_spec_refused() -> None:
    with pytest.raises(ValueError, match="n_group"):
        SynthSpec(n_routed_experts=6, n_group=4)
    with pytest.raises(ValueError, match="variant"):
        SynthSpec(variant="fp8")
