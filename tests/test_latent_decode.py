"""Decoding as engines do (prep run --prefill / --generate): a prefill, then one decode step per
token against a latent cache with kv_b_proj absorbed (or no cache). With the full forward's keys
computed as the latent path does (--latent-kv) the two agree to float32 precision for every
dense layout, TP and EP and both variants, from stored bytes; the cache holds kv_lora_rank +
qk_rope_head_dim values per token and layer."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from prep.cli import main
from prep.convert import convert
from prep.deepseek import target_for
from prep.reference.run import run
from prep.testing import SynthSpec
from checkpoints import write_checkpoint
from layouts.engines import get_engine

ATOM = get_engine("atom")  # the engine whose profile these tests use

IDS = [1, 5, 9, 200, 7, 33, 2, 900]


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("src")
    return {v: write_checkpoint(SynthSpec(variant=v), root / v) for v in ("r1-0528", "v2")}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / a.abs().max())


@pytest.mark.parametrize("variant, layout, moe_layout, tp, ep", [
    ("v2", None, None, 1, 1),  # the source itself
    ("v2", "preshuffle", "ck", 2, 1),
    ("v2", "non-shuffle", "triton", 1, 1),
    ("r1-0528", "preshuffle", "ck", 2, 2),
    ("r1-0528", "non-shuffle", "ck", 4, 1),
])
def test_latent_decode_gives_the_full_forwards_logits(sources, tmp_path, variant, layout, moe_layout, tp, ep):
    model = sources[variant]
    if layout is not None:
        model = tmp_path / "out"
        convert(str(sources[variant]), model, target_for(ATOM, layout=layout, moe_layout=moe_layout, tp=tp, ep=ep))
    full = run(model, IDS, latent_kv=True, source_engine=ATOM)["logits"]
    latent = run(model, IDS, latent_kv=True, prefill=3, source_engine=ATOM)
    assert latent["logits"].shape == full.shape
    assert rel(full, latent["logits"]) < 1e-5, rel(full, latent["logits"])
    cfg = json.loads((model / "config.json").read_text())
    assert latent["kv_cache_bytes_per_token"] == 2 * (cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]) * \
        cfg["num_hidden_layers"]
    assert latent["per_head_kv_bytes_per_token"] > latent["kv_cache_bytes_per_token"]
    # No cache: each step recomputed from its prefix, the same logits.
    none = run(model, IDS, prefill=3, kv_cache="none", source_engine=ATOM)
    assert rel(run(model, IDS, source_engine=ATOM)["logits"], none["logits"]) < 1e-5 and none["kv_cache_bytes_per_token"] == 0


def test_generated_tokens_are_the_full_forwards_greedy_choices(sources):
    src = sources["v2"]
    r = run(src, IDS[:4], latent_kv=True, prefill=4, generate=4, source_engine=ATOM)
    made = r["generated"]
    assert len(made) == 4 and made[0] == int(r["logits"][-1].argmax())
    again = run(src, IDS[:4] + made[:-1], latent_kv=True, source_engine=ATOM)["logits"]
    assert again[3:].argmax(-1).tolist() == made


def test_decode_options_on_the_command_line(sources):
    src = str(sources["v2"])
    r = CliRunner().invoke(main, ["run", src, "--prompt-ids", "1,5,9,200", "--prefill", "2", "--generate", "2",
                                  "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.output)
    assert out["prefill"] == 2 and out["kv_cache"] == "latent" and len(out["generated"]) == 2
    r = CliRunner().invoke(main, ["run", src, "--prompt-ids", "1,5,9,200", "--prefill", "2"])
    assert "decode: prefill of 2, then 2 steps, with a latent cache of" in r.output, r.output
    r = CliRunner().invoke(main, ["compare", src, src, "--prompt-ids", "1,5,9,200", "--prefill-b", "2",
                                  "--latent-kv", "--rtol", "1e-5"])
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(main, ["run", src, "--prompt-ids", "1,5,9", "--prefill", "4"])
    assert r.exit_code == 1 and r.output.strip() == "error: --prefill 4: give 1 to 3 (the number of prompt ids)"


def test_sglang_order_quantizes_the_absorbed_gemms_to_mxfp4_along_their_reduced_dims(sources):
    # SGLang's ROCm MXFP4 decode: W_UK re-quantized in blocks along its nope dim (not the
    # checkpoint's kv_lora blocks), W_UV along kv_lora; the query and the attention output
    # quantized on the fly. Its logits are finite and not the reference order's.
    from prep.reference.model import DeepseekV3, ForwardOptions, _mxfp4_roundtrip
    from prep.reference.weights import load_weights

    w = load_weights(sources["v2"], None, None)
    model = DeepseekV3(w, ForwardOptions(engine=ATOM, gemm_path="asm", mla_order="sglang"))
    w_uk, w_uv = model._sglang_absorbed(0)
    ref_uk, ref_uv = model.absorbed_kv_b(0)
    along_nope = w_uk.transpose(1, 2)
    assert torch.equal(_mxfp4_roundtrip(along_nope), along_nope)  # already MXFP4 in nope blocks
    assert not torch.equal(w_uk, ref_uk)  # the regrouping lost something
    assert torch.equal(_mxfp4_roundtrip(w_uv), w_uv)
    ref = run(sources["v2"], IDS, prefill=3, latent_kv=True, source_engine=ATOM)
    sgl = run(sources["v2"], IDS, prefill=3, latent_kv=True, mla_order="sglang", source_engine=ATOM)
    assert sgl["mla_order"] == "sglang" and torch.isfinite(sgl["logits"]).all()
    assert not torch.equal(ref["logits"], sgl["logits"])
