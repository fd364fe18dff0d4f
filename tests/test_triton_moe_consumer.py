"""The consumer check of ATOM's Triton MoE layouts: aiter's own Triton MoE GEMMs (``moe_gemm_a16w4``
and ``moe_gemm_a4w4`` from the pinned aiter tree, interpreted on the CPU), run on a conversion's
stacked experts as ATOM holds them after loading, compute the source experts' product
(harness/triton_moe.py says how; the dense layouts' check is tests/test_consumer_kernels.py)."""

from __future__ import annotations

import pathlib
import subprocess
import sys

from conftest import need_engine_sources
from prep.convert import convert
from prep.deepseek import target_for
from prep.testing import SynthSpec
from checkpoints import write_checkpoint
from layouts.engines import get_engine

ATOM = get_engine("atom")  # the engine whose profile these tests use

REPO = pathlib.Path(__file__).resolve().parent.parent


def test_aiters_triton_moe_gemms_compute_the_source_experts_from_the_triton_layout_at_tp2(tmp_path):
    # TP 2, rank 1 (rank 0 is a script run): its part of the intermediate, rows 128-255, padded to
    # 256 as ATOM pads it; the CDNA4_SCALE scales
    # read with their label, and once without it (the check must then be far off). Both stages,
    # BF16 and MXFP4 activations. The gfx942 layout (raw scales) is a script run (issue note).
    oracles = need_engine_sources()
    src = write_checkpoint(SynthSpec(), tmp_path / "src")
    out = tmp_path / "out"
    convert(str(src), out, target_for(ATOM, tp=2, moe_layout="triton"))
    r = subprocess.run([sys.executable, "-m", "harness", "check-triton-moe", "--source", str(src),
                        "--converted", str(out), "--oracles", str(oracles), "--work", str(tmp_path / "work"),
                        "--tokens", "8", "--ranks", "1"], capture_output=True, text=True, cwd=REPO)
    ranks = [line for line in r.stdout.splitlines() if line.startswith("rank ")]
    assert r.returncode == 0 and len(ranks) == 1 and ranks[0].startswith("rank 1/2: "), r.stdout + r.stderr[-3000:]
    for line in ranks:
        assert "(triton, scale label CDNA4_SCALE), 9 experts" in line and "read with label None: nan (off" in line
        errors = [float(w) for w in line.split("relative error ")[1].split("; read")[0].replace(";", "").split()
                  if w[0].isdigit()]
        assert len(errors) == 4 and max(errors) < 0.02 and line.endswith(": ok"), line
