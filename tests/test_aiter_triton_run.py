"""``prep run --gemm aiter-triton``: the reference engine with every dense MXFP4 GEMM on aiter's own
Triton kernel (interpreted on the CPU) agrees with its torch dequantize-and-matmul path within
``LOGIT_RTOL`` of the largest logit, on generated checkpoints of both variants converted to both
dense layouts at TP 1 and 2; a wrong weight layout or activation layout lands far outside it.

The tolerance (prep/reference/dense_gemm.py, docs/consumer-kernels.md): both paths multiply the same MXFP4
activations by the same weights; only the float32 summation order differs, by at most
``2 * K * 2**-24`` of ``|A| @ |W|^T`` per output, 64 times below the BF16 step every GEMM output
is rounded to; the budget is one BF16 step of the largest logit.

Shapes: aiter's preshuffle kernel needs K % 256 == 0 on every rank. The default tiny v2 has
K = 128 (``q_b_proj``, ``kv_b_proj``; ``o_proj`` at TP 2), refused in one line
(``test_preshuffle_k_the_kernel_cannot_run_is_refused_before_the_forward``); the v2 runs here use
``q_lora_rank = kv_lora_rank = 256`` and ``v_head_dim = 64`` (``o_proj`` K = 512 / TP). The
default r1-0528 fits (its attention is BF16; ``down_proj`` K = 512 / TP).

Interpreter time (about 0.15 s per kernel program) decides the sizes: v2 runs its first layer
(attention and the dense MLP: every dense module kind), r1-0528 its first layer too (its only
dense MXFP4 GEMMs are layer 0's MLP; its attention is BF16), and once the whole model (the MoE
layers, on torch, after it). Prompts are 32 tokens (the
preshuffle kernel's shuffled activation-scale rule, in one 32-row block) or 5 (its raw rule, and
gemm_afp4wfp4's split-K configs). CPU time of this file: about 52 s on the 2-core VM.
"""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

import layouts
from layouts.engines import get_engine
from prep.cli import main
from prep.convert import convert
from prep.deepseek import target_for
from prep.reference.dense_gemm import LOGIT_RTOL, AiterDenseGemms
from prep.errors import PrepError
from prep.reference.model import DeepseekV3, ForwardOptions
from prep.reference.run import run
from prep.testing import SynthSpec
from checkpoints import write_checkpoint
from prep.reference.weights import load_weights

ATOM = get_engine("atom")  # the engine whose profile these tests use

IDS = [1, 5, 9, 200, 17, 3, 44, 900, 12, 7, 33, 512, 1000, 2, 8, 64, 99, 31, 250, 600,
       4, 77, 123, 321, 11, 22, 0, 1023, 400, 45, 67, 89]  # 32 tokens
SPECS = {"v2": SynthSpec(variant="v2", q_lora_rank=256, kv_lora_rank=256, v_head_dim=64),
         "r1-0528": SynthSpec(variant="r1-0528")}
LAYERS = {"v2": 1, "r1-0528": 1}  # r1-0528's whole model in one case (FULL_MODEL)
FULL_MODEL = ("r1-0528", "preshuffle", 2, 32)
# (variant, dense layout, tp, tokens)
# Interpreter time picks the token counts: gemm_afp4wfp4 is fast from 32 tokens on (below, aiter's
# split-K configs launch 16x the programs: one case), the W16 kernel three times faster at 5
# tokens than at 32 (r1-0528 at TP 2 runs 32: the shuffled scale cut into each rank's K slice).
CASES = [("r1-0528", "non-shuffle", 1, 5), ("r1-0528", "non-shuffle", 2, 32),
         ("r1-0528", "preshuffle", 1, 5), ("r1-0528", "preshuffle", 2, 32),
         ("v2", "non-shuffle", 1, 32), ("v2", "non-shuffle", 2, 32),
         ("v2", "preshuffle", 1, 5), ("v2", "preshuffle", 2, 5)]


@pytest.fixture(scope="module")
def converted(tmp_path_factory, aiter_triton_gemm):
    """(variant, layout, tp) -> a conversion of the variant's generated checkpoint."""
    root = tmp_path_factory.mktemp("aiter-run")
    srcs = {v: write_checkpoint(spec, root / f"src-{v}") for v, spec in SPECS.items()}
    out = {}
    for v, lay, tp in sorted({c[:3] for c in CASES}):
        out[v, lay, tp] = root / f"{v}-{lay}-tp{tp}"
        convert(str(srcs[v]), out[v, lay, tp], target_for(ATOM, layout=lay, moe_layout="ck", tp=tp))
    out["src", "r1-0528"] = srcs["r1-0528"]
    return out


def logit_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| relative to a's largest logit (inf when either is not finite)."""
    if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
        return float("inf")
    return float((a - b).abs().max() / a.abs().max())


@pytest.mark.parametrize("variant,layout,tp,tokens", CASES, ids=[f"{v}-{lay}-tp{tp}-m{m}" for v, lay, tp, m in CASES])
def test_aiter_triton_logits_agree_with_torch_within_tolerance(converted, variant, layout, tp, tokens):
    out = converted[variant, layout, tp]
    kw = dict(layers=None if (variant, layout, tp, tokens) == FULL_MODEL else LAYERS[variant])
    ref = run(out, IDS[:tokens], **kw, source_engine=ATOM)
    got = run(out, IDS[:tokens], gemm="aiter-triton", **kw, source_engine=ATOM)
    assert got["gemm"] == "aiter-triton" and ref["gemm"] == "torch"
    # The kernel's own activation flags: raw for gemm_afp4wfp4, triton-preshuffle's for the W16 one.
    assert got["gemm_path"] == {"non-shuffle": "triton-non-shuffle", "preshuffle": "triton-preshuffle"}[layout]
    a, b = ref["logits"], got["logits"]
    assert a.shape == b.shape == (tokens, 1024)
    assert logit_diff(a, b) <= LOGIT_RTOL, logit_diff(a, b)


def test_every_dense_module_and_no_expert_goes_to_aiter(converted):
    """Which GEMMs run on aiter's kernels: every dense MXFP4 module, on each rank that holds a piece
    (row-parallel modules on both ranks' K halves); none of the stacked experts (routed or shared)."""
    out = converted["v2", "non-shuffle", 2]
    dense = AiterDenseGemms(out, layouts.load_manifest(out))
    want = {f"model.layers.{i}.self_attn.{m}" for i in range(4)  # layer 3: the MTP layer
            for m in ("q_a_proj", "kv_a_proj_with_mqa", "q_b_proj", "kv_b_proj", "o_proj")}
    want |= {f"model.layers.0.mlp.{m}" for m in ("gate_proj", "up_proj", "down_proj")}
    assert set(dense.pieces) == want
    assert {(p.rank, p.ks.start, p.ks.stop) for p in dense.pieces["model.layers.0.self_attn.o_proj"]} == {
        (0, 0, 256), (1, 256, 512)}
    assert [p.rank for p in dense.pieces["model.layers.0.self_attn.q_a_proj"]] == [0]  # replicated: rank 0's
    assert not any(".experts" in p or "shared_experts" in p for p in dense.pieces)
    src = AiterDenseGemms(converted["src", "r1-0528"])
    assert set(src.pieces) == {f"model.layers.0.mlp.{m}" for m in ("gate_proj", "up_proj", "down_proj")}


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
def test_wrong_weight_layout_gives_logits_far_outside_the_tolerance(converted):
    """Preshuffled bytes (W16, S32x8) read as non-shuffle: gemm_afp4wfp4 multiplies them as raw."""
    out = converted["r1-0528", "preshuffle", 1]
    right = run(out, IDS, layers=1, source_engine=ATOM)["logits"]
    wrong = run(out, IDS, layers=1, gemm="aiter-triton", assume_layout="non-shuffle", source_engine=ATOM)["logits"]
    assert logit_diff(right, wrong) > 25 * LOGIT_RTOL


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
def test_wrong_activation_layout_gives_logits_far_outside_the_tolerance(converted):
    """The W16 kernel below 32 tokens reads a raw activation scale; given the ASM path's (always
    S32x8-shuffled and padded), it reads the bytes in the wrong order. The right flags, on the
    same model and kernels, pass."""
    out = converted["r1-0528", "preshuffle", 1]
    ids = torch.tensor(IDS[:5])
    right = run(out, IDS[:5], layers=1, source_engine=ATOM)["logits"]
    dense = AiterDenseGemms(out, layouts.load_manifest(out))
    weights = load_weights(out)
    wrong = DeepseekV3(weights, ForwardOptions(engine=ATOM, gemm_path="asm"), layers=1, dense_gemm=dense)(ids)
    assert logit_diff(right, wrong) > 25 * LOGIT_RTOL
    ok = DeepseekV3(weights, ForwardOptions(engine=ATOM, gemm_path="triton-preshuffle"), layers=1, dense_gemm=dense)(ids)
    assert logit_diff(right, ok) <= LOGIT_RTOL


def test_preshuffle_k_the_kernel_cannot_run_is_refused_before_the_forward(tmp_path, aiter_triton_gemm):
    # The default tiny v2's attention dims, one layer (the MoE layers change nothing here).
    src = write_checkpoint(SynthSpec(variant="v2", num_hidden_layers=1), tmp_path / "src")
    out = tmp_path / "ps"
    convert(str(src), out, target_for(ATOM, layout="preshuffle", moe_layout="ck", tp=1))
    with pytest.raises(PrepError, match=r"self_attn\.(q|kv)_b_proj\.weight \(rank 0\): K = 128 \(per rank\) is not "
                                        r"a multiple of 256.*--layout non-shuffle"):
        run(out, [1, 2], gemm="aiter-triton", source_engine=ATOM)


def test_missing_aiter_files_and_a_mismatched_gemm_path_are_refused(converted, tmp_path):
    out = converted["r1-0528", "preshuffle", 1]
    with pytest.raises(PrepError, match=r"aiter's MXFP4 GEMM files are missing.*fetch_aiter_oracle\.py"):
        run(out, [1, 2], gemm="aiter-triton", aiter_dir=str(tmp_path), source_engine=ATOM)
    with pytest.raises(PrepError, match="--gemm-path asm: .*triton-preshuffle; leave --gemm-path out"):
        run(out, [1, 2], gemm="aiter-triton", gemm_path="asm", source_engine=ATOM)
    with pytest.raises(PrepError, match="needs --act-quant"):
        run(out, [1, 2], gemm="aiter-triton", act_quant=False)


def test_cli_compare_torch_against_aiter_triton(converted):
    """A source on the torch path against its conversion on aiter's kernels (--gemm-b; one
    checkpoint given twice works the same way); the source's own dense GEMMs run on aiter too."""
    out, src = converted["r1-0528", "non-shuffle", 2], converted["src", "r1-0528"]
    ids = ",".join(map(str, IDS))
    r = CliRunner().invoke(main, ["compare", str(src), str(out), "--prompt-ids", ids, "--gemm-b", "aiter-triton",
                                  "--rtol", str(LOGIT_RTOL), "--layers", "1", "--json"])
    assert r.exit_code == 0, r.output
    res = json.loads(r.output)
    assert (res["gemm_a"], res["gemm_b"]) == ("torch", "aiter-triton")
    assert res["max_abs_diff"] <= LOGIT_RTOL * res["max_abs_logit"]
    src_aiter = run(src, IDS, layers=1, gemm="aiter-triton", source_engine=ATOM)["logits"]
    assert logit_diff(run(src, IDS, layers=1, source_engine=ATOM)["logits"], src_aiter) <= LOGIT_RTOL
