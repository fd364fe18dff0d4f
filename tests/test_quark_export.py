"""Independent check on a checkpoint exported by amd-quark itself (tests/quark_export.py): prep
reads it, converts and verifies it, and its reference forward agrees with quark's own forward
of the same quantized model."""


import pytest
import torch

import quark_export
from prep.convert import convert
from prep.deepseek import Target
from prep.reference.run import run
from prep.verify import verify
from conftest import _need

IDS = [1, 5, 9, 200, 17, 3, 44, 900]


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    if not quark_export.available():
        _need(False, "amd-quark + transformers")
    out = tmp_path_factory.mktemp("quark") / "export"
    model = quark_export.export(out)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([IDS]), use_cache=False).logits[0].float()
    return out, logits


def test_prep_converts_and_verifies_an_amd_quark_export(exported, tmp_path):
    src, _ = exported
    out = tmp_path / "out"
    summary = convert(str(src), out, Target("preshuffle", "ck", 2))
    assert summary["tensors"] > 0
    verify(str(out), source=str(src))  # every tensor inverts to quark's bytes
    assert torch.equal(run(out, IDS, act_quant=False)["logits"], run(src, IDS, act_quant=False)["logits"])


def test_reference_forward_agrees_with_quarks_own_forward(exported):
    # Both dequantize the same MXFP4 bytes (weight-only, activations BF16); quark runs the
    # transformers model in BF16 (BF16 matmuls), we multiply in float32 and round to BF16
    # between modules. Seen: max |difference| 0.055 on logits of magnitude 2.9 (1.9%).
    # Tolerance: 3% of the largest |logit|. Random weights leave near-ties among 1,024 logits
    # (seen: one of 8 positions' top two within 0.03), so the argmax must agree at 6 of 8.
    src, theirs = exported
    ours = run(src, IDS, act_quant=False)["logits"]
    assert ours.shape == theirs.shape
    assert (ours - theirs).abs().max() <= 0.03 * theirs.abs().max()
    assert (ours.argmax(-1) == theirs.argmax(-1)).sum() >= 6
