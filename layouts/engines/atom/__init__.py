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

The adapter that installs a converted checkpoint into ATOM's models is :mod:`.adapter`; the
door that serves a converted folder with ATOM's own server is :mod:`.serve`.
"""

from __future__ import annotations

import shlex
from typing import Mapping

from .._compat import (CompatibilityError, EngineConfig, bf16_moe_layout_matches, dense_layout_matches,
                       engine_matches, ep_matches, fp8_layout_matches, moe_layout_matches, rank_in_range, tp_matches)
from ...manifest import Manifest
from ...errors import LayoutsError
from ...families import WHOLE
from ...registry import FP8_CHANNEL_PRESHUFFLE, FP8_CHANNEL_SCALE, FP8_PRESHUFFLE, MOE_BF16, MOE_CK, MOE_TRITON, MOE_TRITON_GFX942, NON_SHUFFLE, PRESHUFFLE, recorded_layout
from ...shuffle import S8_COLS, pad_to
from .. import (NEVER, EngineProfile, GemmPathRule, GpuArch, ShardingRules, _config,
                current_gpu_arch, deepseek_merges)

ENV_NON_SHUFFLE = "ATOM_USE_FP4_NON_SHUFFLE_TRITON_GEMM"
ENV_TRITON_GEMM = "ATOM_USE_TRITON_GEMM"
ENV_TRITON_MOE = "ATOM_USE_TRITON_MOE"
ENV_INPUT_FUSION = "ATOM_ENABLE_DS_INPUT_RMSNORM_QUANT_FUSION"
ENV_QKNORM_FUSION = "ATOM_ENABLE_DS_QKNORM_QUANT_FUSION"
ENV_GU_INTERLEAVE = "ATOM_MOE_GU_ITLV"
ENV_TRITON_MOE_DECODE = "ATOM_USE_TRITON_MOE_DECODE"
# 1 (ATOM's default): aiter's (16, 16) shuffle of every FP8 block-scaled weight at load, which the
# fp8-preshuffle layout writes; 0: unshuffled, bar fused_qkv_a_proj (atom/model_ops/linear.py:858-869)
ENV_FP8_PRESHUFFLE = "ATOM_FP8_BLOCKSCALE_WEIGHT_PRESHUFFLE"

# ---------------------------------------------------------------------------- paths and layouts
ASM, TRITON_PRESHUFFLE, TRITON_NON_SHUFFLE = "asm", "triton-preshuffle", "triton-non-shuffle"
CK, TRITON = "ck", "triton"  # MoE back ends: aiter's CK fused_moe, triton_kernels' MoE

GEMM_PATHS: dict[str, GemmPathRule] = {  # the default (no switch) first
    ASM: GemmPathRule(PRESHUFFLE.name, 0, 0),
    # ATOM_USE_TRITON_GEMM=1 (use_triton_gemm()) also fuses the input RMSNorm with a 1x128 FP8 quant
    # (deepseek_v2.py, DeepseekV2DecoderLayer.__init__, enable_fp8_input_norm_quant)
    TRITON_PRESHUFFLE: GemmPathRule(PRESHUFFLE.name, 32, 32, fuses_fp8_group_input_quant=True),
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

# ---------------------------------------------------------------------------- a rank's modules
# ATOM's DeepSeek model (atom/models/deepseek_v2.py at ffdf3bb5): q_a and kv_a merged into a
# replicated fused_qkv_a_proj; gate and up into a column-parallel gate_up_proj (the dense MLP's,
# and the shared expert's when it is not stacked with the routed ones); q_b / q_proj / kv_b
# column parallel, o_proj and down row parallel; embedding and head vocabulary parallel; the
# routed experts stacked as mlp.experts, in contiguous blocks under expert parallel
# (determine_expert_map). tests/atom_sharding.py states the same from ATOM's weight loaders and
# checks every rank against ATOM's real load.
SHARDING = ShardingRules(
    merges=deepseek_merges("self_attn.fused_qkv_a_proj"),
    # atom/model_loader/weight_names.py renames every weight_scale_inv; LinearBase allocates
    # weight_scale [ceil(N/128), ceil(K/128)], Fp8MoEMethod w13_weight_scale / w2_weight_scale
    fp8_block_scale="weight_scale",
    # use_replicated_vocab_embed: with ATOM_REPLICATE_VOCAB_EMBED (default 1) and an untied head,
    # GLM-5's embedding is a ReplicatedEmbedding, the whole table on every rank
    splits=(("glm-5", r"^model\.embed_tokens$", WHOLE),),
)

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


def fp8_attention_tensor(manifest: Manifest) -> str | None:
    """The first FP8 (F8_E4M3) attention weight the checkpoint holds with one scale per output
    channel (its ``weight_scale`` has its rows), or None: block-scaled FP8 attention (DeepSeek's
    own release, one scale per 128x128 block) is what ATOM's block-scale GEMMs read."""
    weights = {(t.rank, t.name): t for t in manifest.tensors if t.dtype == "F8_E4M3" and ".self_attn." in t.name}
    for t in manifest.tensors:
        w = weights.get((t.rank, t.name[:-len("_scale")])) if t.name.endswith(".weight_scale") else None
        if w is not None and t.shape[0] == w.shape[0]:
            return w.name
    return None


def triton_gemm_needs_bf16_attention(manifest: Manifest, engine: EngineConfig) -> str | None:
    """The triton-preshuffle path is ATOM_USE_TRITON_GEMM=1; the dense layout fits it, but ATOM's
    attention under that switch expects a BF16 source (module docstring)."""
    if engine.gemm_path == TRITON_PRESHUFFLE and (fp8 := fp8_attention_tensor(manifest)) is not None:
        # ATOM's fused q_a/kv_a path under that switch runs its FP8 block-scale preshuffle GEMMs whatever
        # the linear's quant type (atom/models/deepseek_v2.py:861-932, :2713-2733), while its per-channel
        # linears keep the weight unshuffled with an [N, 1] scale there (atom/model_ops/linear.py:848-853)
        return (f"attention is FP8 per channel ({fp8}) but with {ENV_TRITON_GEMM}=1 ATOM's fused q_a/kv_a path runs "
                "its FP8 block-scale GEMMs on it, which read a per-channel weight wrong: unset "
                f"{ENV_TRITON_GEMM} (ATOM then runs its per-channel FP8 GEMM, gemm_a8w8_bpreshuffle)")
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
        layout = recorded_layout(record)
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
    label = "ATOM"
    gemm_paths = GEMM_PATHS
    moe_layouts = MOE_LAYOUTS
    gpu_archs = (GFX94, GFX95)
    default_gpu_arch = GFX95.example
    expert_parallel_backends = (CK,)  # ATOM's Triton MoE ignores the expert map
    expert_parallel_switch = "--enable-expert-parallel"  # sets ep_size = tp_size
    mtp_draft_flags = "--method mtp"
    bf16_moe_layout = BF16_MOE_LAYOUT
    # LinearBase / Fp8MoEMethod.process_weights_after_loading (per_1x128): shuffle_weights (16, 16) of
    # every block-scaled FP8 weight and expert, the scales untouched (ATOM_FP8_BLOCKSCALE_WEIGHT_PRESHUFFLE=1)
    fp8_layout = FP8_PRESHUFFLE.name
    # LinearBase.process_weights_after_loading (per_Token FP8, every path this door serves it on):
    # N padded to 128 (zero rows, scale 1.0, is_output_padded) and shuffle_weights (16, 16)
    fp8_channel_layouts = (FP8_CHANNEL_PRESHUFFLE.name, FP8_CHANNEL_SCALE.name)
    fp8_layout_fix = f"unset {ENV_FP8_PRESHUFFLE} (ATOM's default, 1, holds them in this layout)"
    fp8_channel_linears = True  # python -m harness check-engine atom --serve on MTP-MoEFP4 (tests/test_atom_serve.py)
    fp8_block_linears = True  # python -m harness check-engine atom --serve on the fp8-block variant (tests/test_atom_serve.py)
    sharding = SHARDING
    # python -m harness check-engine atom --serve on tiny kimi-k2, kimi-k2.5 and v3.2 (the indexer replicated;
    # tests/test_atom_serve.py)
    families = ("deepseek-v3", "kimi-k2", "kimi-k2.5", "deepseek-v3.2", "glm-5")
    checks = (engine_matches, tp_matches, rank_in_range, ep_matches, dense_layout_matches,
              triton_gemm_needs_bf16_attention, s32x8_k_pad_usable, moe_layout_matches, bf16_moe_layout_matches,
              fp8_layout_matches, expert_parallel_needs_ck_moe)

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
        # MoE switches that change the bytes the MXFP4 MoE holds (ROCm/ATOM ffdf3bb5 atom/model_ops/moe.py
        # Mxfp4MoEMethod): GU_ITLV shuffles w13 gate/up-interleaved (1285-1320) and tells the CK kernel
        # GateMode.INTERLEAVE (1566-1571): no prep layout holds that order; TRITON_MOE_DECODE (read
        # only without GU_ITLV, 1053-1054) builds preshuffled decode copies at load (1325, 1396).
        if on(ENV_GU_INTERLEAVE):
            raise CompatibilityError(
                f"{ENV_GU_INTERLEAVE}=1: ATOM's MoE then reads w13 with gate and up rows interleaved, an order no prep "
                f"MoE layout holds, and would read them swapped; unset {ENV_GU_INTERLEAVE}")
        if on(ENV_TRITON_MOE_DECODE):
            raise CompatibilityError(
                f"{ENV_TRITON_MOE_DECODE}=1: ATOM builds the Triton decode MoE's own copies of the experts while "
                f"processing them at load, which a converted checkpoint's stacked experts skip; unset "
                f"{ENV_TRITON_MOE_DECODE}")
        gemm_path = TRITON_NON_SHUFFLE if non_shuffle else TRITON_PRESHUFFLE if triton_gemm else ASM
        arch = gpu_arch or current_gpu_arch() or self.default_gpu_arch
        if env.get(ENV_TRITON_MOE, ""):  # set and not empty, as ATOM's envs.is_set reads it
            moe = TRITON if on(ENV_TRITON_MOE) else CK
        else:  # ATOM's own choice when the switch is unset
            moe = TRITON if arch.startswith(GFX94.prefix) or (arch.startswith(GFX95.prefix) and triton_gemm) else CK
        return EngineConfig(gemm_path, moe, tp_size, rank, ep_size, arch,
                            on(ENV_INPUT_FUSION, "1"), on(ENV_QKNORM_FUSION, "1"), profile=self,
                            fp8_layout="" if on(ENV_FP8_PRESHUFFLE, "1") else None)

    def dense_fix(self, layout: str, gemm_path: str) -> str | None:
        return _DENSE_FIX.get((layout, gemm_path))

    def moe_fix(self, moe_layout: str, engine: EngineConfig) -> str | None:
        readers = {backend for (backend, _), layout in self.moe_layouts.items() if layout == moe_layout}
        if engine.moe_backend in readers:  # the right back end on another GPU: only the GPU fixes it
            return "run on the GPU the checkpoint was made for (the Triton MoE scale layout differs by arch)"
        if not readers:
            return None
        return f"set {ENV_TRITON_MOE}={1 if TRITON in readers else 0}"

    def source_notes(self, config: Mapping) -> list[str]:
        """DeepSeek-V3 keys a transformers-5 config lacks, which ATOM's model reads
        (``layouts.engines._config``): ATOM's server takes no config override, so its door sets
        them on ATOM's config in each worker (``worker.complete_hf_config``)."""
        return _config.notes(config, self.display_name, None, door="prep-atom-serve")

    def target_refusal(self, tp: int, ep: int, moe_layout: str, fuse_shared_expert: bool = False) -> str | None:
        if ep not in (1, tp):
            return (f"--ep {ep} with --tp {tp}: expert parallel runs with ep_size = tp_size (ATOM's "
                    f"{self.expert_parallel_switch}); pass --ep 1 or --ep equal to --tp")
        if ep > 1 and moe_layout not in (ep_layouts := self.expert_parallel_moe_layouts()):
            return (f"--ep {ep} with --moe-layout {moe_layout}: ATOM's Triton MoE ignores the expert map, so no "
                    f"engine could run this; use --moe-layout {' or '.join(ep_layouts)} for expert parallel")
        return None


    def serve_command(self, folder: str, tp: int, ep: int, layout: str, moe_layout: str,
                      fuse_shared_expert: bool = True, config: Mapping | None = None) -> str | None:
        """``prep-atom-serve`` (layouts.engines.atom.serve) with the switches of the first GEMM path
        reading ``layout`` and of the MoE back end reading ``moe_layout`` (set explicitly: ATOM's
        unset MoE switch means another back end per arch), and the TP/EP flags."""
        path = next((p for p, rule in self.gemm_paths.items() if rule.weight_layout == layout), None)
        backend = next((b for (b, _), m in self.moe_layouts.items() if m == moe_layout), None)
        if path is None or backend not in SERVED_MOE_BACKENDS:
            return None
        env = {**_PATH_SWITCHES[path], ENV_TRITON_MOE: "1" if backend == TRITON else "0"}
        flags = f"--tensor-parallel-size {tp}" + (f" {self.expert_parallel_switch}" if ep > 1 else "")
        if backend == TRITON:  # ATOM's own test plan for its Triton MoE: both DeepSeek fusions, an FP8 KV cache
            env.update({ENV_QKNORM_FUSION: "1", ENV_INPUT_FUSION: "1"})
            flags += " --kv_cache_dtype fp8"
        switches = " ".join(f"{k}={v}" for k, v in env.items())
        return f"{switches} prep-atom-serve --model {shlex.quote(folder)} {flags}"


# The MoE back ends prep-atom-serve (layouts.engines.atom.serve) serves: both. ATOM's Triton MoE builds
# more than bytes at load (ROCm/ATOM ffdf3bb5 atom/model_ops/moe.py:1206-1271,
# _process_weight_layout_after_loading: transposed views of w13/w2 and their scales, the scale swizzle
# label, a raw copy of the shared expert); the adapter leaves the module so (adapter._hold_as_triton_moe).
SERVED_MOE_BACKENDS = (CK, TRITON)

# The switches that select each GEMM path (config_from_env read the other way).
_PATH_SWITCHES = {ASM: {}, TRITON_PRESHUFFLE: {ENV_TRITON_GEMM: "1"}, TRITON_NON_SHUFFLE: {ENV_NON_SHUFFLE: "1"}}

PROFILE = AtomProfile()


# The adapter's names, where engine code has imported them from since it was written.
from .adapter import (AtomInstallReport, atom_mtp_param_name, install_converted_weights,  # noqa: E402
                      install_draft_weights)

__all__ = ["PROFILE", "TRITON_NON_SHUFFLE", "TRITON_PRESHUFFLE", "AtomProfile", "AtomInstallReport", "atom_mtp_param_name", "install_converted_weights",
           "install_draft_weights"]
