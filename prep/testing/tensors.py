"""A synthetic checkpoint's tensors: every module's stored tensors (:class:`Param`), in file
order, and their bytes, drawn per tensor from a generator seeded by ``(seed, name)`` and
quantized as Quark's exporter writes them."""

from __future__ import annotations

import fnmatch
import hashlib
import math
from dataclasses import dataclass, replace

import torch

import layouts
from layouts.dequant import FP8_BLOCK  # DeepSeek's FP8 release: one scale per 128x128 block of a weight
from layouts.sizes import ceil_div

from .config import exclude_patterns, is_excluded, layer_quant_config
from .spec import (FP8_MAX, LANGUAGE_MODEL, VT_BLOCKS, VT_HIDDEN, VT_INTERMEDIATE, VT_PATCH, VT_POS,
                   SynthSpec)

@dataclass(frozen=True)
class Param:
    """One module's stored tensors. ``kind``: "fp4" (weight U8 [N, K/2] + weight_scale U8
    [N, ceil(K/32)] from the logical [N, K]), "fp8" (weight F8_E4M3 [N, K] + weight_scale F32
    [N], one per output channel), "fp8-block" (weight F8_E4M3 [N, K] + weight_scale_inv F32
    [ceil(N/128), ceil(K/128)]), "bf16" (a BF16 weight), "norm" (BF16 around 1), "bias"
    (float32 ``e_score_correction_bias``)."""

    module: str
    shape: tuple[int, ...]
    kind: str

    def tensors(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Stored name -> (shape, dtype)."""
        if self.kind == "fp4":
            n, k = self.shape
            return {f"{self.module}.weight": ((n, k // 2), torch.uint8),
                    f"{self.module}.weight_scale": ((n, ceil_div(k, 32)), torch.uint8)}
        if self.kind == "bias":
            return {f"{self.module}.e_score_correction_bias": (self.shape, torch.float32)}
        if self.kind == "norm-bias":  # a LayerNorm's bias (DeepSeek-V3.2's indexer k_norm)
            return {f"{self.module}.bias": (self.shape, torch.bfloat16)}
        if self.kind == "fp8":
            return {f"{self.module}.weight": (self.shape, torch.float8_e4m3fn),
                    f"{self.module}.weight_scale": ((self.shape[0],), torch.float32)}
        if self.kind == "fp8-block":
            n, k = self.shape
            return {f"{self.module}.weight": (self.shape, torch.float8_e4m3fn),
                    f"{self.module}.weight_scale_inv": ((ceil_div(n, FP8_BLOCK), ceil_div(k, FP8_BLOCK)), torch.float32)}
        return {f"{self.module}.weight": (self.shape, torch.bfloat16)}

    def nbytes(self) -> int:
        total = 0
        for shape, dtype in self.tensors().values():
            total += torch.Size(shape).numel() * dtype.itemsize
        return total


def _layer_params(spec: SynthSpec, layer: int, excluded: list[str]) -> list[Param]:
    s, h = spec, spec.hidden_size
    p = f"model.layers.{layer}"
    mtp = layer == s.num_hidden_layers

    overrides = layer_quant_config(spec)

    def linear(module: str, n: int, k: int) -> Param:
        if is_excluded(module, excluded):
            return Param(module, (n, k), "bf16")
        if spec.variant == "fp8-block":
            return Param(module, (n, k), "fp8-block")
        fp8 = any(fnmatch.fnmatchcase(module, pat) for pat in overrides)  # the only override: FP8 per channel
        return Param(module, (n, k), "fp8" if fp8 else "fp4")

    out = []
    glm = s.model_type == "glm_moe_dsa"  # GLM-5's MTP layer: no embedding or head of its own
    if mtp and not glm:
        out.append(Param(f"{p}.embed_tokens", (s.vocab_size, h), "bf16"))
    if mtp:  # DeepSeek's MTP block: embed, two norms and eh_proj ahead of a normal decoder layer.
        out += [Param(f"{p}.enorm", (h,), "norm"),
                Param(f"{p}.hnorm", (h,), "norm"),
                # The real quirk: eh_proj is BF16 without weight_scale even where not excluded
                # (but in amd/GLM-5.1-MXFP4, which quantizes it: ATOM's deepseek_mtp.py says so).
                Param(f"{p}.eh_proj", (h, 2 * h), "fp4" if s.variant == "experts" else "bf16")]
    heads, qk = s.num_attention_heads, s.qk_nope_head_dim + s.qk_rope_head_dim
    a = f"{p}.self_attn"
    out += [
        Param(f"{p}.input_layernorm", (h,), "norm"),
        linear(f"{a}.q_a_proj", s.q_lora_rank, h),
        Param(f"{a}.q_a_layernorm", (s.q_lora_rank,), "norm"),
        linear(f"{a}.q_b_proj", heads * qk, s.q_lora_rank),
        linear(f"{a}.kv_a_proj_with_mqa", s.kv_lora_rank + s.qk_rope_head_dim, h),
        Param(f"{a}.kv_a_layernorm", (s.kv_lora_rank,), "norm"),
        linear(f"{a}.kv_b_proj", heads * (s.qk_nope_head_dim + s.v_head_dim), s.kv_lora_rank),
        linear(f"{a}.o_proj", h, heads * s.v_head_dim),
    ]
    if s.has_indexer(layer):  # DeepSeek-V3.2's indexer (self_attn.indexer.*), the MTP layer's too
        i = f"{a}.indexer"
        out += [linear(f"{i}.wq_b", s.index_n_heads * s.index_head_dim, s.q_lora_rank),
                linear(f"{i}.wk", s.index_head_dim, h),
                Param(f"{i}.k_norm", (s.index_head_dim,), "norm"), Param(f"{i}.k_norm", (s.index_head_dim,), "norm-bias"),
                Param(f"{i}.weights_proj", (s.index_n_heads, h), "bf16")]  # never quantized (every engine: BF16)
    out += [Param(f"{p}.post_attention_layernorm", (h,), "norm")]

    def mlp(prefix: str, inter: int) -> list[Param]:
        return [linear(f"{prefix}.gate_proj", inter, h), linear(f"{prefix}.up_proj", inter, h),
                linear(f"{prefix}.down_proj", h, inter)]

    if layer < s.first_k_dense_replace:
        out += mlp(f"{p}.mlp", s.intermediate_size)
    else:  # The router is a custom module, never a quantized linear: BF16 whatever the config says.
        out += [Param(f"{p}.mlp.gate", (s.n_routed_experts, h), "bf16"),
                Param(f"{p}.mlp.gate", (s.n_routed_experts,), "bias")]
        for e in range(s.n_routed_experts):
            out += mlp(f"{p}.mlp.experts.{e}", s.moe_intermediate_size)
        out += mlp(f"{p}.mlp.shared_experts", s.moe_intermediate_size * s.n_shared_experts)
    if mtp:
        out.append(Param(f"{p}.shared_head.norm", (h,), "norm"))
    if mtp and not glm:
        out.append(linear(f"{p}.shared_head.head", s.vocab_size, h))
    return out


def plan_groups(spec: SynthSpec) -> list[list[Param]]:
    """Params in file order, grouped into units a shard should not split: the embedding, each
    layer 0..L-1, final norm + lm_head, then the MTP layer L (last, as in DeepSeek's repo)."""
    excluded = exclude_patterns(spec)
    h = spec.hidden_size
    groups = [[Param("model.embed_tokens", (spec.vocab_size, h), "bf16")]]
    groups += [_layer_params(spec, layer, excluded) for layer in range(spec.num_hidden_layers)]
    lm_head = "bf16" if is_excluded("lm_head", excluded) else "fp4"
    groups.append([Param("model.norm", (h,), "norm"), Param("lm_head", (spec.vocab_size, h), lm_head)])
    if spec.mtp:
        groups.append(_layer_params(spec, spec.num_hidden_layers, excluded))
    if spec.multimodal:
        groups = [[replace(p, module=LANGUAGE_MODEL + p.module) for p in g] for g in groups] + _vision_params(spec.hidden_size)
    return groups


def _vision_params(text_hidden: int) -> list[list[Param]]:
    """MoonViT's tensors and the patch-merger projector's (Kimi-K2.5: ``vision_tower.*``,
    ``mm_projector.*``, every linear and LayerNorm with its bias), one group each."""
    def with_bias(module: str, shape: tuple[int, ...], kind: str = "bf16") -> list[Param]:
        return [Param(module, shape, kind), Param(module, (shape[0],), "norm-bias")]

    h, merged = VT_HIDDEN, VT_HIDDEN * 4  # the projector reads 2x2 merged patches
    vt = "vision_tower"
    groups = [with_bias(f"{vt}.patch_embed.proj", (h, 3, VT_PATCH, VT_PATCH))
              + [Param(f"{vt}.patch_embed.pos_emb", (VT_POS, VT_POS, h), "bf16")]]
    for b in range(VT_BLOCKS):
        p = f"{vt}.encoder.blocks.{b}"
        groups.append(with_bias(f"{p}.norm0", (h,), "norm") + with_bias(f"{p}.wqkv", (3 * h, h))
                      + with_bias(f"{p}.wo", (h, h)) + with_bias(f"{p}.norm1", (h,), "norm")
                      + with_bias(f"{p}.mlp.fc0", (VT_INTERMEDIATE, h)) + with_bias(f"{p}.mlp.fc1", (h, VT_INTERMEDIATE)))
    groups.append(with_bias(f"{vt}.encoder.final_layernorm", (h,), "norm")
                  + with_bias("mm_projector.pre_norm", (h,), "norm") + with_bias("mm_projector.proj.0", (merged, merged))
                  + with_bias("mm_projector.proj.2", (text_hidden, merged)))
    return groups


def tensor_specs(spec: SynthSpec) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Every stored tensor of the checkpoint: name -> (shape, dtype), without generating data."""
    return {name: sd for group in plan_groups(spec) for p in group for name, sd in p.tensors().items()}


def _generator(spec: SynthSpec, name: str) -> torch.Generator:
    # Seeded per tensor, so a tensor's bytes do not depend on shard layout or generation order.
    digest = hashlib.sha256(f"{spec.seed}:{name}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))


def _random_uint8(shape: tuple[int, ...], g: torch.Generator, low: int = 0, high: int = 256) -> torch.Tensor:
    n = torch.Size(shape).numel()
    if (low, high) == (0, 256):  # int32 draws give 4 bytes per RNG call: ~3x faster for GBs.
        words = torch.randint(-(2**31), 2**31 - 1, (ceil_div(n, 4),), dtype=torch.int32, generator=g)
        return words.view(torch.uint8)[:n].reshape(shape).clone()
    return torch.randint(low, high, shape, dtype=torch.uint8, generator=g)


def _materialize(spec: SynthSpec, p: Param) -> dict[str, torch.Tensor]:
    g = _generator(spec, p.module + ("#bias" if p.kind in ("bias", "norm-bias") else ""))
    names = list(p.tensors())
    if p.kind == "norm":
        return {names[0]: (1.0 + 0.05 * torch.randn(p.shape, generator=g)).to(torch.bfloat16)}
    if p.kind == "bias":
        return {names[0]: 0.01 * torch.randn(p.shape, generator=g)}
    if p.kind == "norm-bias":
        return {names[0]: (0.01 * torch.randn(p.shape, generator=g)).to(torch.bfloat16)}
    if p.kind == "bf16":
        out = torch.empty(p.shape, dtype=torch.bfloat16)
        for rows in _row_blocks(p.shape):
            out[rows] = (0.02 * torch.randn(out[rows].shape, generator=g)).to(torch.bfloat16)
        return {names[0]: out}
    n, k = p.shape
    if p.kind == "fp8-block":  # per 128x128 block: scale_inv = block amax / 448, codes nearest even
        w = torch.empty((n, k), dtype=torch.float8_e4m3fn)
        nb, kb = ceil_div(n, FP8_BLOCK), ceil_div(k, FP8_BLOCK)
        scale = torch.empty((nb, kb), dtype=torch.float32)
        for r in range(nb):  # a band of 128 rows at a time: blocks never span bands
            rows = slice(r * FP8_BLOCK, min(n, (r + 1) * FP8_BLOCK))
            x = (0.02 * torch.randn((rows.stop - rows.start, k), generator=g)).to(torch.bfloat16).float()
            for c in range(kb):
                cols = slice(c * FP8_BLOCK, min(k, (c + 1) * FP8_BLOCK))
                s = (x[:, cols].abs().amax() / FP8_MAX).clamp_min(1e-12)
                w[rows, cols] = (x[:, cols] / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
                scale[r, c] = s
        return {names[0]: w, names[1]: scale}
    if p.kind == "fp8":  # per output channel: scale = row amax / 448, codes rounded to nearest even
        w = torch.empty((n, k), dtype=torch.float8_e4m3fn)
        scale = torch.empty((n,), dtype=torch.float32)
        for rows in _row_blocks((n, k)):
            x = (0.02 * torch.randn((rows.stop - rows.start, k), generator=g)).to(torch.bfloat16).float()
            s = (x.abs().amax(dim=1) / FP8_MAX).clamp_min(1e-12)
            w[rows] = (x / s[:, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
            scale[rows] = s
        return {names[0]: w, names[1]: scale}
    if spec.random_bytes:
        return {names[0]: _random_uint8((n, k // 2), g), names[1]: _random_uint8((n, ceil_div(k, 32)), g, 118, 127)}
    # Rows spread over 2^-2..2^2 so scale bytes vary across rows, as in trained weights.
    row_scale = torch.exp2(4.0 * torch.rand((n, 1), generator=g) - 2.0)
    packed = torch.empty((n, k // 2), dtype=torch.uint8)
    scale = torch.empty((n, ceil_div(k, 32)), dtype=torch.uint8)
    for rows in _row_blocks((n, k)):  # MXFP4 blocks run along rows: a block of rows quantizes alone
        w = (0.02 * torch.randn((rows.stop - rows.start, k), generator=g) * row_scale[rows]).to(torch.bfloat16)
        packed[rows], scale[rows] = layouts.mxfp4.quantize(w, layouts.mxfp4.QUARK)  # bytes as Quark's exporter writes them
    return {names[0]: packed, names[1]: scale}


def _row_blocks(shape: tuple[int, ...], block_bytes: int = 64 << 20) -> list[slice]:
    """Blocks of whole rows of about ``block_bytes`` of float32: drawing a tensor at once held it
    several times over in float32 (9.3 GB for the real-dims preset's 1.8 GiB embedding)."""
    if len(shape) < 2:
        return [slice(0, shape[0] if shape else 1)]
    per_row = 4 * math.prod(shape[1:])
    step = max(1, block_bytes // per_row)
    return [slice(r, min(shape[0], r + step)) for r in range(0, shape[0], step)]
