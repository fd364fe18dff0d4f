"""Quark's own MXFP4 weight export path, as an oracle for the QUARK recipe.

Runs the pieces `export_safetensors` uses for an MXFP4 weight (observer -> real quantizer ->
pack), on the CPU. `quark.torch`'s package init imports `transformers`, which amd-quark does not
declare; when transformers is absent we register an empty `quark.torch` package so the
submodules we need import on their own. Quark JIT-compiles a small C++ op on first use (g++,
ninja; cached under ~/.cache/torch_extensions).
"""

from __future__ import annotations

import importlib.util
import os
import pathlib
import sys
import types

import torch


def available() -> bool:
    return importlib.util.find_spec("quark") is not None


def _import_quark_torch() -> None:
    os.environ.setdefault("QUARK_LOG_LEVEL", "warning")
    import quark

    if "quark.torch" in sys.modules:
        return
    # quark.torch's package init scans every transformers model file for MoE classes (most of its
    # import, even narrowed as quark_export does): the MXFP4 export pieces below do not need it
    # (PREP_QUARK_LIGHT=1).
    if importlib.util.find_spec("transformers") is not None and not os.environ.get("PREP_QUARK_LIGHT"):
        from quark_export import import_quark_torch

        import_quark_torch()
        return
    pkg = types.ModuleType("quark.torch")
    pkg.__path__ = [os.path.join(importlib.util.find_spec("quark").submodule_search_locations[0], "torch")]
    sys.modules["quark.torch"] = pkg
    quark.torch = pkg


def quark_mxfp4(w: torch.Tensor, scale_calculation_mode: str = "even") -> tuple[torch.Tensor, torch.Tensor]:
    """W [N, K] -> (packed uint8 [N, K/2], E8M0 uint8 [N, K/32]) as Quark's exporter writes them."""
    _import_quark_torch()
    from quark.torch.export.nn.modules.realquantizer import get_real_quantizer
    from quark.torch.quantization.config.config import OCP_MXFP4Spec
    from quark.torch.quantization.tensor_quantize import FakeQuantizeBase

    qspec = OCP_MXFP4Spec(ch_axis=-1, is_dynamic=False,
                          scale_calculation_mode=scale_calculation_mode).to_quantization_spec()
    fq = FakeQuantizeBase.get_fake_quantize(qspec, device=w.device)
    fq.disable_fake_quant()  # only the observer's scale is needed
    with torch.no_grad():
        fq(w)
        rq = get_real_quantizer(qspec=qspec, quantizer=fq, reorder=False, real_quantized=True,
                                float_dtype=torch.float32, device=w.device)
        packed = rq.to_real_quantize_params(w)
        rq.maybe_convert_and_transpose_scale()
    return packed.view(torch.uint8), rq.scale.view(torch.uint8)


def quark_mxfp4_in_subprocess(w: torch.Tensor, scale_calculation_mode: str = "even") -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`quark_mxfp4` in a process of its own with only the export pieces of quark.torch
    imported (about 3 s, against about 7 s for the whole package, narrowed by quark_export, in this
    process), forked from the run's server of prep's environment (conftest.forked_python: torch
    already imported)."""
    import tempfile

    from conftest import forked_python

    with tempfile.TemporaryDirectory() as d:
        src, dst = os.path.join(d, "w.pt"), os.path.join(d, "out.pt")
        torch.save({"w": w, "mode": scale_calculation_mode}, src)
        rc, stdout, stderr = forked_python(None, [src, dst], {**os.environ, "PREP_QUARK_LIGHT": "1"},
                                           path=pathlib.Path(__file__))
        assert rc == 0, stdout[-2000:] + stderr[-2000:]
        out = torch.load(dst)
    return out["packed"], out["scale"]


if __name__ == "__main__":
    args = torch.load(sys.argv[1])
    packed, scale = quark_mxfp4(args["w"], args["mode"])
    torch.save({"packed": packed.clone(), "scale": scale.clone()}, sys.argv[2])
