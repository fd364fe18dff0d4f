"""ATOM's derivation of MLA's ``W_K``/``W_V`` from each ``kv_b_proj`` at load, as the ATOM checks run
it and check it: from a BF16 or FP8 ``kv_b_proj`` ATOM takes the weight as it is (its FP8 GEMM a
torch stand-in, :mod:`harness.stand_ins`); from an MXFP4 one (v2) it runs ``kv_b_proj``'s GEMM on an
identity, here on aiter's Triton kernels, interpreted (:func:`mla_from_mxfp4`, :data:`MLA_GEMM`: on
the asm path a stand-in for ``gemm_a4w4``), where the kernel takes ``kv_lora_rank`` as K
(:func:`mla_gemm_runs`); elsewhere that one step is skipped in both loads alike.
:func:`mla_derivation` compares what ATOM derived with ``layouts.absorbed_kv_b`` of the rank's
stored bytes."""

from __future__ import annotations

import contextlib
import pathlib
import types
from unittest import mock

import torch

from harness.compare import as_bytes
from layouts.engines.atom import ASM, TRITON_NON_SHUFFLE, TRITON_PRESHUFFLE
from prep.errors import PrepError


def mla_kernels(root: str | None = None) -> types.ModuleType | None:
    """aiter's Triton MXFP4 GEMMs (from ``root``, the wheel's files; default prep.reference.aiter_gemm's
    folder) for ATOM's MXFP4 ``W_K``/``W_V`` derivation, or None, said in one line, where they are
    missing. Loaded before anything imports triton (the kernels are interpreted) and before ATOM's
    aiter stand-ins exist (prep.reference.aiter_gemm loads them under aiter's own names)."""
    from prep.reference import aiter_gemm

    try:
        return aiter_gemm.gemm_module(root)
    except PrepError as e:
        print(f"ATOM's W_K/W_V derivation from MXFP4 kv_b_proj is NOT run (skipped in both loads): {e}")
        return None


def mla_gemm_runs(path: str, kv_lora_rank: int) -> bool:
    """Whether aiter's Triton kernel for ATOM's GEMM ``path`` can run ``kv_b_proj``'s GEMM (K =
    ``kv_lora_rank``, not split by TP): the non-shuffle kernel takes any K, the preshuffle one
    (which stands in for ``gemm_a4w4`` on the asm path) K % 256 == 0 only (prep.reference.aiter_gemm)."""
    return path == TRITON_NON_SHUFFLE or kv_lora_rank % 256 == 0


# What computes kv_b_proj's GEMM on an identity when ATOM derives W_K/W_V from MXFP4 bytes.
MLA_GEMM = {TRITON_NON_SHUFFLE: "aiter's gemm_afp4wfp4 (Triton, interpreted): ATOM's own call",
            TRITON_PRESHUFFLE: "aiter's preshuffled-weight Triton GEMM (interpreted): ATOM's own call",
            ASM: "STAND-IN for aiter's gemm_a4w4 (a GPU binary): aiter's preshuffled-weight Triton GEMM "
                 "(interpreted) on the same W16 weight and S32x8 scale bytes"}


def _mxfp4_quant_stand_in(x, quant_dtype=None, scale=None, shuffle=False, **_):
    """STAND-IN for aiter's ``get_hip_quant(per_1x32)`` (a HIP binary): MXFP4 rows with
    ``layouts``' quantization, the scale S32x8-shuffled and padded when ``shuffle`` (as the HIP
    kernel lays it out for gemm_a4w4). Its only input here is the identity ATOM multiplies
    ``kv_b_proj`` by: every block of 32 holds one 1.0 or none, which any MXFP4 rule quantizes
    exactly (code 4.0, scale 2^-2; zeros)."""
    import layouts
    from layouts.families import language_config
    from aiter import dtypes

    q, s = layouts.mxfp4.quantize(x.float())
    if shuffle:
        s = layouts.shuffle.preshuffle_scale(s, pad_value=layouts.mxfp4.E8M0_ONE)
    return q.view(dtypes.fp4x2), s.view(torch.float8_e8m0fnu)


@contextlib.contextmanager
def mla_from_mxfp4(kernels: types.ModuleType | None):
    """ATOM's derivation of ``W_K``/``W_V`` from an MXFP4 ``kv_b_proj`` (v2): with ``kernels``
    (aiter's Triton MXFP4 GEMMs, prep.reference.aiter_gemm), ``MLAAttention.process_weights_after_loading``
    runs as ATOM wrote it, ``get_and_maybe_dequant_weights`` multiplying the stored bytes by an
    identity through ATOM's own ``gemm_a4w4_quant`` (its views of weight and scales per path), with
    aiter's kernels for the GEMM (:data:`MLA_GEMM`) and :func:`_mxfp4_quant_stand_in` for the
    activation. Without ``kernels`` (the kernel cannot take this K, :func:`mla_gemm_runs`) the
    step is skipped in both loads alike; its only input, ``kv_b_proj``'s bytes, is compared."""
    from aiter import dtypes
    from atom.model_ops import linear
    from atom.model_ops.attention_mla import MLAAttention

    if kernels is None:
        run = MLAAttention.process_weights_after_loading

        def unless_mxfp4(self):
            if self.kv_b_proj.weight.dtype != dtypes.fp4x2:
                run(self)

        with mock.patch.object(MLAAttention, "process_weights_after_loading", unless_mxfp4):
            yield
        return
    from prep.reference.aiter_gemm import with_defined_overread

    def non_shuffle(x, w, x_scale, w_scale, otype, y):
        return with_defined_overread(kernels.gemm_afp4wfp4)(x, w, x_scale, w_scale, dtype=otype, y=y)

    def preshuffle(x, w, x_scale, w_scale, dtype=torch.bfloat16, y=None):
        return kernels.gemm_afp4wfp4_preshuffled_weight_scales(x, w, x_scale, w_scale, dtype=y.dtype if y is not None
                                                               else dtype, y=y, use_aot=False)

    def a4w4(x, weight, x_scale, weight_scale, y):
        # gemm_a4w4 reads the same bytes as ATOM's Triton preshuffle path; viewed as that path views them
        x_scale = x_scale.view(torch.uint8)
        x_scale = x_scale.view(x_scale.shape[0] // 32, -1) if x.shape[0] >= 32 else x_scale[: x.shape[0]]
        w_scale = weight_scale.view(torch.uint8)
        return preshuffle(x.view(torch.uint8), weight.view(torch.uint8).view(weight.shape[0] // 16, -1), x_scale,
                          w_scale.view(w_scale.shape[0] // 32, -1), y=y)

    with mock.patch.object(linear, "get_hip_quant", lambda _qtype: _mxfp4_quant_stand_in), \
            mock.patch.object(linear, "gemm_afp4wfp4", non_shuffle), \
            mock.patch.object(linear, "gemm_afp4wfp4_preshuffle", preshuffle), \
            mock.patch.object(linear, "gemm_a4w4", a4w4):
        yield


def mla_derivation(target: torch.nn.Module, out: pathlib.Path, rank: int, tp: int,
                   mxfp4_derived: bool) -> tuple[int, list[str]]:
    """(layers checked, mismatches): the ``W_K``/``W_V`` (and scales) ATOM derived from each
    ``kv_b_proj`` in ``process_weights_after_loading``, against ``layouts.absorbed_kv_b`` of
    the rank's stored bytes put through ATOM's own quantization (``W_K`` is ``W_UK`` with its
    last two dims swapped, ``W_V`` is ``W_UV``). From a BF16 ``kv_b_proj`` ATOM takes the weight as
    it is; from an MXFP4 one it multiplies the stored bytes by an identity (:func:`mla_from_mxfp4`),
    whose BF16 result is exact (an MXFP4 value times 1.0 fits BF16's 8 bits), so both must give the
    same bytes. Layers whose MXFP4 derivation did not run (``mxfp4_derived`` False) are left out;
    tests/test_mla.py checks ours against the source there."""
    import json
    import re

    import layouts
    from layouts.families import language_config
    from aiter import dtypes
    from atom.model_ops.attention_mla import MLAAttention, dynamic_per_batched_tensor_quant

    loaded = layouts.load_rank(out, rank)
    shape = layouts.MlaShape.from_config(language_config(json.loads((out / "config.json").read_text())), tp)
    checked, bad = 0, []
    for name, module in target.named_modules():
        if not isinstance(module, MLAAttention) or (module.kv_b_proj.weight.dtype == dtypes.fp4x2
                                                     and not mxfp4_derived):
            continue
        if not (isinstance(getattr(module, "W_K", None), torch.Tensor) and module.W_K.dtype == dtypes.fp8):
            bad.append(f"{name}: ATOM kept no FP8 W_K (another derivation than this check knows)")
            continue
        layer = int(re.search(r"layers\.(\d+)\.", name).group(1))
        w_uk, w_uv = layouts.absorbed_kv_b_of_rank(loaded, loaded.records, layer, shape)
        ours = dict(zip(("W_K", "W_K_scale"), dynamic_per_batched_tensor_quant(
            w_uk.transpose(1, 2).to(torch.bfloat16), dtype=dtypes.fp8)))
        ours.update(zip(("W_V", "W_V_scale"), dynamic_per_batched_tensor_quant(w_uv.to(torch.bfloat16),
                                                                               dtype=dtypes.fp8)))
        for k, t in ours.items():
            got = getattr(module, k)
            if got.shape != t.shape or not torch.equal(as_bytes(got), as_bytes(t)):
                bad.append(f"{name}.{k}: ATOM's derivation differs from layouts.absorbed_kv_b's")
        checked += 1
    return checked, bad

