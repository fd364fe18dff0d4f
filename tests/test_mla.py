"""The latent-cache halves of kv_b_proj (layouts/mla.py): each rank's W_UK / W_UV read from the
bytes as stored, in every dense layout and TP size, equal the source's kv_b_proj dequantized and
cut per head, exactly (float32 of the same FP4 codes and scales)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

import layouts
from layouts.mla import MlaShape, absorbed_kv_b, absorbed_kv_b_of_rank
from layouts.engines import get_engine
from prep.convert import convert
from prep.deepseek import target_for
from prep.testing import SynthSpec
from checkpoints import write_checkpoint

ATOM = get_engine("atom")  # the engine whose profile these tests use


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("src")
    return {v: write_checkpoint(SynthSpec(variant=v), root / v) for v in ("r1-0528", "v2", "mtp-moefp4", "fp8-block")}


def source_tensor(src, name: str) -> torch.Tensor:
    index = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
    with safe_open(str(src / index[name]), "pt") as f:
        return f.get_tensor(name)


def source_kv_b(src, layer: int) -> torch.Tensor:
    """float32 [heads * (nope + v), kv_lora] of the source's kv_b_proj."""
    name = f"model.layers.{layer}.self_attn.kv_b_proj.weight"
    w = source_tensor(src, name)
    if w.dtype == torch.float8_e4m3fn:  # Quark's per-channel scale [N], or DeepSeek's per 128x128 block
        if name + "_scale" in json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]:
            return w.float() * source_tensor(src, f"{name}_scale").float().reshape(-1, 1)
        s = source_tensor(src, f"{name}_scale_inv").float()
        return w.float() * s.repeat_interleave(128, 0)[:w.shape[0]].repeat_interleave(128, 1)[:, :w.shape[1]]
    if w.dtype != torch.uint8:
        return w.float()
    s = source_tensor(src, f"{name}_scale")
    return layouts.mxfp4.dequantize(w, s, k=2 * w.shape[-1])


@pytest.mark.parametrize("variant, layout, tp", [
    ("v2", "preshuffle", 1), ("v2", "preshuffle", 2), ("v2", "non-shuffle", 2), ("v2", "preshuffle", 4),
    ("r1-0528", "preshuffle", 2), ("mtp-moefp4", "preshuffle", 2), ("fp8-block", "preshuffle", 1),
])
def test_each_ranks_w_uk_and_w_uv_are_the_source_kv_b_proj_cut_per_head(sources, tmp_path, variant, layout, tp):
    src = sources[variant]
    out = tmp_path / "out"
    convert(str(src), out, target_for(ATOM, layout=layout, moe_layout="ck", tp=tp))
    cfg = json.loads((src / "config.json").read_text())
    shape = MlaShape.from_config(cfg, tp)
    nope = shape.qk_nope_head_dim
    stored = set()
    for rank in range(tp):
        loaded = layouts.load_rank(out, rank)
        for layer in range(cfg["num_hidden_layers"]):
            rec = loaded.records[f"model.layers.{layer}.self_attn.kv_b_proj.weight"]
            stored.add((rec.role, rec.layout))
            w_uk, w_uv = absorbed_kv_b_of_rank(loaded, loaded.records, layer, shape, heads_per_block=3)
            full = source_kv_b(src, layer).view(-1, nope + shape.v_head_dim, shape.kv_lora_rank)
            mine = full[rank * shape.heads:(rank + 1) * shape.heads]
            assert w_uk.shape == (shape.heads, nope, shape.kv_lora_rank)
            assert w_uv.shape == (shape.heads, shape.v_head_dim, shape.kv_lora_rank)
            assert torch.equal(w_uk, mine[:, :nope]) and torch.equal(w_uv, mine[:, nope:]), (rank, layer)
    # What the case exercises: MXFP4 in the layout asked for (v2), BF16 split by heads (R1-0528),
    # FP8 per channel padded and shuffled with its padded scale, FP8 blocks shuffled (ATOM's).
    assert stored == {"v2": {("mxfp4_weight", layout)}, "r1-0528": {("bf16_shard", None)},
                      "mtp-moefp4": {("bf16_shard", "fp8-channel-preshuffle")},
                      "fp8-block": {("bf16_shard", "fp8-preshuffle")}}[variant], stored


def test_reading_a_shuffled_kv_b_proj_as_another_layout_gives_other_values(sources, tmp_path):
    # The index map is the layout's own: read through the wrong one, the numbers differ (what an
    # engine that forgets is_shuffled computes), never the right ones by accident.
    out = tmp_path / "out"
    convert(str(sources["v2"]), out, target_for(ATOM, layout="preshuffle", moe_layout="ck", tp=1))
    cfg = json.loads((sources["v2"] / "config.json").read_text())
    shape = MlaShape.from_config(cfg)
    loaded = layouts.load_rank(out, 0)
    name = "model.layers.0.self_attn.kv_b_proj.weight"
    right = absorbed_kv_b(loaded[name], shape, scale=loaded[f"{name}_scale"], layout="preshuffle")
    wrong = absorbed_kv_b(loaded[name], shape, scale=loaded[f"{name}_scale"], layout="non-shuffle")
    assert not torch.equal(right[0], wrong[0]) and not torch.equal(right[1], wrong[1])
    with pytest.raises(layouts.LayoutsError, match="without the weight's scale"):
        absorbed_kv_b(loaded[name], shape, layout="preshuffle")
    assert shape.cache_values_per_token == cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]
