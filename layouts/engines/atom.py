"""ROCm ATOM's profile: its switches, which layout each of its paths reads, the activation-quant
flags each GEMM path needs, the configurations it would misread (refused with the fix), and the
adapter that installs a converted checkpoint into its DeepSeek model.

Switches (``atom/utils/envs.py``; on only when the value is ``"1"``, as ATOM reads them):

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

Which flags the fused RMSNorm + MXFP4 quant needs for each dense GEMM path (ATOM's
``_mxfp4_activation_quant_layout``): the scale is written row-major ``[M, K/32]`` or
S32x8-shuffled, exactly ``M`` rows or padded to ``[pad256(M), pad8(K/32)]``:

===================== ============== ======================== ==================
GEMM path             weight layout  shuffle                  scale_shuffle_padding
===================== ============== ======================== ==================
asm                   preshuffle     always                   always
triton-preshuffle     preshuffle     M >= 32                  M >= 32 (the GEMM takes ``scale[:M]`` below)
triton-non-shuffle    non-shuffle    never                    never
===================== ============== ======================== ==================

With ``ATOM_USE_TRITON_GEMM=1`` ATOM's DeepSeek attention takes a BF16 source only (ROCm/ATOM
``atom/models/deepseek_v2.py``, ``DeepseekV2MLAAttention.__init__``, at commit ffdf3bb5): when the
q_a projection's quant dtype is fp4x2 it builds ``fused_qkv_a_proj`` / ``q_b_proj`` with
``source_quant_dtype=torch.bfloat16`` (a BF16 ``[out, in]`` weight it quantizes itself in
``process_weights_after_loading``, no ``weight_scale``) and ``kv_b_proj`` / ``o_proj`` plain BF16.
MXFP4 attention (Quark's v2 checkpoints) then cannot load: the packed ``[out, in/2]`` weight
fails ``LinearBase.weight_loader_process``'s copy into the ``[out, in]`` BF16 slot and the scales
have no parameter to go to. Without the switch, ATOM keeps the quant config for exactly this
static-Quark MXFP4 attention and runs it on the ASM/CK ``gemm_a4w4``.

The adapter (:func:`install_converted_weights`). ATOM's loader (``atom/model_loader/loader.py``)
copies every checkpoint tensor into the parameters its layers created, then calls each module's
``process_weights_after_loading`` (and its ``quant_method``'s): for MXFP4 that is
``shuffle_weights`` + ``e8m0_shuffle`` on every dense linear, ``moe_shuffle_weight`` /
``moe_shuffle_scale`` (2-D scales) or ``_swizzle_mxfp4`` on every MoE layer. ATOM has no hook to
skip that, and ``is_shuffled`` is only ever written. So:

1. :func:`install_converted_weights` checks the checkpoint against the engine configuration
   (:func:`layouts.check_compatibility`), loads this rank (:func:`layouts.load_rank`), and for
   every MXFP4 tensor replaces the data of the parameter of the same name (shapes differ where
   the layout pads: S32x8 scales, 2-D CK MoE scales), sets the attributes the manifest states
   (``is_shuffled`` on the weight, ``hidden_pad`` / ``intermediate_pad`` on the MoE method,
   which ATOM passes to ``fused_moe``), and makes that module's processing a no-op;
2. a rank-exact checkpoint (manifest format 2, ``docs/rank-exact.md``) holds the rank's BF16
   tensors already split and merged as ATOM's layer classes hold them: each is installed into its
   parameter too (the F32 router bias cast to ATOM's BF16), so nothing is left for ATOM's loader
   and ``AtomInstallReport.not_installed`` lists any parameter still unfilled. BF16 linears need
   no processing; BF16 experts (the R1-0528 MTP layer) are stored in ``bf16-preshuffle``, the
   layout ATOM's ``shuffle_weights`` would give them, so their module's processing is made a no-op
   as for MXFP4 (experts stored without a layout keep ATOM's own processing). Of a format-1
   checkpoint the pass-through (BF16) tensors are whole and come back in
   ``AtomInstallReport.passthrough`` for ATOM's own loader to slice;
3. the MTP layer (``model.layers.{num_hidden_layers + i}``, ``i < num_nextn_predict_layers``) is
   not in ATOM's ``DeepseekV2ForCausalLM``: ATOM builds it only in its separate draft model
   (``DeepSeekMTP``). Its tensors are installed into that draft model when one is passed
   (``mtp_model=``), under the draft's parameter names (:func:`atom_mtp_param_name`), else
   returned in ``AtomInstallReport.mtp``.

Call it after the model (and draft model) is built and instead of the reading step of ATOM's
``load_model``; ATOM's post-loading loop (``process_weights_after_loading`` of every module)
still runs, and does nothing to the modules made no-ops here. What is exercised without ROCm:
the name and shape contract against models built as ATOM's ``create_weights`` builds them
(tests/test_atom_adapter.py), and ATOM's real DeepSeek and MTP models, built and post-processed
by ATOM's own code on the CPU, compared byte for byte with ATOM's own load of the source, every
rank of each conversion it makes (scripts/check_atom_install.py; docs/engines.md). What is not: aiter's
kernels on the installed bytes, and the Triton MoE path, whose ``_swizzle_mxfp4`` wraps the
scales in triton_kernels layout objects that ATOM must still construct from the
``CDNA4_SCALE`` tensors handed over (reported in ``AtomInstallReport.needs_engine_wrapping``).
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import re
from typing import Any, Mapping

import torch

from ..compat import (CompatibilityError, EngineConfig, bf16_moe_layout_matches, check_compatibility,
                      dense_layout_matches, ep_matches, moe_layout_matches, rank_in_range, tp_matches)
from ..loader import RankTensors, load_rank
from ..manifest import Manifest, ManifestError, TensorRecord, load_manifest
from ..errors import LayoutsError
from ..registry import MOE_BF16, MOE_CK, MOE_TRITON, MOE_TRITON_GFX942, NON_SHUFFLE, PRESHUFFLE, recorded_layout
from ..shuffle import S8_COLS, pad_to
from . import NEVER, EngineProfile, GemmPathRule, GpuArch, current_gpu_arch

ENV_NON_SHUFFLE = "ATOM_USE_FP4_NON_SHUFFLE_TRITON_GEMM"
ENV_TRITON_GEMM = "ATOM_USE_TRITON_GEMM"
ENV_TRITON_MOE = "ATOM_USE_TRITON_MOE"
ENV_INPUT_FUSION = "ATOM_ENABLE_DS_INPUT_RMSNORM_QUANT_FUSION"
ENV_QKNORM_FUSION = "ATOM_ENABLE_DS_QKNORM_QUANT_FUSION"

# ---------------------------------------------------------------------------- paths and layouts
ASM, TRITON_PRESHUFFLE, TRITON_NON_SHUFFLE = "asm", "triton-preshuffle", "triton-non-shuffle"
CK, TRITON = "ck", "triton"  # MoE back ends: aiter's CK fused_moe, triton_kernels' MoE

GEMM_PATHS: dict[str, GemmPathRule] = {  # the default (no switch) first
    ASM: GemmPathRule(PRESHUFFLE.name, 0, 0),
    TRITON_PRESHUFFLE: GemmPathRule(PRESHUFFLE.name, 32, 32),
    TRITON_NON_SHUFFLE: GemmPathRule(NON_SHUFFLE.name, NEVER, NEVER),
}
GFX94, GFX95 = GpuArch("gfx94", "gfx942", "gfx94x (MI300)"), GpuArch("gfx95", "gfx950", "gfx95x (MI355)")
MOE_LAYOUTS: dict[tuple[str, str], str] = {  # CK first: it is ATOM's MoE unless the switch (or the arch) says Triton
    (CK, GFX94.prefix): MOE_CK.name,
    (CK, GFX95.prefix): MOE_CK.name,
    (TRITON, GFX94.prefix): MOE_TRITON_GFX942.name,  # triton_kernels on gfx942 reads raw scales
    (TRITON, GFX95.prefix): MOE_TRITON.name,  # and CDNA4_SCALE-swizzled ones on gfx950
}
# BF16 experts (R1-0528's MTP layer) go to UnquantizedFusedMoEMethod whatever the switches say
# (ROCm/ATOM ffdf3bb5 atom/model_ops/moe.py:2888-2891; ATOM_USE_TRITON_MOE is read only by the
# MXFP4 method, 1046-1052). Its process_weights_after_loading (moe.py:830-836) pads nothing
# (_maybe_pad_weight, 827-828, is the identity) and calls shuffle_weights(w13, w2), which shuffles
# each expert [N, K] with aiter's shuffle_weight(layout=(16, 16)), no gate/up interleave, and
# sets is_shuffled (atom/model_ops/utils.py:134-168); aiter's fused_moe reads that attribute
# (aiter e4048607 aiter/fused_moe.py:747). On every arch, CK or Triton MXFP4 MoE alike.
BF16_MOE_LAYOUT = MOE_BF16.name

# ---------------------------------------------------------------------------- refusals
_DENSE_FIX = {
    (PRESHUFFLE.name, TRITON_NON_SHUFFLE): (
        "checkpoint is preshuffled; the non-shuffle Triton GEMM would read garbage: "
        f"unset {ENV_NON_SHUFFLE} or convert with --layout {NON_SHUFFLE.name}"),
    (NON_SHUFFLE.name, ASM): (
        "checkpoint is non-shuffled (raw); the ASM/CK gemm_a4w4 reads preshuffled (W16/S32x8) weights and would "
        f"read garbage: set {ENV_NON_SHUFFLE}=1 or convert with --layout {PRESHUFFLE.name}"),
    (NON_SHUFFLE.name, TRITON_PRESHUFFLE): (
        "checkpoint is non-shuffled (raw); the Triton preshuffle GEMM reads W16/S32x8 weights and would read "
        f"garbage: set {ENV_NON_SHUFFLE}=1 instead of {ENV_TRITON_GEMM}=1, or convert with --layout {PRESHUFFLE.name}"),
}

# DeepSeek's attention projections (MLA; q_proj where q_lora_rank is None), as manifest groups end.
ATTENTION_MODULES = ("q_proj", "q_a_proj", "kv_a_proj_with_mqa", "fused_qkv_a_proj", "q_b_proj", "kv_b_proj", "o_proj")


def mxfp4_attention_group(manifest: Manifest) -> str | None:
    """The first attention module the checkpoint holds in MXFP4, or None (attention is BF16)."""
    for t in manifest.tensors:
        if t.role == "mxfp4_weight" and t.group and t.group.rpartition(".")[2] in ATTENTION_MODULES:
            return t.group
    return None


def triton_gemm_needs_bf16_attention(manifest: Manifest, engine: EngineConfig) -> str | None:
    """The triton-preshuffle path is ATOM_USE_TRITON_GEMM=1; the dense layout fits it, but ATOM's
    attention under that switch expects a BF16 source (module docstring)."""
    if engine.gemm_path == TRITON_PRESHUFFLE and (attn := mxfp4_attention_group(manifest)) is not None:
        return (f"attention is MXFP4 ({attn}) but with {ENV_TRITON_GEMM}=1 ATOM builds DeepSeek's attention for a "
                "BF16 source (fused_qkv_a_proj/q_b_proj quantized at load, source_quant_dtype=bfloat16; kv_b_proj/o_proj "
                "BF16; no weight_scale), so the packed weights fail its weight loader's copy and the scales are dropped: "
                f"unset {ENV_TRITON_GEMM} (ATOM then runs MXFP4 attention on the ASM/CK gemm_a4w4, same layout), or use "
                "a checkpoint whose attention is BF16 (as R1-0528)")
    return None


# Which bytes each GEMM path can take in the K-pad columns of an S32x8 weight scale (the columns
# past K/32 when K/32 is not a multiple of 8: DeepSeek's down_proj at TP 16, K = 1152). Every ATOM
# path passes the real K, taken from the activation [M, K/2] (ROCm/ATOM atom/model_ops/linear.py,
# gemm_a4w4_quant, at commit ffdf3bb5; aiter at e4048607: gemm_afp4wfp4_preshuffle takes
# K_elems = 2 * x_fp4.shape[1] in aiter/ops/triton/gemm/basic/gemm_afp4wfp4.py, gemm_a4w4 takes
# k = A.shape[-1] * 2 in aiter/ops/gemm_op_a4w4.py before calling the ASM or CK kernel).
# * triton-preshuffle: aiter's Triton kernels, told the real K, read the pad columns but multiply
#   them by data masked to zero, so any finite byte is exact and 0xFF (E8M0 NaN) makes the output
#   NaN (tests/test_consumer_kernels.py, test_s32x8_k_pad_byte; docs/consumer-kernels.md).
# * asm: aiter's ASM/CK gemm_a4w4 is a binary that cannot run here; AMD-AGI/Primus-Turbo#383
#   reports that it reads the K-pad scale columns against the data past K, which only 0x00
#   (2^-127) cancels; a 0x7F pad (layout version 1) lets that data into the sum.
# * triton-non-shuffle reads raw scales: there is no pad to read.
# The MoE back ends get no rule: prep pads stacked experts to multiples of 256, so their S32x8
# scales never pad K (and no evidence says how the CK MoE reads a pad).
_K_PAD_USABLE = {ASM: (lambda b: b == 0x00, "only 0x00"), TRITON_PRESHUFFLE: (lambda b: b != 0xFF, "any byte but 0xFF")}


def _k_padded_linear(manifest: Manifest) -> tuple[str, int] | None:
    """The first dense linear whose S32x8 scale pads K, with its K per rank, or None."""
    for g in manifest.groups:
        if g.kind == "linear" and g.layout == PRESHUFFLE.name and g.parts:
            p = g.parts[0]
            k = p.k // g.tp if p.split == "cols" else p.k
            if -(-k // 32) % S8_COLS:
                return g.name, k
    return None


def s32x8_k_pad_usable(manifest: Manifest, engine: EngineConfig) -> str | None:
    """The GEMM path reads the K-pad columns of the checkpoint's S32x8 scales: their byte must be
    one it can use (the table above)."""
    usable = _K_PAD_USABLE.get(engine.gemm_path)
    padded = _k_padded_linear(manifest) if usable and manifest.layout == PRESHUFFLE.name else None
    if padded is None:
        return None
    record = manifest.layouts.get(PRESHUFFLE.name)
    if record is None:
        return f"the manifest does not record the {PRESHUFFLE.name!r} layout it used (its pad byte): convert again"
    try:
        layout = recorded_layout(record.to_json())
    except LayoutsError as e:
        return str(e.args[0])
    byte, (ok, which) = layout.scale.pad_value, usable
    if ok(byte):
        return None
    name, k = padded
    return (f"{name}: K = {k} pads its S32x8 scale from {-(-k // 32)} to {pad_to(-(-k // 32), S8_COLS)} columns with "
            f"0x{byte:02X} (layout '{PRESHUFFLE.name}' version {layout.version}), and the {engine.gemm_path} GEMM "
            f"reads those columns ({which} keeps it right): re-convert with this prep version "
            f"(layout version {PRESHUFFLE.version} pads with 0x{PRESHUFFLE.scale.pad_value:02X})")


def expert_parallel_needs_ck_moe(manifest: Manifest, engine: EngineConfig) -> str | None:
    if engine.ep_size > 1 and engine.moe_backend not in AtomProfile.expert_parallel_backends:
        return ("expert parallel with the Triton MoE: ATOM's triton_kernel_fused_experts ignores the expert map "
                f"and would apply other ranks' expert ids to this rank's experts; set {ENV_TRITON_MOE}=0 (CK MoE) for EP")
    return None


# ---------------------------------------------------------------------------- the profile
class AtomProfile(EngineProfile):
    """ROCm ATOM (``ROCm/ATOM`` at commit ffdf3bb5) serving DeepSeek V2/V3/R1 on MI300 / MI355."""

    name = "atom"
    gemm_paths = GEMM_PATHS
    moe_layouts = MOE_LAYOUTS
    gpu_archs = (GFX94, GFX95)
    default_gpu_arch = GFX95.example
    expert_parallel_backends = (CK,)  # ATOM's Triton MoE ignores the expert map
    expert_parallel_switch = "--enable-expert-parallel"  # sets ep_size = tp_size
    bf16_moe_layout = BF16_MOE_LAYOUT
    checks = (tp_matches, rank_in_range, ep_matches, dense_layout_matches, triton_gemm_needs_bf16_attention,
              s32x8_k_pad_usable, moe_layout_matches, bf16_moe_layout_matches, expert_parallel_needs_ck_moe)

    def config_from_env(self, env: Mapping[str, str], *, tp_size: int, rank: int, ep_size: int,
                        gpu_arch: str | None) -> EngineConfig:
        def on(name: str, default: str = "0") -> bool:
            return env.get(name, default) == "1"

        non_shuffle, triton_gemm = on(ENV_NON_SHUFFLE), on(ENV_TRITON_GEMM)
        if non_shuffle and triton_gemm:
            raise CompatibilityError(
                f"{ENV_TRITON_GEMM}=1 together with {ENV_NON_SHUFFLE}=1: ATOM keeps the weights raw but its fused "
                "qkv_a + RMSNorm + quant path (_fuse_qkv_a_proj_reduce_rmsnorm_quant_fp4) still runs the preshuffle "
                f"GEMM on them and reads garbage; unset one of the two")
        gemm_path = TRITON_NON_SHUFFLE if non_shuffle else TRITON_PRESHUFFLE if triton_gemm else ASM
        arch = gpu_arch or current_gpu_arch() or self.default_gpu_arch
        if ENV_TRITON_MOE in env:
            moe = TRITON if on(ENV_TRITON_MOE) else CK
        else:  # ATOM's own choice when the switch is unset
            moe = TRITON if arch.startswith(GFX94.prefix) or (arch.startswith(GFX95.prefix) and triton_gemm) else CK
        return EngineConfig(gemm_path, moe, tp_size, rank, ep_size, arch,
                            on(ENV_INPUT_FUSION, "1"), on(ENV_QKNORM_FUSION, "1"), engine=self.name)

    def dense_fix(self, layout: str, gemm_path: str) -> str | None:
        return _DENSE_FIX.get((layout, gemm_path))

    def moe_fix(self, moe_layout: str, engine: EngineConfig) -> str | None:
        readers = {backend for (backend, _), layout in self.moe_layouts.items() if layout == moe_layout}
        if engine.moe_backend in readers:  # the right back end on another GPU: only the GPU fixes it
            return "run on the GPU the checkpoint was made for (the Triton MoE scale layout differs by arch)"
        if not readers:
            return None
        return f"set {ENV_TRITON_MOE}={1 if TRITON in readers else 0}"

    def target_refusal(self, tp: int, ep: int, moe_layout: str) -> str | None:
        if ep not in (1, tp):
            return (f"--ep {ep} with --tp {tp}: expert parallel runs with ep_size = tp_size (ATOM's "
                    f"{self.expert_parallel_switch}); pass --ep 1 or --ep equal to --tp")
        if ep > 1 and moe_layout not in (ep_layouts := self.expert_parallel_moe_layouts()):
            return (f"--ep {ep} with --moe-layout {moe_layout}: ATOM's Triton MoE ignores the expert map, so no "
                    f"engine could run this; use --moe-layout {' or '.join(ep_layouts)} for expert parallel")
        return None


PROFILE = AtomProfile()


# ---------------------------------------------------------------------------- the adapter
@dataclasses.dataclass
class AtomInstallReport:
    """What :func:`install_converted_weights` did, for the engine's log.

    Names in ``skipped_processing`` and ``needs_engine_wrapping`` are those of the model the
    tensor went into; the draft model's carry ``.mtp_block.`` (or are its layer's own), so the
    two never collide."""

    installed: list[str]  # main-model parameter names whose data now holds the converted tensor
    skipped_processing: list[str]  # modules whose process_weights_after_loading is now a no-op
    passthrough: dict[str, torch.Tensor]  # BF16 tensors for ATOM's own weight loader (main model)
    needs_engine_wrapping: list[str]  # Triton MoE scales ATOM still wraps in its layout objects
    rank_tensors: RankTensors | None = None
    # The MTP layer's tensors not installed, by checkpoint name (``model.layers.{N}.…``), for the
    # draft model: all of them without ``mtp_model``, only the BF16 ones with it. ATOM's draft
    # loader takes these names as they are (its ``remap_mtp_weight_name`` renames them).
    mtp: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    mtp_installed: list[str] = dataclasses.field(default_factory=list)  # draft-model parameter names filled
    # Rank-exact: parameters of the models ("main:…", "draft:…") the checkpoint did not fill; ATOM's
    # loader would warn that they were NOT loaded. Empty when the model is the converted one.
    not_installed: list[str] = dataclasses.field(default_factory=list)


def _processing_done(layer: torch.nn.Module) -> None:
    """Stands in for ``process_weights_after_loading``: the converted bytes are final."""
    return None


def _as_param_dtype(t: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """Our uint8 bytes seen as the parameter's dtype (ATOM allocates fp4x2 / e8m0 / uint8)."""
    if param.dtype == t.dtype:
        return t
    if param.dtype.itemsize != 1:
        raise ManifestError(f"parameter dtype {param.dtype} cannot hold MXFP4 bytes")
    return t.view(param.dtype)


# ---------------------------------------------------------------------------- the MTP layer
# ATOM's draft model, from ROCm/ATOM atom/models/deepseek_mtp.py at commit ffdf3bb5:
# DeepSeekMTP.model is a DeepSeekMultiTokenPredictor whose ``layers`` is a ModuleDict keyed by the
# checkpoint's own layer index (``range(num_hidden_layers, num_hidden_layers + num_nextn_predict_layers)``),
# so the draft keeps ``model.layers.{N}.``. Each layer (DeepSeekMultiTokenPredictorLayer) holds
# enorm, hnorm, eh_proj and shared_head itself and its decoder layer as ``mtp_block``; ATOM's loader
# (spec_decode) renames checkpoint names with remap_mtp_weight_name -> rewrite_spec_layer_name:
# decoder-layer tensors gain ``.mtp_block.``, the layer's own keep their name, and embed_tokens,
# shared with the target, moves to the top (``model.embed_tokens``). The main model
# (DeepseekV2Model, atom/models/deepseek_v2.py) makes only num_hidden_layers layers and its loader
# drops names past them (CheckpointNameRewriter._is_past_last_layer, atom/model_loader/weight_names.py).
_MTP_LAYER_OWN = ("embed_tokens", "enorm", "hnorm", "eh_proj", "shared_head")  # ATOM's spec_layer_weight_names
_MTP_SHARED = ("embed_tokens",)  # ATOM's shared_weight_names
_TARGET_EMBED = "model.embed_tokens.weight"
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def atom_mtp_param_name(name: str, layer: int) -> str:
    """The parameter of ATOM's ``DeepSeekMTP`` that checkpoint tensor ``name`` of MTP layer
    ``layer`` fills: ATOM's ``rewrite_spec_layer_name``, substring tests included."""
    prefix = f"model.layers.{layer}."
    own = next((w for w in _MTP_LAYER_OWN if w in name), None)
    if own is None:
        return name.replace(prefix, f"{prefix}mtp_block.")
    return name.replace(prefix, "model.") if own in _MTP_SHARED else name


def _mtp_layers(root: pathlib.Path) -> range:
    """The MTP layers' indices, from the config.json the conversion copied next to its files
    (the manifest does not hold the model's shape). ATOM builds its models from that file too."""
    path = root / "config.json"
    try:
        cfg = json.loads(path.read_text())
        start = int(cfg["num_hidden_layers"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ManifestError(f"{path}: cannot read num_hidden_layers ({e!r}); it tells the main model's layers "
                            "from the MTP layer: copy the source's config.json there or convert again") from None
    return range(start, start + int(cfg.get("num_nextn_predict_layers") or 0))


def _layer_index(name: str) -> int | None:
    m = _LAYER.match(name)
    return int(m.group(1)) if m else None


# ---------------------------------------------------------------------------- installing
def _install(model: torch.nn.Module, items: list[tuple[str, str, torch.Tensor, TensorRecord]],
             report: AtomInstallReport, which: str) -> list[str]:
    """Put each ``(checkpoint name, parameter name, tensor, record)`` into ``model``'s parameter,
    set its attributes and make its module's processing a no-op; returns the parameter names."""
    params = dict(model.named_parameters())
    modules = dict(model.named_modules())
    what = "model" if which == "main" else f"{which} model"
    installed: list[str] = []
    groups: dict[str, dict[str, Any]] = {}
    for ckpt_name, name, t, rec in items:
        param = params.get(name)
        shown = ckpt_name if name == ckpt_name else f"{ckpt_name} (ATOM's {which} parameter {name})"
        if param is None:
            raise ManifestError(f"{shown}: the checkpoint has it but the {what} has no such parameter; "
                                f"is this ATOM's {'DeepSeekMTP' if which == 'draft' else 'DeepSeek model'} "
                                "with the same --tp/--ep?")
        module_name = name.rpartition(".")[0]
        # Scales may be padded past ATOM's allocation; every other tensor is exactly the parameter.
        if rec.role != "e8m0_scale" and tuple(param.shape) != tuple(t.shape):
            raise ManifestError(f"{shown}: the {what} allocates {list(param.shape)} but the checkpoint holds "
                                f"{list(t.shape)}; the model config differs from the converted one")
        if rec.layout is None:  # source bytes, already split: ATOM's own processing still runs on them
            param.data = t if param.dtype == t.dtype else t.to(param.dtype)  # the F32 router bias: ATOM keeps BF16
            installed.append(name)
            continue
        param.data = _as_param_dtype(t, param)
        # is_shuffled goes on weights only, as ATOM sets it (ROCm/ATOM ffdf3bb5 atom/model_ops/utils.py:168
        # shuffle_weights; moe.py:1297-1298 w13_weight/w2_weight) and as its readers look for it (aiter
        # e4048607 aiter/ops/moe_op.py:626 reads w1; ATOM's attention_mla.py:876 kv_b_proj.weight).
        for k, v in rec.runtime_attrs.items():
            if k != "is_shuffled" or rec.role != "e8m0_scale":
                setattr(param, k, v)
        installed.append(name)
        groups.setdefault(module_name, {}).update(
            {k: v for k, v in rec.runtime_attrs.items() if k in ("hidden_pad", "intermediate_pad")})
        if rec.runtime_attrs.get("scale_swizzle"):
            report.needs_engine_wrapping.append(name)
    for module_name, method_attrs in groups.items():
        _skip_processing(modules[module_name], module_name, method_attrs)
        report.skipped_processing.append(module_name)
    return installed


def _skip_processing(module: torch.nn.Module, module_name: str, method_attrs: dict[str, Any]) -> None:
    method = getattr(module, "quant_method", None)
    if method is not None and hasattr(method, "process_weights_after_loading"):
        for k, v in method_attrs.items():  # ATOM computes these from the config: they must agree
            have = getattr(method, k, v)
            if have != v:
                raise ManifestError(f"{module_name}: ATOM's MoE method has {k}={have} but the checkpoint was padded "
                                    f"with {k}={v}; convert with the same hidden/intermediate padding")
        # Patch this instance (ATOM makes one quant method per layer) rather than wrap it:
        # ATOM dispatches on isinstance(layer.quant_method, ...), which a proxy would break.
        method.process_weights_after_loading = _processing_done
    if hasattr(module, "process_weights_after_loading"):
        module.process_weights_after_loading = lambda: None  # this instance only


def install_converted_weights(model: torch.nn.Module, model_dir: str | pathlib.Path, engine: EngineConfig,
                              device: str | torch.device | None = None,
                              mtp_model: torch.nn.Module | None = None) -> AtomInstallReport:
    """Install rank ``engine.rank``'s converted tensors into ``model`` (ATOM's DeepSeek), and the
    MTP layer's into ``mtp_model`` (ATOM's ``DeepSeekMTP`` draft) when given; without it the MTP
    layer's tensors come back in the report's ``mtp``, not installed.

    A rank-exact checkpoint (manifest format 2) holds every tensor of the rank already split as
    ATOM holds it: all of them are installed, BF16 included, and nothing is left for ATOM's
    loader (``report.not_installed`` names any parameter of the model still unfilled). The
    draft's ``model.embed_tokens`` gets the rank's target embedding, which is what ATOM's drafter
    puts there after loading. Of a format-1 checkpoint the MXFP4 tensors are installed and the
    pass-through ones (whole, for every rank) come back in ``report.passthrough`` for ATOM's
    loader to slice.

    Raises :class:`~layouts.CompatibilityError` when the engine would misread the checkpoint,
    and :class:`~layouts.ManifestError` naming the tensor when the model has no parameter for
    it or its shape is not the one ATOM allocates before processing."""
    manifest = load_manifest(model_dir)
    check_compatibility(manifest, engine)
    mtp_layers = _mtp_layers(manifest.root)
    if device is None:
        first = next(iter(model.parameters()), None)
        device = first.device if first is not None else "cpu"
    tensors = load_rank(model_dir, engine.rank, device, manifest=manifest)
    exact = manifest.target.rank_exact
    report = AtomInstallReport([], [], {}, [], tensors)
    main, draft = [], []
    for name, t in tensors.items():
        rec = tensors.records[name]
        layer = _layer_index(name)
        whole = rec.role == "passthrough" and not exact  # format 1: ATOM's loader slices it
        if layer is not None and layer in mtp_layers:
            if mtp_model is not None and not whole:
                draft.append((name, atom_mtp_param_name(name, layer), t, rec))
            else:
                report.mtp[name] = t  # ATOM's main model has no MTP layer: the draft model takes these
        elif whole:
            report.passthrough[name] = t
        else:
            main.append((name, name, t, rec))
            if exact and mtp_model is not None and name == _TARGET_EMBED:
                draft.append((name, _TARGET_EMBED, t, rec))  # ATOM's drafter shares the target's embedding
    report.installed = _install(model, main, report, "main")
    if mtp_model is not None:
        report.mtp_installed = _install(mtp_model, draft, report, "draft")
    if exact:
        for which, m, done in (("main", model, report.installed), ("draft", mtp_model, report.mtp_installed)):
            if m is not None:
                filled = set(done)
                report.not_installed += [f"{which}:{n}" for n, _ in m.named_parameters() if n not in filled]
    return report
