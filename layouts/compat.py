"""Does a converted checkpoint fit the engine about to load it? The engine's configuration
(GEMM path, MoE backend, TP/EP size, rank, GPU arch, the two DeepSeek quant-fusion switches),
read from ATOM's environment switches or given, is checked against the manifest; a mismatch is
refused with one line naming it and the fix, never loaded into silent garbage.

ATOM's switches (``atom/utils/envs.py``; on only when the value is ``"1"``, as ATOM reads them):

=========================================== ======= ==============================================
switch                                      default effect
=========================================== ======= ==============================================
``ATOM_USE_FP4_NON_SHUFFLE_TRITON_GEMM``    0       dense GEMM: Triton on raw weights (wins first)
``ATOM_USE_TRITON_GEMM``                    0       dense GEMM: Triton on preshuffled weights;
                                                    attention must be BF16 on disk (see below)
(neither)                                           dense GEMM: ASM/CK ``gemm_a4w4`` (preshuffled)
``ATOM_USE_TRITON_MOE``                     unset   MoE: Triton if "1", CK if set otherwise; unset:
                                                    Triton on gfx94x, and on gfx95x only with
                                                    ``ATOM_USE_TRITON_GEMM=1``
``ATOM_ENABLE_DS_INPUT_RMSNORM_QUANT_FUSION`` 1     fused RMSNorm+quant before ``fused_qkv_a_proj``
``ATOM_ENABLE_DS_QKNORM_QUANT_FUSION``      1       fused q_a/kv_a RMSNorm+quant before ``q_b_proj``
=========================================== ======= ==============================================

With ``ATOM_USE_TRITON_GEMM=1`` ATOM's DeepSeek attention takes a BF16 source only (ROCm/ATOM
``atom/models/deepseek_v2.py``, ``DeepseekV2MLAAttention.__init__``, at commit ffdf3bb5): when the
q_a projection's quant dtype is fp4x2 it builds ``fused_qkv_a_proj`` / ``q_b_proj`` with
``source_quant_dtype=torch.bfloat16`` (a BF16 ``[out, in]`` weight it quantizes itself in
``process_weights_after_loading``, no ``weight_scale``) and ``kv_b_proj`` / ``o_proj`` plain BF16.
MXFP4 attention (Quark's v2 checkpoints) then cannot load: the packed ``[out, in/2]`` weight
fails ``LinearBase.weight_loader_process``'s copy into the ``[out, in]`` BF16 slot and the scales
have no parameter to go to. Without the switch, ATOM keeps the quant config for exactly this
static-Quark MXFP4 attention and runs it on the ASM/CK ``gemm_a4w4``.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Mapping

from .manifest import Manifest
from .selection import GEMM_PATH_RULES

MOE_BACKENDS = ("ck", "triton")
ENV_NON_SHUFFLE = "ATOM_USE_FP4_NON_SHUFFLE_TRITON_GEMM"
ENV_TRITON_GEMM = "ATOM_USE_TRITON_GEMM"
ENV_TRITON_MOE = "ATOM_USE_TRITON_MOE"
ENV_INPUT_FUSION = "ATOM_ENABLE_DS_INPUT_RMSNORM_QUANT_FUSION"
ENV_QKNORM_FUSION = "ATOM_ENABLE_DS_QKNORM_QUANT_FUSION"


class CompatibilityError(ValueError):
    """The checkpoint and the engine's configuration disagree; the message says how to fix it."""


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """What the engine will run: which kernels read the weights, and where this process sits."""

    gemm_path: str = "asm"  # "asm" | "triton-preshuffle" | "triton-non-shuffle"
    moe_backend: str = "ck"  # "ck" (aiter fused_moe) | "triton"
    tp_size: int = 1
    rank: int = 0
    ep_size: int = 1  # 1, or tp_size with expert parallel on
    gpu_arch: str = "gfx950"  # gfx942 (MI300) or gfx950 (MI355): the Triton MoE scale layout differs
    input_norm_quant_fusion: bool = True
    qknorm_quant_fusion: bool = True

    def __post_init__(self) -> None:
        if self.gemm_path not in GEMM_PATH_RULES:
            raise CompatibilityError(f"unknown GEMM path {self.gemm_path!r}; known: {', '.join(GEMM_PATH_RULES)}")
        if self.moe_backend not in MOE_BACKENDS:
            raise CompatibilityError(f"unknown MoE backend {self.moe_backend!r}; known: {', '.join(MOE_BACKENDS)}")
        if not self.gpu_arch.startswith(("gfx94", "gfx95")):
            raise CompatibilityError(f"GPU arch {self.gpu_arch!r}: prep's layouts cover gfx94x (MI300) and gfx95x "
                                     "(MI355); gfx1250 tiles differ and are not supported")

    @classmethod
    def from_env(cls, tp_size: int = 1, rank: int = 0, ep_size: int = 1, gpu_arch: str | None = None,
                 env: Mapping[str, str] | None = None) -> "EngineConfig":
        """ATOM's switches as ATOM reads them, refusing the combinations ATOM gets wrong.

        ``gpu_arch`` defaults to the current device's (``gcnArchName`` on ROCm), else gfx950."""
        env = os.environ if env is None else env

        def on(name: str, default: str = "0") -> bool:
            return env.get(name, default) == "1"

        non_shuffle, triton_gemm = on(ENV_NON_SHUFFLE), on(ENV_TRITON_GEMM)
        if non_shuffle and triton_gemm:
            raise CompatibilityError(
                f"{ENV_TRITON_GEMM}=1 together with {ENV_NON_SHUFFLE}=1: ATOM keeps the weights raw but its fused "
                "qkv_a + RMSNorm + quant path (_fuse_qkv_a_proj_reduce_rmsnorm_quant_fp4) still runs the preshuffle "
                f"GEMM on them and reads garbage; unset one of the two")
        gemm_path = "triton-non-shuffle" if non_shuffle else "triton-preshuffle" if triton_gemm else "asm"
        arch = gpu_arch or _current_gpu_arch() or "gfx950"
        if ENV_TRITON_MOE in env:
            moe = "triton" if on(ENV_TRITON_MOE) else "ck"
        else:
            moe = "triton" if arch.startswith("gfx94") or (arch.startswith("gfx95") and triton_gemm) else "ck"
        return cls(gemm_path, moe, tp_size, rank, ep_size, arch,
                   on(ENV_INPUT_FUSION, "1"), on(ENV_QKNORM_FUSION, "1"))

    def expected_dense_layout(self) -> str:
        return GEMM_PATH_RULES[self.gemm_path].weight_layout

    def expected_moe_layout(self) -> str:
        if self.moe_backend == "ck":
            return "ck"
        return "triton-gfx942" if self.gpu_arch.startswith("gfx94") else "triton"


def _current_gpu_arch() -> str | None:
    try:
        import torch

        if torch.cuda.is_available() and getattr(torch.version, "hip", None):
            return torch.cuda.get_device_properties(0).gcnArchName.split(":")[0]
    except Exception:  # noqa: BLE001 - no device, no arch: the caller falls back
        return None
    return None


_DENSE_FIX = {
    ("preshuffle", "triton-non-shuffle"): (
        "checkpoint is preshuffled; the non-shuffle Triton GEMM would read garbage: "
        f"unset {ENV_NON_SHUFFLE} or convert with --layout non-shuffle"),
    ("non-shuffle", "asm"): (
        "checkpoint is non-shuffled (raw); the ASM/CK gemm_a4w4 reads preshuffled (W16/S32x8) weights and would "
        f"read garbage: set {ENV_NON_SHUFFLE}=1 or convert with --layout preshuffle"),
    ("non-shuffle", "triton-preshuffle"): (
        "checkpoint is non-shuffled (raw); the Triton preshuffle GEMM reads W16/S32x8 weights and would read "
        f"garbage: set {ENV_NON_SHUFFLE}=1 instead of {ENV_TRITON_GEMM}=1, or convert with --layout preshuffle"),
}


# DeepSeek's attention projections (MLA; q_proj where q_lora_rank is None), as manifest groups end.
ATTENTION_MODULES = ("q_proj", "q_a_proj", "kv_a_proj_with_mqa", "fused_qkv_a_proj", "q_b_proj", "kv_b_proj", "o_proj")


def mxfp4_attention_group(manifest: Manifest) -> str | None:
    """The first attention module the checkpoint holds in MXFP4, or None (attention is BF16)."""
    for t in manifest.tensors:
        if t.role != "passthrough" and t.group and t.group.rpartition(".")[2] in ATTENTION_MODULES:
            return t.group
    return None


def check_compatibility(manifest: Manifest, engine: EngineConfig) -> None:
    """Raise :class:`CompatibilityError` naming the first mismatch and its fix; else return."""
    where = f"{manifest.root}"
    if manifest.tp != engine.tp_size:
        raise CompatibilityError(
            f"{where}: converted for tp={manifest.tp} but the engine runs tp={engine.tp_size}; per-rank tensors "
            f"([gate;up], [q_a;kv_a], padded experts) differ between TP sizes: convert again with --tp {engine.tp_size}")
    if not 0 <= engine.rank < engine.tp_size:
        raise CompatibilityError(f"{where}: rank {engine.rank} is out of range for tp={engine.tp_size}")
    if manifest.ep != engine.ep_size:
        fix = f"convert again with --ep {engine.ep_size}" if engine.ep_size > 1 else "convert again with --ep 1"
        raise CompatibilityError(
            f"{where}: converted with ep={manifest.ep} but the engine runs ep={engine.ep_size} "
            f"({'expert parallel on' if engine.ep_size > 1 else 'expert parallel off'}); the experts each rank "
            f"holds differ: {fix}, or {'disable' if manifest.ep == 1 else 'enable'} --enable-expert-parallel")
    want = engine.expected_dense_layout()
    if manifest.layout != want:
        msg = _DENSE_FIX.get((manifest.layout, engine.gemm_path),
                             f"checkpoint layout {manifest.layout!r} but the {engine.gemm_path} GEMM reads {want!r}: "
                             f"convert with --layout {want}")
        raise CompatibilityError(f"{where}: {msg}")
    if engine.gemm_path == "triton-preshuffle" and (attn := mxfp4_attention_group(manifest)) is not None:
        # The triton-preshuffle path is ATOM_USE_TRITON_GEMM=1; the dense layout fits it, but ATOM's
        # attention under that switch expects a BF16 source (module docstring).
        raise CompatibilityError(
            f"{where}: attention is MXFP4 ({attn}) but with {ENV_TRITON_GEMM}=1 ATOM builds DeepSeek's attention for a "
            "BF16 source (fused_qkv_a_proj/q_b_proj quantized at load, source_quant_dtype=bfloat16; kv_b_proj/o_proj "
            "BF16; no weight_scale), so the packed weights fail its weight loader's copy and the scales are dropped: "
            f"unset {ENV_TRITON_GEMM} (ATOM then runs MXFP4 attention on the ASM/CK gemm_a4w4, same layout), or use "
            "a checkpoint whose attention is BF16 (as R1-0528)")
    want_moe = engine.expected_moe_layout()
    if manifest.moe_layout != want_moe:
        if manifest.moe_layout.startswith("triton") and engine.moe_backend == "triton":
            env_fix = f"run on the GPU the checkpoint was made for (the Triton MoE scale layout differs by arch)"
        else:
            env_fix = "set " + (f"{ENV_TRITON_MOE}=1" if manifest.moe_layout.startswith("triton") else f"{ENV_TRITON_MOE}=0")
        raise CompatibilityError(
            f"{where}: MoE experts are in the {manifest.moe_layout!r} layout but the engine's {engine.moe_backend} MoE "
            f"on {engine.gpu_arch} reads {want_moe!r}; it would compute garbage: {env_fix} or convert with "
            f"--moe-layout {want_moe}")
    if engine.ep_size > 1 and engine.moe_backend == "triton":
        raise CompatibilityError(
            f"{where}: expert parallel with the Triton MoE: ATOM's triton_kernel_fused_experts ignores the expert map "
            f"and would apply other ranks' expert ids to this rank's experts; set {ENV_TRITON_MOE}=0 (CK MoE) for EP")
